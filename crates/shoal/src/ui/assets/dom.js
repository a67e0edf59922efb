// What every view uses: building elements, asking the server, tables with sortable headers
// and pagers.

/** An element: h('a', {href: '#'}, 'text', child...). `on*` attributes become listeners. */
export function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === false || v === null || v === undefined) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'class') e.className = v;
    else if (v === true) e.setAttribute(k, '');
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/** The server said the session is gone: the app shows the login form. */
export class LoggedOut extends Error {}

/** A request to the server; JSON in and out. Rejects with the server's message. */
export async function api(path, { method = 'GET', body } = {}) {
  const opts = { method, credentials: 'same-origin', headers: {} };
  if (body !== undefined) {
    opts.headers['content-type'] = 'application/json';
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  if (r.status === 401) throw new LoggedOut();
  const text = await r.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = { error: text };
  }
  if (!r.ok) {
    const err = new Error((data && data.error) || `${r.status} ${r.statusText}`);
    err.status = r.status;
    err.fields = data && data.errors;
    throw err;
  }
  return data;
}

/** Says `text` to screen readers. */
export function announce(text) {
  const s = document.getElementById('status');
  s.textContent = '';
  setTimeout(() => { s.textContent = text; }, 50);
}

/**
 * A table whose headers sort it: `columns` are {key, label, num, sortable}; `state` holds
 * sort and desc, and `onSort` asks for the rows again.
 */
export function sortableTable(columns, state, onSort, caption) {
  const head = h('tr', {}, columns.map((c) => {
    const th = h('th', { scope: 'col', class: c.num ? 'num' : '' });
    if (c.sortable === false) {
      th.append(c.label);
      return th;
    }
    const active = state.sort === c.key;
    th.setAttribute('aria-sort', active ? (state.desc ? 'descending' : 'ascending') : 'none');
    th.append(h('button', {
      type: 'button',
      class: 'sort',
      onclick: () => {
        state.desc = state.sort === c.key ? !state.desc : !!c.num;
        state.sort = c.key;
        state.page = 1;
        onSort();
      },
    }, c.label, active ? (state.desc ? ' ▾' : ' ▴') : ''));
    return th;
  }));
  const body = h('tbody');
  const table = h('table', {}, h('caption', { class: 'sr-only' }, caption), h('thead', {}, head), body);
  return { table, body };
}

/** Previous/next buttons and where the page is among `total` rows. */
export function pager(state, total, onPage) {
  const pages = Math.max(1, Math.ceil(total / state.per_page));
  const from = total === 0 ? 0 : (state.page - 1) * state.per_page + 1;
  const to = Math.min(total, state.page * state.per_page);
  return h('nav', { class: 'pager', 'aria-label': 'Pages' },
    h('button', { type: 'button', disabled: state.page <= 1, onclick: () => { state.page -= 1; onPage(); } }, 'Previous'),
    h('span', {}, `${from}–${to} of ${total} (page ${state.page} of ${pages})`),
    h('button', { type: 'button', disabled: state.page >= pages, onclick: () => { state.page += 1; onPage(); } }, 'Next'));
}

/** Calls `fn` `ms` after the last of a burst of calls. */
export function debounce(fn, ms) {
  let t = null;
  return (...args) => {
    clearTimeout(t);
    t = setTimeout(() => fn(...args), ms);
  };
}
