//! `SHOW NODES`: the cluster as this node sees it.

use super::{n, t, Int, ResultSet, Text};
use crate::app::App;

/// `SHOW NODES`: the cluster's live nodes as this node sees them.
pub fn nodes(app: &App) -> Result<ResultSet, String> {
    let Some(cluster) = app.cluster.get() else {
        return Err("SHOW NODES: this Shoal is not in a cluster (no [cluster] section)".into());
    };
    let status = cluster.status();
    let mut r = ResultSet::new(&[
        ("node", Text),
        ("relay", Text),
        ("slot", Int),
        ("self", Text),
        ("clients", Int),
        ("owned_pools", Int),
        ("links", Int),
        ("relayed_clients", Int),
        ("bytes_in", Int),
        ("bytes_out", Int),
        ("rtt_us", Int),
    ]);
    for node in status.nodes {
        let me = node.id == status.node;
        r.row(vec![
            t(node.id),
            t(node.relay),
            n(node.slot),
            t(if me { "yes" } else { "no" }),
            n(node.load),
            n(node.pools.len()),
            n(node.links),
            n(node.streams),
            n(node.bytes_in),
            n(node.bytes_out),
            n(node.rtt_us),
        ]);
    }
    Ok(r)
}
