//! Routing: from who a client says it is (its startup packet, and the TLS server name it
//! asked for) to the scope it belongs to (the config file's databases, or one tenant), the
//! user it must authenticate as and the pool that serves it, backed by a registry that
//! changes while Shoal runs.
//!
//! This is the one place that knows tenants exist: sessions ask it [`Registry::resolve`] and
//! [`Registry::pool`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, RwLock};

use shoal_wire::sqlstate;

use crate::config::{ClientAuth, Config, Database, PoolSettings, User};
use crate::pool::Pool;
use building::{same_upstream, without_size};
mod building;
mod operations;
pub mod tenant;

pub use tenant::{TenantRoute, Tenants, DB_PREFIX};

/// What a client asks for.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    pub user: &'a str,
    pub database: &'a str,
    /// The TLS server name (SNI) the client connected with, once TLS is terminated here.
    pub server_name: Option<&'a str>,
    /// The tenant named in the startup `options` (`reference=<tenant>`).
    pub reference: Option<&'a str>,
    pub addr: Option<IpAddr>,
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
    #[error("tenant \"{0}\" does not exist")]
    UnknownTenant(String),
    #[error("the connection names two tenants (\"{0}\" and \"{1}\"): by user name, TLS server name and options they must agree")]
    TenantConflict(String, String),
    #[error("tenant \"{0}\" is banned{1}")]
    TenantBanned(String, String),
    #[error("connections from this address are not allowed for tenant \"{0}\"")]
    AddressNotAllowed(String),
    #[error("database \"{0}\" does not allow new connections: an administrator ran DISABLE (ENABLE lifts it)")]
    Disabled(String),
}

impl RouteError {
    /// Its kind, in the one taxonomy of [`crate::error`].
    pub fn kind(&self) -> crate::error::ErrorKind {
        use crate::error::ErrorKind;
        match self {
            RouteError::TenantBanned(..) => ErrorKind::Banned,
            // Shoal's own configuration cannot reach the database.
            RouteError::Misconfigured(..) => ErrorKind::ServerUnavailable,
            _ => ErrorKind::Routing,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            RouteError::UnknownUser(_) => sqlstate::INVALID_AUTHORIZATION,
            RouteError::UnknownDatabase(_) => sqlstate::INVALID_CATALOG_NAME,
            RouteError::Misconfigured(..) => sqlstate::CONNECTION_FAILURE,
            RouteError::UnknownTenant(_) => sqlstate::INVALID_CATALOG_NAME,
            RouteError::TenantConflict(..) => sqlstate::INVALID_AUTHORIZATION,
            RouteError::TenantBanned(..) => sqlstate::CONNECTION_REJECTED,
            RouteError::AddressNotAllowed(_) => sqlstate::INVALID_AUTHORIZATION,
            RouteError::Disabled(_) => sqlstate::CANNOT_CONNECT_NOW,
        }
    }
}

/// The virtual database names of the admin console.
pub fn is_console(database: &str) -> bool {
    database == "pgbouncer" || database == "shoal"
}

/// Where a login goes.
#[derive(Debug, Clone)]
pub enum Scope {
    /// The config file's databases and users (database name as the client sent it).
    File(Arc<Config>, String),
    /// The config file's users, and the database `[databases."*"]` made for a name no entry
    /// lists.
    Wildcard(Arc<Config>, Arc<Database>),
    Tenant(Arc<TenantRoute>),
}

/// A routed login: its scope and the user name to authenticate (a `user.tenant` name
/// without its tenant).
#[derive(Debug, Clone)]
pub struct Routed {
    pub scope: Scope,
    pub user: String,
}

impl Routed {
    /// The database the login reaches (`None`: a config-file name that does not exist,
    /// reported after authentication, as PostgreSQL does).
    pub fn database(&self) -> Option<&Database> {
        match &self.scope {
            Scope::File(c, name) => c.databases.get(name),
            Scope::Wildcard(_, db) => Some(db),
            Scope::Tenant(t) => Some(&t.database),
        }
    }

    /// The user as configured (config file, or the tenant's list). Borrowed: a login copies
    /// it only if it has to change it.
    pub fn configured_user(&self) -> Option<&User> {
        match &self.scope {
            Scope::File(c, _) | Scope::Wildcard(c, _) => c.users.get(&self.user),
            Scope::Tenant(t) => t.users().get(&self.user),
        }
    }

    /// The user that runs the database's auth_query.
    pub fn auth_user(&self) -> Option<User> {
        match &self.scope {
            Scope::File(c, _) | Scope::Wildcard(c, _) => {
                let aq = self.database()?.auth_query.as_ref()?;
                c.users.get(&aq.user).cloned()
            }
            Scope::Tenant(t) => t.manager().cloned(),
        }
    }

