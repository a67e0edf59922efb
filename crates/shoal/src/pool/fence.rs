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

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

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

pub struct Fence(AtomicU8);

impl Fence {
    pub fn new() -> Fence {
        Fence(AtomicU8::new(if CLUSTERED.load(Ordering::Relaxed) {
            CLOSED
        } else {
            OPEN
        }))
    }

    /// Pools made from now on start closed.
    pub fn clustered() {
        CLUSTERED.store(true, Ordering::SeqCst);
    }

    /// Whether a server may be used (checked out or opened) now.
    pub fn may_open(&self) -> bool {
        match self.0.load(Ordering::Acquire) {
            OPEN => true,
            OWNED => before_deadline(),
            _ => false,
        }
    }

    /// This node's claim on the pool is confirmed.
    pub fn own(&self) {
        let _ = self
            .0
            .compare_exchange(CLOSED, OWNED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// This node gives the pool up (or may have lost it). Returns whether it was owned.
    pub fn close(&self) -> bool {
        self.0
            .compare_exchange(OWNED, CLOSED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// In a cluster, this node may not use the pool's servers now.
    pub fn fenced(&self) -> bool {
        !self.may_open()
    }

    pub fn owned(&self) -> bool {
        self.0.load(Ordering::Acquire) == OWNED
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
        let f = Fence(AtomicU8::new(CLOSED));
        assert!(!f.may_open());
        f.own();
        assert!(f.owned());
        set_deadline(Instant::now() + std::time::Duration::from_secs(60));
        assert!(f.may_open());
        set_deadline(Instant::now());
        assert!(!f.may_open(), "past the deadline, owned or not");
        assert!(f.close());
        assert!(!f.close(), "closed once");
        let single = Fence(AtomicU8::new(OPEN));
        assert!(single.may_open(), "a single node has no deadline");
        assert!(!single.close());
    }
}
