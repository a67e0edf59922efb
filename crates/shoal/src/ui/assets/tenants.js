// Tenants: a searchable page of them with ban, terminate and delete, and a form to create or
// edit one that shows the API's validation messages beside the fields they name.

import { h, api, LoggedOut, announce, pager, debounce } from './dom.js';

const state = { page: 1, per_page: 50, search: '' };

function loggedOut(e) {
  if (e instanceof LoggedOut) {
    window.dispatchEvent(new Event('shoal:logged-out'));
    return true;
  }
  return false;
}

// What each user's pool really holds: its own size, else the tenant's default, else 15.
function poolSizes(t) {
  const fallback = t.default_pool_size ?? 15;
  if (!t.users.length) return String(fallback);
  const many = t.users.length > 1;
  return t.users.map((u) => `${many ? `${u.db_user} ` : ''}${u.pool_size ?? fallback}`).join(', ');
}

export function tenantsView(view, every) {
  const search = h('input', { id: 'tenant-search', type: 'search', value: state.search, placeholder: 'tenant id' });
  const message = h('p', { class: 'message', role: 'status' });
  const holder = h('div', { class: 'table-wrap' });
  const foot = h('div');
  view.append(
    h('h1', {}, 'Tenants'),
    h('div', { class: 'toolbar' },
      h('label', { for: 'tenant-search' }, 'Search'), search,
      h('a', { class: 'button', href: '#/tenants/new' }, 'New tenant')),
    message, holder, foot);

  const act = async (what, fn) => {
    try {
      const said = await fn();
      message.className = 'message ok';
      message.textContent = said || what;
      announce(message.textContent);
    } catch (e) {
      if (loggedOut(e)) return;
      message.className = 'message error';
      message.textContent = `${what} failed: ${e.message}`;
    }
    load().catch(loggedOut);
  };

  const load = async () => {
    const q = new URLSearchParams({ page: state.page, per_page: state.per_page, search: state.search });
    const page = await api(`/ui/api/tenants?${q}`);
    const rows = page.data.map((t) => {
      const id = t.external_id;
      const path = `/ui/api/tenants/${encodeURIComponent(id)}`;
      const banned = t.banned;
      return h('tr', { 'data-tenant': id },
        h('th', { scope: 'row' }, h('a', { href: `#/tenants/edit/${encodeURIComponent(id)}` }, id)),
        h('td', {}, `${t.db_host}:${t.db_port}/${t.db_database}`),
        h('td', {}, t.users.map((u) => u.db_user).join(', ')),
        h('td', { class: 'num' }, poolSizes(t)),
        h('td', {}, banned ? h('span', { class: 'badge bad' }, 'banned') : h('span', { class: 'badge' }, 'active')),
        h('td', { class: 'actions' },
          h('button', {
            type: 'button',
            'aria-label': `${banned ? 'Unban' : 'Ban'} ${id}`,
            onclick: () => {
              if (banned) {
                act(`Unban ${id}`, async () => { await api(path, { method: 'PATCH', body: { tenant: { banned: false } } }); return `${id} unbanned.`; });
                return;
              }
              const reason = prompt(`Ban ${id}: its clients are disconnected and new ones refused. Reason (optional):`);
              if (reason === null) return;
              act(`Ban ${id}`, async () => {
                await api(path, { method: 'PATCH', body: { tenant: { banned: true, ban_reason: reason || null } } });
                return `${id} banned; its clients were disconnected.`;
              });
            },
          }, banned ? 'Unban' : 'Ban'),
          h('button', {
            type: 'button',
            'aria-label': `Terminate ${id}'s clients`,
            onclick: () => {
              if (!confirm(`End every client and pool of ${id}? The tenant stays.`)) return;
              act(`Terminate ${id}`, async () => {
                const r = await api(`${path}/terminate`, { method: 'POST' });
                return `${id}: ${r.clients} clients ended.`;
              });
            },
          }, 'Terminate'),
          h('button', {
            type: 'button',
            class: 'danger',
            'aria-label': `Delete ${id}`,
            onclick: () => {
              if (!confirm(`Delete ${id}? Its clients are ended and its settings removed.`)) return;
              act(`Delete ${id}`, async () => { await api(path, { method: 'DELETE' }); return `${id} deleted.`; });
            },
          }, 'Delete')));
    });
    const table = h('table', {},
      h('caption', { class: 'sr-only' }, 'Tenants'),
      h('thead', {}, h('tr', {}, ['Tenant', 'Database', 'Users', 'Pool size', 'State', 'Actions']
        .map((c) => h('th', { scope: 'col', class: c === 'Pool size' ? 'num' : '' }, c)))),
      h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: 6 }, state.search ? 'No tenant matches.' : 'No tenants yet.'))));
    holder.replaceChildren(table);
    foot.replaceChildren(pager(state, page.total, () => load().catch(loggedOut)));
  };

  search.addEventListener('input', debounce(() => {
    state.search = search.value.trim();
    state.page = 1;
    load().catch(loggedOut);
  }, 250));
  return every(5000, load);
}

