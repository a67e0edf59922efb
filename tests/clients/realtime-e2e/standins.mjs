// Stand-ins for the two Supabase services that Supabase's own Realtime e2e tool
// (realtime-check.ts) needs beside Realtime: Auth (create a user, sign in with a password,
// sign out) and PostgREST (insert, update and delete with eq/in filters). Each REST request
// runs in PostgreSQL — through Shoal's pooler — as the token's role with
// `request.jwt.claims` set, so row-level security and `realtime.send` triggers decide as
// they do on Supabase. Everything under /realtime/v1 (HTTP and WebSocket) goes to Shoal's
// realtime listener for the tenant. Only what the tool uses is here; anything else is a 404.
//
// Environment: REALTIME (host:port of Shoal's realtime listener), TENANT, DATABASE_URL
// (the tenant's database through Shoal), JWT_SECRET (the tenant's). Prints
// `listening PORT` once it accepts requests.
import crypto from 'node:crypto'
import http from 'node:http'
import net from 'node:net'
import pg from 'pg'

const [rtHost, rtPort] = process.env.REALTIME.split(':')
const tenant = process.env.TENANT
const secret = process.env.JWT_SECRET
const db = new pg.Pool({ connectionString: process.env.DATABASE_URL, max: 8 })

const b64url = (buf) => Buffer.from(buf).toString('base64url')

function sign(claims) {
  const head = b64url(JSON.stringify({ alg: 'HS256', typ: 'JWT' }))
  const body = b64url(JSON.stringify(claims))
  const mac = crypto.createHmac('sha256', secret).update(`${head}.${body}`).digest()
  return `${head}.${body}.${b64url(mac)}`
}

/// The claims of an HS256 token signed with the tenant's secret and not expired, or null.
function verify(token) {
  const parts = (token ?? '').split('.')
  if (parts.length !== 3) return null
  const mac = crypto.createHmac('sha256', secret).update(`${parts[0]}.${parts[1]}`).digest()
  const given = Buffer.from(parts[2], 'base64url')
  if (given.length !== mac.length || !crypto.timingSafeEqual(given, mac)) return null
  let claims
  try {
    claims = JSON.parse(Buffer.from(parts[1], 'base64url'))
  } catch {
    return null
  }
  if (typeof claims.exp !== 'number' || claims.exp * 1000 < Date.now()) return null
  return claims
}

const bearer = (req) => {
  const h = req.headers.authorization ?? ''
  return h.toLowerCase().startsWith('bearer ') ? h.slice(7) : req.headers.apikey
}

const send = (res, status, body) => {
  const text = body === undefined ? '' : JSON.stringify(body)
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) })
  res.end(text)
}

const readBody = (req) =>
  new Promise((resolve, reject) => {
    const chunks = []
    req.on('data', (c) => chunks.push(c))
    req.on('end', () => {
      const text = Buffer.concat(chunks).toString()
      try {
        resolve(text === '' ? null : JSON.parse(text))
      } catch (e) {
        reject(e)
      }
    })
    req.on('error', reject)
  })

// ---- Auth ---------------------------------------------------------------------------

/// What GoTrue keeps: users with a password hash, in the `auth` schema that policies and
/// `auth.uid()` read.
const AUTH_SCHEMA = `
  CREATE SCHEMA IF NOT EXISTS auth;
  CREATE TABLE IF NOT EXISTS auth.users (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    email text UNIQUE NOT NULL,
    encrypted_password text NOT NULL,
    email_confirmed_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now()
  );
  CREATE OR REPLACE FUNCTION auth.uid() RETURNS uuid LANGUAGE sql STABLE AS
    $$ SELECT nullif(current_setting('request.jwt.claims', true)::jsonb ->> 'sub', '')::uuid $$;
  CREATE OR REPLACE FUNCTION auth.role() RETURNS text LANGUAGE sql STABLE AS
    $$ SELECT current_setting('request.jwt.claims', true)::jsonb ->> 'role' $$;
  CREATE OR REPLACE FUNCTION auth.jwt() RETURNS jsonb LANGUAGE sql STABLE AS
    $$ SELECT coalesce(nullif(current_setting('request.jwt.claims', true), ''), '{}')::jsonb $$;
  GRANT USAGE ON SCHEMA auth TO anon, authenticated, service_role;
`