    pub fn tenant(&self) -> Option<&Arc<TenantRoute>> {
        match &self.scope {
            Scope::Tenant(t) => Some(t),
            Scope::File(..) | Scope::Wildcard(..) => None,
        }
    }
}

type PoolKey = (String, String);

/// The routable configuration, the tenants, and the pools made from them.
pub struct Registry {
    config: RwLock<Arc<Config>>,
    pub tenants: Tenants,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    /// Databases paused by the admin console (`*`: all); pools made later start paused.
    paused: Mutex<std::collections::HashSet<String>>,
    /// Pools taken out of routing whose servers may still be open (`WAIT_CLOSE`).
    retired: Mutex<Vec<std::sync::Weak<Pool>>>,
    /// Databases the admin console disabled (`DISABLE db`): new logins are refused.
    disabled: Mutex<std::collections::HashSet<String>>,
    /// A schema counter per database (host, port, name), shared by its pools.
    schemas: Mutex<HashMap<(String, u16, String), Arc<std::sync::atomic::AtomicU64>>>,
    /// Rate and concurrency limiters, by scope (`db:NAME`, `user:NAME/USER`), kept while
    /// their limits stay the same.
    limiters: Mutex<HashMap<String, Arc<crate::limits::Limiter>>>,
    /// Each database's cache freshness, while a pool caches its results.
    freshness:
        Mutex<HashMap<(String, u16, String), std::sync::Weak<crate::cache::freshness::Freshness>>>,
    /// Each database's catalogue, shared by its pools (see [`crate::analysis::catalogue`]).
    catalogues:
        Mutex<HashMap<(String, u16, String), std::sync::Weak<crate::analysis::catalogue::Source>>>,
    /// How pools made from now on reach their servers, when not by host and port.
    dial: std::sync::OnceLock<Arc<dyn crate::server::Dial>>,
    /// Told of tenants changed or ended, for the services beside the pooler (realtime),
    /// before the change is acknowledged.
    tenant_listeners: RwLock<Vec<TenantListener>>,
    /// Shards of the data plane its pools keep idle lists for.
    shards: usize,
    /// This process's cluster lease as its pools' fences follow it.
    pub lease: Arc<crate::pool::LeaseClock>,
    /// Each database's one change stream on this node, for the cache and Realtime.
    pub captures: Arc<crate::wal::Captures>,
}

type TenantListener = Box<dyn Fn(&TenantEvent) + Send + Sync>;

/// A tenant changed (put, removed) or had its clients ended (ban, terminate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantEvent {
    Changed(String),
    Ended(String),
}

impl Registry {
    /// Routes for clients on one runtime (no shard threads).
    pub fn new(config: Config) -> Registry {
        Registry::with_shards(config, 1)
    }

    /// Routes whose pools serve clients on `shards` shard threads.
    pub fn with_shards(config: Config, shards: usize) -> Registry {
        Registry {
            shards: shards.max(1),
            lease: Arc::new(crate::pool::LeaseClock::new(config.cluster.is_some())),
            config: RwLock::new(Arc::new(config)),
            tenants: Tenants::default(),
            tenant_listeners: RwLock::default(),
            pools: Mutex::new(HashMap::new()),
            paused: Mutex::new(Default::default()),
            retired: Mutex::new(Vec::new()),
            disabled: Mutex::new(Default::default()),
            schemas: Mutex::new(HashMap::new()),
            freshness: Mutex::new(HashMap::new()),
            catalogues: Mutex::new(HashMap::new()),
            limiters: Mutex::new(HashMap::new()),
            dial: std::sync::OnceLock::new(),
            captures: Arc::default(),
        }
    }

    /// Makes every pool created from now on reach its servers through `dial` instead of by
    /// host and port (in-process servers in tests). Set once, before the first login.
    pub fn set_dial(&self, dial: Arc<dyn crate::server::Dial>) {
        let _ = self.dial.set(dial);
    }

