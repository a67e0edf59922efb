//! Whether this node may use servers for a pool. A single node always may. In a cluster a
//! pool's servers may be used only by the node holding its ownership key in etcd (see
//! [`crate::cluster`]): a pool starts closed, is opened when its claim is confirmed, and is
//! closed again when the claim is given up or this node's lease may have lapsed.
//!
//! An owned pool is also closed by the clock: the lease is known alive only until a deadline
//! (its last confirmed renewal plus two thirds of its TTL), checked at every checkout. So a
//! node paused past its lease (SIGSTOP, a long GC-like stall of the machine) uses no server
//! once it runs again, before any of its tasks could learn the lease is gone. Servers already
//! lent are ended by whoever closes the fence.
//!
//! Neither closes the window between a check and a write in an owner that is paused right
//! then: the new owner also makes PostgreSQL refuse the old one (see `pg_fence`), and the
//! fence holds this node's mark for that.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::pg_fence::{Mark, MarkSlot};

/// Whether this process is a cluster node, and until when its lease is known alive: one per
/// [`crate::app::App`], shared by the fences of all its pools (two nodes can run in one
/// process, as in tests).
pub struct LeaseClock {
    clustered: AtomicBool,
    /// The lease's deadline, in nanoseconds after `base` (0: none yet).
    deadline_ns: AtomicU64,
    base: Instant,
}

impl LeaseClock {
    pub fn new(clustered: bool) -> LeaseClock {
        LeaseClock {
            clustered: AtomicBool::new(clustered),
            deadline_ns: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    /// Pools made from now on start closed (set before clients are accepted).
    pub fn set_clustered(&self) {
        self.clustered.store(true, Ordering::SeqCst);
    }

    pub fn clustered(&self) -> bool {
        self.clustered.load(Ordering::Relaxed)
    }

    /// Owned pools may be used until `deadline` (moved on by each confirmed renewal).
    pub fn set_deadline(&self, deadline: Instant) {
        let ns = deadline.saturating_duration_since(self.base).as_nanos() as u64;
        self.deadline_ns.store(ns.max(1), Ordering::Release);
    }

    fn before_deadline(&self) -> bool {
        let d = self.deadline_ns.load(Ordering::Acquire);
        d != 0 && (self.base.elapsed().as_nanos() as u64) < d
    }
}

impl Default for LeaseClock {
    fn default() -> Self {
        LeaseClock::new(false)
    }
}

const OPEN: u8 = 0;
const OWNED: u8 = 1;
const CLOSED: u8 = 2;

pub struct Fence {
    state: AtomicU8,
    lease: Arc<LeaseClock>,
    /// This node's mark at PostgreSQL, for a primary's pool it owns (see `pg_fence`).
    mark: Mutex<MarkSlot>,
    /// Held while the pool is taken over, so two logins that both find it unowned take it
    /// over once.
    pub taking_over: tokio::sync::Mutex<()>,
}

/// Why no server may be opened for a pool whose mark was given up.
#[derive(Debug)]
pub struct MarkLost;

impl Fence {
    /// A fence on `lease`: closed in a cluster until the pool is owned, open otherwise.
    pub fn new(lease: Arc<LeaseClock>) -> Fence {
        let state = if lease.clustered() { CLOSED } else { OPEN };
        Fence::with_state(state, lease)
    }

    fn with_state(state: u8, lease: Arc<LeaseClock>) -> Fence {
        Fence {
            state: AtomicU8::new(state),
            lease,
            mark: Mutex::new(MarkSlot::NotNeeded),
            taking_over: tokio::sync::Mutex::new(()),
        }
    }

    /// The lease this fence follows (a replica's pool follows its primary's).
    pub fn lease(&self) -> &Arc<LeaseClock> {
        &self.lease
    }

    /// The mark each server opened must be enlisted with before it serves (`None`: no mark
    /// is needed), or `MarkLost` when it was given up.
    pub fn mark(&self) -> Result<Option<Arc<Mark>>, MarkLost> {
        match &*self.mark.lock().unwrap_or_else(|e| e.into_inner()) {
            MarkSlot::NotNeeded => Ok(None),
            MarkSlot::Held(m) => Ok(Some(m.clone())),
            MarkSlot::Lost => Err(MarkLost),
        }
    }

    /// This node took the pool over at PostgreSQL.
    pub fn set_mark(&self, mark: Arc<Mark>) {
        *self.mark.lock().unwrap_or_else(|e| e.into_inner()) = MarkSlot::Held(mark);
    }

    /// This node gave the pool up (or may have lost it): its mark goes (the session ends
    /// once the last enlisting in flight is done with it), and no server is opened until
    /// the pool is taken over again.
    pub fn drop_mark(&self) {
        let mut slot = self.mark.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*slot, MarkSlot::Held(_)) {
            *slot = MarkSlot::Lost;
        }
    }

    /// Whether a server may be used (checked out or opened) now.
    pub fn may_open(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            OPEN => true,
            OWNED => self.lease.before_deadline(),
            _ => false,
        }
    }

    /// This node's claim on the pool is confirmed.
    pub fn own(&self) {
        let _ = self
            .state
            .compare_exchange(CLOSED, OWNED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// This node gives the pool up (or may have lost it). Returns whether it was owned.
    pub fn close(&self) -> bool {
        self.state
            .compare_exchange(OWNED, CLOSED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// In a cluster, this node may not use the pool's servers now.
    pub fn fenced(&self) -> bool {
        !self.may_open()
    }

    pub fn owned(&self) -> bool {
        self.state.load(Ordering::Acquire) == OWNED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owned_pool_is_usable_until_the_lease_deadline() {
        let lease = Arc::new(LeaseClock::new(true));
        let f = Fence::new(lease.clone());
        assert!(!f.may_open());
        f.own();
        assert!(f.owned());
        lease.set_deadline(Instant::now() + std::time::Duration::from_secs(60));
        assert!(f.may_open());
        lease.set_deadline(Instant::now());
        assert!(!f.may_open(), "past the deadline, owned or not");
        assert!(f.close());
        assert!(!f.close(), "closed once");
        let single = Fence::new(Arc::new(LeaseClock::new(false)));
        assert!(single.may_open(), "a single node has no deadline");
        assert!(!single.close());
    }
}
