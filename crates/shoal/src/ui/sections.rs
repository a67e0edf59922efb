//! The dashboard's sections for features that may not be configured: the cluster, realtime,
//! replicas and the result cache. Each is `None` (and the page leaves it out) unless the
//! feature is in use.

use crate::features::PoolFeatures;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Mutex;

use serde::Serialize;

use crate::app::App;

#[derive(Serialize)]
pub struct Sections {
    pub version: &'static str,
    pub cluster: Option<crate::cluster::status::ClusterStatus>,
    pub realtime: Option<Vec<RealtimeRow>>,
    pub replicas: Option<Vec<crate::replicas::status::BackendRow>>,
    pub cache: Option<Vec<CacheRow>>,
}

#[derive(Debug, Serialize)]
pub struct RealtimeRow {
    pub tenant: String,
    pub sockets: u64,
    pub channels: u64,
    pub messages: u64,
    /// Messages from clients a second, over the last sampled second.
    pub messages_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct CacheRow {
    pub pool: String,
    pub entries: u64,
    pub bytes: u64,
    pub hits: u64,
    pub misses: u64,
    /// Hits over lookups (`None`: no lookups yet).
    pub hit_ratio: Option<f64>,
}

/// Each realtime tenant's message count at the last sample, and its rate.
#[derive(Default)]
pub struct RealtimeRates {
    inner: Mutex<HashMap<String, (u64, u64, f64)>>,
}

impl RealtimeRates {
    /// Takes each tenant's message total at `at` (milliseconds).
    pub fn record(&self, at: u64, totals: impl Iterator<Item = (String, u64)>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = HashMap::new();
        for (tenant, total) in totals {
            let rate = match inner.remove(&tenant) {
                Some((t0, at0, _)) if at > at0 => {
                    total.saturating_sub(t0) as f64 * 1000.0 / (at - at0) as f64
                }
                _ => 0.0,
            };
            next.insert(tenant, (total, at, rate));
        }
        *inner = next;
    }

    pub fn rate(&self, tenant: &str) -> f64 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.get(tenant).map_or(0.0, |r| r.2)
    }
}

/// The realtime tenants' message totals now (none without `[realtime]`).
pub fn realtime_totals(app: &App) -> Vec<(String, u64)> {
    app.realtime
        .get()
        .map(|s| {
            s.stats()
                .into_iter()
                .map(|r| (r.tenant, r.messages))
                .collect()
        })
        .unwrap_or_default()
}

pub fn sections(app: &App, rates: &RealtimeRates) -> Sections {
    let pools = app.routes.pools();
    let realtime = app.realtime.get().map(|s| {
        s.stats()
            .into_iter()
            .map(|r| RealtimeRow {
                messages_per_s: rates.rate(&r.tenant),
                tenant: r.tenant,
                sockets: r.sockets,
                channels: r.channels,
                messages: r.messages,
            })
            .collect()
    });
    let replicas =
        crate::replicas::status::rows(&crate::features::each(&pools, |f| f.replicas().cloned()));
    let cache: Vec<CacheRow> = pools
        .iter()
        .filter_map(|p| {
            let c = p.cache()?;
            let (hits, misses) = (c.stats.hits.load(Relaxed), c.stats.misses.load(Relaxed));
            Some(CacheRow {
                pool: p.name.clone(),
                entries: c.entries(),
                bytes: c.bytes(),
                hits,
                misses,
                hit_ratio: (hits + misses > 0).then(|| hits as f64 / (hits + misses) as f64),
            })
        })
        .collect();
    Sections {
        version: env!("CARGO_PKG_VERSION"),
        cluster: app.cluster.get().map(|n| n.status()),
        realtime,
        replicas: (!replicas.is_empty()).then_some(replicas),
        cache: (!cache.is_empty()).then_some(cache),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn realtime_rates_are_per_second_between_samples() {
        let r = RealtimeRates::default();
        r.record(1000, [("t".to_owned(), 10)].into_iter());
        assert_eq!(r.rate("t"), 0.0, "one measure is no rate");
        r.record(3000, [("t".to_owned(), 50)].into_iter());
        assert_eq!(r.rate("t"), 20.0);
        r.record(4000, std::iter::empty());
        assert_eq!(r.rate("t"), 0.0, "a tenant gone is forgotten");
    }
}
