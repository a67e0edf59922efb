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
mod failures;
mod fence;
mod idle;
mod lease;
pub mod pg_fence;
mod slow;

pub use addons::{AddOns, Plug, PoolAddOns};
pub use fence::{Fence, LeaseClock};
use idle::IdleList;
pub use lease::{Lease, Leaving};
pub use slow::SlowQuery;

use crate::disposition::{decide, Disposition, ServerState};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;

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
    type Cancelled: std::future::Future;
    fn begin(&self) -> Self::Cancelled;
    fn end(&self);
}

/// A wait nothing can cancel (a login's: the client has no cancel key yet).
pub struct NoCancel;

impl WaitCancel for NoCancel {
    type Cancelled = std::future::Pending<()>;
    fn begin(&self) -> Self::Cancelled {
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
    permits: Arc<Semaphore>,
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
            permits: Arc::new(Semaphore::new(settings.size)),
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
            idle: (0..crate::shard::count())
                .map(|_| Mutex::new(IdleList::default()))
                .collect(),
            login_params: Mutex::new(HashMap::new()),
            learning_login_params: tokio::sync::Mutex::new(()),
            statements,
            stats: PoolStats::default(),
        });
        // Upkeep runs on the control runtime, not on the shard whose login made the pool.
        crate::control::spawn(reap(Arc::downgrade(&pool)));
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

    /// Waits (FIFO, bounded by `query_wait_timeout`) for a server connection, for a client
    /// not yet identified (see [`Pool::checkout_for`]).
    pub async fn checkout(self: &Arc<Self>) -> Result<Lease, CheckoutError> {
        self.checkout_for(0).await
    }

    /// Waits (FIFO, bounded by `query_wait_timeout`) for a server connection for `client`
    /// (its connection id): the server it left its own state on, if that is idle.
    pub async fn checkout_for(self: &Arc<Self>, client: u64) -> Result<Lease, CheckoutError> {
        // The rare paths (a paused pool, a new connection) are boxed: this future is part of
        // every transaction's, which is allocated and moved once per burst of activity.
        if self.paused.load(Ordering::Relaxed) {
            Box::pin(self.wait_resumed()).await?;
        }
        if !self.fence.may_open() {
            return Err(CheckoutError::Fenced(self.name.clone()));
        }
        let permit = match self.permits.clone().try_acquire_owned() {
            Ok(p) => {
                self.metrics.wait.observe_us(0);
                self.no_queue();
                p
            }
            Err(_) => {
                if let Some(e) = self.shed() {
                    return Err(e);
                }
                let started = Instant::now();
                let counted = Waiting::new(&self.stats.waiting);
                let waiting = counted.0.load(Ordering::Relaxed);
                if Self::may_warn(&self.last_exhausted_warning, 10_000) {
                    tracing::warn!(pool = %self.name, size = self.size(), waiting, "pool exhausted: clients are waiting for a server");
                }
                let r = crate::timer::timeout(
                    self.settings.wait_timeout,
                    self.permits.clone().acquire_owned(),
                )
                .await;
                drop(counted);
                let waited = started.elapsed().as_micros() as u64;
                self.stats.queue_delay_us.store(waited, Ordering::Relaxed);
                match r {
                    Err(_) => {
                        return Err(CheckoutError::WaitTimeout {
                            pool: self.name.clone(),
                            waited: self.settings.wait_timeout,
                            size: self.size(),
                        })
                    }
                    Ok(Err(_)) => return Err(CheckoutError::Closed(self.name.clone())),
                    Ok(Ok(p)) => {
                        self.stats.wait_micros.fetch_add(waited, Ordering::Relaxed);
                        self.metrics.wait.observe_us(waited);
                        p
                    }
                }
            }
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        let opening = match self.pop_idle(client, true) {
            Idle::Server(conn) => {
                return Ok(Lease {
                    conn: Some(conn),
                    _permit: permit,
                    pool: self.clone(),
                })
            }
            Idle::Open(opening) => opening,
            // Not given to a reserving checkout; opened as one would be, should it come.
            Idle::Nothing => self.open_beyond_room(),
        };
        let conn = Box::pin(self.connect(opening)).await?;
        Ok(Lease {
            conn: Some(conn),
            _permit: permit,
            pool: self.clone(),
        })
    }

    /// A server ready for a client: checked out (at once when one is idle, else waiting
    /// first come, first served, until the client's cancel ends the wait), then made what
    /// the client expects: nothing of another client, its startup `params`, its held
    /// `sets`. The one way logins, transactions and other front doors get a server. The
    /// wait is over before the server is prepared: a cancel from then on is the caller's
    /// to route (to the server, once it is named).
    pub async fn prepared_server<W: WaitCancel>(
        self: &Arc<Self>,
        client: u64,
        params: &[(String, String)],
        sets: Option<&crate::sets::SessionSets>,
        cancel: &W,
    ) -> Result<Lease, ServerWait> {
        let mut lease = match self.try_checkout(client) {
            Some(l) => l,
            None => {
                let cancelled = cancel.begin();
                let r = tokio::select! {
                    r = self.checkout_for(client) => r.map_err(ServerWait::Checkout),
                    _ = cancelled => Err(ServerWait::Cancelled),
                };
                cancel.end();
                r?
            }
        };
        let prepared = lease
            .prepare_for(client, params, sets, &self.settings)
            .await;
        let evicted = lease.session.take_evicted();
        if evicted != 0 {
            // The last resort of a full pool (see `pop_idle`): that client is told.
            tracing::warn!(pool = %self.name, client = evicted, "a live client's session state was cleaned away: the pool had no other server");
            self.lost_state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(evicted);
        }
        match prepared {
            Ok(()) => Ok(lease),
            Err(e) => Err(ServerWait::Prepare(e)),
        }
    }

    /// A client that leaves: the state it left on idle servers is nobody's, and those
    /// servers are taken before any live client's.
    pub fn owner_left(&self, client: u64) {
        for i in 0..self.idle.len() {
            self.lock_shard(i).owner_left(client);
        }
        self.lost_state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&client);
    }

    /// Whether `client`'s session state was cleaned away from its server since it last
    /// asked (once).
    pub fn state_lost(&self, client: u64) -> bool {
        self.lost_state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&client)
    }

    /// Refuses a client at once rather than queue it (load shedding): when the last client
    /// served after waiting had waited past half of `query_wait_timeout`, the queue is not
    /// draining, and one more client in it would most likely wait out its timeout, holding
    /// its session (at a cluster's owner, a relayed stream) all the while. Refused now, it
    /// can go elsewhere or try later, and the clients already queued are served sooner. It
    /// stops as soon as a client is served after a shorter wait, or at once.
    fn shed(&self) -> Option<CheckoutError> {
        let timeout = self.settings.wait_timeout;
        let delay = self.stats.queue_delay_us.load(Ordering::Relaxed);
        if timeout.is_zero() || delay <= timeout.as_micros() as u64 / 2 {
            return None;
        }
        Some(CheckoutError::Saturated {
            pool: self.name.clone(),
            waiting: self.stats.waiting.load(Ordering::Relaxed),
            waited: Duration::from_micros(delay),
            timeout,
        })
    }

    /// A client got a server without waiting: there is no queue.
    #[inline]
    fn no_queue(&self) {
        if self.stats.queue_delay_us.load(Ordering::Relaxed) != 0 {
            self.stats.queue_delay_us.store(0, Ordering::Relaxed);
        }
    }

    /// The best idle server for `client` (see [`IdleList::take`]) of this thread's shard,
    /// else of another.
    #[inline]
    fn pop_any(&self, client: u64, take_others: bool) -> Option<Box<ServerConn>> {
        let here = crate::shard::current();
        if let Some(c) = self.lock_shard(here).take(client, take_others) {
            return Some(c);
        }
        (0..self.idle.len())
            .filter(|&i| i != here)
            .find_map(|i| self.lock_shard(i).take(client, take_others))
    }

    /// A healthy idle server for `client`, or room to open one. Another client's state is
    /// cleaned away only when no other server can be had within `pool_size`: a server is
    /// opened instead while the pool has room. With `reserve`, the room is taken (counted in
    /// `stats.servers`, so `pool_size` holds however many checkouts race); without, only
    /// looked at, and `Nothing` says a server is to be waited for or opened by a checkout
    /// that reserves.
    fn pop_idle(&self, client: u64, reserve: bool) -> Idle<'_> {
        loop {
            let mut conn = match self.pop_any(client, false) {
                Some(c) => c,
                None if !reserve && self.has_room() => return Idle::Nothing,
                None if reserve && self.reserve_server() => {
                    return Idle::Open(Opening(&self.stats.servers))
                }
                None => match self.pop_any(client, true) {
                    Some(c) => c,
                    None if reserve => {
                        // No room and nothing idle while this checkout holds a permit: the
                        // pool is shrinking (`resize`); its permits bound it meanwhile.
                        return Idle::Open(self.open_beyond_room());
                    }
                    None => return Idle::Nothing,
                },
            };
            if conn.is_stale() || self.past_lifetime(&conn) {
                tracing::debug!(pool = %self.name, server = conn.id, "discarding stale server connection");
                self.stats.servers.fetch_sub(1, Ordering::Relaxed);
                tokio::spawn(conn.close());
                continue;
            }
            let id = conn.id;
            match conn.follow_to_this_shard() {
                Ok(conn) => return Idle::Server(conn),
                Err(e) => {
                    tracing::warn!(pool = %self.name, server = id, error = %e, "cannot move a server to this shard; closing it");
                    self.stats.servers.fetch_sub(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Room for a server counted whether or not there is room (the permits bound the pool).
    fn open_beyond_room(&self) -> Opening<'_> {
        self.stats.servers.fetch_add(1, Ordering::Relaxed);
        Opening(&self.stats.servers)
    }

    /// Whether another server may be opened within `pool_size`.
    fn has_room(&self) -> bool {
        self.stats.servers.load(Ordering::Relaxed) < self.size()
    }

    /// Takes room for one more server within `pool_size`, if there is room.
    // `fetch_update` is renamed `try_update` in newer Rust; Shoal still builds with 1.87.
    #[allow(deprecated)]
    fn reserve_server(&self) -> bool {
        self.stats
            .servers
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.size()).then_some(n + 1)
            })
            .is_ok()
    }

    /// A server without waiting or connecting, when one is free and idle: the common case,
    /// which needs no cancellation handling.
    pub fn try_checkout(self: &Arc<Self>, client: u64) -> Option<Lease> {
        if self.paused.load(Ordering::Relaxed) || !self.fence.may_open() {
            return None;
        }
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        let Idle::Server(conn) = self.pop_idle(client, false) else {
            return None;
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        self.metrics.wait.observe_us(0);
        self.no_queue();
        Some(Lease {
            conn: Some(conn),
            _permit: permit,
            pool: self.clone(),
        })
    }

    /// Opens a server in the room `opening` took.
    async fn connect(&self, opening: Opening<'_>) -> Result<Box<ServerConn>, CheckoutError> {
        if !self.fence.may_open() {
            return Err(CheckoutError::Fenced(self.name.clone()));
        }
        let Ok(mark) = self.fence.mark() else {
            return Err(CheckoutError::Fenced(self.name.clone()));
        };
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        self.metrics.connecting.fetch_add(1, Ordering::Relaxed);
        // A capped statement_timeout is the server's own default: PostgreSQL ends a
        // statement past it with its usual error (Shoal's cancel is the backstop).
        let cap = self
            .settings
            .statement_timeout
            .map(|d| format!("-c statement_timeout={}", d.as_millis().max(1)));
        let extra: &[(&str, &str)] = match &cap {
            Some(o) => &[("options", o.as_str())],
            None => &[],
        };
        let r =
            ServerConn::connect_with(&self.upstream, self.settings.connect_timeout, extra).await;
        self.metrics.connecting.fetch_sub(1, Ordering::Relaxed);
        match r {
            Ok(mut conn) => {
                let enlisted = match mark {
                    Some(mark) => Some(self.enlist(&conn, mark).await?),
                    None => None,
                };
                self.servers_info
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(
                        conn.id,
                        ServerInfo {
                            process_id: conn.process_id,
                            addr: conn.addr,
                            created: conn.created,
                            tls: conn.stream.is_tls(),
                        },
                    );
                let fd = conn.stream.raw_fd();
                if let Some(fd) = fd {
                    self.server_fds.insert(fd);
                }
                conn.tracker = Some(Box::new(ServerTracker {
                    pool: self.self_weak(),
                    id: conn.id,
                    fd,
                    enlisted,
                }));
                opening.opened();
                if self.login_params(&[]).is_none() {
                    self.remember_login_params(&[], &conn.params);
                }
                tracing::debug!(pool = %self.name, server = conn.id, pid = conn.process_id, "server connected");
                Ok(Box::new(conn))
            }
            Err(source) => {
                drop(opening);
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                Err(CheckoutError::Server {
                    pool: self.name.clone(),
                    source,
                })
            }
        }
    }

    /// Records a new server with this node's mark at PostgreSQL before it serves (see
    /// [`pg_fence`]). When PostgreSQL refuses, another node is taking the pool over (or
    /// the mark is gone): this node stops serving the pool at once.
    async fn enlist(
        &self,
        conn: &ServerConn,
        mark: Arc<pg_fence::Mark>,
    ) -> Result<(Weak<pg_fence::Mark>, i32), CheckoutError> {
        let pid = conn.process_id;
        let m = mark.clone();
        let r = match crate::control::spawn(async move { m.enlist(pid).await }).await {
            Ok(r) => r,
            Err(e) => Err(pg_fence::FenceError::Answer(e.to_string())),
        };
        match r {
            Ok(()) => Ok((Arc::downgrade(&mark), pid)),
            Err(e) => {
                tracing::error!(pool = %self.name, error = %e, "PostgreSQL refuses this node's servers for the pool (another node takes it over, or this node's fence session ended): no longer serving it");
                self.stop_serving().await;
                Err(CheckoutError::Fenced(self.name.clone()))
            }
        }
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

    /// Returns a healthy, idle (status `I`, nothing pending) server to the pool.
    pub fn checkin(&self, mut lease: Lease) {
        let Some(mut conn) = lease.conn.take() else {
            return;
        };
        conn.last_used = clock::now_ms();
        conn.session.checked_in();
        let state = ServerState {
            expired: self.past_lifetime(&conn),
            pool_ended: self.ended().is_some(),
            ..ServerState::default()
        };
        if let Disposition::Close(reason) = decide(&state) {
            tracing::debug!(pool = %self.name, server = conn.id, reason = reason.label(), "closing a server");
            self.stats.servers.fetch_sub(1, Ordering::Relaxed);
            tokio::spawn(conn.close());
        } else {
            let shard = conn.shard;
            self.lock_shard(shard).push(conn);
        }
        // The permit is released when `lease` drops, after the connection is idle again, so
        // the next waiter finds it.
        drop(lease);
    }

    fn past_lifetime(&self, conn: &ServerConn) -> bool {
        clock::now_ms().saturating_sub(conn.created) >= self.settings.lifetime.as_millis() as u64
            || conn.created < self.reconnect_before.load(Ordering::Relaxed)
    }

    /// `RECONNECT`: every server open now is replaced: the idle ones are closed at once, the
    /// busy ones when their client releases them (as past their lifetime).
    pub async fn reconnect(&self) {
        self.reconnect_before
            .store(clock::now_ms() + 1, Ordering::Relaxed);
        self.close_idle().await;
    }

    /// Closes idle servers past their idle timeout or lifetime (keeping `min_pool_size`) and
    /// opens servers up to `min_pool_size`.
    async fn maintain(self: &Arc<Self>) {
        let now = clock::now_ms();
        let lifetime = self.settings.lifetime.as_millis() as u64;
        let idle_timeout = self.settings.idle_timeout.as_millis() as u64;
        let total = self.stats.servers.load(Ordering::Relaxed);
        let mut removable = total.saturating_sub(self.settings.min_size);
        let mut expired: Vec<Box<ServerConn>> = Vec::new();
        for shard in 0..self.idle.len() {
            // Oldest-returned first: those are the ones the LIFO checkout leaves unused.
            expired.extend(self.lock_shard(shard).sweep(|c| {
                let too_old = now.saturating_sub(c.created) >= lifetime
                    || c.created < self.reconnect_before.load(Ordering::Relaxed);
                let too_idle = removable > 0 && now.saturating_sub(c.last_used) >= idle_timeout;
                let gone = too_old || too_idle || c.is_stale();
                if gone {
                    removable = removable.saturating_sub(1);
                }
                gone
            }));
        }
        for c in expired {
            self.stats.servers.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!(pool = %self.name, server = c.id, "closing idle server connection");
            c.close().await;
        }
        // A pool another node owns (cluster) keeps no servers here.
        while self.fence.may_open()
            && self.stats.servers.load(Ordering::Relaxed) < self.settings.min_size
        {
            let Ok(permit) = self.permits.clone().try_acquire_owned() else {
                break;
            };
            if !self.reserve_server() {
                break;
            }
            match self.connect(Opening(&self.stats.servers)).await {
                Ok(conn) => {
                    let shard = conn.shard;
                    self.lock_shard(shard).push(conn)
                }
                Err(e) => {
                    tracing::warn!(pool = %self.name, error = %crate::logsafe::Escaped(&e), "cannot open min_pool_size connection");
                    break;
                }
            }
            drop(permit);
        }
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
        self.size().saturating_sub(self.permits.available_permits())
    }

    /// Servers idle in the pool now.
    pub fn idle_count(&self) -> usize {
        (0..self.idle.len()).map(|i| self.lock_shard(i).len()).sum()
    }

    pub fn size(&self) -> usize {
        self.size.load(Ordering::Relaxed)
    }

    /// Changes the pool size without disturbing clients: growing adds permits at once;
    /// shrinking takes permits back as running transactions end, and closes idle servers
    /// beyond the new size.
    pub async fn resize(self: &Arc<Self>, new: usize) {
        let old = self.size.swap(new, Ordering::Relaxed);
        if new > old {
            self.permits.add_permits(new - old);
        } else if new < old {
            let permits = self.permits.clone();
            let delta = (old - new) as u32;
            tokio::spawn(async move {
                if let Ok(p) = permits.acquire_many_owned(delta).await {
                    p.forget();
                }
            });
            let surplus = self
                .stats
                .servers
                .load(Ordering::Relaxed)
                .saturating_sub(new);
            let mut closing: Vec<Box<ServerConn>> = Vec::new();
            for shard in 0..self.idle.len() {
                let n = surplus - closing.len();
                closing.extend(self.lock_shard(shard).drain_oldest(n));
            }
            for c in closing {
                self.stats.servers.fetch_sub(1, Ordering::Relaxed);
                c.close().await;
            }
        }
        tracing::info!(pool = %self.name, from = old, to = new, "pool resized");
    }

    /// Ends the pool: no more checkouts, its clients are told `reason` and disconnected, its
    /// idle servers closed (busy ones close when their client goes).
    pub async fn end(&self, reason: String) -> usize {
        let _ = self.ended.set(reason);
        self.permits.close();
        let n = self.client_fds.shut_reads();
        self.close_idle().await;
        n
    }

    /// Why the pool was ended, if it was.
    pub fn ended(&self) -> Option<&str> {
        self.ended.get().map(String::as_str)
    }

    /// Closes every idle server (shutdown).
    pub async fn close_idle(&self) {
        let idle: Vec<Box<ServerConn>> = self.take_all_idle();
        for c in idle {
            self.stats.servers.fetch_sub(1, Ordering::Relaxed);
            c.close().await;
        }
    }
}

/// The reaper: one task per pool on a coarse one-second tick; it ends with the pool. Every
/// `stats_period` seconds it also logs the pool's counters.
async fn reap(pool: Weak<Pool>) {
    let mut tick = crate::timer::interval(Duration::from_secs(1));
    let mut seconds = 0u64;
    let mut last = StatsSnapshot::default();
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        pool.maintain().await;
        seconds += 1;
        let period = pool.settings.stats_period.max(1);
        if seconds.is_multiple_of(period) {
            last = pool.log_stats(last, period);
        }
    }
}

