//! This process as a node of a Shoal cluster (`[cluster]`), and the pooler's one seam into
//! it: for a client's pool, [`Node::place`] says "here" (this node owns the pool: take a
//! server from it as a single node would) or "there" (relay the client to the owner, see
//! [`pipe`]). Everything else — etcd membership and ownership (the `shoal-cluster` crate),
//! node links, the relay's byte loop — stays behind it.
//!
//! - [`links`]: the node links, outgoing and accepted, and their upkeep.
//! - [`open`]: what a relaying node tells an owner about a client.
//! - [`pipe`]: the relaying node's byte loop between a client and the owner.
//! - [`status`]: the cluster as this node sees it (console, metrics, API).
//!
//! etcd is only ever called on the control runtime; a login asks for a claim through
//! [`crate::control::spawn`] and awaits the answer.

pub mod links;
pub mod open;
pub mod pipe;
pub mod status;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use shoal_cluster::ownership::Claim;
use shoal_cluster::{ClusterError, Membership, MembershipConfig, NodeInfo};

use crate::app::App;
use crate::config::Cluster;
use crate::pool::Pool;

/// Where a pool's clients are served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// This node owns the pool.
    Here,
    /// The named node does: relay.
    There(String),
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot join the cluster: {0}")]
    Join(#[source] ClusterError),
    #[error("cannot listen for node links on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the cluster cannot say who owns pool \"{0}\" now (etcd: {1})")]
    Claim(String, String),
    #[error("node \"{0}\" is not in the cluster")]
    UnknownNode(String),
    #[error("cannot reach node \"{node}\": {reason}")]
    Unreachable { node: String, reason: String },
}

/// Counters for `/metrics` and the console.
#[derive(Default)]
pub struct ClusterMetrics {
    /// Clients of this node relayed to another now. (Those relayed here are the streams of
    /// the accepted links.)
    pub relayed_out: AtomicU64,
    pub claims: AtomicU64,
    pub redirects: AtomicU64,
}

pub struct Node {
    pub id: String,
    pub slot: u16,
    pub config: Cluster,
    membership: Membership,
    pub links: links::Links,
    pub metrics: ClusterMetrics,
}

/// Joins the cluster: takes a slot, registers under a lease, starts following the others,
/// and accepts node links on `relay_listen`. Pools made from here on start fenced. Run on
/// the control runtime, before clients are accepted.
pub async fn start(app: &Arc<App>, config: Cluster) -> Result<Arc<Node>, NodeError> {
    crate::pool::Fence::clustered();
    let listener = tokio::net::TcpListener::bind(config.relay_listen)
        .await
        .map_err(|source| NodeError::Listen {
            addr: config.relay_listen,
            source,
        })?;
    let relay = listener.local_addr().map_err(|source| NodeError::Listen {
        addr: config.relay_listen,
        source,
    })?;
    let membership = Membership::join(MembershipConfig {
        etcd: config.etcd.clone(),
        node: NodeInfo {
            id: config.node_id.clone(),
            relay: relay.to_string(),
            load: 0,
            slot: 0,
        },
        lease_ttl: config.lease_ttl,
    })
    .await
    .map_err(NodeError::Join)?;
    let slot = membership.slot();
    if slot > crate::cancel::MAX_SLOT {
        return Err(NodeError::Join(ClusterError::NoSlot));
    }
    app.cancels.set_node_slot(slot);
    let node = Arc::new(Node {
        id: config.node_id.clone(),
        slot,
        links: links::Links::new(config.secret.as_bytes()),
        config,
        membership,
        metrics: ClusterMetrics::default(),
    });
    tracing::info!(node = %node.id, slot, relay = %relay, "joined the cluster");
    tokio::spawn(links::accept(listener, app.clone(), node.clone()));
    tokio::spawn(links::upkeep(node.clone()));
    tokio::spawn(fence_on_lapse(app.clone(), node.clone()));
    Ok(node)
}

impl Node {
    /// The live nodes now.
    pub fn nodes(&self) -> shoal_cluster::membership::View {
        self.membership.nodes()
    }

