//! The Prometheus exposition of a running Shoal: at each scrape, the process's counters,
//! every pool's and every shard's, read from the App and encoded (`prometheus-client`).
//! Apart from [`crate::metrics`], which holds the counters, so the parts that count (pools,
//! the App) do not depend on what reads them.

use crate::features::PoolFeatures;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use shoal_control::metrics::{counter, gauge, histogram, process_resources};

use crate::metrics::{AtomicHistogram, LabelValue, Labels, ERROR_CLASSES, REJECT_REASONS};
use crate::pool::Pool;

/// Encodes every metric of a running Shoal on each scrape.
pub struct ShoalCollector {
    pub app: Arc<crate::app::App>,
}

impl std::fmt::Debug for ShoalCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShoalCollector")
    }
}

fn pool_labels(pool: &Pool) -> Labels {
    let (tenant, database) = match (&pool.tenant, pool.name.split_once('/')) {
        (Some(t), _) => (t.clone(), pool.upstream.dbname.clone()),
        (None, Some((db, _))) => (String::new(), db.to_owned()),
        (None, None) => (String::new(), pool.name.clone()),
    };
    vec![
        ("tenant", LabelValue::new(&tenant)),
        ("database", LabelValue::new(&database)),
        ("user", LabelValue::new(&pool.upstream.user)),
        ("mode", LabelValue::new(pool.settings.mode.name())),
    ]
}

fn load(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

fn count(a: &std::sync::atomic::AtomicUsize) -> i64 {
    a.load(Ordering::Relaxed) as i64
}

/// A per-pool metric: its name, its help, and how to read it from a pool.
type PoolMetric<T> = (&'static str, &'static str, T);
type PoolGauges = &'static [PoolMetric<fn(&Pool) -> i64>];
type PoolCounters = &'static [PoolMetric<fn(&Pool) -> u64>];
type PoolHistograms = &'static [PoolMetric<fn(&Pool) -> &AtomicHistogram>];

const POOL_GAUGES: PoolGauges = &[
    ("shoal_pool_clients", "Clients logged in to the pool", |p| {
        count(&p.stats.clients)
    }),
    ("shoal_pool_clients_active", "Clients holding a server", |p| {
        p.in_use() as i64
    }),
    ("shoal_pool_clients_waiting", "Clients waiting for a server", |p| {
        count(&p.stats.waiting)
    }),
    (
        "shoal_pool_clients_idle",
        "Logged-in clients neither holding nor waiting for a server",
        |p| (count(&p.stats.clients) - p.in_use() as i64 - count(&p.stats.waiting)).max(0),
    ),
    ("shoal_pool_servers", "Server connections open", |p| {
        count(&p.stats.servers)
    }),
    ("shoal_pool_servers_idle", "Server connections idle in the pool", |p| {
        p.idle_count() as i64
    }),
    ("shoal_pool_servers_in_use", "Server connections held by clients", |p| {
        p.in_use() as i64
    }),
    ("shoal_pool_servers_connecting", "Server connections being opened", |p| {
        load(&p.metrics.connecting) as i64
    }),
    ("shoal_pool_size", "The pool's size now", |p| p.size() as i64),
    (
        "shoal_pool_listen_channels",
        "Channels the pool's transaction-mode clients LISTEN to (one listener connection serves them)",
        |p| p.notify().channels() as i64,
    ),
];

const POOL_COUNTERS: PoolCounters = &[
    ("shoal_pool_transactions", "Transactions (server checkouts)", |p| {
        load(&p.stats.checkouts)
    }),
    ("shoal_pool_queries", "Queries answered (ReadyForQuery relayed)", |p| {
        load(&p.metrics.queries)
    }),
    ("shoal_pool_bytes_received", "Bytes from clients to servers", |p| {
        load(&p.metrics.bytes_in)
    }),
    ("shoal_pool_bytes_sent", "Bytes from servers to clients", |p| {
        load(&p.metrics.bytes_out)
    }),
    ("shoal_pool_server_connects", "Server connections opened", |p| {
        load(&p.stats.connects)
    }),
    (
        "shoal_pool_server_connect_failures",
        "Server connections that failed to open",
        |p| load(&p.stats.connect_failures),
    ),
    (
        "shoal_pool_notifications_delivered",
        "Notifications handed to listening clients by the pool's listener connection",
        |p| load(&p.notify().counts.delivered),
    ),
    (
        "shoal_pool_listener_connections_lost",
        "Listener connections lost while clients listened (notifications sent until it was back were lost)",
        |p| load(&p.notify().counts.listener_lost),
    ),
    (
        "shoal_pool_notification_overflows",
        "Clients closed for leaving more notifications unread than Shoal holds for one client",
        |p| load(&p.notify().counts.overflowed),
    ),
];

const POOL_HISTOGRAMS: PoolHistograms = &[
    (
        "shoal_pool_wait_seconds",
        "Time clients waited for a server",
        |p| &p.metrics.wait,
    ),
    (
        "shoal_pool_transaction_seconds",
        "Time a client held a server (a transaction, or a session in session mode)",
        |p| &p.metrics.transaction,
    ),
    (
        "shoal_pool_query_seconds",
        "Time from a query's first message to its ReadyForQuery",
        |p| &p.metrics.query,
    ),
];

impl Collector for ShoalCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let app = &self.app;
        // Replicas' pools too: their servers, checkouts (reads) and errors are theirs.
        let pools = crate::features::with_replica_pools(app.routes.pools());
        encode_pools(&mut e, &pools)?;
        encode_process(&mut e, app)?;
        if app.shards.count() > 1 {
            encode_shards(&mut e, &app.shards)?;
        }
        if let Some(node) = app.cluster.get() {
            crate::cluster::status::encode(node, &mut e)?;
        }
        let routed = app.routes.pools();
        use crate::features::each;
        crate::replicas::status::encode(&each(&routed, |f| f.replicas().cloned()), &mut e)?;
        crate::query_rules::encode(&each(&routed, |f| f.rules()), &mut e)?;
        crate::cache::status::encode(&each(&routed, |f| f.cache()), &mut e)?;
        if let Some(rt) = app.realtime.get() {
            crate::realtime::encode(rt, app.feeds.get(), &mut e)?;
        }
        let (fds, rss) = process_resources();
        gauge(
            &mut e,
            "shoal_open_fds",
            "Open file descriptors",
            &[(vec![], fds)],
        )?;
        gauge(
            &mut e,
            "shoal_resident_memory_bytes",
            "Resident memory",
            &[(vec![], rss)],
        )
    }
}

