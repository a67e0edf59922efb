//! Clients relayed between nodes of a cluster, from either end.
//!
//! On the node the client connected to ([`relay_out`]): authenticated there, it is relayed to
//! the pool's owner (see [`crate::cluster::pipe`]). On the owner ([`serve_relayed`]): the
//! relaying node's stream is a client like any other, logged in without a password exchange
//! (the relaying node did it; the link is authenticated), then served by the loop of its
//! pool mode.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use shoal_cluster::link::LinkStream;
use shoal_wire::sqlstate;

use super::entry;
use super::login::{self, Relayed, Request};
use super::{finish, Extras, Session, SessionError};
use crate::app::App;
use crate::cluster::open::{RelayOpen, Snapshot, HELD, LEAVING, MOVED, REDIRECT};

/// [`Extras::shipped`] of a session whose state cannot move (it stays with this node).
const STAYS: u64 = u64::MAX;
use crate::cluster::pipe::{self, RelayError};
use crate::error::ErrorKind;
use crate::net::Stream;
use crate::params::StartupRequest;
use std::sync::atomic::Ordering;

/// A client authenticated here, to relay to the node that owns its pool.
pub(super) struct Relaying {
    pub(super) app: Arc<App>,
    pub(super) id: u64,
    pub(super) stream: Stream,
    pub(super) relayed: Relayed,
    /// Counts the client while it is relayed.
    pub(super) _guard: crate::admission::ClientGuard,
}

/// Relays a client authenticated here to the node that owns its pool, until either ends.
/// (A function returning its future: an `async fn` would keep its argument twice in it.)
///
/// This future is what every parked client is, so it holds only the loop between the
/// relay and the parked wait: the relay proper ([`pipe::run`]) lives in a box of its own,
/// freed when the client parks, and the parked wait is inline (readiness of the socket, no
/// buffer). Keeping it under 152 bytes puts the task in jemalloc's 256-byte class, not 384.
#[allow(clippy::manual_async_fn)]
pub(super) fn relay_out(mut r: Relaying) -> impl std::future::Future<Output = ()> + Send {
    // `r` is used in place, never taken apart into locals: each would be a second copy in
    // this future.
    async move {
        let (Some(node), Some(opening)) = (r.app.cluster.get(), r.relayed.opening.take()) else {
            return;
        };
        tracing::debug!(conn = r.id, pool = %r.relayed.pool.name, "client relayed");
        // Reached by shutdown as a local client is (its read side shut: it ends, and is told).
        if let Some(fd) = r.stream.raw_fd() {
            r.app.lifecycle.client_fds.insert(fd);
        }
        // Every local of the loop ends with this block, before the last await: a local's
        // room in the future lasts as long as its scope, moved out of or not.
        let finishing = {
            let counted = pipe::Counted::new(&node.metrics.relayed_out);
            let mut start = pipe::Start::Open(opening);
            let result = loop {
                let (stream, pool, open) = (&mut r.stream, &r.relayed.pool, &mut r.relayed.open);
                match Box::pin(pipe::run(node, stream, pool, open, start)).await {
                    Ok(pipe::Ran::Parked) => {}
                    Ok(pipe::Ran::Ended) => break Ok(()),
                    Err(e) => break Err(e),
                }
                let parked = pipe::Counted::new(&node.metrics.parked);
                node.metrics.parks.fetch_add(1, Ordering::Relaxed);
                crate::admission::CHURN.fetch_add(1, Ordering::Relaxed);
                let woke = loop {
                    if let Err(e) = std::future::poll_fn(|cx| r.stream.poll_read_ready(cx)).await {
                        break Err(RelayError::Client(e));
                    }
                    match pipe::read_parked(&mut r.stream) {
                        Ok(pipe::Woke::Stale) => continue,
                        woke => break woke,
                    }
                };
                drop(parked);
                match woke {
                    Ok(pipe::Woke::Sent(first)) => start = pipe::Start::Back(first),
                    Ok(pipe::Woke::Left | pipe::Woke::Stale) => break Ok(()),
                    Err(e) => break Err(e),
                }
            };
            drop(counted);
            if let Some(fd) = r.stream.raw_fd() {
                r.app.lifecycle.client_fds.remove(fd);
            }
            drop(r.relayed.pool);
            let result = ended(&r.app, result);
            Box::pin(finish(r.id, &mut r.stream, result))
        };
        finishing.await;
        // Named, so that the block captures it: it counts the client until here.
        drop(r._guard);
    }
}

