//! This process as a node of a Shoal cluster (`[cluster]`), and the pooler's one seam into
//! it: for a client's pool, [`Node::place`] says "here" (this node owns the pool: take a
//! server from it as a single node would) or "there" (relay the client to the owner, see
//! [`pipe`]). Everything else — etcd membership and ownership (the `shoal-cluster` crate),
//! node links, the relay's byte loop — stays behind it.
//!
//! - `handlers`: what this node does with the streams peers open (registered by the
//!   services that take them).
//! - `lease`: this node's registration followed: deadlines, fencing, etcd outages, joining
//!   again.
//! - [`links`]: the node links, outgoing and accepted, and their upkeep.
//! - [`open`]: what a relaying node tells an owner about a client.
//! - [`pipe`]: the relaying node's byte loop between a client and the owner.
//! - [`position`]: where a relayed client stands in the protocol (may it move owners?).
//! - `rebalance`: idle pools given up when hashing names another node.
//! - [`status`]: the cluster as this node sees it (console, metrics, API).
//! - [`tls`]: TLS on node links.
//!
//! etcd is only ever called on the control runtime; a login asks for a claim through
//! [`crate::control::spawn`] and awaits the answer.

mod handlers;
mod lease;
pub mod links;
pub mod open;
pub mod pipe;
pub mod position;
mod rebalance;
pub mod status;
pub mod tls;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use shoal_cluster::ownership::Claim;
use shoal_cluster::{ClusterError, Membership, MembershipConfig, NodeInfo};

use crate::admission::Admission;
use crate::cancel::CancelRegistry;
use crate::config::Cluster;
use crate::pool::Pool;
use crate::route::Registry;
pub use handlers::Handlers;

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
    #[error("node link TLS: {0}")]
    Tls(#[from] tls::NodeTlsError),
    #[error("cannot listen for node links on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the cluster cannot say who owns pool \"{0}\" now (etcd: {1})")]
    Claim(String, String),
    #[error("cannot take pool \"{0}\" over at PostgreSQL: {1}")]
    TakeOver(String, String),
    #[error("node \"{0}\" is not in the cluster")]
    UnknownNode(String),
    #[error("cannot reach node \"{node}\": {reason}")]
    Unreachable { node: String, reason: String },
    /// Nothing answers at the node's address (refused, or no link within the connect
    /// timeout): it may have died, and its pools are about to move.
    #[error("cannot reach node \"{node}\": {reason}")]
    Down { node: String, reason: String },
}

/// Counters for `/metrics` and the console.
#[derive(Default)]
pub struct ClusterMetrics {
    /// Clients of this node relayed to another now. (Those relayed here are the streams of
    /// the accepted links.)
    pub relayed_out: AtomicU64,
    /// Of those, parked now (idle, with no session at the owner), and parked ever.
    pub parked: AtomicU64,
    pub parks: AtomicU64,
    pub claims: AtomicU64,
    pub redirects: AtomicU64,
    /// Pools taken over at PostgreSQL, and the sessions of earlier owners that ended.
    pub takeovers: AtomicU64,
    pub takeover_ended: AtomicU64,
}

/// What the cluster uses of the process it runs in: the pools it owns and fences, the
/// cancel keys it stamps with its slot and serves for peers, the client count it reports.
/// (The services that take relayed streams are reached through [`Handlers`].)
pub struct Host {
    pub routes: Arc<Registry>,
    pub cancels: Arc<CancelRegistry>,
    pub admission: Arc<Admission>,
    /// Where relayed clients and node links are served.
    pub shards: Arc<crate::shard::Shards>,
}

pub struct Node {
    pub id: String,
    pub(crate) host: Host,
    pub config: Cluster,
    /// This node's registration; replaced when the node joins again after its lease expired.
    pub(crate) membership: std::sync::RwLock<Arc<Membership>>,
    /// How it registers (to join again).
    pub(crate) joining: MembershipConfig,
    /// Set when the node leaves at shutdown (no joining again then).
    pub(crate) left: std::sync::atomic::AtomicBool,
    pub links: links::Links,
    pub metrics: ClusterMetrics,
    /// The node serving each client relayed from here, by its cancel key's process id: a
    /// client's cancel comes to the node it connected to, which passes it on.
    relayed: std::sync::Mutex<std::collections::HashMap<i32, String>>,
    /// The idle clock: per shard, [`PARK_PHASES`] ticks, each rung once every half
    /// `park_idle_after`, one after the other. A relayed client waits on one phase of its
    /// shard's (by its cancel key) and is parked when idle through two of its rings (see
    /// [`pipe`]); no idle client holds a timer of its own. The phases spread the parking:
    /// with one tick, every client that went idle in the same half period parked at once,
    /// and the owner's burst of ending sessions stalled the queries behind it for 50-300 ms.
    park_ticks: Vec<[tokio::sync::Notify; PARK_PHASES]>,
    /// The services taking the streams peers open here.
    handlers: Handlers,
}

