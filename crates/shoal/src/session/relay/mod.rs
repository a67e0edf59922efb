//! The relay between a client and the server it holds: a non-blocking loop that moves whole
//! messages both ways without decoding most of them, and keeps just enough protocol state to
//! know when the server can go back to the pool.
//!
//! Each read is followed by a scan of the new message headers; complete messages go out in one
//! write, from the buffer they were read into when passed on unchanged, through an output
//! buffer when a hook rewrites around them (what each message becomes is the hook's to say,
//! see [`super::hooks`]; the bookkeeping is in [`super::outbound`]). Both directions are driven
//! by readiness, so neither side can stall the other (a client pipelining a large batch while
//! PostgreSQL streams results back cannot deadlock the relay).

use bytes::Buf;
use shoal_wire::backend::ErrorFields;

use std::pin::Pin;
use std::task::Poll;

use tokio::io::AsyncWrite;

use super::flow::Flow;
use super::hooks::{HookCx, Hooks, PassThrough, Prepared};
use super::outbound::Outbound;
use super::{Session, SessionError};
use crate::config::replicas::ReadRouting;
use crate::net::poll_read_buf;
use crate::pool::Lease;
use crate::seam::Features as _;
use crate::server::ServerConn;
use crate::Plugged;

mod client;
mod overdue;
mod server;

use overdue::Overdue;
use server::take_server;

/// Read granularity; buffers grow beyond it only for larger messages.
pub const READ_CHUNK: usize = 8192;
/// Read into what is left of a buffer while at least this much is.
const MIN_READ_ROOM: usize = 2048;
/// Stop reading a side while this much is waiting to be written to the other.
const HIGH_WATER: usize = 256 * 1024;
/// Bound on a single message from a server.
const SERVER_MAX_MESSAGE: usize = 1 << 30;

/// The pool mode's policy for the server the relay holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The server goes back at the transaction boundary, so the relay translates prepared
    /// statements, follows session state, and leaves a server's FATAL for the session to
    /// report.
    Transaction,
    /// The client keeps the server: everything passes through, a FATAL included.
    Session,
}

impl Policy {
    pub fn per_transaction(self) -> bool {
        self == Policy::Transaction
    }

    pub fn forwards_fatal(self) -> bool {
        self == Policy::Session
    }
}

/// Why the relay stopped.
pub enum RelayEnd {
    /// Transaction boundary reached (transaction mode only).
    Boundary,
    /// The client sent Terminate.
    Terminate,
    /// The client's connection ended.
    ClientGone,
    /// The server connection failed; carries PostgreSQL's FATAL error if it sent one.
    ServerLost(Option<Box<ErrorFields>>),
}

/// The client's side of the session, lent to hooks while messages pass.
struct ClientSide<'a> {
    registry: &'a crate::prepared::StatementRegistry,
    /// For what DDL makes stale (rare: read from the pool when it happens).
    pool: &'a crate::pool::Pool,
    rules: Option<crate::seam::Rules>,
    pool_name: &'a str,
    params: &'a [(String, String)],
    client_id: u64,
    statements: &'a mut Option<Box<crate::prepared::ClientStatements>>,
    max_prepared: usize,
    encoding: shoal_wire::sql::ClientEncoding,
    /// A message taken may change the encoding (see [`super::Extras::recoding`]).
    recoding: bool,
    /// A message taken leaves state Shoal does not follow; of it, state that surely lasts.
    untracked: bool,
    keeps: bool,
    /// The next message is refused with this (`25006`), not passed on (see
    /// [`super::reads::Take::Refuse`]).
    refuse: Option<&'static str>,
}

impl<'a> ClientSide<'a> {
    fn of(
        pool: &'a crate::pool::Pool,
        params: &'a [(String, String)],
        client_id: u64,
        statements: &'a mut Option<Box<crate::prepared::ClientStatements>>,
        rules: Option<crate::seam::Rules>,
        encoding: shoal_wire::sql::ClientEncoding,
    ) -> Self {
        ClientSide {
            pool,
            encoding,
            recoding: false,
            untracked: false,
            keeps: false,
            refuse: None,
            registry: &pool.statements,
            rules,
            pool_name: &pool.name,
            params,
            client_id,
            statements,
            max_prepared: pool.settings.max_prepared_statements.max(1),
        }
    }

