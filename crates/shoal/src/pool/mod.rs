//! A pool of server connections for one (database, user) pair.
//!
//! Checkout takes a permit from a fair (FIFO) semaphore sized `pool_size`, then reuses the
//! most recently returned idle connection or opens a new one. Holding a permit is what counts
//! against the pool size, so waiting clients queue in arrival order and a timed-out wait gives
//! a clear error. A background reaper closes connections idle too long or past their lifetime
//! and keeps `min_pool_size` warm.
//!
//! Server connections live boxed (a `ServerConn` is ~400 bytes): checkout and checkin move a
//! pointer between an idle list and a lease instead of copying the struct several times per
//! transaction.
#![allow(clippy::vec_box)]

mod addons;
mod checkout;
mod failures;
mod fence;
mod idle;
mod lease;
mod permits;
pub mod pg_fence;
mod slow;
mod upkeep;

pub use addons::{AddOns, Plug, PoolAddOns};
pub use fence::{Fence, LeaseClock};
use idle::IdleList;
pub use lease::{Lease, Leaving};
use permits::Permits;
pub use slow::SlowQuery;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::clock;
use crate::config::PoolSettings;
use crate::params::{Params, SharedParams};
use crate::server::{ServerConn, ServerError, Upstream};

/// Distinct startup-parameter sets remembered per pool; past it the cache starts over.
const LOGIN_PARAMS_CACHE: usize = 256;

/// Why no server connection could be had.
#[derive(Debug, thiserror::Error)]
pub enum CheckoutError {
    #[error("no server connection available in pool \"{pool}\" within {waited:?} (query_wait_timeout); all {size} are busy")]
    WaitTimeout {
        pool: String,
        waited: Duration,
        size: usize,
    },
    #[error("pool \"{pool}\" is saturated: {waiting} clients wait for a server, and the last one served had waited {waited:?}, past half of query_wait_timeout ({timeout:?}); try again later")]
    Saturated {
        pool: String,
        waiting: usize,
        waited: Duration,
        timeout: Duration,
    },
    #[error("pool \"{pool}\": {source}")]
    Server {
        pool: String,
        #[source]
        source: ServerError,
    },
    #[error("pool \"{0}\" is shutting down")]
    Closed(String),
    #[error("pool \"{0}\" is no longer owned by this node (cluster); reconnect")]
    Fenced(String),
}

/// How a client's cancel reaches a checkout waiting for a server: [`WaitCancel::begin`]
/// when the wait begins (its future completes on a cancel), [`WaitCancel::end`] as soon as
/// it ends, before the server is prepared.
pub trait WaitCancel {
    type Cancelled<'a>: std::future::Future
    where
        Self: 'a;
    fn begin(&self) -> Self::Cancelled<'_>;
    fn end(&self);
}

/// A wait nothing can cancel (a login's: the client has no cancel key yet).
pub struct NoCancel;

impl WaitCancel for NoCancel {
    type Cancelled<'a> = std::future::Pending<()>;
    fn begin(&self) -> Self::Cancelled<'_> {
        std::future::pending()
    }
    fn end(&self) {}
}

/// What a checkout finds among the idle servers.
enum Idle<'a> {
    Server(Box<ServerConn>),
    /// None to take: open one, in the room taken for it.
    Open(Opening<'a>),
    /// None to take, and no room to open one (only without `reserve`).
    Nothing,
}

/// Room taken in `stats.servers` for a server being opened: given back unless the server
/// opens ([`Opening::opened`]), however the opening ends (a failure, or a checkout dropped
/// midway by the client's cancel).
struct Opening<'a>(&'a AtomicUsize);

impl Opening<'_> {
    fn opened(self) {
        std::mem::forget(self);
    }
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why [`Pool::prepared_server`] has no server to give.
#[derive(Debug)]
pub enum ServerWait {
    /// The client cancelled while it waited.
    Cancelled,
    /// No server could be had (see [`crate::error::ClientError::checkout`]).
    Checkout(CheckoutError),
    /// A server was had, but failed while being made what the client expects; nothing of
    /// the client's reached it, and it is closed.
    Prepare(ServerError),
}

/// Counts a checkout in `PoolStats::waiting` for as long as it waits, dropped with it too
/// (a client's cancel, or a login timing out, drops a waiting checkout: counted by hand, it
/// stayed counted).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(waiting: &'a AtomicUsize) -> Self {
        waiting.fetch_add(1, Ordering::Relaxed);
        Waiting(waiting)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counters an operator needs, updated with relaxed atomics.