const scrypt = (password, salt) =>
  new Promise((resolve, reject) =>
    crypto.scrypt(password, salt, 32, (e, key) => (e ? reject(e) : resolve(key))),
  )

async function hashPassword(password) {
  const salt = crypto.randomBytes(16)
  return `${salt.toString('hex')}:${(await scrypt(password, salt)).toString('hex')}`
}

async function checkPassword(password, stored) {
  const [salt, hash] = stored.split(':')
  const key = await scrypt(password, Buffer.from(salt, 'hex'))
  return crypto.timingSafeEqual(key, Buffer.from(hash, 'hex'))
}

const userJson = (row) => ({
  id: row.id,
  aud: 'authenticated',
  role: 'authenticated',
  email: row.email,
  email_confirmed_at: row.email_confirmed_at,
  created_at: row.created_at,
  app_metadata: { provider: 'email', providers: ['email'] },
  user_metadata: {},
  identities: [],
})

const authError = (res, status, code, msg) => send(res, status, { code: status, error_code: code, msg })

async function auth(req, res, path, url) {
  const claims = verify(bearer(req))
  if (req.method === 'POST' && path === '/admin/users') {
    if (claims?.role !== 'service_role') return authError(res, 403, 'not_admin', 'User not allowed')
    const { email, password, email_confirm } = (await readBody(req)) ?? {}
    if (!email || !password) return authError(res, 400, 'validation_failed', 'email and password are required')
    try {
      const { rows } = await db.query(
        `INSERT INTO auth.users (email, encrypted_password, email_confirmed_at)
         VALUES ($1, $2, CASE WHEN $3 THEN now() END) RETURNING *`,
        [email, await hashPassword(password), !!email_confirm],
      )
      return send(res, 200, userJson(rows[0]))
    } catch (e) {
      if (e.code === '23505') return authError(res, 422, 'email_exists', 'A user with this email address has already been registered')
      throw e
    }
  }
  if (req.method === 'POST' && path === '/token' && url.searchParams.get('grant_type') === 'password') {
    const { email, password } = (await readBody(req)) ?? {}
    const { rows } = await db.query('SELECT * FROM auth.users WHERE email = $1', [email ?? ''])
    if (rows.length === 0 || !(await checkPassword(String(password ?? ''), rows[0].encrypted_password))) {
      return authError(res, 400, 'invalid_credentials', 'Invalid login credentials')
    }
    const now = Math.floor(Date.now() / 1000)
    const expiresIn = 3600
    const user = userJson(rows[0])
    const accessToken = sign({
      aud: 'authenticated',
      sub: user.id,
      email: user.email,
      role: 'authenticated',
      iat: now,
      exp: now + expiresIn,
      session_id: crypto.randomUUID(),
    })
    return send(res, 200, {
      access_token: accessToken,
      token_type: 'bearer',
      expires_in: expiresIn,
      expires_at: now + expiresIn,
      refresh_token: crypto.randomBytes(16).toString('hex'),
      user,
    })
  }
  if (req.method === 'GET' && path === '/user') {
    if (!claims?.sub) return authError(res, 401, 'no_authorization', 'This endpoint requires a valid Bearer token')
    const { rows } = await db.query('SELECT * FROM auth.users WHERE id = $1', [claims.sub])
    if (rows.length === 0) return authError(res, 404, 'user_not_found', 'User not found')
    return send(res, 200, userJson(rows[0]))
  }
  if (req.method === 'POST' && path === '/logout') {
    res.writeHead(204).end()
    return
  }
  return authError(res, 404, 'not_found', `no such Auth endpoint: ${req.method} ${path}`)
}

// ---- PostgREST ----------------------------------------------------------------------

const ident = (name) => `"${String(name).replace(/"/g, '""')}"`

