//! Sessions a client comes back to. A socket that connected with `resume=<id>` (an id the
//! client chose: 16 to 128 letters, digits, `-` or `_`) and then lost its connection
//! without a close is kept for the tenant's resume window: its channels stay subscribed,
//! and whatever they get — broadcasts (from clients, HTTP and the database), presence,
//! Postgres Changes — waits in its queue. A new connection to the same tenant, with a token
//! for the same role and subject, naming the same id takes all of it over: the queue is
//! written first, and the client's re-joins of the channels it had are answered without
//! ending their subscriptions (see [`crate::socket::Socket::resumed`]). So a client that
//! drops for a few seconds misses nothing and sees nothing twice, and the others see no
//! presence leave and join. A connection whose loss was not noticed yet (no heartbeat
//! timeout so far) is taken over the same way.
//!
//! What was written to the lost connection may not have been read. While frames wait to
//! be acknowledged, WebSocket pings (which a client's WebSocket layer answers only after
//! taking every frame before them) tell what was read; the frames written since are kept
//! ([`Ring`]) and written again, first, to the connection that comes back. So nothing is
//! missed; the few frames in flight at the loss may come twice.
//!
//! Nothing is kept past the window, past a full queue (the session then ends as a slow
//! socket's does), past [`RING`] frames not known to be read, when the tenant's sockets
//! end, or when the client closed the socket itself: a goodbye means it is not coming
//! back.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::edge::Seat;
use crate::hub::{Frame, Outbox};
use crate::jwt::Claims;
use crate::protocol::Vsn;
use crate::socket::Socket;

/// How long a new connection waits for the holder of its session to hand it over.
const HANDOVER: Duration = Duration::from_secs(2);

/// Frames written but not known to be read that a session keeps; past it, the session
/// can no longer be resumed without a gap, and is not.
pub const RING: usize = 4096;

/// Everything a session needs to go on: its protocol state and channels, the frames
/// written but not known to be read, its queue, and its seat among the tenant's
/// connected users.
pub(crate) struct Kept {
    pub socket: Socket,
    pub unread: VecDeque<Frame>,
    pub queue: mpsc::Receiver<Frame>,
    pub out: Outbox,
    pub seat: Seat,
}

/// The frames a resumable session wrote that the client may not have read, in order. A
/// WebSocket ping carrying the number of the next frame is sent while frames are
/// unacknowledged (one at a time): the client's WebSocket layer answers it with a pong only
/// after taking every frame before it. (A client's Phoenix heartbeats would say less, and
/// only of clients that stop sending them while one is unanswered, as not all do.)
#[derive(Default)]
pub(crate) struct Ring {
    frames: VecDeque<Frame>,
    /// The number of the first frame in `frames`, and of the next one written.
    first: u64,
    next: u64,
    /// The ping sent and not answered yet (the frame number it carries).
    ping: Option<u64>,
}

impl Ring {
    /// A ping to send now, if frames wait to be acknowledged and none is out: its payload.
    pub fn ping(&mut self) -> Option<bytes::Bytes> {
        if self.ping.is_some() || self.frames.is_empty() {
            return None;
        }
        self.ping = Some(self.next);
        Some(bytes::Bytes::copy_from_slice(&self.next.to_be_bytes()))
    }

    /// A pong came back with `payload`: the frames before the number it carries are read.
    pub fn pong(&mut self, payload: &[u8]) {
        let Ok(n) = <[u8; 8]>::try_from(payload).map(u64::from_be_bytes) else {
            return;
        };
        if self.ping != Some(n) {
            return;
        }
        self.ping = None;
        self.read_before(n);
    }

    fn read_before(&mut self, n: u64) {
        while self.first < n && self.frames.pop_front().is_some() {
            self.first += 1;
        }
        if self.frames.is_empty() {
            // An idle socket holds no buffer.
            self.frames.shrink_to_fit();
        }
    }

    /// `f` is being written; false when the ring is full (the session can no longer be
    /// resumed without a gap).
    pub fn written(&mut self, f: &Frame) -> bool {
        self.frames.push_back(f.clone());
        self.next += 1;
        self.frames.len() <= RING
    }

    pub fn unread(self) -> VecDeque<Frame> {
        self.frames
    }
}

impl Kept {
    /// The session ends for good: its channels are left, its presences go, its seat frees.
    pub fn end(mut self) {
        let hub = self.seat.hub().clone();
        self.socket.close(&hub);
    }
}

/// Who may take a session over: a connection with a token of the same role and subject,
/// speaking the same protocol version (what waits is written in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    role: String,
    sub: Option<String>,
    vsn: Vsn,
}

impl Owner {
    pub fn of(claims: &Claims, vsn: Vsn) -> Owner {
        Owner {
            role: claims.role.clone(),
            sub: claims.all.get("sub").map(|s| s.to_string()),
            vsn,
        }
    }
}

