//! The realtime service's seam into Shoal: tenants come from the pooler's tenant store (a
//! tenant with a `jwt_secret` has realtime on), and the WebSocket edge runs on the control
//! runtime, beside the API, never on the data plane's cores.

use std::net::SocketAddr;
use std::sync::Arc;

use shoal_realtime::edge::{Directory, Lookup, Options, Service, TenantKeys};
use shoal_realtime::jwt::Verifier;
use shoal_realtime::limits::Limits;

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

/// Starts the WebSocket service when `[realtime]` is configured; its address.
pub async fn start(app: &Arc<App>) -> std::io::Result<Option<SocketAddr>> {
    let Some(section) = app.config.realtime.clone() else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(section.listen)
        .await
        .map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot listen on {} (realtime.listen): {e}", section.listen),
            )
        })?;
    let addr = listener.local_addr()?;
    let options = Options {
        tenant_header: section.tenant_header,
        heartbeat_timeout: std::time::Duration::from_secs_f64(section.heartbeat_timeout),
    };
    let service = Service::new(Arc::new(Tenants(app.clone())), options);
    // Tenant changes reach the service as the pooler applies them (weakly: the service
    // holds the app).
    let weak = Arc::downgrade(&service);
    app.routes.on_tenant_event(move |e| {
        let Some(service) = weak.upgrade() else {
            return;
        };
        match e {
            TenantEvent::Changed(id) => service.tenant_changed(id),
            TenantEvent::Ended(id) => service.tenant_ended(id),
        }
    });
    tracing::info!(%addr, "realtime listening");
    crate::control::spawn(crate::api::serve(
        listener,
        shoal_realtime::edge::router(service),
    ));
    Ok(Some(addr))
}