/// `in.(a,"b,c")` → ['a', 'b,c'].
function listItems(text) {
  const inner = text.replace(/^\(/, '').replace(/\)$/, '')
  const items = []
  let cur = ''
  let quoted = false
  for (let i = 0; i < inner.length; i++) {
    const c = inner[i]
    if (c === '"') quoted = !quoted
    else if (c === '\\' && quoted) cur += inner[++i] ?? ''
    else if (c === ',' && !quoted) {
      items.push(cur)
      cur = ''
    } else cur += c
  }
  if (inner.length > 0) items.push(cur)
  return items
}

const OPERATORS = { eq: '=', neq: '<>', lt: '<', lte: '<=', gt: '>', gte: '>=', like: 'LIKE', ilike: 'ILIKE' }
const RESERVED = new Set(['select', 'columns', 'on_conflict', 'order', 'limit', 'offset'])

/// The WHERE clause of PostgREST's horizontal filters on the table aliased `t`, its
/// parameters appended to `params`.
function where(url, params) {
  const conds = []
  for (const [column, spec] of url.searchParams) {
    if (RESERVED.has(column)) continue
    const dot = spec.indexOf('.')
    const [op, value] = dot < 0 ? [spec, ''] : [spec.slice(0, dot), spec.slice(dot + 1)]
    if (op === 'in') {
      params.push(listItems(value))
      conds.push(`t.${ident(column)} = ANY($${params.length})`)
    } else if (op === 'is') {
      const v = { null: 'NULL', true: 'TRUE', false: 'FALSE' }[value.toLowerCase()]
      if (!v) throw restError(400, 'PGRST100', `"is" takes null, true or false, not ${value}`)
      conds.push(`t.${ident(column)} IS ${v}`)
    } else if (OPERATORS[op]) {
      params.push(op.endsWith('like') ? value.replace(/\*/g, '%') : value)
      conds.push(`t.${ident(column)} ${OPERATORS[op]} $${params.length}`)
    } else {
      throw restError(400, 'PGRST100', `unknown filter operator "${op}" on ${column}`)
    }
  }
  return conds.length > 0 ? ` WHERE ${conds.join(' AND ')}` : ''
}

const restError = (status, code, message) => Object.assign(new Error(message), { status, restCode: code })

const returning = (url) => {
  const select = url.searchParams.get('select')
  if (!select) return null
  return select === '*' ? '*' : select.split(',').map((c) => ident(c.trim())).join(', ')
}

async function rest(req, res, table, url) {
  const claims = verify(bearer(req))
  if (!claims) return send(res, 401, { code: 'PGRST301', message: 'JWT invalid or expired', details: null, hint: null })
  const target = `${ident('public')}.${ident(table)}`
  const body = req.method === 'POST' || req.method === 'PATCH' ? await readBody(req) : null
  const params = []
  let statement
  if (req.method === 'POST') {
    const rows = Array.isArray(body) ? body : [body ?? {}]
    const listed = url.searchParams.get('columns')
    const columns = listed ? listItems(listed) : Object.keys(rows[0] ?? {})
    const cols = columns.map(ident).join(', ')
    params.push(JSON.stringify(rows))
    statement = `INSERT INTO ${target} (${cols}) SELECT ${cols} FROM jsonb_populate_recordset(NULL::${target}, $1::jsonb)`
  } else if (req.method === 'PATCH') {
    const columns = Object.keys(body ?? {})
    if (columns.length === 0) return send(res, 204)
    params.push(JSON.stringify(body))
    const set = columns.map((c) => `${ident(c)} = p.${ident(c)}`).join(', ')
    statement = `UPDATE ${target} AS t SET ${set} FROM jsonb_populate_record(NULL::${target}, $1::jsonb) AS p`
    statement += where(url, params)
  } else if (req.method === 'DELETE') {
    statement = `DELETE FROM ${target} AS t` + where(url, params)
  } else {
    return send(res, 405, { code: 'PGRST117', message: `${req.method} is not supported here`, details: null, hint: null })
  }
  const cols = returning(url)
  const sql = cols
    ? `WITH r AS (${statement} RETURNING ${cols}) SELECT coalesce(json_agg(r), '[]')::text AS rows FROM r`
    : statement
  const client = await db.connect()
  try {
    await client.query('BEGIN')
    await client.query(
      "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true), set_config('request.method', $3, true)",
      [claims.role ?? 'anon', JSON.stringify(claims), req.method],
    )
    const result = await client.query(sql, params)
    await client.query('COMMIT')
    if (cols) return send(res, req.method === 'POST' ? 201 : 200, JSON.parse(result.rows[0].rows))
    res.writeHead(req.method === 'POST' ? 201 : 204).end()
  } catch (e) {
    await client.query('ROLLBACK').catch(() => {})
    throw e
  } finally {
    client.release()
  }
}