    fn cx<'b>(
        &'b mut self,
        server: &'b mut crate::server_session::ServerSession,
        flow: &'b mut Flow,
    ) -> HookCx<'b> {
        HookCx {
            registry: self.registry,
            params: self.params,
            client_id: self.client_id,
            statements: self.statements,
            server,
            max_prepared: self.max_prepared,
            pending: &mut flow.pending,
            status: flow.status,
            rules: self.rules.as_ref(),
            pool_name: self.pool_name,
            encoding: self.encoding,
            recoding: &mut self.recoding,
            untracked: &mut self.untracked,
            keeps: &mut self.keeps,
            refuse: self.refuse.take(),
        }
    }
}

impl Session {
    /// Relays until the transaction boundary (transaction mode), the client leaves, or
    /// the server fails. Leftover client bytes (a partial message) stay in `self.cbuf`; when
    /// the server fails, client messages already taken for it are dropped with it (the client
    /// gets an error for them instead of seeing them run twice). `proven`: messages at the
    /// head of the client's buffer already proven to read, when the server is a replica's.
    pub(super) async fn relay(
        &mut self,
        lease: &mut Lease,
        flow: &mut Flow,
        policy: Policy,
        proven: u32,
        capture: Option<crate::seam::Capture>,
    ) -> Result<RelayEnd, SessionError> {
        let mut out = Outbound::new();
        out.capture = capture;
        // Read once per transaction: a pool's first listener arriving meanwhile misses only
        // this transaction's claim (see `crate::seam::Features::claim`).
        out.notify_active = policy.per_transaction() && Plugged::listeners_active(&self.pool);
        // In force for the whole transaction (a change applies from the next one).
        if policy.per_transaction() {
            out.rules = Plugged::rules(&self.pool);
            if self.takes_writes(lease.pool()) {
                out.writes = Plugged::writes(&self.pool);
            }
        }
        if policy.per_transaction()
            && Plugged::replicas(&self.pool).is_some()
            && self.routing().0 == ReadRouting::Split
        {
            if self.takes_writes(lease.pool()) {
                out.track_writes = true;
            } else {
                out.reads_only = true;
                // Proven when the replica was chosen: not parsed or looked up again.
                out.cleared = proven;
            }
        }
        let server: &mut ServerConn = lease;
        // Boxed apart from each other would cost an allocation per transaction: the two
        // loops are two instances of one generic function instead.
        let mut end = match policy {
            Policy::Transaction => {
                self.relay_loop(&mut Prepared, server, flow, policy, &mut out)
                    .await
            }
            Policy::Session => {
                self.relay_loop(&mut PassThrough, server, flow, policy, &mut out)
                    .await
            }
        };
        // Replies for a client that is gone (or with a server that failed) go nowhere, and
        // messages taken for a failed server are dropped with it.
        server.buf.advance(out.direct);
        self.cbuf.advance(out.direct_to_server);
        // The server may not serve anyone else with a message half-written to it.
        flow.partial = out.partial();
        if out.partial() && !matches!(end, Ok(RelayEnd::Boundary)) {
            // Cut in the middle of a streamed message: neither side's framing can be
            // trusted any more.
            end = Err(SessionError::Quiet(
                "connection lost in the middle of a streamed message".into(),
            ));
        }
        if policy.per_transaction() {
            Plugged::transaction_ran(&self.pool, out.counts.queries);
        }
        out.flush_counts(&self.pool);
        if let Some(w) = out.writes.as_mut() {
            // Ended without its ReadyForQuery (a lost server): what it sent may have
            // committed.
            Plugged::writes_done(w);
        }
        if let Some(capture) = out.capture.take() {
            Plugged::captured(capture);
        }
        if out.wrote {
            // Its next reads go only where this transaction's commit is visible.
            super::Extras::get(&mut self.extras).wrote_at = crate::clock::now_ms();
        }
        if out.to_server.capacity() > 0 {
            crate::bufpool::give(out.to_server);
        }
        if out.to_client.capacity() > 0 {
            crate::bufpool::give(out.to_client);
        }
        end
    }

