//! The relaying node's side of a relayed client: once the client is authenticated here, its
//! bytes go to the owner over a stream of this shard's link, and the owner's come back. The
//! owner runs the client's session (pooling, prepared statements, SETs, LISTEN), so
//! everything that works there works here unchanged; this loop only moves bytes.
//!
//! An idle relayed client holds no buffer here (readiness of both sides first, then one read
//! into a recycled buffer), as an idle local client holds none.

use std::future::poll_fn;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use shoal_cluster::link::LinkStream;

use super::open::{HeldOpen, Resume, Snapshot, HELD, LEAVING, MOVED, REDIRECT};
use super::position::Position;
use super::{Node, NodeError, Place};
use crate::net::Stream;
use crate::pool::Pool;

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
    #[error("node \"{0}\", which ran this pool, is shutting down")]
    Leaving(String),
    #[error("the connection to node \"{node}\", which runs this pool, was lost before it answered this client's statement (which may or may not have run): {reason}")]
    InFlight { node: String, reason: String },
    #[error(
        "the pool moved to node \"{0}\" while this client's statement was on its way; it did not run: run it again"
    )]
    Moved(String),
    #[error("client connection: {0}")]
    Client(#[source] std::io::Error),
    #[error("this node is shutting down")]
    ShuttingDown,
}

/// How a [`run`] begins.
pub enum Start {
    /// The client just logged in (in the box its login made).
    Open(Box<Opening>),
    /// The client was parked and sent these bytes: open a stream for it at the pool's
    /// owner, where its session resumes, and pass them on.
    Back(BytesMut),
}

/// A logged-in client's first stream: open it at `to`, then say `greeting` to the client.
pub struct Opening {
    pub to: String,
    pub greeting: BytesMut,
}

/// How a [`run`] ended without an error.
pub enum Ran {
    Ended,
    /// The client idled; its stream is closed (its session at the owner gone) and `open`
    /// says how to resume it.
    Parked,
}

