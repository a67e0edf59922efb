// A client that drops and comes back: realtime-js with `params.resume`, reaching Shoal
// through a TCP relay that this script breaks on cue: RT_CUT=cut closes both sides, as a
// restarted proxy would; RT_CUT=freeze stops forwarding without closing, as a network
// that drops everything would (the client finds out by its heartbeat, Shoal not at all,
// and the frames it writes meanwhile are lost on the way). Another client broadcasts throughout and watches the first one's presence; the
// test writes rows before and during the cut. RT_RESUME=0 connects without `resume` (the
// control: the same cut loses messages and shows a presence leave).
//
// Lines out: {"subscribed":true}, then {"cut":true} once the relay is cut, then the
// result. Lines in: "go" (after each of the test's writes).
import net from 'node:net'
import readline from 'node:readline'
import { RealtimeClient } from '@supabase/realtime-js'
import WebSocket from 'ws'
import { subscribe, timeout, until } from './lib.mjs'

const shoal = new URL(process.env.RT_URL.replace(/^ws/, 'http'))
const rows = Number(process.env.RT_ROWS)
const messages = 300
const mode = process.env.RT_CUT ?? 'cut'
const resume = process.env.RT_RESUME !== '0'

const input = readline.createInterface({ input: process.stdin })
const lines = input[Symbol.asyncIterator]()
const go = async () => {
  const { value } = await lines.next()
  if (value !== 'go') throw new Error(`expected go, got ${value}`)
}

// The relay: every connection piped to Shoal; `cut()` breaks all of them at once.
const conns = []
const relay = net.createServer((client) => {
  const up = net.connect(Number(shoal.port), shoal.hostname)
  client.pipe(up)
  up.pipe(client)
  const drop = () => {
    client.destroy()
    up.destroy()
  }
  client.on('error', drop)
  up.on('error', drop)
  const freeze = () => {
    // Nothing passes either way from now; Shoal's side stays open, the client's side
    // closes when the client gives up on it.
    client.unpipe(up)
    up.unpipe(client)
    up.pause()
    up.removeListener('error', drop)
    up.on('error', () => {})
    client.on('close', () => client.destroy())
  }
  conns.push(mode === 'freeze' ? freeze : drop)
})
await new Promise((r) => relay.listen(0, '127.0.0.1', r))
const cut = () => conns.splice(0).forEach((f) => f())

const params = { apikey: process.env.RT_TOKEN }
if (resume) params.resume = `resume-${process.pid}-${Date.now()}`
const url = `ws://127.0.0.1:${relay.address().port}${shoal.pathname}`
const receiver = new RealtimeClient(url, { params, transport: WebSocket, heartbeatIntervalMs: 1000 })
const sender = new RealtimeClient(process.env.RT_URL, {
  params: { apikey: process.env.RT_TOKEN },
  transport: WebSocket,
  heartbeatIntervalMs: 1000,
})

const seen = []
const ids = []
const room = receiver
  .channel('room', { config: { presence: { key: 'r' } } })
  .on('broadcast', { event: 'n' }, (m) => seen.push(m.payload.seq))
const db = receiver
  .channel('db')
  .on('postgres_changes', { event: 'INSERT', schema: 'public', table: 'notes' }, (p) => ids.push(p.new.id))
let leaves = 0
const out = sender
  .channel('room', { config: { presence: { key: 's' } } })
  .on('presence', { event: 'leave' }, ({ key }) => {
    if (key === 'r') leaves += 1
  })
await subscribe(room)
await subscribe(db)
await subscribe(out)
await room.track({ who: 'receiver' })
await until(() => Object.keys(out.presenceState()).includes('r'))
console.log(JSON.stringify({ subscribed: true }))
await go()

// Broadcasts every 10 ms, across the cut and the way back.
const sending = (async () => {
  for (let seq = 0; seq < messages; seq++) {
    await out.send({ type: 'broadcast', event: 'n', payload: { seq } })
    await new Promise((r) => setTimeout(r, 10))
  }
})()
await until(() => seen.length >= 20)
cut()
console.log(JSON.stringify({ cut: true }))
await go()
await sending
// With resume, the replay can arrive before the rejoin's reply: wait for that too.
const all = () =>
  new Set(seen).size >= messages && new Set(ids).size >= rows && (!resume || room.state === 'joined')
await Promise.race([until(all), timeout(15000, 'everything')]).catch(() => {})
const missing = [...Array(messages).keys()].filter((n) => !seen.includes(n))
console.log(
  JSON.stringify({
    received: seen.length,
    missing: missing.length,
    twice: seen.length - new Set(seen).size,
    ids: [...new Set(ids)].sort((a, b) => a - b),
    leaves,
    rejoined: room.state,
  }),
)
receiver.disconnect()
sender.disconnect()
process.exit(0)
