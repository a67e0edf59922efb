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

mod gate;

/// Bytes the pipe between a WebSocket and its session buffers each way.
const PIPE: usize = 64 * 1024;

struct Door {
    app: Arc<App>,
    max_message: usize,
    /// Ask for passwords in cleartext (see `[serverless] cleartext_password`).
    cleartext_password: bool,
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
    let listener =
        crate::listener::bind_or_inherit(inherited, section.listen, "serverless.listen").await?;
    let addr = listener.local_addr()?;
    let fd = listener.as_raw_fd();
    let door = Arc::new(Door {
        app: app.clone(),
        max_message: section.max_message_size,
        cleartext_password: section.cleartext_password,
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
        Stream::WebSocket(Box::new(theirs)),
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
    // While the login runs, the client's bytes wait in the gate (pipelined connect).
    let gated = door.cleartext_password;
    let gate = std::sync::Mutex::new(gated.then(|| (gate::Gate::default(), BytesMut::new())));
    let answered = tokio::sync::Notify::new();
    // What may go to the session now (`None`: the login is done, all of `bytes`).
    let pass = |bytes: &[u8]| -> Option<BytesMut> {
        let mut g = gate.lock().unwrap_or_else(|e| e.into_inner());
        let (gate, held) = g.as_mut()?;
        held.extend_from_slice(bytes);
        let mut to = BytesMut::new();
        gate::release(gate, held, &mut to);
        if gate.is_open() && held.is_empty() {
            *g = None;
        }
        Some(to)
    };
    let inbound = async {
        loop {
            let written = tokio::select! {
                m = source.next() => match m {
                    Some(Ok(Message::Binary(b))) => match pass(&b) {
                        None => to_session.write_all(&b).await,
                        Some(held_back) => to_session.write_all(&held_back).await,
                    },
                    // The driver sends only binary frames; pings are answered by the library.
                    Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                },
                _ = answered.notified() => match pass(&[]) {
                    Some(released) => to_session.write_all(&released).await,
                    None => continue,
                },
            };
            if written.is_err() {
                break;
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
                    if let Some((gate, held)) =
                        gate.lock().unwrap_or_else(|e| e.into_inner()).as_mut()
                    {
                        let dropped = gate.answered(&buf, held);
                        let _ = held.split_to(dropped);
                        answered.notify_one();
                    }
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
