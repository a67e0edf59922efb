// Presence with realtime-js: A and B join a channel with presence keys; each tracks itself;
// each must see both in its presence state; then A leaves (its socket closes without an
// untrack) and B must see A's leave. Prints one JSON line. Run by
// crates/shoal/tests/realtime.rs with RT_URL, RT_TOKEN and RT_VSN (B's protocol version).
import { client, subscribe, timeout, until } from './lib.mjs'

const a = client('2.0.0')
const b = client(process.env.RT_VSN || '2.0.0')
const chA = a.channel('lobby', { config: { presence: { key: 'alice' } } })
const chB = b.channel('lobby', { config: { presence: { key: 'bob' } } })
const leftOfB = []
chA.on('presence', { event: 'sync' }, () => {})
chB.on('presence', { event: 'sync' }, () => {})
chB.on('presence', { event: 'leave' }, ({ key }) => leftOfB.push(key))
const both = (state) => Object.keys(state).sort().join(',') === 'alice,bob'
try {
  await Promise.all([subscribe(chA), subscribe(chB)])
  const tracked = [await chA.track({ name: 'Alice' }), await chB.track({ name: 'Bob' })]
  await Promise.race([
    until(() => both(chA.presenceState()) && both(chB.presenceState())),
    timeout(10000, 'both present'),
  ])
  const seenByB = chB.presenceState()
  a.disconnect()
  await Promise.race([until(() => leftOfB.includes('alice')), timeout(10000, 'leave seen')])
  console.log(JSON.stringify({ tracked, seenByB, leftOfB, after: Object.keys(chB.presenceState()) }))
} catch (e) {
  console.log(JSON.stringify({ error: String(e), a: chA.presenceState(), b: chB.presenceState() }))
} finally {
  a.disconnect()
  b.disconnect()
  setTimeout(() => process.exit(0), 100)
}
