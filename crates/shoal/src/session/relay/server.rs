//! The server's side of the relay: each reply followed (errors, COPY, reported settings,
//! command tags that change the session or the schema) and passed on, in place or through
//! the hooks, and the end of each request (ReadyForQuery) accounted.

use crate::seam::Features as _;
use crate::Plugged;
use bytes::Buf;
use shoal_wire::backend::{self, tag as be, ErrorFields};
use shoal_wire::frame::{next_frame_len, HEADER_LEN};

use super::super::flow::Flow;
use super::super::hooks::Hooks;
use super::super::outbound::{stream_some, stream_start, Outbound};
use super::super::{Extras, SessionError};
use super::{ClientSide, Policy, SERVER_MAX_MESSAGE};
use crate::prepared::Expect;
use crate::server::ServerConn;

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

/// The tag of a plain read or write (`SELECT`, `INSERT`, `UPDATE`, `DELETE`, `MERGE`,
/// `FETCH`, `MOVE`, `COPY`), which none of the checks below reacts to. Told on four bytes,
/// since nearly every reply ends with one.
#[inline(always)]
fn plain_tag(tag: &[u8]) -> bool {
    matches!(
        tag.first_chunk::<4>(),
        Some(b"SELE" | b"INSE" | b"UPDA" | b"DELE" | b"MERG" | b"FETC" | b"MOVE" | b"COPY")
    )
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
    extras: &mut Option<Box<Extras>>,
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
            Extras::get(extras).sets.executed(op.clone());
            false
        }
        // Among other statements: not followed (see docs/transaction-mode.md); the client is
        // told.
        _ if listen => {
            super::super::listening::warn_uncarried(&mut server.buf, out);
            true
        }
        _ => false,
    }
}

/// Looks at every complete server message in the server's buffer: replies passed on unchanged
/// become `direct` bytes while `to_client` is empty; the rest (and everything after something
/// Shoal adds or hides) is copied to `to_client` (in transaction mode, hiding or adding
/// replies for the statement translation).
/// Stops at a FATAL error, which it returns; in session mode the FATAL itself is passed on.
#[allow(clippy::too_many_arguments)]
pub(super) fn take_server<H: Hooks>(
    hooks: &mut H,
    side: &mut ClientSide<'_>,
    server: &mut ServerConn,
    extras: &mut Option<Box<Extras>>,
    flow: &mut Flow,
    out: &mut Outbound,
    policy: Policy,
) -> Result<Option<Box<ErrorFields>>, SessionError> {
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
                if super::super::listening::before_ready(x, server, out)? {
                    return Ok(None);
                }
                // Notifications may have been put in front of it.
                at = out.direct;
            }
        }
        let mut seen = Seen {
            side: &mut *side,
            server: &mut *server,
            extras: &mut *extras,
            flow: &mut *flow,
            out: &mut *out,
            policy,
        };
        match seen.reply(tag, at, n)? {
            Reply::Fatal(e) => return Ok(Some(e)),
            Reply::Moved => at = out.direct,
            Reply::Seen => {}
        }
        let body_first = server.buf.get(at + HEADER_LEN).copied();
        let forwarded = pass_on(hooks, side, server, flow, out, tag, n);
        if tag == be::READY_FOR_QUERY {
            ready_for_query(
                side,
                extras,
                flow,
                out,
                body_first.unwrap_or(b'I'),
                forwarded,
            );
        }
        if hooks.replies_due(&mut server.session) {
            out.spill_to_client(&mut server.buf);
            hooks.emit_due(&mut side.cx(&mut server.session, flow), &mut out.to_client);
        }
    }
    Ok(None)
}

/// What the relay learns from a server message before it passes on.
enum Reply {
    Seen,
    /// Something was put in front of it (it moved in the buffer).
    Moved,
    /// A FATAL error: the server is lost. Boxed, as everywhere the relay carries one: the
    /// results it passes for every message and step stay small.
    Fatal(Box<ErrorFields>),
}

/// What [`Seen::reply`] reads and updates.
struct Seen<'a, 'b> {
    side: &'a mut ClientSide<'b>,
    server: &'a mut ServerConn,
    extras: &'a mut Option<Box<Extras>>,
    flow: &'a mut Flow,
    out: &'a mut Outbound,
    policy: Policy,
}

impl Seen<'_, '_> {
    /// Follows the server message of type `tag` and length `n` at `at`: errors, COPY,
    /// reported settings, and (in transaction mode) what command tags say.
    #[inline(always)]
    fn reply(&mut self, tag: u8, at: usize, n: usize) -> Result<Reply, SessionError> {
        let body_at = at + HEADER_LEN..at + n;
        match tag {
            be::ERROR_RESPONSE => {
                self.flow.error_response();
                if let Some(x) = self.extras.as_mut() {
                    x.sets.error();
                }
                let e = backend::parse_error(&self.server.buf[body_at])
                    .map_err(SessionError::server_protocol)?;
                self.out.counts.error(&e.code);
                if e.is_fatal() {
                    self.out.spill_to_client(&mut self.server.buf);
                    if self.policy.forwards_fatal() {
                        self.out.to_client.extend_from_slice(&self.server.buf[..n]);
                    }
                    self.server.buf.advance(n);
                    return Ok(Reply::Fatal(Box::new(e)));
                }
            }
            be::COPY_IN_RESPONSE => self.flow.copy_in_response(),
            be::PARAMETER_STATUS => self.parameter_status(body_at)?,
            be::COMMAND_COMPLETE
                if self.policy.per_transaction() && self.command_complete(body_at) =>
            {
                return Ok(Reply::Moved);
            }
            _ => {}
        }
        Ok(Reply::Seen)
    }

