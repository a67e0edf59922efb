//! The realtime service's seam into Shoal: tenants come from the pooler's tenant store (a
//! tenant with a `jwt_secret` has realtime on), and the WebSocket edge runs on the control
//! runtime, beside the API, never on the data plane's cores.

use std::net::SocketAddr;
use std::sync::Arc;

use shoal_realtime::edge::{Directory, Lookup, Options, Service, TenantKeys};
use shoal_realtime::jwt::Verifier;
use shoal_realtime::limits::Limits;

pub mod changes;
pub mod fabric;

use crate::app::App;
use crate::route::TenantEvent;

struct Tenants(Arc<App>);

impl Directory for Tenants {
    fn tenant(&self, id: &str) -> Lookup {
        let Some(route) = self.0.routes.tenants.get(id) else {
            return Lookup::NotFound;
        };
        let t = &route.tenant;
        let verifier = Verifier::new(t.jwt_secret.as_deref(), t.jwt_jwks.as_ref());
        if t.banned_at(std::time::SystemTime::now()) || verifier.is_empty() {
            return Lookup::Disabled;
        }
        let defaults = Limits::default();
        Lookup::Found(TenantKeys {
            verifier: Arc::new(verifier),
            limits: Limits {
                max_channels: t.max_channels_per_client.unwrap_or(defaults.max_channels),
                max_payload: t
                    .max_payload_size_in_kb
                    .map_or(defaults.max_payload, |kb| kb.saturating_mul(1024)),
                max_concurrent_users: t.max_concurrent_users,
                max_events_per_second: t.max_events_per_second,
                max_joins_per_second: t.max_joins_per_second,
                max_bytes_per_second: t.max_bytes_per_second,
                private_only: t.private_only,
            },
        })
    }
}

/// Without `[realtime]`, the capture tasks the cache's change streams need (see
/// [`crate::wal`]): Realtime's, serving no tenant.
pub fn start_taps(app: &Arc<App>) {
    let node = match app.cluster.get() {
        Some(n) => n.id.clone(),
        None => format!(
            "{}:{}",
            shoal_control::config::host_name(),
            app.config.server.listen.first().map_or(0, |a| a.port())
        ),
    };
    let feeds = changes::Feeds::new(app, &node, std::sync::Weak::new());
    feeds.serve_taps(app);
    let _ = app.feeds.set(feeds);
}

/// Starts the WebSocket service when `[realtime]` is configured, on `inherited` (a
/// previous process's socket) or its own; its address and socket. When Shoal shuts down
/// (or hands over to a new process), every socket is closed with 1012 (service restart),
/// which the official clients answer by reconnecting: to the new process, after an upgrade.
pub async fn start(
    app: &Arc<App>,
    inherited: Option<tokio::net::TcpListener>,
) -> std::io::Result<Option<(SocketAddr, std::os::fd::RawFd, Arc<Service>)>> {
    use std::os::fd::AsRawFd;
    let Some(section) = app.config.realtime.clone() else {
        return Ok(None);
    };
    let listener =
        crate::listener::bind_or_inherit(inherited, section.listen, "realtime.listen").await?;
    let addr = listener.local_addr()?;
    let fd = listener.as_raw_fd();
    let options = Options {
        tenant_header: section.tenant_header,
        heartbeat_timeout: std::time::Duration::from_secs_f64(section.heartbeat_timeout),
        resume_window: std::time::Duration::from_secs_f64(section.resume_window),
    };
    let service = Service::new(Arc::new(Tenants(app.clone())), options);
    let node = match app.cluster.get() {
        Some(n) => n.id.clone(),
        None => format!("{}:{}", shoal_control::config::host_name(), addr.port()),
    };
    let feeds = changes::Feeds::new(app, &node, Arc::downgrade(&service));
    feeds.serve_taps(app);
    service.set_feed(feeds.clone());
    // Tenant changes reach the service as the pooler applies them (weakly: the service
    // holds the app).
    let weak = Arc::downgrade(&service);
    let weak_feeds = Arc::downgrade(&feeds);
    let routes = Arc::downgrade(&app.routes);
    app.routes.on_tenant_event(move |e| {
        let Some(service) = weak.upgrade() else {
            return;
        };
        match e {
            TenantEvent::Changed(id) => {
                service.tenant_changed(id);
                let realtime = routes
                    .upgrade()
                    .and_then(|r| r.tenants.get(id))
                    .is_some_and(|t| t.tenant.jwt_secret.is_some() || t.tenant.jwt_jwks.is_some());
                if let Some(feeds) = weak_feeds.upgrade().filter(|_| realtime) {
                    feeds.prepare(id);
                }
            }
            TenantEvent::Ended(id) => service.tenant_ended(id),
        }
    });
    tracing::info!(%addr, "realtime listening");
    if let Some(node) = app.cluster.get() {
        let relay = Arc::new(fabric::NodeRelay::new(
            node.clone(),
            Arc::downgrade(&service),
        ));
        relay.keep_streams();
        service.set_relay(relay);
    }
    let _ = app.feeds.set(feeds);
    let _ = app.realtime.set(service.clone());
    let mut shutdown = app.lifecycle.shutdown.clone();
    let stopping = service.clone();
    let router = shoal_realtime::edge::router(service.clone());
    let serving = crate::control::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "realtime stopped");
        }
    });
    crate::control::spawn(async move {
        while !*shutdown.borrow_and_update() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        // No new sockets here (the listener stays open for a process taking over).
        serving.abort();
        stopping.shut_down();
    });
    Ok(Some((addr, fd, service)))
}