#[derive(Default, Debug)]
pub struct PoolStats {
    pub clients: AtomicUsize,
    pub waiting: AtomicUsize,
    pub servers: AtomicUsize,
    pub checkouts: AtomicU64,
    pub wait_micros: AtomicU64,
    /// How long the last client served after waiting had waited (all of
    /// `query_wait_timeout` when one gave up), in microseconds; zero once a client got a
    /// server at once. Clients are served first come, first served, so this is how long the
    /// queue makes a client wait now (see [`Pool::shed`]).
    pub queue_delay_us: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
}

pub struct Pool {
    me: Weak<Pool>,
    /// `database/user`, for messages and logs.
    pub name: String,
    /// The database name as routed (a config entry's, or the wildcard's client-given one)
    /// and the user name: how another process finds this pool's twin (client hand-over).
    pub route_key: (String, String),
    pub settings: PoolSettings,
    pub upstream: Upstream,
    permits: Permits,
    /// Idle servers per shard (one list unless the per-core data plane runs): a server goes
    /// back to the shard whose runtime polls its socket, and checkouts look there first.
    idle: Box<[Mutex<IdleList>]>,
    /// Live clients whose session state a full pool cleaned away, to be told at their next
    /// statement.
    lost_state: Mutex<std::collections::HashSet<u64>>,
    /// What a server reported after applying a given set of client startup parameters (the
    /// empty set: a fresh server), so later logins with the same set need no server at all.
    login_params: Mutex<HashMap<Params, SharedParams>>,
    /// Held by the login learning a new entry of `login_params` (see `session::login`).
    pub learning_login_params: tokio::sync::Mutex<()>,
    /// Named prepared statements of this pool's clients, by text (transaction mode).
    pub statements: crate::prepared::StatementRegistry,
    pub stats: PoolStats,
    /// The pool size now (`settings.size` is what it was made with; tenants resize live).
    size: AtomicUsize,
    /// Set when the pool was ended (tenant banned, deleted or terminated): why, for its
    /// clients' FATAL.
    ended: std::sync::OnceLock<String>,
    /// This pool's logged-in clients' sockets, so ending the pool can end them.
    pub client_fds: crate::net::ClientFds,
    /// This pool's server sockets, so fencing the pool (cluster) can end the transactions
    /// running on them.
    pub server_fds: crate::net::ClientFds,
    /// When the last client left (milliseconds on [`clock`]), for closing unused pools.
    pub unused_since: AtomicU64,
    /// The tenant this pool serves, if any (for metrics and the admin console).
    pub tenant: Option<String>,
    pub metrics: crate::metrics::PoolMetrics,
    /// Every open server connection, for the admin console.
    servers_info: Mutex<HashMap<u64, ServerInfo>>,
    /// `PAUSE`: checkouts wait until `RESUME`.
    paused: std::sync::atomic::AtomicBool,
    /// `RECONNECT`: servers opened before this (ms, the coarse clock) close when released.
    reconnect_before: AtomicU64,
    resumed: tokio::sync::Notify,
    /// Per-second averages over the last `stats_period` (`SHOW STATS`).
    pub averages: Mutex<Averages>,
    /// Whether this node may open servers for the pool (always, unless in a cluster).
    pub fence: Fence,
    /// What the features keep for this pool (see [`AddOns`]).
    addons: Arc<PoolAddOns>,
    /// When the last slow-query and pool-exhausted warnings were logged (rate limits).
    last_slow_warning: AtomicU64,
    last_exhausted_warning: AtomicU64,
    slow: slow::SlowLog,
}

/// An open server connection as the admin console shows it.
#[derive(Debug, Clone)]
pub struct ServerInfo {
    pub process_id: i32,
    pub addr: std::net::SocketAddr,
    /// [`clock::now_ms`] at connect.
    pub created: u64,
    pub tls: bool,
}

/// Removes a server from its pool's list when the connection is dropped, however it ends.
pub struct ServerTracker {
    pool: Weak<Pool>,
    id: u64,
    fd: Option<std::os::fd::RawFd>,
    /// The mark this server was enlisted with, and its process id (cluster).
    enlisted: Option<(Weak<pg_fence::Mark>, i32)>,
}

