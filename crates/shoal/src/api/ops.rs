//! Operations endpoints: `/metrics` (Prometheus text format), `/health` (the process is up)
//! and `/ready` (its upstreams accept TCP connections). Served on the API listener and on
//! `[metrics] listen`.
// The HTTP endpoints run on the main runtime.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use subtle::ConstantTimeEq;

use crate::app::App;

struct Ops {
    app: Arc<App>,
    token: Option<String>,
}

/// The operations routes; `token`, when given, is required (as a bearer token) by `/metrics`.
pub fn router(app: Arc<App>, token: Option<String>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/api/cluster", get(cluster))
        .with_state(Arc::new(Ops { app, token }))
}

/// The cluster as this node sees it (404 without `[cluster]`); guarded as `/metrics` is.
async fn cluster(State(ops): State<Arc<Ops>>, headers: HeaderMap) -> Response {
    if let Some(denied) = unauthorized(&ops, &headers) {
        return denied;
    }
    match ops.app.cluster.get() {
        Some(node) => Json(node.status()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "this Shoal is not in a cluster (no [cluster] section)"})),
        )
            .into_response(),
    }
}

/// The refusal of a request without the metrics token, when one is set.
fn unauthorized(ops: &Ops, headers: &HeaderMap) -> Option<Response> {
    let t = ops.token.as_ref()?;
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(t.as_bytes().ct_eq(given.as_bytes())) {
        return None;
    }
    Some(
        (
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "missing or invalid bearer token"})),
        )
            .into_response(),
    )
}

async fn metrics(State(ops): State<Arc<Ops>>, headers: HeaderMap) -> Response {
    if let Some(denied) = unauthorized(&ops, &headers) {
        return denied;
    }
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::scrape::render(&ops.app),
    )
        .into_response()
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// Ready when every upstream Shoal routes to (the config file's databases and the tenants
/// with open pools) accepts a TCP connection within two seconds.
async fn ready(State(ops): State<Arc<Ops>>) -> Response {
    let mut targets: Vec<(String, String, u16)> = ops
        .app
        .routes
        .config()
        .databases
        .values()
        .map(|d| (d.name.clone(), d.host.clone(), d.port))
        .collect();
    for p in ops.app.routes.pools() {
        if let Some(t) = &p.tenant {
            targets.push((
                format!("tenant {t}"),
                p.upstream.host.clone(),
                p.upstream.port,
            ));
        }
    }
    targets.sort();
    targets.dedup();
    let checks = targets.into_iter().map(|(name, host, port)| async move {
        let ok = matches!(
            tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect((host.as_str(), port))
            )
            .await,
            Ok(Ok(_))
        );
        (name, ok)
    });
    let results = futures_util::future::join_all(checks).await;
    let down: Vec<&String> = results
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(n, _)| n)
        .collect();
    if down.is_empty() {
        Json(json!({"status": "ready", "upstreams": results.len()})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "unreachable": down})),
        )
            .into_response()
    }
}