/// What the client is told of how its relay ended, counted in the metrics.
fn ended(app: &App, result: Result<(), RelayError>) -> Result<(), SessionError> {
    let closing = app.lifecycle.closing_clients.load(Ordering::Relaxed);
    let result = match result {
        Ok(()) if closing => Err(RelayError::ShuttingDown),
        r => r,
    };
    let result = result.map_err(|e| match e {
        RelayError::ShuttingDown => SessionError::fatal(
            ErrorKind::Shutdown,
            sqlstate::ADMIN_SHUTDOWN,
            "terminating connection because Shoal is shutting down",
        ),
        RelayError::Client(_) => SessionError::ClientGone,
        e => SessionError::fatal(
            ErrorKind::NodeLost,
            sqlstate::CONNECTION_FAILURE,
            e.to_string(),
        ),
    });
    if let Err(e) = &result {
        app.metrics.rejected(e.kind());
    }
    result
}

/// What a relayed login comes to on the node asked to serve it.
enum Served {
    In(Box<login::LoggedIn>),
    /// A client whose last owner was lost, taken up here (with its session's state).
    Resumed(
        Box<login::LoggedIn>,
        Option<Box<crate::handoff::SessionImage>>,
    ),
    /// Another node owns the pool: the relaying node is sent there.
    Elsewhere(String),
}

/// Serves a client another node relays here, from its stream's opening to its end. Built as
/// [`super::serve`] is: the login in a box of its own, freed once done, so an idle relayed
/// client costs what an idle local one does.
pub fn serve_relayed(
    app: Arc<App>,
    link: LinkStream,
    what: Bytes,
) -> impl std::future::Future<Output = ()> + Send {
    let login = Box::pin(login_phase(app, link, what));
    async move {
        let Some((session, lease)) = login.await else {
            return;
        };
        match lease {
            Some(lease) => Box::pin(super::session_mode::serve_session_mode(session, *lease)).await,
            None => super::serve_transaction_mode(session).await,
        }
    }
}

async fn login_phase(
    app: Arc<App>,
    link: LinkStream,
    what: Bytes,
) -> Option<(Session, Option<Box<crate::pool::Lease>>)> {
    let open = match RelayOpen::decode(&what) {
        Ok(o) => o,
        Err(e) => {
            tracing::warn!(peer = %link.peer(), error = %e, "relayed client refused: bad opening");
            link.close("bad opening");
            return None;
        }
    };
    let id = app.lifecycle.next_conn_id();
    let Some(node) = app.cluster.get().cloned() else {
        link.close("not in a cluster");
        return None;
    };
    if app.lifecycle.shutting_down() {
        // The relaying node waits for the pool's next owner.
        link.close(LEAVING);
        return None;
    }
    let parked = open.resume.as_ref().is_some_and(|r| r.parked);
    let mut stream = Stream::Link(link);
    let timeout = crate::config::secs(app.config.server.client_login_timeout);
    let r = match crate::timer::timeout(timeout, log_in(&app, &node, &mut stream, open)).await {
        Ok(r) => r,
        Err(_) => Err(SessionError::fatal(
            ErrorKind::LoginTimeout,
            sqlstate::CONNECTION_FAILURE,
            "the pool's owner could not log the client in within client_login_timeout",
        )),
    };
    match r {
        Ok(Served::In(done)) => {
            let (guard, _) = app.admission.client_guard();
            let session_mode = done.lease.is_some();
            let (session, lease) = Session::new(&app, id, guard, stream, *done);
            if session_mode {
                // Its server cannot move: if this node is lost, so is the session.
                if let Stream::Link(l) = &session.stream {
                    let _ = l.send_state(&Snapshot::Stays.encode());
                }
            }
            Some((session, lease))
        }
        Ok(Served::Resumed(done, image)) => {
            let (guard, _) = app.admission.client_guard();
            let (mut session, lease) = Session::new(&app, id, guard, stream, *done);
            if let Some(image) = image {
                session.restore(*image);
            }
            // Says to a moving client's relaying node that the client is taken up (then
            // what its state is, if it has any). A parked client's node does not wait for
            // it: its statement came with the opening, and the answer says as much.
            if let (Stream::Link(l), false) = (&session.stream, parked) {
                let _ = l.send_state(&Snapshot::Plain.encode());
            }
            session.ship_state();
            if parked {
                tracing::debug!(conn = id, pool = %session.pool.name, "parked relayed client back");
            } else {
                tracing::info!(conn = id, pool = %session.pool.name, "relayed client taken up after its owner was lost");
            }
            Some((session, lease))
        }
        Ok(Served::Elsewhere(owner)) => {
            if let Stream::Link(l) = &stream {
                l.close(&format!("{REDIRECT}{owner}"));
            }
            None
        }
        Err(e) => {
            app.metrics.rejected(e.kind());
            finish(id, &mut stream, Err(e)).await;
            None
        }
    }
}