impl Drop for ServerTracker {
    fn drop(&mut self) {
        if let Some((mark, pid)) = self.enlisted.take() {
            if let Some(mark) = mark.upgrade() {
                crate::control::spawn(async move { mark.discharge(pid).await });
            }
        }
        if let Some(pool) = self.pool.upgrade() {
            if let Some(fd) = self.fd {
                pool.server_fds.remove(fd);
            }
            pool.servers_info
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&self.id);
        }
    }
}

/// What `SHOW STATS` reports as averages: per second (counts, bytes) or per transaction and
/// query (microseconds), over the last stats period.
#[derive(Debug, Default, Clone, Copy)]
pub struct Averages {
    pub xact_count: u64,
    pub query_count: u64,
    pub recv: u64,
    pub sent: u64,
    pub xact_time: u64,
    pub query_time: u64,
    pub wait_time: u64,
}

/// What a pool is called: see the fields of the same names on [`Pool`].
pub struct Names {
    pub name: String,
    pub route_key: (String, String),
    pub tenant: Option<String>,
}

impl Pool {
    pub fn new(
        names: Names,
        statements: crate::prepared::StatementRegistry,
        settings: PoolSettings,
        upstream: Upstream,
        lease: Arc<LeaseClock>,
        addons: Arc<PoolAddOns>,
        shards: usize,
    ) -> Arc<Pool> {
        let Names {
            name,
            route_key,
            tenant,
        } = names;
        let pool = Arc::new_cyclic(|me| Pool {
            me: me.clone(),
            name,
            route_key,
            permits: Permits::new(settings.size),
            size: AtomicUsize::new(settings.size),
            ended: std::sync::OnceLock::new(),
            client_fds: Default::default(),
            server_fds: Default::default(),
            unused_since: AtomicU64::new(clock::now_ms()),
            tenant,
            metrics: Default::default(),
            servers_info: Mutex::new(HashMap::new()),
            paused: std::sync::atomic::AtomicBool::new(false),
            reconnect_before: AtomicU64::new(0),
            resumed: tokio::sync::Notify::new(),
            averages: Mutex::new(Averages::default()),
            fence: Fence::new(lease),
            addons,
            last_slow_warning: AtomicU64::new(0),
            last_exhausted_warning: AtomicU64::new(0),
            slow: Default::default(),
            settings,
            upstream,
            lost_state: Mutex::default(),
            idle: (0..shards.max(1))
                .map(|_| Mutex::new(IdleList::default()))
                .collect(),
            login_params: Mutex::new(HashMap::new()),
            learning_login_params: tokio::sync::Mutex::new(()),
            statements,
            stats: PoolStats::default(),
        });
        // Upkeep runs on the control runtime, not on the shard whose login made the pool.
        crate::control::spawn(upkeep::reap(Arc::downgrade(&pool)));
        pool
    }

    /// The add-on the pool was made with.
    #[inline]
    pub fn addons(&self) -> &PoolAddOns {
        &self.addons
    }

    /// The database this pool serves, as the console and routing name it (a config entry's
    /// name, or `tenant:<id>`).
    pub fn database(&self) -> &str {
        &self.route_key.0
    }

    /// Shards this pool keeps idle servers for.
    pub fn shards(&self) -> usize {
        self.idle.len()
    }

    fn lock_shard(&self, shard: usize) -> std::sync::MutexGuard<'_, IdleList> {
        // A server opened off the shards (`NO_SHARD`) waits in shard 0's list.
        self.idle[if shard < self.idle.len() { shard } else { 0 }]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Every idle server of every shard, in one list (for upkeep, not the hot path).
    fn take_all_idle(&self) -> Vec<Box<ServerConn>> {
        (0..self.idle.len())
            .flat_map(|i| self.lock_shard(i).drain())
            .collect()
    }

    fn idle_ids(&self) -> Vec<u64> {
        (0..self.idle.len())
            .flat_map(|i| self.lock_shard(i).ids().collect::<Vec<_>>())
            .collect()
    }

    /// The ParameterStatus values to report to a client logging in with `params`, if known.
    pub fn login_params(&self, params: &[(String, String)]) -> Option<SharedParams> {
        let cache = self.login_params.lock().unwrap_or_else(|e| e.into_inner());
        cache.get(params).cloned()
    }

    /// Remembers what a server reported for `params`; returns the shared copy, which a login
    /// reports without copying it again.
    pub fn remember_login_params(
        &self,
        params: &[(String, String)],
        reported: &[(String, String)],
    ) -> SharedParams {
        let shared: SharedParams = reported.into();
        let mut cache = self.login_params.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= LOGIN_PARAMS_CACHE {
            cache.clear();
        }
        cache.insert(params.to_vec(), shared.clone());
        shared
    }

