// Compatibility check of Shoal's transaction mode with node-postgres: many concurrent
// clients (more than the pool has servers) using named queries (protocol-level prepared
// statements), transactions, errors and pipelined queries, then LISTEN/NOTIFY, verifying
// every result.
// Usage: node compat.js DSN [WORKERS]
'use strict';
const { Client } = require('pg');

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

async function worker(dsn, w, rounds) {
  const c = new Client({ connectionString: dsn });
  await c.connect();
  try {
    // A session SET holds across transactions (which run on different servers).
    await c.query(`SET application_name = 'node-${w}'`);
    // A named statement whose Parse failed leaves no name behind: the same name prepares.
    try {
      await c.query({ name: 'retry', text: 'SELEC $1::int AS v', values: [1] });
      check(false, 'a syntax error must fail');
    } catch (e) {
      check(e.code === '42601', `syntax_error, got ${e.code}`);
    }
    const again = await c.query({ name: 'retry', text: 'SELECT $1::int AS v', values: [w] });
    check(again.rows[0].v === w, 're-prepared after a failed Parse');
    for (let i = 0; i < rounds; i++) {
      const k = w * 10000 + i;
      // Named query: prepared once per connection, reused in later transactions.
      let r = await c.query({ name: 'double', text: 'SELECT $1::int * 2 AS v', values: [k] });
      check(r.rows[0].v === k * 2, 'named query');
      await c.query('BEGIN');
      await c.query({ name: 'ins', text: 'INSERT INTO compat_node (k, v) VALUES ($1, $2)', values: [k, `n${k}`] });
      r = await c.query({ name: 'sel', text: 'SELECT v FROM compat_node WHERE k = $1', values: [k] });
      check(r.rows[0].v === `n${k}`, 'read own write');
      await c.query('COMMIT');
      try {
        await c.query({ name: 'ins', text: 'INSERT INTO compat_node (k, v) VALUES ($1, $2)', values: [k, 'dup'] });
        check(false, 'duplicate must fail');
      } catch (e) {
        check(e.code === '23505', `unique violation, got ${e.code}`);
      }
      // Several queries in flight on one connection (node-postgres queues them).
      const all = await Promise.all([0, 1, 2, 3, 4].map((j) =>
        c.query({ name: 'double', text: 'SELECT $1::int * 2 AS v', values: [k + j] })));
      check(all.every((res, j) => res.rows[0].v === (k + j) * 2), 'queued queries in order');
      r = await c.query("SELECT current_setting('application_name') AS a");
      check(r.rows[0].a === `node-${w}`, 'SET held');
    }
    // A server-side cancel (statement_timeout) leaves the connection usable.
    await c.query('BEGIN');
    await c.query("SET LOCAL statement_timeout = '50ms'");
    try {
      await c.query('SELECT pg_sleep(5)');
      check(false, 'timeout must cancel');
    } catch (e) {
      check(e.code === '57014', `query_canceled, got ${e.code}`);
    }
    await c.query('ROLLBACK');
    const r = await c.query('SELECT 1 AS one');
    check(r.rows[0].one === 1, 'goes on after cancel');
  } finally {
    await c.end();
  }
}

// LISTEN on one client while every worker notifies through the same pool.
async function notify(dsn, senders) {
  const l = new Client({ connectionString: dsn });
  await l.connect();
  const got = [];
  let wake = null;
  l.on('notification', (n) => {
    got.push(n);
    if (wake) wake();
  });
  await l.query('LISTEN compat_node');
  // Its own notification is emitted before its query resolves, with its own process id.
  await l.query("NOTIFY compat_node, 'self'");
  check(got.length === 1 && got[0].payload === 'self' && got[0].processId === l.processID,
    `own notification: ${JSON.stringify(got)}`);
  got.length = 0;
  const pids = await Promise.all(Array.from({ length: senders }, async (_, w) => {
    const c = new Client({ connectionString: dsn });
    await c.connect();
    for (let i = 0; i < 10; i++) {
      await c.query({ name: 'n', text: 'SELECT pg_notify($1, $2)', values: ['compat_node', `${w}:${i}`] });
    }
    const pid = c.processID;
    await c.end();
    return pid;
  }));
  const deadline = Date.now() + 20000;
  while (got.length < senders * 10) {
    check(Date.now() < deadline, `notifications: ${got.length} of ${senders * 10}`);
    await new Promise((resolve) => { wake = resolve; setTimeout(resolve, 1000); });
  }
  const want = [];
  for (let w = 0; w < senders; w++) for (let i = 0; i < 10; i++) want.push(`${w}:${i}`);
  check(JSON.stringify(got.map((n) => n.payload).sort()) === JSON.stringify(want.sort()), 'every notification once');
  check(got.every((n) => n.processId === pids[Number(n.payload.split(':')[0])]), 'sender process ids');
  await l.end();
}

async function main() {
  const dsn = process.argv[2];
  const workers = Number(process.argv[3] || 20);
  const rounds = 15;
  const setup = new Client({ connectionString: dsn });
  await setup.connect();
  await setup.query('CREATE TABLE IF NOT EXISTS compat_node (k int PRIMARY KEY, v text)');
  await setup.end();
  await Promise.all(Array.from({ length: workers }, (_, w) => worker(dsn, w, rounds)));
  console.log(`node-postgres ${require('pg/package.json').version}: ${workers} workers x ${rounds} rounds OK`);
  await notify(dsn, workers);
  console.log(`node-postgres: LISTEN/NOTIFY with ${workers} senders OK`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
