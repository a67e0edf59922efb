//! Shoal's cluster, apart from the pooler: which nodes are alive (registered in etcd under a
//! lease each renews) and which node owns a pool (rendezvous hashing over the live nodes).
//!
//! - [`hrw`]: highest-random-weight hashing, pure: a node joining or leaving moves only the
//!   pools it wins or held.
//! - [`membership`]: a node's registration in etcd and its live view of the others.
//! - [`link`]: node-to-node connections multiplexing relayed clients.
//! - [`ownership`]: a pool's owner confirmed by a key under the owner's lease (the fence).
//! - [`tables`]: per-connection tables that give a connect storm's memory back.
//!
//! The etcd client runs on whatever runtime calls it; the pooler runs it on its control
//! runtime, never on the data plane's cores.

pub mod hrw;
pub mod link;
pub mod membership;
pub mod ownership;
pub mod tables;

pub use membership::{ClusterError, Membership, MembershipConfig, NodeInfo};
