//! The WebSocket edge: `/socket/websocket` and `/realtime/v1/websocket`, with the tenant
//! taken from the first label of the `Host` header (as Supabase does), from a configured
//! header, or from a path prefix (`/t/TENANT/socket/websocket`), `vsn=1.0.0|2.0.0`, and the tenant's JWT as `apikey` (query) or `x-api-key`
//! (header). A refused request gets its HTTP status and a JSON body before any upgrade.
//!
//! Each socket is one task: frames from the client go through its [`Socket`], frames for
//! it come from its bounded queue (see [`crate::hub`]). A socket that does not keep up is
//! closed with a reason rather than let its queue grow.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{SinkExt, StreamExt};

use crate::hub::{Frame, Hub, Outbox};
use crate::protocol::Vsn;
use crate::socket::{Limits, Socket};

/// What the edge needs of a tenant.
#[derive(Clone)]
pub struct TenantKeys {
    /// Verifies the tenant's JWTs (HS256, HS384 or HS512).
    pub jwt_secret: String,
    pub limits: Limits,
}

/// Where the edge finds tenants (the pooler's tenant store, in Shoal).
pub trait Directory: Send + Sync + 'static {
    /// Tenant `id`'s keys, when it exists and has realtime on.
    fn tenant(&self, id: &str) -> Option<TenantKeys>;
}

/// Frames a socket may have queued before it counts as too slow.
pub const SOCKET_QUEUE: usize = 1024;

pub struct Service {
    directory: Arc<dyn Directory>,
    /// The header naming the tenant (`None`: the first label of `Host`).
    tenant_header: Option<String>,
    hubs: Mutex<HashMap<String, Arc<Hub>>>,
    next_socket: AtomicU64,
}

impl Service {
    pub fn new(directory: Arc<dyn Directory>, tenant_header: Option<String>) -> Arc<Service> {
        Arc::new(Service {
            directory,
            tenant_header: tenant_header.map(|h| h.to_ascii_lowercase()),
            hubs: Mutex::default(),
            next_socket: AtomicU64::new(1),
        })
    }

    /// Tenant `id`'s channels.
    pub fn hub(&self, id: &str) -> Arc<Hub> {
        self.hubs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.to_owned())
            .or_default()
            .clone()
    }

    /// The tenant's keys, when `token` is one of its JWTs; else the refusal.
    #[allow(clippy::result_large_err)]
    pub(crate) fn authorize(
        &self,
        tenant: Option<String>,
        token: Option<&str>,
    ) -> Result<(String, TenantKeys), Response> {
        let Some(tenant) = tenant else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "no tenant: the host name's first label (or the tenant header) names it",
            ));
        };
        let Some(keys) = self.directory.tenant(&tenant) else {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "Tenant not found or realtime is not enabled for it",
            ));
        };
        let Some(token) = token else {
            return Err(refuse(StatusCode::UNAUTHORIZED, "apikey is missing"));
        };
        if let Err(e) = crate::jwt::verify(token, &keys.jwt_secret) {
            return Err(refuse(StatusCode::UNAUTHORIZED, &e.to_string()));
        }
        Ok((tenant, keys))
    }

    pub(crate) fn tenant_of(&self, headers: &HeaderMap) -> Option<String> {
        let value = match &self.tenant_header {
            Some(h) => headers.get(h.as_str())?.to_str().ok()?.to_owned(),
            None => {
                let host = headers.get("host")?.to_str().ok()?;
                host.split(['.', ':']).next()?.to_owned()
            }
        };
        (!value.is_empty()).then_some(value)
    }
}

pub fn router(service: Arc<Service>) -> axum::Router {
    axum::Router::new()
        .route("/socket/websocket", axum::routing::get(upgrade))
        .route("/realtime/v1/websocket", axum::routing::get(upgrade))
        .route(
            "/t/{tenant}/socket/websocket",
            axum::routing::get(upgrade_named),
        )
        .route(
            "/t/{tenant}/realtime/v1/websocket",
            axum::routing::get(upgrade_named),
        )
        .merge(crate::rest::routes())
        .with_state(service)
}

pub(crate) fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "message": message }))).into_response()
}

async fn upgrade(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    ws: WebSocketUpgrade,
) -> Response {
    let tenant = svc.tenant_of(&headers);
    accept(svc, tenant, headers, query, ws)
}

async fn upgrade_named(
    State(svc): State<Arc<Service>>,
    axum::extract::Path(tenant): axum::extract::Path<String>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    ws: WebSocketUpgrade,
) -> Response {
    accept(svc, Some(tenant), headers, query, ws)
}

fn accept(
    svc: Arc<Service>,
    tenant: Option<String>,
    headers: HeaderMap,
    query: HashMap<String, String>,
    ws: WebSocketUpgrade,
) -> Response {
    let token = query
        .get("apikey")
        .cloned()
        .or_else(|| headers.get("x-api-key")?.to_str().ok().map(str::to_owned));
    let Some(vsn) = Vsn::parse(query.get("vsn").map(String::as_str)) else {
        return refuse(StatusCode::BAD_REQUEST, "vsn must be 1.0.0 or 2.0.0");
    };
    let (tenant, keys) = match svc.authorize(tenant, token.as_deref()) {
        Ok(k) => k,
        Err(r) => return r,
    };
    let hub = svc.hub(&tenant);
    let id = svc.next_socket.fetch_add(1, Ordering::Relaxed);
    ws.on_upgrade(move |socket| run(socket, hub, Socket::new_queued(id, vsn, keys.limits)))
}

impl Socket {
    /// A socket and the reading end of its queue.
    fn new_queued(
        id: u64,
        vsn: Vsn,
        limits: Limits,
    ) -> (Socket, tokio::sync::mpsc::Receiver<Frame>, Outbox) {
        let (out, rx) = Outbox::new(SOCKET_QUEUE);
        (Socket::new(id, vsn, out.clone(), limits), rx, out)
    }
}

async fn run(
    ws: WebSocket,
    hub: Arc<Hub>,
    (mut socket, mut queue, out): (Socket, tokio::sync::mpsc::Receiver<Frame>, Outbox),
) {
    let (mut sink, mut stream) = ws.split();
    let close = loop {
        tokio::select! {
            incoming = stream.next() => {
                let result = match incoming {
                    Some(Ok(WsMessage::Text(t))) => socket.on_text(&hub, t.as_str()),
                    Some(Ok(WsMessage::Binary(b))) => socket.on_binary(&hub, &b),
                    Some(Ok(WsMessage::Ping(_) | WsMessage::Pong(_))) => Ok(()),
                    Some(Ok(WsMessage::Close(_))) | None | Some(Err(_)) => break None,
                };
                if let Err(e) = result {
                    // 1003: unsupported data.
                    break Some((1003, e.to_string()));
                }
            }
            frame = queue.recv() => {
                let Some(frame) = frame else { break None };
                let m = match frame {
                    Frame::Text(t) => WsMessage::Text(t.as_ref().into()),
                    Frame::Binary(b) => WsMessage::Binary(bytes::Bytes::copy_from_slice(&b)),
                };
                if sink.send(m).await.is_err() {
                    break None;
                }
            }
        }
        if out.is_slow() {
            // 1013: try again later.
            break Some((1013, "too slow: the socket's send queue is full".into()));
        }
    };
    socket.close(&hub);
    if let Some((code, reason)) = close {
        let _ = sink
            .send(WsMessage::Close(Some(CloseFrame {
                code,
                reason: reason.into(),
            })))
            .await;
    }
}
