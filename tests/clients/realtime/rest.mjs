// Broadcast over HTTP with realtime-js: A subscribes to a channel; B, never subscribed,
// sends to it with httpSend() (one message) and with send() (which falls back to the batch
// endpoint); A must get both. Prints one JSON line. Run by crates/shoal/tests/realtime.rs
// with RT_URL and RT_TOKEN.
import { client, subscribe, timeout } from './lib.mjs'

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
// send() warns that it falls back to REST: expected here.
console.warn = () => {}
try {
  await subscribe(chA)
  const chB = b.channel('room')
  const single = await chB.httpSend('poke', { n: 7 })
  const batch = await chB.send({ type: 'broadcast', event: 'batch', payload: { m: 1 } })
  await Promise.race([both, timeout(10000, 'both delivered')])
  got.sort((x, y) => x.event.localeCompare(y.event))
  console.log(JSON.stringify({ single, batch, got }))
} catch (e) {
  console.log(JSON.stringify({ error: String(e), got }))
} finally {
  a.disconnect()
  b.disconnect()
  setTimeout(() => process.exit(0), 100)
}