/// PostgREST's statuses for PostgreSQL's errors (the common ones).
function pgStatus(code, role) {
  if (code === '42501') return role === 'anon' ? 401 : 403
  if (code === '23505' || code === '23503') return 409
  if (code === '42P01' || code === '42883') return 404
  if (code?.startsWith('23') || code?.startsWith('22')) return 400
  return 400
}

// ---- Realtime: to Shoal --------------------------------------------------------------

const realtimePath = (path) => `/t/${encodeURIComponent(tenant)}${path}`

function proxy(req, res, url) {
  const upstream = http.request(
    { host: rtHost, port: rtPort, method: req.method, path: realtimePath(url.pathname) + url.search, headers: req.headers },
    (up) => {
      res.writeHead(up.statusCode, up.headers)
      up.pipe(res)
    },
  )
  upstream.on('error', (e) => send(res, 502, { error: `Shoal's realtime listener: ${e.message}` }))
  req.pipe(upstream)
}

function upgrade(req, socket, head) {
  const url = new URL(req.url, 'http://x')
  if (!url.pathname.startsWith('/realtime/v1/')) return socket.end('HTTP/1.1 404 Not Found\r\n\r\n')
  const up = net.connect(Number(rtPort), rtHost, () => {
    let lines = `${req.method} ${realtimePath(url.pathname)}${url.search} HTTP/1.1\r\n`
    for (let i = 0; i < req.rawHeaders.length; i += 2) lines += `${req.rawHeaders[i]}: ${req.rawHeaders[i + 1]}\r\n`
    up.write(lines + '\r\n')
    if (head.length > 0) up.write(head)
    up.pipe(socket)
    socket.pipe(up)
  })
  const close = () => {
    up.destroy()
    socket.destroy()
  }
  up.on('error', close)
  socket.on('error', close)
  up.on('close', close)
  socket.on('close', close)
}

// ---- The front door ------------------------------------------------------------------

const server = http.createServer(async (req, res) => {
  const url = new URL(req.url, 'http://x')
  const path = url.pathname
  try {
    if (path.startsWith('/realtime/v1/')) return proxy(req, res, url)
    if (path.startsWith('/auth/v1/')) return await auth(req, res, path.slice('/auth/v1'.length), url)
    const m = path.match(/^\/rest\/v1\/([^/]+)$/)
    if (m) return await rest(req, res, decodeURIComponent(m[1]), url)
    send(res, 404, { error: `no such endpoint: ${path}` })
  } catch (e) {
    if (res.headersSent) return res.destroy()
    if (e.restCode) return send(res, e.status, { code: e.restCode, message: e.message, details: null, hint: null })
    if (e.code && /^[0-9A-Z]{5}$/.test(e.code)) {
      const role = verify(bearer(req))?.role
      return send(res, pgStatus(e.code, role), { code: e.code, message: e.message, details: e.detail ?? null, hint: e.hint ?? null })
    }
    if (e instanceof SyntaxError) return send(res, 400, { code: 'PGRST102', message: 'Empty or invalid json', details: null, hint: null })
    console.error(e)
    send(res, 500, { error: e.message })
  }
})
server.on('upgrade', upgrade)

await db.query(AUTH_SCHEMA)
server.listen(Number(process.env.PORT ?? 0), '127.0.0.1', () => {
  console.log(`listening ${server.address().port}`)
})
