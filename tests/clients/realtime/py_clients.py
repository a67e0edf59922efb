"""Supabase's Python client (`realtime` 2.34.1, protocol 1.0 JSON) against Shoal.

Two clients join one channel: a broadcast with `self` and `ack`, presence join and the
leave of a client that drops without leaving, a broadcast over HTTP, a token refresh that
keeps the channel, and a bad token that closes it. Prints one line of JSON.
"""

import asyncio
import json
import os

from realtime import AsyncRealtimeClient

if os.environ.get("RT_DEBUG"):
    import logging

    logging.basicConfig(level=logging.DEBUG)

URL = os.environ["RT_URL"]
TOKEN = os.environ["RT_TOKEN"]
OTHER = os.environ["RT_OTHER_TOKEN"]
BAD = os.environ["RT_BAD_TOKEN"]


async def until(check, what, secs=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + secs
    while not check():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out: {what}")
        await asyncio.sleep(0.02)


async def main():
    out = {}
    a = AsyncRealtimeClient(URL, TOKEN, auto_reconnect=False, hb_interval=2)
    b = AsyncRealtimeClient(URL, TOKEN, auto_reconnect=False, hb_interval=2)
    await a.connect()
    await b.connect()
    seen_a, seen_b, pokes, errors = [], [], [], []
    statuses = {"a": [], "b": []}
    joins, leaves = [], []
    ca = a.channel(
        "room",
        {"config": {"broadcast": {"self": True, "ack": True}, "presence": {"key": "alice"}}},
    )
    ca.on_broadcast("greeting", lambda m: seen_a.append(m["payload"]))
    cb = b.channel("room", {"config": {"presence": {"key": "bob"}}})
    cb.on_broadcast("greeting", lambda m: seen_b.append(m["payload"]))
    cb.on_broadcast("poke", lambda m: pokes.append(m["payload"]))
    cb.on_presence_join(lambda key, cur, new: joins.append(key))
    cb.on_presence_leave(lambda key, cur, left: leaves.append(key))
    await ca.subscribe(lambda s, e: statuses["a"].append(s.value))

    def on_b(status, error):
        statuses["b"].append(status.value)
        if error is not None:
            errors.append(str(error))

    await cb.subscribe(on_b)
    out["subscribed"] = [statuses["a"][-1], statuses["b"][-1]]

    await ca.send_broadcast("greeting", {"text": "héllo", "n": 1})
    await until(lambda: seen_a and seen_b, "broadcast to both")
    out["seenByA"], out["seenByB"] = seen_a, seen_b

    await ca.track({"name": "Alice"})
    await until(lambda: "alice" in cb.presence_state(), "alice present")
    out["presentToB"] = sorted(cb.presence_state())
    out["joins"] = sorted(set(joins))
    # `a` drops: its socket closes without a phx_leave.
    await a.close()
    await until(lambda: "alice" in leaves, "alice's leave")
    out["leaves"] = leaves

    await cb.http_send("poke", {"n": 7})
    await until(lambda: pokes, "the HTTP broadcast")
    # A fresh token keeps the channel: a later broadcast still arrives.
    await b.set_auth(OTHER)
    await cb.http_send("poke", {"n": 8})
    await until(lambda: len(pokes) == 2, "a broadcast after the refresh")
    out["pokes"] = pokes
    # A token the tenant did not sign closes it, saying why (the client reports an error
    # `system` message as a channel error).
    await b.set_auth(BAD)
    await until(lambda: "CLOSED" in statuses["b"], "the channel closing")
    out["statusesOfB"] = statuses["b"]
    out["errors"] = errors
    await b.close()
    print(json.dumps(out))


asyncio.run(asyncio.wait_for(main(), 60))
