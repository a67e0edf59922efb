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

/// (database, user name) → what was found and when it was fetched.
type Entries = HashMap<(String, String), (Option<Found>, Instant)>;

/// A user's secret, and until when (Unix seconds) PostgreSQL lets the role log in.
#[derive(Clone)]
struct Found {
    secret: String,
    valid_until: f64,
}

/// What PostgreSQL itself checks when a role logs in, and a pooled server skips: the role may
/// log in (`LOGIN`, a connection limit other than 0, `CONNECT` on the database) and until when
/// (`VALID UNTIL`). `pg_roles` is readable by any role, so this works whatever the auth_query
/// and whoever `auth_user` is.
const ROLE_CHECK: &str = "SELECT rolcanlogin AND rolconnlimit <> 0 \
     AND pg_catalog.has_database_privilege(oid, pg_catalog.current_database(), 'CONNECT'), \
     EXTRACT(EPOCH FROM rolvaliduntil) \
     FROM pg_catalog.pg_roles WHERE rolname = $1";

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
        let found = match cached {
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
        // A cached role's VALID UNTIL is checked on every login.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let Some(Found { secret, .. }) = found.filter(|f| f.valid_until > now) else {
            return Ok(None);
        };
        let auth = if let Ok(v) = shoal_wire::scram::Verifier::parse(&secret) {
            ClientAuth::Scram(Box::new(v))
        } else if shoal_wire::md5::is_stored_secret(&secret) {
            ClientAuth::Md5(secret.to_ascii_lowercase())
        } else {
            tracing::warn!(database = %db.name, "auth_query returned a secret that is neither SCRAM nor MD5");
            return Ok(None);
        };
        Ok(Some(User::named(name, auth)))
    }
}

/// Runs the auth_query, and the role check, on a short-lived connection as the auth user.
/// `None` when there is no such user, it has no password, or PostgreSQL would refuse its
/// login.
async fn fetch(
    auth_user: &User,
    timeout: std::time::Duration,
    db: &Database,
    aq: &AuthQuery,
    name: &str,
) -> Result<Option<Found>, ServerError> {
    let tls_settings = crate::config::upstream_tls_for(db, auth_user);
    let tls = crate::upstream_tls::UpstreamTls::build(&tls_settings)
        .map_err(|e| ServerError::Tls(e.to_string()))?;
    let upstream = Upstream {
        host: db.host.clone(),
        port: db.port,
        family: db.family,
        dbname: db.dbname.clone(),
        user: auth_user.server_user.clone(),
        password: auth_user.server_password.clone(),
        tls: tls.map(std::sync::Arc::new),
        tls_settings,
        passthrough: None,
        dial: None,
    };
    let mut conn = ServerConn::connect(&upstream, timeout).await?;
    let rows = crate::timer::timeout(timeout, async {
        let secret = conn.query_row(&aq.query, &[name]).await?;
        let role = conn.query_row(ROLE_CHECK, &[name]).await?;
        Ok::<_, ServerError>((secret, role))
    })
    .await
    .map_err(|_| ServerError::ConnectTimeout("auth_query".into()))??;
    conn.close().await;
    let (secret, role) = rows;
    let Some(secret) = secret.and_then(|cols| cols.into_iter().nth(1).flatten()) else {
        return Ok(None);
    };
    Ok(role
        .and_then(|cols| role_valid_until(&cols))
        .map(|valid_until| Found {
            secret,
            valid_until,
        }))
}

/// From the role check's row: until when the role may log in (`f64::INFINITY` without
/// `VALID UNTIL`), or `None` when it may not log in at all.
fn role_valid_until(cols: &[Option<String>]) -> Option<f64> {
    if cols.first()?.as_deref() != Some("t") {
        return None;
    }
    match cols.get(1)? {
        None => Some(f64::INFINITY),
        Some(t) => t.parse::<f64>().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_rows() {
        let row = |a: Option<&str>, b: Option<&str>| vec![a.map(String::from), b.map(String::from)];
        assert_eq!(role_valid_until(&row(Some("t"), None)), Some(f64::INFINITY));
        assert_eq!(
            role_valid_until(&row(Some("t"), Some("Infinity"))),
            Some(f64::INFINITY)
        );
        assert_eq!(
            role_valid_until(&row(Some("t"), Some("1700000000.5"))),
            Some(1_700_000_000.5)
        );
        assert_eq!(
            role_valid_until(&row(Some("t"), Some("-Infinity"))),
            Some(f64::NEG_INFINITY)
        );
        assert_eq!(role_valid_until(&row(Some("f"), None)), None);
        assert_eq!(role_valid_until(&row(None, None)), None);
        assert_eq!(role_valid_until(&row(Some("t"), Some("garbage"))), None);
    }
}