/// Whether a client's `resume` id may name a session.
pub(crate) fn valid_id(id: &str) -> bool {
    (16..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A request for a session: where to hand it.
pub(crate) type Request = oneshot::Sender<Kept>;

/// Where to send a request for a session.
pub(crate) type Sender = mpsc::Sender<Request>;

struct Holder {
    owner: Owner,
    generation: u64,
    requests: Sender,
}

/// Who holds each resumable session now (a connection, or a parked session waiting).
#[derive(Default)]
pub(crate) struct Sessions {
    held: Mutex<HashMap<(String, String), Holder>>,
    next: AtomicU64,
}

/// A holder's registration: requests for the session come on `requests`.
pub(crate) struct Held {
    key: (String, String),
    generation: u64,
    pub requests: mpsc::Receiver<Request>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Holder>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where to ask for session `id` of `tenant` (`None`: nobody holds it), or `Err` when
    /// it is another owner's.
    pub fn holder(&self, tenant: &str, id: &str, owner: &Owner) -> Result<Option<Sender>, ()> {
        let held = self.lock();
        match held.get(&(tenant.to_owned(), id.to_owned())) {
            None => Ok(None),
            Some(h) if h.owner == *owner => Ok(Some(h.requests.clone())),
            Some(_) => Err(()),
        }
    }

    /// Makes the caller the holder of session `id` of `tenant` (in place of any other,
    /// whose requests then stop coming).
    pub fn hold(&self, tenant: &str, id: &str, owner: Owner) -> Held {
        let key = (tenant.to_owned(), id.to_owned());
        let generation = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(1);
        self.lock().insert(
            key.clone(),
            Holder {
                owner,
                generation,
                requests: tx,
            },
        );
        Held {
            key,
            generation,
            requests: rx,
        }
    }

    /// `held` lets go, unless another holder has taken its place.
    pub fn release(&self, held: &Held) {
        let mut map = self.lock();
        if map
            .get(&held.key)
            .is_some_and(|h| h.generation == held.generation)
        {
            map.remove(&held.key);
        }
    }

    /// Asks `holder` for its session; `None` when it ended or did not answer in time.
    pub async fn take(holder: Sender) -> Option<Kept> {
        let (tx, rx) = oneshot::channel();
        holder.send(tx).await.ok()?;
        tokio::time::timeout(HANDOVER, rx).await.ok()?.ok()
    }

    /// Keeps `kept`, whose connection was lost, for `window`: hands it to the first new
    /// connection that asks for it, or ends it when the window passes, its queue fills or
    /// the tenant's sockets end.
    pub fn park(self: &Arc<Sessions>, kept: Kept, mut held: Held, window: Duration) {
        let sessions = self.clone();
        tokio::spawn(async move {
            let mut ended = kept.seat.hub().ended();
            let request = tokio::select! {
                r = held.requests.recv() => r,
                () = tokio::time::sleep(window) => None,
                () = kept.out.slowed() => None,
                _ = ended.changed() => None,
            };
            sessions.release(&held);
            match request {
                Some(to) => {
                    if let Err(kept) = to.send(kept) {
                        kept.end();
                    }
                }
                None => kept.end(),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: u8) -> Frame {
        Frame::Binary(bytes::Bytes::from(vec![n]))
    }

    fn ring_of(r: &Ring) -> Vec<u8> {
        r.frames
            .iter()
            .map(|f| match f {
                Frame::Binary(b) => b[0],
                Frame::Text(_) => unreachable!(),
            })
            .collect()
    }

    #[test]
    fn a_pong_acknowledges_what_was_written_before_its_ping() {
        let mut r = Ring::default();
        assert_eq!(r.ping(), None, "nothing to acknowledge");
        assert!(r.written(&frame(1)) && r.written(&frame(2)));
        let p = r.ping().unwrap();
        assert_eq!(r.ping(), None, "one ping at a time");
        assert!(r.written(&frame(3)));
        r.pong(b"not eight");
        r.pong(&7u64.to_be_bytes());
        assert_eq!(ring_of(&r), [1, 2, 3], "a pong for no ping of ours");
        r.pong(&p);
        assert_eq!(ring_of(&r), [3]);
        let q = r.ping().unwrap();
        r.pong(&q);
        assert_eq!(ring_of(&r), Vec::<u8>::new());
    }

    #[test]
    fn a_full_ring_says_so() {
        let mut r = Ring::default();
        for _ in 0..RING {
            assert!(r.written(&frame(0)));
        }
        assert!(!r.written(&frame(0)));
    }

    #[test]
    fn resume_ids_are_checked() {
        assert!(valid_id("0123456789abcdef"));
        assert!(valid_id("6f1c2d3e-aaaa-bbbb-cccc-0123456789ab"));
        assert!(!valid_id("short"));
        assert!(!valid_id("0123456789abcdef/"));
        assert!(!valid_id(&"a".repeat(129)));
    }
}