    async fn relay_loop<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        policy: Policy,
        out: &mut Outbound,
    ) -> Result<RelayEnd, SessionError> {
        let mut st = LoopState {
            terminate: !self.take_client(hooks, server, flow, out)?,
            fatal: None,
            overdue: Overdue::new(self.pool.settings.statement_timeout),
            draining: false,
            answered: 0,
        };
        if out.server_pending() {
            out.query_start = Some(out.txn_start);
        }
        loop {
            if let Some(end) = self.settled(&mut st, server, flow, policy, out) {
                return Ok(end);
            }
            st.overdue.arm(out.query_start, flow.pending > 0);
            let reads = Reads {
                server: out.to_client.len() + out.direct < HIGH_WATER && st.fatal.is_none(),
                client: out.to_server.len() + out.direct_to_server < HIGH_WATER
                    && !st.terminate
                    && !st.draining
                    && !out.held,
            };
            let step =
                std::future::poll_fn(|cx| self.poll_step(cx, server, out, reads, &mut st.overdue))
                    .await;
            if let Some(end) = self.on_step(step, hooks, server, flow, policy, out, &mut st)? {
                return Ok(end);
            }
            if out.listener_due.is_some() {
                // Boxed: the relay's future stays the size it is without it.
                Box::pin(self.resume_at_ready(hooks, server, flow, policy, out, &mut st)).await?;
            }
        }
    }

    /// How the relay ends once everything taken has been written both ways, if it does: a
    /// FATAL to report, the client gone or leaving, or (transaction mode) the boundary.
    #[inline(always)]
    fn settled(
        &mut self,
        st: &mut LoopState,
        server: &ServerConn,
        flow: &Flow,
        policy: Policy,
        out: &mut Outbound,
    ) -> Option<RelayEnd> {
        // Bytes a TLS stream took but could not put on its socket yet are not sent.
        let client_sent = out.to_client.is_empty() && out.direct == 0 && !self.stream.wants_flush();
        if client_sent {
            if let Some(e) = st.fatal.take() {
                return Some(RelayEnd::ServerLost(Some(e)));
            }
        }
        if !out.server_pending() && client_sent && !server.stream.wants_flush() {
            if st.draining && flow.pending == 0 {
                return Some(RelayEnd::ClientGone);
            }
            if st.terminate {
                return Some(RelayEnd::Terminate);
            }
            if policy.per_transaction() && flow.at_boundary() && !out.partial() {
                return Some(RelayEnd::Boundary);
            }
            if !policy.per_transaction() && out.counts.queries > 0 && flow.at_boundary() {
                // Session mode: each transaction counts when it ends.
                out.flush_counts(&self.pool);
            }
        }
        None
    }

    /// One step: the first operation that can make progress, in an order that drains
    /// before it fills. Pending operations leave their wakers registered.
    #[inline(always)]
    fn poll_step(
        &mut self,
        cx: &mut std::task::Context<'_>,
        server: &mut ServerConn,
        out: &Outbound,
        reads: Reads,
        overdue: &mut Overdue,
    ) -> Poll<Step> {
        // In each direction, at most one of the two places holds bytes (see
        // `Outbound::direct_to_server` and `Outbound::direct`).
        let to_server = match out.direct_to_server {
            0 => &out.to_server[..],
            n => &self.cbuf[..n],
        };
        if !to_server.is_empty() {
            if let Poll::Ready(r) = Pin::new(&mut server.stream).poll_write(cx, to_server) {
                return Poll::Ready(Step::ToServer(r));
            }
        } else if server.stream.wants_flush() {
            if let Poll::Ready(r) = Pin::new(&mut server.stream).poll_flush(cx) {
                return Poll::Ready(Step::ToServer(r.map(|()| 0)));
            }
        }
        let to_client = match out.direct {
            0 => &out.to_client[..],
            n => &server.buf[..n],
        };
        if !to_client.is_empty() {
            if let Poll::Ready(r) = self.stream.poll_write(cx, to_client) {
                return Poll::Ready(Step::ToClient(r));
            }
        } else if self.stream.wants_flush() {
            if let Poll::Ready(r) = self.stream.poll_flush(cx) {
                return Poll::Ready(Step::ToClient(r.map(|()| 0)));
            }
        }
        // Readiness first: most polls of a side find nothing (one side answers while the
        // other waits), and a read that would find nothing costs more than asking.
        if reads.server && server.stream.poll_read_ready(cx).is_ready() {
            reserve_for_next_at(&mut server.buf, out.direct, out.server_rest > 0);
            if let Poll::Ready(r) = poll_read_buf(&mut server.stream, cx, &mut server.buf) {
                return Poll::Ready(Step::FromServer(r));
            }
        }
        if reads.client && self.stream.poll_read_ready(cx).is_ready() {
            reserve_for_next_at(&mut self.cbuf, out.direct_to_server, out.client_rest > 0);
            if let Poll::Ready(r) = self.stream.poll_read_buf(cx, &mut self.cbuf) {
                return Poll::Ready(Step::FromClient(r));
            }
        }
        if overdue.poll(cx) {
            return Poll::Ready(Step::Overdue);
        }
        Poll::Pending
    }

    /// Does what `step` calls for; how the relay ends, if it does now. Not async: a step
    /// that must wait (for the pool's listener) leaves `out.listener_due` for the loop, so
    /// the common step builds no future of its own.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn on_step<H: Hooks>(
        &mut self,
        step: Step,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        policy: Policy,
        out: &mut Outbound,
        st: &mut LoopState,
    ) -> Result<Option<RelayEnd>, SessionError> {
        match step {
            Step::ToServer(Ok(n)) => {
                out.counts.bytes_in += n as u64;
                if out.direct_to_server > 0 {
                    self.cbuf.advance(n);
                    out.direct_to_server -= n;
                } else {
                    out.to_server.advance(n);
                }
            }
            Step::ToServer(Err(_)) => return Ok(Some(RelayEnd::ServerLost(st.fatal.take()))),
            Step::ToClient(Ok(n)) => out.sent_to_client(n, &mut server.buf),
            Step::ToClient(Err(_)) => return Ok(Some(RelayEnd::ClientGone)),
            Step::FromServer(Ok(0)) | Step::FromServer(Err(_)) => {
                return Ok(Some(RelayEnd::ServerLost(None)))
            }
            Step::FromServer(Ok(_)) => {
                self.server_bytes(hooks, server, flow, policy, out, st)?;
            }
            Step::FromClient(Ok(0))
                if flow.pending > 0
                    && out.client_rest == 0
                    && self
                        .app
                        .lifecycle
                        .closing_clients
                        .load(std::sync::atomic::Ordering::Relaxed) =>
            {
                st.draining = true;
            }
            Step::FromClient(Ok(0)) | Step::FromClient(Err(_)) => {
                return Ok(Some(RelayEnd::ClientGone))
            }
            Step::Overdue => {
                tracing::warn!(conn = self.id, pool = %self.pool.name, "a request ran past max_statement_timeout; cancelling it");
                tokio::spawn(crate::server::forward(server.cancel_target()));
            }
            Step::FromClient(Ok(_)) => {
                // Messages passed in place stay where they are, ahead of what just arrived:
                // `take_client` reads on from behind them. (A streamed message is never
                // passed in place, so `client_rest > 0` has none.)
                if out.client_rest == 0 {
                    self.account_large(out.direct_to_server, true)?;
                }
                st.terminate = !self.take_client(hooks, server, flow, out)?;
                if out.query_start.is_none() && out.server_pending() {
                    out.query_start = Some(crate::clock::mono_us());
                }
            }
        }
        Ok(None)
    }

    /// New bytes from the server: its replies taken. Transaction mode keeps the client and
    /// reports an ERROR once the replies before a FATAL are out; session mode passes it on.
    /// Replies stopped before a ReadyForQuery that waits for the pool's listener are
    /// finished by [`Self::resume_at_ready`].
    #[inline(always)]
    fn server_bytes<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        policy: Policy,
        out: &mut Outbound,
        st: &mut LoopState,
    ) -> Result<(), SessionError> {
        st.answered = out.counts.queries;
        st.fatal = self.take_replies(hooks, server, flow, out, policy)?;
        if out.listener_due.is_none() {
            self.after_replies(hooks, server, flow, out, st)?;
        }
        Ok(())
    }

    /// What follows the replies taken: a held unit proven again, a cancel not sent twice.
    #[inline(always)]
    fn after_replies<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        out: &mut Outbound,
        st: &mut LoopState,
    ) -> Result<(), SessionError> {
        if out.held && flow.is_idle() && flow.status != b'I' {
            // The held unit is inside a block opened READ ONLY: it is proven again now that
            // the block is known, and refused if it is not.
            out.held = false;
            st.terminate = !self.take_client(hooks, server, flow, out)?;
        }
        if out.counts.queries != st.answered {
            // A cancel forwarded before this answer is not sent again.
            self.cancel.slot.note_answered();
        }
        Ok(())
    }
}

