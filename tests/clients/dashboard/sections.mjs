// The dashboard's optional sections in Chromium on a node of a real cluster: the Cluster
// entry is in the navigation, and its page lists the live nodes and who owns which pool.
// Environment: SHOAL_UI, SHOAL_TOKEN, NODES (how many), POOL (a pool's name), SCREENSHOTS.

import { chromium } from 'playwright-core';
import { join } from 'node:path';
import assert from 'node:assert/strict';

const { SHOAL_UI: UI, SHOAL_TOKEN: TOKEN, NODES, POOL, SCREENSHOTS } = process.env;

async function until(what, fn, ms = 20000) {
  const end = Date.now() + ms;
  for (;;) {
    try {
      if (await fn()) return;
    } catch {
      // retried
    }
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--no-first-run'],
});
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  await page.goto(UI);
  await page.getByLabel('API token or JWT').fill(TOKEN);
  await page.keyboard.press('Enter');
  await page.locator('#tile-tps').waitFor();
  for (const [name, shown] of [['Cluster', true], ['Replicas', false], ['Cache', false]]) {
    assert.equal(await page.getByRole('link', { name, exact: true }).isVisible(), shown, name);
  }
  await page.getByRole('link', { name: 'Cluster', exact: true }).click();
  const nodes = page.getByRole('table', { name: 'Nodes' });
  await until(`${NODES} nodes`, async () => (await nodes.locator('tbody tr').count()) === Number(NODES));
  const owners = page.getByRole('table', { name: 'Pool owners' });
  await until('the pool\'s owner', async () => (await owners.locator('tbody').textContent()).includes(POOL));
  await page.screenshot({ path: join(SCREENSHOTS, 'cluster.png'), fullPage: true });
  assert.deepEqual(errors, []);
} finally {
  await browser.close();
}
console.log(JSON.stringify({ ok: true }));
