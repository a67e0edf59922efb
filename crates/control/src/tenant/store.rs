//! Where tenants are kept: an embedded SQLite file (the default; nothing to set up) or a
//! PostgreSQL metadata database shared by several Shoal nodes, which tell each other about
//! changes with NOTIFY. Tenants are stored as their JSON with every password sealed.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::crypto::{CryptoError, Sealer};
use super::model::Tenant;
use crate::config::StoreSection;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("tenant store: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("tenant store: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("tenant store: {0}")]
    Io(#[from] std::io::Error),
    #[error("tenant store: a stored tenant is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("tenant store: {0}")]
    Crypto(#[from] CryptoError),
    #[error("tenant store: {0}")]
    Config(String),
}

/// The NOTIFY channel a shared store announces changes on (payload: the tenant id).
pub const CHANNEL: &str = "shoal_tenants";

/// What a tenant store keeps: sealed tenant bodies by id. A backend knows nothing of tenants
/// or secrets ([`Store`] seals and reads the bodies), so adding one (a cluster's etcd, say)
/// means these four operations and nothing else.
pub trait Backend: Send + Sync {
    /// Every (id, body), by id.
    fn rows(&self) -> BoxFuture<'_, Vec<(String, String)>>;
    fn row<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<String>>;
    /// Creates or replaces; true when it was created.
    fn upsert(&self, id: String, body: String) -> BoxFuture<'_, bool>;
    /// True when it existed.
    fn remove(&self, id: String) -> BoxFuture<'_, bool>;
    /// One page of the rows whose id contains `search`, by id, and how many there are.
    /// Backends that can should answer this themselves: a page then costs what it holds,
    /// not what the store holds.
    fn page(&self, search: String, offset: usize, limit: usize) -> BoxFuture<'_, RowPage> {
        Box::pin(async move {
            let found: Vec<(String, String)> = self
                .rows()
                .await?
                .into_iter()
                .filter(|(id, _)| id.contains(&search))
                .collect();
            let total = found.len();
            let rows = found.into_iter().skip(offset).take(limit).collect();
            Ok((rows, total))
        })
    }
    /// Where other nodes' changes are announced, for a store several nodes share.
    fn shared_url(&self) -> Option<&str> {
        None
    }
    fn name(&self) -> &'static str;
}

/// A page of (id, body) rows, and how many rows match in all.
pub type RowPage = (Vec<(String, String)>, usize);

/// `search` as a LIKE pattern matching ids that contain it (`\` escapes).
fn contains_pattern(search: &str) -> String {
    let mut p = String::with_capacity(search.len() + 2);
    p.push('%');
    for c in search.chars() {
        if matches!(c, '%' | '_' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push('%');
    p
}

/// A backend's answer.
pub type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A tenant store: a [`Backend`], and the sealing of passwords at rest.
pub struct Store {
    backend: Box<dyn Backend>,
    sealer: Sealer,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.backend.name())
    }
}

impl Store {
    /// Opens (and creates or migrates) the store `section` names.
    pub async fn open(section: &StoreSection) -> Result<Store, StoreError> {
        let url = section.url();
        let key = std::env::var(&section.encryption_key_env).ok();
        if let Some(path) = url.strip_prefix("sqlite:") {
            let path = Path::new(path);
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let sealer = match key {
                Some(k) => Sealer::from_text(&k)?,
                None => Sealer::from_text(&key_file(&section.data_dir)?)?,
            };
            let path = path.to_owned();
            let conn = tokio::task::spawn_blocking(move || open_sqlite(&path))
                .await
                .map_err(|e| StoreError::Config(e.to_string()))??;
            Ok(Store::with(
                Box::new(Sqlite {
                    conn: Arc::new(Mutex::new(conn)),
                }),
                sealer,
            ))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let Some(k) = key else {
                return Err(StoreError::Config(format!(
                    "a shared (postgres) store needs the encryption key in ${} (the same on every node)",
                    section.encryption_key_env
                )));
            };
            let sealer = Sealer::from_text(&k)?;
            let client = pg_connect(&url, &section.tls_settings()).await?;
            migrate_pg(&client).await?;
            Ok(Store::with(Box::new(Postgres { client, url }), sealer))
        } else {
            Err(StoreError::Config(
                "store.url must start with sqlite: or postgres://".into(),
            ))
        }
    }

    /// A store over any backend.
    pub fn with(backend: Box<dyn Backend>, sealer: Sealer) -> Store {
        Store { backend, sealer }
    }

    /// The shared store's URL (for the change listener).
    pub fn shared_url(&self) -> Option<&str> {
        self.backend.shared_url()
    }

