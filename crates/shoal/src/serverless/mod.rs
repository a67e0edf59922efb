//! The serverless front door (`[serverless]`): serverless and edge functions cannot hold
//! TCP connections, so Neon's serverless driver carries the PostgreSQL protocol over a
//! WebSocket. Each WebSocket here becomes one client connection, handed to the same login,
//! routing and pools as a TCP client (tenants, authentication, limits, rules, cache):
//! binary frames in are the client's bytes, the session's bytes go out as binary frames.
//!
//! The WebSocket runs on the control runtime (axum); the session runs on a data-plane
//! shard, reached through an in-memory pipe. Any path is accepted (the driver asks for
//! `/v2`; `neonConfig.wsProxy` lets a user choose another).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, State};
use axum::response::Response;
use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::app::App;
use crate::net::Stream;

/// Bytes the pipe between a WebSocket and its session buffers each way.
const PIPE: usize = 64 * 1024;

struct Door {
    app: Arc<App>,
    max_message: usize,
    /// Round robin over the data plane's shards.
    next_shard: AtomicUsize,
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
    let listener = match inherited {
        Some(l) => l,
        None => tokio::net::TcpListener::bind(section.listen)
            .await
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "cannot listen on {} (serverless.listen): {e}",
                        section.listen
                    ),
                )
            })?,
    };
    let addr = listener.local_addr()?;
    let fd = listener.as_raw_fd();
    let door = Arc::new(Door {
        app: app.clone(),
        max_message: section.max_message_size,
        next_shard: AtomicUsize::new(0),
    });
    let router = axum::Router::new()
        .fallback(axum::routing::get(upgrade))
        .with_state(door);
    tracing::info!(%addr, "serverless front door listening (PostgreSQL over WebSocket)");
    tokio::spawn(async move {
        let service = router.into_make_service_with_connect_info::<SocketAddr>();
        if let Err(e) = axum::serve(listener, service).await {
            tracing::error!(error = %e, "serverless front door stopped");
        }
    });
    Ok(Some((addr, fd)))
}

async fn upgrade(
    State(door): State<Arc<Door>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    ws: WebSocketUpgrade,
) -> Response {
    ws.max_message_size(door.max_message)
        .max_frame_size(door.max_message)
        .on_upgrade(move |socket| bridge(door, socket, peer))
}

/// Carries one WebSocket's bytes to and from its session until either side ends.
async fn bridge(door: Arc<Door>, socket: WebSocket, peer: SocketAddr) {
    let (ours, theirs) = tokio::io::duplex(PIPE);
    let session = crate::session::serve(
        door.app.clone(),
        Stream::Buffered(Box::new(theirs)),
        Some(peer),
    );
    let shards = crate::shard::open().clamp(1, crate::shard::count());
    let shard = door.next_shard.fetch_add(1, Ordering::Relaxed) % shards;
    match crate::shard::handle(shard) {
        Some(h) => drop(h.spawn(session)),
        None => drop(tokio::spawn(session)),
    }
    let (mut from_session, mut to_session) = tokio::io::split(ours);
    let (mut sink, mut source) = socket.split();
    let inbound = async {
        while let Some(Ok(m)) = source.next().await {
            match m {
                Message::Binary(b) => {
                    if to_session.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                // The driver sends only binary frames; pings are answered by the library.
                Message::Text(_) | Message::Ping(_) | Message::Pong(_) => {}
            }
        }
        // The client is gone: the session reads the end of its stream.
        let _ = to_session.shutdown().await;
    };
    let outbound = async {
        let mut buf = BytesMut::with_capacity(16 * 1024);
        loop {
            buf.reserve(16 * 1024);
            match from_session.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let frame = buf.split().freeze();
                    if sink.send(Message::Binary(frame)).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = sink.send(Message::Close(None)).await;
    };
    tokio::select! {
        _ = inbound => {}
        _ = outbound => {}
    }
}
