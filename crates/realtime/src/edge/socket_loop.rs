//! One socket's loop while its connection lasts: frames from the client through its
//! [`crate::socket::Socket`], frames for it from its queue (or kept from its last
//! connection), heartbeats, the token's expiry, and how it ended.

use std::collections::VecDeque;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket};
use futures_util::{SinkExt, StreamExt};

use super::TOO_SLOW;
use crate::hub::{Ending, Frame};
use crate::resume::{Held, Kept, Ring, Sessions};

/// The instant the epoch second `exp` comes (far off for `None`).
fn instant_of(exp: Option<i64>) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    let Some(exp) = exp else {
        return now + Duration::from_secs(365 * 24 * 3600);
    };
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    now + Duration::from_secs(exp.max(0) as u64).saturating_sub(wall)
}

/// How a socket's loop ended: what to tell the client.
enum Goodbye {
    /// Nothing (the connection is gone).
    None,
    /// A close frame with this code and reason.
    Close(u16, String),
    /// The answer to the client's own close frame.
    Answer,
    /// Another connection asked for the session (the client came back to it).
    Handover(crate::resume::Request),
}

/// What became of a socket's session when its connection ended.
pub(super) enum Outcome {
    /// The connection was lost, and the session may be come back to.
    Lost(Kept, Held),
    /// The session is over.
    Over(Kept, Option<Held>),
    /// Another connection has it.
    HandedOver,
}

/// The next request for the session `held`, if it can be come back to (else never).
async fn requested(held: &mut Option<Held>) -> crate::resume::Request {
    match held {
        Some(h) => match h.requests.recv().await {
            Some(to) => to,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// The next frame to write: one the session kept from its last connection, else one
/// from its queue. (Cancel-safe: a kept frame is taken only when returned.)
async fn next_frame(
    kept: &mut VecDeque<Frame>,
    queue: &mut tokio::sync::mpsc::Receiver<Frame>,
) -> Option<Frame> {
    match kept.pop_front() {
        Some(f) => Some(f),
        None => queue.recv().await,
    }
}

pub(super) async fn run(
    ws: WebSocket,
    kept: Kept,
    mut held: Option<Held>,
    heartbeat: Duration,
    sessions: &Sessions,
) -> Outcome {
    let Kept {
        mut socket,
        unread: mut pending,
        mut queue,
        out,
        seat,
    } = kept;
    // Only a session that may be resumed keeps what it writes.
    let mut ring = held.as_ref().map(|_| Ring::default());
    let hub = seat.hub().clone();
    let mut ended = hub.ended();
    // A restart announced while this socket was being upgraded.
    let restarting = *ended.borrow() == Some(Ending::RESTART);
    let (mut sink, mut stream) = ws.split();
    // Two timers for the socket's life, moved only when their deadline does: a message
    // costs a clock read, not a timer registration.
    let mut last_heard = tokio::time::Instant::now();
    let silence = tokio::time::sleep(heartbeat);
    let mut expiry = socket.expiry();
    let expiring = tokio::time::sleep_until(instant_of(expiry));
    tokio::pin!(silence, expiring);
    let close = loop {
        if restarting {
            break Goodbye::Close(Ending::RESTART.code, Ending::RESTART.reason.into());
        }
        tokio::select! {
            incoming = stream.next() => {
                last_heard = tokio::time::Instant::now();
                let result = match incoming {
                    Some(Ok(WsMessage::Text(t))) => socket.on_text(&hub, t.as_str()),
                    Some(Ok(WsMessage::Binary(b))) => socket.on_binary(&hub, &b),
                    Some(Ok(WsMessage::Pong(b))) => {
                        if let Some(ring) = &mut ring {
                            ring.pong(&b);
                        }
                        Ok(())
                    }
                    Some(Ok(WsMessage::Ping(_))) => Ok(()),
                    // The client's goodbye is answered (below), as the protocol asks:
                    // without it a client sees 1006, an abnormal close.
                    Some(Ok(WsMessage::Close(_))) => break Goodbye::Answer,
                    None | Some(Err(_)) => break Goodbye::None,
                };
                if let Err(e) = result {
                    // 1003: unsupported data.
                    break Goodbye::Close(1003, e.to_string());
                }
            }
            frame = next_frame(&mut pending, &mut queue) => {
                let Some(frame) = frame else { break Goodbye::None };
                if ring.as_mut().is_some_and(|r| !r.written(&frame)) {
                    // Too much unread to come back to without a gap.
                    ring = None;
                    if let Some(h) = held.take() {
                        sessions.release(&h);
                    }
                }
                let m = match frame {
                    Frame::Text(t) => WsMessage::Text(t),
                    Frame::Binary(b) => WsMessage::Binary(b),
                };
                // A client that stops reading must not hold its task here for good.
                tokio::select! {
                    sent = sink.send(m) => if sent.is_err() { break Goodbye::None },
                    () = out.slowed() => break Goodbye::Close(1013, TOO_SLOW.into()),
                }
            }
            to = requested(&mut held) => break Goodbye::Handover(to),
            () = &mut expiring => socket.expire(&hub, crate::jwt::now()),
            _ = ended.changed() => {
                let why = (*ended.borrow()).unwrap_or(Ending::TENANT);
                break Goodbye::Close(why.code, why.reason.into());
            }
            () = &mut silence => {
                if last_heard.elapsed() >= heartbeat {
                    break Goodbye::Close(1000, format!("heartbeat timeout: nothing heard for {heartbeat:?}"));
                }
                silence.as_mut().reset(last_heard + heartbeat);
            }
        }
        if let Some(payload) = ring.as_mut().and_then(Ring::ping) {
            tokio::select! {
                sent = sink.send(WsMessage::Ping(payload)) => if sent.is_err() { break Goodbye::None },
                () = out.slowed() => break Goodbye::Close(1013, TOO_SLOW.into()),
            }
        }
        if socket.expiry() != expiry || expiring.is_elapsed() {
            expiry = socket.expiry();
            expiring.as_mut().reset(instant_of(expiry));
        }
        if out.is_slow() {
            // 1013: try again later.
            break Goodbye::Close(1013, TOO_SLOW.into());
        }
    };
    let mut unread = ring.map(Ring::unread).unwrap_or_default();
    unread.append(&mut pending);
    let kept = Kept {
        socket,
        unread,
        queue,
        out,
        seat,
    };
    // Best effort: a client that does not read gets no goodbye.
    let goodbye = Duration::from_secs(1);
    let frame = match close {
        Goodbye::None => {
            return match held {
                Some(held) => Outcome::Lost(kept, held),
                None => Outcome::Over(kept, None),
            }
        }
        Goodbye::Handover(to) => {
            if let Err(kept) = to.send(kept) {
                return Outcome::Over(kept, held);
            }
            WsMessage::Close(Some(CloseFrame {
                code: 1000,
                reason: "the session was resumed on another connection".into(),
            }))
        }
        // The WebSocket layer queued the answer to the client's close (its own code):
        // closing the sink writes it. The channels end first, as they always have.
        Goodbye::Answer => {
            let outcome = Outcome::Over(kept, held);
            let _ = tokio::time::timeout(goodbye, sink.close()).await;
            return outcome;
        }
        Goodbye::Close(code, reason) => {
            let frame = WsMessage::Close(Some(CloseFrame {
                code,
                reason: reason.into(),
            }));
            let outcome = Outcome::Over(kept, held);
            let _ = tokio::time::timeout(goodbye, sink.send(frame)).await;
            return outcome;
        }
    };
    let _ = tokio::time::timeout(goodbye, sink.send(frame)).await;
    Outcome::HandedOver
}