/// Relays the client over one owner's stream after another (it moves when its owner is
/// lost while it is idle), until either side ends or the client is parked.
///
/// If the owner is lost while the client is idle (see [`Position`]), the client goes on at
/// the pool's next owner, with the session state the old one last reported, and sees
/// nothing of it. Lost at any other moment, the client is told (its statement may or may
/// not have run) and closed, as when a server dies under a client inside a transaction.
///
/// The caller keeps this future in a box of its own, freed while the client is parked (see
/// [`crate::session`]'s `relay_out`, the loop every relayed client is): a parked client costs
/// that loop, its socket and its opening.
pub async fn run(
    node: &Arc<Node>,
    client: &mut Stream,
    pool: &Arc<Pool>,
    open: &mut HeldOpen,
    start: Start,
) -> Result<Ran, RelayError> {
    let mut position = Position::default();
    // A returning client's bytes, until the owner answers them: if it sends the client
    // elsewhere instead, they go again.
    let mut unanswered = None;
    let (mut stream, mut to, mut key) = match start {
        Start::Open(opening) => {
            let Opening { to, greeting } = *opening;
            let (stream, to) = match Box::pin(open_at(node, to, open, None)).await {
                // The owner is leaving, or gone (nothing answers, its link was lost): a new
                // login has sent no statement, so it waits for the next owner rather than
                // fail while the pool changes hands.
                Err(
                    RelayError::Leaving(_)
                    | RelayError::Lost { .. }
                    | RelayError::Node(NodeError::Down { .. } | NodeError::UnknownNode(_)),
                ) => Box::pin(move_client(node, pool, open, None)).await?,
                r => r?,
            };
            Box::pin(client.write_all(&greeting))
                .await
                .map_err(RelayError::Client)?;
            (stream, to, None)
        }
        Start::Back(first) => {
            let key = open.resume.as_ref().map(|r| r.cancel_key);
            position.client_sent(&first);
            // Not waiting for the owner to say it took the client up: its answer says so,
            // and waiting would cost this node a wake-up per resume.
            let (stream, to) = match Box::pin(move_client(node, pool, open, Some(&first))).await {
                Ok(opened) => opened,
                Err(e) => {
                    crate::bufpool::give(first);
                    return Err(e);
                }
            };
            unanswered = Some(first);
            if let Some((pid, _)) = key {
                node.relayed_to(pid, &to);
            }
            (stream, to, key)
        }
    };
    let mut turns = Turns::default();
    let result = loop {
        let r = shuttle(
            client,
            &stream,
            &to,
            &mut position,
            &mut key,
            &mut unanswered,
            node,
        )
        .await;
        let r = match (r, stream.peer_closed()) {
            // The owner handed the client back (it is shutting down).
            (Ok(Shuttled::Ended), Some(why)) if why == MOVED => {
                Err(RelayError::Leaving(to.clone()))
            }
            // The node sent the client elsewhere without reading what it sent.
            (Ok(Shuttled::Ended), Some(why)) if why == LEAVING || why.starts_with(REDIRECT) => {
                let Some(first) = unanswered.as_deref() else {
                    break Err(not_taken_up(&why, &to));
                };
                match Box::pin(reopen(node, pool, open, (&why, &to), first, &mut turns)).await {
                    Ok((s, t)) => {
                        if let Some((pid, _)) = key {
                            node.relayed_to(pid, &t);
                        }
                        (stream, to) = (s, t);
                        continue;
                    }
                    Err(e) => break Err(e),
                }
            }
            (r, _) => r,
        };
        match (r, key) {
            (Ok(Shuttled::Park), Some(cancel_key)) => {
                open.resume = Some(Resume {
                    cancel_key,
                    snapshot: stream.state().map(|b| Box::from(&b[..])),
                    parked: true,
                });
                // A parked client runs nothing a cancel could stop, and its next stream
                // names its node again: the entry is not kept (a parked client's cost).
                node.forget_relayed(cancel_key.0);
                // Closing the stream ends the session at the owner.
                return Ok(Ran::Parked);
            }
            (Err(e @ (RelayError::Lost { .. } | RelayError::Leaving(_))), Some(cancel_key))
                if position.idle() && movable(&stream) && !node.leaving() =>
            {
                tracing::info!(why = %e, pool = %pool.name, "a relayed client idle as its pool's owner went: moving it");
                open.resume = Some(Resume {
                    cancel_key,
                    snapshot: stream.state().map(|b| Box::from(&b[..])),
                    parked: false,
                });
                drop(stream);
                match Box::pin(move_client(node, pool, open, None)).await {
                    Ok((s, t)) => {
                        node.relayed_to(cancel_key.0, &t);
                        (stream, to) = (s, t);
                    }
                    Err(e) => break Err(e),
                }
            }
            (r, k) => {
                if let Err(e @ (RelayError::Lost { .. } | RelayError::Leaving(_))) = &r {
                    tracing::info!(why = %e, idle = position.idle(), movable = movable(&stream), key = k.is_some(), "the pool's owner went under a relayed client that cannot move");
                }
                break r.map(|_| Ran::Ended);
            }
        }
    };
    if let Some((pid, _)) = key {
        node.forget_relayed(pid);
    }
    result
}

/// What a parked client's readable socket held.
pub enum Woke {
    /// Its next bytes, to resume it with.
    Sent(BytesMut),
    /// It left (closed, or said only Terminate), and so needs no session again.
    Left,
    /// Nothing: the readiness was stale.
    Stale,
}

/// Reads a parked client's socket once it is readable (it holds no buffer until then).
pub fn read_parked(client: &mut Stream) -> Result<Woke, RelayError> {
    let mut buf = crate::bufpool::take();
    let woke = match client.read_now(&mut buf) {
        Ok(Some(n)) if n > 0 && buf[..] != TERMINATE => return Ok(Woke::Sent(buf)),
        Ok(Some(_)) => Ok(Woke::Left),
        Ok(None) => Ok(Woke::Stale),
        Err(e) => Err(RelayError::Client(e)),
    };
    crate::bufpool::give(buf);
    woke
}

/// A client's Terminate message, whole.
const TERMINATE: [u8; 5] = [b'X', 0, 0, 0, 4];

/// Counts in a gauge for as long as it lives (a client relayed from this node; one parked).
pub struct Counted<'a>(&'a AtomicU64);

