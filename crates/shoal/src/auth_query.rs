//! Users who are not in Shoal's configuration, looked up in PostgreSQL itself: a database
//! with an `auth_user` runs its `auth_query` as that user to get a user's secret (a SCRAM
//! verifier or an MD5 hash), cached for `auth_query_cache_ttl`. With the secret Shoal checks
//! the client, and then logs in upstream as that user without ever knowing the password
//! (SCRAM or MD5 passthrough).

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::time::Instant;

use crate::config::{AuthQuery, ClientAuth, Database, User};
use crate::server::{ServerConn, ServerError, Upstream};

/// (database, user name) → the secret (`None`: no such user) and when it was fetched.
type Entries = HashMap<(String, String), (Option<String>, Instant)>;

/// Secrets found by auth_query, cached.
#[derive(Default)]
pub struct SecretCache {
    entries: Mutex<Entries>,
}

/// Entries kept at most; past it the cache starts over.
const MAX_ENTRIES: usize = 100_000;

impl SecretCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets a user's secret (its login failed: the password may have changed).
    pub fn forget(&self, database: &str, user: &str) {
        self.lock().remove(&(database.to_owned(), user.to_owned()));
    }

    /// The user `name` as `db`'s auth_query finds it: `Ok(None)` when there is no such user
    /// (or it has no password).
    pub async fn user(
        &self,
        auth_user: &User,
        connect_timeout: std::time::Duration,
        db: &Database,
        aq: &AuthQuery,
        name: &str,
    ) -> Result<Option<User>, ServerError> {
        let key = (db.name.clone(), name.to_owned());
        let cached = self
            .lock()
            .get(&key)
            .filter(|(_, at)| at.elapsed() < aq.cache_ttl)
            .map(|(s, _)| s.clone());
        let secret = match cached {
            Some(s) => s,
            None => {
                let s = fetch(auth_user, connect_timeout, db, aq, name).await?;
                let mut entries = self.lock();
                if entries.len() >= MAX_ENTRIES {
                    entries.clear();
                }
                entries.insert(key, (s.clone(), Instant::now()));
                s
            }
        };
        let Some(secret) = secret else {
            return Ok(None);
        };
        let auth = if let Ok(v) = shoal_wire::scram::Verifier::parse(&secret) {
            ClientAuth::Scram(v)
        } else if shoal_wire::md5::is_stored_secret(&secret) {
            ClientAuth::Md5(secret.to_ascii_lowercase())
        } else {
            tracing::warn!(database = %db.name, "auth_query returned a secret that is neither SCRAM nor MD5");
            return Ok(None);
        };
        Ok(Some(User {
            name: name.to_owned(),
            auth,
            server_user: name.to_owned(),
            server_password: None,
            pool_mode: None,
            pool_size: None,
            client_tls: None,
            passthrough: None,
            max_client_conn: None,
        }))
    }
}

/// Runs the auth_query on a short-lived connection as the auth user.
async fn fetch(
    auth_user: &User,
    timeout: std::time::Duration,
    db: &Database,
    aq: &AuthQuery,
    name: &str,
) -> Result<Option<String>, ServerError> {
    let tls = crate::upstream_tls::UpstreamTls::build(&db.tls)
        .map_err(|e| ServerError::Tls(e.to_string()))?;
    let upstream = Upstream {
        host: db.host.clone(),
        port: db.port,
        family: db.family,
        dbname: db.dbname.clone(),
        user: auth_user.server_user.clone(),
        password: auth_user.server_password.clone(),
        tls: tls.map(std::sync::Arc::new),
        tls_settings: db.tls.clone(),
        passthrough: None,
    };
    let mut conn = ServerConn::connect(&upstream, timeout).await?;
    let row = crate::timer::timeout(timeout, conn.query_row(&aq.query, &[name]))
        .await
        .map_err(|_| ServerError::ConnectTimeout("auth_query".into()))??;
    conn.close().await;
    Ok(row.and_then(|cols| cols.into_iter().nth(1).flatten()))
}
