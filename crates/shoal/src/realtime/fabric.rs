//! Realtime between the nodes of a cluster, over Shoal's node links: each node keeps one
//! stream to every other live node on its control link (the data plane's threads never
//! carry them) and writes to it every broadcast and presence change of its own clients;
//! the nodes that receive one deliver it to their own subscribers. Each new stream starts
//! with a reset and this node's presences, so a peer's view of them is whole again after a
//! lost stream; when a stream ends, its node's presences leave.
//!
//! A peer's queue is bounded: a broadcast that finds it full (a link that cannot keep up
//! for 65,536 messages) is not relayed and is counted, as Phoenix's PubSub drops what a
//! node cannot take; a stream that fails is opened again while the peer is in the view.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use shoal_realtime::edge::Service;
use shoal_realtime::fabric::{self, PresenceChange, Relay, Relayed};
use shoal_realtime::protocol::UserBroadcast;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::app::App;
use crate::cluster::Node;

/// What a realtime stream's opening says, to tell it from a relayed client's.
pub const OPENING: &[u8] = b"shoal-realtime/1";

/// Broadcasts waiting for one peer's stream.
const QUEUE: usize = 65_536;

/// How long a peer's stream waits for this node's realtime service to start.
const SERVICE_WAIT: Duration = Duration::from_secs(10);

pub struct NodeRelay {
    node: Arc<Node>,
    /// The service whose clients' messages this relays (weak: the service holds this).
    service: std::sync::Weak<Service>,
    peers: Mutex<HashMap<String, tokio::sync::mpsc::Sender<Bytes>>>,
    pub dropped: AtomicU64,
}

impl NodeRelay {
    pub fn new(node: Arc<Node>, service: std::sync::Weak<Service>) -> NodeRelay {
        NodeRelay {
            node,
            service,
            peers: Mutex::default(),
            dropped: AtomicU64::new(0),
        }
    }
}

impl Relay for NodeRelay {
    fn publish(&self, tenant: &str, b: &UserBroadcast) {
        match fabric::encode(tenant, b) {
            Ok(f) => self.send(Bytes::from(f)),
            Err(e) => tracing::warn!(tenant, error = %e, "broadcast not relayed to other nodes"),
        }
    }

    fn presence(&self, tenant: &str, change: &PresenceChange) {
        match fabric::encode_presence(tenant, change) {
            Ok(f) => self.send(Bytes::from(f)),
            Err(e) => tracing::warn!(tenant, error = %e, "presence not relayed to other nodes"),
        }
    }
}

impl NodeRelay {
    /// Keeps a stream to every live peer (a node that joins learns this node's presences
    /// at once, not at its next message), looking twice a second.
    // Runs on the control runtime, which has tokio's time driver.
    #[allow(clippy::disallowed_methods)]
    pub fn keep_streams(self: &Arc<Self>) {
        let relay = Arc::downgrade(self);
        crate::control::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let Some(relay) = relay.upgrade() else {
                    return;
                };
                relay.send_to_peers(None);
            }
        });
    }

    /// Queues `frame` for every other live node.
    fn send(&self, frame: Bytes) {
        self.send_to_peers(Some(frame));
    }

    /// Queues `frame` (if any) for every other live node, starting a writer for each peer
    /// that has none and ending those of peers gone from the view.
    fn send_to_peers(&self, frame: Option<Bytes>) {
        let view = self.node.nodes();
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        // Peers gone from the view end their writers (their queue's sender is dropped).
        peers.retain(|id, tx| view.contains_key(id) && !tx.is_closed());
        for id in view.keys().filter(|id| **id != self.node.id) {
            let tx = peers.entry(id.clone()).or_insert_with(|| {
                let (tx, rx) = tokio::sync::mpsc::channel(QUEUE);
                crate::control::spawn(write_to(
                    self.node.clone(),
                    self.service.clone(),
                    id.clone(),
                    rx,
                ));
                tx
            });
            let Some(frame) = &frame else { continue };
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
async fn write_to(
    node: Arc<Node>,
    service: std::sync::Weak<Service>,
    peer: String,
    mut queue: tokio::sync::mpsc::Receiver<Bytes>,
) {
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
        if let Err(e) = start_stream(&mut stream, &service).await {
            tracing::warn!(peer = %peer, error = %e, "realtime stream to the peer failed");
            continue;
        }
        // The peer never writes on this stream: anything read from it means it ended (the
        // peer closed it, or the link went). Waiting on that as well as on the queue lets
        // an idle stream that the peer dropped be opened again at once, not at this node's
        // next presence change, so the peer's view of this node's presences is made whole.
        let (mut ended, mut writer) = tokio::io::split(stream);
        let mut probe = [0u8; 1];
        loop {
            tokio::select! {
                frame = queue.recv() => {
                    let Some(frame) = frame else { return };
                    if let Err(e) = writer.write_all(&frame).await {
                        tracing::warn!(peer = %peer, error = %e, "realtime stream to the peer failed");
                        break;
                    }
                }
                _ = ended.read(&mut probe) => {
                    tracing::debug!(peer = %peer, "the peer ended the realtime stream; opening it again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    break;
                }
            }
        }
    }
}

/// Starts a stream to a peer: a reset, then every presence of this node's sockets.
async fn start_stream(
    stream: &mut shoal_cluster::link::LinkStream,
    service: &std::sync::Weak<Service>,
) -> std::io::Result<()> {
    stream.write_all(&fabric::encode_reset()).await?;
    let Some(service) = service.upgrade() else {
        return Ok(());
    };
    for (tenant, change) in service.local_presences() {
        if let Ok(f) = fabric::encode_presence(&tenant, &change) {
            stream.write_all(&f).await?;
        }
    }
    Ok(())
}

/// Reads what another node relays on `stream` and applies it here: broadcasts delivered
/// to this node's subscribers, presences kept while the stream lasts.
// Runs on the control runtime, which has tokio's time driver.
#[allow(clippy::disallowed_methods)]
pub async fn receive(app: Arc<App>, stream: shoal_cluster::link::LinkStream) {
    let peer = stream.peer().to_owned();
    // A peer may open its stream while this node is still starting its realtime service:
    // wait for it a little rather than drop the stream (and the peer's presences with it).
    let mut waited = Duration::ZERO;
    let service = loop {
        if let Some(s) = app.realtime.get() {
            break s.clone();
        }
        if waited >= SERVICE_WAIT {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += Duration::from_millis(50);
    };
    let mut generation = None;
    read_frames(&service, stream, &mut generation).await;
    if let Some(g) = generation {
        service.origin_ends(&peer, g);
    }
}

async fn read_frames(
    service: &Service,
    mut stream: shoal_cluster::link::LinkStream,
    generation: &mut Option<u64>,
) {
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
        match frame {
            Ok(Relayed::Broadcast(tenant, b)) => service.deliver_relayed(&tenant, &b),
            Ok(Relayed::Presence(tenant, change)) => {
                service.presence_relayed(&peer, &tenant, change)
            }
            Ok(Relayed::Reset) => *generation = Some(service.origin_starts(&peer)),
            Err(e) => {
                tracing::warn!(peer = %peer, error = %e, "realtime stream from the peer ended");
                return;
            }
        }
    }
}
