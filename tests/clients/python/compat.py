#!/usr/bin/env python3
"""Compatibility check of Shoal's transaction mode with real Python drivers.

Many concurrent workers (more than the pool has servers) use psycopg 3 with server-side
prepared statements (prepare_threshold=0) and asyncpg with its statement cache, exercising
prepared statements, pipelined queries, transactions, errors, SET LOCAL and COPY, then
LISTEN/NOTIFY (one listener, every worker notifying), verifying every result. Prints one line per driver and exits non-zero on the first wrong result.

Usage: compat.py DSN [WORKERS]
"""

import asyncio
import sys

import asyncpg
import psycopg


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def psycopg_worker(dsn, w, rounds):
    async with await psycopg.AsyncConnection.connect(dsn, prepare_threshold=0, autocommit=True) as conn:
        for i in range(rounds):
            k = w * 10_000 + i
            # Prepared (named) statements, reused across transactions on any server.
            cur = await conn.execute("SELECT %s::int * 2, %s::text", (k, f"w{w}"))
            check(await cur.fetchone() == (k * 2, f"w{w}"), "psycopg prepared select")
            async with conn.transaction():
                await conn.execute("SET LOCAL statement_timeout = '5s'")
                await conn.execute("INSERT INTO compat (k, v, driver) VALUES (%s, %s, 'psycopg')", (k, f"v{k}"))
                cur = await conn.execute("SELECT v FROM compat WHERE k = %s AND driver = 'psycopg'", (k,))
                check(await cur.fetchone() == (f"v{k}",), "psycopg read own write")
                cur = await conn.execute("SELECT current_setting('statement_timeout')")
                check((await cur.fetchone())[0] == "5s", "psycopg SET LOCAL")
            # An error inside a transaction rolls it back and the connection goes on.
            try:
                async with conn.transaction():
                    await conn.execute("INSERT INTO compat (k, v, driver) VALUES (%s, 'dup', 'psycopg')", (k,))
                check(False, "psycopg duplicate key must fail")
            except psycopg.errors.UniqueViolation:
                pass
            # Pipelining.
            async with conn.pipeline():
                curs = [await conn.execute("SELECT %s::int", (k + j,)) for j in range(5)]
            vals = [(await c.fetchone())[0] for c in curs]
            check(vals == [k + j for j in range(5)], "psycopg pipeline order")
        # COPY in and out.
        async with conn.transaction():
            async with conn.cursor().copy("COPY compat (k, v, driver) FROM STDIN") as copy:
                for j in range(50):
                    await copy.write_row((10_000_000 + w * 100 + j, "copied", "psycopg-copy"))
        cur = conn.cursor()
        rows = []
        async with cur.copy(f"COPY (SELECT k FROM compat WHERE driver = 'psycopg-copy' AND k / 100 = {100_000 + w}) TO STDOUT") as copy:
            async for row in copy.rows():
                rows.append(int(row[0]))
        check(len(rows) == 50, f"psycopg copy out: {len(rows)}")


async def asyncpg_worker(dsn, w, rounds):
    conn = await asyncpg.connect(dsn)  # statement cache on (asyncpg's default)
    try:
        # A session SET holds across transactions (which run on different servers).
        await conn.execute(f"SET application_name = 'asyncpg-{w}'")
        named = await conn.prepare("SELECT $1::int + 1", name=f"compat_{w}")
        check(named.get_name() == f"compat_{w}", "asyncpg explicitly named statement")
        for i in range(rounds):
            k = w * 10_000 + i
            # SQL EXECUTE of the named statement, sent by asyncpg as a prepared statement.
            check(await conn.fetchval(f"EXECUTE compat_{w}({k})") == k + 1, "asyncpg SQL EXECUTE")
            check(await conn.fetchval("SELECT $1::int * 3", k) == k * 3, "asyncpg cached statement")
            stmt = await conn.prepare("SELECT v FROM compat WHERE k = $1 AND driver = $2")
            async with conn.transaction():
                await conn.execute("INSERT INTO compat (k, v, driver) VALUES ($1, $2, 'asyncpg')", k, f"a{k}")
                check(await stmt.fetchval(k, "asyncpg") == f"a{k}", "asyncpg prepared in transaction")
            check(await stmt.fetchval(k, "asyncpg") == f"a{k}", "asyncpg prepared after transaction")
            try:
                await conn.execute("INSERT INTO compat (k, v, driver) VALUES ($1, 'dup', 'asyncpg')", k)
                check(False, "asyncpg duplicate key must fail")
            except asyncpg.UniqueViolationError:
                pass
            rows = await conn.fetch("SELECT g FROM generate_series(1, $1::int) g", 20)
            check([r[0] for r in rows] == list(range(1, 21)), "asyncpg rows")
            check(await conn.fetchval("SELECT current_setting('application_name')") == f"asyncpg-{w}",
                  "asyncpg SET held")
        # Cancel: a statement_timeout (server-side cancel) surfaces as QueryCanceledError.
        try:
            async with conn.transaction():
                await conn.execute("SET LOCAL statement_timeout = '50ms'")
                await conn.execute("SELECT pg_sleep(5)")
            check(False, "asyncpg timeout must fail")
        except asyncpg.QueryCanceledError:
            pass
        check(await conn.fetchval("SELECT 1") == 1, "asyncpg goes on after cancel")
        # Client-side cancel: asyncpg sends a CancelRequest when the wait is abandoned.
        try:
            await asyncio.wait_for(conn.execute("SELECT pg_sleep(5)"), 0.2)
            check(False, "asyncpg wait_for must time out")
        except asyncio.TimeoutError:
            pass
        check(await conn.fetchval("SELECT 2") == 2, "asyncpg goes on after a client cancel")
        await conn.copy_records_to_table("compat", records=[(20_000_000 + w * 100 + j, "c", "asyncpg-copy") for j in range(30)],
                                         columns=["k", "v", "driver"])
        check(await conn.fetchval("SELECT count(*) FROM compat WHERE driver = 'asyncpg-copy' AND k / 100 = $1", 200_000 + w) == 30,
              "asyncpg copy")
    finally:
        await conn.close()


