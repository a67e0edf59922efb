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
use shoal_wire::backend::{self, tag as be, ErrorFields};
use shoal_wire::frame::next_frame_len;
use shoal_wire::frontend::tag as fe;

use std::pin::Pin;
use std::task::Poll;

use tokio::io::AsyncWrite;

use super::flow::Flow;
use super::hooks::{HookCx, Hooks, PassThrough, Prepared};
use super::outbound::{stream_some, stream_start, ClientSink, Outbound};
use super::{Session, SessionError};
use crate::config::replicas::ReadRouting;
use crate::net::poll_read_buf;
use crate::pool::Lease;
use crate::prepared::Expect;
use crate::server::ServerConn;
use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend;
use shoal_wire::sql::ClientEncoding;

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
    ServerLost(Option<ErrorFields>),
}

impl Session {
    /// Moves every complete client message from `cbuf` to `to_server`, rewriting prepared
    /// statements in transaction mode. Returns false on Terminate (left in `cbuf`).
    ///
    /// Every message is checked for shape first: a malformed one never reaches a server
    /// (PostgreSQL would silently skip to the next Sync, a state Shoal could not see).
    fn take_client<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        out: &mut Outbound,
    ) -> Result<bool, SessionError> {
        let max = self.app.config.server.max_packet_size;
        // Taken from the outbound state (read from the pool once per transaction), not from
        // the pool's lock for every batch of messages.
        let rules = out.rules.clone();
        let mut side = ClientSide::of(
            &self.pool,
            &self.params,
            self.id,
            &mut self.statements,
            rules,
            super::encoding_of(&self.extras),
        );
        loop {
            if out.client_rest > 0 {
                stream_some(&mut self.cbuf, &mut out.to_server, &mut out.client_rest);
                if out.client_rest > 0 {
                    break;
                }
                continue;
            }
            if out.client_discard > 0 {
                let n = out.client_discard.min(self.cbuf.len());
                self.cbuf.advance(n);
                out.client_discard -= n;
                if out.client_discard > 0 {
                    break;
                }
                continue;
            }
            let at = out.direct_to_server;
            if flow.is_idle()
                && matches!(
                    self.cbuf.get(at),
                    Some(&(fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL))
                )
            {
                // No COPY is running or can be starting: PostgreSQL would ignore the message,
                // so it is dropped here, however long, and never half-written to a server.
                let Some(total) = copy_message_len(&self.cbuf[at..])? else {
                    break;
                };
                out.spill_to_server(&mut self.cbuf);
                out.client_discard = total;
                continue;
            }
            if stream_start(&self.cbuf[at..], &[fe::COPY_DATA]).is_some() {
                out.spill_to_server(&mut self.cbuf);
                out.client_rest = stream_start(&self.cbuf, &[fe::COPY_DATA]).unwrap_or(0);
                continue;
            }
            let Some(n) =
                next_frame_len(&self.cbuf[at..], max).map_err(SessionError::from_frame)?
            else {
                break;
            };
            let tag = self.cbuf[at];
            frontend::validate(tag, &self.cbuf[at + HEADER_LEN..at + n])
                .map_err(SessionError::from_frame)?;
            if out.reads_only || out.track_writes {
                use super::reads::Take;
                match super::reads::replica_may_take(
                    &self.pool,
                    &self.cbuf[at..],
                    side.statements.as_deref(),
                    tag,
                    flow,
                    out,
                    side.encoding,
                ) {
                    Take::Pass => {}
                    Take::Hold if out.reads_only => {
                        // Not proven to read: it waits for the primary (see `super::reads`).
                        out.held = true;
                        break;
                    }
                    Take::Hold => {
                        // On the primary: it may write, and the transaction counts as a write.
                        out.wrote = true;
                        out.track_writes = false;
                    }
                    Take::Refuse => side.refuse = Some(super::reads::REFUSED_ON_REPLICA),
                }
            }
            if !flow.client(tag).map_err(SessionError::UnknownMessage)? {
                return Ok(false);
            }
            let (head, rest) = self.cbuf.split_at(at);
            let msg = &rest[..n];
            if let Some(cache) = &out.cache {
                super::cached::note_writes(
                    cache,
                    msg,
                    side.statements.as_deref(),
                    &mut out.touched,
                    side.encoding,
                );
            }
            let body = &msg[HEADER_LEN..];
            match tag {
                fe::QUERY => super::hygiene::database_command(&self.app, body, side.encoding),
                fe::PARSE => {
                    super::hygiene::database_command_parsed(&self.app, body, side.encoding)
                }
                // A function called by its number may be `set_config`.
                fe::FUNCTION_CALL => side.recoding = true,
                _ => {}
            }
            if out.notify_active
                && matches!(tag, fe::QUERY | fe::PARSE | fe::BIND)
                && super::listening::may_notify(tag, &msg[HEADER_LEN..], side.statements)
            {
                // Before the message is written: its notifications cannot be read earlier.
                claim(
                    &self.pool,
                    &mut self.extras,
                    server.process_id,
                    self.cancel.process_id(),
                );
            }
            let mut sink = ClientSink::new(head, msg, &mut out.to_server);
            hooks
                .client_message(&mut side.cx(&mut server.session, flow), msg, &mut sink)
                .map_err(SessionError::from_frame)?;
            let (consumed, direct) = sink.settle();
            self.cbuf.advance(consumed);
            out.direct_to_server = direct;
            if side.untracked {
                side.untracked = false;
                let x = super::Extras::get(&mut self.extras);
                x.holds_state = true;
                x.keeps_state |= std::mem::take(&mut side.keeps);
            }
            if side.recoding && side.encoding != ClientEncoding::Unknown {
                // What follows is read once the server has said how it reads it.
                side.encoding = ClientEncoding::Unknown;
                super::Extras::get(&mut self.extras).recoding = true;
            }
        }
        if hooks.replies_due(&mut server.session) {
            out.spill_to_client(&mut server.buf);
            hooks.emit_due(&mut side.cx(&mut server.session, flow), &mut out.to_client);
        }
        Ok(true)
    }
}