impl<'a> Counted<'a> {
    pub fn new(gauge: &'a AtomicU64) -> Self {
        gauge.fetch_add(1, Ordering::Relaxed);
        Counted(gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether the owner said the client's session could move (it says nothing of a plain one).
fn movable(stream: &LinkStream) -> bool {
    match stream.state() {
        None => true,
        Some(b) => !matches!(
            Snapshot::decode(&b).map(Snapshot::state),
            Some(Snapshot::Stays) | None
        ),
    }
}

/// Opens the client's stream at `to`.
///
/// With no `first`, follows redirects and returns the stream and its node once the owner
/// answered (a login reply or an error; for a moving client, its acknowledgment). With
/// `first`, a returning client's bytes, sends them with the opening (a parked client's next
/// query costs no extra round trip) and returns at once: the owner's answer, or its word
/// that the client belongs elsewhere, comes to [`run`]'s loop. Once they are sent, a lost
/// link is [`RelayError::InFlight`], never tried again: the owner may have run them.
async fn open_at(
    node: &Arc<Node>,
    mut to: String,
    open: &HeldOpen,
    first: Option<&[u8]>,
) -> Result<(LinkStream, String), RelayError> {
    let what = open.encode();
    let resuming = open.resume.is_some();
    let mut hops = 0;
    loop {
        let link = node.links.get(node, &to).await?;
        let s = link.open(&what).map_err(|e| lost(&to, e))?;
        if let Some(first) = first {
            return match to_owner(&s, first, &to).await {
                Ok(()) => Ok((s, to)),
                Err(RelayError::Lost { node, reason }) => {
                    Err(RelayError::InFlight { node, reason })
                }
                Err(e) => Err(e),
            };
        }
        poll_fn(|cx| {
            if resuming && s.state().is_some() {
                return Poll::Ready(Ok(()));
            }
            s.poll_read_ready(cx)
        })
        .await
        .map_err(|e| lost(&to, e))?;
        match s.peer_closed() {
            Some(why) if why == LEAVING => return Err(RelayError::Leaving(to)),
            Some(why) if why.starts_with(REDIRECT) => {
                redirected(node, &mut hops)?;
                to = why[REDIRECT.len()..].to_owned();
            }
            _ => return Ok((s, to)),
        }
    }
}

/// Finds the pool's next owner for a client whose owner was lost: once the lost node's
/// claim has expired (its lease), the node hashing names claims the pool; this node, if it
/// is that node (the client then comes back to it over a link of its own).
async fn move_client(
    node: &Arc<Node>,
    pool: &Arc<Pool>,
    open: &HeldOpen,
    first: Option<&[u8]>,
) -> Result<(LinkStream, String), RelayError> {
    let limit = node.config.lease_ttl + Duration::from_secs(10);
    let started = std::time::Instant::now();
    loop {
        let tried = match node.place(pool, false).await {
            Ok(Place::Here) => open_at(node, node.id.clone(), open, first).await,
            Ok(Place::There(to)) => open_at(node, to, open, first).await,
            Err(e) => Err(e.into()),
        };
        match tried {
            Ok(done) => return Ok(done),
            Err(e @ (RelayError::Node(_) | RelayError::Lost { .. } | RelayError::Leaving(_))) => {
                if started.elapsed() > limit {
                    return Err(e);
                }
                crate::timer::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Counts a redirect followed; past [`MAX_HOPS`] of them (`hops`), ownership keeps moving and
/// the client is told.
fn redirected(node: &Node, hops: &mut usize) -> Result<(), RelayError> {
    node.metrics.redirects.fetch_add(1, Ordering::Relaxed);
    *hops += 1;
    if *hops > MAX_HOPS {
        return Err(RelayError::Redirects);
    }
    Ok(())
}

/// A returning client's attempts to be taken up, across the nodes that sent it on.
#[derive(Default)]
struct Turns {
    redirects: usize,
    /// When a node first said it was leaving.
    leaving_since: Option<std::time::Instant>,
}

/// Opens a returning client's stream again, with `first` (all it sent so far), after the
/// node it went to (`from`) closed it unread: `why` names the pool's owner, or says the node
/// is leaving (the pool is placed again once its claim is gone).
async fn reopen(
    node: &Arc<Node>,
    pool: &Arc<Pool>,
    open: &HeldOpen,
    (why, from): (&str, &str),
    first: &[u8],
    turns: &mut Turns,
) -> Result<(LinkStream, String), RelayError> {
    if let Some(owner) = why.strip_prefix(REDIRECT) {
        redirected(node, &mut turns.redirects)?;
        return open_at(node, owner.to_owned(), open, Some(first)).await;
    }
    let since = *turns.leaving_since.get_or_insert_with(|| {
        tracing::info!(node = from, pool = %pool.name, "a returning client's owner is leaving: it waits for the pool's next owner");
        std::time::Instant::now()
    });
    if since.elapsed() > node.config.lease_ttl + Duration::from_secs(10) {
        return Err(RelayError::Leaving(from.to_owned()));
    }
    // Until the leaving node's claim is gone, the pool may still be placed there.
    crate::timer::sleep(Duration::from_millis(100)).await;
    move_client(node, pool, open, Some(first)).await
}

/// What a client is told when a node closed its stream unread and its bytes were not kept
/// (it sent more than [`MAX_UNANSWERED`] before any answer).
fn not_taken_up(why: &str, to: &str) -> RelayError {
    match why.strip_prefix(REDIRECT) {
        Some(owner) => RelayError::Moved(owner.to_owned()),
        None => RelayError::Leaving(to.to_owned()),
    }
}

/// What a returning client sends before its new owner answers is kept up to this much, to
/// be sent again if that node sends it elsewhere; past it, the client is told instead.
const MAX_UNANSWERED: usize = 256 * 1024;

/// Keeps `sent` with what the owner has not answered, if that is still kept.
fn keep_unanswered(unanswered: &mut Option<BytesMut>, sent: &[u8]) {
    let Some(kept) = unanswered else {
        return;
    };
    if kept.len() + sent.len() <= MAX_UNANSWERED {
        kept.extend_from_slice(sent);
    } else if let Some(kept) = unanswered.take() {
        crate::bufpool::give(kept);
    }
}

fn lost(node: &str, e: std::io::Error) -> RelayError {
    RelayError::Lost {
        node: node.to_owned(),
        reason: e.to_string(),
    }
}

/// How a [`shuttle`] ended.
enum Shuttled {
    /// Either side ended the stream.
    Ended,
    /// The client idled through two ticks of the idle clock, between transactions, with a
    /// session that can move: its session at the owner may go.
    Park,
}

enum Ready {
    /// The idle clock ticked.
    Tick,
    /// The client's socket is readable.
    Client,
    /// A buffered client stream (TLS) read this much into the held buffer.
    ClientRead(std::io::Result<usize>),
    /// The owner sent something (or ended).
    Owner,
}

/// Moves bytes both ways until either side ends. Only the wait for either side lives in this
/// future (what an idle relayed client costs); the writes, which may wait, are boxed.
async fn shuttle(
    client: &mut Stream,
    owner: &LinkStream,
    node: &str,
    position: &mut Position,
    key: &mut Option<(i32, i32)>,
    unanswered: &mut Option<BytesMut>,
    cluster: &Node,
) -> Result<Shuttled, RelayError> {
    // Only a buffered client stream holds a buffer while idle (only a read can tell it
    // has bytes).
    let mut held = BytesMut::new();
    // The owner asked for the client back (it is shutting down): nothing more is read from
    // the client until the owner has closed the stream or answered what it had.
    let mut handing_back = false;
    // Ticks of the idle clock seen since the client or the owner last sent anything.
    let mut idle_ticks = 0u8;
    loop {
        if !handing_back && owner.state().is_some_and(|b| b.first() == Some(&b'H')) {
            handing_back = true;
            owner.send_state(HELD).map_err(|e| lost(node, e))?;
        }
        let buffered = client.is_buffered();
        if buffered && held.capacity() == 0 {
            held = crate::bufpool::take();
        }
        // Only a client between transactions, whose bytes its socket's readiness tells (a
        // parked client waits on that alone), may be parked.
        let parkable = !handing_back && !buffered && key.is_some() && position.idle();
        let tick = key
            .filter(|_| parkable)
            .and_then(|(pid, _)| cluster.park_tick(pid))
            .map(|t| t.notified());
        let mut tick = std::pin::pin!(tick);
        let ready = poll_fn(|cx| {
            if handing_back {
                // The owner's bytes only.
            } else if buffered {
                if let Poll::Ready(r) = client.poll_read_buf(cx, &mut held) {
                    return Poll::Ready(Ready::ClientRead(r));
                }
            } else if client.poll_read_ready(cx).is_ready() {
                return Poll::Ready(Ready::Client);
            }
            if owner.poll_read_ready(cx).is_ready() {
                return Poll::Ready(Ready::Owner);
            }
            match tick.as_mut().as_pin_mut().map(|t| t.poll(cx)) {
                Some(Poll::Ready(())) => Poll::Ready(Ready::Tick),
                _ => Poll::Pending,
            }
        })
        .await;
        if !matches!(ready, Ready::Tick) {
            idle_ticks = 0;
        }
        match ready {
            Ready::Tick => {
                idle_ticks += 1;
                if idle_ticks >= 2 && movable(owner) {
                    return Ok(Shuttled::Park);
                }
            }
            Ready::ClientRead(r) => {
                let n = r.map_err(RelayError::Client)?;
                if n == 0 {
                    return Ok(Shuttled::Ended);
                }
                position.client_sent(&held);
                keep_unanswered(unanswered, &held);
                let ended = Box::pin(pass_on(owner, &held, node)).await?;
                held.clear();
                if ended {
                    return Ok(Shuttled::Ended);
                }
            }
            Ready::Client => {
                let mut buf = crate::bufpool::take();
                let r = client.read_now(&mut buf);
                let r = match r {
                    Ok(Some(0)) => Ok(true),
                    Ok(Some(_)) => {
                        position.client_sent(&buf);
                        keep_unanswered(unanswered, &buf);
                        Box::pin(pass_on(owner, &buf, node)).await
                    }
                    // Stale readiness.
                    Ok(None) => Ok(false),
                    Err(e) => Err(RelayError::Client(e)),
                };
                crate::bufpool::give(buf);
                if r? {
                    return Ok(Shuttled::Ended);
                }
            }
            Ready::Owner => {
                let mut buf = crate::bufpool::take();
                let read = {
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    owner.poll_read_buf(&mut cx, &mut buf)
                };
                // Any answer (its bytes, or a state: it took the client up) settles the
                // bytes it was sent; only a close says it did not read them.
                let answered = match read {
                    Poll::Ready(Ok(n)) => n > 0,
                    Poll::Ready(Err(_)) => false,
                    Poll::Pending => owner.state().is_some(),
                };
                if answered {
                    if let Some(kept) = unanswered.take() {
                        crate::bufpool::give(kept);
                    }
                }
                let r = match read {
                    // The owner ended the session (its last words, if any, were relayed).
                    Poll::Ready(Ok(0)) => Ok(true),
                    Poll::Ready(Ok(_)) => {
                        if let Some(k) = position.owner_sent(&buf) {
                            *key = Some(k);
                            cluster.relayed_to(k.0, node);
                        }
                        Box::pin(client.write_all(&buf))
                            .await
                            .map(|_| false)
                            .map_err(RelayError::Client)
                    }
                    Poll::Ready(Err(e)) => Err(lost(node, e)),
                    Poll::Pending => Ok(false),
                };
                crate::bufpool::give(buf);
                if r? {
                    return Ok(Shuttled::Ended);
                }
            }
        }
    }
}

/// Passes the client's bytes on; true if the owner had closed the stream. Its close says
/// why (for [`run`]: a node that sent the client elsewhere has read none of it), and the
/// client's bytes that raced it are not an error of their own.
async fn pass_on(owner: &LinkStream, data: &[u8], node: &str) -> Result<bool, RelayError> {
    match to_owner(owner, data, node).await {
        Ok(()) => Ok(false),
        Err(_) if owner.peer_closed().is_some() => Ok(true),
        Err(e) => Err(e),
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
