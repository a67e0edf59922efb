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
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::pg_fence::{Mark, MarkSlot};

/// Set once, when this process joins a cluster (before it accepts clients): pools made from
/// then on start closed.
static CLUSTERED: AtomicBool = AtomicBool::new(false);

/// The lease's deadline, in nanoseconds after [`base`] (0: none yet).
static DEADLINE_NS: AtomicU64 = AtomicU64::new(0);

fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Owned pools may be used until `deadline` (moved on by each confirmed lease renewal).
pub fn set_deadline(deadline: Instant) {
    let ns = deadline.saturating_duration_since(base()).as_nanos() as u64;
    DEADLINE_NS.store(ns.max(1), Ordering::Release);
}

fn before_deadline() -> bool {
    let d = DEADLINE_NS.load(Ordering::Acquire);
    d != 0 && (base().elapsed().as_nanos() as u64) < d
}

const OPEN: u8 = 0;
const OWNED: u8 = 1;
const CLOSED: u8 = 2;

pub struct Fence {
    state: AtomicU8,
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
    pub fn new() -> Fence {
        Fence::with_state(if CLUSTERED.load(Ordering::Relaxed) {
            CLOSED
        } else {
            OPEN
        })
    }

    fn with_state(state: u8) -> Fence {
        Fence {
            state: AtomicU8::new(state),
            mark: Mutex::new(MarkSlot::NotNeeded),
            taking_over: tokio::sync::Mutex::new(()),
        }
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

    /// Pools made from now on start closed.
    pub fn clustered() {
        CLUSTERED.store(true, Ordering::SeqCst);
    }

    /// Whether a server may be used (checked out or opened) now.
    pub fn may_open(&self) -> bool {
        match self.state.load(Ordering::Acquire) {
            OPEN => true,
            OWNED => before_deadline(),
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

impl Default for Fence {
    fn default() -> Self {
        Fence::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owned_pool_is_usable_until_the_lease_deadline() {
        let f = Fence::with_state(CLOSED);
        assert!(!f.may_open());
        f.own();
        assert!(f.owned());
        set_deadline(Instant::now() + std::time::Duration::from_secs(60));
        assert!(f.may_open());
        set_deadline(Instant::now());
        assert!(!f.may_open(), "past the deadline, owned or not");
        assert!(f.close());
        assert!(!f.close(), "closed once");
        let single = Fence::with_state(OPEN);
        assert!(single.may_open(), "a single node has no deadline");
        assert!(!single.close());
    }
}
