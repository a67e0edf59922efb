// A private channel through realtime-js: joins `room:alice` with `private: true`, says on a
// line of its own whether it was let in, then prints the broadcasts from the database it
// gets (RT_EXPECT of them, or after 10 s).
import { client, subscribe, timeout, until } from './lib.mjs'

const c = client(process.env.RT_VSN ?? '2.0.0')
await c.setAuth(process.env.RT_TOKEN)
const got = []
const channel = c
  .channel('room:alice', { config: { private: true } })
  .on('broadcast', { event: 'note' }, (m) => got.push(m.payload))
try {
  await subscribe(channel)
} catch (e) {
  console.log(JSON.stringify({ subscribed: false, error: String(e.message ?? e) }))
  c.disconnect()
  process.exit(0)
}
console.log(JSON.stringify({ subscribed: true }))
const expect = Number(process.env.RT_EXPECT ?? '1')
await Promise.race([until(() => got.length >= expect), timeout(10000, 'notes')]).catch(() => {})
console.log(JSON.stringify({ got }))
c.disconnect()
process.exit(0)
