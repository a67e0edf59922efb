//! What the caches hold and did: `SHOW CACHE` rows and the `shoal_cache_*` metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::freshness::{BY_RESET, BY_STREAM, BY_WRITE};
use crate::pool::Pool;

/// One pool's cache.
pub struct Row {
    pub pool: String,
    pub database: String,
    pub entries: u64,
    pub bytes: u64,
    pub max_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub fills: u64,
    pub waits: u64,
    pub stale: u64,
    pub passed: u64,
    pub unkept: u64,
    pub evictions: u64,
    /// `up`, or why the change stream is down.
    pub stream: String,
    pub covered: u64,
    /// Invalidations of the pool's database: by writes through Shoal, by the stream, by
    /// resets (the stream lost).
    pub invalidations: [u64; 3],
}

/// A row for each pool in `caches`, with its cache.
pub fn rows(caches: &[(Arc<Pool>, Arc<super::QueryCache>)]) -> Vec<Row> {
    let mut rows = Vec::new();
    for (p, c) in caches {
        let f = &c.freshness;
        let state = f.stream_state();
        let s = &c.stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        rows.push(Row {
            pool: p.name.clone(),
            database: f.label.clone(),
            entries: c.entries(),
            bytes: c.bytes(),
            max_bytes: c.config.max_memory,
            hits: load(&s.hits),
            misses: load(&s.misses),
            fills: load(&s.fills),
            waits: load(&s.waits),
            stale: load(&s.stale),
            passed: load(&s.passed),
            unkept: load(&s.unkept_replies),
            evictions: load(&s.evictions),
            stream: match (state.connected, state.last_error) {
                (true, _) => "up".into(),
                (false, Some(e)) => format!("down: {e}"),
                (false, None) => "starting".into(),
            },
            covered: f.tables().iter().filter(|t| t.covered()).count() as u64,
            invalidations: [BY_WRITE, BY_STREAM, BY_RESET].map(|i| f.invalidations(i)),
        });
    }
    rows
}

/// The `shoal_cache_*` metric families.
pub fn encode(
    caches: &[(Arc<Pool>, Arc<super::QueryCache>)],
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use crate::metrics::LabelValue;
    use shoal_control::metrics::{counter, gauge};
    let rows = rows(caches);
    if rows.is_empty() {
        return Ok(());
    }
    let per_pool = |v: &dyn Fn(&Row) -> u64| -> Vec<_> {
        rows.iter()
            .map(|r| (vec![("pool", LabelValue::new(&r.pool))], v(r)))
            .collect()
    };
    for (name, help, value) in [
        (
            "shoal_cache_hits",
            "Units answered from the result cache",
            &(|r: &Row| r.hits) as &dyn Fn(&Row) -> u64,
        ),
        (
            "shoal_cache_misses",
            "Cacheable units the cache had no current reply for",
            &|r: &Row| r.misses,
        ),
        (
            "shoal_cache_fills",
            "Replies kept by the result cache",
            &|r: &Row| r.fills,
        ),
        (
            "shoal_cache_waits",
            "Clients that waited for another client's fill of the same key",
            &|r: &Row| r.waits,
        ),
        (
            "shoal_cache_stale",
            "Lookups that found an entry whose tables had changed",
            &|r: &Row| r.stale,
        ),
        (
            "shoal_cache_evictions",
            "Entries evicted to keep the cache within cache_max_memory",
            &|r: &Row| r.evictions,
        ),
    ] {
        counter(e, name, help, &per_pool(value))?;
    }
    let gauges: Vec<_> = per_pool(&|r| r.bytes)
        .into_iter()
        .map(|(l, v)| (l, v as i64))
        .collect();
    gauge(
        e,
        "shoal_cache_bytes",
        "Bytes the result cache holds (keys and replies)",
        &gauges,
    )?;
    let entries: Vec<_> = per_pool(&|r| r.entries)
        .into_iter()
        .map(|(l, v)| (l, v as i64))
        .collect();
    gauge(
        e,
        "shoal_cache_entries",
        "Replies the result cache holds",
        &entries,
    )?;
    let mut databases: Vec<&Row> = rows.iter().collect();
    databases.sort_by(|a, b| a.database.cmp(&b.database));
    databases.dedup_by(|a, b| a.database == b.database);
    let mut inval = Vec::new();
    for r in &databases {
        for (cause, v) in ["write", "stream", "reset"].iter().zip(r.invalidations) {
            inval.push((
                vec![
                    ("database", LabelValue::new(&r.database)),
                    ("cause", LabelValue::new(cause)),
                ],
                v,
            ));
        }
    }
    counter(
        e,
        "shoal_cache_invalidations",
        "Changes that made cached replies stale, by cause: a write through Shoal, a change seen on the stream, the stream lost",
        &inval,
    )?;
    let up: Vec<_> = databases
        .iter()
        .map(|r| {
            (
                vec![("database", LabelValue::new(&r.database))],
                i64::from(r.stream == "up"),
            )
        })
        .collect();
    gauge(e, "shoal_cache_stream_up", "Whether the database's change stream is up (nothing is served from the cache while it is not)", &up)
}
