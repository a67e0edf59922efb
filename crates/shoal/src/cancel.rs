//! Cancel keys: the BackendKeyData Shoal gives each client, and the routing of a client's
//! CancelRequest to the server connection running that client's query — only while it runs.
//!
//! Each client owns a [`CancelSlot`] naming its current server, if any. The session fills the
//! slot at checkout and empties it before returning the server to the pool. Forwarding a
//! cancel counts itself in the slot as in flight until PostgreSQL has closed the cancel
//! connection (it has then signalled the backend), and emptying the slot waits for in-flight
//! cancels. So a cancel can never be delivered to a server after that server moved on to
//! another client, while the common case (no cancel) costs one uncontended lock.

use std::collections::HashMap;

pub use crate::server::{forward, CancelTarget};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use subtle::ConstantTimeEq;

#[derive(Default)]
struct SlotState {
    target: Option<CancelTarget>,
    /// Capped: a client's cancels beyond it are not forwarded.
    in_flight: u16,
    /// The task of the client's query waiting for a server, once its wait was polled: a
    /// cancel ends the wait (see [`WaitCancelled`]).
    waker: Option<Waker>,
    /// The client's query is waiting for a server.
    waiting: bool,
    /// A cancel ended the wait.
    wait_cancelled: bool,
    /// The client has a request in progress that has no server yet (checkout done, session
    /// being prepared): a cancel is remembered, and the request is answered as cancelled
    /// instead of being sent (see [`CancelSlot::set`]).
    busy: bool,
    pending: bool,
    /// Changes with every server named and every answer the client is sent: a cancel is
    /// sent again only while it has not changed (see [`follow_up`]). 16 bits keep the slot
    /// in its size class; wrapping round within a recheck's wait is harmless.
    turn: u16,
}

/// Who a logged-in client is, for the admin console's `SHOW CLIENTS`.
#[derive(Debug, Clone, Default)]
pub struct ClientInfo {
    pub pool: std::sync::Weak<crate::pool::Pool>,
    pub addr: Option<PeerAddr>,
    /// [`crate::clock::now_ms`] at login.
    pub since_ms: u64,
}

/// A client's address as `SHOW CLIENTS` shows it: 20 bytes where a `SocketAddr` takes 32
/// (an IPv6 address's flow and scope ids are shown nowhere), which keeps [`CancelSlot`] in a
/// 128-byte allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr {
    ip: IpAddr,
    port: u16,
}

impl PeerAddr {
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(a: SocketAddr) -> Self {
        PeerAddr {
            ip: a.ip(),
            port: a.port(),
        }
    }
}

/// One client's cancel state. Kept small: every connected client has one.
pub struct CancelSlot {
    secret: i32,
    /// The key's process id (kept here, not in each session: an idle client's task is small).
    process_id: i32,
    state: Mutex<SlotState>,
    pub info: ClientInfo,
}

impl CancelSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The client's request is being served (until [`CancelSlot::clear`]).
    pub fn mark_busy(&self) {
        self.lock().busy = true;
    }

    /// `active` (holds a server), `waiting` (for one) or `idle`.
    pub fn state(&self) -> &'static str {
        let s = self.lock();
        if s.target.is_some() {
            "active"
        } else if s.waiting {
            "waiting"
        } else {
            "idle"
        }
    }

    /// The request ended without reaching a server: forget a cancel meant for it.
    pub fn not_busy(&self) {
        let mut s = self.lock();
        s.busy = false;
        s.pending = false;
    }

    /// Names the server about to run this client's request. Returns false, naming nothing,
    /// if a cancel for the request arrived while its server was being found: the caller
    /// then answers the request as cancelled without sending it. (Forwarding that cancel
    /// instead would race the request to the server: PostgreSQL ignores a cancel that finds
    /// its backend idle, and the query would run on.)
    #[must_use]
    pub fn set(&self, target: CancelTarget) -> bool {
        let mut s = self.lock();
        if std::mem::take(&mut s.pending) {
            // The request ends here: a later cancel is for the next one.
            s.busy = false;
            return false;
        }
        s.target = Some(target);
        s.turn = s.turn.wrapping_add(1);
        true
    }

    /// The client was sent a ReadyForQuery: a cancel forwarded before it is not sent again.
    /// (Its relay calls this once per batch of server bytes that held any.)
    pub fn note_answered(&self) {
        let mut s = self.lock();
        s.turn = s.turn.wrapping_add(1);
    }

    /// Forgets the server; returns once no cancel for it can still arrive. A cancel in
    /// flight is rare and brief (one loopback round trip to PostgreSQL), so waiting for it
    /// polls on a short timer rather than keeping a wait list in every client.
    pub async fn clear(&self) {
        while !self.clear_now() {
            crate::timer::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Forgets the server; `false` if a cancel for it may still arrive, which
    /// [`CancelSlot::clear`] then waits out. The common case, once per transaction, makes
    /// no future.
    pub fn clear_now(&self) -> bool {
        let mut s = self.lock();
        s.target = None;
        s.busy = false;
        s.pending = false;
        s.in_flight == 0
    }

    /// The client's query is about to wait for a server; [`WaitCancelled`] completes if a
    /// cancel arrives meanwhile. (Nothing is allocated: the wait is on the path of every
    /// query that finds the pool busy.)
    pub fn begin_wait(&self) -> WaitCancelled<'_> {
        let mut s = self.lock();
        s.waiting = true;
        s.wait_cancelled = false;
        WaitCancelled(self)
    }

    pub fn end_wait(&self) {
        let waker = {
            let mut s = self.lock();
            s.waiting = false;
            s.wait_cancelled = false;
            s.waker.take()
        };
        // Outside the lock: dropping a waker runs its runtime's code.
        drop(waker);
    }

    /// Counts a cancel in flight for as long as the returned guard lives, so that even a
    /// forward whose task is dropped midway (a login timeout) cannot leave the count up and
    /// [`CancelSlot::clear`] waiting forever.
    fn begin(&self) -> Option<(CancelTarget, u16, InFlight<'_>)> {
        let mut s = self.lock();
        let t = s.target?;
        s.in_flight = s.in_flight.checked_add(1)?;
        Some((t, s.turn, InFlight(self)))
    }

    /// [`CancelSlot::begin`], only while the slot is at `turn` still.
    fn begin_again(&self, turn: u16) -> Option<(CancelTarget, InFlight<'_>)> {
        let mut s = self.lock();
        let t = s.target.filter(|_| s.turn == turn)?;
        s.in_flight = s.in_flight.checked_add(1)?;
        Some((t, InFlight(self)))
    }
}

