//! The seam through which features keep state on a pool without the pool knowing them.
//!
//! The pool is data plane: it hands out servers and knows nothing of caches, rules, limits,
//! replicas or LISTEN. Those features still need per-pool state that lives and dies with the
//! pool, so the pool carries one opaque add-on, made by whoever makes the pool (the route
//! registry), and the features find theirs by type (see `crate::features`). The pool calls
//! back into it only where its own life demands it: when this node stops serving the pool.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;

/// State a feature layer keeps on each pool.
pub trait AddOns: Any + Send + Sync {
    /// This node stopped serving the pool (cluster): whatever the add-on holds for it on the
    /// database (replicas' servers) must go too.
    fn stop_serving(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// A pool with no feature state (tests of the pool itself).
impl AddOns for () {
    fn stop_serving(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(std::future::ready(()))
    }
}
