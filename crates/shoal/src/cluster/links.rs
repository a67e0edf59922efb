//! Node links as this node has them: one outgoing link per peer and data-plane shard (a
//! relayed client's bytes stay on its session's thread), opened on first use; the links
//! other nodes opened here, each driven on a shard of its own; probes that end a link whose
//! peer stopped answering or left the cluster.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shoal_cluster::link::{self, handshake, Incoming, Link, Side};

use super::{Node, NodeError};
use crate::net::Io;

/// How long a link's connect and handshake may take: long enough for a node busy with a
/// connect storm to answer (at 3 s, thousands of handshakes with overloaded nodes were given
/// up on, and every client waiting for those links failed).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often links are probed; a link whose peer has been silent for [`DEAD_AFTER`] with a
/// probe out ends. A probe wakes the peer's thread for nothing else: in a cluster of 55 idle
/// nodes on two cores, probing every link each second from both ends cost about a quarter
/// of a core, so a link is probed by the end that opened it, only as often as ending a dead
/// one in [`DEAD_AFTER`] needs. A peer that dies is gone sooner: its connections close with
/// its process, and its registration expires with its lease. This catches only a peer alive
/// in etcd but unreachable or hung, so it is slow enough never to end the links of a node
/// that is only overloaded (a million clients connecting at once kept shards from answering for seconds,
/// and ending their links then failed every client relayed over them; at 15 s, nodes
/// starved of CPU under a million connecting clients still ended thousands of links, and
/// opening them again under the same load made it worse).
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How often the upkeep looks at the live nodes (control links to new peers; links to peers
/// that left end).
const UPKEEP_EVERY: Duration = Duration::from_secs(1);
const DEAD_AFTER: Duration = Duration::from_secs(30);

type Cell = Arc<tokio::sync::OnceCell<Link>>;

/// The "shard" of the links the control runtime keeps to every peer (probes, and what the
/// peers' answers say of etcd: see `lease`).
const CONTROL: usize = usize::MAX;

pub struct Links {
    secret: Arc<[u8]>,
    /// TLS for links, when `[cluster]` gives certificates.
    tls: Option<Arc<super::tls::NodeTls>>,
    /// This node's status word, sent to peers that probe its links: milliseconds since its
    /// lease was last renewed.
    pub status: Arc<std::sync::atomic::AtomicU64>,
    /// Outgoing, by (peer, shard).
    out: Mutex<HashMap<(String, usize), Cell>>,
    /// Accepted from other nodes.
    accepted: Mutex<Vec<Link>>,
    /// Bytes in and out over links with each peer that have ended (so the totals only grow).
    retired: Mutex<HashMap<String, (u64, u64)>>,
}

impl Links {
    pub fn new(secret: &[u8], tls: Option<super::tls::NodeTls>) -> Links {
        Links {
            secret: secret.into(),
            tls: tls.map(Arc::new),
            status: Default::default(),
            out: Mutex::new(HashMap::new()),
            accepted: Mutex::new(Vec::new()),
            retired: Mutex::new(HashMap::new()),
        }
    }

    fn retire(&self, l: &Link) {
        let (i, o) = l.bytes();
        let mut r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        let t = r.entry(l.peer().to_owned()).or_default();
        t.0 += i;
        t.1 += o;
    }

    /// Bytes in and out over every link with `peer` since this node started.
    pub fn total_bytes(&self, peer: &str) -> (u64, u64) {
        let mut t = self
            .retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .copied()
            .unwrap_or_default();
        for l in self.all().iter().filter(|l| l.peer() == peer) {
            let (i, o) = l.bytes();
            t.0 += i;
            t.1 += o;
        }
        t
    }

    /// Moves ended links' byte counts into the totals and forgets the links.
    fn forget_dead(&self) {
        let mut dead = Vec::new();
        self.out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, c| match c.get() {
                Some(l) if l.dead().is_some() => {
                    dead.push(l.clone());
                    false
                }
                _ => true,
            });
        self.accepted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|l| {
                if l.dead().is_some() {
                    dead.push(l.clone());
                    return false;
                }
                true
            });
        for l in dead {
            self.retire(&l);
        }
    }

    /// This shard's link to `peer`, opened if there is none (or the last one died).
    pub async fn get(&self, node: &Arc<Node>, peer: &str) -> Result<Link, NodeError> {
        self.get_on(node, peer, crate::shard::current()).await
    }

    /// The control runtime's link to `peer` (realtime broadcasts go there), opened if
    /// there is none.
    pub async fn control(&self, node: &Arc<Node>, peer: &str) -> Result<Link, NodeError> {
        self.get_on(node, peer, CONTROL).await
    }

    /// What `peer` said of itself in its last answer to a probe of the control link (and
    /// when).
    pub fn control_status(&self, peer: &str) -> Option<(u64, std::time::Instant)> {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let l = out.get(&(peer.to_owned(), CONTROL))?.get()?;
        l.dead().is_none().then(|| l.peer_status()).flatten()
    }

    /// Whether this node has a live control link to `peer`.
    fn has_control(&self, peer: &str) -> bool {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.get(&(peer.to_owned(), CONTROL))
            .and_then(|c| c.get())
            .is_some_and(|l| l.dead().is_none())
    }

    /// Probes every control link now (a probe already out is not repeated).
    pub fn probe_control(&self) {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        for ((_, shard), c) in out.iter() {
            if let (CONTROL, Some(l)) = (*shard, c.get()) {
                l.ping();
            }
        }
    }

    async fn get_on(&self, node: &Arc<Node>, peer: &str, shard: usize) -> Result<Link, NodeError> {
        let key = (peer.to_owned(), shard);
        let cell = {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            let cell = out.entry(key).or_default();
            if let Some(dead) = cell.get().filter(|l| l.dead().is_some()) {
                self.retire(dead);
                *cell = Cell::default();
            }
            cell.clone()
        };
        cell.get_or_try_init(|| self.connect(node, peer))
            .await
            .cloned()
    }

    async fn connect(&self, node: &Arc<Node>, peer: &str) -> Result<Link, NodeError> {
        let unreachable = |reason: String| NodeError::Unreachable {
            node: peer.to_owned(),
            reason,
        };
        let addr = node
            .relay_addr(peer)
            .ok_or_else(|| NodeError::UnknownNode(peer.to_owned()))?;
        let secret = self.secret.clone();
        let me = node.id.clone();
        let tls = self.tls.clone();
        let down = |reason: String| NodeError::Down {
            node: peer.to_owned(),
            reason,
        };
        let tcp = crate::timer::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&addr))
            .await
            .map_err(|_| down(format!("{addr}: no answer within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| down(format!("{addr}: {e}")))?;
        let dial = async move {
            let _ = tcp.set_nodelay(true);
            let mut io: Box<dyn Io> = match tls {
                None => Box::new(tcp),
                Some(tls) => {
                    let name = super::tls::server_name(&addr)
                        .ok_or_else(|| format!("{addr}: not a host name or address"))?;
                    Box::new(
                        tls.connector
                            .connect(name, tcp)
                            .await
                            .map_err(|e| format!("TLS with {addr}: {e}"))?,
                    )
                }
            };
            let theirs = handshake::connect(&mut io, &secret, &me)
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((io, theirs))
        };
        let (io, theirs) = crate::timer::timeout(CONNECT_TIMEOUT, dial)
            .await
            .map_err(|_| unreachable(format!("no link within {CONNECT_TIMEOUT:?}")))?
            .map_err(unreachable)?;
        if theirs != peer {
            return Err(unreachable(format!("the node there is \"{theirs}\"")));
        }
        let (l, incoming) = Link::new(theirs, Side::Connector, self.status.clone());
        tracing::info!(peer, shard = crate::shard::current(), "node link opened");
        tokio::spawn(run(io, l.clone(), incoming, None));
        Ok(l)
    }

    /// The links other nodes opened here, alive now.
    pub fn accepted(&self) -> Vec<Link> {
        self.accepted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|l| l.dead().is_none())
            .cloned()
            .collect()
    }

    /// Every link now, outgoing then accepted.
    pub fn all(&self) -> Vec<Link> {
        let mut v: Vec<Link> = self
            .out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|c| c.get().cloned())
            .collect();
        v.extend(
            self.accepted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .cloned(),
        );
        v
    }
}