    fn lock_pools(&self) -> std::sync::MutexGuard<'_, HashMap<PoolKey, Arc<Pool>>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The configuration routing uses now.
    pub fn config(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The tenant a client names, if any: by `options` reference, by the text after the last
    /// dot of its user name, by its TLS server name (exact `sni_hostname`, or the first label
    /// under `[tenants] sni_base_domain`). Every name given must agree. Returns the tenant id
    /// and the user name to authenticate.
    fn tenant_named<'a>(
        &self,
        config: &Config,
        req: &RouteRequest<'a>,
    ) -> Result<Option<(String, &'a str)>, RouteError> {
        let mut named: Option<String> = None;
        let mut agree = |id: String| -> Result<(), RouteError> {
            match &named {
                Some(n) if *n != id => Err(RouteError::TenantConflict(n.clone(), id)),
                _ => {
                    named = Some(id);
                    Ok(())
                }
            }
        };
        if let Some(r) = req.reference {
            agree(r.to_owned())?;
        }
        if let Some(sni) = req.server_name {
            let sni = sni.to_ascii_lowercase();
            if let Some(id) = self.tenants.by_sni(&sni) {
                agree(id)?;
            } else if let Some(base) = &config.tenants.sni_base_domain {
                let base = base.trim_start_matches('.').to_ascii_lowercase();
                if let Some(label) = sni.strip_suffix(&base).and_then(|s| s.strip_suffix('.')) {
                    if !label.is_empty() && !label.contains('.') {
                        agree(label.to_owned())?;
                    }
                }
            }
        }
        let mut user = req.user;
        if let Some((base, suffix)) = req.user.rsplit_once('.') {
            let suffix_is_tenant = self.tenants.get(suffix).is_some();
            match &named {
                // Named otherwise: strip the same tenant; another tenant's name conflicts;
                // any other dot is part of the user name.
                Some(n) if n == suffix => user = base,
                Some(n) if suffix_is_tenant => {
                    return Err(RouteError::TenantConflict(n.clone(), suffix.to_owned()))
                }
                Some(_) => {}
                None if suffix_is_tenant => {
                    named = Some(suffix.to_owned());
                    user = base;
                }
                // `first.last` as a config-file user stays one; otherwise the suffix names
                // a tenant that does not exist.
                None if config.users.contains_key(req.user) => {}
                None if config.store.is_some()
                    && shoal_control::tenant::model::valid_external_id(suffix)
                    && !base.is_empty() =>
                {
                    named = Some(suffix.to_owned());
                    user = base;
                }
                None => {}
            }
        }
        Ok(named.map(|n| (n, user)))
    }

    /// Where a login goes, checked before authentication: an unknown or banned tenant, or an
    /// address outside its allow list, is refused before any password is exchanged.
    pub fn resolve(&self, req: &RouteRequest<'_>) -> Result<Routed, RouteError> {
        let config = self.config();
        let Some((id, user)) = self.tenant_named(&config, req)? else {
            // The console's names are never a wildcard database's.
            let wild = (!is_console(req.database))
                .then(|| config.wildcard_database(req.database))
                .flatten();
            let scope = match wild {
                Some(db) => Scope::Wildcard(config, Arc::new(db)),
                None => Scope::File(config, req.database.to_owned()),
            };
            return Ok(Routed {
                scope,
                user: req.user.to_owned(),
            });
        };
        let tenant = self
            .tenants
            .get(&id)
            .ok_or_else(|| RouteError::UnknownTenant(id.clone()))?;
        if tenant.tenant.banned_at(std::time::SystemTime::now()) {
            let reason = tenant
                .tenant
                .ban_reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            return Err(RouteError::TenantBanned(id, reason));
        }
        if !tenant.allows(req.addr) {
            return Err(RouteError::AddressNotAllowed(id));
        }
        Ok(Routed {
            scope: Scope::Tenant(tenant),
            user: user.to_owned(),
        })
    }

    /// The pool serving an authenticated `user` for `routed`, made on first use; refused
    /// while its database is disabled.
    pub fn pool(&self, routed: &Routed, user: &User) -> Result<Arc<Pool>, RouteError> {
        let pool = self.pool_for(routed, user)?;
        if self
            .disabled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(pool.database())
        {
            return Err(RouteError::Disabled(pool.database().to_owned()));
        }
        Ok(pool)
    }

    /// `DISABLE db` / `ENABLE db`: whether new logins to `database` are refused (clients
    /// already in stay).
    pub fn set_disabled(&self, database: &str, disabled: bool) {
        let mut d = self.disabled.lock().unwrap_or_else(|e| e.into_inner());
        if disabled {
            d.insert(database.to_owned());
        } else {
            d.remove(database);
        }
    }

    /// `SHOW STATE`'s flags: whether every pool is paused (`PAUSE` or `SUSPEND` with no
    /// database), and whether any database is disabled.
    pub fn paused_all(&self) -> bool {
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains("*")
    }

    /// Every pool routing can reach.
    pub fn pools(&self) -> Vec<Arc<Pool>> {
        self.lock_pools().values().cloned().collect()
    }