/// Cumulative counters at the last stats log line.
#[derive(Default, Clone, Copy)]
struct StatsSnapshot {
    checkouts: u64,
    wait_micros: u64,
    connects: u64,
    connect_failures: u64,
    queries: u64,
    recv: u64,
    sent: u64,
    xact_us: u64,
    query_us: u64,
}

impl Pool {
    /// One structured log line with the pool's state and what happened since the last one.
    fn log_stats(&self, last: StatsSnapshot, period: u64) -> StatsSnapshot {
        let s = &self.stats;
        let m = &self.metrics;
        let now = StatsSnapshot {
            checkouts: s.checkouts.load(Ordering::Relaxed),
            wait_micros: s.wait_micros.load(Ordering::Relaxed),
            connects: s.connects.load(Ordering::Relaxed),
            connect_failures: s.connect_failures.load(Ordering::Relaxed),
            queries: m.queries.load(Ordering::Relaxed),
            recv: m.bytes_in.load(Ordering::Relaxed),
            sent: m.bytes_out.load(Ordering::Relaxed),
            xact_us: m.transaction.sum_us(),
            query_us: m.query.sum_us(),
        };
        let checkouts = now.checkouts - last.checkouts;
        let queries = now.queries - last.queries;
        *self.averages.lock().unwrap_or_else(|e| e.into_inner()) = Averages {
            xact_count: checkouts / period,
            query_count: queries / period,
            recv: (now.recv - last.recv) / period,
            sent: (now.sent - last.sent) / period,
            xact_time: (now.xact_us - last.xact_us) / checkouts.max(1),
            query_time: (now.query_us - last.query_us) / queries.max(1),
            wait_time: (now.wait_micros - last.wait_micros) / checkouts.max(1),
        };
        if self.settings.stats_period == 0 {
            return now;
        }
        if checkouts > 0 || now.connects != last.connects {
            tracing::info!(
                pool = %self.name,
                clients = s.clients.load(Ordering::Relaxed),
                waiting = s.waiting.load(Ordering::Relaxed),
                servers = s.servers.load(Ordering::Relaxed),
                idle = self.idle_count(),
                transactions_per_s = checkouts / period,
                avg_wait_us = (now.wait_micros - last.wait_micros) / checkouts.max(1),
                connects = now.connects - last.connects,
                connect_failures = now.connect_failures - last.connect_failures,
                "pool stats"
            );
        }
        now
    }
}
