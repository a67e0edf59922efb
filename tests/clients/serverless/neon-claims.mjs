// Neon's serverless driver with `authToken` against Shoal's HTTP front door: each query runs
// with the token's role and claims (row-level security decides what it sees), a batch too,
// and nothing of a token stays for the next request on the same login. The table `notes`
// (owner, body), readable by the tokens' role under a policy on the `sub` claim, is made by
// the test. Usage: node neon-claims.mjs HTTP_ADDR DSN ROLE TOKEN_ALICE TOKEN_BOB BAD_TOKEN
import { neon, neonConfig } from '@neondatabase/serverless';

const [httpAddr, dsn, role, alice, bob, bad] = process.argv.slice(2);
neonConfig.fetchEndpoint = `http://${httpAddr}/sql`;

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
}

const asAlice = neon(dsn, { authToken: alice });
// A function returning the token, as an auth library's getter is passed.
const asBob = neon(dsn, { authToken: async () => bob });
const plain = neon(dsn);

const mine = async (sql) => (await sql`SELECT body FROM notes ORDER BY body`).map((r) => r.body).join();
for (let round = 0; round < 3; round++) {
  check(await mine(asAlice) === 'a1,a2', `alice sees ${await mine(asAlice)}`);
  check(await mine(asBob) === 'b1', `bob sees ${await mine(asBob)}`);
  // Without a token: the connection string's user (the table's owner) sees every row, and
  // no claims are left from the requests before.
  const [p] = await plain`SELECT current_user AS u, coalesce(current_setting('request.jwt.claims', true), '') AS c,
                          (SELECT count(*)::int FROM notes) AS n`;
  check(p.u !== role && p.c === '' && p.n === 3, `without a token ${JSON.stringify(p)}`);
}
const [who] = await asAlice`SELECT current_user AS u, current_setting('request.jwt.claims', true)::json->>'sub' AS sub`;
check(who.u === role && who.sub === 'alice', `alice's query ran as ${JSON.stringify(who)}`);
// A batch: every statement under the claims.
const [a, b] = await asBob.transaction([
  asBob`SELECT count(*)::int AS n FROM notes`,
  asBob`SELECT current_setting('request.jwt.claims', true)::json->>'sub' AS sub`,
]);
check(a[0].n === 1 && b[0].sub === 'bob', `bob's batch ${JSON.stringify([a, b])}`);
// A token the tenant's keys did not sign is refused, not ignored.
let refused = null;
try {
  await neon(dsn, { authToken: bad })`SELECT body FROM notes`;
} catch (e) {
  refused = e;
}
check(refused && /JWT signature/.test(refused.message), `a forged token: ${refused?.message}`);
console.log('neon serverless driver with authToken: ok');
