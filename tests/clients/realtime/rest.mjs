// Broadcast over HTTP with realtime-js: A subscribes to a channel; B, never subscribed,
// sends to it with httpSend() (one message) and with send() (which falls back to the batch
// endpoint); A must get both. Prints one JSON line. Run by crates/shoal/tests/realtime.rs
// with RT_URL and RT_TOKEN.
import { RealtimeClient } from '@supabase/realtime-js'
import WebSocket from 'ws'

const url = process.env.RT_URL
const token = process.env.RT_TOKEN
const timeout = (ms, what) =>
  new Promise((_, reject) => setTimeout(() => reject(new Error(`timed out: ${what}`)), ms))
const client = () => new RealtimeClient(url, { params: { apikey: token }, transport: WebSocket })

const a = client()
const b = client()
const got = []
const chA = a.channel('room')
const both = new Promise((resolve) => {
  chA.on('broadcast', { event: '*' }, (m) => {
    got.push({ event: m.event, payload: m.payload })
    if (got.length === 2) resolve()
  })
})
const origWarn = console.warn
console.warn = () => {}
try {
  await Promise.race([
    new Promise((resolve, reject) =>
      chA.subscribe((s, e) => (s === 'SUBSCRIBED' ? resolve() : s !== 'CLOSED' && reject(new Error(`${s} ${e ?? ''}`))))
    ),
    timeout(10000, 'subscribe'),
  ])
  const chB = b.channel('room')
  const single = await chB.httpSend('poke', { n: 7 })
  const batch = await chB.send({ type: 'broadcast', event: 'batch', payload: { m: 1 } })
  await Promise.race([both, timeout(10000, 'both delivered')])
  got.sort((x, y) => x.event.localeCompare(y.event))
  console.log(JSON.stringify({ single, batch, got }))
} catch (e) {
  console.log(JSON.stringify({ error: String(e), got }))
} finally {
  console.warn = origWarn
  a.disconnect()
  b.disconnect()
  setTimeout(() => process.exit(0), 100)
}
