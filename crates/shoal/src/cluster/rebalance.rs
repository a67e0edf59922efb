//! Pools follow the cluster's membership, but only when idle. A pool stays with its owner
//! while it has clients (its servers, prepared statements and listeners are there); once it
//! has none, and rendezvous hashing over the live nodes names another node (one joined), or
//! the pool is gone from routing here, this node gives it up: its fence closes, its idle
//! servers close, and its key in etcd goes, so the next login anywhere claims it for the
//! node hashing names.

use crate::features::PoolFeatures;
use std::sync::Arc;
use std::time::Duration;

use super::Node;
use crate::pool::Pool;

/// How often owned pools are looked over.
const EVERY: Duration = Duration::from_secs(1);

/// Whether nothing runs on the pool: no client (local or relayed here), no server lent, no
/// listener.
fn idle(pool: &Pool) -> bool {
    pool.stats
        .clients
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
        && pool.in_use() == 0
        && !pool.notify().active()
}

/// Gives up `pool` if it is still idle once fenced (a client that logged in meanwhile keeps
/// it here). Returns whether it was given up.
async fn give_up(node: &Arc<Node>, pool: &Arc<Pool>) -> bool {
    if !pool.fence.close() {
        return false;
    }
    if !idle(pool) {
        pool.fence.own();
        return false;
    }
    pool.fence.drop_mark();
    pool.close_idle().await;
    if let Some(r) = pool.replicas() {
        r.fence().await;
    }
    release(node, &pool.name).await;
    true
}

async fn release(node: &Arc<Node>, key: &str) {
    match node.membership().release(key).await {
        Ok(_) => tracing::info!(pool = %key, "pool given up by this node"),
        Err(e) => {
            tracing::warn!(pool = %key, error = %e, "pool not released in etcd (its key goes with this node's lease)")
        }
    }
}

/// Runs on the control runtime for as long as the node does.
// The control runtime has tokio's time driver.
#[allow(clippy::disallowed_methods)]
pub async fn run(node: Arc<Node>) {
    let mut tick = tokio::time::interval(EVERY);
    loop {
        tick.tick().await;
        if !node.lease_alive() {
            continue;
        }
        let pools = node.host.routes.pools();
        for pool in &pools {
            if !pool.fence.owned() || !idle(pool) {
                continue;
            }
            let hashed = node.hashed_owner(&pool.name);
            if hashed.is_some_and(|h| h != node.id) {
                give_up(&node, pool).await;
            }
        }
        // Keys this node holds for pools no longer in its routing (a tenant's pool closed
        // for disuse, a database removed by a reload).
        let routed: std::collections::HashSet<&str> =
            pools.iter().map(|p| p.name.as_str()).collect();
        let stale: Vec<String> = node
            .owners()
            .iter()
            .filter(|(k, owner)| **owner == node.id && !routed.contains(k.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            release(&node, &k).await;
        }
    }
}
