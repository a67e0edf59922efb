//! This node's lease, followed: what it allows (owned pools usable until a deadline), what
//! happens when it cannot be renewed, and joining again once it expired.
//!
//! Consistency while etcd cannot be reached: a pool can only change owner through etcd (a
//! claim needs the old owner's key gone, which needs its lease expired, which needs etcd).
//! So when this node cannot renew its lease, it asks its peers over the node links (each
//! probe's answer says how long ago the peer last renewed its own): if every live peer it
//! knows has not renewed either, etcd is down or cut off from all of them, nobody can take
//! a pool over, and the node goes on serving its pools (existing clients see nothing; new
//! pools cannot be claimed). If any peer renews, or cannot be asked, this node may be the
//! one cut off: it fences its pools before its lease can expire, and joins again when it
//! can. A node that joins while etcd is cut off from all the others is the one case this
//! cannot see (see docs/cluster.md).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Node;

/// How often the lease's state is looked at while a renewal is overdue (and the peers
/// probed); otherwise it is looked at on each renewal, and when the next one is late.
const TICK: Duration = Duration::from_millis(100);
/// A peer's answer older than this does not count.
const FRESH: Duration = Duration::from_secs(1);

/// Follows this node's registration until it leaves; joins again whenever it expires.
///
/// Owned pools are usable until [`shoal_cluster::Membership::valid_until`]. A renewal
/// overdue, the peers are probed every tick; if every one of them answers that it has not
/// renewed for a while either, the deadline is extended a quarter TTL at a time for as long
/// as they keep saying so. Otherwise, at the deadline, every owned pool is fenced.
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
pub async fn keep(node: Arc<Node>) {
    let ttl = node.config.lease_ttl;
    loop {
        let m = node.membership();
        let mut renewals = m.renewals();
        let mut fenced = false;
        let mut vouching = false;
        let mut deadline = m.valid_until();
        loop {
            // The registration ended: etcd expired the lease, or the node left.
            if renewals.has_changed().is_err() {
                break;
            }
            let renewed = *renewals.borrow_and_update();
            let since = renewed.elapsed();
            node.links
                .status
                .store(since.as_millis() as u64, Ordering::Relaxed);
            if since < ttl / 4 + TICK {
                deadline = deadline.max(m.valid_until());
                node.host.routes.lease.set_deadline(deadline);
                if fenced || vouching {
                    tracing::info!(node = %node.id, "cluster lease renewed again");
                }
                (fenced, vouching) = (false, false);
                // Nothing to look at until the next renewal, or until one is overdue (an
                // idle node is not woken ten times a second for nothing).
                let overdue_at = renewed + ttl / 4 + TICK;
                let _ = tokio::time::timeout_at(overdue_at.into(), renewals.changed()).await;
                continue;
            }
            // A renewal is overdue: what do the others see?
            node.links.probe_control();
            if vouched(&node, ttl, renewed) {
                deadline = deadline.max(Instant::now() + ttl / 4);
                node.host.routes.lease.set_deadline(deadline);
                if !vouching {
                    tracing::warn!(node = %node.id, unrenewed = ?since, "etcd cannot be reached, by any node: serving the pools this node owns, changing no ownership");
                    vouching = true;
                }
            } else if !fenced && Instant::now() + TICK >= deadline {
                vouching = false;
                fence_all(&node).await;
                fenced = true;
            }
            tokio::time::sleep(TICK).await;
        }
        if node.left.load(Ordering::SeqCst) {
            return;
        }
        fence_all(&node).await;
        tracing::warn!(node = %node.id, "cluster lease expired: joining the cluster again");
        let mut wait = Duration::from_millis(200);
        loop {
            match super::join(&node.host, &node.joining).await {
                Ok(fresh) => {
                    tracing::info!(node = %node.id, slot = fresh.slot(), "joined the cluster again");
                    *node.membership.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(fresh);
                    break;
                }
                Err(e) => {
                    tracing::warn!(node = %node.id, error = %e, "cannot join the cluster again yet");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Whether every live peer this node knows answered a probe since this node's last renewal,
/// lately, saying it has missed a renewal of its own too (a peer that reaches etcd renews a
/// quarter TTL apart): etcd is out of everyone's reach.
fn vouched(node: &Node, ttl: Duration, renewed: Instant) -> bool {
    let missed = (ttl / 4 + Duration::from_millis(150)).as_millis() as u64;
    node.nodes()
        .keys()
        .filter(|id| **id != node.id)
        .all(|peer| {
            node.links
                .control_status(peer)
                .is_some_and(|(since_ms, at)| {
                    at > renewed && at.elapsed() < FRESH && since_ms >= missed
                })
        })
}

/// Fences every pool this node owns: no server is used for it, idle ones are closed, and
/// the transactions running on the others end (their sockets are shut), so this node never
/// acts beside the owner the others will choose once its lease expires.
async fn fence_all(node: &Node) {
    node.host.routes.lease.set_deadline(Instant::now());
    let mut fenced = 0;
    for pool in node.host.routes.pools() {
        if pool.stop_serving().await {
            fenced += 1;
        }
    }
    if fenced > 0 {
        tracing::error!(node = %node.id, fenced, "cluster lease lapsed: this node owns no pools now");
    }
}
