//! The cluster as this node sees it, for `SHOW NODES`, `/metrics` and `GET /api/cluster`.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use serde::Serialize;

use super::Node;

#[derive(Debug, Serialize)]
pub struct ClusterStatus {
    /// This node.
    pub node: String,
    pub slot: u16,
    /// Whether this node's lease is known to be alive (false: it acts as owner of nothing).
    pub lease_alive: bool,
    pub nodes: Vec<NodeStatus>,
    /// Clients of this node relayed to others now.
    pub relayed_out: u64,
    /// Of `relayed_out`, those parked now (idle, with no session at the owner), and the
    /// times clients were parked since this node started.
    pub parked: u64,
    pub parks: u64,
    /// Clients other nodes relay here now.
    pub relayed_in: u64,
    pub claims: u64,
    pub redirects: u64,
}

#[derive(Debug, Serialize)]
pub struct NodeStatus {
    pub id: String,
    pub relay: String,
    pub slot: u16,
    /// Clients it last reported.
    pub load: u64,
    /// Pools it owns.
    pub pools: Vec<String>,
    /// This node's links with it (none for this node itself).
    pub links: usize,
    /// Streams (relayed clients) on those links, both ways.
    pub streams: usize,
    /// Bytes received from and sent to it over links since this node started.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Last measured round trip over a link with it, in microseconds (0: not measured).
    pub rtt_us: u64,
}

impl Node {
    pub fn status(&self) -> ClusterStatus {
        let view = self.nodes();
        let owners = self.owners();
        let mut pools: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for (pool, owner) in owners.iter() {
            pools.entry(owner).or_default().push(pool.clone());
        }
        let links = self.links.all();
        let mut relayed_in = 0;
        let nodes = view
            .values()
            .map(|n| {
                let mut s = NodeStatus {
                    id: n.id.clone(),
                    relay: n.relay.clone(),
                    slot: n.slot,
                    load: n.load,
                    pools: pools.remove(n.id.as_str()).unwrap_or_default(),
                    links: 0,
                    streams: 0,
                    bytes_in: 0,
                    bytes_out: 0,
                    rtt_us: 0,
                };
                for l in links
                    .iter()
                    .filter(|l| l.peer() == n.id && l.dead().is_none())
                {
                    s.links += 1;
                    s.streams += l.streams();
                    s.rtt_us = s.rtt_us.max(l.rtt().as_micros() as u64);
                }
                (s.bytes_in, s.bytes_out) = self.links.total_bytes(&n.id);
                s
            })
            .collect();
        for l in self.links.accepted() {
            relayed_in += l.streams() as u64;
        }
        ClusterStatus {
            node: self.id.clone(),
            slot: self.slot(),
            lease_alive: self.lease_alive(),
            nodes,
            relayed_out: self.metrics.relayed_out.load(Ordering::Relaxed),
            relayed_in,
            parked: self.metrics.parked.load(Ordering::Relaxed),
            parks: self.metrics.parks.load(Ordering::Relaxed),
            claims: self.metrics.claims.load(Ordering::Relaxed),
            redirects: self.metrics.redirects.load(Ordering::Relaxed),
        }
    }
}

/// The `shoal_cluster_*` metric families.
pub fn encode(
    node: &Node,
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use shoal_control::metrics::{counter, gauge};
    let s = node.status();
    let one = |v: i64| vec![(vec![], v)];
    gauge(
        e,
        "shoal_cluster_nodes",
        "Live nodes in the cluster, as this node sees them",
        &one(s.nodes.len() as i64),
    )?;
    gauge(
        e,
        "shoal_cluster_lease_alive",
        "1 while this node's etcd lease is known to be alive (0: it owns no pools)",
        &one(i64::from(s.lease_alive)),
    )?;
    let me = s.nodes.iter().find(|n| n.id == s.node);
    gauge(
        e,
        "shoal_cluster_owned_pools",
        "Pools this node owns",
        &one(me.map_or(0, |n| n.pools.len() as i64)),
    )?;
    let relayed = |dir: &'static str, v: u64| {
        (
            vec![("direction", crate::metrics::LabelValue::new(dir))],
            v as i64,
        )
    };
    gauge(
        e,
        "shoal_cluster_relayed_clients",
        "Clients relayed between nodes now: out (this node's, to their pool's owner) and in (other nodes', served here)",
        &[relayed("out", s.relayed_out), relayed("in", s.relayed_in)],
    )?;
    gauge(
        e,
        "shoal_cluster_parked_clients",
        "Relayed clients of this node parked now: idle past park_idle_after, their session at the owner let go until they send again",
        &one(s.parked as i64),
    )?;
    counter(
        e,
        "shoal_cluster_parks",
        "Times a relayed client of this node was parked",
        &[(vec![], s.parks)],
    )?;
    counter(
        e,
        "shoal_cluster_claims",
        "Pool ownership claims this node made in etcd",
        &[(vec![], s.claims)],
    )?;
    counter(
        e,
        "shoal_cluster_takeovers",
        "Pools this node took over at PostgreSQL before serving them (see docs/cluster.md)",
        &[(vec![], node.metrics.takeovers.load(Ordering::Relaxed))],
    )?;
    counter(
        e,
        "shoal_cluster_takeover_ended_sessions",
        "Sessions of earlier owners (their servers and fence sessions) ended at PostgreSQL by this node's take-overs",
        &[(vec![], node.metrics.takeover_ended.load(Ordering::Relaxed))],
    )?;
    counter(
        e,
        "shoal_cluster_redirects",
        "Relayed logins the asked node sent on to another owner",
        &[(vec![], s.redirects)],
    )?;
    let peers: Vec<&NodeStatus> = s.nodes.iter().filter(|n| n.id != s.node).collect();
    let peer = |n: &NodeStatus| vec![("peer", crate::metrics::LabelValue::new(&n.id))];
    let mut bytes = Vec::new();
    for n in &peers {
        let mut l = peer(n);
        l.push(("direction", crate::metrics::LabelValue::new("in")));
        bytes.push((l, n.bytes_in));
        let mut l = peer(n);
        l.push(("direction", crate::metrics::LabelValue::new("out")));
        bytes.push((l, n.bytes_out));
    }
    counter(
        e,
        "shoal_cluster_link_bytes",
        "Bytes over node links with each peer, frames included",
        &bytes,
    )?;
    let rtt: Vec<_> = peers.iter().map(|n| (peer(n), n.rtt_us as i64)).collect();
    gauge(
        e,
        "shoal_cluster_link_rtt_microseconds",
        "Last measured round trip over a link with each peer",
        &rtt,
    )?;
    Ok(())
}
