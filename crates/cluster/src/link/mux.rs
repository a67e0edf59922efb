//! Many clients' byte streams over one node-to-node connection.
//!
//! A [`Link`] is shared by the task that drives its socket ([`drive`]) and the
//! [`LinkStream`]s of the clients using it, all on one thread in the pooler (a link belongs
//! to a data-plane shard), so its one lock is uncontended. Writing a stream appends a frame
//! to the link's outgoing buffer and wakes the driver; the driver writes whatever all streams
//! queued in as few system calls as the socket takes, and reads the peer's frames into each
//! stream's inbox.
//!
//! Flow control is per stream and per direction: a sender may have at most [`WINDOW`] bytes
//! that the receiving stream's reader has not consumed; the receiver returns credit as its
//! reader consumes. So a client that stops reading stalls only its own stream, never the
//! link, and a link's buffers are bounded by its streams' windows. An idle stream holds no
//! buffer.
//!
//! No timers here (the data plane's runtimes have none): liveness is probed from outside with
//! [`Link::ping`] and [`Link::silent_for`], and a dead link is ended with [`Link::kill`].

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use super::frame::{self, Kind, HEADER, MAX_PAYLOAD};
pub use super::stream::LinkStream;

/// Unconsumed bytes a stream may have in flight in each direction.
pub const WINDOW: usize = 256 * 1024;
/// Credit is returned once a reader has consumed this much (fewer, larger Credit frames).
pub(super) const CREDIT_BATCH: usize = WINDOW / 4;
/// An inbox emptied with more capacity than this gives it back: a stream between small
/// replies reuses its inbox, and a large result's buffer is not kept. (An idle relayed
/// client is parked after a while, and then has no stream at all.)
pub(super) const KEEP_INBOX: usize = 2 * 1024;
/// Largest state snapshot a stream carries.
pub const MAX_STATE: usize = 16 << 20;

/// Which end of the connection this is: the two ends number the streams they open apart
/// (odd and even), so both may open streams without agreeing first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Connector,
    Acceptor,
}

/// What the peer asks of this node.
pub enum Incoming {
    /// A stream the peer opened, with what it said it is for.
    Stream(LinkStream, Bytes),
    /// A client's cancel request (process id, secret) for this node's registry.
    Cancel(i32, i32),
}

#[derive(Default)]
pub(super) struct Slot {
    pub(super) inbox: BytesMut,
    pub(super) reader: Option<Waker>,
    pub(super) writer: Option<Waker>,
    /// Bytes this side may still send.
    pub(super) send_credit: usize,
    /// Bytes read by this side's reader not yet credited back.
    pub(super) consumed: usize,
    /// The peer sent Close (its reason, if any).
    pub(super) peer_closed: Option<Box<str>>,
    /// This side sent Close (a shutdown); the slot stays until the stream is dropped.
    pub(super) local_closed: bool,
    /// The peer's state snapshot being received, and the last one complete.
    pub(super) state_partial: Option<BytesMut>,
    pub(super) state: Option<Bytes>,
    /// A snapshot arrived that the stream's reader has not been woken for yet.
    pub(super) state_fresh: bool,
}

pub(super) struct State {
    /// Frames waiting for the driver.
    pub(super) out: BytesMut,
    pub(super) writer: Option<Waker>,
    pub(super) streams: HashMap<u32, Slot>,
    next_id: u32,
    /// Why the link ended, once it has.
    pub(super) dead: Option<Arc<str>>,
    incoming: Option<mpsc::UnboundedSender<Incoming>>,
    ping_sent: Option<Instant>,
    last_pong: Instant,
    /// When the peer's bytes were last seen arriving (a sign of life as good as a Pong: a
    /// peer busy answering its clients may be slow to answer a probe), and `bytes_in` then.
    /// Noted by [`Link::silent_for`], once a probe period, not per read.
    last_heard: Instant,
    heard_bytes: u64,
    /// The peer's status word from its last Pong.
    peer_status: Option<u64>,
    /// `Shared::turns` when [`Link::silent_for`] last looked.
    turns_seen: u64,
    /// Since when [`Link::quiet_for`] has seen no bytes from the peer, and `bytes_in` then.
    quiet_since: Instant,
    quiet_bytes: u64,
}

struct Shared {
    state: Mutex<State>,
    peer: String,
    side: Side,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Last measured round trip, in microseconds.
    rtt_us: AtomicU64,
    /// This node's status word, sent in each Pong (its meaning is the caller's).
    status: Arc<AtomicU64>,
    /// Turns the driver has taken: when it took none between two probes, this side was not
    /// running, and the peer's answers may be waiting unread (see [`Link::silent_for`]).
    turns: AtomicU64,
}

