//! Building a pool for a database and user: its upstream, its catalogue, and the features
//! its configuration asks for (result cache, limits, query rules, read replicas), and whether
//! a pool built before a configuration change can be kept.

use std::sync::Arc;

use super::{Registry, RouteError, Routed, Scope, DB_PREFIX};
use crate::analysis::catalogue::Source;
use crate::config::{Database, PoolMode, PoolSettings, User};
use crate::features::{Features, PoolFeatures};
use crate::pool::Pool;
use crate::server::Upstream;

impl Registry {
    pub(super) fn pool_for(&self, routed: &Routed, user: &User) -> Result<Arc<Pool>, RouteError> {
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
    pub(super) fn set_features(&self, pool: &Pool, d: &Database, u: &User) {
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
}

pub(super) fn same_upstream(pool: &Pool, d: &Database, u: &User) -> bool {
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

pub(super) fn without_size(s: &PoolSettings) -> PoolSettings {
    PoolSettings {
        size: 0,
        ..s.clone()
    }
}