/// Routes the relayed client as if it had connected here, minus the password exchange.
async fn log_in(
    app: &Arc<App>,
    node: &Arc<crate::cluster::Node>,
    stream: &mut Stream,
    open: RelayOpen,
) -> Result<Served, SessionError> {
    let resume = open.resume;
    let mut req = Request {
        startup: StartupRequest {
            user: open.user,
            database: open.database,
            params: open.params,
            unrecognized: Vec::new(),
            reference: open.reference,
            target: open.target,
        },
        server_name: open.server_name,
        peer: open.peer,
        out: BytesMut::with_capacity(1024),
    };
    let routed = login::resolve(app, &req).await?;
    let user = login::credentials(app, &routed)
        .await?
        .map_err(login::refused)?;
    let user = login::with_passthrough(user, open.client_key);
    let pool = app.routes.pool(&routed, &user).map_err(login::refused)?;
    if pool.name != open.pool {
        return Err(SessionError::fatal(
            ErrorKind::Routing,
            sqlstate::CONNECTION_FAILURE,
            format!(
                "the nodes route this client differently (\"{}\" here, \"{}\" where it connected): check that their configurations match",
                pool.name, open.pool
            ),
        ));
    }
    drop(user);
    drop(routed);
    match node.place(&pool, true).await {
        Ok(crate::cluster::Place::Here) => {}
        Ok(crate::cluster::Place::There(owner)) => return Ok(Served::Elsewhere(owner)),
        Err(e) => {
            return Err(SessionError::fatal(
                ErrorKind::NodeLost,
                sqlstate::CONNECTION_FAILURE,
                e.to_string(),
            ))
        }
    }
    match resume {
        Some(r) => resumed(app, req, pool, r).map(|(done, image)| Served::Resumed(done, image)),
        None => entry::enter_pool(app, stream, &mut req, pool)
            .await
            .map(Served::In),
    }
}

/// A client whose owner was lost, logged in here without a word to it (it is logged in):
/// same cancel key, and the state its old owner last reported.
#[allow(clippy::type_complexity)]
fn resumed(
    app: &Arc<App>,
    req: Request,
    pool: Arc<crate::pool::Pool>,
    r: crate::cluster::open::Resume,
) -> Result<
    (
        Box<login::LoggedIn>,
        Option<Box<crate::handoff::SessionImage>>,
    ),
    SessionError,
> {
    let refuse = |why: &str| {
        SessionError::fatal(
            ErrorKind::NodeLost,
            sqlstate::CONNECTION_FAILURE,
            format!("the node that ran this session was lost and the session cannot move: {why}; reconnect"),
        )
    };
    if pool.settings.mode != crate::config::PoolMode::Transaction {
        return Err(refuse("its pool is in session mode"));
    }
    let image = match r
        .snapshot
        .as_deref()
        .map(|b| Snapshot::decode(b).map(Snapshot::state))
    {
        None | Some(Some(Snapshot::Plain)) => None,
        Some(Some(Snapshot::Image(j))) => Some(Box::new(
            serde_json::from_slice::<crate::handoff::SessionImage>(j)
                .map_err(|_| refuse("its state could not be read"))?,
        )),
        Some(Some(Snapshot::Stays | Snapshot::HandBack(_))) | Some(None) => {
            return Err(refuse("it listens, or holds state only its old node had"))
        }
    };
    pool.stats
        .clients
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let info = crate::cancel::ClientInfo {
        pool: Arc::downgrade(&pool),
        addr: req.peer.map(Into::into),
        since_ms: crate::clock::now_ms(),
    };
    let (pid, secret) = r.cancel_key;
    let cancel = app
        .cancels
        .register_exact(pid, secret, info.clone())
        .unwrap_or_else(|| app.cancels.register(None, info));
    let encoding = entry::startup_encoding(&req.startup.params);
    Ok((
        Box::new(login::LoggedIn {
            pool: entry::PoolClient(pool),
            params: req.startup.params,
            cancel,
            lease: None,
            peer: req.peer,
            target: req.startup.target,
            // Refined by the image's held SETs when the session takes it up.
            encoding,
        }),
        image,
    ))
}

