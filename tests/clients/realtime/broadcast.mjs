// Two realtime-js clients on one channel: each subscribes, one broadcasts (with `self`
// and `ack`), and the script prints what each saw as one JSON line. Run by
// crates/shoal/tests/realtime.rs with RT_URL (the endpoint, without /websocket),
// RT_TOKEN (a tenant JWT) and RT_VSN (1.0.0 or 2.0.0 for the second client).
import { RealtimeClient } from '@supabase/realtime-js'
import WebSocket from 'ws'

const url = process.env.RT_URL
const token = process.env.RT_TOKEN
const vsn = process.env.RT_VSN || '2.0.0'
const timeout = (ms, what) =>
  new Promise((_, reject) => setTimeout(() => reject(new Error(`timed out: ${what}`)), ms))

function client(version) {
  return new RealtimeClient(url, {
    params: { apikey: token },
    transport: WebSocket,
    vsn: version,
    heartbeatIntervalMs: 2000,
  })
}

function subscribe(channel) {
  return new Promise((resolve, reject) => {
    channel.subscribe((status, err) => {
      if (status === 'SUBSCRIBED') resolve(status)
      else if (status === 'CHANNEL_ERROR' || status === 'TIMED_OUT') reject(new Error(`${status} ${err ?? ''}`))
    })
  })
}

const a = client('2.0.0')
const b = client(vsn)
const seenByA = []
const seenByB = []
const chA = a.channel('room', { config: { broadcast: { self: true, ack: true } } })
const chB = b.channel('room')
const bGot = new Promise((resolve) => {
  chB.on('broadcast', { event: 'greeting' }, (m) => {
    seenByB.push(m)
    resolve()
  })
})
const aGot = new Promise((resolve) => {
  chA.on('broadcast', { event: 'greeting' }, (m) => {
    seenByA.push(m)
    resolve()
  })
})
try {
  await Promise.race([Promise.all([subscribe(chA), subscribe(chB)]), timeout(10000, 'subscribe')])
  const ack = await chA.send({ type: 'broadcast', event: 'greeting', payload: { text: 'héllo', n: 1 } })
  await Promise.race([Promise.all([aGot, bGot]), timeout(10000, 'broadcast')])
  console.log(JSON.stringify({ ack, seenByA, seenByB }))
} catch (e) {
  console.log(JSON.stringify({ error: String(e) }))
} finally {
  a.disconnect()
  b.disconnect()
  setTimeout(() => process.exit(0), 100)
}