/// CommandComplete tags of commands rarely run that the relay follows in transaction mode.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RareTag {
    Listen,
    Unlisten,
    Deallocate,
}

#[inline]
fn rare_tag(tag: &[u8]) -> Option<RareTag> {
    // One byte rules out the tags of ordinary statements (SELECT, INSERT, COMMIT, ...).
    match tag.first()? {
        b'L' if tag.starts_with(b"LISTEN\0") => Some(RareTag::Listen),
        b'U' if tag.starts_with(b"UNLISTEN\0") => Some(RareTag::Unlisten),
        b'D' if tag.starts_with(b"DEALLOCATE\0") => Some(RareTag::Deallocate),
        _ => None,
    }
}

/// `LISTEN`/`UNLISTEN` (carried, see [`crate::notify`]) and `DEALLOCATE` through the
/// extended protocol (the client's name goes). True when something was put in front of the
/// reply (it moved).
#[cold]
#[inline(never)]
fn command_tag_rare(
    tag: RareTag,
    server: &mut ServerConn,
    side: &mut ClientSide<'_>,
    extras: &mut Option<Box<super::Extras>>,
    out: &mut Outbound,
) -> bool {
    if tag == RareTag::Deallocate {
        if let Some(Expect::Execute(Some(crate::sets::SetOp::Deallocate(name)))) =
            server.session.next_owed()
        {
            if let Some(c) = side.statements.as_mut() {
                c.deallocated(name);
            }
        }
        return false;
    }
    let listen = tag == RareTag::Listen;
    if listen {
        server.session.listened();
    }
    match server.session.next_owed() {
        Some(Expect::Query(Some(op)) | Expect::Execute(Some(op))) if op.is_listen() => {
            super::Extras::get(extras).sets.executed(op.clone());
            false
        }
        // Among other statements: not followed (see docs/transaction-mode.md); the client is
        // told.
        _ if listen => {
            super::listening::warn_uncarried(&mut server.buf, out);
            true
        }
        _ => false,
    }
}

/// Claims the server for the client's notifications (once per transaction; see
/// [`crate::notify::Hub::claim`]).
#[cold]
fn claim(
    pool: &crate::pool::Pool,
    extras: &mut Option<Box<super::Extras>>,
    server_pid: i32,
    client_pid: i32,
) {
    let x = super::Extras::get(extras);
    if !x.sets.notified {
        x.sets.notified = true;
        pool.notify.claim(server_pid, client_pid);
    }
}

/// The length of the COPY message at the head of `buf` (from its header), `None` until the
/// header is there.
fn copy_message_len(buf: &[u8]) -> Result<Option<usize>, SessionError> {
    let Some(header) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len < 4 {
        return Err(SessionError::from_frame(
            shoal_wire::frame::FrameError::BadLength {
                tag: header[0] as char,
                len: len as u32,
            },
        ));
    }
    Ok(Some(len + 1))
}

