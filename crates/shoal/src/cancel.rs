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
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn made_process_ids_carry_the_node_slot() {
        let registry = Arc::new(CancelRegistry::default());
        let plain = registry.register(None, ClientInfo::default());
        assert!(plain.process_id() >= MADE);
        for slot in [0, 1, 77, MAX_SLOT] {
            registry.set_node_slot(slot);
            for _ in 0..100 {
                let r = registry.register(None, ClientInfo::default());
                assert!(r.process_id() > 0);
                assert_eq!(node_slot(r.process_id()), Some(slot));
            }
        }
        // A real server's process id (session mode) names no node.
        let real = registry.register(Some(4242), ClientInfo::default());
        assert_eq!(node_slot(real.process_id()), None);
    }

    #[test]
    fn a_resumed_client_takes_over_its_own_key_from_a_session_still_ending() {
        let registry = Arc::new(CancelRegistry::default());
        let old = registry
            .register_exact(77, 1234, ClientInfo::default())
            .unwrap();
        assert!(
            registry
                .register_exact(77, 999, ClientInfo::default())
                .is_none(),
            "another secret: another client's key"
        );
        let new = registry
            .register_exact(77, 1234, ClientInfo::default())
            .expect("the same client");
        drop(old);
        let slot = registry.find(77, 1234).expect("still registered");
        assert!(Arc::ptr_eq(&slot, &new.slot), "the new session's");
    }

    /// Every connected client holds one slot: with its reference counts it must fit the
    /// allocator's 128-byte size class (the next is 160).
    #[test]
    fn a_slot_fits_in_128_bytes() {
        assert!(2 * std::mem::size_of::<usize>() + std::mem::size_of::<CancelSlot>() <= 128);
    }

    /// A cancel that arrives while the client's server is being found is not sent to that
    /// server (it would race the request there): `set` reports it, and names no server.
    #[tokio::test]
    async fn a_cancel_before_the_server_is_named_cancels_the_request_not_the_server() {
        let registry = Arc::new(CancelRegistry::default());
        let reg = registry.register(None, ClientInfo::default());
        let target = CancelTarget::new("127.0.0.1:9".parse().unwrap(), 7, 9);
        reg.slot.mark_busy();
        // The cancel arrives while the request has no server yet: remembered, not sent.
        registry.cancel(reg.process_id(), reg.secret_key()).await;
        assert!(!reg.slot.set(target), "the request is reported cancelled");
        assert_eq!(
            reg.slot.state(),
            "idle",
            "no server named for a cancelled request"
        );
        // A cancel after the request ended is for no request: ignored.
        registry.cancel(reg.process_id(), reg.secret_key()).await;
        // The next request is not affected by either cancel.
        reg.slot.mark_busy();
        assert!(reg.slot.set(target));
        assert_eq!(reg.slot.state(), "active");
        reg.slot.clear().await;
    }

    /// A cancel that ends a wait for a server which the wait nonetheless ends with (both
    /// came at once) still cancels the request: it is not sent to that server.
    #[tokio::test]
    async fn a_cancel_that_crosses_a_server_arriving_still_cancels() {
        let registry = Arc::new(CancelRegistry::default());
        let reg = registry.register(None, ClientInfo::default());
        reg.slot.mark_busy();
        // The wait ended with a server: the signal is never looked at.
        let _unlooked = reg.slot.begin_wait();
        registry.cancel(reg.process_id(), reg.secret_key()).await;
        reg.slot.end_wait();
        let target = CancelTarget::new("127.0.0.1:9".parse().unwrap(), 7, 9);
        assert!(!reg.slot.set(target), "the request is reported cancelled");
        // A cancel that did end the wait leaves nothing behind for the next request.
        reg.slot.mark_busy();
        let cancelled = reg.slot.begin_wait();
        registry.cancel(reg.process_id(), reg.secret_key()).await;
        crate::timer::timeout(Duration::from_secs(5), cancelled)
            .await
            .expect("the wait was told");
        reg.slot.end_wait();
        reg.slot.not_busy();
        reg.slot.mark_busy();
        assert!(reg.slot.set(target), "the next request runs");
        reg.slot.clear().await;
    }

    /// A wait already asleep (its waker in the slot) is woken by the cancel, from another
    /// task, and the slot keeps no waker once the wait ends.
    #[tokio::test]
    async fn a_cancel_wakes_a_sleeping_wait_for_a_server() {
        let registry = Arc::new(CancelRegistry::default());
        let reg = registry.register(None, ClientInfo::default());
        reg.slot.mark_busy();
        let slot = reg.slot.clone();
        let (asleep_tx, asleep) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn(async move {
            let mut wait = Box::pin(slot.begin_wait());
            let mut asleep_tx = Some(asleep_tx);
            std::future::poll_fn(|cx| {
                let r = std::future::Future::poll(wait.as_mut(), cx);
                if let Some(tx) = asleep_tx.take() {
                    assert!(r.is_pending(), "no cancel yet");
                    let _ = tx.send(());
                }
                r
            })
            .await;
            slot.end_wait();
        });
        asleep.await.expect("the wait was polled");
        assert_eq!(reg.slot.state(), "waiting");
        // A cancel with the wrong secret (someone guessing keys) ends nothing.
        let wrong = reg.secret_key().wrapping_add(1);
        assert!(!registry.cancel(reg.process_id(), wrong).await);
        assert_eq!(reg.slot.state(), "waiting");
        assert!(!waiter.is_finished());
        registry.cancel(reg.process_id(), reg.secret_key()).await;
        crate::timer::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the cancel woke the wait")
            .expect("waiter");
        assert!(reg.slot.lock().waker.is_none());
        assert_eq!(reg.slot.state(), "idle");
    }

    /// A stand-in server that counts the cancel requests it gets (each: read, then closed).
    async fn counting_server() -> (CancelTarget, Arc<AtomicU32>, tokio::task::JoinHandle<()>) {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicU32::new(0));
        let counted = count.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                let mut req = [0u8; 16];
                if c.read_exact(&mut req).await.is_ok() {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        let target = CancelTarget::new(addr, 7, 9);
        (target, count, task)
    }

    /// A cancel PostgreSQL ignored (its backend was between messages, before the request
    /// arrived) is sent again while the request runs unanswered, and only then.
    #[tokio::test]
    async fn a_cancel_is_sent_again_while_its_request_runs_unanswered() {
        let (target, count, server) = counting_server().await;
        let registry = Arc::new(CancelRegistry::default());
        let reg = registry.register(None, ClientInfo::default());
        let turn_now = || {
            let (_, turn, guard) = reg.slot.begin().unwrap();
            drop(guard);
            turn
        };
        assert!(reg.slot.set(target));
        // Nothing answered: every recheck cancels again.
        let turn = turn_now();
        let sent = follow_up(reg.slot.clone(), turn).await;
        assert_eq!(sent, RECHECK.len() as u32);
        assert_eq!(count.load(Ordering::SeqCst), sent);
        // The request was answered after the cancel: not cancelled again.
        reg.slot.note_answered();
        assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
        // The client's next unit (a server named again) is never cancelled by an old cancel.
        let turn = turn_now();
        reg.slot.clear().await;
        reg.slot.mark_busy();
        assert!(reg.slot.set(target));
        assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
        // Nor is anything once the server is given back.
        let turn = turn_now();
        reg.slot.clear().await;
        assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
        assert_eq!(count.load(Ordering::SeqCst), RECHECK.len() as u32);
        server.abort();
    }

    /// A cancel whose forwarding is abandoned midway (its connection's login timed out) must
    /// not leave the client unable to give its server back.
    #[tokio::test]
    async fn an_abandoned_forward_does_not_block_clear() {
        // A "server" that accepts the cancel connection and never closes it.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                conns.push(c);
            }
        });
        let registry = Arc::new(CancelRegistry::default());
        let reg = registry.register(None, ClientInfo::default());
        assert!(reg.slot.set(CancelTarget::new(addr, 1, 2)));
        let abandoned = crate::timer::timeout(
            Duration::from_millis(100),
            registry.cancel(reg.process_id(), reg.secret_key()),
        )
        .await;
        assert!(abandoned.is_err(), "the forward was still waiting");
        crate::timer::timeout(Duration::from_secs(2), reg.slot.clear())
            .await
            .expect("clear returns once the abandoned forward is gone");
        hold.abort();
    }
}
