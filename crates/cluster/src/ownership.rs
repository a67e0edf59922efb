//! Who owns a pool: the node rendezvous hashing names ([`crate::hrw`]), confirmed by a key
//! in etcd created in a transaction under the owner's lease. The key is the fence: a node
//! opens upstream servers for a pool only while it holds that key, a second node's
//! transaction fails while the key exists, and the key goes with the owner's lease, so a
//! node that dies or is cut off loses its pools when its lease expires (and stops acting as
//! owner before that: see [`crate::Membership::lease_alive`]).

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

use crate::membership::ClusterError;

/// Where pool owners are recorded: `OWNERS_PREFIX` + pool key.
pub const OWNERS_PREFIX: &str = "/shoal/owners/";

/// The outcome of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This node holds the pool (it did already, or does now).
    Owned,
    /// Another node holds it.
    OwnedBy(String),
}

fn key(pool: &str) -> String {
    format!("{OWNERS_PREFIX}{pool}")
}

/// Claims `pool` for `node` under `lease`: created only if no node holds it.
pub async fn claim(
    client: &mut Client,
    lease: i64,
    node: &str,
    pool: &str,
) -> Result<Claim, ClusterError> {
    let k = key(pool);
    let txn = Txn::new()
        .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            k.clone(),
            node,
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(k, None)]);
    let r = client.txn(txn).await?;
    if r.succeeded() {
        return Ok(Claim::Owned);
    }
    let holder = r
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
            _ => None,
        })
        .unwrap_or_default();
    Ok(if holder == node {
        Claim::Owned
    } else {
        Claim::OwnedBy(holder)
    })
}

/// Gives `pool` up, if `node` holds it (an idle pool moving to the node hashing now names).
pub async fn release(client: &mut Client, node: &str, pool: &str) -> Result<bool, ClusterError> {
    let k = key(pool);
    let txn = Txn::new()
        .when([Compare::value(k.clone(), CompareOp::Equal, node)])
        .and_then([TxnOp::delete(k, None)]);
    Ok(client.txn(txn).await?.succeeded())
}

/// Every pool's owner, as etcd records them now.
pub async fn owners(client: &mut Client) -> Result<Vec<(String, String)>, ClusterError> {
    let r = client
        .get(OWNERS_PREFIX, Some(GetOptions::new().with_prefix()))
        .await?;
    Ok(r.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(&kv.key()[OWNERS_PREFIX.len()..]).into_owned(),
                String::from_utf8_lossy(kv.value()).into_owned(),
            )
        })
        .collect())
}
