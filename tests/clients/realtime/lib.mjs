// What the realtime-js scripts share: a client on RT_URL with RT_TOKEN, subscribing, and
// waiting with a deadline.
import { RealtimeClient } from '@supabase/realtime-js'
import WebSocket from 'ws'

export const url = process.env.RT_URL
export const token = process.env.RT_TOKEN

export const client = (vsn = '2.0.0') =>
  new RealtimeClient(url, { params: { apikey: token }, transport: WebSocket, vsn, heartbeatIntervalMs: 2000 })

export const timeout = (ms, what) =>
  new Promise((_, reject) => setTimeout(() => reject(new Error(`timed out: ${what}`)), ms))

/// Resolves once `check()` holds, looking every 20 ms.
export const until = (check) =>
  new Promise((resolve) => {
    const tick = () => (check() ? resolve() : setTimeout(tick, 20))
    tick()
  })

/// Resolves when the channel is SUBSCRIBED; rejects on an error, a timeout or a close.
export const subscribe = (channel) =>
  Promise.race([
    new Promise((resolve, reject) => {
      channel.subscribe((status, err) => {
        if (status === 'SUBSCRIBED') resolve(status)
        else reject(new Error(`${status} ${err ?? ''}`))
      })
    }),
    timeout(10000, 'subscribe'),
  ])
