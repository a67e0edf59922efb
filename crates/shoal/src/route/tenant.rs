//! Tenants as routing sees them: a tenant turned into what routing and the pools use
//! ([`TenantRoute`]), and the table routing looks tenants up in ([`Tenants`]). A tenant
//! costs a table entry until a client logs in; its users' verifiers and its pools are made
//! on first use. (The operator's JSON, its store and sealing are `shoal_control::tenant`;
//! applying store changes here is [`crate::tenant::service`].)

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use crate::config::{
    AuthQuery, ClientAuth, ClientTls, Config, Database, PoolSettings, SslMode, UpstreamTlsSettings,
    User, DEFAULT_AUTH_QUERY,
};
use shoal_control::tenant::model::{self, Tenant, UpstreamVerify};

/// Prefix of a tenant's database name inside Shoal (config-file names cannot contain `:`),
/// so tenant pools and cached secrets never share a key with the config file's.
pub const DB_PREFIX: &str = "tenant:";

/// A tenant ready for routing.
pub struct TenantRoute {
    pub tenant: Tenant,
    /// The tenant's one database, as a config-file database would be.
    pub database: Database,
    allow_list: Vec<ipnet::IpNet>,
    /// Users with verifiers, made on the first login (PBKDF2 per user is not free, and most
    /// tenants in a large store are idle).
    users: OnceLock<BTreeMap<String, User>>,
}

impl std::fmt::Debug for TenantRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantRoute")
            .field("id", &self.tenant.external_id)
            .finish_non_exhaustive()
    }
}

impl TenantRoute {
    /// `ca_dir` holds the tenant's upstream CA file when it verifies its server.
    pub fn new(tenant: Tenant, ca_dir: &std::path::Path) -> Result<TenantRoute, String> {
        let id = tenant.external_id.clone();
        let rootcert = match (&tenant.upstream_verify, &tenant.upstream_tls_ca) {
            (Some(UpstreamVerify::Peer), Some(pem)) => {
                std::fs::create_dir_all(ca_dir).map_err(|e| e.to_string())?;
                let path = ca_dir.join(format!("{id}.pem"));
                std::fs::write(&path, pem).map_err(|e| e.to_string())?;
                Some(path)
            }
            _ => None,
        };
        let mode = match (tenant.upstream_ssl, tenant.upstream_verify) {
            (false, _) => SslMode::Disable,
            (true, Some(UpstreamVerify::Peer)) => SslMode::VerifyFull,
            (true, _) => SslMode::Require,
        };
        let auth_query = (!tenant.require_user).then(|| AuthQuery {
            user: tenant
                .manager()
                .map(|m| m.db_user.clone())
                .unwrap_or_default(),
            query: tenant
                .auth_query
                .clone()
                .unwrap_or_else(|| DEFAULT_AUTH_QUERY.into()),
            cache_ttl: crate::config::secs(tenant.auth_query_cache_ttl.unwrap_or(10.0)),
        });
        let database = Database {
            name: format!("{DB_PREFIX}{id}"),
            host: tenant.db_host.clone(),
            port: tenant.db_port,
            family: match tenant.ip_version {
                model::IpVersion::Auto => crate::config::IpFamily::Any,
                model::IpVersion::V4 => crate::config::IpFamily::V4,
                model::IpVersion::V6 => crate::config::IpFamily::V6,
            },
            dbname: tenant.db_database.clone(),
            tls: UpstreamTlsSettings {
                mode,
                rootcert,
                cert: None,
                key: None,
                key_password: None,
                sni: true,
            },
            client_tls: tenant.enforce_ssl.then_some(ClientTls::Require),
            auth_query,
            pool_mode: None,
            pool_size: tenant.default_pool_size,
            min_pool_size: None,
            max_client_conn: tenant.default_max_clients,
            server_reset: tenant.server_reset,
            // Validated when the tenant was stored.
            replicas: tenant.replicas().unwrap_or_default(),
            // Validated when the tenant was stored.
            rules: shoal_control::config::rules::validate("query_rules", &tenant.query_rules)
                .unwrap_or_default(),
            // Validated when the tenant was stored.
            cache: tenant.cache().unwrap_or_default(),
            // Validated when the tenant was stored.
            limits: tenant.limits().unwrap_or_default(),
        };
        let allow_list = tenant
            .allow_list
            .iter()
            .filter_map(|c| c.parse().ok())
            .collect();
        Ok(TenantRoute {
            tenant,
            database,
            allow_list,
            users: OnceLock::new(),
        })
    }

    pub fn id(&self) -> &str {
        &self.tenant.external_id
    }

    /// The tenant's listed users: each checks its client against its password (SCRAM) and
    /// logs in upstream with it.
    pub fn users(&self) -> &BTreeMap<String, User> {
        // The SCRAM verifier costs a PBKDF2 derivation per user: made at the first login,
        // not when the tenant is stored or synced.
        self.users.get_or_init(|| {
            self.user_list(|password| {
                ClientAuth::Scram(Box::new(shoal_wire::scram::Verifier::from_password(
                    password,
                )))
            })
        })
    }

    /// Where and as whom Shoal itself logs in to the tenant's database: its manager user
    /// (`is_manager`), else its first user.
    pub fn manager_upstream(&self) -> Result<crate::server::Upstream, String> {
        let users = self.upstream_users();
        let manager = self.tenant.manager().map(|m| &m.db_user);
        let user = manager
            .and_then(|m| users.get(m))
            .or_else(|| users.values().next())
            .ok_or("at least one user is needed")?;
        let tls = crate::upstream_tls::UpstreamTls::build(&self.database.tls)
            .map_err(|e| e.to_string())?;
        Ok(crate::server::Upstream {
            host: self.database.host.clone(),
            port: self.database.port,
            family: self.database.family,
            dbname: self.database.dbname.clone(),
            user: user.server_user.clone(),
            password: user.server_password.clone(),
            tls: tls.map(Arc::new),
            tls_settings: self.database.tls.clone(),
            passthrough: None,
            dial: None,
        })
    }