/// A handle on one node link (cheap to clone).
#[derive(Clone)]
pub struct Link {
    shared: Arc<Shared>,
}

pub(super) fn wake(w: &mut Option<Waker>) {
    if let Some(w) = w.take() {
        w.wake();
    }
}

pub(super) fn park(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

pub(super) fn lost(reason: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!("node link lost: {reason}"),
    )
}

impl State {
    pub(super) fn queue(&mut self, kind: Kind, stream: u32, payload: &[u8]) {
        frame::put_frame(&mut self.out, kind, stream, payload);
        wake(&mut self.writer);
    }

    fn end(&mut self, reason: &str) {
        if self.dead.is_some() {
            return;
        }
        self.dead = Some(reason.into());
        self.out = BytesMut::new();
        self.incoming = None;
        for s in self.streams.values_mut() {
            wake(&mut s.reader);
            wake(&mut s.writer);
        }
        wake(&mut self.writer);
    }
}

impl Link {
    /// A link over a connection whose handshake is done; `drive` must then run it. Streams
    /// the peer opens, and its cancel requests, arrive on the receiver. `status` is this
    /// node's status word, read whenever the peer probes the link.
    pub fn new(
        peer: String,
        side: Side,
        status: Arc<AtomicU64>,
    ) -> (Link, mpsc::UnboundedReceiver<Incoming>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let link = Link {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    out: BytesMut::new(),
                    writer: None,
                    streams: HashMap::new(),
                    next_id: match side {
                        Side::Connector => 1,
                        Side::Acceptor => 2,
                    },
                    dead: None,
                    incoming: Some(tx),
                    ping_sent: None,
                    last_pong: Instant::now(),
                    last_heard: Instant::now(),
                    heard_bytes: 0,
                    peer_status: None,
                    turns_seen: 0,
                    quiet_since: Instant::now(),
                    quiet_bytes: 0,
                }),
                peer,
                side,
                bytes_in: AtomicU64::new(0),
                bytes_out: AtomicU64::new(0),
                rtt_us: AtomicU64::new(0),
                status,
                turns: AtomicU64::new(0),
            }),
        };
        (link, rx)
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The node at the other end.
    pub fn peer(&self) -> &str {
        &self.shared.peer
    }

    /// Opens a stream; `what` tells the peer what it is for.
    pub fn open(&self, what: &[u8]) -> io::Result<LinkStream> {
        if what.len() > MAX_PAYLOAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "stream opening too long",
            ));
        }
        let mut s = self.lock();
        if let Some(r) = &s.dead {
            return Err(lost(r));
        }
        let mut id = s.next_id;
        while s.streams.contains_key(&id) {
            id = id.wrapping_add(2);
        }
        s.next_id = id.wrapping_add(2);
        s.streams.insert(
            id,
            Slot {
                send_credit: WINDOW,
                ..Slot::default()
            },
        );
        s.queue(Kind::Open, id, what);
        Ok(LinkStream::new(self.clone(), id))
    }

    /// Passes a client's cancel request to the peer.
    pub fn cancel(&self, process_id: i32, secret: i32) -> io::Result<()> {
        let mut s = self.lock();
        if let Some(r) = &s.dead {
            return Err(lost(r));
        }
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&process_id.to_be_bytes());
        p[4..].copy_from_slice(&secret.to_be_bytes());
        s.queue(Kind::Cancel, 0, &p);
        Ok(())
    }

    /// Sends a probe unless one is out; its answer updates [`Link::rtt`]. With one out, the
    /// driver is woken all the same: a turn it takes says this side runs (see
    /// [`Link::silent_for`]).
    pub fn ping(&self) {
        let mut s = self.lock();
        if s.dead.is_some() {
            return;
        }
        if s.ping_sent.is_some() {
            wake(&mut s.writer);
            return;
        }
        s.ping_sent = Some(Instant::now());
        s.queue(Kind::Ping, 0, &[0; 8]);
    }

    /// How long the peer has been silent while a probe waits for its answer: since its last
    /// answer or its last bytes, whichever came later (zero with no probe out). Meant to be
    /// asked once per probe, after [`Link::ping`] woke the driver: if the driver took no
    /// turn since the last time it was asked, this side is the one not running (a starved
    /// thread: the answer may be unread in the socket), and the peer is not blamed for it.
    pub fn silent_for(&self) -> std::time::Duration {
        let mut s = self.lock();
        let bytes_in = self.shared.bytes_in.load(Ordering::Relaxed);
        let turns = self.shared.turns.load(Ordering::Relaxed);
        if bytes_in != s.heard_bytes || turns == s.turns_seen {
            s.heard_bytes = bytes_in;
            s.last_heard = Instant::now();
        }
        s.turns_seen = turns;
        match s.ping_sent {
            Some(_) => s.last_pong.max(s.last_heard).elapsed(),
            None => std::time::Duration::ZERO,
        }
    }

    /// How long no bytes have come from the peer, as far as the calls to this tell (it
    /// notes the bytes received at each call, so its resolution is the time between them).
    /// Unlike [`Link::silent_for`] it needs no probe out: the end of a link that the peer
    /// probes hears from the peer regularly, and need not probe it too unless it stops.
    pub fn quiet_for(&self) -> std::time::Duration {
        let mut s = self.lock();
        let bytes_in = self.shared.bytes_in.load(Ordering::Relaxed);
        if bytes_in != s.quiet_bytes {
            s.quiet_bytes = bytes_in;
            s.quiet_since = Instant::now();
        }
        s.quiet_since.elapsed()
    }

    /// Whether this end opened the link.
    pub fn side(&self) -> Side {
        self.shared.side
    }

    /// The peer's status word as of its last answer to a probe, and when that came.
    pub fn peer_status(&self) -> Option<(u64, Instant)> {
        let s = self.lock();
        s.peer_status.map(|v| (v, s.last_pong))
    }

    /// The last measured round trip.
    pub fn rtt(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.shared.rtt_us.load(Ordering::Relaxed))
    }

    /// Bytes received and sent (frames included).
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.shared.bytes_in.load(Ordering::Relaxed),
            self.shared.bytes_out.load(Ordering::Relaxed),
        )
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.lock().streams.len()
    }

    /// Why the link ended, if it has.
    pub fn dead(&self) -> Option<Arc<str>> {
        self.lock().dead.clone()
    }

    /// Ends the link: every stream fails, the driver returns and the connection closes.
    pub fn kill(&self, reason: &str) {
        self.lock().end(reason);
    }

    /// Handles a batch of frames read from the peer; an error ends the link.
    fn receive(&self, buf: &mut BytesMut) -> Result<(), String> {
        let mut s = self.lock();
        while let Some(h) = frame::parse_header(buf).map_err(|e| e.to_string())? {
            if buf.len() < HEADER + h.len {
                buf.reserve(HEADER + h.len - buf.len());
                break;
            }
            buf.advance(HEADER);
            let payload = &buf[..h.len];
            self.dispatch(&mut s, h.kind, h.stream, payload)?;
            buf.advance(h.len);
        }
        Ok(())
    }

    fn dispatch(&self, s: &mut State, kind: Kind, id: u32, payload: &[u8]) -> Result<(), String> {
        match kind {
            Kind::Open => {
                let theirs = match self.shared.side {
                    Side::Connector => id.is_multiple_of(2),
                    Side::Acceptor => !id.is_multiple_of(2),
                };
                if !theirs || s.streams.contains_key(&id) {
                    return Err(format!("the peer opened stream {id}, which it may not"));
                }
                s.streams.insert(
                    id,
                    Slot {
                        send_credit: WINDOW,
                        ..Slot::default()
                    },
                );
                let stream = LinkStream::new(self.clone(), id);
                let what = Bytes::copy_from_slice(payload);
                if let Some(tx) = &s.incoming {
                    // Refused only while the link shuts down; the stream then just ends.
                    let _ = tx.send(Incoming::Stream(stream, what));
                }
            }
            Kind::Data => {
                // Data after this side dropped the stream is not wanted any more.
                if let Some(slot) = s.streams.get_mut(&id) {
                    if slot.inbox.len() + payload.len() > WINDOW {
                        return Err(format!("the peer overran stream {id}'s window"));
                    }
                    slot.inbox.extend_from_slice(payload);
                    wake(&mut slot.reader);
                }
            }
            Kind::Credit => {
                if let Some(slot) = s.streams.get_mut(&id) {
                    let n = u32::from_be_bytes(payload.try_into().expect("checked length"));
                    slot.send_credit = (slot.send_credit + n as usize).min(WINDOW);
                    wake(&mut slot.writer);
                }
            }
            Kind::Close => {
                if let Some(slot) = s.streams.get_mut(&id) {
                    let why = String::from_utf8_lossy(payload);
                    slot.peer_closed = Some(why.into());
                    wake(&mut slot.reader);
                    wake(&mut slot.writer);
                }
            }
            Kind::Cancel => {
                let pid = i32::from_be_bytes(payload[..4].try_into().expect("checked length"));
                let key = i32::from_be_bytes(payload[4..].try_into().expect("checked length"));
                if let Some(tx) = &s.incoming {
                    let _ = tx.send(Incoming::Cancel(pid, key));
                }
            }
            Kind::State => {
                if let Some(slot) = s.streams.get_mut(&id) {
                    let part = slot.state_partial.get_or_insert_with(BytesMut::new);
                    if part.len() + payload.len() > MAX_STATE {
                        return Err(format!("the peer sent stream {id} too large a state"));
                    }
                    part.extend_from_slice(&payload[1..]);
                    if payload[0] & frame::STATE_LAST != 0 {
                        slot.state = slot.state_partial.take().map(BytesMut::freeze);
                        // Whoever waits for the stream may be waiting for this.
                        slot.state_fresh = true;
                        wake(&mut slot.reader);
                    }
                }
            }
            Kind::Ping => {
                let status = self.shared.status.load(Ordering::Relaxed).to_be_bytes();
                s.queue(Kind::Pong, 0, &status);
            }
            Kind::Pong => {
                if let Some(sent) = s.ping_sent.take() {
                    let rtt = sent.elapsed().as_micros().min(u64::MAX as u128) as u64;
                    self.shared.rtt_us.store(rtt, Ordering::Relaxed);
                }
                s.last_pong = Instant::now();
                s.peer_status = Some(u64::from_be_bytes(
                    payload.try_into().expect("checked length"),
                ));
            }
        }
        Ok(())
    }
}

