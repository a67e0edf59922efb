//! A pool's upkeep: the reaper that closes servers idle too long or past their lifetime and
//! keeps `min_pool_size` warm, the periodic stats line, and the console's commands that
//! replace, resize or end a pool's servers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Averages, Opening, Pool};
use crate::clock;
use crate::server::ServerConn;

impl Pool {
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
            let Some(permit) = self.permits.try_acquire() else {
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

    /// Changes the pool size without disturbing clients: growing adds permits at once;
    /// shrinking takes permits back as running transactions end, and closes idle servers
    /// beyond the new size.
    pub async fn resize(self: &Arc<Self>, new: usize) {
        let old = self.size.swap(new, Ordering::Relaxed);
        if new > old {
            self.permits.add(new - old);
        } else if new < old {
            self.permits.shrink(old - new);
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

/// The reaper: one task per pool; it ends with the pool. Every tick it ends the waits past
/// `query_wait_timeout` (see `Permits::expire`); every second it closes servers idle too long
/// or past their lifetime and keeps `min_pool_size` warm, waits still ending meanwhile (a
/// connect can take seconds); every `stats_period` seconds it logs the pool's counters.
pub(super) async fn reap(pool: Weak<Pool>) {
    let Some(period) = pool
        .upgrade()
        .map(|p| sweep_period(p.settings.wait_timeout))
    else {
        return;
    };
    let per_second = (Duration::from_secs(1).as_micros() / period.as_micros()).max(1) as u64;
    let mut tick = crate::timer::interval(period);
    let (mut ticks, mut seconds) = (0u64, 0u64);
    let mut last = StatsSnapshot::default();
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        pool.permits.expire(clock::mono_us());
        ticks += 1;
        if (ticks - 1) % per_second != 0 {
            continue;
        }
        let sweeping = async {
            loop {
                tick.tick().await;
                pool.permits.expire(clock::mono_us());
            }
        };
        tokio::select! {
            biased;
            _ = pool.maintain() => {}
            _ = sweeping => {}
        }
        seconds += 1;
        let period = pool.settings.stats_period.max(1);
        if seconds.is_multiple_of(period) {
            last = pool.log_stats(last, period);
        }
    }
}

/// How often waits are checked against `query_wait_timeout`: a quarter of it, so a wait ends
/// at most a quarter late, within 10 ms and one second.
fn sweep_period(wait_timeout: Duration) -> Duration {
    if wait_timeout.is_zero() {
        // Nobody waits (see `Pool::checkout_for`).
        return Duration::from_secs(1);
    }
    (wait_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
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
