//! What each pool carries for the features: its statement analyses and catalogue, query
//! rules, result cache, limits, replicas and LISTEN hub.
//!
//! The pool is data plane and names none of these; it holds a [`Features`] as its add-on
//! (`pool::AddOns`, its type named at the crate root through `pool::Plug`), made with it by
//! the route registry. Import [`PoolFeatures`] to ask a pool for them: `pool.cache()`, `pool.rules()`;
//! whoever makes a pool keeps its `Arc<Features>` to set them.
//! Rules, cache and limits are replaced live on reloads, so each sits behind a lock with a
//! flag that spares pools without one the lock on every statement.
//!
//! [`relay`] is the session's side of them: the data plane's `seam::Features`,
//! implemented over these.

pub mod relay;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use crate::analysis::catalogue::Source;
use crate::analysis::Analyses;
use crate::cache::QueryCache;
use crate::limits::PoolLimits;
use crate::notify::Hub;
use crate::pool::{AddOns, Pool};
use crate::query_rules::QueryRules;
use crate::replicas::ReplicaSet;

/// The features' state for one pool.
pub struct Features {
    /// Each statement text its clients send, analysed once: what its rules, cache and
    /// replica split decide on (see [`crate::analysis`]).
    analyses: Arc<Analyses>,
    /// What its statements are judged against: its database's, shared by its pools.
    catalogue: Arc<Source>,
    /// LISTEN/NOTIFY for the pool's transaction-mode clients.
    notify: Arc<Hub>,
    /// Read replicas of the pool's database, when reads may go to them.
    replicas: OnceLock<Arc<ReplicaSet>>,
    /// Query rules in force (its database's and its user's).
    rules: Swappable<QueryRules>,
    /// The result cache, when the pool has one.
    cache: Swappable<QueryCache>,
    /// Rate and concurrency limits, when the pool's database or user has any.
    limits: Swappable<PoolLimits>,
}

impl Features {
    /// No rules, cache, limits or replicas yet; statements judged against `catalogue`.
    pub fn new(catalogue: Arc<Source>) -> Arc<Features> {
        Arc::new(Features {
            analyses: Arc::default(),
            catalogue,
            notify: Arc::default(),
            replicas: OnceLock::new(),
            rules: Swappable::default(),
            cache: Swappable::default(),
            limits: Swappable::default(),
        })
    }

    /// The query rules in force, if any.
    #[inline]
    pub fn rules(&self) -> Option<Arc<QueryRules>> {
        self.rules.get()
    }

    /// Puts `rules` in force for the pool's clients from their next transaction on (unchanged
    /// rules keep what they remember).
    pub fn set_rules(&self, rules: Vec<crate::config::rules::Rule>) {
        self.rules.update(|current| {
            if current.map_or(&[][..], |r| r.rules()) == rules.as_slice() {
                return None;
            }
            let new =
                QueryRules::new(rules, self.analyses.clone(), self.catalogue.clone()).map(Arc::new);
            if new.as_ref().is_some_and(|r| r.needs_catalogue()) {
                self.catalogue.start();
            }
            Some(new)
        });
    }

    /// The rate and concurrency limits its clients are held to, if any.
    #[inline]
    pub fn limits(&self) -> Option<Arc<PoolLimits>> {
        self.limits.get()
    }

    /// Puts `limits` in force from the clients' next transaction (the same limiters as now
    /// keep their state).
    pub fn set_limits(&self, limits: Option<PoolLimits>) {
        self.limits.update(|current| {
            if let (Some(c), Some(n)) = (current, limits.as_ref()) {
                if same_limiter(&c.database, &n.database)
                    && same_limiter(&c.user, &n.user)
                    && c.wait == n.wait
                {
                    return None;
                }
            }
            Some(limits.map(Arc::new))
        });
    }

    /// The result cache, if the pool has one.
    #[inline]
    pub fn cache(&self) -> Option<Arc<QueryCache>> {
        self.cache.get()
    }

    /// Puts a cache with `config` in place (`None`: none), keeping the present one when its
    /// settings are unchanged; `freshness` gives a new one its database's versions.
    pub fn set_cache(
        &self,
        config: Option<crate::config::cache::Cache>,
        freshness: impl FnOnce() -> Arc<crate::cache::freshness::Freshness>,
    ) {
        self.cache.update(|current| {
            if current.map(|c| &c.config) == config.as_ref() {
                return None;
            }
            let new =
                config.map(|c| Arc::new(QueryCache::new(c, freshness(), self.analyses.clone())));
            if let Some(c) = &new {
                c.freshness.start();
            }
            Some(new)
        });
    }