    fn to_stored(&self, t: &Tenant) -> Result<String, StoreError> {
        let mut v = serde_json::to_value(t)?;
        if let (Some(obj), Some(s)) = (v.as_object_mut(), &t.jwt_secret) {
            obj.insert(
                "jwt_secret".into(),
                serde_json::Value::String(self.sealer.seal(s)),
            );
        }
        if let (Some(obj), Some(j)) = (v.as_object_mut(), &t.jwt_jwks) {
            obj.insert(
                "jwt_jwks".into(),
                serde_json::Value::String(self.sealer.seal(&j.to_string())),
            );
        }
        if let Some(users) = v.get_mut("users").and_then(|u| u.as_array_mut()) {
            for (u, src) in users.iter_mut().zip(&t.users) {
                if let (Some(obj), Some(p)) = (u.as_object_mut(), &src.db_password) {
                    obj.insert(
                        "db_password".into(),
                        serde_json::Value::String(self.sealer.seal(p)),
                    );
                }
            }
        }
        Ok(v.to_string())
    }

    fn read_stored(&self, id: &str, body: &str) -> Result<Tenant, StoreError> {
        let mut v: serde_json::Value = serde_json::from_str(body)?;
        if let Some(obj) = v.as_object_mut() {
            if let Some(serde_json::Value::String(s)) = obj.get("jwt_secret") {
                let plain = self.sealer.open(s)?;
                obj.insert("jwt_secret".into(), serde_json::Value::String(plain));
            }
            if let Some(serde_json::Value::String(s)) = obj.get("jwt_jwks") {
                let plain: serde_json::Value = serde_json::from_str(&self.sealer.open(s)?)?;
                obj.insert("jwt_jwks".into(), plain);
            }
        }
        if let Some(users) = v.get_mut("users").and_then(|u| u.as_array_mut()) {
            for u in users {
                if let Some(obj) = u.as_object_mut() {
                    if let Some(serde_json::Value::String(s)) = obj.get("db_password") {
                        let plain = self.sealer.open(s)?;
                        obj.insert("db_password".into(), serde_json::Value::String(plain));
                    }
                }
            }
        }
        let mut t: Tenant = serde_json::from_value(v)?;
        t.external_id = id.to_owned();
        Ok(t)
    }

    /// One page of the tenants whose id contains `search` (ids are lowercase: so is the
    /// search), by id, and how many match.
    pub async fn page(
        &self,
        search: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<Tenant>, usize), StoreError> {
        let (rows, total) = self
            .backend
            .page(search.to_lowercase(), offset, limit)
            .await?;
        let tenants = rows
            .iter()
            .map(|(id, body)| self.read_stored(id, body))
            .collect::<Result<_, _>>()?;
        Ok((tenants, total))
    }

    /// Every tenant.
    pub async fn list(&self) -> Result<Vec<Tenant>, StoreError> {
        self.backend
            .rows()
            .await?
            .iter()
            .map(|(id, body)| self.read_stored(id, body))
            .collect()
    }

    pub async fn get(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        let body = self.backend.row(id).await?;
        body.map(|b| self.read_stored(id, &b)).transpose()
    }

    /// Creates or replaces a tenant; true when it was created.
    pub async fn put(&self, t: &Tenant) -> Result<bool, StoreError> {
        let body = self.to_stored(t)?;
        self.backend.upsert(t.external_id.clone(), body).await
    }

    /// Deletes a tenant; true when it existed.
    pub async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        self.backend.remove(id.to_owned()).await
    }
}

/// The embedded store: SQLite in the data directory, one node.
struct Sqlite {
    conn: Arc<Mutex<rusqlite::Connection>>,
}

