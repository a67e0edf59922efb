// Drives Shoal's dashboard in Debian's headless Chromium (playwright-core, no downloaded
// browser) the way an operator would: logs in, watches the numbers move while pgbench runs
// through Shoal, opens a pool, creates a tenant through the form (after a validation error)
// and connects to it with psql, bans it and watches its client end, logs out. Screenshots go
// to $SCREENSHOTS. Any failed check throws; the last line printed is a JSON summary.
//
// Environment: SHOAL_UI (http://host:port/ui), SHOAL_TOKEN, SHOAL_HOST, SHOAL_PORT,
// DB (a database Shoal serves, as user app), PG_PORT (PostgreSQL's, for the tenant),
// PGPASSWORD (app's), SCREENSHOTS (a directory).

import { chromium } from 'playwright-core';
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, mkdirSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import assert from 'node:assert/strict';

const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set`);
  return v;
};
const UI = env('SHOAL_UI');
const TOKEN = env('SHOAL_TOKEN');
const HOST = env('SHOAL_HOST');
const PORT = env('SHOAL_PORT');
const DB = env('DB');
const PG_PORT = env('PG_PORT');
const SHOTS = env('SCREENSHOTS');
mkdirSync(SHOTS, { recursive: true });

const done = [];
const step = (name) => { done.push(name); console.error(`ok: ${name}`); };

/** A child process and a promise of its end ({code, out, err}). */
function run(cmd, args, extraEnv = {}) {
  const child = spawn(cmd, args, { env: { ...process.env, ...extraEnv } });
  let out = '';
  let err = '';
  child.stdout.on('data', (d) => { out += d; });
  child.stderr.on('data', (d) => { err += d; });
  const ended = new Promise((resolve) => child.on('close', (code) => resolve({ code, out, err })));
  return { child, ended };
}

/** A number as the page prints it ("1.2k", "950", "3.5 ms"). */
function numeric(text) {
  const m = (text || '').trim().match(/^(-?[0-9.]+)([kMG]?)/);
  if (!m) return NaN;
  return Number(m[1]) * ({ '': 1, k: 1e3, M: 1e6, G: 1e9 }[m[2]]);
}

const psqlArgs = (user, sql) => ['-X', '-q', '-t', '-A', '-h', HOST, '-p', PORT, '-U', user, '-d', DB, '-c', sql];

/** Waits until `fn` returns something truthy (it is retried on throws), or fails with `what`. */
async function until(what, fn, ms = 20000) {
  const end = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}${last ? `: ${last.message}` : ''}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--no-first-run'],
});
const pgbench = [];
const errors = [];
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  page.on('pageerror', (e) => errors.push(e.message));

  // Nothing without a session: the page shows only the login form, the data is refused.
  await page.goto(UI);
  await page.getByLabel('API token or JWT').waitFor();
  assert.equal(await page.locator('#nav').isVisible(), false, 'no navigation before login');
  assert.equal((await page.request.get(`${UI}/feed`)).status(), 401);
  assert.equal((await page.request.get(`${UI}/api/tenants`)).status(), 401);
  assert.equal((await page.request.get(`${UI}/api/pools`)).status(), 401);
  step('unauthenticated requests get 401');

  await page.getByLabel('API token or JWT').fill('not-the-token');
  await page.getByRole('button', { name: 'Log in' }).click();
  await until('the refusal', async () => (await page.locator('#login-error').textContent()).includes('neither'));
  await page.screenshot({ path: join(SHOTS, 'login-refused.png') });
  await page.getByLabel('API token or JWT').fill(TOKEN);
  await page.keyboard.press('Enter');
  await page.locator('#tile-tps').waitFor();
  const cookies = await context.cookies();
  const session = cookies.find((c) => c.name === 'shoal_ui');
  assert.ok(session && session.httpOnly && session.sameSite === 'Strict', JSON.stringify(cookies));
  assert.ok(!page.url().includes(TOKEN), 'the token is never in the URL');
  step('logged in (HttpOnly, SameSite=Strict cookie)');

  // Live numbers: pgbench through Shoal moves the transactions tile and the chart.
  const dir = mkdtempSync(join(tmpdir(), 'shoal-dash-'));
  writeFileSync(join(dir, 'select.sql'), 'SELECT 1;\n');
  pgbench.push(run('pgbench', ['-n', '-f', join(dir, 'select.sql'), '-c', '4', '-j', '2', '-T', '120',
    '-h', HOST, '-p', PORT, '-U', 'app', DB]));
  const tps = async () => numeric(await page.locator('#tile-tps .tile-value').textContent());
  const first = await until('transactions a second above zero', async () => { const v = await tps(); return v > 0 && v; });
  const second = await until('the transactions tile to change', async () => { const v = await tps(); return v > 0 && v !== first && v; });
  const line = await page.locator('figure.chart path.series').first().getAttribute('d');
  assert.ok(line && line.split(' ').length > 1, 'the clients chart has a line');
  // Seconds without samples break a line instead of joining its ends with a ramp.
  const runs = await page.evaluate(async () => {
    const { runsOf } = await import('/ui/assets/charts.js');
    const at = [0, 1000, 2000, 30000, 31000, 32000, 33000];
    return runsOf(at.map((t, i) => ({ at: t, n: i === 5 ? null : i })), (s) => s.n, 3000)
      .map((r) => r.map((p) => p.at));
  });
  assert.deepEqual(runs, [[0, 1000, 2000], [30000, 31000], [33000]]);
  await page.screenshot({ path: join(SHOTS, 'overview.png') });
  step(`live numbers move (${first} then ${second} transactions/s)`);

  // A slow query, for the pool's page.
  const slow = run('psql', psqlArgs('app', 'SELECT pg_sleep(0.3)'));
  assert.equal((await slow.ended).code, 0, 'the slow query ran');

  // Pools: the table, sorting, filtering, and a pool's own page.
  await page.getByRole('link', { name: 'Pools' }).click();
  const row = page.locator('tbody tr', { hasText: DB });
  await row.first().waitFor();
  await until('the pool\'s transactions a second', async () => numeric(await row.first().locator('td').nth(7).textContent()) > 0);
  await page.getByRole('button', { name: /Tx\/s/ }).click();
  await until('sorting by Tx/s', async () => (await page.locator('th[aria-sort="descending"]').count()) === 1);
  await page.getByLabel('Filter').fill('no-such-pool');
  await until('the filter', async () => (await page.locator('tbody').textContent()).includes('No pool matches'));
  await page.getByLabel('Filter').fill(DB);
  await row.first().waitFor();
  await page.screenshot({ path: join(SHOTS, 'pools.png') });
  await row.first().getByRole('link').click();
  await page.getByRole('table', { name: 'Servers' }).waitFor();
  await until('the pool\'s servers', async () => (await page.getByRole('table', { name: 'Servers' }).locator('tbody tr td').first().textContent()) !== 'No servers open.');
  await until('the slow query', async () => (await page.getByRole('table', { name: /Slow queries/ }).locator('tbody').textContent()).includes('ms'));
  await page.screenshot({ path: join(SHOTS, 'pool.png'), fullPage: true });
  step('pools table sorted, filtered; pool page with servers and a slow query');

  // Tenants: the form shows the API's validation message beside the bad field.
  await page.getByRole('link', { name: 'Tenants' }).click();
  await page.getByRole('link', { name: 'New tenant' }).click();
  const tenant = `dash-${process.pid}`;
  await page.getByLabel('Tenant id').fill(tenant);
  await page.getByLabel('Host').fill('127.0.0.1');
  await page.getByLabel('Port').fill(PG_PORT);
  await page.getByLabel('Database', { exact: true }).fill(DB);
  await page.getByLabel('Database user').fill('app');
  await page.getByLabel('Password').fill(process.env.PGPASSWORD);
  await page.getByLabel('Pool size', { exact: true }).fill('2');
  const allow = page.getByLabel(/Allowed client networks/);
  await allow.fill('127.0.0.0/8\nnot-a-network');
  const wait = page.getByLabel('Wait for a limit up to');
  await wait.fill('3 parsecs');
  await page.getByRole('button', { name: 'Create tenant' }).click();
  const allowError = page.locator('[data-field="allow_list"] .field-error');
  await until('the allow list\'s error', async () => (await allowError.textContent()).includes('line 2: is not a CIDR'));
  assert.equal(await allow.getAttribute('aria-invalid'), 'true');
  // Every invalid field is marked at once, the duration in words.
  const waitError = await page.locator('[data-field="limit_wait"] .field-error').textContent();
  assert.ok(waitError.includes('is not a duration such as "5s"'), waitError);
  assert.equal(await wait.getAttribute('aria-invalid'), 'true');
  assert.equal(await page.evaluate(() => document.activeElement.name), 'allow_list', 'the bad field has the focus');
  await page.screenshot({ path: join(SHOTS, 'tenant-invalid.png'), fullPage: true });
  step('a validation error shown beside its field');
  await allow.fill('127.0.0.0/8\n::1/128');
  await wait.fill('');
  await page.getByRole('button', { name: 'Create tenant' }).click();
  await page.locator(`tr[data-tenant="${tenant}"]`).waitFor();
  assert.equal(await page.locator(`tr[data-tenant="${tenant}"] td.num`).textContent(), '2',
    'the list shows the user\'s own pool size, not the default');
  const tenantUser = `app.${tenant}`;
  const q = await run('psql', psqlArgs(tenantUser, 'SELECT 40 + 2')).ended;
  assert.equal(q.code, 0, q.err);
  assert.equal(q.out.trim(), '42');
  step('a tenant created through the form, reached with psql');

  // Edit: the form comes filled in; a pool size changed, the password kept (left empty).
  await page.locator(`tr[data-tenant="${tenant}"]`).getByRole('link', { name: tenant }).click();
  await until('the filled-in form', async () => (await page.getByLabel('Host').inputValue()) === '127.0.0.1');
  assert.equal(await page.getByLabel('Database user').inputValue(), 'app');
  assert.equal(await page.getByLabel('Password').inputValue(), '', 'passwords are never shown');
  await page.getByLabel('Pool size', { exact: true }).fill('4');
  await page.getByRole('button', { name: 'Save' }).click();
  await until('the new pool size in the list', async () =>
    (await page.locator(`tr[data-tenant="${tenant}"] td.num`).textContent()) === '4');
  const again = await run('psql', psqlArgs(tenantUser, 'SELECT 1')).ended;
  assert.equal(again.code, 0, `the password was kept: ${again.err}`);
  step('a tenant edited, its password kept');

  // Ban: the tenant's connected client ends, new ones are refused.
  const held = run('psql', psqlArgs(tenantUser, 'SELECT pg_sleep(60)'));
  await page.getByRole('link', { name: 'Pools' }).click();
  await page.getByLabel('Filter').fill(tenant);
  await until('the tenant\'s pool with its client', async () => {
    const r = page.locator('tbody tr', { hasText: tenant });
    return (await r.count()) > 0 && Number(await r.first().locator('td').nth(3).textContent()) >= 1;
  });
  await page.getByRole('link', { name: 'Tenants' }).click();
  await page.getByLabel('Search').fill(tenant);
  const tenantRow = page.locator(`tr[data-tenant="${tenant}"]`);
  await tenantRow.waitFor();
  page.once('dialog', (d) => d.accept('misuse'));
  await tenantRow.getByRole('button', { name: `Ban ${tenant}` }).click();
  const ended = await Promise.race([
    held.ended,
    new Promise((r) => setTimeout(() => r(null), 20000)),
  ]);
  assert.ok(ended, 'the banned tenant\'s client was not ended');
  assert.notEqual(ended.code, 0);
  assert.match(ended.err, /banned/, ended.err);
  await until('the banned badge', async () => (await tenantRow.locator('.badge').textContent()) === 'banned');
  const refused = await run('psql', psqlArgs(tenantUser, 'SELECT 1')).ended;
  assert.notEqual(refused.code, 0, 'a banned tenant refuses new clients');
  await page.screenshot({ path: join(SHOTS, 'tenant-banned.png'), fullPage: true });
  await tenantRow.getByRole('button', { name: `Unban ${tenant}` }).click();
  await until('the active badge', async () => (await tenantRow.locator('.badge').textContent()) === 'active');
  const back = await run('psql', psqlArgs(tenantUser, 'SELECT 1')).ended;
  assert.equal(back.code, 0, `an unbanned tenant takes clients again: ${back.err}`);
  page.once('dialog', (d) => d.accept());
  await tenantRow.getByRole('button', { name: `Delete ${tenant}` }).click();
  await until('the tenant gone', async () => (await tenantRow.count()) === 0);
  step('a ban ends the tenant\'s client; unban; delete');

  // Accessible: every form control has a name; keyboard reaches the navigation.
  await page.getByRole('link', { name: 'New tenant' }).click();
  await page.getByLabel('Tenant id').waitFor();
  const unnamed = await page.evaluate(() => [...document.querySelectorAll('input, select, textarea')]
    .filter((e) => e.offsetParent !== null && e.labels.length === 0 && !e.getAttribute('aria-label'))
    .map((e) => e.name || e.id));
  assert.deepEqual(unnamed, [], 'controls without a label');
  await page.goto(`${UI}#/`);
  await page.locator('#tile-tps').waitFor();
  await page.keyboard.press('Tab');
  await page.keyboard.press('Tab');
  assert.equal(await page.evaluate(() => document.activeElement.textContent.trim()), 'Shoal', 'Tab reaches the header');
  step('labels and keyboard');

  // A phone-sized screen: nothing wider than the screen.
  const phone = await browser.newContext({ viewport: { width: 375, height: 740 }, isMobile: true });
  await phone.addCookies(cookies);
  const small = await phone.newPage();
  await small.goto(`${UI}#/`);
  await small.locator('#tile-tps').waitFor();
  const overflow = await small.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
  assert.ok(overflow <= 0, `the overview is ${overflow}px wider than a phone`);
  await small.screenshot({ path: join(SHOTS, 'overview-phone.png'), fullPage: true });
  await phone.close();
  step('fits a phone');

  // A server that stops answering is said, and the banner goes when it answers again.
  await page.goto(`${UI}#/`);
  await page.locator('#tile-tps').waitFor();
  await page.route('**/ui/feed*', (route) => route.abort('connectionrefused'));
  await until('the banner', async () => page.locator('#offline').isVisible());
  assert.match(await page.locator('#offline').textContent(), /not answering/);
  await page.unroute('**/ui/feed*');
  await until('the banner gone', async () => !(await page.locator('#offline').isVisible()));
  step('a server not answering is said');

  // Logging out ends the session.
  await page.getByRole('button', { name: 'Log out' }).click();
  await page.getByLabel('API token or JWT').waitFor();
  assert.equal((await page.request.get(`${UI}/feed`)).status(), 401);
  step('logged out');
  assert.deepEqual(errors, [], 'errors in the page');
} finally {
  for (const p of pgbench) p.child.kill('SIGINT');
  await browser.close();
}
console.log(JSON.stringify({ steps: done }));
