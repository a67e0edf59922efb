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

use crate::analysis::catalogue::Source;
use crate::config::{ClientAuth, Config, Database, PoolMode, PoolSettings, User};
use crate::features::{Features, PoolFeatures};
use crate::pool::Pool;
use crate::server::Upstream;
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

    fn pool_for(&self, routed: &Routed, user: &User) -> Result<Arc<Pool>, RouteError> {
        let (db, settings) = match &routed.scope {
            Scope::File(config, name) => {
                let db = config
                    .databases
                    .get(name)
                    .ok_or_else(|| RouteError::UnknownDatabase(name.clone()))?;
                (db, config.pool_settings(db, user))
            }
            Scope::Wildcard(config, db) => (&**db, config.pool_settings(db, user)),
            Scope::Tenant(t) => (&t.database, t.pool_settings(&self.config(), user)),
        };
        let key = (db.name.clone(), user.name.clone());
        // A user found by auth_query whose password changed needs a pool that logs in with
        // the new secret; clients on the old one keep it.
        let usable =
            |pool: &Pool| pool.upstream.passthrough == user.passthrough && pool.ended().is_none();
        if let Some(pool) = self.lock_pools().get(&key).filter(|p| usable(p)) {
            return Ok(pool.clone());
        }
        // Certificates and keys are read with no lock held: every login waits on that one.
        let tls_settings = crate::config::upstream_tls_for(db, user);
        let tls = crate::upstream_tls::UpstreamTls::build(&tls_settings)
            .map_err(|e| RouteError::Misconfigured(db.name.clone(), e.to_string()))?;
        let mut pools = self.lock_pools();
        if let Some(pool) = pools.get(&key) {
            if usable(pool) {
                // Made by another login meanwhile.
                return Ok(pool.clone());
            }
            if let Some(old) = pools.remove(&key) {
                crate::control::spawn(async move { old.close_idle().await });
            }
        }
        let name = match routed.tenant() {
            Some(t) => format!("{}/{}", t.id(), user.name),
            None => format!("{}/{}", db.name, user.name),
        };
        let upstream = Upstream {
            host: db.host.clone(),
            port: db.port,
            family: db.family,
            dbname: db.dbname.clone(),
            user: user.server_user.clone(),
            password: user.server_password.clone(),
            tls: tls.map(Arc::new),
            tls_settings,
            passthrough: user.passthrough.clone(),
            dial: self.dial.get().cloned(),
        };
        let features = Features::new(self.catalogue_for(db, &upstream, &settings));
        let names = crate::pool::Names {
            name,
            route_key: (db.name.clone(), user.name.clone()),
            tenant: routed.tenant().map(|t| t.id().to_owned()),
        };
        let pool = Pool::new(
            names,
            crate::prepared::StatementRegistry::sharing(self.schema_counter(db)),
            settings,
            upstream,
            self.lease.clone(),
            features.clone(),
            self.shards,
        );
        self.set_features(&pool, db, user);
        if let Some(replicas) = replicas_for(db, user) {
            // A replica's pool keeps its own LISTEN hub and judges by the primary's catalogue.
            let catalogue = features.catalogue().clone();
            features.set_replicas(crate::replicas::ReplicaSet::new(
                &pool,
                replicas,
                features.analyses().clone(),
                catalogue.clone(),
                || Features::new(catalogue.clone()),
            ));
        }
        if let Some(t) = routed.tenant() {
            // A tenant's `default_parameter_status` answers logins without startup
            // parameters before any server is reached.
            let defaults: Vec<(String, String)> = t
                .tenant
                .default_parameter_status
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if !defaults.is_empty() {
                pool.remember_login_params(&[], &defaults);
            }
        }
        {
            let paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
            if paused.contains("*") || paused.contains(&db.name) {
                pool.pause();
            }
        }
        pools.insert(key, pool.clone());
        Ok(pool)
    }

    /// The schema counter of `db`'s database on its server, shared by the pools of its
    /// users (see [`crate::prepared::StatementRegistry`]).
    fn schema_counter(&self, db: &Database) -> Arc<std::sync::atomic::AtomicU64> {
        let mut schemas = self.schemas.lock().unwrap_or_else(|e| e.into_inner());
        schemas
            .entry((db.host.clone(), db.port, db.dbname.clone()))
            .or_default()
            .clone()
    }

    /// `d`'s catalogue, shared by its pools: read through the first pool that needed it.
    fn catalogue_for(
        &self,
        d: &Database,
        upstream: &Upstream,
        settings: &PoolSettings,
    ) -> Arc<Source> {
        let key = (d.host.clone(), d.port, d.dbname.clone());
        let mut all = self.catalogues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = all.get(&key).and_then(std::sync::Weak::upgrade) {
            return c;
        }
        all.retain(|_, w| w.strong_count() > 0);
        let c = Source::new(
            format!("{}:{}/{}", upstream.host, upstream.port, upstream.dbname),
            upstream.clone(),
            settings.connect_timeout,
        );
        all.insert(key, Arc::downgrade(&c));
        c
    }

    /// Puts in force on `pool` the rules, result cache and limits `d` and `u` call for
    /// (clients already on it are held to them from their next transaction).
    fn set_features(&self, pool: &Pool, d: &Database, u: &User) {
        let f = pool.features();
        f.set_rules(rules_for(d, u));
        self.set_cache(pool, f, d, u);
        self.set_limits(f, d, u);
    }

    /// Gives `pool` the result cache `d` and `u` call for (transaction mode only: a
    /// session-mode client's server keeps its own state), sharing its database's freshness.
    fn set_cache(&self, pool: &Pool, f: &Features, d: &Database, u: &User) {
        let on = u.cache.unwrap_or(d.cache.enabled) && pool.settings.mode == PoolMode::Transaction;
        f.set_cache(on.then(|| d.cache.clone()), || {
            let key = (d.host.clone(), d.port, d.dbname.clone());
            let mut all = self.freshness.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(f) = all.get(&key).and_then(std::sync::Weak::upgrade) {
                return f;
            }
            all.retain(|_, w| w.strong_count() > 0);
            let f = crate::cache::freshness::Freshness::new(
                key.clone(),
                pool.upstream.clone(),
                f.catalogue().clone(),
                &self.captures,
            );
            all.insert(key, Arc::downgrade(&f));
            f
        });
    }

    /// Gives `pool` the rate and concurrency limits of `d` (shared by its pools) and `u`.
    fn set_limits(&self, f: &Features, d: &Database, u: &User) {
        use crate::config::limits::Limits;
        let mut all = self.limiters.lock().unwrap_or_else(|e| e.into_inner());
        let mut limiter = |key: String, config: Limits, label: String| {
            let config = Limits {
                statement_timeout: None,
                wait: Default::default(),
                ..config
            };
            if !config.any() {
                all.remove(&key);
                return None;
            }
            if let Some(l) = all.get(&key).filter(|l| l.config == config) {
                return Some(l.clone());
            }
            let l = Arc::new(crate::limits::Limiter::new(config, label));
            all.insert(key, l.clone());
            Some(l)
        };
        let scope = match d.name.strip_prefix(DB_PREFIX) {
            Some(tenant) => format!("tenant \"{tenant}\""),
            None => format!("database \"{}\"", d.name),
        };
        let database = limiter(format!("db:{}", d.name), d.limits.clone(), scope);
        let user = u.limits.as_deref().and_then(|l| {
            limiter(
                format!("user:{}/{}", d.name, u.name),
                l.clone(),
                format!("user \"{}\"", u.name),
            )
        });
        drop(all);
        let limits = (database.is_some() || user.is_some()).then_some(crate::limits::PoolLimits {
            database,
            user,
            wait: d.limits.wait,
        });
        f.set_limits(limits);
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

    /// Pools of `database` (all when `None`), as the admin console names databases.
    pub fn pools_of(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.lock_pools()
            .iter()
            .filter(|((d, _), _)| database.is_none_or(|want| d == want))
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// `PAUSE [db]`: the pools (and pools made later) hold new transactions.
    pub fn pause(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(database.unwrap_or("*").to_owned());
        let mut pools = self.pools_of(database);
        // Pools taken out of routing still serve their clients: they pause too.
        pools.extend(self.retired_pools(database));
        for p in &pools {
            p.pause();
        }
        pools
    }

    fn retired_pools(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|w| w.upgrade())
            .filter(|p| database.is_none_or(|d| p.database() == d))
            .collect()
    }

    /// `RESUME [db]`.
    pub fn resume(&self, database: Option<&str>) {
        let still = {
            let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
            match database {
                Some(d) => {
                    paused.remove(d);
                }
                None => paused.clear(),
            }
            paused.clone()
        };
        for ((db, _), p) in self.lock_pools().iter() {
            if !still.contains("*") && !still.contains(db) {
                p.resume();
            }
        }
        for p in self.retired_pools(None) {
            let db = p.database().to_owned();
            if !still.contains("*") && !still.contains(&db) {
                p.resume();
            }
        }
    }

    /// Servers still open in pools taken out of routing (of `database`, or all).
    pub fn retired_servers(&self, database: Option<&str>) -> usize {
        let r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.iter()
            .filter_map(|w| w.upgrade())
            .filter(|p| database.is_none_or(|d| p.database() == d))
            .map(|p| p.stats.servers.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// `KILL db`: ends every client and pool of a database.
    pub async fn kill(&self, database: &str, reason: &str) -> usize {
        let mut n = 0;
        for pool in self.pools_of(Some(database)) {
            n += self.end_pool(&pool, reason).await;
        }
        n
    }

    /// Removes a tenant: its clients are told why and disconnected, its pools closed.
    pub async fn remove_tenant(&self, id: &str, reason: &str) -> Option<usize> {
        let old = self.tenants.remove(id)?;
        drop(old);
        self.tenant_event(&TenantEvent::Changed(id.to_owned()));
        Some(self.end_tenant_pools(id, reason).await)
    }

    /// Ends every pool of a tenant (ban, terminate); returns how many clients were told.
    pub async fn end_tenant_pools(&self, id: &str, reason: &str) -> usize {
        self.tenant_event(&TenantEvent::Ended(id.to_owned()));
        let mut n = 0;
        for pool in self.tenant_pools(id) {
            n += self.end_pool(&pool, reason).await;
        }
        n
    }

    pub async fn end_pool(&self, pool: &Arc<Pool>, reason: &str) -> usize {
        {
            let mut pools = self.lock_pools();
            pools.retain(|_, p| !Arc::ptr_eq(p, pool));
        }
        pool.end(reason.to_owned()).await
    }

    /// Closes tenant pools no client has used for `idle`: a tenant costs nothing again
    /// until its next login.
    pub fn close_unused_tenant_pools(&self, idle: std::time::Duration) -> usize {
        let now = crate::clock::now_ms();
        let idle_ms = idle.as_millis() as u64;
        let unused: Vec<PoolKey> = self
            .lock_pools()
            .iter()
            .filter(|((db, _), p)| {
                db.starts_with(DB_PREFIX)
                    && p.stats.clients.load(std::sync::atomic::Ordering::Relaxed) == 0
                    && now.saturating_sub(p.unused_since.load(std::sync::atomic::Ordering::Relaxed))
                        >= idle_ms
            })
            .map(|(k, _)| k.clone())
            .collect();
        for (db, user) in &unused {
            self.remove_pool(db, user);
        }
        unused.len()
    }
}

fn same_upstream(pool: &Pool, d: &Database, u: &User) -> bool {
    pool.upstream.host == d.host
        && pool.upstream.port == d.port
        && pool.upstream.dbname == d.dbname
        && pool.upstream.user == u.server_user
        && pool.upstream.password == u.server_password
        && pool.upstream.family == d.family
        && pool.upstream.tls_settings == crate::config::upstream_tls_for(d, u)
        && pool.replica_config() == replicas_for(d, u).as_ref()
}

/// The query rules of `u`'s pools of `d`: the database's, then the user's.
fn rules_for(d: &Database, u: &User) -> Vec<crate::config::rules::Rule> {
    d.rules
        .iter()
        .chain(u.rules.iter().flat_map(|r| r.iter()))
        .cloned()
        .collect()
}

/// The replicas of `d` as `u`'s pools use them (`u`'s `read_routing` wins), if it has any.
fn replicas_for(d: &Database, u: &User) -> Option<crate::config::replicas::Replicas> {
    if d.replicas.hosts.is_empty() {
        return None;
    }
    let mut r = d.replicas.clone();
    if let Some(routing) = u.read_routing {
        r.routing = routing;
    }
    Some(r)
}

fn without_size(s: &PoolSettings) -> PoolSettings {
    PoolSettings {
        size: 0,
        ..s.clone()
    }
}

/// The user of a pool (from its route key, not its display name: names may hold a `/`).
fn pool_user(pool: &Pool) -> String {
    pool.route_key.1.clone()
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
            reference: None,
            addr: None,
        }
    }

    fn user_of(r: &Registry, user: &str, db: &str) -> (Routed, User) {
        let routed = r.resolve(&req(user, db)).unwrap();
        let u = routed.configured_user().unwrap().clone();
        (routed, u)
    }

    /// DDL through one database's pools makes its statements be prepared afresh, and no
    /// other database's.
    #[tokio::test]
    async fn schema_changes_stay_within_their_database() {
        let c = Config::parse(
            "[databases.d]\nport = 1\n[databases.e]\nport = 1\n[databases.d2]\nport = 1\ndbname = \"d\"\n\
             [users.u]\npassword = \"p\"\n[users.v]\npassword = \"p\"\n",
            "test",
            &|_| None,
        )
        .unwrap();
        let r = Registry::new(c);
        let pool = |user: &str, db: &str| {
            let (routed, u) = user_of(&r, user, db);
            r.pool(&routed, &u).unwrap()
        };
        let (du, dv, d2, e) = (
            pool("u", "d"),
            pool("v", "d"),
            pool("u", "d2"),
            pool("u", "e"),
        );
        let body = b"SELECT 1\0\0\0";
        let before: Vec<_> = [&du, &dv, &d2, &e]
            .iter()
            .map(|p| {
                p.statements
                    .intern(0, body, shoal_wire::sql::ClientEncoding::Utf8)
            })
            .collect();
        du.statements.schema_changed();
        let after: Vec<_> = [&du, &dv, &d2, &e]
            .iter()
            .map(|p| {
                p.statements
                    .intern(0, body, shoal_wire::sql::ClientEncoding::Utf8)
            })
            .collect();
        let fresh: Vec<bool> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| b.id != a.id)
            .collect();
        // d, as u and as v, and d2 (the same database on the same server) re-prepare; e keeps.
        assert_eq!(fresh, vec![true, true, true, false]);
    }

    #[tokio::test]
    async fn routes_known_names_and_refuses_others() {
        let r = Registry::new(config(3));
        let (routed, u) = user_of(&r, "u", "d");
        assert!(r
            .resolve(&req("nobody", "d"))
            .unwrap()
            .configured_user()
            .is_none());
        let p = r.pool(&routed, &u).unwrap();
        assert_eq!(p.name, "d/u");
        assert!(Arc::ptr_eq(&p, &r.pool(&routed, &u).unwrap()));
        let (nodb, u) = user_of(&r, "u", "nodb");
        assert_eq!(
            r.pool(&nodb, &u).err(),
            Some(RouteError::UnknownDatabase("nodb".into()))
        );
    }

    #[tokio::test]
    async fn pools_change_with_the_config_at_run_time() {
        let r = Registry::new(config(3));
        let (routed, u) = user_of(&r, "u", "d");
        let before = r.pool(&routed, &u).unwrap();
        // The same settings: the pool stays.
        r.replace_config(config(3));
        let (routed, u) = user_of(&r, "u", "d");
        assert!(Arc::ptr_eq(&before, &r.pool(&routed, &u).unwrap()));
        // A new pool size: the pool is resized in place.
        r.replace_config(config(5));
        let (routed, u) = user_of(&r, "u", "d");
        let after = r.pool(&routed, &u).unwrap();
        assert!(Arc::ptr_eq(&before, &after));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(after.size(), 5);
        // Another setting: new logins get a new pool; the old one lives on for its clients.
        r.replace_config(
            Config::parse(
                "[pool]\npool_size = 5\npool_mode = \"session\"\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n",
                "test",
                &|_| None,
            )
            .unwrap(),
        );
        let (routed, u) = user_of(&r, "u", "d");
        let third = r.pool(&routed, &u).unwrap();
        assert!(!Arc::ptr_eq(&before, &third));
        assert!(r.remove_pool("d", "u").is_some());
        assert!(r.pools().is_empty());
    }

    fn tenant(id: &str, sni: Option<&str>) -> TenantRoute {
        let mut t: crate::tenant::model::Tenant = serde_json::from_value(serde_json::json!({
            "db_host": "127.0.0.1", "db_database": "x", "require_user": true,
            "users": [{"db_user": "app", "db_password": "pw"}],
            "sni_hostname": sni,
            "allow_list": ["10.0.0.0/8"]
        }))
        .unwrap();
        t.external_id = id.into();
        TenantRoute::new(t, std::path::Path::new("/nonexistent")).unwrap()
    }

    fn with_store() -> Config {
        Config::parse(
            "[store]\nurl = \"sqlite::memory:\"\n[tenants]\nsni_base_domain = \"db.example.com\"\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n[users.\"first.last\"]\npassword = \"p\"\n",
            "test",
            &|_| None,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn tenants_are_named_by_user_sni_or_reference_and_must_agree() {
        let r = Registry::new(with_store());
        r.put_tenant(tenant("acme", Some("pg.acme.test"))).await;
        r.put_tenant(tenant("other", None)).await;
        let ip: Option<IpAddr> = Some("10.1.2.3".parse().unwrap());
        let at =
            |user: &'static str, sni: Option<&'static str>, reference: Option<&'static str>| {
                r.resolve(&RouteRequest {
                    user,
                    database: "d",
                    server_name: sni,
                    reference,
                    addr: ip,
                })
            };
        let id = |x: Result<Routed, RouteError>| {
            let x = x.unwrap();
            (x.tenant().map(|t| t.id().to_owned()), x.user)
        };
        assert_eq!(
            id(at("app.acme", None, None)),
            (Some("acme".into()), "app".into())
        );
        assert_eq!(
            id(at("app", Some("pg.acme.test"), None)),
            (Some("acme".into()), "app".into())
        );
        assert_eq!(
            id(at("app", Some("other.db.example.com"), None)),
            (Some("other".into()), "app".into())
        );
        assert_eq!(
            id(at("app", None, Some("other"))),
            (Some("other".into()), "app".into())
        );
        assert_eq!(
            id(at("app.acme", Some("pg.acme.test"), Some("acme"))),
            (Some("acme".into()), "app".into())
        );
        // Config-file users, dotted or not, stay in the config file.
        assert_eq!(id(at("u", None, None)), (None, "u".into()));
        assert_eq!(
            id(at("first.last", None, None)),
            (None, "first.last".into())
        );
        // Disagreements and unknown tenants are refused.
        assert!(matches!(
            at("app.other", Some("pg.acme.test"), None),
            Err(RouteError::TenantConflict(..))
        ));
        assert!(matches!(
            at("app", Some("pg.acme.test"), Some("other")),
            Err(RouteError::TenantConflict(..))
        ));
        assert!(matches!(
            at("app.nosuch", None, None),
            Err(RouteError::UnknownTenant(_))
        ));
        assert!(matches!(
            at("app", None, Some("nosuch")),
            Err(RouteError::UnknownTenant(_))
        ));
        // The allow list.
        let outside = r.resolve(&RouteRequest {
            user: "app.acme",
            database: "d",
            server_name: None,
            reference: None,
            addr: Some("192.168.1.1".parse().unwrap()),
        });
        assert_eq!(
            outside.unwrap_err(),
            RouteError::AddressNotAllowed("acme".into())
        );
    }
}