/// Looks at every complete server message in the server's buffer: replies passed on unchanged
/// become `direct` bytes while `to_client` is empty; the rest (and everything after something
/// Shoal adds or hides) is copied to `to_client` (in transaction mode, hiding or adding
/// replies for the statement translation).
/// Stops at a FATAL error, which it returns; in session mode the FATAL itself is passed on.
#[allow(clippy::too_many_arguments)]
fn take_server<H: Hooks>(
    hooks: &mut H,
    side: &mut ClientSide<'_>,
    server: &mut ServerConn,
    extras: &mut Option<Box<super::Extras>>,
    flow: &mut Flow,
    out: &mut Outbound,
    policy: Policy,
) -> Result<Option<ErrorFields>, SessionError> {
    let registry = side.registry;
    loop {
        if out.server_rest > 0 {
            stream_some(&mut server.buf, &mut out.to_client, &mut out.server_rest);
            if out.server_rest > 0 {
                break;
            }
            continue;
        }
        let mut at = out.direct;
        if stream_start(&server.buf[at..], &[be::DATA_ROW, be::COPY_DATA]).is_some() {
            out.spill_to_client(&mut server.buf);
            if hooks.replies_due(&mut server.session) {
                hooks.emit_due(&mut side.cx(&mut server.session, flow), &mut out.to_client);
            }
            out.server_rest =
                stream_start(&server.buf, &[be::DATA_ROW, be::COPY_DATA]).unwrap_or(0);
            continue;
        }
        let Some(n) = next_frame_len(&server.buf[at..], SERVER_MAX_MESSAGE)
            .map_err(SessionError::server_protocol)?
        else {
            break;
        };
        let tag = server.buf[at];
        if let Some(x) = extras.as_mut() {
            if tag == be::READY_FOR_QUERY && policy.per_transaction() {
                if super::listening::before_ready(x, server, out)? {
                    return Ok(None);
                }
                // Notifications may have been put in front of it.
                at = out.direct;
            }
        }
        let body = &server.buf[at + HEADER_LEN..at + n];
        match tag {
            be::ERROR_RESPONSE => {
                flow.error_response();
                if let Some(x) = extras.as_mut() {
                    x.sets.error();
                }
                let e = backend::parse_error(body).map_err(SessionError::server_protocol)?;
                out.counts.error(&e.code);
                if e.is_fatal() {
                    out.spill_to_client(&mut server.buf);
                    if policy.forwards_fatal() {
                        out.to_client.extend_from_slice(&server.buf[..n]);
                    }
                    server.buf.advance(n);
                    return Ok(Some(e));
                }
            }
            be::COPY_IN_RESPONSE => {
                flow.copy_in_response();
            }
            be::PARAMETER_STATUS => {
                let (k, v) = backend::parse_parameter_status_bytes(body)
                    .map_err(SessionError::server_protocol)?;
                if k == b"client_encoding" || k == b"server_encoding" {
                    let (client, server_enc) = {
                        let get = |name: &str| {
                            server
                                .params
                                .iter()
                                .find(|(n, _)| n == name)
                                .map(|(_, v)| v.as_str())
                        };
                        let v = std::str::from_utf8(v).ok();
                        if k == b"client_encoding" {
                            (v, get("server_encoding"))
                        } else {
                            (get("client_encoding"), v)
                        }
                    };
                    super::encoding_reported(extras, client, server_enc);
                }
                // A reported setting changed under a client (`SET ROLE` changes
                // `is_superuser`, `set_config` may change `application_name`): whatever
                // did it, the next client must not inherit it.
                if crate::server::set_param_bytes(&mut server.params, k, v)
                    && policy.per_transaction()
                {
                    server.session.mark_dirty();
                }
            }
            be::COMMAND_COMPLETE if policy.per_transaction() => {
                if let Some(rare) = rare_tag(body) {
                    if command_tag_rare(rare, server, side, extras, out) {
                        at = out.direct;
                    }
                } else if crate::params::changes_session_state(body) {
                    server.session.mark_dirty();
                    if let Some(Expect::Query(Some(op)) | Expect::Execute(Some(op))) =
                        server.session.next_owed()
                    {
                        super::Extras::get(extras).sets.executed(op.clone());
                    }
                } else if crate::params::changes_schema(body) {
                    registry.schema_changed();
                    flow.schema_changed = true;
                } else if let Some(x) = extras.as_mut() {
                    match server.session.next_owed() {
                        // A savepoint command (`ROLLBACK TO`'s tag is ROLLBACK too).
                        Some(Expect::Query(Some(op)) | Expect::Execute(Some(op)))
                            if op.is_savepoint() =>
                        {
                            x.sets.executed(op.clone())
                        }
                        _ if body.starts_with(b"COMMIT") => x.sets.transaction_end(true),
                        _ if body.starts_with(b"ROLLBACK") => x.sets.transaction_end(false),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        let body_first = server.buf.get(at + HEADER_LEN).copied();
        // Passed on unchanged from where it lies, or (when Shoal rewrites around it)
        // through `to_client`.
        let in_place = out.to_client.is_empty()
            && !matches!(tag, be::ERROR_RESPONSE | be::COPY_IN_RESPONSE)
            && !hooks.replies_due(&mut server.session);
        let forwarded = if in_place {
            let forward = hooks.passes(&mut server.session, tag);
            if forward {
                out.direct += n;
            } else if out.direct == 0 {
                server.buf.advance(n);
            } else {
                out.spill_to_client(&mut server.buf);
                server.buf.advance(n);
            }
            forward
        } else {
            out.spill_to_client(&mut server.buf);
            let forward = hooks.server_reply(
                &mut side.cx(&mut server.session, flow),
                &server.buf[..n],
                &mut out.to_client,
            );
            server.buf.advance(n);
            forward
        };
        if tag == be::READY_FOR_QUERY {
            // Only ReadyForQuery messages the client sees answer what it sent.
            flow.ready_for_query(body_first.unwrap_or(b'I'), forwarded);
            if forwarded {
                crate::shard::note_answered();
            }
            if flow.is_idle() {
                // Every change of encoding sent has been reported by now.
                if let Some(x) = extras.as_mut() {
                    x.recoding = false;
                }
            }
            if forwarded {
                out.counts.queries += 1;
                if let Some(t) = out.query_start.take() {
                    let now = crate::clock::mono_us();
                    out.last_ready = Some(now);
                    let us = now.saturating_sub(t);
                    out.counts.query_us.observe_us(us);
                    out.counts.slowest_us = out.counts.slowest_us.max(us);
                    // Pipelined queries already sent: the next one runs from now.
                    if flow.pending > 0 {
                        out.query_start = Some(now);
                    }
                }
            }
            if forwarded {
                if let Some(x) = extras.as_mut() {
                    x.sets.ready(flow.status);
                }
            }
            if flow.status == b'I' && !out.touched.is_nothing() {
                // Before the client reads that its transaction ended.
                if let Some(cache) = &out.cache {
                    out.touched.apply(&cache.freshness);
                }
            }
            if flow.status == b'I' && std::mem::take(&mut flow.schema_changed) {
                // Committed DDL: statements parsed from now on must see it, and the
                // catalogue the rules, the cache and the replica split judge by is read
                // again.
                registry.schema_changed();
                side.pool.catalogue().changed();
            }
        }
        if hooks.replies_due(&mut server.session) {
            out.spill_to_client(&mut server.buf);
            hooks.emit_due(&mut side.cx(&mut server.session, flow), &mut out.to_client);
        }
    }
    Ok(None)
}

/// The client's side of the session, lent to hooks while messages pass.
struct ClientSide<'a> {
    registry: &'a crate::prepared::StatementRegistry,
    /// For what DDL makes stale (rare: read from the pool when it happens).
    pool: &'a crate::pool::Pool,
    rules: Option<std::sync::Arc<crate::query_rules::QueryRules>>,
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
        rules: Option<std::sync::Arc<crate::query_rules::QueryRules>>,
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
            rules: self.rules.as_deref(),
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
        capture: Option<Box<crate::cache::Capture>>,
    ) -> Result<RelayEnd, SessionError> {
        let mut out = Outbound::new();
        out.capture = capture;
        // Read once per transaction: a pool's first listener arriving meanwhile misses only
        // this transaction's claim (see `crate::notify::Hub::claim`).
        out.notify_active = policy.per_transaction() && self.pool.notify.active();
        // In force for the whole transaction (a change applies from the next one).
        if policy.per_transaction() {
            out.rules = self.pool.rules();
            if self.takes_writes(lease.pool()) {
                out.cache = self.pool.cache();
            }
        }
        if policy.per_transaction()
            && self.pool.replicas().is_some()
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
            if let Some(l) = self.pool.limits() {
                l.charge(out.counts.queries);
            }
        }
        out.flush_counts(&self.pool);
        if let Some(cache) = &out.cache {
            // Ended without its ReadyForQuery (a lost server): what it sent may have
            // committed.
            out.touched.apply(&cache.freshness);
        }
        if let Some(capture) = out.capture.take() {
            capture.finish();
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
        let mut terminate = !self.take_client(hooks, server, flow, out)?;
        if out.server_pending() {
            out.query_start = Some(out.txn_start);
        }
        let mut fatal: Option<ErrorFields> = None;
        let mut overdue = Overdue::new(self.pool.settings.statement_timeout);
        // Shutdown closed the client's read side while requests were in flight: their
        // replies still go out (a forwarded COMMIT's outcome reaches the client), then the
        // client is told why it is closed.
        let mut draining = false;
        loop {
            // Bytes a TLS stream took but could not put on its socket yet are not sent.
            let client_sent =
                out.to_client.is_empty() && out.direct == 0 && !self.stream.wants_flush();
            if client_sent {
                if let Some(e) = fatal.take() {
                    return Ok(RelayEnd::ServerLost(Some(e)));
                }
            }
            if !out.server_pending() && client_sent && !server.stream.wants_flush() {
                if draining && flow.pending == 0 {
                    return Ok(RelayEnd::ClientGone);
                }
                if terminate {
                    return Ok(RelayEnd::Terminate);
                }
                if policy.per_transaction() && flow.at_boundary() && !out.partial() {
                    return Ok(RelayEnd::Boundary);
                }
                if !policy.per_transaction() && out.counts.queries > 0 && flow.at_boundary() {
                    // Session mode: each transaction counts when it ends.
                    out.flush_counts(&self.pool);
                }
            }
            overdue.arm(out.query_start, flow.pending > 0);
            let read_server = out.to_client.len() + out.direct < HIGH_WATER && fatal.is_none();
            let read_client = out.to_server.len() + out.direct_to_server < HIGH_WATER
                && !terminate
                && !draining
                && !out.held;
            // One step: the first operation that can make progress, in an order that drains
            // before it fills. Pending operations leave their wakers registered.
            let step = std::future::poll_fn(|cx| {
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
                // Readiness first: most polls of a side find nothing (one side answers while
                // the other waits), and a read that would find nothing costs more than asking.
                if read_server && server.stream.poll_read_ready(cx).is_ready() {
                    reserve_for_next_at(&mut server.buf, out.direct, out.server_rest > 0);
                    if let Poll::Ready(r) = poll_read_buf(&mut server.stream, cx, &mut server.buf) {
                        return Poll::Ready(Step::FromServer(r));
                    }
                }
                if read_client && self.stream.poll_read_ready(cx).is_ready() {
                    reserve_for_next_at(&mut self.cbuf, out.direct_to_server, out.client_rest > 0);
                    if let Poll::Ready(r) = self.stream.poll_read_buf(cx, &mut self.cbuf) {
                        return Poll::Ready(Step::FromClient(r));
                    }
                }
                if overdue.poll(cx) {
                    return Poll::Ready(Step::Overdue);
                }
                Poll::Pending
            })
            .await;
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
                Step::ToServer(Err(_)) => return Ok(RelayEnd::ServerLost(fatal)),
                Step::ToClient(Ok(n)) => {
                    out.counts.bytes_out += n as u64;
                    if let Some(c) = out.capture.as_mut() {
                        c.feed(match out.direct {
                            0 => &out.to_client[..n],
                            _ => &server.buf[..n],
                        });
                    }
                    if out.direct > 0 {
                        server.buf.advance(n);
                        out.direct -= n;
                    } else {
                        out.to_client.advance(n);
                    }
                }
                Step::ToClient(Err(_)) => return Ok(RelayEnd::ClientGone),
                Step::FromServer(Ok(0)) | Step::FromServer(Err(_)) => {
                    return Ok(RelayEnd::ServerLost(None))
                }
                Step::FromServer(Ok(_)) => {
                    // Transaction mode keeps the client and reports an ERROR once the
                    // replies before the FATAL are out; session mode passes it on.
                    let mut side = ClientSide::of(
                        &self.pool,
                        &self.params,
                        self.id,
                        &mut self.statements,
                        None,
                        super::encoding_of(&self.extras),
                    );
                    fatal = take_server(
                        hooks,
                        &mut side,
                        server,
                        &mut self.extras,
                        flow,
                        out,
                        policy,
                    )?;
                    if out.listener_due.is_some() {
                        // Boxed: the relay's future stays the size it is without it.
                        fatal = Box::pin(self.resume_at_ready(hooks, server, flow, out, policy))
                            .await?;
                    }
                    if out.held && flow.is_idle() && flow.status != b'I' {
                        // The held unit is inside a block opened READ ONLY: it is proven
                        // again now that the block is known, and refused if it is not.
                        out.held = false;
                        terminate = !self.take_client(hooks, server, flow, out)?;
                    }
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
                    draining = true;
                }
                Step::FromClient(Ok(0)) | Step::FromClient(Err(_)) => {
                    return Ok(RelayEnd::ClientGone)
                }
                Step::Overdue => {
                    tracing::warn!(conn = self.id, pool = %self.pool.name, "a request ran past max_statement_timeout; cancelling it");
                    tokio::spawn(crate::server::forward(server.cancel_target()));
                }
                Step::FromClient(Ok(_)) => {
                    // Messages passed in place stay where they are, ahead of what just
                    // arrived: `take_client` reads on from behind them. (A streamed message
                    // is never passed in place, so `client_rest > 0` has none.)
                    if out.client_rest == 0 {
                        self.account_large(out.direct_to_server, true)?;
                    }
                    terminate = !self.take_client(hooks, server, flow, out)?;
                    if out.query_start.is_none() && out.server_pending() {
                        out.query_start = Some(crate::clock::mono_us());
                    }
                }
            }
        }
    }
}

impl Session {
    /// The server's replies stopped before a ReadyForQuery that waits for the pool's
    /// listener (see [`super::listening`]): waits, then goes on from it.
    async fn resume_at_ready<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        out: &mut Outbound,
        policy: Policy,
    ) -> Result<Option<ErrorFields>, SessionError> {
        let mut fatal = None;
        while let Some(due) = out.listener_due.take() {
            self.sync_listener(due, server.process_id).await;
            let mut side = ClientSide::of(
                &self.pool,
                &self.params,
                self.id,
                &mut self.statements,
                None,
                super::encoding_of(&self.extras),
            );
            fatal = take_server(
                hooks,
                &mut side,
                server,
                &mut self.extras,
                flow,
                out,
                policy,
            )?;
        }
        Ok(fatal)
    }
}