/// Drives a link until it ends. On an accepted link (`node` given) it serves what the peer
/// asks of this node: its relayed clients and its cancels. The peer of an outgoing link asks
/// nothing.
async fn run(
    io: Box<dyn Io>,
    l: Link,
    mut incoming: tokio::sync::mpsc::UnboundedReceiver<Incoming>,
    accepted: Option<Arc<Node>>,
) {
    let serve = async {
        while let Some(inc) = incoming.recv().await {
            let Some(node) = &accepted else {
                continue;
            };
            match inc {
                Incoming::Stream(s, what) => node.handlers.dispatch(s, what),
                Incoming::Cancel(pid, key) => {
                    let cancels = node.host.cancels.clone();
                    tokio::spawn(async move {
                        cancels.cancel(pid, key).await;
                    });
                }
            }
        }
    };
    let peer = l.peer().to_owned();
    let why = tokio::select! {
        why = link::drive(io, l.clone()) => why,
        _ = serve => l.dead().unwrap_or_else(|| "stopped".into()),
    };
    tracing::warn!(peer = %peer, reason = %why, "node link ended");
}

/// Accepts node links on the relay listener: each proves the cluster secret, then runs on a
/// data-plane shard of its own (round robin), where the clients it relays are served.
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
pub async fn accept(listener: tokio::net::TcpListener, node: Arc<Node>) {
    let mut next_shard = 0usize;
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "node link accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        // On a shard taking clients (packing may keep others closed): its relayed clients
        // are served where the local ones are.
        let shard = node.host.shards.round_robin(next_shard);
        let handle = node.host.shards.handle(shard).cloned();
        next_shard += 1;
        let node = node.clone();
        // Proved, then driven, on the shard whose clients it will carry.
        let start = move |tcp: tokio::net::TcpStream| async move {
            let proved = crate::timer::timeout(CONNECT_TIMEOUT, prove(tcp, &node)).await;
            let (io, peer) = match proved {
                Ok(Ok(x)) => x,
                Ok(Err(e)) => {
                    tracing::warn!(%addr, error = %e, "node link refused");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%addr, "node link refused: no handshake in time");
                    return;
                }
            };
            let (l, incoming) = Link::new(peer.clone(), Side::Acceptor, node.links.status.clone());
            node.links
                .accepted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(l.clone());
            tracing::info!(%peer, shard, "node link accepted");
            let accepted = Some(node.clone());
            run(io, l, incoming, accepted).await;
        };
        match (handle, tcp.into_std()) {
            (Some(h), Ok(std)) => {
                h.spawn(async move {
                    match tokio::net::TcpStream::from_std(std) {
                        Ok(tcp) => start(tcp).await,
                        Err(e) => tracing::warn!(error = %e, "node link lost moving to a shard"),
                    }
                });
            }
            (None, Ok(std)) => {
                if let Ok(tcp) = tokio::net::TcpStream::from_std(std) {
                    tokio::spawn(start(tcp));
                }
            }
            (_, Err(e)) => tracing::warn!(error = %e, "node link lost"),
        }
    }
}