    /// Takes the pool over at PostgreSQL, ending whatever an earlier owner still has
    /// there (cluster; see [`pg_fence`]): done before this node serves the pool. Returns
    /// how many sessions of earlier owners were ended.
    pub async fn take_over(&self) -> Result<usize, pg_fence::FenceError> {
        let up = self.upstream.clone();
        let name = self.name.clone();
        let timeout = self.settings.connect_timeout.max(Duration::from_secs(5));
        let mark =
            crate::control::spawn(
                async move { pg_fence::Mark::take_over(&up, &name, timeout).await },
            )
            .await
            .map_err(|e| pg_fence::FenceError::Answer(e.to_string()))??;
        tracing::debug!(pool = %self.name, mark = mark.pid, "pool taken over at PostgreSQL");
        let ended = mark.ended;
        self.fence.set_mark(Arc::new(mark));
        Ok(ended)
    }

    /// This node stops serving the pool (cluster): no server is used or opened for it, idle
    /// ones close, the transactions on the others end, its mark goes.
    pub async fn stop_serving(&self) -> bool {
        let owned = self.fence.close();
        self.fence.drop_mark();
        if owned {
            self.server_fds.shut_reads();
            self.close_idle().await;
            self.addons.stop_serving().await;
        }
        owned
    }

    fn self_weak(&self) -> Weak<Pool> {
        self.me.clone()
    }

    /// A handle that does not keep the pool alive.
    pub fn weak(&self) -> Weak<Pool> {
        self.me.clone()
    }

    /// Open server connections: (id, info, idle now).
    pub fn server_list(&self) -> Vec<(u64, ServerInfo, bool)> {
        let idle: std::collections::HashSet<u64> = self.idle_ids().into_iter().collect();
        let mut v: Vec<(u64, ServerInfo, bool)> = self
            .servers_info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(id, i)| (*id, i.clone(), idle.contains(id)))
            .collect();
        v.sort_by_key(|(id, _, _)| *id);
        v
    }

    /// `PAUSE`: new checkouts wait (up to `query_wait_timeout`) until [`Pool::resume`].
    pub fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    pub fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
        self.resumed.notify_waiters();
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    async fn wait_resumed(&self) -> Result<(), CheckoutError> {
        let wait = async {
            loop {
                let notified = self.resumed.notified();
                if !self.paused.load(Ordering::SeqCst) {
                    return;
                }
                notified.await;
            }
        };
        let counted = Waiting::new(&self.stats.waiting);
        let r = crate::timer::timeout(self.settings.wait_timeout, wait).await;
        drop(counted);
        r.map_err(|_| CheckoutError::WaitTimeout {
            pool: self.name.clone(),
            waited: self.settings.wait_timeout,
            size: self.size(),
        })
    }

    /// True at most once per `every_ms` per `slot`: log lines that could flood are
    /// rate-limited.
    fn may_warn(slot: &AtomicU64, every_ms: u64) -> bool {
        let now = clock::now_ms().max(1);
        let last = slot.load(Ordering::Relaxed);
        (last == 0 || now.saturating_sub(last) >= every_ms)
            && slot
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// A query took `us`: logged when over `slow_query_threshold` (at most once a second
    /// per pool).
    pub fn note_query_time(&self, us: u64) {
        let limit = self.settings.slow_query;
        if limit.is_zero() || us < limit.as_micros() as u64 {
            return;
        }
        self.slow.note(SlowQuery {
            at: clock::epoch_ms(),
            duration_ms: us as f64 / 1000.0,
        });
        if Self::may_warn(&self.last_slow_warning, 1000) {
            tracing::warn!(pool = %self.name, duration_ms = us / 1000, threshold_ms = limit.as_millis() as u64, "slow query");
        }
    }

    /// The last slow queries, newest first.
    pub fn recent_slow_queries(&self) -> Vec<SlowQuery> {
        self.slow.recent()
    }

    /// Servers held by clients (or being opened for them) now.
    pub fn in_use(&self) -> usize {
        self.size().saturating_sub(self.permits.available())
    }

    /// Servers idle in the pool now.
    pub fn idle_count(&self) -> usize {
        (0..self.idle.len()).map(|i| self.lock_shard(i).len()).sum()
    }

    pub fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }
}
