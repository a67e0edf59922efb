//! The tenant store and the management API, started with the process: tenants loaded into
//! routing, a shared store followed, unused tenant pools closed, the API and dashboard
//! served.
// Control plane: runs on the main runtime, which has tokio's time driver.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use crate::app::App;
use crate::config::secs;

/// Opens the tenant store (when configured), loads its tenants into routing, follows a
/// shared store's changes, closes unused tenant pools, and serves the management API (when
/// configured). Returns the API's address.
pub(super) async fn start_tenants(
    app: &std::sync::Arc<App>,
    metrics_token: Option<String>,
    inherited: Option<tokio::net::TcpListener>,
) -> std::io::Result<Option<(std::net::SocketAddr, std::os::fd::RawFd)>> {
    let Some(section) = app.config.store.clone() else {
        return Ok(None);
    };
    let store = crate::tenant::store::Store::open(&section)
        .await
        .map_err(std::io::Error::other)?;
    let shared = store.shared_url().map(str::to_owned);
    let service = std::sync::Arc::new(crate::tenant::service::TenantService::new(
        app.routes.clone(),
        store,
        &section.data_dir,
    ));
    let n = service.sync_all().await.map_err(std::io::Error::other)?;
    tracing::info!(tenants = n, store = %redact_url(&section.url()), "tenant store opened");
    if let Some(url) = shared {
        tokio::spawn(crate::tenant::service::follow_shared_store(
            service.clone(),
            url,
            section.tls_settings(),
            secs(section.resync_interval.max(1.0)),
        ));
    }
    let idle = secs(app.config.tenants.pool_idle_close);
    let routes_app = app.clone();
    tokio::spawn(async move {
        let mut tick =
            tokio::time::interval(Duration::from_secs(5).min(idle.max(Duration::from_millis(200))));
        loop {
            tick.tick().await;
            let closed = routes_app.routes.close_unused_tenant_pools(idle);
            if closed > 0 {
                tracing::debug!(closed, "closed unused tenant pools");
            }
        }
    });
    let Some(api) = app.config.api.clone() else {
        return Ok(None);
    };
    let auth = crate::api::auth::ApiAuth::from_env(
        &api.jwt_secret_env,
        api.token_env.as_deref(),
        &section.data_dir,
    )?;
    let listener = crate::listener::bind_or_inherit(inherited, api.listen, "api.listen").await?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    let addr = listener.local_addr()?;
    tracing::info!(%addr, dashboard = %format!("http://{addr}/ui"), "management API listening");
    let auth = std::sync::Arc::new(auth);
    let router = crate::api::router(service.clone(), auth.clone())
        .merge(crate::api::ops::router(app.clone(), metrics_token))
        .merge(crate::ui::router(app.clone(), service, auth));
    tokio::spawn(crate::api::serve(listener, router));
    Ok(Some((addr, fd)))
}

/// A store URL for the log, without its password.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}
