// Presence with realtime-js: A and B join a channel with presence keys; each tracks itself;
// each must see both in its presence state; then A leaves (its socket closes without an
// untrack) and B must see A's leave. Prints one JSON line. Run by
// crates/shoal/tests/realtime.rs with RT_URL, RT_TOKEN and RT_VSN (B's protocol version).
import { RealtimeClient } from '@supabase/realtime-js'
import WebSocket from 'ws'

const url = process.env.RT_URL
const token = process.env.RT_TOKEN
const vsn = process.env.RT_VSN || '2.0.0'
const timeout = (ms, what) =>
  new Promise((_, reject) => setTimeout(() => reject(new Error(`timed out: ${what}`)), ms))

const client = (version) =>
  new RealtimeClient(url, { params: { apikey: token }, transport: WebSocket, vsn: version })

function until(check) {
  return new Promise((resolve) => {
    const tick = () => (check() ? resolve() : setTimeout(tick, 20))
    tick()
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
const chA = a.channel('lobby', { config: { presence: { key: 'alice' } } })
const chB = b.channel('lobby', { config: { presence: { key: 'bob' } } })
const leftOfB = []
chA.on('presence', { event: 'sync' }, () => {})
chB.on('presence', { event: 'sync' }, () => {})
chB.on('presence', { event: 'leave' }, ({ key }) => leftOfB.push(key))
try {
  await Promise.race([Promise.all([subscribe(chA), subscribe(chB)]), timeout(10000, 'subscribe')])
  const tracked = [await chA.track({ name: 'Alice' }), await chB.track({ name: 'Bob' })]
  const both = () => (s) => Object.keys(s).sort().join(',') === 'alice,bob'
  await Promise.race([
    until(() => both()(chA.presenceState()) && both()(chB.presenceState())),
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