    pub fn catalogue(&self) -> &Arc<Source> {
        &self.catalogue
    }

    pub fn analyses(&self) -> &Arc<Analyses> {
        &self.analyses
    }

    /// The pool's replicas, when reads may go to them.
    #[inline]
    pub fn replicas(&self) -> Option<&Arc<ReplicaSet>> {
        self.replicas.get()
    }

    /// Gives the pool its replicas (once, as it is made).
    pub fn set_replicas(&self, set: ReplicaSet) {
        let _ = self.replicas.set(Arc::new(set));
    }

    pub fn notify(&self) -> &Arc<Hub> {
        &self.notify
    }
}

impl AddOns for Features {
    fn stop_serving(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(r) = self.replicas.get() {
                r.fence().await;
            }
        })
    }
}

/// A feature's state that reloads replace while statements read it.
struct Swappable<T> {
    current: RwLock<Option<Arc<T>>>,
    /// Whether `current` holds one: read without the lock on every statement.
    present: AtomicBool,
}

impl<T> Default for Swappable<T> {
    fn default() -> Self {
        Swappable {
            current: RwLock::new(None),
            present: AtomicBool::new(false),
        }
    }
}

impl<T> Swappable<T> {
    #[inline]
    fn get(&self) -> Option<Arc<T>> {
        if !self.present.load(Ordering::Acquire) {
            return None;
        }
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the state with what `next` makes of the present one (`None` from `next`:
    /// keep it as it is).
    fn update(&self, next: impl FnOnce(Option<&Arc<T>>) -> Option<Option<Arc<T>>>) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if let Some(new) = next(current.as_ref()) {
            self.present.store(new.is_some(), Ordering::Release);
            *current = new;
        }
    }
}

/// A pool's features, for code above the data plane and for [`relay`].
pub trait PoolFeatures {
    fn features(&self) -> &Features;

    #[inline]
    fn rules(&self) -> Option<Arc<QueryRules>> {
        self.features().rules()
    }

    #[inline]
    fn limits(&self) -> Option<Arc<PoolLimits>> {
        self.features().limits()
    }

    #[inline]
    fn cache(&self) -> Option<Arc<QueryCache>> {
        self.features().cache()
    }

    #[inline]
    fn replicas(&self) -> Option<&Arc<ReplicaSet>> {
        self.features().replicas()
    }

    /// The replica configuration the pool was made with (`None`: reads stay here).
    fn replica_config(&self) -> Option<&crate::config::replicas::Replicas> {
        self.replicas().map(|r| &r.config)
    }

    fn catalogue(&self) -> &Arc<Source> {
        self.features().catalogue()
    }

    /// LISTEN/NOTIFY for the pool's transaction-mode clients.
    #[inline]
    fn notify(&self) -> &Arc<Hub> {
        self.features().notify()
    }
}

impl PoolFeatures for Pool {
    #[inline]
    fn features(&self) -> &Features {
        self.addons()
    }
}

/// Each pool of `pools` that has what `pick` takes from its features, with it.
pub fn each<T>(pools: &[Arc<Pool>], pick: impl Fn(&Features) -> Option<T>) -> Vec<(Arc<Pool>, T)> {
    pools
        .iter()
        .filter_map(|p| Some((p.clone(), pick(p.features())?)))
        .collect()
}

/// `pools` with the replica pools of each, for listings of every pool with servers.
pub fn with_replica_pools(pools: Vec<Arc<Pool>>) -> Vec<Arc<Pool>> {
    let mut all = Vec::with_capacity(pools.len());
    for p in pools {
        let members: Vec<Arc<Pool>> = p
            .replicas()
            .map(|s| s.members.iter().map(|m| m.pool.clone()).collect())
            .unwrap_or_default();
        all.push(p);
        all.extend(members);
    }
    all
}

fn same_limiter(
    a: &Option<Arc<crate::limits::Limiter>>,
    b: &Option<Arc<crate::limits::Limiter>>,
) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}
