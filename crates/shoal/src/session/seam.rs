//! What the session asks of the features at the points of a client's life where they
//! decide, as one trait the data plane defines and the features implement
//! ([`crate::features::relay`]). The implementation is chosen once, at the crate root
//! ([`crate::Plugged`]), so every call is resolved at compile time: nothing is called
//! through a pointer or boxed, and the session names no feature module.
//!
//! Moved behind it so far: the pools' rate and concurrency limits. The rest (result cache,
//! replicas, query rules, LISTEN) is still called by name; see docs/architecture.md.

use std::future::Future;

use crate::pool::Pool;

/// A unit of work refused before it reached a server, with what to tell the client
/// (`53400`).
#[derive(Debug)]
pub struct Refusal(pub String);

pub trait Features {
    /// What a pool's limits are for one unit of work (looked up once per unit).
    type Limits: Send + Sync;
    /// What a transaction holds while it runs (a place under a concurrency limit).
    type Running: Send;

    fn limits(pool: &Pool) -> Self::Limits;

    /// A unit of work that needs a server is about to run, or be answered from a cache: it
    /// may have to wait for its turn, or be refused (a rate limit).
    fn admit_unit(limits: &Self::Limits) -> impl Future<Output = Result<(), Refusal>> + Send;

    /// A transaction is about to take a server: what it holds while it runs, after waiting
    /// its turn, or a refusal (a concurrency limit).
    fn admit_transaction(
        limits: &Self::Limits,
    ) -> impl Future<Output = Result<Self::Running, Refusal>> + Send;

    /// A transaction ended, having answered `queries` queries (rates count them all).
    fn transaction_ran(pool: &Pool, queries: u64);
}
