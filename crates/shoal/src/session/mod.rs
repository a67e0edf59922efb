//! One client connection from accept to close: handshake, authentication, login, then the
//! pooling loop of its pool mode.
//!
//! Transaction mode: the client holds no server (and no buffer) while idle; a server is checked
//! out when a message needing one arrives and goes back at the transaction boundary. Session
//! mode: the client keeps one server for its lifetime, reset on exit.

mod auth;
mod budget;
mod cached;
mod ending;
mod entry;
mod error;
mod flow;
mod handoff;
mod handshake;
mod hooks;
mod hygiene;
mod listening;
mod login;
mod moving;
mod outbound;
mod reads;
mod relay;
mod relayed;
mod session_mode;
#[cfg(test)]
mod size_tests;
mod transaction;
mod unserved;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::BytesMut;
use shoal_wire::sql::ClientEncoding;
use shoal_wire::sqlstate;

use crate::admission::ClientGuard;
use crate::app::App;
use crate::cancel::Registration;
use crate::error::ClientError;
use crate::error::ErrorKind;
use crate::logsafe::Escaped;
use crate::net::Stream;
use crate::params::SharedParams;
use crate::pool::{Lease, Leaving};
use crate::seam::Features as _;
use crate::{prepared, sets, Plugged};
use entry::PoolClient;
use flow::Flow;
use login::{login_phase, LoggedIn};
use relay::{Policy, RelayEnd};

use ending::{end_session, finish};
pub use error::SessionError;
pub use handoff::adopt;
use moving::move_to;
pub use relayed::serve_relayed;
use session_mode::serve_session_mode;
use unserved::Idle;

/// Serves one accepted connection to its end. Never panics on client input; every failure
/// is logged with the connection id and, where the protocol allows, reported to the client.
/// `peer` is the client's address as `accept` gave it (saving a system call per login); when
/// it is `None`, the stream is asked.
pub fn serve(
    app: Arc<App>,
    stream: Stream,
    peer: Option<SocketAddr>,
) -> impl std::future::Future<Output = ()> + Send {
    // This task lives as long as the (mostly idle) client, so its future is kept small
    // (`session_future_fits_a_small_task` checks it): what the login needs goes into the
    // login's own boxed future, freed when it is done, so the task keeps only that box's
    // pointer and what runs only while the client is active is boxed apart too.
    let login = Box::pin(login_phase(app, stream, peer));
    async move {
        let Some((session, lease)) = login.await else {
            return;
        };
        match lease {
            Some(lease) => Box::pin(serve_session_mode(session, *lease)).await,
            None => serve_transaction_mode(session).await,
        }
    }
}

/// The transaction-mode client from login (or from a move to this shard) to its end.
///
/// Written as a function returning an `async move` block that uses its captured session in
/// place: an `async fn` would keep its argument twice in the future, and this future is what
/// every idle client is (440 bytes instead of 280 when written as an `async fn`).
#[allow(clippy::manual_async_fn)]
fn serve_transaction_mode(mut session: Session) -> impl std::future::Future<Output = ()> + Send {
    async move {
        loop {
            let result = match session.run_transaction_mode().await {
                Ok(Next::MoveTo(target)) => match move_to(session, target) {
                    Ok(()) => return,
                    Err(back) => {
                        session = *back;
                        continue;
                    }
                },
                // The client's socket lives on in the new process: not a word to it.
                Ok(Next::HandedOver) => return,
                Ok(Next::Done) => Ok(()),
                Err(e) => Err(e),
            };
            return Box::pin(end_session(&mut session, result)).await;
        }
    }
}

/// What the idle transaction-mode loop ends with.
enum Next {
    /// The client left, or is to be told why it is closed (an error).
    Done,
    /// The client, idle, moves to that shard.
    MoveTo(usize),
    /// The client was handed to the process that took over (see [`crate::handoff`]).
    HandedOver,
}

/// How the client leaves its server, from what the protocol still owes.
fn leaving(flow: &Flow, reset: bool) -> Leaving {
    Leaving {
        busy: flow.pending > 0 || flow.copy_in || flow.unsynced,
        partial: flow.partial,
        in_transaction: flow.status != b'I',
        reset,
    }
}

/// Whether the client left (Terminate, or its connection ended) while being served.
enum Gone {
    Yes,
    No,
}

pub struct Session {
    id: u64,
    /// Counted in [`App::active`] while holding a server.
    active: bool,
    app: Arc<App>,
    stream: Stream,
    /// Client bytes not yet forwarded. Released (capacity 0) while the client is idle.
    cbuf: BytesMut,
    /// Counts this client in its pool while it lives.
    pool: PoolClient,
    cancel: Registration,
    params: SharedParams,
    /// An error was reported for an extended-protocol batch; drop messages up to its Sync.
    skip_until_sync: bool,
    /// KiB of the large-message budget this client holds (see [`budget`]).
    large_kib: u32,
    /// Rarely needed state, boxed so an idle client that never uses it pays 8 bytes.
    extras: Option<Box<Extras>>,
    /// The client's named prepared statements (transaction mode), once it has any.
    statements: Option<Box<prepared::ClientStatements>>,
}

