//! A node's membership: registered in etcd under a lease it keeps alive, and a live view of
//! every registered node, kept by watching the registrations.
//!
//! Each node puts `NODES_PREFIX<node_id>` (its relay address and load, as JSON) under a
//! lease of `lease_ttl`, renewed four times per TTL. A node that dies stops renewing; etcd
//! deletes its key when the lease expires, and every other node's watch sees it go: within
//! `lease_ttl` of its last renewal. A node that leaves revokes its lease, and is gone at
//! once. If this node cannot renew in time, [`Membership::lease_alive`] turns false before
//! the lease can expire on etcd's side, so what depends on it (pool ownership) stops first.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where nodes register: `NODES_PREFIX` + node id.
pub const NODES_PREFIX: &str = "/shoal/nodes/";

/// What a node tells the others about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: String,
    /// The node-to-node address other nodes relay clients to.
    pub relay: String,
    /// Clients connected (a hint for operators and balancing).
    pub load: u64,
    /// A small number no other live node has (set by [`Membership::join`]): the cancel keys
    /// this node issues carry it, so a cancel reaching any node finds the node to pass it to.
    #[serde(default)]
    pub slot: u16,
}

/// Where slots are held: `SLOTS_PREFIX` + slot number, under the holder's lease.
pub const SLOTS_PREFIX: &str = "/shoal/slots/";
/// Slots there are (cancel keys have room for 7 bits).
pub const MAX_SLOTS: u16 = 128;

/// What joining needs.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    pub etcd: Vec<String>,
    pub node: NodeInfo,
    pub lease_ttl: Duration,
}

/// The live nodes, by id.
pub type View = Arc<BTreeMap<String, NodeInfo>>;

/// Every pool's owner node as etcd records it, by pool key.
pub type Owners = Arc<BTreeMap<String, String>>;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("lease_ttl must be at least 2 s (is {0:?})")]
    LeaseTooShort(Duration),
    #[error("node {0} is already registered (another node with that node_id runs)")]
    DuplicateNode(String),
    #[error("all {MAX_SLOTS} node slots are taken: too many nodes")]
    NoSlot,
}

/// This node's registration and view; dropping it stops renewing (as a crash would),
/// [`Membership::leave`] deregisters at once.
pub struct Membership {
    client: Client,
    lease: i64,
    node_id: String,
    view: watch::Receiver<View>,
    owners: watch::Receiver<Owners>,
    alive: watch::Receiver<bool>,
    renewed: watch::Receiver<std::time::Instant>,
    lease_ttl: Duration,
    slot: u16,
    /// What this node registered (its load is updated).
    me: std::sync::Mutex<NodeInfo>,
    tasks: Vec<JoinHandle<()>>,
}

impl Membership {
    /// Registers this node and starts following the others. Fails if etcd cannot be reached
    /// or a live node already has this id. A registration of this id left by a process that
    /// stopped (restarted within its lease) is waited out: its lease is not renewed, and
    /// expires within its TTL.
    pub async fn join(mut cfg: MembershipConfig) -> Result<Membership, ClusterError> {
        if cfg.lease_ttl < Duration::from_secs(2) {
            return Err(ClusterError::LeaseTooShort(cfg.lease_ttl));
        }
        let mut client = Client::connect(&cfg.etcd, Some(connect_options(cfg.lease_ttl))).await?;
        let granted = std::time::Instant::now();
        let lease = client
            .lease_grant(cfg.lease_ttl.as_secs() as i64, None)
            .await?
            .id();
        cfg.node.slot = match take_slot(&mut client, lease, &cfg.node.id).await {
            Ok(s) => s,
            Err(e) => {
                let _ = client.lease_revoke(lease).await;
                return Err(e);
            }
        };
        let key = format!("{NODES_PREFIX}{}", cfg.node.id);
        let value = serde_json::to_vec(&cfg.node).expect("plain data serialises");
        // Created only if absent: two processes with one node_id must not both register.
        if !register(&mut client, key, value, lease).await? {
            let _ = client.lease_revoke(lease).await;
            return Err(ClusterError::DuplicateNode(cfg.node.id));
        }
        let (alive_tx, alive) = watch::channel(true);
        let (renewed_tx, renewed) = watch::channel(granted);
        let (view_tx, view) = watch::channel(View::default());
        let (owners_tx, owners) = watch::channel(Owners::default());
        let tasks = vec![
            tokio::spawn(keep_alive(
                client.clone(),
                lease,
                cfg.lease_ttl,
                alive_tx,
                renewed_tx,
            )),
            tokio::spawn(follow(client.clone(), NODES_PREFIX, parse_node, view_tx)),
            tokio::spawn(follow(
                client.clone(),
                crate::ownership::OWNERS_PREFIX,
                parse_owner,
                owners_tx,
            )),
        ];
        let mut m = Membership {
            client,
            lease,
            node_id: cfg.node.id.clone(),
            view,
            owners,
            alive,
            renewed,
            lease_ttl: cfg.lease_ttl,
            slot: cfg.node.slot,
            me: std::sync::Mutex::new(cfg.node.clone()),
            tasks,
        };
        // Return once the view holds this node: callers can rely on seeing themselves.
        let me = cfg.node.id;
        let _ = m.view.wait_for(|v| v.contains_key(&me)).await;
        Ok(m)
    }