    /// The listed users as their pools see them (upstream login, sizes, mode), without the
    /// client-side check: for comparing and resizing pools, never for authentication.
    pub fn upstream_users(&self) -> BTreeMap<String, User> {
        self.user_list(|_| ClientAuth::Trust)
    }

    fn user_list(&self, auth: impl Fn(&str) -> ClientAuth) -> BTreeMap<String, User> {
        self.tenant
            .users
            .iter()
            .map(|u| {
                let password = u.db_password.clone().unwrap_or_default();
                let user = User {
                    name: u.db_user.clone(),
                    auth: auth(&password),
                    server_user: u.db_user.clone(),
                    server_password: Some(password),
                    pool_mode: Some(u.mode_type.into()),
                    pool_size: u.pool_size,
                    read_routing: u.read_routing,
                    rules: None,
                    cache: None,
                    // Validated when the tenant was stored.
                    limits: shoal_control::config::user_limits(
                        "users",
                        u.rate_limit,
                        u.rate_burst,
                        u.max_concurrency,
                    )
                    .ok()
                    .flatten(),
                    client_tls: None,
                    passthrough: None,
                    max_client_conn: u.max_clients,
                    upstream_cert: None,
                };
                (u.db_user.clone(), user)
            })
            .collect()
    }

    /// The user that runs the tenant's auth_query.
    pub fn manager(&self) -> Option<&User> {
        let name = &self.database.auth_query.as_ref()?.user;
        self.users().get(name)
    }

    pub fn allows(&self, addr: Option<IpAddr>) -> bool {
        match addr {
            // Unix sockets are local.
            None => true,
            Some(ip) => {
                let ip = match ip {
                    IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
                    v4 => v4,
                };
                self.allow_list.iter().any(|n| n.contains(&ip))
            }
        }
    }

    /// Settings of the pool serving `user`: the user's, then the tenant's defaults, then
    /// Supavisor's defaults; timeouts from `[pool]`.
    pub fn pool_settings(&self, config: &Config, user: &User) -> PoolSettings {
        let mut s = config.pool_settings(&self.database, user);
        s.size = user
            .pool_size
            .or(self.tenant.default_pool_size)
            .unwrap_or(model::DEFAULT_POOL_SIZE);
        s.max_client_conn = user
            .max_client_conn
            .or(self.tenant.default_max_clients)
            .unwrap_or(model::DEFAULT_MAX_CLIENTS);
        s.min_size = 0;
        if self.tenant.client_idle_timeout > 0 {
            s.client_idle_timeout = Duration::from_secs(self.tenant.client_idle_timeout);
        }
        s
    }
}

/// Every tenant routing knows, by id and by SNI host name.
#[derive(Default)]
pub struct Tenants {
    inner: RwLock<Table>,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<String, Arc<TenantRoute>>,
    by_sni: HashMap<String, String>,
}

impl Tenants {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<TenantRoute>> {
        self.read().by_id.get(id).cloned()
    }

    /// The tenant whose `sni_hostname` is `name` (case-insensitive).
    pub fn by_sni(&self, name: &str) -> Option<String> {
        self.read().by_sni.get(&name.to_ascii_lowercase()).cloned()
    }

    pub fn len(&self) -> usize {
        self.read().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ids(&self) -> Vec<String> {
        self.read().by_id.keys().cloned().collect()
    }

    /// Adds or replaces a tenant; returns the one it replaced.
    pub fn insert(&self, route: TenantRoute) -> Option<Arc<TenantRoute>> {
        let id = route.id().to_owned();
        let sni = route
            .tenant
            .sni_hostname
            .as_ref()
            .map(|s| s.to_ascii_lowercase());
        let mut t = self.write();
        let old = t.by_id.insert(id.clone(), Arc::new(route));
        if let Some(old_sni) = old.as_ref().and_then(|o| o.tenant.sni_hostname.as_ref()) {
            let old_sni = old_sni.to_ascii_lowercase();
            if t.by_sni.get(&old_sni) == Some(&id) {
                t.by_sni.remove(&old_sni);
            }
        }
        if let Some(sni) = sni {
            t.by_sni.insert(sni, id);
        }
        old
    }

    pub fn remove(&self, id: &str) -> Option<Arc<TenantRoute>> {
        let mut t = self.write();
        let old = t.by_id.remove(id)?;
        if let Some(sni) = &old.tenant.sni_hostname {
            let sni = sni.to_ascii_lowercase();
            if t.by_sni.get(&sni).map(String::as_str) == Some(id) {
                t.by_sni.remove(&sni);
            }
        }
        Some(old)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Storing or syncing a tenant derives no SCRAM verifier (a PBKDF2 per user, on the
    /// control thread): only a login does, once.
    #[test]
    fn verifiers_are_made_at_the_first_login_only() {
        let tenant: Tenant = serde_json::from_value(serde_json::json!({
            "external_id": "acme", "db_host": "h", "db_database": "d", "require_user": true,
            "users": [{"db_user": "a", "db_password": "pa"}, {"db_user": "b", "db_password": "pb"}]
        }))
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let route = TenantRoute::new(tenant, dir.path()).unwrap();
        let upstream = route.upstream_users();
        assert_eq!(upstream["a"].server_password.as_deref(), Some("pa"));
        assert!(matches!(upstream["b"].auth, ClientAuth::Trust));
        assert!(route.users.get().is_none(), "no verifier derived yet");
        assert!(matches!(route.users()["a"].auth, ClientAuth::Scram(_)));
    }
}
