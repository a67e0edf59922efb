// One client's latency per operation, for bench/serverless: MODE is
//   tcp-warm   a query on an open node-postgres connection (TARGET: host:port)
//   tcp-new    a new node-postgres connection, a query, its end
//   http       a one-shot query with Neon's neon() (TARGET: the front door's host:port)
//   http-raw   the same request as `http` by fetch alone (no driver)
//   http-floor a request the front door answers 400 at once: the HTTP client's and
//              server's own cost, the floor of any HTTP query
//   ws-new     a new WebSocket Client of Neon's driver, a query, its end
// Usage: node latency.mjs MODE TARGET DSN ITERATIONS   → one line of JSON (milliseconds)
import { createRequire } from 'node:module';
import { neon, neonConfig, Client as NeonClient } from '@neondatabase/serverless';
import ws from 'ws';

const require = createRequire(new URL('../node/package.json', import.meta.url));
const pg = require('pg');

const [mode, target, dsn, iterationsArg] = process.argv.slice(2);
const iterations = Number(iterationsArg ?? 2000);
const [host, port] = target.split(':');
const url = new URL(dsn);
const tcp = {
  host, port: Number(port), user: decodeURIComponent(url.username),
  password: decodeURIComponent(url.password), database: url.pathname.slice(1),
};
neonConfig.fetchEndpoint = `http://${target}/sql`;
neonConfig.webSocketConstructor = ws;
neonConfig.wsProxy = () => `${target}/v2`;
neonConfig.useSecureWebSocket = false;
neonConfig.pipelineTLS = false;

async function op() {
  switch (mode) {
    case 'tcp-warm': {
      const c = new pg.Client(tcp);
      await c.connect();
      return [async (i) => (await c.query('SELECT $1::int AS n', [i])).rows[0].n, () => c.end()];
    }
    case 'tcp-new':
      return [async (i) => {
        const c = new pg.Client(tcp);
        await c.connect();
        const n = (await c.query('SELECT $1::int AS n', [i])).rows[0].n;
        await c.end();
        return n;
      }, () => {}];
    case 'http': {
      const sql = neon(dsn);
      return [async (i) => (await sql.query('SELECT $1::int AS n', [i]))[0].n, () => {}];
    }
    case 'http-raw': {
      // The same request as neon() sends, by fetch alone: the server's part of `http`.
      const headers = {
        'Neon-Connection-String': dsn, 'Neon-Raw-Text-Output': 'true', 'Neon-Array-Mode': 'true',
      };
      return [async (i) => {
        const r = await fetch(`http://${target}/sql`, {
          method: 'POST', headers, body: JSON.stringify({ query: 'SELECT $1::int AS n', params: [String(i)] }),
        });
        const body = await r.json();
        return Number(body.rows[0][0]);
      }, () => {}];
    }
    case 'http-floor':
      // What the HTTP client and server cost alone: a request the front door refuses
      // before any session (no connection string), answered 400.
      return [async (i) => {
        const r = await fetch(`http://${target}/sql`, { method: 'POST', body: '{}' });
        await r.text();
        if (r.status !== 400) throw new Error(`floor answered ${r.status}`);
        return i;
      }, () => {}];
    case 'ws-new':
      return [async (i) => {
        const c = new NeonClient(dsn);
        await c.connect();
        const n = (await c.query('SELECT $1::int AS n', [i])).rows[0].n;
        await c.end();
        return n;
      }, () => {}];
    default:
      throw new Error(`unknown mode ${mode}`);
  }
}

const [run, end] = await op();
for (let i = 0; i < Math.min(200, iterations); i++) await run(i);
const ms = [];
const t0 = process.hrtime.bigint();
for (let i = 0; i < iterations; i++) {
  const s = process.hrtime.bigint();
  const n = await run(i);
  ms.push(Number(process.hrtime.bigint() - s) / 1e6);
  if (n !== i) throw new Error(`query ${i} answered ${n}`);
}
const total = Number(process.hrtime.bigint() - t0) / 1e6;
await end();
ms.sort((a, b) => a - b);
const at = (q) => ms[Math.min(ms.length - 1, Math.floor(ms.length * q))];
console.log(JSON.stringify({ mode, n: ms.length, mean: total / ms.length, p50: at(0.5), p95: at(0.95), p99: at(0.99) }));