/// Every pool's gauges, counters, errors and histograms.
fn encode_pools(e: &mut DescriptorEncoder<'_>, pools: &[Arc<Pool>]) -> Result<(), std::fmt::Error> {
    for (name, help, read) in POOL_GAUGES {
        let rows: Vec<(Labels, i64)> = pools.iter().map(|p| (pool_labels(p), read(p))).collect();
        gauge(e, name, help, &rows)?;
    }
    for (name, help, read) in POOL_COUNTERS {
        let rows: Vec<(Labels, u64)> = pools.iter().map(|p| (pool_labels(p), read(p))).collect();
        counter(e, name, help, &rows)?;
    }
    encode_pool_errors(e, pools)?;
    for (name, help, read) in POOL_HISTOGRAMS {
        let rows: Vec<(Labels, &AtomicHistogram)> =
            pools.iter().map(|p| (pool_labels(p), read(p))).collect();
        histogram(e, name, help, &rows)?;
    }
    Ok(())
}

/// Errors relayed to each pool's clients, by SQLSTATE class (classes never seen left out).
fn encode_pool_errors(
    e: &mut DescriptorEncoder<'_>,
    pools: &[Arc<Pool>],
) -> Result<(), std::fmt::Error> {
    let mut m = e.encode_descriptor(
        "shoal_pool_errors",
        "Errors relayed to clients, by SQLSTATE class",
        None,
        MetricType::Counter,
    )?;
    for p in pools {
        for (i, c) in p.metrics.errors.iter().enumerate() {
            let v = c.load(Ordering::Relaxed);
            if v == 0 {
                continue;
            }
            let mut labels = pool_labels(p);
            labels.push((
                "class",
                LabelValue::new(ERROR_CLASSES.get(i).copied().unwrap_or("other")),
            ));
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
        }
    }
    Ok(())
}