    /// Claims `pool` for this node (see [`crate::ownership`]).
    pub async fn claim(&self, pool: &str) -> Result<crate::ownership::Claim, ClusterError> {
        crate::ownership::claim(&mut self.client.clone(), self.lease, &self.node_id, pool).await
    }

    /// Gives `pool` up if this node holds it.
    pub async fn release(&self, pool: &str) -> Result<bool, ClusterError> {
        crate::ownership::release(&mut self.client.clone(), &self.node_id, pool).await
    }

    /// The node that owns `pool` by rendezvous hashing over the live nodes.
    pub fn hashed_owner(&self, pool: &str) -> Option<String> {
        let view = self.nodes();
        crate::hrw::owner(pool, view.keys().map(String::as_str)).map(str::to_owned)
    }

    /// Updates the load this node's registration reports (under its lease, as registered).
    /// Nothing is written when it did not change.
    pub async fn set_load(&self, load: u64) -> Result<(), ClusterError> {
        let (key, value) = {
            let mut me = self.me.lock().unwrap_or_else(|e| e.into_inner());
            if me.load == load {
                return Ok(());
            }
            me.load = load;
            (
                format!("{NODES_PREFIX}{}", me.id),
                serde_json::to_vec(&*me).expect("plain data serialises"),
            )
        };
        self.client
            .clone()
            .put(key, value, Some(PutOptions::new().with_lease(self.lease)))
            .await?;
        Ok(())
    }

    /// This node's slot (see [`NodeInfo::slot`]).
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// Every pool's recorded owner now.
    pub fn owners(&self) -> Owners {
        self.owners.borrow().clone()
    }

    /// A receiver of every change of the pools' owners.
    pub fn watch_owners(&self) -> watch::Receiver<Owners> {
        self.owners.clone()
    }

    /// The live nodes now.
    pub fn nodes(&self) -> View {
        self.view.borrow().clone()
    }

    /// A receiver of every change of the live nodes.
    pub fn watch(&self) -> watch::Receiver<View> {
        self.view.clone()
    }

    /// False once this node may no longer be registered (its lease could not be renewed in
    /// time): it must stop acting as an owner.
    pub fn lease_alive(&self) -> watch::Receiver<bool> {
        self.alive.clone()
    }

    /// Until when this node's lease is surely alive: etcd extends it by the TTL from when it
    /// handles a renewal, which is after this node sent it; nine tenths of the TTL after the
    /// last confirmed renewal was sent leaves a margin for the clocks' rates and for acting
    /// on it. Moves on with each renewal; [`Membership::renewals`] says when.
    pub fn valid_until(&self) -> std::time::Instant {
        *self.renewed.borrow() + self.lease_ttl * 9 / 10
    }

    /// A receiver that changes at each confirmed renewal.
    pub fn renewals(&self) -> watch::Receiver<std::time::Instant> {
        self.renewed.clone()
    }

