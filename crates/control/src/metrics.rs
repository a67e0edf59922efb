//! The metrics registry's parts every service shares: lock-free histograms a hot path
//! updates without allocating, label values escaped for the text format, and helpers that
//! encode families of gauges, counters and histograms for a `prometheus-client` collector.
//! Each service keeps its own counters and a collector that reads them at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// Histogram bucket upper bounds, in microseconds (then +Inf).
pub const BUCKETS_US: [u64; 13] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000, 10_000_000,
    60_000_000,
];
const NBUCKETS: usize = BUCKETS_US.len() + 1;

fn bucket_of(us: u64) -> usize {
    BUCKETS_US
        .iter()
        .position(|&b| us <= b)
        .unwrap_or(BUCKETS_US.len())
}

/// A histogram updated with relaxed atomics (no lock).
#[derive(Debug, Default)]
pub struct AtomicHistogram {
    counts: [AtomicU64; NBUCKETS],
    sum_us: AtomicU64,
}

impl AtomicHistogram {
    pub fn observe_us(&self, us: u64) {
        self.counts[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
        if us > 0 {
            self.sum_us.fetch_add(us, Ordering::Relaxed);
        }
    }

    /// Adds a transaction's local observations.
    pub fn merge(&self, local: &LocalHistogram) {
        if local.count == 0 {
            return;
        }
        for (i, &c) in local.counts.iter().enumerate() {
            if c > 0 {
                self.counts[i].fetch_add(u64::from(c), Ordering::Relaxed);
            }
        }
        self.sum_us.fetch_add(local.sum_us, Ordering::Relaxed);
    }

    pub fn sum_us(&self) -> u64 {
        self.sum_us.load(Ordering::Relaxed)
    }

    /// (sum in seconds, count, per-bucket counts with upper bounds in seconds). The last
    /// bucket's bound is `f64::MAX`, which the text encoder writes as Prometheus's `+Inf`
    /// (it would write infinity as `inf`).
    pub fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut buckets = Vec::with_capacity(NBUCKETS);
        let mut count = 0;
        for (i, c) in self.counts.iter().enumerate() {
            let c = c.load(Ordering::Relaxed);
            count += c;
            let upper = BUCKETS_US.get(i).map_or(f64::MAX, |&b| b as f64 / 1e6);
            buckets.push((upper, c));
        }
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        (sum, count, buckets)
    }
}

/// Observations made during one transaction, on the session's stack.
#[derive(Debug, Default, Clone)]
pub struct LocalHistogram {
    counts: [u32; NBUCKETS],
    sum_us: u64,
    count: u32,
}

impl LocalHistogram {
    pub fn observe_us(&mut self, us: u64) {
        self.counts[bucket_of(us)] += 1;
        self.sum_us += us;
        self.count += 1;
    }
}

/// A metric's labels, as the encoding helpers take them.
pub type Labels = Vec<(&'static str, LabelValue)>;

/// A label value escaped for the text exposition format (`\\`, `"` and newlines), which the
/// encoder writes as it is: role, database and tenant names come from users, and one with a
/// quote or a newline must not end the value or forge a series.
pub struct LabelValue(String);

impl LabelValue {
    pub fn new(raw: &str) -> LabelValue {
        let mut v = String::with_capacity(raw.len());
        for c in raw.chars() {
            match c {
                '\\' => v.push_str("\\\\"),
                '"' => v.push_str("\\\""),
                '\n' => v.push_str("\\n"),
                c => v.push(c),
            }
        }
        LabelValue(v)
    }
}

impl prometheus_client::encoding::EncodeLabelValue for LabelValue {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        encoder.write_str(&self.0)
    }
}

pub fn gauge(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, i64)],
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        m.encode_family(labels)?.encode_gauge(v)?;
    }
    Ok(())
}

pub fn counter(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        m.encode_family(labels)?
            .encode_counter::<NoLabelSet, _, u64>(v, None)?;
    }
    Ok(())
}

pub fn histogram(
    e: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(Labels, &AtomicHistogram)],
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in rows {
        let (sum, count, buckets) = h.snapshot();
        m.encode_family(labels)?
            .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
    }
    Ok(())
}

/// Descriptors opened under /proc/self/fd, and resident memory from /proc/self/statm.
pub fn process_resources() -> (i64, i64) {
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as i64);
    let page = 4096;
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
        .map_or(0, |p| p * page);
    (fds, rss)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_bucket_and_merge() {
        let h = AtomicHistogram::default();
        let mut local = LocalHistogram::default();
        local.observe_us(40);
        local.observe_us(700);
        local.observe_us(100_000_000);
        h.merge(&local);
        h.observe_us(1_000);
        let (sum, count, buckets) = h.snapshot();
        assert_eq!(count, 4);
        assert!((sum - 100.00174).abs() < 1e-6);
        assert_eq!(buckets[0], (50e-6, 1));
        assert_eq!(buckets[4], (1e-3, 2));
        assert_eq!(buckets.last().unwrap().1, 1, "+Inf");
        // Exposed as Prometheus's `+Inf` bucket.
        let mut text = String::new();
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(One(h)));
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("h_bucket{le=\"+Inf\"} 4"), "{text}");
        assert!(!text.contains("inf\""), "{text}");
    }

    #[derive(Debug)]
    struct One(AtomicHistogram);

    impl prometheus_client::collector::Collector for One {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            histogram(&mut e, "h", "a histogram", &[(vec![], &self.0)])
        }
    }
}