    /// A tenant's pools.
    pub fn tenant_pools(&self, id: &str) -> Vec<Arc<Pool>> {
        let db = format!("{}{id}", DB_PREFIX);
        self.lock_pools()
            .iter()
            .filter(|((d, _), _)| *d == db)
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// Takes a pool out of routing: new logins get a fresh pool; clients attached to the old
    /// one keep it until they leave, and its idle servers are closed.
    pub fn remove_pool(&self, database: &str, user: &str) -> Option<Arc<Pool>> {
        let pool = self
            .lock_pools()
            .remove(&(database.to_owned(), user.to_owned()))?;
        self.retire(&pool);
        let closing = pool.clone();
        tokio::spawn(async move { closing.close_idle().await });
        Some(pool)
    }

    /// Routes later logins by `config`. Pools whose settings, upstream or credentials changed
    /// (or whose database or user is gone) are removed as by [`Registry::remove_pool`];
    /// unchanged pools, tenant pools, and every attached client, carry on untouched.
    pub fn replace_config(&self, config: Config) {
        let mut stale: Vec<PoolKey> = Vec::new();
        let mut resize: Vec<(Arc<Pool>, usize)> = Vec::new();
        for ((db, user), pool) in self.lock_pools().iter() {
            if db.starts_with(DB_PREFIX) {
                continue;
            }
            let wild = config.wildcard_database(db);
            let (Some(d), Some(u)) = (
                config.databases.get(db).or(wild.as_ref()),
                config.users.get(user),
            ) else {
                stale.push((db.clone(), user.clone()));
                continue;
            };
            let settings = config.pool_settings(d, u);
            // Rules change in place: clients already on the pool are held to the new ones.
            self.set_features(pool, d, u);
            if !same_upstream(pool, d, u) || without_size(&settings) != without_size(&pool.settings)
            {
                stale.push((db.clone(), user.clone()));
            } else if settings.size != pool.size() {
                // Only the size changed: the pool is resized in place.
                resize.push((pool.clone(), settings.size));
            }
        }
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        for (db, user) in stale {
            self.remove_pool(&db, &user);
        }
        for (pool, size) in resize {
            tokio::spawn(async move { pool.resize(size).await });
        }
    }

    /// Calls `f` on every tenant change from now on, synchronously (so a change is in
    /// force everywhere when the API answers).
    pub fn on_tenant_event(&self, f: impl Fn(&TenantEvent) + Send + Sync + 'static) {
        self.tenant_listeners
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(f));
    }

    fn tenant_event(&self, e: &TenantEvent) {
        for f in self
            .tenant_listeners
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            f(e);
        }
    }

    /// Adds or replaces a tenant. Its pools whose upstream or credentials changed are
    /// replaced (attached clients stay on the old pool until they leave); pools whose only
    /// change is their size are resized in place; pools of users no longer listed end.
    pub async fn put_tenant(&self, route: TenantRoute) {
        let id = route.id().to_owned();
        let config = self.config();
        let new_users = route.upstream_users();
        let database = route.database.clone();
        let settings_of: HashMap<String, PoolSettings> = new_users
            .values()
            .map(|u| (u.name.clone(), route.pool_settings(&config, u)))
            .collect();
        let auth_query = database.auth_query.is_some();
        self.tenants.insert(route);
        self.tenant_event(&TenantEvent::Changed(id.clone()));
        for pool in self.tenant_pools(&id) {
            let user = pool_user(&pool);
            let listed = new_users.get(&user);
            let keep_settings = match listed {
                Some(u) => same_upstream(&pool, &database, u).then(|| &settings_of[&user]),
                // A passthrough (auth_query) user stays while auth_query is on and the
                // upstream is the same.
                None if auth_query && pool.upstream.passthrough.is_some() => {
                    let same = pool.upstream.host == database.host
                        && pool.upstream.port == database.port
                        && pool.upstream.dbname == database.dbname
                        && pool.upstream.family == database.family
                        && pool.upstream.tls_settings == database.tls;
                    same.then_some(&pool.settings)
                }
                None => None,
            };
            match keep_settings {
                Some(s) if without_size(s) == without_size(&pool.settings) => {
                    // Rules change in place, for clients already on the pool too.
                    match listed {
                        Some(u) => self.set_features(&pool, &database, u),
                        None => {
                            let named = User::named(&user, ClientAuth::Trust);
                            self.set_features(&pool, &database, &named);
                        }
                    }
                    if s.size != pool.size() {
                        pool.resize(s.size).await;
                    }
                }
                _ if listed.is_none() && !auth_query => {
                    self.end_pool(&pool, "its user was removed from the tenant")
                        .await;
                }
                // New upstream or credentials: new logins get a new pool; clients on the old
                // one keep its servers (still logged in) until they leave.
                _ => {
                    self.lock_pools().retain(|_, p| !Arc::ptr_eq(p, &pool));
                    self.retire(&pool);
                }
            }
        }
    }

    fn retire(&self, pool: &Arc<Pool>) {
        let mut r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.retain(|w| w.strong_count() > 0);
        r.push(Arc::downgrade(pool));
    }
}

/// The user of a pool (from its route key, not its display name: names may hold a `/`).
fn pool_user(pool: &Pool) -> String {
    pool.route_key.1.clone()
}

#[cfg(test)]
mod tests;