/// Phases of the idle clock (see [`Node::park_ticks`]).
const PARK_PHASES: usize = 16;

/// Joins the cluster: takes a slot, registers under a lease, starts following the others,
/// and accepts node links on `relay_listen`. Pools made from here on start fenced. Run on
/// the control runtime, before clients are accepted.
pub async fn start(
    host: Host,
    config: Cluster,
    handlers: Handlers,
) -> Result<Arc<Node>, NodeError> {
    host.routes.lease.set_clustered();
    let node_tls = config.tls.as_ref().map(tls::NodeTls::load).transpose()?;
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
    let joining = MembershipConfig {
        etcd: config.etcd.clone(),
        node: NodeInfo {
            id: config.node_id.clone(),
            relay: relay.to_string(),
            load: 0,
            slot: 0,
        },
        lease_ttl: config.lease_ttl,
    };
    let membership = join(&host, &joining).await.map_err(NodeError::Join)?;
    // None when parking is off: no client then waits on a tick.
    let park_ticks = match config.park_idle_after {
        Some(_) => (0..host.shards.count())
            .map(|_| std::array::from_fn(|_| tokio::sync::Notify::new()))
            .collect(),
        None => Vec::new(),
    };
    let node = Arc::new(Node {
        id: config.node_id.clone(),
        host,
        links: links::Links::new(config.secret.as_bytes(), node_tls),
        config,
        membership: std::sync::RwLock::new(Arc::new(membership)),
        joining,
        left: Default::default(),
        metrics: ClusterMetrics::default(),
        relayed: Default::default(),
        park_ticks,
        handlers,
    });
    tracing::info!(node = %node.id, slot = node.slot(), relay = %relay, "joined the cluster");
    tokio::spawn(links::accept(listener, node.clone()));
    tokio::spawn(links::upkeep(node.clone()));
    tokio::spawn(lease::keep(node.clone()));
    tokio::spawn(rebalance::run(node.clone()));
    if let Some(every) = node.config.park_idle_after {
        tokio::spawn(tick_idle_clock(
            Arc::downgrade(&node),
            every / 2 / PARK_PHASES as u32,
        ));
    }
    Ok(node)
}