impl Session {
    /// A relayed client gone idle while this node shuts down: asks the relaying node for the
    /// client back (with its state); once it says it sends nothing more and all it sent was
    /// answered, closes the stream with the word that the client moved, and the relaying node
    /// takes it to the pool's next owner without a word to the client. True when it did.
    pub(super) fn hand_back(&mut self) -> bool {
        let Stream::Link(link) = &self.stream else {
            return false;
        };
        let x = self.extras.as_ref();
        if !self.app.lifecycle.shutting_down() || x.is_some_and(|x| x.shipped == STAYS) {
            return false;
        }
        if x.is_some_and(|x| x.handing_back) {
            // Its answer follows everything it sent: when it is here, so is all of that.
            if link.state().as_deref() == Some(HELD) && !link.has_data() {
                link.close(MOVED);
                tracing::debug!(conn = self.id, pool = %self.pool.name, "relayed client handed back: this node is shutting down");
                return true;
            }
            return false;
        }
        let (_, state) = self.snapshot();
        let asked = Snapshot::HandBack(Box::new(
            Snapshot::decode(&state).unwrap_or(Snapshot::Plain),
        ));
        if link.send_state(&asked.encode()).is_ok() {
            Extras::get(&mut self.extras).handing_back = true;
        }
        false
    }

    /// The session's state for the relaying node, and its signature (which changes when the
    /// state does; [`STAYS`] for state that cannot move).
    fn snapshot(&self) -> (u64, Vec<u8>) {
        let signature = self.signature();
        if signature == STAYS {
            return (STAYS, Snapshot::Stays.encode());
        }
        if signature == 0 {
            return (0, Snapshot::Plain.encode());
        }
        let mut i = self.image(false);
        // The unnamed statement is not carried: it changes with nearly every transaction of
        // many drivers, and is rarely used across transactions.
        i.unnamed = None;
        // A snapshot is shipped once and may be taken up much later, after more writes
        // (which ship nothing new): its reader takes the last write as just made.
        if i.wrote_ms_ago.is_some() {
            i.wrote_ms_ago = Some(0);
        }
        let image = serde_json::to_vec(&i).unwrap_or_default();
        (signature, Snapshot::Image(&image).encode())
    }

    /// A relayed client gone idle: if its session's state changed since the relaying node
    /// last heard, tells it (so a new owner can take the client up if this one is lost).
    pub(super) fn ship_state(&mut self) {
        let Stream::Link(link) = &self.stream else {
            return;
        };
        let shipped = self.extras.as_ref().map_or(0, |x| x.shipped);
        if shipped == STAYS || self.signature() == shipped {
            return;
        }
        let (signature, state) = self.snapshot();
        if link.send_state(&state).is_ok() {
            Extras::get(&mut self.extras).shipped = signature;
        }
    }

    /// A number that changes with the state a snapshot carries ([`STAYS`] for state that
    /// cannot move; 0 for none), found without making the snapshot (every idle moment of a
    /// relayed client asks).
    fn signature(&self) -> u64 {
        let sets = self.extras.as_ref().map(|x| &x.sets);
        if sets.is_some_and(|s| !s.listening.is_empty())
            || self.statements.as_ref().is_some_and(|s| s.has_rewritten())
        {
            return STAYS;
        }
        // A first write changes the state once (see `snapshot`).
        let wrote = self.extras.as_ref().is_some_and(|x| x.wrote_at != 0);
        sets.map_or(0, |s| s.fingerprint)
            ^ self
                .statements
                .as_ref()
                .map_or(0, |s| s.signature())
                .rotate_left(17)
            ^ u64::from(wrote).rotate_right(1)
    }
}
