//! Metrics: counters kept where the work happens, read only when scraped.
//!
//! The hot path never takes a lock or allocates for metrics: a session counts a
//! transaction's queries, bytes, errors and query durations in a [`TxnCounts`] on its own
//! stack and adds them to its pool's atomics once, when the transaction ends. A scrape walks
//! the pools and encodes what they hold in the Prometheus text format
//! (`prometheus-client`); nothing is registered per pool, so pools come and go freely.

use std::sync::atomic::{AtomicU64, Ordering};

pub use shoal_control::metrics::{AtomicHistogram, LabelValue, Labels, LocalHistogram, BUCKETS_US};

/// SQLSTATE classes counted apart; the rest is `other`.
pub const ERROR_CLASSES: [&str; 12] = [
    "08", "22", "23", "25", "28", "40", "42", "53", "54", "55", "57", "XX",
];
const NCLASSES: usize = ERROR_CLASSES.len() + 1;

fn class_of(code: &str) -> usize {
    let class = code.get(..2).unwrap_or("");
    ERROR_CLASSES
        .iter()
        .position(|c| *c == class)
        .unwrap_or(ERROR_CLASSES.len())
}

/// What a session counts while it holds a server, added to the pool at the end.
#[derive(Debug, Default)]
pub struct TxnCounts {
    pub queries: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub errors: [u32; NCLASSES],
    pub query_us: LocalHistogram,
    /// The slowest query of the transaction (for the slow-query log).
    pub slowest_us: u64,
}

impl TxnCounts {
    pub fn error(&mut self, code: &str) {
        self.errors[class_of(code)] += 1;
    }
}

/// A pool's counters beyond [`crate::pool::PoolStats`].
#[derive(Debug, Default)]
pub struct PoolMetrics {
    pub queries: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub errors: [AtomicU64; NCLASSES],
    pub wait: AtomicHistogram,
    pub transaction: AtomicHistogram,
    pub query: AtomicHistogram,
    pub connecting: AtomicU64,
}

impl PoolMetrics {
    /// Adds a finished transaction (held for `held_us`).
    pub fn add(&self, t: &TxnCounts, held_us: u64) {
        if t.queries > 0 {
            self.queries.fetch_add(t.queries, Ordering::Relaxed);
        }
        self.bytes_in.fetch_add(t.bytes_in, Ordering::Relaxed);
        self.bytes_out.fetch_add(t.bytes_out, Ordering::Relaxed);
        for (i, &n) in t.errors.iter().enumerate() {
            if n > 0 {
                self.errors[i].fetch_add(u64::from(n), Ordering::Relaxed);
            }
        }
        self.query.merge(&t.query_us);
        self.transaction.observe_us(held_us);
    }
}

/// Why logins are refused (`shoal_connections_rejected_total{reason}`): every
/// [`crate::error::ErrorKind`] (the one taxonomy of failures; its label is the `reason`).
pub const REJECT_REASONS: [crate::error::ErrorKind; 19] = crate::error::ErrorKind::ALL;

/// Process-wide counters.
#[derive(Debug, Default)]
pub struct ProcessMetrics {
    pub accepted: AtomicU64,
    rejected: [AtomicU64; REJECT_REASONS.len()],
    pub tls_handshakes: AtomicU64,
    pub tls_handshake_failures: AtomicU64,
    pub auth_failures: AtomicU64,
    pub serverless: ServerlessMetrics,
}

/// HTTP statuses the serverless front door counts per outcome
/// (`shoal_serverless_http_requests`); any other is counted as "other".
pub const HTTP_STATUSES: [u16; 11] = [200, 400, 401, 403, 404, 413, 429, 500, 503, 504, 507];

/// The serverless front door's traffic, per transport.
/// Counters of one tenant's Postgres Changes capture, for `/metrics`.
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Row changes read from the WAL.
    pub changes: AtomicU64,
    /// `postgres_changes` messages queued to subscribers.
    pub delivered: AtomicU64,
    /// Authorization queries run.
    pub authorizations: AtomicU64,
    /// Subscriptions currently served.
    pub subscriptions: AtomicU64,
}

/// What lists the captures' counters per tenant (Realtime's change feed), so that what
/// holds it need not name it.
pub trait FeedCounters: Send + Sync {
    fn per_tenant(&self) -> Vec<(String, std::sync::Arc<FeedStats>)>;
}

#[derive(Debug, Default)]
pub struct ServerlessMetrics {
    pub websockets: AtomicU64,
    /// HTTP queries answered, by status ([`HTTP_STATUSES`]; others last).
    http: [AtomicU64; HTTP_STATUSES.len() + 1],
}

impl ServerlessMetrics {
    pub fn websocket(&self) {
        self.websockets.fetch_add(1, Ordering::Relaxed);
    }

    pub fn http(&self, status: u16) {
        let statuses = HTTP_STATUSES;
        let i = statuses
            .iter()
            .position(|s| *s == status)
            .unwrap_or(statuses.len());
        self.http[i].fetch_add(1, Ordering::Relaxed);
    }

    /// (status label, count) for every status, "other" last.
    pub fn http_counts(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        let labels = HTTP_STATUSES.map(|s| s.to_string());
        labels
            .into_iter()
            .chain(std::iter::once("other".to_owned()))
            .zip(self.http.iter().map(|c| c.load(Ordering::Relaxed)))
    }
}

impl ProcessMetrics {
    /// Counts a login refused with `code` (and an auth failure for 28P01).
    pub fn rejected(&self, kind: crate::error::ErrorKind) {
        if kind == crate::error::ErrorKind::Auth {
            self.auth_failures.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(i) = REJECT_REASONS.iter().position(|r| *r == kind) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn rejected_count(&self, reason: crate::error::ErrorKind) -> u64 {
        REJECT_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.rejected[i].load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_classes() {
        let mut t = TxnCounts::default();
        t.error("23505");
        t.error("ZZ000");
        assert_eq!(t.errors[2], 1);
        assert_eq!(t.errors[ERROR_CLASSES.len()], 1);
    }
}