/// How long after a forwarded cancel (each) the request is looked at again, and cancelled
/// again if it still runs unanswered. A cancel PostgreSQL acted on is answered within the
/// first wait nearly always; the later ones cover a request that reached its server late
/// (a busy machine).
const RECHECK: [Duration; 4] = [
    Duration::from_millis(10),
    Duration::from_millis(40),
    Duration::from_millis(150),
    Duration::from_millis(400),
];

/// Sends a forwarded cancel again while its request runs unanswered: the slot still at the
/// `turn` it was at when the cancel came (the same server named, see [`CancelSlot::set`],
/// and no ReadyForQuery sent to the client since). PostgreSQL ignores a cancel that finds its
/// backend waiting for a message, which is where a request's backend is until its bytes
/// arrive: a cancel crossing a request that had just been given a server was lost (seen
/// with pgJDBC's query timeouts through a full pool). A cancel sent again can only stop
/// what the first was meant for: a later request of the client is either a new unit or
/// comes after an answer.
async fn follow_up(slot: Arc<CancelSlot>, turn: u16) -> u32 {
    let mut sent = 0;
    for wait in RECHECK {
        crate::timer::sleep(wait).await;
        let Some((target, in_flight)) = slot.begin_again(turn) else {
            break;
        };
        tracing::debug!(
            server_pid = target.process_id,
            "a cancelled request still runs unanswered: cancel sent again"
        );
        forward(target).await;
        drop(in_flight);
        sent += 1;
    }
    sent
}

/// Completes when a cancel ends the client's wait for a server (see
/// [`CancelSlot::begin_wait`]).
pub struct WaitCancelled<'a>(&'a CancelSlot);

impl std::future::Future for WaitCancelled<'_> {
    type Output = ();

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.0.lock();
        if s.wait_cancelled {
            return Poll::Ready(());
        }
        match &mut s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// One cancel in flight to a slot's server.
struct InFlight<'a>(&'a CancelSlot);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
    }
}

/// All live clients' cancel keys, by process id (unique among live clients).
#[derive(Default)]
pub struct CancelRegistry {
    by_pid: Mutex<HashMap<i32, Arc<CancelSlot>>>,
    /// In a cluster, this node's slot plus one (0: none), carried by the process ids it
    /// makes (see [`node_slot`]).
    slot: std::sync::atomic::AtomicU32,
}

/// Process ids Shoal makes are at least this (real PostgreSQL ones are far below).
const MADE: i32 = 1 << 30;
/// In a cluster, bits 23..30 of a made process id name the node that issued it.
const SLOT_SHIFT: u32 = 23;
pub const MAX_SLOT: u16 = 127;

/// The node slot a process id carries: `None` for a real server's (session mode), which
/// names no node.
pub fn node_slot(process_id: i32) -> Option<u16> {
    (process_id >= MADE).then_some(((process_id >> SLOT_SHIFT) & MAX_SLOT as i32) as u16)
}

/// Removes the client's key when the session ends.
pub struct Registration {
    registry: Arc<CancelRegistry>,
    pub slot: Arc<CancelSlot>,
}

impl Registration {
    pub fn process_id(&self) -> i32 {
        self.slot.process_id
    }

