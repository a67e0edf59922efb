//! Realtime broadcasts between the nodes of a cluster, over Shoal's node links: each node
//! keeps one stream to every other live node on its control link (the data plane's
//! threads never carry them) and writes every broadcast of its own clients to it; the
//! nodes that receive one deliver it to their own subscribers.
//!
//! A peer's queue is bounded: a broadcast that finds it full (a link that cannot keep up
//! for 65,536 messages) is not relayed and is counted, as Phoenix's PubSub drops what a
//! node cannot take; a stream that fails is opened again while the peer is in the view.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use shoal_realtime::fabric::{self, Relay};
use shoal_realtime::protocol::UserBroadcast;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::app::App;
use crate::cluster::Node;

/// What a realtime stream's opening says, to tell it from a relayed client's.
pub const OPENING: &[u8] = b"shoal-realtime/1";

/// Broadcasts waiting for one peer's stream.
const QUEUE: usize = 65_536;

pub struct NodeRelay {
    node: Arc<Node>,
    peers: Mutex<HashMap<String, tokio::sync::mpsc::Sender<Bytes>>>,
    pub dropped: AtomicU64,
}

impl NodeRelay {
    pub fn new(node: Arc<Node>) -> NodeRelay {
        NodeRelay {
            node,
            peers: Mutex::default(),
            dropped: AtomicU64::new(0),
        }
    }
}

impl Relay for NodeRelay {
    fn publish(&self, tenant: &str, b: &UserBroadcast) {
        let frame = match fabric::encode(tenant, b) {
            Ok(f) => Bytes::from(f),
            Err(e) => {
                tracing::warn!(tenant, error = %e, "broadcast not relayed to other nodes");
                return;
            }
        };
        let view = self.node.nodes();
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        // Peers gone from the view end their writers (their queue's sender is dropped).
        peers.retain(|id, tx| view.contains_key(id) && !tx.is_closed());
        for id in view.keys().filter(|id| **id != self.node.id) {
            let tx = peers.entry(id.clone()).or_insert_with(|| {
                let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
                crate::control::spawn(write_to(self.node.clone(), id.clone(), rx));
                tx
            });
            if tx.try_send(frame.clone()).is_err() {
                let n = self.dropped.fetch_add(1, Ordering::Relaxed);
                if n.is_power_of_two() {
                    tracing::warn!(peer = %id, dropped = n + 1, "realtime broadcasts not relayed: the node link is behind");
                }
            }
        }
    }
}

/// Writes `peer`'s queue to a realtime stream, opening it again when it fails, until the
/// queue ends (the peer left the view).
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
async fn write_to(node: Arc<Node>, peer: String, mut queue: tokio::sync::mpsc::Receiver<Bytes>) {
    loop {
        let opened = match node.links.control(&node, &peer).await {
            Ok(link) => link.open(OPENING).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let mut stream = match opened {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(peer = %peer, error = %e, "no realtime stream to the peer yet");
                if queue.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let Some(frame) = queue.recv().await else {
                return;
            };
            if let Err(e) = stream.write_all(&frame).await {
                tracing::warn!(peer = %peer, error = %e, "realtime stream to the peer failed");
                break;
            }
        }
    }
}

/// Reads broadcasts another node relays on `stream` and delivers them to this node's
/// subscribers.
pub async fn receive(app: Arc<App>, mut stream: shoal_cluster::link::LinkStream) {
    let peer = stream.peer().to_owned();
    loop {
        let mut prefix = [0u8; 4];
        if stream.read_exact(&mut prefix).await.is_err() {
            return;
        }
        let frame = match fabric::frame_len(prefix) {
            Ok(n) => {
                let mut buf = BytesMut::zeroed(n);
                if stream.read_exact(&mut buf).await.is_err() {
                    return;
                }
                fabric::decode(buf.freeze())
            }
            Err(e) => Err(e),
        };
        match (frame, app.realtime.get()) {
            (Ok((tenant, b)), Some(service)) => service.deliver_relayed(&tenant, &b),
            (Ok(_), None) => {}
            (Err(e), _) => {
                tracing::warn!(peer = %peer, error = %e, "realtime stream from the peer ended");
                return;
            }
        }
    }
}
