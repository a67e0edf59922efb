//! LISTEN/NOTIFY in transaction mode.
//!
//! A transaction-mode client's next transaction may run on any server, so the server that ran
//! its `LISTEN` cannot be the one that delivers its notifications. Each pool instead keeps one
//! connection of its own (the pool's *listener*, outside `pool_size`) that LISTENs to the
//! union of the channels its clients listen to, and hands each notification to every client
//! listening to that channel, through the client's [`Mailbox`].
//!
//! The client's `LISTEN` still runs on its transaction's server (so errors, transaction
//! blocks and savepoints behave as in PostgreSQL); [`crate::sets`] follows it, and once it
//! commits the client's ReadyForQuery waits until the listener LISTENs to the channel too
//! ([`Hub::update`]). A notification committed after the client saw that ReadyForQuery is
//! therefore always delivered. The transaction's server is unlistened before it goes back to
//! the pool, and what it delivers meanwhile is dropped: the listener delivers it.

mod listener;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::oneshot;

pub use crate::mailbox::{Mail, Mailbox, Put, MAX_PENDING};

/// The pool's side of LISTEN/NOTIFY: who listens to what, and the listener connection's
/// task (running while anyone listens).
#[derive(Default)]
pub struct Hub {
    state: Mutex<State>,
    /// Wakes the listener task: the wanted channels changed, or a barrier was asked for.
    wake: tokio::sync::Notify,
    /// Someone listens (mirrors `State::subscribers` being non-empty, read without the lock).
    active: std::sync::atomic::AtomicBool,
    pub counts: NotifyCounts,
}

#[derive(Default)]
struct State {
    /// Mailboxes by channel.
    subscribers: HashMap<Box<[u8]>, Vec<Arc<Mailbox>>>,
    /// Bumped at each change of `subscribers`' channels.
    wanted: u64,
    /// The `wanted` the listener connection has LISTENed to (all of it, confirmed).
    in_force: u64,
    /// Clients waiting for `in_force` to reach a value.
    waiters: Vec<(u64, oneshot::Sender<()>)>,
    /// Barriers asked for and not yet sent (see [`Hub::barrier`]).
    barriers: Vec<Barrier>,
    /// (server process id, client process id): a client's transaction that may NOTIFY runs
    /// on that server, so notifications from it are the client's and carry the process id
    /// Shoal gave the client (see [`Hub::claim`]).
    claims: Vec<(i32, i32)>,
    /// A listener task runs.
    running: bool,
    /// The listener connection is open (barriers wait for nothing while it is not).
    connected: bool,
}

/// A client's request that everything committed on the server with `server_pid` so far
/// reaches the mailboxes before the receiver completes.
struct Barrier {
    server_pid: i32,
    done: oneshot::Sender<()>,
}

