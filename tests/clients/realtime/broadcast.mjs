// Two realtime-js clients on one channel: each subscribes, one broadcasts (with `self`
// and `ack`), and the script prints what each saw as one JSON line. Run by
// crates/shoal/tests/realtime.rs with RT_URL (the endpoint, without /websocket),
// RT_TOKEN (a tenant JWT) and RT_VSN (1.0.0 or 2.0.0 for the second client).
import { client, subscribe, timeout } from './lib.mjs'

const a = client('2.0.0')
const b = client(process.env.RT_VSN || '2.0.0')
const seenByA = []
const seenByB = []
const chA = a.channel('room', { config: { broadcast: { self: true, ack: true } } })
const chB = b.channel('room')
const heard = (list, channel) =>
  new Promise((resolve) =>
    channel.on('broadcast', { event: 'greeting' }, (m) => {
      list.push(m)
      resolve()
    })
  )
const aGot = heard(seenByA, chA)
const bGot = heard(seenByB, chB)
try {
  await Promise.all([subscribe(chA), subscribe(chB)])
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