impl Backend for Sqlite {
    fn rows(&self) -> BoxFuture<'_, Vec<(String, String)>> {
        let conn = self.conn.clone();
        Box::pin(blocking(move || {
            let c = conn.lock().unwrap_or_else(|e| e.into_inner());
            let mut st = c.prepare("SELECT external_id, body FROM tenants ORDER BY external_id")?;
            let rows = st
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        }))
    }

    fn page(&self, search: String, offset: usize, limit: usize) -> BoxFuture<'_, RowPage> {
        let conn = self.conn.clone();
        Box::pin(blocking(move || {
            let c = conn.lock().unwrap_or_else(|e| e.into_inner());
            let pattern = contains_pattern(&search);
            let total: i64 = c.query_row(
                "SELECT count(*) FROM tenants WHERE external_id LIKE ?1 ESCAPE '\\'",
                [&pattern],
                |r| r.get(0),
            )?;
            let mut st = c.prepare(
                "SELECT external_id, body FROM tenants WHERE external_id LIKE ?1 ESCAPE '\\'
                 ORDER BY external_id LIMIT ?2 OFFSET ?3",
            )?;
            let rows = st
                .query_map(
                    rusqlite::params![
                        pattern,
                        limit.min(i64::MAX as usize) as i64,
                        offset.min(i64::MAX as usize) as i64
                    ],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )?
                .collect::<Result<Vec<_>, _>>()?;
            Ok((rows, total as usize))
        }))
    }

    fn row<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<String>> {
        let conn = self.conn.clone();
        let id = id.to_owned();
        Box::pin(blocking(move || {
            let c = conn.lock().unwrap_or_else(|e| e.into_inner());
            let mut st = c.prepare("SELECT body FROM tenants WHERE external_id = ?1")?;
            let mut rows = st.query([&id])?;
            Ok(match rows.next()? {
                Some(r) => Some(r.get(0)?),
                None => None,
            })
        }))
    }

    fn upsert(&self, id: String, body: String) -> BoxFuture<'_, bool> {
        let conn = self.conn.clone();
        Box::pin(blocking(move || {
            let c = conn.lock().unwrap_or_else(|e| e.into_inner());
            let existed: bool = c
                .prepare("SELECT 1 FROM tenants WHERE external_id = ?1")?
                .exists([&id])?;
            c.execute(
                "INSERT INTO tenants (external_id, body, updated_at) VALUES (?1, ?2, strftime('%s','now'))
                 ON CONFLICT (external_id) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at",
                rusqlite::params![id, body],
            )?;
            Ok(!existed)
        }))
    }

    fn remove(&self, id: String) -> BoxFuture<'_, bool> {
        let conn = self.conn.clone();
        Box::pin(blocking(move || {
            let c = conn.lock().unwrap_or_else(|e| e.into_inner());
            Ok(c.execute("DELETE FROM tenants WHERE external_id = ?1", [&id])? > 0)
        }))
    }

    fn name(&self) -> &'static str {
        "sqlite"
    }
}

/// The shared store: a PostgreSQL table several nodes use, changes announced with NOTIFY.
struct Postgres {
    client: tokio_postgres::Client,
    url: String,
}

impl Backend for Postgres {
    fn rows(&self) -> BoxFuture<'_, Vec<(String, String)>> {
        Box::pin(async move {
            Ok(self
                .client
                .query(
                    "SELECT external_id, body FROM shoal_tenants ORDER BY external_id",
                    &[],
                )
                .await?
                .into_iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect())
        })
    }

    fn page(&self, search: String, offset: usize, limit: usize) -> BoxFuture<'_, RowPage> {
        Box::pin(async move {
            let pattern = contains_pattern(&search);
            let (limit, offset) = (
                limit.min(i64::MAX as usize) as i64,
                offset.min(i64::MAX as usize) as i64,
            );
            let total: i64 = self
                .client
                .query_one(
                    "SELECT count(*) FROM shoal_tenants WHERE external_id LIKE $1 ESCAPE '\\'",
                    &[&pattern],
                )
                .await?
                .get(0);
            let rows = self
                .client
                .query(
                    "SELECT external_id, body FROM shoal_tenants WHERE external_id LIKE $1 ESCAPE '\\'
                     ORDER BY external_id LIMIT $2 OFFSET $3",
                    &[&pattern, &limit, &offset],
                )
                .await?
                .into_iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
            Ok((rows, total as usize))
        })
    }

    fn row<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<String>> {
        Box::pin(async move {
            Ok(self
                .client
                .query_opt(
                    "SELECT body FROM shoal_tenants WHERE external_id = $1",
                    &[&id],
                )
                .await?
                .map(|r| r.get(0)))
        })
    }

    fn upsert(&self, id: String, body: String) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let row = self
                .client
                .query_one(
                    "WITH up AS (
                        INSERT INTO shoal_tenants (external_id, body) VALUES ($1, $2)
                        ON CONFLICT (external_id) DO UPDATE SET body = excluded.body, updated_at = now()
                        RETURNING (xmax = 0) AS created
                     ) SELECT created, pg_notify($3, $1) IS NULL FROM up",
                    &[&id, &body, &CHANNEL],
                )
                .await?;
            Ok(row.get(0))
        })
    }

    fn remove(&self, id: String) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let n = self
                .client
                .query(
                    "WITH d AS (DELETE FROM shoal_tenants WHERE external_id = $1 RETURNING external_id)
                     SELECT pg_notify($2, external_id) FROM d",
                    &[&id, &CHANNEL],
                )
                .await?
                .len();
            Ok(n > 0)
        })
    }

    fn shared_url(&self) -> Option<&str> {
        Some(&self.url)
    }

    fn name(&self) -> &'static str {
        "postgres"
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Config(e.to_string()))?
}