/// The backstop of `max_statement_timeout`: PostgreSQL ends a statement past it itself
/// (servers start with it as their `statement_timeout`), but a client may raise its own
/// setting (`SET`, `set_config`, a function's `SET` clause). A request (a Query, or extended
/// messages up to Sync) still running [`OVERDUE_GRACE`] past the cap is cancelled by Shoal.
struct Overdue {
    limit: Option<std::time::Duration>,
    /// The request it times (its start), and the timer.
    timer: Option<(u64, Pin<Box<crate::timer::Sleep>>)>,
    /// The request already cancelled.
    fired: Option<u64>,
}

/// How long past the cap Shoal waits for PostgreSQL's own timeout before it cancels.
const OVERDUE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

impl Overdue {
    fn new(cap: Option<std::time::Duration>) -> Overdue {
        Overdue {
            limit: cap.map(|c| c + OVERDUE_GRACE),
            timer: None,
            fired: None,
        }
    }

    /// Times the request that started at `start` while one is running.
    fn arm(&mut self, start: Option<u64>, running: bool) {
        let Some(limit) = self.limit else { return };
        match start {
            Some(t) if running && self.fired != Some(t) => {
                if self.timer.as_ref().map(|w| w.0) != Some(t) {
                    let elapsed =
                        std::time::Duration::from_micros(crate::clock::mono_us().saturating_sub(t));
                    let left = limit.saturating_sub(elapsed);
                    self.timer = Some((t, Box::pin(crate::timer::sleep(left))));
                }
            }
            _ => self.timer = None,
        }
    }

    /// Whether the running request just passed the limit.
    fn poll(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        let Some((t, sleep)) = self.timer.as_mut() else {
            return false;
        };
        if std::future::Future::poll(sleep.as_mut(), cx).is_pending() {
            return false;
        }
        self.fired = Some(*t);
        self.timer = None;
        true
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