    pub fn secret_key(&self) -> i32 {
        self.slot.secret
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.registry.lock();
        if map
            .get(&self.slot.process_id)
            .is_some_and(|s| Arc::ptr_eq(s, &self.slot))
        {
            shoal_cluster::tables::remove(&mut map, &self.slot.process_id);
        }
    }
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Arc<CancelSlot>>> {
        self.by_pid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a client. `process_id` is the real server's in session mode (so the client's
    /// `pg_backend_pid()` matches); otherwise, or if that pid is taken by a client of another
    /// server, Shoal picks one above the range of real pids.
    pub fn register(self: &Arc<Self>, process_id: Option<i32>, info: ClientInfo) -> Registration {
        let mut map = self.lock();
        let mut pid = process_id.unwrap_or_else(|| self.make_pid());
        while map.contains_key(&pid) {
            pid = self.make_pid();
        }
        let slot = Arc::new(CancelSlot {
            secret: rand::random(),
            process_id: pid,
            state: Mutex::new(SlotState::default()),
            info,
        });
        map.insert(pid, slot.clone());
        Registration {
            registry: self.clone(),
            slot,
        }
    }

    /// Process ids made from now on carry `slot` (this node's, in a cluster).
    pub fn set_node_slot(&self, slot: u16) {
        assert!(slot <= MAX_SLOT, "node slots have 7 bits");
        self.slot
            .store(u32::from(slot) + 1, std::sync::atomic::Ordering::Relaxed);
    }

    fn make_pid(&self) -> i32 {
        match self.slot.load(std::sync::atomic::Ordering::Relaxed) {
            0 => rand::random_range(MADE..i32::MAX),
            s => MADE | ((s as i32 - 1) << SLOT_SHIFT) | rand::random_range(0..1 << SLOT_SHIFT),
        }
    }

    /// Registers a client handed over by another process (or resumed by a relaying node)
    /// under the key it was given there; `None` if another client here has that process id.
    /// The same key with the same secret is this client's own earlier session, still ending
    /// (a relayed client that parked and came straight back): the new session takes the key
    /// over, so the client's cancel requests reach the query it runs now. (The old
    /// registration's drop leaves the new one in place.)
    pub fn register_exact(
        self: &Arc<Self>,
        process_id: i32,
        secret: i32,
        info: ClientInfo,
    ) -> Option<Registration> {
        let mut map = self.lock();
        if let Some(old) = map.get(&process_id) {
            // Constant-time: the secret is a credential.
            if !bool::from(old.secret.to_be_bytes().ct_eq(&secret.to_be_bytes())) {
                return None;
            }
        }
        let slot = Arc::new(CancelSlot {
            secret,
            process_id,
            state: Mutex::new(SlotState::default()),
            info,
        });
        map.insert(process_id, slot.clone());
        Some(Registration {
            registry: self.clone(),
            slot,
        })
    }

    /// Every registered client: (key, whether it holds a server, whether it waits for one).
    pub fn clients(&self) -> Vec<(i32, Arc<CancelSlot>)> {
        let mut v: Vec<(i32, Arc<CancelSlot>)> =
            self.lock().iter().map(|(k, s)| (*k, s.clone())).collect();
        v.sort_by_key(|(_, s)| s.info.since_ms);
        v
    }

    fn find(&self, process_id: i32, secret_key: i32) -> Option<Arc<CancelSlot>> {
        let slot = self.lock().get(&process_id)?.clone();
        // Constant-time: the secret is a credential.
        bool::from(slot.secret.to_be_bytes().ct_eq(&secret_key.to_be_bytes())).then_some(slot)
    }

    /// Handles a CancelRequest: forwards it if the key is known and its client has a query
    /// running; otherwise does nothing, as PostgreSQL does for unknown keys. Returns whether
    /// the key is one of this node's clients'.
    pub async fn cancel(&self, process_id: i32, secret_key: i32) -> bool {
        let Some(slot) = self.find(process_id, secret_key) else {
            tracing::debug!("cancel request with unknown key ignored");
            return false;
        };
        let Some((target, turn, in_flight)) = slot.begin() else {
            let mut s = slot.lock();
            if s.waiting {
                tracing::debug!("cancel request for a query waiting for a server");
                s.waiting = false;
                s.wait_cancelled = true;
                // The wait may end with a server all the same (it came at the same moment,
                // and the wait took it): the request is then answered as cancelled when its
                // server is named, never sent.
                s.pending = s.busy;
                let waker = s.waker.take();
                drop(s);
                if let Some(w) = waker {
                    w.wake();
                }
            } else if s.busy {
                s.pending = true;
            } else {
                tracing::debug!("cancel request for an idle client ignored");
            }
            return true;
        };
        forward(target).await;
        drop(in_flight);
        tokio::spawn(follow_up(slot, turn));
        true
    }
}

/// A client's cancel ends its wait for a server (see [`crate::pool::Pool::prepared_server`]).
impl crate::pool::WaitCancel for CancelSlot {
    type Cancelled<'a> = WaitCancelled<'a>;

    fn begin(&self) -> WaitCancelled<'_> {
        self.begin_wait()
    }

    fn end(&self) {
        self.end_wait();
    }
}

#[cfg(test)]
mod tests;
