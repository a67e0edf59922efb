//! The relaying node's side of a relayed client: once the client is authenticated here, its
//! bytes go to the owner over a stream of this shard's link, and the owner's come back. The
//! owner runs the client's session (pooling, prepared statements, SETs, LISTEN), so
//! everything that works there works here unchanged; this loop only moves bytes.
//!
//! An idle relayed client holds no buffer here (readiness of both sides first, then one read
//! into a recycled buffer), as an idle local client holds none.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;

use bytes::BytesMut;
use shoal_cluster::link::LinkStream;

use super::open::{RelayOpen, REDIRECT};
use super::{Node, NodeError};
use crate::net::Stream;

/// Redirects followed before giving up (ownership moving while the client logs in).
const MAX_HOPS: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("the connection to node \"{node}\", which runs this pool, was lost: {reason}")]
    Lost { node: String, reason: String },
    #[error("pool ownership kept moving: gave up after {MAX_HOPS} redirects")]
    Redirects,
    #[error("client connection: {0}")]
    Client(#[source] std::io::Error),
}

/// Relays the client to the node `to` (or to whichever node that one says owns the pool),
/// after writing `greeting` (the end of authentication composed here) before the owner's
/// first bytes. Returns when either side ends.
pub async fn relay(
    node: &Arc<Node>,
    client: &mut Stream,
    mut to: String,
    open: &RelayOpen,
    greeting: &[u8],
) -> Result<(), RelayError> {
    let what = open.encode();
    let mut hops = 0;
    let stream = loop {
        let link = node.links.get(node, &to).await?;
        let s = link.open(&what).map_err(|e| RelayError::Lost {
            node: to.clone(),
            reason: e.to_string(),
        })?;
        // The owner's first word: its login reply, an error, or "ask that node".
        poll_fn(|cx| s.poll_read_ready(cx))
            .await
            .map_err(|e| lost(&to, e))?;
        match s.peer_closed() {
            Some(why) if why.starts_with(REDIRECT) => {
                node.metrics
                    .redirects
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(RelayError::Redirects);
                }
                to = why[REDIRECT.len()..].to_owned();
                continue;
            }
            _ => break s,
        }
    };
    client
        .write_all(greeting)
        .await
        .map_err(RelayError::Client)?;
    node.metrics
        .relayed_out
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let r = shuttle(client, &stream, &to).await;
    node.metrics
        .relayed_out
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    r
}

fn lost(node: &str, e: std::io::Error) -> RelayError {
    RelayError::Lost {
        node: node.to_owned(),
        reason: e.to_string(),
    }
}

enum Ready {
    /// The client's socket is readable.
    Client,
    /// A buffered client stream (TLS) read this much into the held buffer.
    ClientRead(std::io::Result<usize>),
    /// The owner sent something (or ended).
    Owner,
}

async fn shuttle(client: &mut Stream, owner: &LinkStream, node: &str) -> Result<(), RelayError> {
    // Only a buffered client stream holds a buffer while idle (only a read can tell it
    // has bytes).
    let mut held = BytesMut::new();
    loop {
        let buffered = client.is_buffered();
        if buffered && held.capacity() == 0 {
            held = crate::bufpool::take();
        }
        let ready = poll_fn(|cx| {
            if buffered {
                if let Poll::Ready(r) = client.poll_read_buf(cx, &mut held) {
                    return Poll::Ready(Ready::ClientRead(r));
                }
            } else if client.poll_read_ready(cx).is_ready() {
                return Poll::Ready(Ready::Client);
            }
            match owner.poll_read_ready(cx) {
                Poll::Ready(_) => Poll::Ready(Ready::Owner),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        match ready {
            Ready::ClientRead(r) => {
                let n = r.map_err(RelayError::Client)?;
                if n == 0 {
                    return Ok(());
                }
                to_owner(owner, &held, node).await?;
                held.clear();
            }
            Ready::Client => {
                let mut buf = crate::bufpool::take();
                let r = client.read_now(&mut buf);
                let r = match r {
                    Ok(Some(0)) => Ok(true),
                    Ok(Some(_)) => to_owner(owner, &buf, node).await.map(|_| false),
                    // Stale readiness.
                    Ok(None) => Ok(false),
                    Err(e) => Err(RelayError::Client(e)),
                };
                crate::bufpool::give(buf);
                if r? {
                    return Ok(());
                }
            }
            Ready::Owner => {
                let mut buf = crate::bufpool::take();
                let read = {
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    owner.poll_read_buf(&mut cx, &mut buf)
                };
                let r = match read {
                    // The owner ended the session (its last words, if any, were relayed).
                    Poll::Ready(Ok(0)) => Ok(true),
                    Poll::Ready(Ok(_)) => client
                        .write_all(&buf)
                        .await
                        .map(|_| false)
                        .map_err(RelayError::Client),
                    Poll::Ready(Err(e)) => Err(lost(node, e)),
                    Poll::Pending => Ok(false),
                };
                crate::bufpool::give(buf);
                if r? {
                    return Ok(());
                }
            }
        }
    }
}

/// Sends all of `data` to the owner, waiting for window as needed.
async fn to_owner(owner: &LinkStream, data: &[u8], node: &str) -> Result<(), RelayError> {
    let mut at = 0;
    while at < data.len() {
        at += poll_fn(|cx| owner.poll_write_data(cx, &data[at..]))
            .await
            .map_err(|e| lost(node, e))?;
    }
    Ok(())
}