/// Per-client state most clients never need.
#[derive(Default)]
pub struct Extras {
    /// Session-level `SET`s to replay on the next server (transaction mode).
    pub sets: sets::SessionSets,
    /// The idle client's `client_idle_timeout` timer, while it waits.
    pub idle_timer: Option<std::pin::Pin<Box<crate::timer::Sleep>>>,
    /// The new process refused this client (see [`crate::handoff`]): it stays here.
    pub stays: bool,
    /// The client's notifications, while it listens (transaction mode).
    pub listen: Option<crate::seam::Listening>,
    /// A relayed client: the signature of the state last sent to the relaying node.
    pub shipped: u64,
    /// A relayed client this node (shutting down) asked the relaying node to take back.
    pub handing_back: bool,
    /// When the client's last transaction on the primary ended ([`crate::clock::now_ms`]),
    /// in a pool with replicas: its reads go where that commit is visible.
    pub wrote_at: u64,
    /// The client's `target_session_attrs` (overrides the pool's `read_routing`).
    pub target: Option<crate::config::replicas::TargetSessionAttrs>,
    /// The reply of the unit about to run is to be kept by the pool's cache.
    pub capture: Option<crate::seam::Capture>,
    /// The client's `client_encoding` as its server last reported it, when not UTF8 (see
    /// [`shoal_wire::encoding`]): how every statement of the client is read.
    pub encoding: ClientEncoding,
    /// The client sent a statement that leaves session state Shoal does not replay (a
    /// `set_config`, a temporary table, a `SET` among other statements, a FunctionCall...):
    /// what it runs may depend on more than a cache key says, for as long as it is
    /// connected.
    pub holds_state: bool,
    /// Of it, state that surely lasts past its transaction (a temporary table, a setting, a
    /// `WITH HOLD` cursor, an advisory lock, an SQL `PREPARE`): told if a full pool cleans
    /// it away. (A `DO` block or a `CALL` only might leave state.)
    pub keeps_state: bool,
    /// A transaction of this client ended on a server it left its state on: the pool is
    /// told when it leaves, and it is told if a full pool cleaned that state away.
    pub owns_servers: bool,
    /// A statement sent may have changed it (`SET client_encoding`, `set_config`, ...):
    /// until the server has answered everything sent, text is read as of an unknown
    /// encoding (only ASCII is readable; the rest fails closed).
    pub recoding: bool,
}

impl Extras {
    pub fn get(extras: &mut Option<Box<Extras>>) -> &mut Extras {
        extras.get_or_insert_with(Default::default)
    }
}

/// How the client's next statement is to be read (UTF8 for a client that holds no extras).
pub(super) fn encoding_of(extras: &Option<Box<Extras>>) -> ClientEncoding {
    match extras {
        Some(x) if x.recoding => ClientEncoding::Unknown,
        Some(x) => x.encoding,
        None => ClientEncoding::Utf8,
    }
}

/// The server reported `client_encoding` (or `server_encoding`) as `value`.
pub(super) fn encoding_reported(
    extras: &mut Option<Box<Extras>>,
    client_encoding: Option<&str>,
    server_encoding: Option<&str>,
) {
    let enc = ClientEncoding::of_session(client_encoding, server_encoding);
    if enc != ClientEncoding::Utf8 || extras.is_some() {
        Extras::get(extras).encoding = enc;
    }
}

/// What a client is told when a full pool cleaned its server's session away.
const STATE_LOST: &str = "this session's state on its server was lost and the statement was not run: every server of the pool was in use or held another client's state, so Shoal cleaned this client's server (DISCARD ALL) for another client; temporary tables, advisory locks, WITH HOLD cursors, SQL PREPAREd statements and settings made with set_config() or among other statements are gone (settings made with single SET statements are restored); raise pool_size or end such state sooner";

impl Drop for Session {
    fn drop(&mut self) {
        if self.extras.as_ref().is_some_and(|x| x.owns_servers) {
            self.pool.owner_left(self.id);
        }
        if let Some(fd) = self.stream.raw_fd() {
            self.app.lifecycle.client_fds.remove(fd);
            self.pool.client_fds.remove(fd);
        }
        budget::release(&self.app.large_message_kib, &mut self.large_kib);
        self.set_active(false);
        if matches!(self.stream, Stream::Link(_)) {
            self.app
                .admission
                .relayed_in
                .fetch_sub(1, Ordering::Relaxed);
        }
        self.app.admission.client_left();
        self.app.shards.client_left(crate::shard::current());
    }
}