/// Rings every shard's idle clock, one phase each `every` (see [`Node::park_ticks`]), until
/// the node is gone.
///
/// The first ring comes at a random point of the first period: nodes started together would
/// otherwise ring together for as long as they run, and the owner of a pool they all relay
/// to would take every node's parks at once (with 55 nodes relaying 5,000 queries a second,
/// about 1,500 sessions ended within a few milliseconds, three times a second).
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
async fn tick_idle_clock(node: std::sync::Weak<Node>, every: std::time::Duration) {
    let first = tokio::time::Instant::now() + every.mul_f64(rand::random_range(0.0..1.0));
    let mut tick = tokio::time::interval_at(first, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for phase in (0..PARK_PHASES).cycle() {
        tick.tick().await;
        let Some(node) = node.upgrade() else { return };
        for t in &node.park_ticks {
            t[phase].notify_waiters();
        }
    }
}

impl Node {
    /// The idle clock's tick for a relayed client on this shard with this cancel key's
    /// process id (none when parking is off).
    pub(crate) fn park_tick(&self, process_id: i32) -> Option<&tokio::sync::Notify> {
        let phases = self.park_ticks.get(crate::shard::current())?;
        Some(&phases[process_id.unsigned_abs() as usize % PARK_PHASES])
    }
}

/// Registers this node; the cancel keys made from then on carry its slot.
pub(crate) async fn join(host: &Host, cfg: &MembershipConfig) -> Result<Membership, ClusterError> {
    let m = Membership::join(cfg.clone()).await?;
    if m.slot() > crate::cancel::MAX_SLOT {
        return Err(ClusterError::NoSlot);
    }
    host.cancels.set_node_slot(m.slot());
    host.routes.lease.set_deadline(m.valid_until());
    Ok(m)
}

impl Node {
    /// This node's registration now.
    pub(crate) fn membership(&self) -> Arc<Membership> {
        self.membership
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// This node's slot (carried by its cancel keys).
    pub fn slot(&self) -> u16 {
        self.membership().slot()
    }

    /// The live nodes now.
    pub fn nodes(&self) -> shoal_cluster::membership::View {
        self.membership().nodes()
    }

    /// Whether this node's lease is known to be alive.
    pub fn lease_alive(&self) -> bool {
        *self.membership().lease_alive().borrow()
    }

    /// Every pool's recorded owner now.
    pub fn owners(&self) -> shoal_cluster::membership::Owners {
        self.membership().owners()
    }

    /// The node rendezvous hashing names for `pool` among the live nodes.
    pub fn hashed_owner(&self, pool: &str) -> Option<String> {
        self.membership().hashed_owner(pool)
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
        let membership = self.membership();
        let claim_here = match membership.owners().get(key) {
            Some(n) if *n == self.id => true,
            Some(n) => return Ok(Place::There(n.clone())),
            None => relayed || membership.hashed_owner(key).as_deref() == Some(self.id.as_str()),
        };
        if !claim_here {
            let hashed = membership.hashed_owner(key);
            return Ok(Place::There(hashed.unwrap_or_else(|| self.id.clone())));
        }
        let k = key.clone();
        let claimed = crate::control::spawn(async move { membership.claim(&k).await })
            .await
            .map_err(|e| NodeError::Claim(key.clone(), e.to_string()))?
            .map_err(|e| NodeError::Claim(key.clone(), e.to_string()))?;
        self.metrics.claims.fetch_add(1, Ordering::Relaxed);
        match claimed {
            Claim::Owned => {
                // PostgreSQL is made to refuse any earlier owner before this one serves.
                let _taking = pool.fence.taking_over.lock().await;
                if !pool.fence.owned() {
                    let ended = pool
                        .take_over()
                        .await
                        .map_err(|e| NodeError::TakeOver(key.clone(), e.to_string()))?;
                    self.metrics.takeovers.fetch_add(1, Ordering::Relaxed);
                    self.metrics
                        .takeover_ended
                        .fetch_add(ended as u64, Ordering::Relaxed);
                    pool.fence.own();
                    tracing::info!(pool = %key, node = %self.id, "pool owned by this node");
                }
                Ok(Place::Here)
            }
            Claim::OwnedBy(n) => Ok(Place::There(n)),
        }
    }

    /// Leaves the cluster at shutdown: the others see this node go at once (its pools are
    /// free to be claimed), and the links end, with them the clients relayed here.
    pub async fn leave(&self) {
        self.left.store(true, Ordering::SeqCst);
        self.membership().leave().await;
        for l in self.links.all() {
            l.kill("the node is shutting down");
        }
    }

    /// Whether the node is leaving (shutdown).
    pub fn leaving(&self) -> bool {
        self.left.load(Ordering::Relaxed)
    }

    /// A client relayed from here (by its cancel key's process id) is served by `owner`.
    pub fn relayed_to(&self, process_id: i32, owner: &str) {
        self.relayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(process_id, owner.to_owned());
    }

    pub fn forget_relayed(&self, process_id: i32) {
        let mut relayed = self.relayed.lock().unwrap_or_else(|e| e.into_inner());
        shoal_cluster::tables::remove(&mut relayed, &process_id);
    }

    /// The relay address of a live node.
    pub fn relay_addr(&self, node: &str) -> Option<String> {
        self.nodes().get(node).map(|n| n.relay.clone())
    }

    /// Passes a cancel request that names no client of this node to the node that issued
    /// its key (or, for a real server's process id, which names none, to every node).
    pub async fn forward_cancel(self: &Arc<Self>, process_id: i32, secret: i32) {
        let nodes = self.nodes();
        let relayed = self
            .relayed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&process_id)
            .cloned();
        let targets: Vec<String> = match crate::cancel::node_slot(process_id) {
            // A client of this node, relayed: its owner now (it may have moved).
            _ if relayed.is_some() => relayed.into_iter().collect(),
            Some(slot) if slot == self.slot() => return,
            Some(slot) => nodes
                .values()
                .filter(|n| n.slot == slot)
                .map(|n| n.id.clone())
                .collect(),
            None => nodes.keys().filter(|n| **n != self.id).cloned().collect(),
        };
        for t in targets {
            let passed = match self.links.get(self, &t).await {
                Ok(link) => link.cancel(process_id, secret).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match passed {
                Ok(()) => tracing::debug!(node = %t, "cancel request passed on"),
                Err(e) => tracing::warn!(node = %t, error = %e, "cancel request not passed on"),
            }
        }
    }
}