// ---- the form ----

/** A labelled input whose errors (the API's, for `field`) show beneath it. */
function field(name, label, attrs = {}, hint = '') {
  const id = `f-${name.replace(/[^a-z0-9]+/gi, '-')}`;
  const input = attrs.type === 'textarea'
    ? h('textarea', { id, name, rows: 3, 'aria-describedby': `${id}-err${hint ? ` ${id}-hint` : ''}`, ...attrs, type: null })
    : h('input', { id, name, 'aria-describedby': `${id}-err${hint ? ` ${id}-hint` : ''}`, ...attrs });
  if (attrs.type === 'textarea' && attrs.value) input.value = attrs.value;
  const wrap = h('div', { class: attrs.type === 'checkbox' ? 'field check' : 'field', 'data-field': name },
    attrs.type === 'checkbox' ? [input, h('label', { for: id }, label)] : [h('label', { for: id }, label), input],
    hint ? h('small', { id: `${id}-hint` }, hint) : null,
    h('p', { id: `${id}-err`, class: 'field-error' }));
  return wrap;
}

const num = (v) => (v === '' || v === undefined || v === null ? null : Number(v));
const str = (v) => (v === '' ? null : v);

function userFieldset(i, u, editing) {
  const p = `users[${i}]`;
  const fs = h('fieldset', { class: 'user', 'data-user': i },
    h('legend', {}, `User ${i + 1}`),
    field(`${p}.db_user`, 'Database user', { value: u.db_user || '', required: true, autocomplete: 'off' }),
    field(`${p}.db_password`, 'Password', { type: 'password', autocomplete: 'new-password' },
      editing && u.db_user ? 'Leave empty to keep the current password.' : ''),
    field(`${p}.pool_size`, 'Pool size', { type: 'number', min: 1, max: 10000, value: u.pool_size ?? '' }, 'Empty: the tenant\'s default.'),
    field(`${p}.max_clients`, 'Max clients', { type: 'number', min: 1, value: u.max_clients ?? '' }),
    h('div', { class: 'field', 'data-field': `${p}.mode_type` },
      h('label', { for: `f-mode-${i}` }, 'Pool mode'),
      h('select', { id: `f-mode-${i}`, name: `${p}.mode_type` },
        ['transaction', 'session'].map((m) => h('option', { value: m, selected: (u.mode_type || 'transaction') === m }, m))),
      h('p', { class: 'field-error' })),
    field(`${p}.is_manager`, 'Manager (runs auth_query)', { type: 'checkbox', checked: !!u.is_manager }),
    h('button', { type: 'button', class: 'quiet remove-user', onclick: () => fs.remove() }, `Remove user ${i + 1}`));
  return fs;
}