impl Session {
    fn new(
        app: &Arc<App>,
        id: u64,
        client: ClientGuard,
        stream: Stream,
        done: LoggedIn,
    ) -> (Session, Option<Box<Lease>>) {
        let LoggedIn {
            pool,
            params,
            cancel,
            lease,
            peer: _,
            target,
            encoding,
        } = done;
        // The session takes over the client count (released in `Drop`).
        client.into_session();
        if matches!(stream, Stream::Link(_)) {
            app.admission.relayed_in.fetch_add(1, Ordering::Relaxed);
        }
        app.shards.client_arrived(crate::shard::current());
        if let Some(fd) = stream.raw_fd() {
            app.lifecycle.client_fds.insert(fd);
            pool.client_fds.insert(fd);
        }
        let mut session = Session {
            id,
            active: false,
            app: app.clone(),
            stream,
            cbuf: BytesMut::new(),
            cancel,
            params: params.into(),
            skip_until_sync: false,
            large_kib: 0,
            extras: None,
            statements: None,
            pool,
        };
        if target.is_some_and(|t| t != crate::config::replicas::TargetSessionAttrs::Any) {
            Extras::get(&mut session.extras).target = target;
        }
        if encoding != ClientEncoding::Utf8 {
            Extras::get(&mut session.extras).encoding = encoding;
        }
        (session, lease.map(Box::new))
    }

    /// The client's read side ended: it left, or shutdown closed it (then it is told why,
    /// as PostgreSQL tells its sessions).
    fn gone_or_shut_down(&self) -> Result<(), SessionError> {
        match self.ended() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Why Shoal is ending this client, if it is: shutdown, or its pool was ended (tenant
    /// banned, deleted or terminated).
    fn ended(&self) -> Option<SessionError> {
        if self.app.lifecycle.closing_clients.load(Ordering::Relaxed) {
            return Some(SessionError::fatal(
                ErrorKind::Shutdown,
                sqlstate::ADMIN_SHUTDOWN,
                "terminating connection because Shoal is shutting down",
            ));
        }
        self.pool.ended().map(|why| {
            SessionError::fatal(
                ErrorKind::PoolClosed,
                sqlstate::ADMIN_SHUTDOWN,
                format!("terminating connection: {why}"),
            )
        })
    }

    /// Readiness of the idle client's socket (with `read`, the read itself, for streams
    /// that buffer); an error when the pool's `client_idle_timeout` passes first, or
    /// writing the client's notifications fails. The timer lives in the client's extras, so
    /// only clients of pools with an idle limit pay for one (and the idle future stays small).
    fn poll_idle(
        &mut self,
        cx: &mut std::task::Context<'_>,
        read: bool,
    ) -> std::task::Poll<Result<std::io::Result<usize>, SessionError>> {
        use std::future::Future;
        use std::task::Poll;
        let ready = if read {
            // `read_buf`'s future keeps no state between polls: made afresh at each one.
            std::pin::pin!(tokio::io::AsyncReadExt::read_buf(
                &mut self.stream,
                &mut self.cbuf
            ))
            .poll(cx)
        } else {
            self.stream.poll_read_ready(cx).map(|r| r.map(|()| 1))
        };
        if let Poll::Ready(r) = ready {
            if let Some(x) = self.extras.as_mut() {
                x.idle_timer = None;
            }
            return Poll::Ready(Ok(r));
        }
        if let Poll::Ready(Err(e)) = self.poll_mail(cx) {
            return Poll::Ready(Err(e));
        }
        let limit = self.pool.settings.client_idle_timeout;
        if limit.is_zero() {
            return Poll::Pending;
        }
        let timer = Extras::get(&mut self.extras)
            .idle_timer
            .get_or_insert_with(|| Box::pin(crate::timer::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(SessionError::fatal(
                ErrorKind::ClientLimit,
                sqlstate::IDLE_SESSION_TIMEOUT,
                format!(
                    "closing an idle client: client_idle_timeout ({} s) passed",
                    limit.as_secs_f64()
                ),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Holds or frees this client's share of the large-message budget.
    fn account_large(&mut self, at: usize, streaming_copy: bool) -> Result<(), SessionError> {
        let budget = self.app.config.server.max_large_message_memory;
        budget::account(
            &self.app.large_message_kib,
            &mut self.cbuf,
            at,
            &mut self.large_kib,
            budget,
            streaming_copy,
        )
    }

    fn set_active(&mut self, active: bool) {
        if self.active != active {
            self.active = active;
            if active {
                self.app.lifecycle.active.fetch_add(1, Ordering::Relaxed);
            } else {
                self.app.lifecycle.active.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
