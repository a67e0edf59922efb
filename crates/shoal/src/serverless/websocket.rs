//! The WebSocket path: the driver's `Pool` and `Client` carry the PostgreSQL protocol in
//! binary frames. Frames in are the client's bytes, the session's bytes go out as binary
//! frames; while the login runs, pipelined messages wait in the gate.

use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, State};
use axum::response::Response;
use bytes::BytesMut;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::listener::Peer;
use super::{gate, Door};
use crate::net::Stream;

pub async fn upgrade(
    State(door): State<Arc<Door>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    ws: WebSocketUpgrade,
) -> Response {
    ws.max_message_size(door.max_message)
        .max_frame_size(door.max_message)
        .on_upgrade(move |socket| bridge(door, socket, peer))
}

/// Carries one WebSocket's bytes to and from its session until either side ends.
async fn bridge(door: Arc<Door>, socket: WebSocket, peer: Peer) {
    door.app.metrics.serverless.websocket();
    let ours = door.start_session(
        |theirs| Stream::WebSocket(Box::new(theirs), peer.tls),
        peer.addr,
    );
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