/// Runs the link over `io` until either side ends it; returns why it ended. Every stream
/// of the link fails then.
pub async fn drive<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, link: Link) -> Arc<str> {
    let mut rbuf = BytesMut::with_capacity(MAX_PAYLOAD + HEADER);
    let mut wbuf = BytesMut::new();
    let reason: String =
        std::future::poll_fn(
            |cx| match poll_turn(&mut io, &link, &mut rbuf, &mut wbuf, cx) {
                Poll::Ready(r) => Poll::Ready(r),
                Poll::Pending => Poll::Pending,
            },
        )
        .await;
    let mut s = link.lock();
    s.end(&reason);
    s.dead.clone().expect("just ended")
}

/// One turn of the driver: reads what the peer sent, writes what the streams queued.
fn poll_turn<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    link: &Link,
    rbuf: &mut BytesMut,
    wbuf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<String> {
    link.shared.turns.fetch_add(1, Ordering::Relaxed);
    loop {
        if let Some(r) = &link.lock().dead {
            return Poll::Ready(r.to_string());
        }
        let mut progress = false;
        if rbuf.capacity() - rbuf.len() < HEADER {
            rbuf.reserve(MAX_PAYLOAD + HEADER);
        }
        match tokio_util::io::poll_read_buf(Pin::new(&mut *io), cx, rbuf) {
            Poll::Ready(Ok(0)) => return Poll::Ready("the peer closed the connection".into()),
            Poll::Ready(Ok(n)) => {
                link.shared.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                if let Err(e) = link.receive(rbuf) {
                    return Poll::Ready(e);
                }
                progress = true;
            }
            Poll::Ready(Err(e)) => return Poll::Ready(e.to_string()),
            Poll::Pending => {}
        }
        if wbuf.is_empty() {
            let mut s = link.lock();
            if s.out.is_empty() {
                park(&mut s.writer, cx);
            } else {
                std::mem::swap(&mut s.out, wbuf);
            }
        }
        while !wbuf.is_empty() {
            match Pin::new(&mut *io).poll_write(cx, wbuf) {
                Poll::Ready(Ok(0)) => return Poll::Ready("the connection took no bytes".into()),
                Poll::Ready(Ok(n)) => {
                    link.shared.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                    wbuf.advance(n);
                    progress = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(e.to_string()),
                Poll::Pending => break,
            }
        }
        if wbuf.is_empty() && wbuf.capacity() > 4 * (MAX_PAYLOAD + HEADER) {
            *wbuf = BytesMut::new();
        }
        if let Poll::Ready(Err(e)) = Pin::new(&mut *io).poll_flush(cx) {
            return Poll::Ready(e.to_string());
        }
        if !progress {
            return Poll::Pending;
        }
    }
}
