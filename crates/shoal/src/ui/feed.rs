//! The dashboard's feed: every second, what the pooler is doing (clients, servers,
//! transactions, queries and errors a second, wait and query latency), kept for the last
//! fifteen minutes, served as compact JSON, so the page never scrapes `/metrics`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use serde::Serialize;

/// Seconds of history kept.
pub const KEEP: usize = 15 * 60;

/// One second of the pooler, summed over its pools.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Sample {
    /// Milliseconds since the epoch.
    pub at: u64,
    #[serde(flatten)]
    pub gauges: Gauges,
    /// Per second over the interval since the last sample.
    pub transactions: f64,
    pub queries: f64,
    pub errors: f64,
    /// Errors a second by SQLSTATE class (`other` for the rest), the classes seen only.
    pub errors_by_class: BTreeMap<&'static str, f64>,
    /// Milliseconds, over the interval (`None`: nothing happened).
    pub wait_p50: Option<f64>,
    pub wait_p99: Option<f64>,
    pub query_p50: Option<f64>,
    pub query_p99: Option<f64>,
}

/// Running totals a sample is the difference of.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    pub at: u64,
    pub transactions: u64,
    pub queries: u64,
    pub errors: u64,
    /// By SQLSTATE class, as [`crate::metrics::ERROR_CLASSES`] and `other` last.
    pub error_classes: Vec<u64>,
    /// Per-bucket counts with upper bounds in seconds (as the metrics' histograms).
    pub wait: Vec<(f64, u64)>,
    pub query: Vec<(f64, u64)>,
}

/// The gauges of a moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Gauges {
    pub pools: usize,
    pub clients_active: usize,
    pub clients_idle: usize,
    pub clients_waiting: usize,
    pub servers_active: usize,
    pub servers_idle: usize,
}

/// The `q` quantile (in milliseconds) of what fell into `now`'s buckets since `before`:
/// the upper bound of the bucket it lands in.
pub fn quantile(before: &[(f64, u64)], now: &[(f64, u64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, u64)> = now
        .iter()
        .enumerate()
        .map(|(i, (le, n))| (*le, n.saturating_sub(before.get(i).map_or(0, |b| b.1))))
        .collect();
    let total: u64 = delta.iter().map(|d| d.1).sum();
    if total == 0 {
        return None;
    }
    let want = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (le, n) in delta {
        seen += n;
        if seen >= want {
            return Some(if le == f64::MAX {
                f64::INFINITY
            } else {
                le * 1000.0
            });
        }
    }
    None
}

/// The sample between `before` and `now`.
pub fn sample(before: &Totals, now: &Totals, g: Gauges) -> Sample {
    let secs = (now.at.saturating_sub(before.at) as f64 / 1000.0).max(0.001);
    let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / secs;
    let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
    Sample {
        at: now.at,
        gauges: g,
        transactions: rate(before.transactions, now.transactions),
        queries: rate(before.queries, now.queries),
        errors: rate(before.errors, now.errors),
        errors_by_class: now
            .error_classes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let d = n.saturating_sub(before.error_classes.get(i).copied().unwrap_or(0));
                let class = crate::metrics::ERROR_CLASSES
                    .get(i)
                    .copied()
                    .unwrap_or("other");
                (d > 0).then(|| (class, d as f64 / secs))
            })
            .collect(),
        wait_p50: finite(quantile(&before.wait, &now.wait, 0.5)),
        wait_p99: finite(quantile(&before.wait, &now.wait, 0.99)),
        query_p50: finite(quantile(&before.query, &now.query, 0.5)),
        query_p99: finite(quantile(&before.query, &now.query, 0.99)),
    }
}

/// The last [`KEEP`] samples.
#[derive(Default)]
pub struct History {
    inner: Mutex<(VecDeque<Sample>, Option<Totals>)>,
}

impl History {
    /// Takes the measure of `now` (with its gauges); the first call only sets the start.
    pub fn record(&self, now: Totals, g: Gauges) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(before) = &inner.1 {
            let s = sample(before, &now, g);
            if inner.0.len() == KEEP {
                inner.0.pop_front();
            }
            inner.0.push_back(s);
        }
        inner.1 = Some(now);
    }

    /// The samples since `since` (milliseconds since the epoch; 0 for all).
    pub fn since(&self, since: u64) -> Vec<Sample> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.0.iter().filter(|s| s.at > since).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_interval_s_buckets() {
        let before = [(0.001, 10), (0.01, 0), (f64::MAX, 0)];
        let now = [(0.001, 10), (0.01, 99), (f64::MAX, 1)];
        assert_eq!(quantile(&before, &now, 0.5), Some(10.0));
        assert_eq!(quantile(&before, &now, 0.99), Some(10.0));
        assert_eq!(quantile(&before, &now, 1.0), Some(f64::INFINITY));
        assert_eq!(quantile(&now, &now, 0.5), None, "nothing happened");
    }

    #[test]
    fn samples_are_rates_over_their_interval_and_history_is_bounded() {
        let t = |at: u64, tx: u64| Totals {
            at,
            transactions: tx,
            queries: tx * 2,
            ..Totals::default()
        };
        let mut later = t(3000, 300);
        later.error_classes = vec![0, 4, 0];
        let mut earlier = t(1000, 100);
        earlier.error_classes = vec![0, 2, 0];
        let s = sample(&earlier, &later, Gauges::default());
        assert_eq!(s.transactions, 100.0);
        assert_eq!(
            s.errors_by_class.into_iter().collect::<Vec<_>>(),
            [("22", 1.0)],
            "only classes seen, per second"
        );
        assert_eq!(s.queries, 200.0);
        assert_eq!(s.wait_p50, None);
        let h = History::default();
        h.record(t(0, 0), Gauges::default());
        assert!(h.since(0).is_empty(), "the first measure only starts");
        for i in 1..=(KEEP as u64 + 10) {
            h.record(t(i * 1000, i), Gauges::default());
        }
        let all = h.since(0);
        assert_eq!(all.len(), KEEP);
        assert_eq!(all.last().unwrap().at, (KEEP as u64 + 10) * 1000);
        assert_eq!(h.since((KEEP as u64 + 8) * 1000).len(), 2);
        let json = serde_json::to_value(&all[0]).unwrap();
        assert_eq!(json["transactions"], 1.0);
        assert!(json["wait_p50"].is_null());
    }
}