/// The process's own counts: connections, logins, TLS, clients, tenants.
fn encode_process(
    e: &mut DescriptorEncoder<'_>,
    app: &crate::app::App,
) -> Result<(), std::fmt::Error> {
    let pm = &app.metrics;
    counter(
        e,
        "shoal_connections_accepted",
        "Client connections accepted",
        &[(vec![], load(&pm.accepted))],
    )?;
    {
        let mut m = e.encode_descriptor(
            "shoal_connections_rejected",
            "Logins refused, by reason",
            None,
            MetricType::Counter,
        )?;
        for r in REJECT_REASONS {
            let labels: Labels = vec![("reason", LabelValue::new(r.label()))];
            m.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&pm.rejected_count(r), None)?;
        }
    }
    counter(
        e,
        "shoal_tls_handshakes",
        "TLS handshakes completed with clients",
        &[(vec![], load(&pm.tls_handshakes))],
    )?;
    counter(
        e,
        "shoal_tls_handshake_failures",
        "TLS handshakes with clients that failed",
        &[(vec![], load(&pm.tls_handshake_failures))],
    )?;
    counter(
        e,
        "shoal_auth_failures",
        "Failed client authentications",
        &[(vec![], load(&pm.auth_failures))],
    )?;
    if app.config.serverless.is_some() {
        serverless(e, &pm.serverless)?;
    }
    gauge(
        e,
        "shoal_clients",
        "Clients logged in",
        &[(vec![], app.admission.clients.load(Ordering::Relaxed) as i64)],
    )?;
    gauge(
        e,
        "shoal_clients_logging_in",
        "Connections still logging in",
        &[(vec![], app.admission.logins.load(Ordering::Relaxed) as i64)],
    )?;
    gauge(
        e,
        "shoal_tenants",
        "Tenants known to routing",
        &[(vec![], app.routes.tenants.len() as i64)],
    )
}

/// The per-core data plane's shards (only when there are several).
fn encode_shards(
    e: &mut DescriptorEncoder<'_>,
    shards: &crate::shard::Shards,
) -> Result<(), std::fmt::Error> {
    gauge(
        e,
        "shoal_shards_open",
        "Per-core data plane: shards taking clients now",
        &[(vec![], shards.open() as i64)],
    )?;
    let rows: Vec<(Labels, i64)> = shards
        .client_counts()
        .into_iter()
        .enumerate()
        .map(|(i, n)| (vec![("shard", LabelValue::new(&i.to_string()))], n as i64))
        .collect();
    gauge(
        e,
        "shoal_shard_clients",
        "Per-core data plane: clients living on each shard",
        &rows,
    )?;
    counter(
        e,
        "shoal_shard_handovers",
        "Per-core data plane: clients accepted on a closed shard and handed to an open one",
        &[(vec![], shards.handed_over())],
    )
}

/// The serverless front door's traffic, per transport (only with `[serverless]`).
fn serverless(
    e: &mut DescriptorEncoder<'_>,
    m: &crate::metrics::ServerlessMetrics,
) -> Result<(), std::fmt::Error> {
    counter(
        e,
        "shoal_serverless_websockets",
        "WebSockets the serverless front door accepted",
        &[(vec![], m.websockets.load(Ordering::Relaxed))],
    )?;
    let rows: Vec<(Labels, u64)> = m
        .http_counts()
        .map(|(status, n)| (vec![("status", LabelValue::new(&status))], n))
        .collect();
    counter(
        e,
        "shoal_serverless_http_requests",
        "HTTP queries the serverless front door answered, by HTTP status",
        &rows,
    )
}

/// The Prometheus text exposition of everything.
pub fn render(app: &Arc<crate::app::App>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(ShoalCollector { app: app.clone() }));
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &registry).is_err() {
        out.clear();
    }
    out
}