export function tenantFormView(view, id) {
  const editing = id !== null;
  const form = h('form', { class: 'tenant-form', novalidate: true });
  const formError = h('div', { class: 'form-error', role: 'alert' });
  view.append(
    h('p', {}, h('a', { href: '#/tenants' }, '← Tenants')),
    h('h1', {}, editing ? `Edit ${id}` : 'New tenant'),
    formError, form);
  let nextUser = 0;

  const render = (t) => {
    const users = h('div', { class: 'users', 'data-field': 'users' });
    for (const u of (t.users.length ? t.users : [{}])) users.append(userFieldset(nextUser++, u, editing));
    form.replaceChildren(
      h('fieldset', {}, h('legend', {}, 'Database'),
        editing ? null : field('external_id', 'Tenant id', { value: '', required: true, autocomplete: 'off' },
          'Lowercase letters, digits and hyphens; clients name it with options=reference=<id>.'),
        field('db_host', 'Host', { value: t.db_host || '', required: true }),
        field('db_port', 'Port', { type: 'number', min: 1, max: 65535, value: t.db_port ?? 5432 }),
        field('db_database', 'Database', { value: t.db_database || '', required: true })),
      h('fieldset', {}, h('legend', {}, 'Users'), users,
        h('p', { class: 'field-error', 'data-field': 'users' }),
        h('button', { type: 'button', class: 'quiet', onclick: () => users.append(userFieldset(nextUser++, {}, false)) }, 'Add a user'),
        field('require_user', 'Only the listed users may log in', { type: 'checkbox', checked: t.require_user ?? true }),
        field('auth_query', 'auth_query (run by the manager for other users)', { value: t.auth_query || '' })),
      h('fieldset', {}, h('legend', {}, 'Pool'),
        field('default_pool_size', 'Default pool size', { type: 'number', min: 1, value: t.default_pool_size ?? '' }, 'Empty: 15.'),
        field('default_max_clients', 'Default max clients', { type: 'number', min: 1, value: t.default_max_clients ?? '' }, 'Empty: 1000.'),
        field('client_idle_timeout', 'Client idle timeout (seconds, 0: none)', { type: 'number', min: 0, value: t.client_idle_timeout ?? 0 })),
      h('fieldset', {}, h('legend', {}, 'Limits'),
        field('max_statement_timeout', 'Max statement time', { value: t.max_statement_timeout || '' }, 'e.g. 30s'),
        field('rate_limit', 'Transactions a second', { type: 'number', min: 0, step: 'any', value: t.rate_limit ?? '' }),
        field('rate_burst', 'Burst', { type: 'number', min: 0, step: 'any', value: t.rate_burst ?? '' }),
        field('max_concurrency', 'Transactions at once', { type: 'number', min: 1, value: t.max_concurrency ?? '' }),
        field('limit_wait', 'Wait for a limit up to', { value: t.limit_wait || '' }, 'e.g. 2s')),
      h('fieldset', {}, h('legend', {}, 'Access'),
        field('allow_list', 'Allowed client networks (one CIDR a line)', { type: 'textarea', value: (t.allow_list || ['0.0.0.0/0', '::/0']).join('\n') }),
        field('enforce_ssl', 'Clients must use TLS', { type: 'checkbox', checked: !!t.enforce_ssl }),
        field('upstream_ssl', 'TLS to PostgreSQL', { type: 'checkbox', checked: !!t.upstream_ssl }),
        editing ? field('banned', 'Banned', { type: 'checkbox', checked: !!t.banned }) : null,
        editing ? field('ban_reason', 'Ban reason', { value: t.ban_reason || '' }) : null),
      h('div', { class: 'form-actions' },
        h('button', { type: 'submit' }, editing ? 'Save' : 'Create tenant'),
        h('a', { href: '#/tenants' }, 'Cancel')));
  };

  const read = () => {
    const v = (name) => form.elements.namedItem(name);
    const val = (name) => (v(name) ? v(name).value.trim() : '');
    const checked = (name) => !!(v(name) && v(name).checked);
    const users = [...form.querySelectorAll('fieldset.user')].map((fs) => {
      const p = `users[${fs.dataset.user}]`;
      const u = {
        db_user: val(`${p}.db_user`),
        pool_size: num(val(`${p}.pool_size`)),
        max_clients: num(val(`${p}.max_clients`)),
        mode_type: val(`${p}.mode_type`),
        is_manager: checked(`${p}.is_manager`),
      };
      const pw = v(`${p}.db_password`).value;
      if (pw !== '' || !editing) u.db_password = pw;
      return u;
    });
    const t = {
      db_host: val('db_host'),
      db_port: num(val('db_port')),
      db_database: val('db_database'),
      users,
      require_user: checked('require_user'),
      auth_query: str(val('auth_query')),
      default_pool_size: num(val('default_pool_size')),
      default_max_clients: num(val('default_max_clients')),
      client_idle_timeout: num(val('client_idle_timeout')) ?? 0,
      max_statement_timeout: str(val('max_statement_timeout')),
      rate_limit: num(val('rate_limit')),
      rate_burst: num(val('rate_burst')),
      max_concurrency: num(val('max_concurrency')),
      limit_wait: str(val('limit_wait')),
      allow_list: val('allow_list').split('\n').map((s) => s.trim()).filter(Boolean),
      enforce_ssl: checked('enforce_ssl'),
      upstream_ssl: checked('upstream_ssl'),
    };
    if (editing) {
      t.banned = checked('banned');
      t.ban_reason = str(val('ban_reason'));
    }
    return t;
  };

  // The form's users are numbered as they were added; the API numbers them as sent.
  const showErrors = (fields) => {
    const order = [...form.querySelectorAll('fieldset.user')].map((fs) => fs.dataset.user);
    const local = (name) => name.replace(/^users\[(\d+)\]/, (_, i) => `users[${order[Number(i)] ?? i}]`);
    const loose = [];
    let first = null;
    for (const [name, messages] of Object.entries(fields)) {
      const exact = form.querySelector(`[data-field="${CSS.escape(local(name))}"]`);
      const item = local(name).match(/^(.*)\[(\d+)\]$/);
      const target = exact || (item && form.querySelector(`[data-field="${CSS.escape(item[1])}"]`));
      // A list's item (allow_list[1]) is a line of its field.
      const text = (!exact && item ? `line ${Number(item[2]) + 1}: ` : '') + messages.join('; ');
      const slot = target && (target.classList.contains('field-error') ? target : target.querySelector('.field-error'));
      if (slot) {
        slot.textContent = text;
        const input = target.querySelector('input, select, textarea');
        if (input) input.setAttribute('aria-invalid', 'true');
        first = first || input || slot;
      } else {
        loose.push(`${name}: ${text}`);
      }
    }
    if (loose.length) formError.replaceChildren(h('p', {}, 'Not saved:'), h('ul', {}, loose.map((l) => h('li', {}, l))));
    else formError.replaceChildren(h('p', {}, 'Not saved: see the fields marked below.'));
    if (first && first.focus) first.focus();
  };

  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();
    formError.replaceChildren();
    for (const e of form.querySelectorAll('.field-error')) e.textContent = '';
    for (const e of form.querySelectorAll('[aria-invalid]')) e.removeAttribute('aria-invalid');
    const t = read();
    const target = editing ? id : (form.elements.namedItem('external_id').value.trim());
    if (!editing && !target) {
      showErrors({ external_id: ["can't be blank"] });
      return;
    }
    try {
      await api(`/ui/api/tenants/${encodeURIComponent(target)}`, {
        method: editing ? 'PATCH' : 'PUT',
        body: { tenant: t },
      });
      announce(editing ? `${target} saved.` : `${target} created.`);
      location.hash = '#/tenants';
    } catch (e) {
      if (loggedOut(e)) return;
      if (e.fields) showErrors(e.fields);
      else formError.replaceChildren(h('p', {}, `Not saved: ${e.message}`));
    }
  });

  if (editing) {
    api(`/ui/api/tenants/${encodeURIComponent(id)}`)
      .then((r) => render(r.data))
      .catch((e) => {
        if (!loggedOut(e)) formError.replaceChildren(h('p', {}, `Cannot load ${id}: ${e.message}`));
      });
  } else {
    render({ users: [] });
  }
  return () => {};
}
