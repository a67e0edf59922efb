//! Whether this node may open servers for a pool. A single node always may. In a cluster a
//! pool's servers may be opened only by the node holding its ownership key in etcd (see
//! [`crate::cluster`]): a pool starts closed, is opened when its claim is confirmed, and is
//! closed again when the claim is given up or this node's lease may have lapsed. Checked
//! before every server connection is opened; servers already open are ended by whoever
//! closes the fence.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// Set once, when this process joins a cluster (before it accepts clients): pools made from
/// then on start closed.
static CLUSTERED: AtomicBool = AtomicBool::new(false);

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

    pub fn may_open(&self) -> bool {
        self.0.load(Ordering::Acquire) != CLOSED
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

    pub fn owned(&self) -> bool {
        self.0.load(Ordering::Acquire) == OWNED
    }
}

impl Default for Fence {
    fn default() -> Self {
        Fence::new()
    }
}
