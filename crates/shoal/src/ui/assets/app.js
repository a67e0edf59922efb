// The dashboard: logs in, then shows the view the URL's fragment names, refreshing it every
// second or two while it is shown.

import { h, api, LoggedOut, sortableTable, pager, debounce } from './dom.js';
import { lineChart, sparkline, fmt } from './charts.js';
import { tenantsView, tenantFormView } from './tenants.js';

const $ = (id) => document.getElementById(id);
const view = $('view');
let stopView = () => {};
let sections = null;

/** Runs `tick` now and every `ms` until the view changes; a lost session shows the login. */
function every(ms, tick) {
  let alive = true;
  let timer = null;
  const run = async () => {
    try {
      await tick();
      $('offline').hidden = true;
    } catch (e) {
      if (e instanceof LoggedOut) return showLogin();
      // The numbers shown are getting old: say so until the server answers again.
      $('offline').textContent = `Shoal is not answering (${e.message}); retrying…`;
      $('offline').hidden = false;
    }
    if (alive) timer = setTimeout(run, ms);
  };
  run();
  return () => { alive = false; clearTimeout(timer); };
}

// ---- login ----

function showLogin(message = '') {
  stopView();
  stopView = () => {};
  view.replaceChildren();
  $('nav').hidden = true;
  $('logout').hidden = true;
  $('login').hidden = false;
  $('login-error').textContent = message;
  $('token').focus();
}

$('login-form').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const token = $('token').value.trim();
  if (!token) {
    $('login-error').textContent = 'Enter the API token or a JWT.';
    return;
  }
  const r = await fetch('/ui/login', {
    method: 'POST',
    credentials: 'same-origin',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ token }),
  });
  if (!r.ok) {
    const body = await r.json().catch(() => ({}));
    $('login-error').textContent = body.error || `Login failed (${r.status}).`;
    $('token').select();
    return;
  }
  $('token').value = '';
  $('login').hidden = true;
  route();
});

$('logout').addEventListener('click', async () => {
  await fetch('/ui/logout', { method: 'POST', credentials: 'same-origin' });
  showLogin('Logged out.');
});

// ---- routing ----