/// What the pool's metrics count of LISTEN/NOTIFY.
#[derive(Default, Debug)]
pub struct NotifyCounts {
    /// Notifications put in clients' mailboxes.
    pub delivered: std::sync::atomic::AtomicU64,
    /// Times the listener connection was lost while clients listened (notifications sent
    /// until it was back are lost).
    pub listener_lost: std::sync::atomic::AtomicU64,
    /// Clients closed for leaving more than [`MAX_PENDING`] bytes of notifications unread.
    pub overflowed: std::sync::atomic::AtomicU64,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `mailbox` receive exactly the channels in `now` (it received `before` until
    /// now). The receiver completes once the listener connection LISTENs to all of them;
    /// it is dropped unanswered if the pool goes away.
    pub fn update(
        self: &Arc<Self>,
        pool: &Weak<crate::pool::Pool>,
        mailbox: &Arc<Mailbox>,
        before: &[Box<[u8]>],
        now: &[Box<[u8]>],
    ) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut s = self.lock();
        let mut changed = false;
        for c in before.iter().filter(|c| !now.contains(c)) {
            if let Some(list) = s.subscribers.get_mut(c) {
                list.retain(|m| !Arc::ptr_eq(m, mailbox));
                if list.is_empty() {
                    s.subscribers.remove(c);
                    changed = true;
                }
            }
        }
        for c in now.iter().filter(|c| !before.contains(c)) {
            let list = s.subscribers.entry(c.clone()).or_default();
            changed |= list.is_empty();
            list.push(mailbox.clone());
        }
        if changed {
            s.wanted += 1;
            self.active.store(
                !s.subscribers.is_empty(),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        if s.in_force >= s.wanted {
            let _ = tx.send(());
        } else {
            let wanted = s.wanted;
            s.waiters.push((wanted, tx));
            self.start(&mut s, pool);
        }
        rx
    }

    /// Whether anyone in the pool listens: only then are notifying transactions followed.
    pub fn active(&self) -> bool {
        self.active.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A client about to run SQL that may notify on the server `server_pid`, which it holds
    /// until [`Hub::barrier`] for that server completes: notifications from that server are
    /// the client's meanwhile. Claimed before the SQL is sent, so none of them can be read
    /// before.
    pub fn claim(&self, server_pid: i32, client_pid: i32) {
        let mut s = self.lock();
        s.claims.retain(|c| c.0 != server_pid);
        s.claims.push((server_pid, client_pid));
    }

    /// Gives up a claim without waiting (the transaction ended without a ReadyForQuery the
    /// client waits for).
    pub fn unclaim(&self, server_pid: i32) {
        self.lock().claims.retain(|c| c.0 != server_pid);
    }

    /// Asks the listener to deliver every notification committed so far before the receiver
    /// completes, and ends the claim on `server_pid` then. Completes at once when nobody
    /// listens.
    pub fn barrier(
        self: &Arc<Self>,
        pool: &Weak<crate::pool::Pool>,
        server_pid: i32,
    ) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let mut s = self.lock();
        if s.subscribers.is_empty() || (s.running && !s.connected) {
            // Nobody to deliver to, or no connection to deliver from: its notifications are
            // not coming.
            s.claims.retain(|c| c.0 != server_pid);
            let _ = tx.send(());
            return rx;
        }
        s.barriers.push(Barrier {
            server_pid,
            done: tx,
        });
        self.start(&mut s, pool);
        rx
    }

    /// Starts the listener task unless it runs; wakes it either way.
    fn start(self: &Arc<Self>, s: &mut State, pool: &Weak<crate::pool::Pool>) {
        if !s.running {
            s.running = true;
            crate::control::spawn(listener::run(pool.clone(), self.clone()));
        }
        self.wake.notify_one();
    }

    /// Channels clients listen to now.
    pub fn channels(&self) -> usize {
        self.lock().subscribers.len()
    }
}

/// A client's listening: its mailbox and the channels the hub knows it listens to. Dropped
/// with the client (its channels are given up).
pub struct Subscription {
    pool: Weak<crate::pool::Pool>,
    hub: Weak<Hub>,
    pub mailbox: Arc<Mailbox>,
    pub channels: Vec<Box<[u8]>>,
}

impl Subscription {
    pub fn new(pool: &crate::pool::Pool, hub: &Arc<Hub>) -> Subscription {
        Subscription {
            pool: pool.weak(),
            hub: Arc::downgrade(hub),
            mailbox: Arc::default(),
            channels: Vec::new(),
        }
    }

    /// Makes the hub's view of this client's channels `now`; see [`Hub::update`].
    pub fn update(&mut self, now: &[Box<[u8]>]) -> Option<oneshot::Receiver<()>> {
        let hub = self.hub.upgrade()?;
        let rx = hub.update(&self.pool, &self.mailbox, &self.channels, now);
        self.channels = now.to_vec();
        Some(rx)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if !self.channels.is_empty() {
            // Nobody waits for the listener to unlisten.
            let _ = self.update(&[]);
        }
    }
}
