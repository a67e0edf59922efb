// Neon's serverless driver, unmodified, against Shoal's serverless front door (PostgreSQL
// over WebSocket): Pool and Client, parameters of the common types, errors, transactions,
// prepared statements, LISTEN/NOTIFY, concurrency beyond the pool's size.
// Usage: node neon.mjs WS_ADDR DSN [WORKERS]   (WS_ADDR: host:port of [serverless] listen)
// NEON_PIPELINE=false: the driver waits for the server's authentication request (SCRAM);
// otherwise it pipelines startup, password and first query (its default).
import { Pool, Client, neonConfig } from '@neondatabase/serverless';
import ws from 'ws';

const [wsAddr, dsn, workersArg] = process.argv.slice(2);
const WORKERS = Number(workersArg ?? 20);

neonConfig.webSocketConstructor = ws;
neonConfig.wsProxy = () => `${wsAddr}/v2`;
// NEON_TLS=1: wss:// (trusting NODE_EXTRA_CA_CERTS).
neonConfig.useSecureWebSocket = process.env.NEON_TLS === '1';
neonConfig.pipelineTLS = false;
if (process.env.NEON_PIPELINE === 'false') neonConfig.pipelineConnect = false;

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

async function types(pool) {
  const { rows } = await pool.query(
    `SELECT $1::int AS i, $2::bigint AS b, $3::numeric AS n, $4::text AS t, $5::bool AS f,
            $6::jsonb AS j, $7::timestamptz AS ts, $8::bytea AS by, $9::int[] AS a,
            $10::text AS nul`,
    [41, '9007199254740993', '12345.678901234567890', 'héllo ☃', true,
     JSON.stringify({ k: [1, 'two'] }), '2026-11-28T01:02:03.456Z', Buffer.from([0, 1, 255]),
     [1, 2, 3], null],
  );
  const r = rows[0];
  check(r.i === 41, `int ${r.i}`);
  check(r.b === '9007199254740993', `bigint ${r.b}`);
  check(r.n === '12345.678901234567890', `numeric ${r.n}`);
  check(r.t === 'héllo ☃', `text ${r.t}`);
  check(r.f === true, 'bool');
  check(JSON.stringify(r.j) === '{"k":[1,"two"]}', `json ${JSON.stringify(r.j)}`);
  check(r.ts.toISOString() === '2026-11-28T01:02:03.456Z', `timestamptz ${r.ts}`);
  check(Buffer.compare(r.by, Buffer.from([0, 1, 255])) === 0, 'bytea');
  check(JSON.stringify(r.a) === '[1,2,3]', `array ${r.a}`);
  check(r.nul === null, 'NULL');
}

async function errors(pool) {
  try {
    await pool.query('SELECT 1 / $1::int', [0]);
    check(false, 'division by zero must fail');
  } catch (e) {
    check(e.code === '22012', `division_by_zero, got ${e.code}: ${e.message}`);
  }
  try {
    await pool.query('SELEC 1');
    check(false, 'a syntax error must fail');
  } catch (e) {
    check(e.code === '42601' && typeof e.position === 'string', `syntax_error with position, got ${e.code} ${e.position}`);
  }
  // The connection is usable after the errors.
  const { rows } = await pool.query('SELECT 2 AS two');
  check(rows[0].two === 2, 'usable after errors');
}

async function worker(pool, w) {
  const c = await pool.connect();
  try {
    for (let i = 0; i < 10; i++) {
      const k = w * 1000 + i;
      // A named (prepared) statement, reused across transactions.
      const { rows } = await c.query({ name: 'plus', text: 'SELECT $1::int + 1 AS v', values: [k] });
      check(rows[0].v === k + 1, `prepared ${rows[0].v}`);
      await c.query('BEGIN');
      await c.query('INSERT INTO neon_ledger VALUES ($1, $2)', [w, i]);
      if (i % 2 === 0) await c.query('COMMIT');
      else await c.query('ROLLBACK');
    }
  } finally {
    c.release();
  }
}

async function listenNotify() {
  const listener = new Client(dsn);
  await listener.connect();
  const got = new Promise((resolve) => listener.on('notification', resolve));
  await listener.query('LISTEN neon_channel');
  const sender = new Client(dsn);
  await sender.connect();
  await sender.query(`SELECT pg_notify('neon_channel', 'over a websocket')`);
  const n = await Promise.race([got, new Promise((_, no) => setTimeout(() => no(new Error('no notification within 10 s')), 10000))]);
  check(n.payload === 'over a websocket', `payload ${n.payload}`);
  await sender.end();
  await listener.end();
}

async function wrongPassword() {
  const bad = new URL(dsn);
  bad.password = 'not-the-password';
  const c = new Client(bad.toString());
  // The refusal ends the connection: its end is reported as an event too.
  c.on('error', () => {});
  try {
    await c.connect();
    await c.query('SELECT 1');
    check(false, 'a wrong password must be refused');
  } catch (e) {
    check(e.code === '28P01', `invalid_password, got ${e.code}: ${e.message}`);
  }
}

await wrongPassword();
const pool = new Pool({ connectionString: dsn, max: WORKERS });
await types(pool);
await errors(pool);
await pool.query('CREATE TABLE IF NOT EXISTS neon_ledger (w int, i int)');
await Promise.all(Array.from({ length: WORKERS }, (_, w) => worker(pool, w)));
const { rows } = await pool.query('SELECT count(*)::int AS n, count(DISTINCT (w, i))::int AS d FROM neon_ledger');
check(rows[0].n === WORKERS * 5 && rows[0].d === WORKERS * 5, `committed rows ${JSON.stringify(rows[0])}`);
await listenNotify();
await pool.end();
console.log(`neon serverless driver over WebSocket (pipelineConnect ${neonConfig.pipelineConnect}): ${WORKERS} workers ok`);