/// What the relay loop carries from one step to the next.
struct LoopState {
    /// The client sent Terminate.
    terminate: bool,
    /// The server's FATAL, reported once the replies before it are out.
    fatal: Option<Box<ErrorFields>>,
    overdue: Overdue,
    /// Shutdown closed the client's read side while requests were in flight: their replies
    /// still go out (a forwarded COMMIT's outcome reaches the client), then the client is
    /// told why it is closed.
    draining: bool,
    /// Queries answered before the server's latest bytes were taken.
    answered: u64,
}

/// Which sides the relay reads from this step (neither while too much waits to be written
/// to the other).
#[derive(Clone, Copy)]
struct Reads {
    server: bool,
    client: bool,
}

impl Session {
    /// The server's replies stopped before a ReadyForQuery that waits for the pool's
    /// listener (see [`super::listening`]): waits, then goes on from it.
    async fn resume_at_ready<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        policy: Policy,
        out: &mut Outbound,
        st: &mut LoopState,
    ) -> Result<(), SessionError> {
        while let Some(due) = out.listener_due.take() {
            self.sync_listener(due, server.process_id).await;
            st.fatal = self.take_replies(hooks, server, flow, out, policy)?;
        }
        self.after_replies(hooks, server, flow, out, st)
    }

    /// [`take_server`] with the session's side of the relay.
    #[inline(always)]
    fn take_replies<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        out: &mut Outbound,
        policy: Policy,
    ) -> Result<Option<Box<ErrorFields>>, SessionError> {
        let mut side = ClientSide::of(
            &self.pool,
            &self.params,
            self.id,
            &mut self.statements,
            None,
            super::encoding_of(&self.extras),
        );
        take_server(
            hooks,
            &mut side,
            server,
            &mut self.extras,
            flow,
            out,
            policy,
        )
    }
}

