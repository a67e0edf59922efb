// Neon's serverless driver, unmodified, against Shoal's serverless front door over HTTP
// (`neon()` and `transaction()` POSTing to /sql): parameters of the common types, the
// tagged template, full results, errors with their fields, batches committed and rolled
// back, batch options, and 100 concurrent one-shot queries.
// Usage: node neon-http.mjs HTTP_ADDR DSN   (HTTP_ADDR: host:port of [serverless] listen)
import { neon, neonConfig, NeonDbError } from '@neondatabase/serverless';

const [httpAddr, dsn] = process.argv.slice(2);
// NEON_TLS=1: https:// (trusting NODE_EXTRA_CA_CERTS).
neonConfig.fetchEndpoint = `${process.env.NEON_TLS === '1' ? 'https' : 'http'}://${httpAddr}/sql`;
const sql = neon(dsn);

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

async function fails(promise, what) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  throw new Error(`check failed: ${what} must fail`);
}

async function types() {
  const rows = await sql.query(
    `SELECT $1::int AS i, $2::bigint AS b, $3::numeric AS n, $4::text AS t, $5::bool AS f,
            $6::jsonb AS j, $7::timestamptz AS ts, $8::bytea AS by, $9::int[] AS a,
            $10::text AS nul`,
    [41, '9007199254740993', '12345.678901234567890', 'héllo ☃ "q"', true,
     JSON.stringify({ k: [1, 'two'] }), new Date('2026-11-28T01:02:03.456Z'),
     Buffer.from([0, 1, 255]), [1, 2, 3], null],
  );
  const r = rows[0];
  check(r.i === 41, `int ${r.i}`);
  check(r.b === '9007199254740993', `bigint ${r.b}`);
  check(r.n === '12345.678901234567890', `numeric ${r.n}`);
  check(r.t === 'héllo ☃ "q"', `text ${r.t}`);
  check(r.f === true, 'bool');
  check(JSON.stringify(r.j) === '{"k":[1,"two"]}', `json ${JSON.stringify(r.j)}`);
  check(r.ts.toISOString() === '2026-11-28T01:02:03.456Z', `timestamptz ${r.ts}`);
  check(Buffer.compare(Buffer.from(r.by), Buffer.from([0, 1, 255])) === 0, `bytea ${r.by}`);
  check(JSON.stringify(r.a) === '[1,2,3]', `array ${r.a}`);
  check(r.nul === null, 'NULL');
  // The tagged template passes values out of band, never spliced.
  const evil = "'; DROP TABLE http_ledger; --";
  const [t] = await sql`SELECT ${evil}::text AS s, ${7}::int * 6 AS n`;
  check(t.s === evil && t.n === 42, `template ${JSON.stringify(t)}`);
  // Full results: fields with type OIDs, command, rowCount; array mode.
  const full = await sql.query('SELECT 1::int AS one, $1::text AS two', ['2'], { fullResults: true, arrayMode: true });
  check(full.command === 'SELECT' && full.rowCount === 1, `full ${full.command} ${full.rowCount}`);
  check(full.fields.map((f) => `${f.name}:${f.dataTypeID}`).join() === 'one:23,two:25', `fields ${JSON.stringify(full.fields)}`);
  check(JSON.stringify(full.rows) === '[[1,"2"]]', `array mode ${JSON.stringify(full.rows)}`);
}

async function errors() {
  const zero = await fails(sql.query('SELECT 1 / $1::int', [0]), 'division by zero');
  check(zero instanceof NeonDbError && zero.code === '22012', `division_by_zero, got ${zero.code}: ${zero.message}`);
  const syntax = await fails(sql.query('SELEC 1'), 'a syntax error');
  check(syntax.code === '42601' && syntax.position === '1', `syntax_error at 1, got ${syntax.code} ${syntax.position}`);
  const unique = await fails(sql.query('INSERT INTO http_ledger VALUES (0, 0), (0, 0)'), 'a duplicate key');
  check(unique.code === '23505' && unique.constraint === 'http_ledger_pkey' && unique.detail?.includes('(w, i)=(0, 0)'),
    `unique_violation with constraint and detail, got ${unique.code} ${unique.constraint} ${unique.detail}`);
}

async function transactions() {
  const [ins, sel] = await sql.transaction([
    sql`INSERT INTO http_ledger VALUES (1, 1), (1, 2)`,
    sql`SELECT count(*)::int AS n FROM http_ledger WHERE w = 1`,
  ]);
  check(ins.length === 0 && sel[0].n === 2, `committed batch ${JSON.stringify([ins, sel])}`);
  // An error rolls the whole batch back.
  const e = await fails(sql.transaction([
    sql`INSERT INTO http_ledger VALUES (2, 1)`,
    sql`SELECT 1 / 0`,
  ]), 'a failing batch');
  check(e.code === '22012', `batch error ${e.code}`);
  const [{ n }] = await sql`SELECT count(*)::int AS n FROM http_ledger WHERE w = 2`;
  check(n === 0, `the failed batch left ${n} rows`);
  // Batch options: read-only refuses a write; the isolation level is the one asked for.
  const ro = await fails(sql.transaction([sql`INSERT INTO http_ledger VALUES (3, 1)`], { readOnly: true }), 'a write in a read-only batch');
  check(ro.code === '25006', `read_only_sql_transaction, got ${ro.code}`);
  const [[iso]] = await sql.transaction([sql`SHOW transaction_isolation`], { isolationLevel: 'Serializable', deferrable: true, readOnly: true });
  check(iso.transaction_isolation === 'serializable', `isolation ${JSON.stringify(iso)}`);
  // Full results per query of a batch.
  const [r] = await sql.transaction([sql`UPDATE http_ledger SET i = i WHERE w = 1`], { fullResults: true });
  check(r.command === 'UPDATE' && r.rowCount === 2, `batch full results ${r.command} ${r.rowCount}`);
}

async function concurrent(n) {
  const answers = await Promise.all(
    Array.from({ length: n }, (_, k) => sql.query('SELECT $1::int AS k', [k])),
  );
  answers.forEach((rows, k) => check(rows[0].k === k, `query ${k} got ${JSON.stringify(rows)}`));
}

await sql`CREATE TABLE IF NOT EXISTS http_ledger (w int, i int, PRIMARY KEY (w, i))`;
await sql`INSERT INTO http_ledger VALUES (0, 0)`;
await types();
await errors();
await transactions();
await concurrent(100);
console.log('neon serverless driver over HTTP: ok');