    /// Whether this node's lease is known to be alive.
    pub fn lease_alive(&self) -> bool {
        *self.membership.lease_alive().borrow()
    }

    /// Every pool's recorded owner now.
    pub fn owners(&self) -> shoal_cluster::membership::Owners {
        self.membership.owners()
    }

    /// Where `pool`'s clients are served. A pool this node holds is here; one another node
    /// holds is there; an unheld pool goes to the node rendezvous hashing names, and is
    /// claimed first when that is this node (or when `relayed`: a relaying node chose this
    /// one, and its view of the live nodes may be a moment newer or older than ours).
    pub async fn place(
        self: &Arc<Self>,
        pool: &Arc<Pool>,
        relayed: bool,
    ) -> Result<Place, NodeError> {
        if pool.fence.owned() {
            return Ok(Place::Here);
        }
        let key = &pool.name;
        let claim_here = match self.membership.owners().get(key) {
            Some(n) if *n == self.id => true,
            Some(n) => return Ok(Place::There(n.clone())),
            None => {
                relayed || self.membership.hashed_owner(key).as_deref() == Some(self.id.as_str())
            }
        };
        if !claim_here {
            let hashed = self.membership.hashed_owner(key);
            return Ok(Place::There(hashed.unwrap_or_else(|| self.id.clone())));
        }
        let me = self.clone();
        let k = key.clone();
        let claimed = crate::control::spawn(async move { me.membership.claim(&k).await })
            .await
            .map_err(|e| NodeError::Claim(key.clone(), e.to_string()))?
            .map_err(|e| NodeError::Claim(key.clone(), e.to_string()))?;
        self.metrics.claims.fetch_add(1, Ordering::Relaxed);
        match claimed {
            Claim::Owned => {
                pool.fence.own();
                tracing::info!(pool = %key, node = %self.id, "pool owned by this node");
                Ok(Place::Here)
            }
            Claim::OwnedBy(n) => Ok(Place::There(n)),
        }
    }

    /// Leaves the cluster at shutdown: the others see this node go at once (its pools are
    /// free to be claimed), and the links end, with them the clients relayed here.
    pub async fn leave(&self) {
        self.membership.leave().await;
        for l in self.links.all() {
            l.kill("the node is shutting down");
        }
    }

    /// The relay address of a live node.
    pub fn relay_addr(&self, node: &str) -> Option<String> {
        self.membership.nodes().get(node).map(|n| n.relay.clone())
    }

    /// Passes a cancel request that names no client of this node to the node that issued
    /// its key (or, for a real server's process id, which names none, to every node).
    pub async fn forward_cancel(self: &Arc<Self>, process_id: i32, secret: i32) {
        let nodes = self.membership.nodes();
        let targets: Vec<String> = match crate::cancel::node_slot(process_id) {
            Some(slot) if slot == self.slot => return,
            Some(slot) => nodes
                .values()
                .filter(|n| n.slot == slot)
                .map(|n| n.id.clone())
                .collect(),
            None => nodes.keys().filter(|n| **n != self.id).cloned().collect(),
        };
        for t in targets {
            match self.links.get(self, &t).await {
                Ok(link) => {
                    let _ = link.cancel(process_id, secret);
                }
                Err(e) => tracing::warn!(node = %t, error = %e, "cancel request not passed on"),
            }
        }
    }
}

/// When this node's lease may have lapsed, every pool it owns is fenced at once: no server
/// is opened for it, idle ones are closed and its clients' servers are ended, so this node
/// never acts beside the owner the others will choose once the lease expires.
async fn fence_on_lapse(app: Arc<App>, node: Arc<Node>) {
    let mut alive = node.membership.lease_alive();
    while alive.wait_for(|a| !*a).await.is_ok() {
        let mut fenced = 0;
        for pool in app.routes.pools() {
            if pool.fence.close() {
                fenced += 1;
                pool.close_idle().await;
            }
        }
        tracing::error!(node = %node.id, fenced, "cluster lease lapsed: this node owns no pools now");
        if alive.wait_for(|a| *a).await.is_err() {
            return;
        }
    }
}
