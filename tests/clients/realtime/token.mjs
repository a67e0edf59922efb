// Tokens on channels with realtime-js: a channel joined with a short-lived token is shut
// when it expires, a refresh keeps a channel, and a bad refresh closes it; each shutdown
// comes with Realtime's `system` message. Prints one line of JSON.
import { client, until, timeout } from './lib.mjs'

const short = process.env.RT_SHORT_TOKEN
const other = process.env.RT_OTHER_TOKEN
const bad = process.env.RT_BAD_TOKEN

/// Subscribes `channel`, recording every status and system message it sees.
const watch = (channel) => {
  const seen = { statuses: [], system: [], got: [] }
  channel.on('system', {}, (m) => seen.system.push(m))
  channel.on('broadcast', { event: 'e' }, (m) => seen.got.push(m.payload))
  channel.subscribe((status) => seen.statuses.push(status))
  return seen
}

const run = async () => {
  const out = {}
  // A channel on a token that expires in a few seconds.
  const c1 = client()
  await c1.setAuth(short)
  const expiring = watch(c1.channel('expiring'))
  await until(() => expiring.statuses.includes('SUBSCRIBED'))
  await until(() => expiring.statuses.includes('CLOSED'))
  out.expired = { statuses: expiring.statuses, system: expiring.system }

  // A refresh keeps the channel; a bad one closes it.
  const c2 = client()
  const sender = client()
  const ch = c2.channel('refresh')
  const seen = watch(ch)
  const tx = sender.channel('refresh', { config: { broadcast: { ack: true } } })
  const txSeen = watch(tx)
  await until(() => seen.statuses.includes('SUBSCRIBED') && txSeen.statuses.includes('SUBSCRIBED'))
  await c2.setAuth(other)
  out.ack = await tx.send({ type: 'broadcast', event: 'e', payload: { n: 1 } })
  await until(() => seen.got.length === 1)
  await c2.setAuth(bad)
  await until(() => seen.statuses.includes('CLOSED'))
  out.refused = { statuses: seen.statuses, system: seen.system, got: seen.got }
  for (const c of [c1, c2, sender]) c.disconnect()
  console.log(JSON.stringify(out))
  process.exit(0)
}

Promise.race([run(), timeout(30000, 'token.mjs')]).catch((e) => {
  console.log(JSON.stringify({ error: String(e) }))
  process.exit(1)
})
