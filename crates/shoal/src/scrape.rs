//! The Prometheus exposition of a running Shoal: at each scrape, the process's counters,
//! every pool's and every shard's, read from the App and encoded (`prometheus-client`).
//! Apart from [`crate::metrics`], which holds the counters, so the parts that count (pools,
//! the App) do not depend on what reads them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use shoal_control::metrics::{counter, gauge, histogram, process_resources};

use crate::metrics::{AtomicHistogram, LabelValue, Labels, ERROR_CLASSES, REJECT_REASONS};

/// Encodes every metric of a running Shoal on each scrape.
pub struct ShoalCollector {
    pub app: Arc<crate::app::App>,
}

impl std::fmt::Debug for ShoalCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ShoalCollector")
    }
}

fn pool_labels(pool: &crate::pool::Pool) -> Labels {
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

impl Collector for ShoalCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let app = &self.app;
        // Replicas' pools too: their servers, checkouts (reads) and errors are theirs.
        let pools = crate::replicas::status::with_replica_pools(app.routes.pools());
        let rows = |f: &dyn Fn(&crate::pool::Pool) -> i64| -> Vec<(Labels, i64)> {
            pools.iter().map(|p| (pool_labels(p), f(p))).collect()
        };
        let crows = |f: &dyn Fn(&crate::pool::Pool) -> u64| -> Vec<(Labels, u64)> {
            pools.iter().map(|p| (pool_labels(p), f(p))).collect()
        };
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let lu = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as i64;
        gauge(
            &mut e,
            "shoal_pool_clients",
            "Clients logged in to the pool",
            &rows(&|p| lu(&p.stats.clients)),
        )?;
        gauge(
            &mut e,
            "shoal_pool_clients_active",
            "Clients holding a server",
            &rows(&|p| p.in_use() as i64),
        )?;
        gauge(
            &mut e,
            "shoal_pool_clients_waiting",
            "Clients waiting for a server",
            &rows(&|p| lu(&p.stats.waiting)),
        )?;
        gauge(
            &mut e,
            "shoal_pool_clients_idle",
            "Logged-in clients neither holding nor waiting for a server",
            &rows(&|p| (lu(&p.stats.clients) - p.in_use() as i64 - lu(&p.stats.waiting)).max(0)),
        )?;
        gauge(
            &mut e,
            "shoal_pool_servers",
            "Server connections open",
            &rows(&|p| lu(&p.stats.servers)),
        )?;
        gauge(
            &mut e,
            "shoal_pool_servers_idle",
            "Server connections idle in the pool",
            &rows(&|p| p.idle_count() as i64),
        )?;
        gauge(
            &mut e,
            "shoal_pool_servers_in_use",
            "Server connections held by clients",
            &rows(&|p| p.in_use() as i64),
        )?;
        gauge(
            &mut e,
            "shoal_pool_servers_connecting",
            "Server connections being opened",
            &rows(&|p| l(&p.metrics.connecting) as i64),
        )?;
        gauge(
            &mut e,
            "shoal_pool_size",
            "The pool's size now",
            &rows(&|p| p.size() as i64),
        )?;
        counter(
            &mut e,
            "shoal_pool_transactions",
            "Transactions (server checkouts)",
            &crows(&|p| l(&p.stats.checkouts)),
        )?;
        counter(
            &mut e,
            "shoal_pool_queries",
            "Queries answered (ReadyForQuery relayed)",
            &crows(&|p| l(&p.metrics.queries)),
        )?;
        counter(
            &mut e,
            "shoal_pool_bytes_received",
            "Bytes from clients to servers",
            &crows(&|p| l(&p.metrics.bytes_in)),
        )?;
        counter(
            &mut e,
            "shoal_pool_bytes_sent",
            "Bytes from servers to clients",
            &crows(&|p| l(&p.metrics.bytes_out)),
        )?;
        counter(
            &mut e,
            "shoal_pool_server_connects",
            "Server connections opened",
            &crows(&|p| l(&p.stats.connects)),
        )?;
        counter(
            &mut e,
            "shoal_pool_server_connect_failures",
            "Server connections that failed to open",
            &crows(&|p| l(&p.stats.connect_failures)),
        )?;
        gauge(
            &mut e,
            "shoal_pool_listen_channels",
            "Channels the pool's transaction-mode clients LISTEN to (one listener connection serves them)",
            &rows(&|p| p.notify.channels() as i64),
        )?;
        counter(
            &mut e,
            "shoal_pool_notifications_delivered",
            "Notifications handed to listening clients by the pool's listener connection",
            &crows(&|p| l(&p.notify.counts.delivered)),
        )?;
        counter(
            &mut e,
            "shoal_pool_listener_connections_lost",
            "Listener connections lost while clients listened (notifications sent until it was back were lost)",
            &crows(&|p| l(&p.notify.counts.listener_lost)),
        )?;
        counter(
            &mut e,
            "shoal_pool_notification_overflows",
            "Clients closed for leaving more notifications unread than Shoal holds for one client",
            &crows(&|p| l(&p.notify.counts.overflowed)),
        )?;
        {
            let mut m = e.encode_descriptor(
                "shoal_pool_errors",
                "Errors relayed to clients, by SQLSTATE class",
                None,
                MetricType::Counter,
            )?;
            for p in &pools {
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
        }
        let hrows = |f: &dyn for<'a> Fn(&'a crate::pool::Pool) -> &'a AtomicHistogram| -> Vec<(Labels, &AtomicHistogram)> {
            pools.iter().map(|p| (pool_labels(p), f(p))).collect()
        };
        histogram(
            &mut e,
            "shoal_pool_wait_seconds",
            "Time clients waited for a server",
            &hrows(&|p| &p.metrics.wait),
        )?;
        histogram(
            &mut e,
            "shoal_pool_transaction_seconds",
            "Time a client held a server (a transaction, or a session in session mode)",
            &hrows(&|p| &p.metrics.transaction),
        )?;
        histogram(
            &mut e,
            "shoal_pool_query_seconds",
            "Time from a query's first message to its ReadyForQuery",
            &hrows(&|p| &p.metrics.query),
        )?;
        let pm = &app.metrics;
        counter(
            &mut e,
            "shoal_connections_accepted",
            "Client connections accepted",
            &[(vec![], l(&pm.accepted))],
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
            &mut e,
            "shoal_tls_handshakes",
            "TLS handshakes completed with clients",
            &[(vec![], l(&pm.tls_handshakes))],
        )?;
        counter(
            &mut e,
            "shoal_tls_handshake_failures",
            "TLS handshakes with clients that failed",
            &[(vec![], l(&pm.tls_handshake_failures))],
        )?;
        counter(
            &mut e,
            "shoal_auth_failures",
            "Failed client authentications",
            &[(vec![], l(&pm.auth_failures))],
        )?;
        if app.config.serverless.is_some() {
            serverless(&mut e, &pm.serverless)?;
        }
        gauge(
            &mut e,
            "shoal_clients",
            "Clients logged in",
            &[(vec![], app.admission.clients.load(Ordering::Relaxed) as i64)],
        )?;
        gauge(
            &mut e,
            "shoal_clients_logging_in",
            "Connections still logging in",
            &[(vec![], app.admission.logins.load(Ordering::Relaxed) as i64)],
        )?;
        gauge(
            &mut e,
            "shoal_tenants",
            "Tenants known to routing",
            &[(vec![], app.routes.tenants.len() as i64)],
        )?;
        if crate::shard::count() > 1 {
            gauge(
                &mut e,
                "shoal_shards_open",
                "Per-core data plane: shards taking clients now",
                &[(vec![], crate::shard::open() as i64)],
            )?;
            let rows: Vec<(Labels, i64)> = crate::shard::client_counts()
                .into_iter()
                .enumerate()
                .map(|(i, n)| (vec![("shard", LabelValue::new(&i.to_string()))], n as i64))
                .collect();
            gauge(
                &mut e,
                "shoal_shard_clients",
                "Per-core data plane: clients living on each shard",
                &rows,
            )?;
            counter(
                &mut e,
                "shoal_shard_handovers",
                "Per-core data plane: clients accepted on a closed shard and handed to an open one",
                &[(vec![], crate::shard::handed_over())],
            )?;
        }
        if let Some(node) = app.cluster.get() {
            crate::cluster::status::encode(node, &mut e)?;
        }
        let routed = app.routes.pools();
        crate::replicas::status::encode(&routed, &mut e)?;
        crate::query_rules::encode(&routed, &mut e)?;
        crate::cache::status::encode(&routed, &mut e)?;
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
        )?;
        Ok(())
    }
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