async def psycopg_notify(dsn, senders):
    """LISTEN on one connection while others notify through the same pool (transaction mode)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute("LISTEN compat_psycopg")
        own = []
        listener.add_notify_handler(own.append)
        # Its own notification arrives before its statement completes, with its own pid.
        await listener.execute("NOTIFY compat_psycopg, 'self'")
        check([(n.payload, n.pid) for n in own] == [("self", listener.pgconn.backend_pid)],
              f"psycopg own notification: {own}")
        listener.remove_notify_handler(own.append)
        pids = {}

        async def send(w):
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
                pids[w] = c.pgconn.backend_pid
                for i in range(10):
                    await c.execute("SELECT pg_notify('compat_psycopg', %s)", (f"{w}:{i}",))

        await asyncio.gather(*(send(w) for w in range(senders)))
        got = [n async for n in listener.notifies(timeout=20, stop_after=senders * 10)]
        check(sorted(n.payload for n in got) == sorted(f"{w}:{i}" for w in range(senders) for i in range(10)),
              f"psycopg notifications: {len(got)} of {senders * 10}")
        check(all(n.pid == pids[int(n.payload.split(':')[0])] for n in got), "psycopg sender pids")
        await listener.execute("UNLISTEN compat_psycopg")


async def asyncpg_notify(dsn, senders):
    """asyncpg's add_listener while others notify through the same pool (transaction mode)."""
    con = await asyncpg.connect(dsn)
    q = asyncio.Queue()
    await con.add_listener("compat_asyncpg", lambda c, pid, ch, payload: q.put_nowait((pid, payload)))
    await con.execute("NOTIFY compat_asyncpg, 'self'")
    check(await asyncio.wait_for(q.get(), 5) == (con.get_server_pid(), "self"), "asyncpg own notification")

    async def send(w):
        c = await asyncpg.connect(dsn)
        for i in range(10):
            await c.execute("SELECT pg_notify('compat_asyncpg', $1)", f"{w}:{i}")
        pid = c.get_server_pid()
        await c.close()
        return pid

    pids = await asyncio.gather(*(send(w) for w in range(senders)))
    got = [await asyncio.wait_for(q.get(), 20) for _ in range(senders * 10)]
    check(sorted(p for _, p in got) == sorted(f"{w}:{i}" for w in range(senders) for i in range(10)),
          "asyncpg notifications")
    check(all(pid == pids[int(p.split(':')[0])] for pid, p in got), "asyncpg sender pids")
    await con.close()


async def main():
    dsn = sys.argv[1]
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rounds = 15
    setup = await asyncpg.connect(dsn, statement_cache_size=0)
    await setup.execute("CREATE TABLE IF NOT EXISTS compat (k bigint, v text, driver text, PRIMARY KEY (k, driver))")
    await setup.close()
    await asyncio.gather(*(psycopg_worker(dsn, w, rounds) for w in range(workers)))
    print(f"psycopg {psycopg.__version__}: {workers} workers x {rounds} rounds OK")
    await asyncio.gather(*(asyncpg_worker(dsn, w, rounds) for w in range(workers)))
    print(f"asyncpg {asyncpg.__version__}: {workers} workers x {rounds} rounds OK")
    await psycopg_notify(dsn, workers)
    print(f"psycopg: LISTEN/NOTIFY with {workers} senders OK")
    await asyncpg_notify(dsn, workers)
    print(f"asyncpg: LISTEN/NOTIFY with {workers} senders OK")


if __name__ == "__main__":
    asyncio.run(main())