    /// A setting the server reports: the client's encoding followed, and a server whose
    /// reported setting changed under a client marked dirty.
    fn parameter_status(&mut self, body: std::ops::Range<usize>) -> Result<(), SessionError> {
        let server = &mut *self.server;
        let (k, v) = backend::parse_parameter_status_bytes(&server.buf[body])
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
            super::super::encoding_reported(self.extras, client, server_enc);
        }
        // A reported setting changed under a client (`SET ROLE` changes `is_superuser`,
        // `set_config` may change `application_name`): whatever did it, the next client
        // must not inherit it.
        if crate::server::set_param_bytes(&mut server.params, k, v) && self.policy.per_transaction()
        {
            server.session.mark_dirty();
        }
        Ok(())
    }

    /// A CommandComplete in transaction mode: session state, schema changes, savepoints
    /// and transaction ends followed. True when something was put in front of it.
    fn command_complete(&mut self, body: std::ops::Range<usize>) -> bool {
        let server = &mut *self.server;
        let body = &server.buf[body];
        if plain_tag(body) {
            return false;
        }
        if let Some(rare) = rare_tag(body) {
            return command_tag_rare(rare, server, self.side, self.extras, self.out);
        }
        if crate::params::changes_session_state(body) {
            server.session.mark_dirty();
            if let Some(Expect::Query(Some(op)) | Expect::Execute(Some(op))) =
                server.session.next_owed()
            {
                Extras::get(self.extras).sets.executed(op.clone());
            }
        } else if crate::params::changes_schema(body) {
            self.side.registry.schema_changed();
            self.flow.schema_changed = true;
        } else if let Some(x) = self.extras.as_mut() {
            match server.session.next_owed() {
                // A savepoint command (`ROLLBACK TO`'s tag is ROLLBACK too).
                Some(Expect::Query(Some(op)) | Expect::Execute(Some(op))) if op.is_savepoint() => {
                    x.sets.executed(op.clone())
                }
                _ if body.starts_with(b"COMMIT") => x.sets.transaction_end(true),
                _ if body.starts_with(b"ROLLBACK") => x.sets.transaction_end(false),
                _ => {}
            }
        }
        false
    }
}

/// Passes the server message of type `tag` and length `n` on: unchanged from where it lies,
/// or (when Shoal rewrites around it) through `to_client`. Whether the client gets it.
#[inline(always)]
fn pass_on<H: Hooks>(
    hooks: &mut H,
    side: &mut ClientSide<'_>,
    server: &mut ServerConn,
    flow: &mut Flow,
    out: &mut Outbound,
    tag: u8,
    n: usize,
) -> bool {
    let in_place = out.to_client.is_empty()
        && !matches!(tag, be::ERROR_RESPONSE | be::COPY_IN_RESPONSE)
        && !hooks.replies_due(&mut server.session);
    if in_place {
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
    }
}

/// A ReadyForQuery (`status`), passed on to the client or not: the request's timing and
/// counts, the client's settings settled, and at a transaction's end the cache told what it
/// wrote and the statements and catalogue told of committed DDL.
#[inline(always)]
fn ready_for_query(
    side: &mut ClientSide<'_>,
    extras: &mut Option<Box<Extras>>,
    flow: &mut Flow,
    out: &mut Outbound,
    status: u8,
    forwarded: bool,
) {
    // Only ReadyForQuery messages the client sees answer what it sent.
    flow.ready_for_query(status, forwarded);
    if flow.is_idle() {
        // Every change of encoding sent has been reported by now.
        if let Some(x) = extras.as_mut() {
            x.recoding = false;
        }
    }
    if forwarded {
        crate::shard::note_answered();
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
        if let Some(x) = extras.as_mut() {
            x.sets.ready(flow.status);
        }
    }
    if flow.status == b'I' {
        // Before the client reads that its transaction ended.
        if let Some(w) = out.writes.as_mut() {
            Plugged::writes_done(w);
        }
    }
    if flow.status == b'I' && std::mem::take(&mut flow.schema_changed) {
        // Committed DDL: statements parsed from now on must see it, and the catalogue the
        // rules, the cache and the replica split judge by is read again.
        side.registry.schema_changed();
        Plugged::schema_changed(side.pool);
    }
}

#[cfg(test)]
mod tests {
    use super::plain_tag;

    #[test]
    fn only_the_tags_of_plain_reads_and_writes_skip_the_checks() {
        for tag in [
            &b"SELECT 1\0"[..],
            b"INSERT 0 1\0",
            b"UPDATE 3\0",
            b"DELETE 0\0",
            b"MERGE 2\0",
            b"FETCH 10\0",
            b"MOVE 1\0",
            b"COPY 5\0",
        ] {
            assert!(plain_tag(tag), "{}", String::from_utf8_lossy(tag));
        }
        // Each of these changes what the session or its prepared statements hold.
        for tag in [
            &b"SET\0"[..],
            b"SAVEPOINT\0",
            b"RELEASE\0",
            b"ROLLBACK\0",
            b"COMMIT\0",
            b"RESET\0",
            b"DISCARD ALL\0",
            b"DEALLOCATE\0",
            b"CREATE TABLE\0",
            b"ALTER TABLE\0",
            b"DROP TABLE\0",
            b"COMMENT\0",
            b"LISTEN\0",
            b"UNLISTEN\0",
            b"SEL",
            b"",
        ] {
            assert!(!plain_tag(tag), "{}", String::from_utf8_lossy(tag));
        }
    }
}