    /// Deregisters now (revokes the lease): the others see this node go at once, and the
    /// pools it held are free.
    pub async fn leave(&self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = self.client.clone().lease_revoke(self.lease).await;
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// How the client reaches etcd. HTTP/2 pings find a connection that stopped answering (a
/// cut link, a paused etcd) within a fraction of the TTL, and the client connects again;
/// without them requests would wait on a dead connection for as long as TCP retransmits.
fn connect_options(ttl: Duration) -> ConnectOptions {
    let ping = (ttl / 8).clamp(Duration::from_millis(250), Duration::from_secs(5));
    ConnectOptions::new()
        .with_keep_alive(ping, ping)
        .with_keep_alive_while_idle(true)
        .with_connect_timeout(ttl / 4)
}

/// Registers `key` under `lease`, waiting out a registration of the same key that nobody
/// renews (this node's, left by a process that stopped): whether it registered.
async fn register(
    client: &mut Client,
    key: String,
    value: Vec<u8>,
    lease: i64,
) -> Result<bool, ClusterError> {
    if create_under_lease(client, key.clone(), value.clone(), lease).await? {
        return Ok(true);
    }
    let Some(old) = client
        .get(key.clone(), None)
        .await?
        .kvs()
        .first()
        .map(|kv| kv.lease())
    else {
        return create_under_lease(client, key, value, lease).await;
    };
    // Its lease's time left now (in whole seconds, rounded down): a live holder renews it
    // before it runs out, a stopped one does not. etcd revokes an expired lease on its own
    // next check, so a little more is allowed; waited for in steps, so a stale key goes as
    // soon as etcd drops it.
    let left = client.lease_time_to_live(old, None).await?.ttl();
    let until = tokio::time::Instant::now() + Duration::from_secs(left.max(0) as u64 + 3);
    // This node's own new lease (its slot is under it) is kept alive meanwhile.
    let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        keeper.keep_alive().await?;
        answers.message().await?;
        if create_under_lease(client, key.clone(), value.clone(), lease).await? {
            tracing::info!(
                key,
                "cluster: a stale registration of this node expired; registered"
            );
            return Ok(true);
        }
    }
    Ok(false)
}

/// Renews the lease four times per TTL (after a failure, every [`RETRY`]). Gives up (and says so) when a renewal has not been
/// confirmed for two thirds of the TTL: the lease may expire before the next could land.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    ttl: Duration,
    alive: watch::Sender<bool>,
    renewed_at: watch::Sender<std::time::Instant>,
) {
    let period = ttl / 4;
    let deadline = ttl * 2 / 3;
    let mut last_ok = tokio::time::Instant::from_std(*renewed_at.borrow());
    let mut stream = None;
    loop {
        if stream.is_none() {
            // Bounded: with etcd down, opening the stream may wait on a connection.
            stream = tokio::time::timeout(period, client.lease_keep_alive(lease))
                .await
                .ok()
                .and_then(Result::ok);
        }
        // etcd extends the lease from when it handles the renewal, which is after this.
        let sent = tokio::time::Instant::now();
        let renewed = match stream.as_mut() {
            Some((keeper, responses)) => {
                let round = async {
                    keeper.keep_alive().await?;
                    responses.message().await
                };
                match tokio::time::timeout(period, round).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => true,
                    Ok(Ok(Some(_))) => {
                        // etcd says the lease is gone: this registration is over.
                        tracing::error!(
                            lease,
                            "cluster: lease expired; this node is no longer registered"
                        );
                        let _ = alive.send(false);
                        return;
                    }
                    _ => {
                        stream = None;
                        false
                    }
                }
            }
            None => false,
        };
        if renewed {
            last_ok = sent;
            renewed_at.send_replace(sent.into_std());
            if alive.send_if_modified(|a| !std::mem::replace(a, true)) {
                tracing::info!(lease, "cluster: the lease is renewed again");
            }
        } else if last_ok.elapsed() >= deadline {
            // Said once per outage, not at every try.
            if alive.send_if_modified(|a| std::mem::replace(a, false)) {
                tracing::error!(
                    lease,
                    "cluster: cannot renew the lease in time; stopping as an owner until it is renewed or this node joins again"
                );
            }
            // A renewal of a lease etcd dropped may fail rather than answer "gone": ask.
            if lease_gone(&mut client, lease, period).await {
                tracing::error!(
                    lease,
                    "cluster: lease expired; this node is no longer registered"
                );
                return;
            }
        }
        // After a failure, again soon: once etcd is back, the peers that reach it first stop
        // vouching for this node, which then has only a quarter TTL to renew before it
        // fences its pools (see the pooler's `cluster::lease`).
        let pause = if renewed {
            period.saturating_sub(Duration::from_millis(10))
        } else {
            RETRY.min(period)
        };
        tokio::time::sleep(pause).await;
    }
}

