//! The realtime service's seam into Shoal: tenants come from the pooler's tenant store (a
//! tenant with a `jwt_secret` has realtime on), and the WebSocket edge runs on the control
//! runtime, beside the API, never on the data plane's cores.

use std::net::SocketAddr;
use std::sync::Arc;

use shoal_realtime::edge::{Directory, Service, TenantKeys};
use shoal_realtime::socket::Limits;

use crate::app::App;

/// Supabase Realtime's defaults.
const MAX_CHANNELS_PER_CLIENT: usize = 100;
const MAX_PAYLOAD_SIZE_IN_KB: usize = 3000;

struct Tenants(Arc<App>);

impl Directory for Tenants {
    fn tenant(&self, id: &str) -> Option<TenantKeys> {
        let route = self.0.routes.tenants.get(id)?;
        let t = &route.tenant;
        if t.banned {
            return None;
        }
        Some(TenantKeys {
            jwt_secret: t.jwt_secret.clone()?,
            limits: Limits {
                max_channels: t.max_channels_per_client.unwrap_or(MAX_CHANNELS_PER_CLIENT),
                max_payload: t.max_payload_size_in_kb.unwrap_or(MAX_PAYLOAD_SIZE_IN_KB) * 1024,
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
    let service = Service::new(Arc::new(Tenants(app.clone())), section.tenant_header);
    tracing::info!(%addr, "realtime listening");
    crate::control::spawn(crate::api::serve(
        listener,
        shoal_realtime::edge::router(service),
    ));
    Ok(Some(addr))
}
