//! Checkout and checkin: a permit first (FIFO, bounded by `query_wait_timeout`), then the
//! server the client left its own state on, this shard's most recently returned idle server,
//! another shard's, or a new connection; and back to the idle list of the shard whose
//! reactor holds it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::permits::Refused;
use super::{
    pg_fence, CheckoutError, Idle, Lease, Opening, Pool, ServerInfo, ServerTracker, ServerWait,
    WaitCancel, Waiting,
};
use crate::clock;
use crate::disposition::{decide, Disposition, ServerState};
use crate::server::ServerConn;

impl Pool {
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
        let permit = match self.permits.try_acquire() {
            Some(p) => {
                self.metrics.wait.observe_us(0);
                self.no_queue();
                p
            }
            None => {
                if let Some(e) = self.shed() {
                    return Err(e);
                }
                let started = clock::mono_us();
                let counted = Waiting::new(&self.stats.waiting);
                let waiting = counted.0.load(Ordering::Relaxed);
                if Self::may_warn(&self.last_exhausted_warning, 10_000) {
                    tracing::warn!(pool = %self.name, size = self.size(), waiting, "pool exhausted: clients are waiting for a server");
                }
                let timeout = self.settings.wait_timeout;
                // No timeout means no waiting (as a timer of zero would).
                let r = if timeout.is_zero() {
                    Err(Refused::TimedOut)
                } else {
                    let deadline = started.saturating_add(timeout.as_micros() as u64);
                    self.permits.acquire(deadline).await
                };
                drop(counted);
                let waited = clock::mono_us().saturating_sub(started);
                self.stats.queue_delay_us.store(waited, Ordering::Relaxed);
                match r {
                    Err(Refused::TimedOut) => {
                        return Err(CheckoutError::WaitTimeout {
                            pool: self.name.clone(),
                            waited: timeout,
                            size: self.size(),
                        })
                    }
                    Err(Refused::Closed) => return Err(CheckoutError::Closed(self.name.clone())),
                    Ok(p) => {
                        self.stats.wait_micros.fetch_add(waited, Ordering::Relaxed);
                        self.metrics.wait.observe_us(waited);
                        p
                    }
                }
            }
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        let opening = match self.pop_idle(client, true) {
            Idle::Server(conn) => return Ok(Lease::new(self, conn, permit)),
            Idle::Open(opening) => opening,
            // Not given to a reserving checkout; opened as one would be, should it come.
            Idle::Nothing => self.open_beyond_room(),
        };
        let conn = Box::pin(self.connect(opening)).await?;
        Ok(Lease::new(self, conn, permit))
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
                    // In order: no random draw per wait.
                    biased;
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
    pub(super) fn reserve_server(&self) -> bool {
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
        let permit = self.permits.try_acquire()?;
        let Idle::Server(conn) = self.pop_idle(client, false) else {
            return None;
        };
        self.stats.checkouts.fetch_add(1, Ordering::Relaxed);
        self.metrics.wait.observe_us(0);
        self.no_queue();
        Some(Lease::new(self, conn, permit))
    }

    /// Opens a server in the room `opening` took.
    pub(super) async fn connect(
        &self,
        opening: Opening<'_>,
    ) -> Result<Box<ServerConn>, CheckoutError> {
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

    /// Returns a healthy, idle (status `I`, nothing pending) server to the pool.
    pub fn checkin(&self, mut lease: Lease) {
        let Some(mut conn) = lease.take_conn() else {
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

    pub(super) fn past_lifetime(&self, conn: &ServerConn) -> bool {
        clock::now_ms().saturating_sub(conn.created) >= self.settings.lifetime.as_millis() as u64
            || conn.created < self.reconnect_before.load(Ordering::Relaxed)
    }
}