/// The `shoal_realtime_*` metric families, by tenant.
pub fn encode(
    service: &Service,
    feeds: Option<&Arc<dyn crate::metrics::FeedCounters>>,
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use crate::metrics::LabelValue;
    use shoal_control::metrics::{counter, gauge};
    use shoal_realtime::edge::TenantStats;
    let rows = service.stats();
    let by_tenant = |v: &dyn Fn(&TenantStats) -> u64| -> Vec<_> {
        rows.iter()
            .map(|r| (vec![("tenant", LabelValue::new(&r.tenant))], v(r)))
            .collect()
    };
    let as_gauge = |v: Vec<(Vec<(&'static str, LabelValue)>, u64)>| -> Vec<_> {
        v.into_iter().map(|(l, n)| (l, n as i64)).collect()
    };
    gauge(
        e,
        "shoal_realtime_sockets",
        "Realtime sockets connected",
        &as_gauge(by_tenant(&|r| r.sockets)),
    )?;
    gauge(
        e,
        "shoal_realtime_channels",
        "Realtime channels with at least one subscriber",
        &as_gauge(by_tenant(&|r| r.channels)),
    )?;
    for (name, help, value) in [
        (
            "shoal_realtime_messages",
            "Messages from realtime clients (sockets and HTTP)",
            &(|r: &TenantStats| r.messages) as &dyn Fn(&TenantStats) -> u64,
        ),
        (
            "shoal_realtime_deliveries",
            "Frames queued to subscribers by broadcasts",
            &|r: &TenantStats| r.delivered,
        ),
        (
            "shoal_realtime_joins",
            "Channel joins",
            &|r: &TenantStats| r.joins,
        ),
        (
            "shoal_realtime_limited",
            "Sockets, joins and messages refused for a tenant limit",
            &|r: &TenantStats| r.limited,
        ),
        (
            "shoal_realtime_slow_sockets",
            "Sockets closed for not reading fast enough",
            &|r: &TenantStats| r.slow,
        ),
    ] {
        counter(e, name, help, &by_tenant(value))?;
    }
    if let Some(feeds) = feeds {
        encode_feeds(feeds, e)?;
    }
    Ok(())
}

/// The `shoal_realtime_postgres_changes_*` families, by tenant.
fn encode_feeds(
    feeds: &Arc<dyn crate::metrics::FeedCounters>,
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use crate::metrics::LabelValue;
    use shoal_control::metrics::{counter, gauge};
    use std::sync::atomic::{AtomicU64, Ordering};
    let rows = feeds.per_tenant();
    let by_tenant = |v: &dyn Fn(&changes::FeedStats) -> &AtomicU64| -> Vec<_> {
        rows.iter()
            .map(|(t, s)| {
                (
                    vec![("tenant", LabelValue::new(t))],
                    v(s).load(Ordering::Relaxed),
                )
            })
            .collect()
    };
    let subscriptions: Vec<_> = by_tenant(&|s| &s.subscriptions)
        .into_iter()
        .map(|(l, n)| (l, n as i64))
        .collect();
    gauge(
        e,
        "shoal_realtime_postgres_changes_subscriptions",
        "Channels with postgres_changes bindings",
        &subscriptions,
    )?;
    counter(
        e,
        "shoal_realtime_postgres_changes_rows",
        "Row changes read from the WAL",
        &by_tenant(&|s| &s.changes),
    )?;
    counter(
        e,
        "shoal_realtime_postgres_changes_delivered",
        "postgres_changes messages queued to subscribers",
        &by_tenant(&|s| &s.delivered),
    )?;
    counter(
        e,
        "shoal_realtime_postgres_changes_authorizations",
        "Authorization queries (one per table and role and claims per batch)",
        &by_tenant(&|s| &s.authorizations),
    )?;
    Ok(())
}
