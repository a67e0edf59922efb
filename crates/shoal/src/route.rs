//! Routing: from who a client says it is (its startup packet; later also the TLS server name
//! it asked for) to the user it must authenticate as and the pool that serves it, backed by a
//! registry of pools that can change while Shoal runs.
//!
//! This is the one place that tenants (routing by `user.tenant`, SNI or database), the admin
//! console and live reload change: sessions only ask it [`Registry::user`] and
//! [`Registry::pool`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use shoal_wire::sqlstate;

use crate::config::{Config, User};
use crate::pool::Pool;
use crate::server::Upstream;

/// What a client asks for.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    pub user: &'a str,
    pub database: &'a str,
    /// The TLS server name (SNI) the client connected with, once TLS is terminated here.
    pub server_name: Option<&'a str>,
}

/// Why a client cannot be routed, with what to tell it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    #[error("user \"{0}\" is not configured in Shoal")]
    UnknownUser(String),
    #[error("database \"{0}\" does not exist in Shoal's configuration")]
    UnknownDatabase(String),
    /// The database's TLS settings cannot be used (a file is missing or wrong).
    #[error("database \"{0}\" is misconfigured in Shoal: {1}")]
    Misconfigured(String, String),
}

impl RouteError {
    pub fn code(&self) -> &'static str {
        match self {
            RouteError::UnknownUser(_) => sqlstate::INVALID_AUTHORIZATION,
            RouteError::UnknownDatabase(_) => sqlstate::INVALID_CATALOG_NAME,
            RouteError::Misconfigured(..) => sqlstate::CONNECTION_FAILURE,
        }
    }
}

/// The routable configuration and the pools made from it.
pub struct Registry {
    config: RwLock<Arc<Config>>,
    pools: Mutex<HashMap<(String, String), Arc<Pool>>>,
}

impl Registry {
    pub fn new(config: Config) -> Registry {
        Registry {
            config: RwLock::new(Arc::new(config)),
            pools: Mutex::new(HashMap::new()),
        }
    }

    fn lock_pools(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Arc<Pool>>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration routing uses now.
    pub fn config(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The user a client must authenticate as. Checked before authentication; the database is
    /// checked after it, as PostgreSQL does (an unauthenticated client learns nothing about
    /// which databases exist).
    pub fn user(&self, req: &RouteRequest<'_>) -> Result<User, RouteError> {
        self.config()
            .users
            .get(req.user)
            .cloned()
            .ok_or_else(|| RouteError::UnknownUser(req.user.to_owned()))
    }

    /// The pool serving an authenticated `user` for `req`, made on first use.
    pub fn pool(&self, req: &RouteRequest<'_>, user: &User) -> Result<Arc<Pool>, RouteError> {
        let config = self.config();
        let db = config
            .databases
            .get(req.database)
            .ok_or_else(|| RouteError::UnknownDatabase(req.database.to_owned()))?;
        let mut pools = self.lock_pools();
        let key = (db.name.clone(), user.name.clone());
        if let Some(pool) = pools.get(&key) {
            // A user found by auth_query whose password changed needs a pool that logs in
            // with the new secret; clients on the old one keep it.
            if pool.upstream.passthrough == user.passthrough {
                return Ok(pool.clone());
            }
            if let Some(old) = pools.remove(&key) {
                tokio::spawn(async move { old.close_idle().await });
            }
        }
        let tls = crate::upstream_tls::UpstreamTls::build(&db.tls)
            .map_err(|e| RouteError::Misconfigured(db.name.clone(), e.to_string()))?;
        let pool = Pool::new(
            format!("{}/{}", db.name, user.name),
            config.pool_settings(db, user),
            Upstream {
                host: db.host.clone(),
                port: db.port,
                dbname: db.dbname.clone(),
                user: user.server_user.clone(),
                password: user.server_password.clone(),
                tls: tls.map(Arc::new),
                tls_settings: db.tls.clone(),
                passthrough: user.passthrough.clone(),
            },
        );
        pools.insert(key, pool.clone());
        Ok(pool)
    }

    /// Every pool routing can reach.
    pub fn pools(&self) -> Vec<Arc<Pool>> {
        self.lock_pools().values().cloned().collect()
    }

    /// Takes a pool out of routing: new logins get a fresh pool; clients attached to the old
    /// one keep it until they leave, and its idle servers are closed.
    pub fn remove_pool(&self, database: &str, user: &str) -> Option<Arc<Pool>> {
        let pool = self
            .lock_pools()
            .remove(&(database.to_owned(), user.to_owned()))?;
        let closing = pool.clone();
        tokio::spawn(async move { closing.close_idle().await });
        Some(pool)
    }

    /// Routes later logins by `config`. Pools whose settings, upstream or credentials changed
    /// (or whose database or user is gone) are removed as by [`Registry::remove_pool`];
    /// unchanged pools, and every attached client, carry on untouched.
    pub fn replace_config(&self, config: Config) {
        let stale: Vec<(String, String)> = self
            .lock_pools()
            .iter()
            .filter(|((db, user), pool)| {
                let (Some(d), Some(u)) = (config.databases.get(db), config.users.get(user)) else {
                    return true;
                };
                let same_upstream = pool.upstream.host == d.host
                    && pool.upstream.port == d.port
                    && pool.upstream.dbname == d.dbname
                    && pool.upstream.user == u.server_user
                    && pool.upstream.password == u.server_password
                    && pool.upstream.tls_settings == d.tls;
                !same_upstream || pool.settings != config.pool_settings(d, u)
            })
            .map(|(k, _)| k.clone())
            .collect();
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        for (db, user) in stale {
            self.remove_pool(&db, &user);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pool_size: usize) -> Config {
        Config::parse(
            &format!(
                "[pool]\npool_size = {pool_size}\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n"
            ),
            "test",
            &|_| None,
        )
        .unwrap()
    }

    fn req<'a>(user: &'a str, database: &'a str) -> RouteRequest<'a> {
        RouteRequest {
            user,
            database,
            server_name: None,
        }
    }

    #[tokio::test]
    async fn routes_known_names_and_refuses_others() {
        let r = Registry::new(config(3));
        let u = r.user(&req("u", "d")).unwrap();
        assert_eq!(
            r.user(&req("nobody", "d")).unwrap_err().code(),
            sqlstate::INVALID_AUTHORIZATION
        );
        let p = r.pool(&req("u", "d"), &u).unwrap();
        assert_eq!(p.name, "d/u");
        assert!(Arc::ptr_eq(&p, &r.pool(&req("u", "d"), &u).unwrap()));
        assert_eq!(
            r.pool(&req("u", "nodb"), &u).err(),
            Some(RouteError::UnknownDatabase("nodb".into()))
        );
    }

    #[tokio::test]
    async fn pools_change_with_the_config_at_run_time() {
        let r = Registry::new(config(3));
        let u = r.user(&req("u", "d")).unwrap();
        let before = r.pool(&req("u", "d"), &u).unwrap();
        // The same settings: the pool stays.
        r.replace_config(config(3));
        assert!(Arc::ptr_eq(&before, &r.pool(&req("u", "d"), &u).unwrap()));
        // A new pool size: new logins get a new pool; the old one lives on for its clients.
        r.replace_config(config(5));
        let after = r.pool(&req("u", "d"), &u).unwrap();
        assert!(!Arc::ptr_eq(&before, &after));
        assert_eq!(after.settings.size, 5);
        assert_eq!(before.settings.size, 3);
        assert!(r.remove_pool("d", "u").is_some());
        assert!(r.pools().is_empty());
    }
}