/// An accepted connection's TLS (when configured) and its proof of the cluster secret;
/// returns the stream and the peer's node id.
async fn prove(tcp: tokio::net::TcpStream, node: &Node) -> Result<(Box<dyn Io>, String), String> {
    let mut io: Box<dyn Io> = match &node.links.tls {
        None => Box::new(tcp),
        Some(tls) => Box::new(
            tls.acceptor
                .accept(tcp)
                .await
                .map_err(|e| format!("TLS: {e}"))?,
        ),
    };
    let peer = handshake::accept(&mut io, &node.links.secret, &node.id)
        .await
        .map_err(|e| e.to_string())?;
    Ok((io, peer))
}

/// Each second: opens a control link to every live peer that has none, and ends links to
/// peers that left the cluster. Every [`PROBE_EVERY`]: probes every link, ending those whose
/// peer stopped answering, and reports this node's load (its clients) in its registration.
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
pub async fn upkeep(node: Arc<Node>) {
    let mut tick = tokio::time::interval(UPKEEP_EVERY);
    let probe_every = (PROBE_EVERY.as_secs() / UPKEEP_EVERY.as_secs()).max(1);
    let mut tick_no = 0u64;
    loop {
        tick.tick().await;
        let live = node.nodes();
        // A control link to every live peer (opened apart: a peer that does not answer
        // must not hold the others up).
        for peer in live.keys().filter(|p| **p != node.id) {
            if node.links.has_control(peer) {
                continue;
            }
            let (n, p) = (node.clone(), peer.clone());
            tokio::spawn(async move {
                let _ = n.links.get_on(&n, &p, CONTROL).await;
            });
        }
        let probing = tick_no.is_multiple_of(probe_every);
        for l in node.links.all() {
            if l.dead().is_some() {
                continue;
            }
            if !live.contains_key(l.peer()) {
                l.kill("the peer left the cluster");
            } else if probing && l.silent_for() > DEAD_AFTER {
                l.kill("the peer stopped answering");
            } else if probing && (l.side() == Side::Connector || l.quiet_for() >= 2 * PROBE_EVERY) {
                // The peer probes the links it opened: this end probes one only once the
                // peer's probes stop coming.
                l.ping();
            }
        }
        node.links.forget_dead();
        // The load others see (`SHOW NODES`), every few seconds when it changed.
        if probing {
            let load = node
                .host
                .admission
                .clients
                .load(std::sync::atomic::Ordering::Relaxed) as u64;
            let m = node.membership();
            if let Err(e) = m.set_load(load).await {
                tracing::debug!(error = %e, "cluster: load not updated");
            }
        }
        tick_no += 1;
    }
}