/// The embedded store's key, made on first use in `data_dir/encryption.key` (mode 0600).
fn key_file(data_dir: &Path) -> Result<String, StoreError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("encryption.key");
    match std::fs::read_to_string(&path) {
        Ok(k) => return Ok(k),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        Err(_) => {}
    }
    std::fs::create_dir_all(data_dir)?;
    let key = Sealer::generate_text();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    f.write_all(key.as_bytes())?;
    tracing::warn!(
        path = %path.display(),
        "no tenant encryption key given: made one for the embedded store (keep it with the store; set SHOAL_ENC_KEY to use your own)"
    );
    Ok(key)
}

fn open_sqlite(path: &Path) -> Result<rusqlite::Connection, StoreError> {
    let c = rusqlite::Connection::open(path)?;
    c.busy_timeout(std::time::Duration::from_secs(5))?;
    c.pragma_update(None, "journal_mode", "WAL")?;
    let version: i64 = c.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version < 1 {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS tenants (
                external_id TEXT PRIMARY KEY,
                body TEXT NOT NULL,
                updated_at INTEGER NOT NULL
             );
             PRAGMA user_version = 1;",
        )?;
    }
    Ok(c)
}

/// A connection to the shared store (TLS or not, as its settings say).
pub type StoreConnection = tokio_postgres::Connection<
    tokio_postgres::Socket,
    <tokio_postgres_rustls::MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<
        tokio_postgres::Socket,
    >>::Stream,
>;

/// Connects to the metadata database with `tls` as libpq's `sslmode` means it (the same
/// rustls setup as every upstream); the caller drives the connection.
pub async fn pg_connect_pair(
    url: &str,
    tls: &crate::config::UpstreamTlsSettings,
) -> Result<(tokio_postgres::Client, StoreConnection), StoreError> {
    use crate::config::SslMode;
    let mut config: tokio_postgres::Config = url.parse()?;
    config.ssl_mode(match tls.mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    // Without TLS a configuration is still needed to name the connector's type.
    let settings = crate::config::UpstreamTlsSettings {
        mode: if tls.mode == SslMode::Disable {
            SslMode::Require
        } else {
            tls.mode
        },
        ..tls.clone()
    };
    let rustls = crate::upstream_tls::UpstreamTls::build(&settings)
        .map_err(|e| StoreError::Config(format!("store TLS: {e}")))?
        .ok_or_else(|| StoreError::Config("store TLS: no configuration".into()))?;
    let connector = tokio_postgres_rustls::MakeRustlsConnect::new((*rustls.config).clone());
    Ok(config.connect(connector).await?)
}

/// Connects to the metadata database; the connection is driven by a task of its own.
pub async fn pg_connect(
    url: &str,
    tls: &crate::config::UpstreamTlsSettings,
) -> Result<tokio_postgres::Client, StoreError> {
    let (client, conn) = pg_connect_pair(url, tls).await?;
    crate::runtime::spawn(async move {
        if let Err(e) = conn.await {
            tracing::warn!(error = %e, "tenant store connection ended");
        }
    });
    Ok(client)
}

/// Shoal's own schema in the metadata database, versioned; applied once by whichever node
/// gets the advisory lock first.
async fn migrate_pg(client: &tokio_postgres::Client) -> Result<(), StoreError> {
    const MIGRATIONS: &[&str] = &["CREATE TABLE shoal_tenants (
            external_id text PRIMARY KEY,
            body text NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT now()
        )"];
    client
        .batch_execute(
            "SELECT pg_advisory_lock(7406331);
             CREATE TABLE IF NOT EXISTS shoal_schema (version int NOT NULL);",
        )
        .await?;
    let result = async {
        let version: i32 = client
            .query_opt("SELECT version FROM shoal_schema", &[])
            .await?
            .map(|r| r.get(0))
            .unwrap_or(0);
        for (i, m) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            client.batch_execute(m).await?;
            client.execute("DELETE FROM shoal_schema", &[]).await?;
            client
                .execute(
                    "INSERT INTO shoal_schema (version) VALUES ($1)",
                    &[&(i as i32 + 1)],
                )
                .await?;
        }
        Ok::<_, StoreError>(())
    }
    .await;
    client
        .batch_execute("SELECT pg_advisory_unlock(7406331)")
        .await?;
    result
}

#[cfg(test)]
mod tests;
