//! The serverless front door (`[serverless]`): serverless and edge functions cannot hold
//! TCP connections, so Neon's serverless driver reaches PostgreSQL over a WebSocket
//! carrying the protocol (`Pool`, `Client`: see `websocket`) or over HTTP (`neon()`,
//! `transaction()`: `POST /sql`, see `http`). Either way each connection or request
//! becomes one client of the same login, routing and pools as a TCP client (tenants,
//! authentication, limits, rules, cache).
//!
//! HTTP and WebSockets run on the control runtime (axum); each session runs on a
//! data-plane shard, reached through an in-memory pipe. A WebSocket may use any path (the
//! driver asks for `/v2`; `neonConfig.wsProxy` lets a user choose another).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::DuplexStream;

use crate::app::App;
use crate::net::Stream;

mod gate;
mod http;
mod listener;
mod websocket;

pub use http::STATUSES as HTTP_STATUSES;

/// Bytes the pipe between a WebSocket and its session buffers each way.
const PIPE: usize = 64 * 1024;

struct Door {
    app: Arc<App>,
    max_message: usize,
    /// Ask for passwords in cleartext (see `[serverless] cleartext_password`).
    cleartext_password: bool,
    max_request: usize,
    max_response: usize,
    /// Seconds.
    request_timeout: f64,
    /// Round robin over the data plane's shards.
    next_shard: AtomicUsize,
    /// Sessions HTTP queries left clean, for the next query with the same credentials.
    warm: Arc<http::Warm>,
}

/// Serves `[serverless] listen` (or the socket a previous process handed over). Returns
/// its address and descriptor.
pub async fn start(
    app: &Arc<App>,
    inherited: Option<tokio::net::TcpListener>,
) -> std::io::Result<Option<(SocketAddr, std::os::fd::RawFd)>> {
    use std::os::fd::AsRawFd;
    let Some(section) = app.config.serverless.clone() else {
        return Ok(None);
    };
    let listener =
        crate::listener::bind_or_inherit(inherited, section.listen, "serverless.listen").await?;
    let addr = listener.local_addr()?;
    let fd = listener.as_raw_fd();
    let door = Arc::new(Door {
        app: app.clone(),
        max_message: section.max_message_size,
        cleartext_password: section.cleartext_password,
        max_request: section.max_request_size,
        max_response: section.max_response_size,
        request_timeout: section.request_timeout,
        next_shard: AtomicUsize::new(0),
        warm: Arc::new(http::Warm::default()),
    });
    let _ = app.admission.spare.set(door.warm.clone());
    let sweeping = Arc::downgrade(&door);
    tokio::spawn(async move {
        let mut every = crate::timer::interval(std::time::Duration::from_secs(2));
        loop {
            every.tick().await;
            match sweeping.upgrade() {
                Some(door) => door.warm.sweep(),
                None => return,
            }
        }
    });
    let router = axum::Router::new()
        .route(
            "/sql",
            axum::routing::post(http::query).get(websocket::upgrade),
        )
        .fallback(axum::routing::get(websocket::upgrade))
        .with_state(door);
    let tls = app.tls.serves_web();
    tracing::info!(%addr, tls, "serverless front door listening (PostgreSQL over WebSocket and HTTP)");
    if !tls && !addr.ip().is_loopback() {
        tracing::warn!(%addr, "the serverless front door takes passwords in plain text: without a certificate in [tls], keep it behind a TLS-terminating proxy");
    }
    let door_listener = listener::start(app.clone(), listener, section.accept_plain)?;
    tokio::spawn(async move {
        let service = router.into_make_service_with_connect_info::<listener::Peer>();
        if let Err(e) = axum::serve(door_listener, service).await {
            tracing::error!(error = %e, "serverless front door stopped");
        }
    });
    Ok(Some((addr, fd)))
}

impl Door {
    /// Starts a session on a data-plane shard (round robin over the open ones) whose
    /// client is the other end of the returned pipe, made a `Stream` by `stream`.
    fn start_session(
        &self,
        stream: impl FnOnce(DuplexStream) -> Stream,
        peer: SocketAddr,
    ) -> DuplexStream {
        let (ours, theirs) = tokio::io::duplex(PIPE);
        let session = crate::session::serve(self.app.clone(), stream(theirs), Some(peer));
        let shards = &self.app.shards;
        let shard = shards.round_robin(self.next_shard.fetch_add(1, Ordering::Relaxed));
        match shards.handle(shard) {
            Some(h) => drop(h.spawn(session)),
            None => drop(tokio::spawn(session)),
        }
        ours
    }
}
