// Postgres Changes through realtime-js: subscribes to `notes` (every event, and INSERTs
// with a filter), says so on a line of its own, then prints what arrives once RT_EXPECT
// changes have (or after 10 s).
import { client, subscribe, timeout, until } from './lib.mjs'

const c = client(process.env.RT_VSN ?? '2.0.0')
const all = []
const filtered = []
const channel = c
  .channel('db-notes')
  .on('postgres_changes', { event: '*', schema: 'public', table: 'notes' }, (p) => all.push(p))
  .on(
    'postgres_changes',
    { event: 'INSERT', schema: 'public', table: 'notes', filter: 'id=eq.2' },
    (p) => filtered.push(p),
  )
await subscribe(channel)
console.log(JSON.stringify({ subscribed: true }))
const expect = Number(process.env.RT_EXPECT ?? '1')
await Promise.race([until(() => all.length >= expect), timeout(10000, 'changes')]).catch(() => {})
console.log(JSON.stringify({ all, filtered }))
c.disconnect()
process.exit(0)