/// Whether etcd answers that `lease` no longer exists (not when it cannot be asked).
async fn lease_gone(client: &mut Client, lease: i64, limit: Duration) -> bool {
    match tokio::time::timeout(limit, client.lease_time_to_live(lease, None)).await {
        Ok(Ok(r)) => r.ttl() <= 0,
        // etcd's own words for it (`ErrGRPCLeaseNotFound`).
        Ok(Err(etcd_client::Error::GRpcStatus(s))) => s.message().contains("lease not found"),
        _ => false,
    }
}

/// How soon a failed renewal is tried again.
const RETRY: Duration = Duration::from_millis(100);

/// Puts `key` under `lease` only if no such key exists (in one transaction); whether it did.
async fn create_under_lease(
    client: &mut Client,
    key: String,
    value: Vec<u8>,
    lease: i64,
) -> Result<bool, ClusterError> {
    let txn = etcd_client::Txn::new()
        .when([etcd_client::Compare::create_revision(
            key.clone(),
            etcd_client::CompareOp::Equal,
            0,
        )])
        .and_then([etcd_client::TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
    Ok(client.txn(txn).await?.succeeded())
}

/// The lowest free slot, taken under `lease` (created only if free: two joining nodes never
/// share one).
async fn take_slot(client: &mut Client, lease: i64, node: &str) -> Result<u16, ClusterError> {
    let taken = client
        .get(
            SLOTS_PREFIX,
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await?;
    let used: std::collections::HashSet<u16> = taken
        .kvs()
        .iter()
        .filter_map(|kv| {
            std::str::from_utf8(&kv.key()[SLOTS_PREFIX.len()..])
                .ok()?
                .parse()
                .ok()
        })
        .collect();
    for slot in (0..MAX_SLOTS).filter(|s| !used.contains(s)) {
        let key = format!("{SLOTS_PREFIX}{slot}");
        if create_under_lease(client, key, node.as_bytes().to_vec(), lease).await? {
            return Ok(slot);
        }
    }
    Err(ClusterError::NoSlot)
}

fn parse_node(_key: &str, value: &[u8]) -> Option<NodeInfo> {
    serde_json::from_slice(value).ok()
}

fn parse_owner(_key: &str, value: &[u8]) -> Option<String> {
    String::from_utf8(value.to_vec()).ok()
}

/// Keeps `view` equal to the keys under `prefix` (by the rest of their key): a full read,
/// then a watch from the revision after it; read again after any watch failure.
async fn follow<V: Clone + Send + Sync + 'static>(
    mut client: Client,
    prefix: &'static str,
    parse: fn(&str, &[u8]) -> Option<V>,
    view: watch::Sender<Arc<BTreeMap<String, V>>>,
) {
    let mut wait = Duration::from_millis(100);
    loop {
        let started = tokio::time::Instant::now();
        if let Err(e) = follow_once(&mut client, prefix, parse, &view).await {
            // The view stays as last known meanwhile.
            if started.elapsed() > Duration::from_secs(10) {
                wait = Duration::from_millis(100);
            }
            if wait == Duration::from_millis(100) {
                tracing::warn!(error = %e, prefix, "cluster: lost a watch; reading again");
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(2));
        }
    }
}

async fn follow_once<V: Clone>(
    client: &mut Client,
    prefix: &str,
    parse: fn(&str, &[u8]) -> Option<V>,
    view: &watch::Sender<Arc<BTreeMap<String, V>>>,
) -> Result<(), ClusterError> {
    let name =
        |key: &[u8]| String::from_utf8_lossy(&key[prefix.len().min(key.len())..]).into_owned();
    let got = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let revision = got.header().map_or(0, |h| h.revision());
    let mut items = BTreeMap::new();
    for kv in got.kvs() {
        let k = name(kv.key());
        if let Some(v) = parse(&k, kv.value()) {
            items.insert(k, v);
        }
    }
    view.send_replace(Arc::new(items.clone()));
    let mut stream = client
        .watch(
            prefix,
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await?;
    while let Some(resp) = stream.message().await? {
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let k = name(kv.key());
            match ev.event_type() {
                EventType::Put => {
                    if let Some(v) = parse(&k, kv.value()) {
                        items.insert(k, v);
                    }
                }
                EventType::Delete => {
                    items.remove(&k);
                }
            }
        }
        view.send_replace(Arc::new(items.clone()));
    }
    Err(ClusterError::Etcd(etcd_client::Error::WatchError(
        "the watch ended".into(),
    )))
}