const routes = [
  [/^#?\/?$/, overview],
  [/^#\/pools$/, poolsView],
  [/^#\/pool\/(.+)$/, (m) => poolView(decodeURIComponent(m[1]))],
  [/^#\/tenants$/, (m, v) => tenantsView(v, every)],
  [/^#\/tenants\/new$/, (m, v) => tenantFormView(v, null)],
  [/^#\/tenants\/edit\/(.+)$/, (m, v) => tenantFormView(v, decodeURIComponent(m[1]))],
  [/^#\/(cluster|realtime|replicas|cache)$/, (m) => sectionView(m[1])],
];

async function route() {
  stopView();
  stopView = () => {};
  try {
    sections = await api('/ui/api/sections');
  } catch (e) {
    if (e instanceof LoggedOut) return showLogin();
    throw e;
  }
  $('login').hidden = true;
  $('nav').hidden = false;
  $('logout').hidden = false;
  for (const a of document.querySelectorAll('#nav a[data-section]')) {
    a.hidden = !sections[a.dataset.section];
  }
  const hash = location.hash || '#/';
  for (const a of document.querySelectorAll('#nav a')) {
    const here = a.getAttribute('href') === hash
      || (hash.startsWith('#/pool/') && a.getAttribute('href') === '#/pools')
      || (hash.startsWith('#/tenants') && a.getAttribute('href') === '#/tenants');
    if (here) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  for (const [re, make] of routes) {
    const m = hash.match(re);
    if (m) {
      view.replaceChildren();
      stopView = make(m, view) || (() => {});
      return;
    }
  }
  view.replaceChildren(h('h1', {}, 'Not found'), h('p', {}, h('a', { href: '#/' }, 'Back to the overview')));
}

window.addEventListener('hashchange', () => {
  route();
  $('main').focus({ preventScroll: true });
});

// ---- overview ----

const WINDOW = 15 * 60 * 1000;
const samples = [];

const CLASS_NAMES = {
  '08': 'connection', '22': 'data', '23': 'constraint', '25': 'transaction state',
  '28': 'authorization', '40': 'rollback', '42': 'syntax/access', '53': 'resources',
  '54': 'limits', '55': 'object state', '57': 'operator', XX: 'internal', other: 'other',
};
const CLASS_COLORS = ['#d1495b', '#edae49', '#00798c', '#30638e', '#8e5572', '#66a182', '#b56576', '#6d597a'];

function overview() {
  const tiles = h('div', { class: 'tiles' });
  const charts = h('div', { class: 'charts' });
  view.append(h('h1', {}, 'Overview'), tiles, charts);
  const c = (title, opts) => {
    const box = h('figure');
    charts.append(box);
    return lineChart(box, { title, ...opts });
  };
  const clients = c('Clients', {
    series: [
      { name: 'active', key: 'clients_active', color: '#0b6e8a' },
      { name: 'idle', key: 'clients_idle', color: '#8a9ba8' },
      { name: 'waiting', key: 'clients_waiting', color: '#d1495b' },
    ],
  });
  const servers = c('Servers', {
    series: [
      { name: 'active', key: 'servers_active', color: '#0b6e8a' },
      { name: 'idle', key: 'servers_idle', color: '#8a9ba8' },
    ],
  });
  const rates = c('Throughput (per second)', {
    series: [
      { name: 'transactions', key: 'transactions', color: '#0b6e8a' },
      { name: 'queries', key: 'queries', color: '#edae49' },
    ],
  });
  const latency = c('Latency', {
    unit: ' ms',
    series: [
      { name: 'query p50', key: 'query_p50', color: '#0b6e8a' },
      { name: 'query p99', key: 'query_p99', color: '#30638e' },
      { name: 'wait p50', key: 'wait_p50', color: '#edae49' },
      { name: 'wait p99', key: 'wait_p99', color: '#d1495b' },
    ],
  });
  const errorsBox = h('figure');
  charts.append(errorsBox);
  let errors = null;
  let classes = '';

  const tile = (label, value, id) => h('div', { class: 'tile', id },
    h('span', { class: 'tile-label' }, label), h('span', { class: 'tile-value' }, value));

  return every(1000, async () => {
    const since = samples.length ? samples[samples.length - 1].at : 0;
    const got = await api(`/ui/feed?since=${since}`);
    samples.push(...got.samples);
    const cut = samples.length ? samples[samples.length - 1].at - WINDOW : 0;
    while (samples.length && samples[0].at < cut) samples.shift();
    const last = samples[samples.length - 1] || {};
    tiles.replaceChildren(
      tile('Pools', fmt(last.pools ?? 0), 'tile-pools'),
      tile('Clients active', fmt(last.clients_active ?? 0), 'tile-clients-active'),
      tile('Clients idle', fmt(last.clients_idle ?? 0), 'tile-clients-idle'),
      tile('Clients waiting', fmt(last.clients_waiting ?? 0), 'tile-clients-waiting'),
      tile('Servers', `${fmt(last.servers_active ?? 0)} active · ${fmt(last.servers_idle ?? 0)} idle`, 'tile-servers'),
      tile('Transactions/s', fmt(last.transactions ?? 0), 'tile-tps'),
      tile('Query p50 / p99', `${fmt(last.query_p50, ' ms')} / ${fmt(last.query_p99, ' ms')}`, 'tile-query'),
      tile('Wait p50 / p99', `${fmt(last.wait_p50, ' ms')} / ${fmt(last.wait_p99, ' ms')}`, 'tile-wait'),
      tile('Errors/s', fmt(last.errors ?? 0), 'tile-errors'),
    );
    // The error chart has a line per class seen in the window.
    const seen = [...new Set(samples.flatMap((s) => Object.keys(s.errors_by_class || {})))].sort();
    const key = seen.join(',');
    if (!errors || key !== classes) {
      classes = key;
      const series = (seen.length ? seen : ['none']).map((cl, i) => ({
        name: cl === 'none' ? 'none' : `${cl} ${CLASS_NAMES[cl] || ''}`.trim(),
        value: (s) => (s.errors_by_class || {})[cl] || 0,
        color: CLASS_COLORS[i % CLASS_COLORS.length],
      }));
      errors = lineChart(errorsBox, { title: 'Errors by SQLSTATE class (per second)', series });
    }
    for (const ch of [clients, servers, rates, latency, errors]) ch.update(samples);
  });
}

// ---- pools ----

const POOL_COLUMNS = [
  { key: 'name', label: 'Pool' },
  { key: 'user', label: 'User' },
  { key: 'mode', label: 'Mode' },
  { key: 'size', label: 'Size', num: true },
  { key: 'cl_active', label: 'Clients active', num: true },
  { key: 'cl_waiting', label: 'Waiting', num: true },
  { key: 'sv_active', label: 'Servers active', num: true },
  { key: 'sv_idle', label: 'Idle', num: true },
  { key: 'tps', label: 'Tx/s', num: true },
  { key: 'spark', label: 'Last minute', sortable: false },
];

const poolsState = { page: 1, per_page: 50, sort: 'name', desc: false, filter: '' };

function poolsView() {
  const filter = h('input', {
    id: 'pool-filter', type: 'search', value: poolsState.filter,
    placeholder: 'pool, database, user or tenant',
  });
  const holder = h('div', { class: 'table-wrap' });
  const foot = h('div');
  view.append(
    h('h1', {}, 'Pools'),
    h('div', { class: 'toolbar' }, h('label', { for: 'pool-filter' }, 'Filter'), filter),
    holder, foot);
  let refresh = () => {};
  filter.addEventListener('input', debounce(() => {
    poolsState.filter = filter.value;
    poolsState.page = 1;
    refresh();
  }, 250));
  const load = async () => {
    const q = new URLSearchParams({
      page: poolsState.page, per_page: poolsState.per_page, sort: poolsState.sort,
      desc: poolsState.desc, filter: poolsState.filter,
    });
    const page = await api(`/ui/api/pools?${q}`);
    const { table, body } = sortableTable(POOL_COLUMNS, poolsState, () => refresh(), 'Pools');
    for (const p of page.data) {
      body.append(h('tr', {},
        h('th', { scope: 'row' }, h('a', { href: `#/pool/${encodeURIComponent(p.name)}` }, p.name)),
        h('td', {}, p.user), h('td', {}, p.mode), h('td', { class: 'num' }, p.size),
        h('td', { class: 'num' }, p.cl_active),
        h('td', { class: p.cl_waiting > 0 ? 'num warn' : 'num' }, p.cl_waiting),
        h('td', { class: 'num' }, p.sv_active), h('td', { class: 'num' }, p.sv_idle),
        h('td', { class: 'num' }, fmt(p.tps)),
        h('td', {}, sparkline(p.spark, `${p.name}: transactions a second, last minute`))));
    }
    if (!page.data.length) {
      body.append(h('tr', {}, h('td', { colspan: POOL_COLUMNS.length }, poolsState.filter ? 'No pool matches.' : 'No pools yet: they open with their first client.')));
    }
    holder.replaceChildren(table);
    foot.replaceChildren(pager(poolsState, page.total, () => refresh()));
  };
  const stop = every(2000, load);
  refresh = () => load().catch((e) => (e instanceof LoggedOut ? showLogin() : null));
  return stop;
}

function kv(pairs) {
  return h('dl', { class: 'kv' }, pairs.flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, v)]));
}

function simpleTable(caption, columns, rows, empty) {
  const t = h('table', {},
    h('caption', {}, caption),
    h('thead', {}, h('tr', {}, columns.map(([label, num]) => h('th', { scope: 'col', class: num ? 'num' : '' }, label)))),
    h('tbody', {}, rows.length
      ? rows.map((r) => h('tr', {}, r.map((v, i) => h('td', { class: columns[i][1] ? 'num' : '' }, v))))
      : h('tr', {}, h('td', { colspan: columns.length }, empty))));
  return h('div', { class: 'table-wrap' }, t);
}

function poolView(name) {
  const body = h('div');
  view.append(h('p', {}, h('a', { href: '#/pools' }, '← Pools')), h('h1', {}, name), body);
  return every(2000, async () => {
    let d;
    try {
      d = await api(`/ui/api/pool?name=${encodeURIComponent(name)}`);
    } catch (e) {
      if (e.status === 404) {
        body.replaceChildren(h('p', {}, 'This pool is closed (pools close when unused).'));
        return;
      }
      throw e;
    }
    const p = d.pool;
    const now = Date.now();
    body.replaceChildren(
      kv([
        ['Database', p.database], ['User', p.user], ['Tenant', p.tenant || '–'], ['Mode', p.mode],
        ['Size', p.size], ['Clients', `${p.cl_active} active, ${p.cl_waiting} waiting`],
        ['Servers', `${p.sv_active} active, ${p.sv_idle} idle, ${p.sv_login} logging in`],
        ['Transactions', `${fmt(p.transactions)} (${fmt(p.tps)}/s)`],
        ...(p.owner ? [['Owner node', p.owner]] : []),
      ]),
      h('div', { class: 'spark-big' }, sparkline(p.spark, 'Transactions a second, last minute')),
      simpleTable('Servers', [['Id'], ['Address'], ['State'], ['Age', true], ['PID', true], ['TLS']],
        d.servers.map((s) => [s.id, s.addr, s.state, `${fmt(s.age_s)} s`, s.pid, s.tls ? 'yes' : 'no']),
        'No servers open.'),
      simpleTable('Waiting clients', [['Client'], ['Waiting', true]],
        d.waiting.map((w) => [w.addr || 'unix socket', `${fmt(w.waiting_ms)} ms`]),
        'Nobody waits.'),
      simpleTable(
        d.slow_threshold_ms ? `Slow queries (over ${d.slow_threshold_ms} ms)` : 'Slow queries',
        [['When'], ['Duration', true]],
        d.slow_queries.map((q) => [`${fmt((now - q.at) / 1000)} s ago`, `${fmt(q.duration_ms)} ms`]),
        d.slow_threshold_ms ? 'None lately.' : 'Not noted: set slow_query_threshold.'),
    );
  });
}

// ---- optional sections ----

function sectionView(which) {
  const body = h('div');
  const titles = { cluster: 'Cluster', realtime: 'Realtime', replicas: 'Replicas', cache: 'Result cache' };
  view.append(h('h1', {}, titles[which]), body);
  return every(2000, async () => {
    const s = await api('/ui/api/sections');
    const data = s[which];
    if (!data) {
      body.replaceChildren(h('p', {}, `${titles[which]} is not configured on this Shoal.`));
      return;
    }
    body.replaceChildren(renderSection(which, data));
  });
}

function renderSection(which, d) {
  if (which === 'cluster') {
    return h('div', {},
      kv([['This node', `${d.node} (slot ${d.slot})`], ['Lease', d.lease_alive ? 'alive' : 'lost'],
        ['Relayed out', `${d.relayed_out} (${d.parked} parked)`], ['Relayed in', d.relayed_in]]),
      simpleTable('Nodes', [['Node'], ['Relay address'], ['Clients', true], ['Pools owned', true], ['Links', true], ['Streams', true], ['RTT', true], ['Bytes in / out', true]],
        d.nodes.map((n) => [n.id, n.relay, n.load, n.pools.length, n.links, n.streams,
          n.rtt_us ? `${fmt(n.rtt_us / 1000)} ms` : '–', `${fmt(n.bytes_in)} / ${fmt(n.bytes_out)}`]),
        'No nodes.'),
      simpleTable('Pool owners', [['Pool'], ['Owner']],
        d.nodes.flatMap((n) => n.pools.map((p) => [p, n.id])), 'No pool is owned yet.'));
  }
  if (which === 'realtime') {
    return simpleTable('Realtime by tenant', [['Tenant'], ['Sockets', true], ['Channels', true], ['Messages/s', true], ['Messages', true]],
      d.map((r) => [r.tenant, r.sockets, r.channels, fmt(r.messages_per_s), fmt(r.messages)]),
      'No realtime tenants connected.');
  }
  if (which === 'replicas') {
    return simpleTable('Backends', [['Pool'], ['Backend'], ['Role'], ['State'], ['Writes'], ['Lag', true], ['Reads', true], ['Servers', true]],
      d.map((b) => [b.pool, `${b.host}:${b.port}`, b.role, b.state, b.writer ? 'yes' : '',
        b.lag_ms === null ? '–' : `${fmt(b.lag_ms)} ms / ${fmt(b.lag_bytes)} B`, fmt(b.reads), `${b.in_use}/${b.servers}`]),
      'No replicas.');
  }
  return simpleTable('Result cache by pool', [['Pool'], ['Entries', true], ['Memory', true], ['Hits', true], ['Misses', true], ['Hit ratio', true]],
    d.map((c) => [c.pool, fmt(c.entries), `${fmt(c.bytes)} B`, fmt(c.hits), fmt(c.misses),
      c.hit_ratio === null ? '–' : `${(c.hit_ratio * 100).toFixed(1)} %`]),
    'No pool caches replies.');
}

window.addEventListener('shoal:logged-out', () => showLogin());

route();