/// What one poll of the relay achieved.
enum Step {
    /// The request running passed `max_statement_timeout` (see [`Overdue`]).
    Overdue,
    ToServer(std::io::Result<usize>),
    ToClient(std::io::Result<usize>),
    FromServer(std::io::Result<usize>),
    FromClient(std::io::Result<usize>),
}

/// Makes room for the next read: at least [`MIN_READ_ROOM`] bytes (a fresh chunk when less is
/// left), or the rest of a large message whose header is already buffered (unless the buffer
/// holds the middle of a message being streamed).
pub fn reserve_for_next(buf: &mut bytes::BytesMut, streaming: bool) {
    reserve_for_next_at(buf, 0, streaming)
}

/// [`reserve_for_next`] for a buffer whose first `at` bytes are already looked at (waiting to
/// be written from there).
fn reserve_for_next_at(buf: &mut bytes::BytesMut, at: usize, streaming: bool) {
    if buf.capacity() == 0 {
        *buf = crate::bufpool::take();
    }
    let pending = &buf[at..];
    let mut want = MIN_READ_ROOM;
    if pending.len() >= 5 && !streaming {
        let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize + 1;
        // Grow towards a large message in steps, so a peer announcing a huge message and
        // sending it slowly cannot make us allocate it all up front.
        want = want.max(len.saturating_sub(pending.len()).min(1 << 20));
    }
    if buf.capacity() - buf.len() < want {
        buf.reserve(want.max(READ_CHUNK));
    }
}
