//! The seam through which features keep state on a pool without the pool knowing them.
//!
//! The pool is data plane: it hands out servers and knows nothing of caches, rules, limits,
//! replicas or LISTEN. Those features still need per-pool state that lives and dies with the
//! pool, so the pool carries one add-on, made by whoever makes the pool (the route registry).
//! Its type is named once, at the crate root ([`crate::Plugged`], through [`Plug`]): the pool
//! never looks into it, and the features read theirs back with a field load rather than a
//! lookup by type on every transaction. The pool calls back into it only where its own life
//! demands it: when this node stops serving the pool.

use std::future::Future;
use std::pin::Pin;

/// State a feature layer keeps on each pool.
pub trait AddOns: Send + Sync + 'static {
    /// This node stopped serving the pool (cluster): whatever the add-on holds for it on the
    /// database (replicas' servers) must go too.
    fn stop_serving(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

/// Names the add-on every pool carries: implemented by the features the data plane runs with.
pub trait Plug {
    type AddOns: AddOns;
}

/// The add-on type of the features the data plane runs with.
pub type PoolAddOns = <crate::Plugged as Plug>::AddOns;
