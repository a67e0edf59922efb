//! The client's side of the relay: each complete message checked for shape, shown to the
//! features that watch what clients send (the replica split, cache invalidation, commands
//! on whole databases, notifications), and handed to the hooks on its way to the server.
//! COPY data passes in streams, and stray COPY messages are dropped.

use crate::seam::Features as _;
use crate::Plugged;
use bytes::Buf;
use shoal_wire::frame::{next_frame_len, HEADER_LEN};
use shoal_wire::frontend::{self, tag as fe};
use shoal_wire::sql::ClientEncoding;

use super::super::flow::Flow;
use super::super::hooks::Hooks;
use super::super::outbound::{stream_some, stream_start, ClientSink, Outbound};
use super::super::{Extras, Session, SessionError};
use super::ClientSide;
use crate::server::ServerConn;

/// What the head of the client's buffer holds.
enum Head {
    /// A streamed or dropped message was dealt with: look again.
    Again,
    /// Nothing more can be taken now.
    Wait,
    /// A whole message of this length, at `out.direct_to_server`.
    Message(usize),
}

impl Session {
    /// Moves every complete client message from `cbuf` to `to_server`, rewriting prepared
    /// statements in transaction mode. Returns false on Terminate (left in `cbuf`).
    ///
    /// Every message is checked for shape first: a malformed one never reaches a server
    /// (PostgreSQL would silently skip to the next Sync, a state Shoal could not see).
    pub(super) fn take_client<H: Hooks>(
        &mut self,
        hooks: &mut H,
        server: &mut ServerConn,
        flow: &mut Flow,
        out: &mut Outbound,
    ) -> Result<bool, SessionError> {
        // Taken from the outbound state (read from the pool once per transaction), not from
        // the pool's lock for every batch of messages.
        let rules = out.rules.clone();
        let mut side = ClientSide::of(
            &self.pool,
            &self.params,
            self.id,
            &mut self.statements,
            rules,
            super::super::encoding_of(&self.extras),
        );
        loop {
            let n = match head(
                &mut self.cbuf,
                flow,
                out,
                self.app.config.server.max_packet_size,
            )? {
                Head::Again => continue,
                Head::Wait => break,
                Head::Message(n) => n,
            };
            let at = out.direct_to_server;
            let tag = self.cbuf[at];
            frontend::validate(tag, &self.cbuf[at + HEADER_LEN..at + n])
                .map_err(SessionError::from_frame)?;
            if (out.reads_only || out.track_writes)
                && replica_gate(&self.cbuf[at..], tag, &mut side, flow, out)
            {
                break;
            }
            if !flow.client(tag).map_err(SessionError::UnknownMessage)? {
                return Ok(false);
            }
            let (head, rest) = self.cbuf.split_at(at);
            let msg = &rest[..n];
            watch(&self.app, &mut side, out, msg, tag);
            if out.notify_active
                && matches!(tag, fe::QUERY | fe::PARSE | fe::BIND)
                && super::super::listening::may_notify(tag, &msg[HEADER_LEN..], side.statements)
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
            settle_side(&mut side, &mut self.extras);
        }
        if hooks.replies_due(&mut server.session) {
            out.spill_to_client(&mut server.buf);
            hooks.emit_due(&mut side.cx(&mut server.session, flow), &mut out.to_client);
        }
        Ok(true)
    }
}

/// Deals with what needs no hook at the head of the client's buffer (the rest of a
/// streamed COPY message, a stray COPY message to drop) and finds the next whole message.
#[inline(always)]
fn head(
    cbuf: &mut bytes::BytesMut,
    flow: &Flow,
    out: &mut Outbound,
    max: usize,
) -> Result<Head, SessionError> {
    if out.client_rest > 0 {
        stream_some(cbuf, &mut out.to_server, &mut out.client_rest);
        return Ok(if out.client_rest > 0 {
            Head::Wait
        } else {
            Head::Again
        });
    }
    if out.client_discard > 0 {
        let n = out.client_discard.min(cbuf.len());
        cbuf.advance(n);
        out.client_discard -= n;
        return Ok(if out.client_discard > 0 {
            Head::Wait
        } else {
            Head::Again
        });
    }
    let at = out.direct_to_server;
    if flow.is_idle()
        && matches!(
            cbuf.get(at),
            Some(&(fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL))
        )
    {
        // No COPY is running or can be starting: PostgreSQL would ignore the message, so it
        // is dropped here, however long, and never half-written to a server.
        let Some(total) = copy_message_len(&cbuf[at..])? else {
            return Ok(Head::Wait);
        };
        out.spill_to_server(cbuf);
        out.client_discard = total;
        return Ok(Head::Again);
    }
    if stream_start(&cbuf[at..], &[fe::COPY_DATA]).is_some() {
        out.spill_to_server(cbuf);
        out.client_rest = stream_start(cbuf, &[fe::COPY_DATA]).unwrap_or(0);
        return Ok(Head::Again);
    }
    Ok(
        match next_frame_len(&cbuf[at..], max).map_err(SessionError::from_frame)? {
            Some(n) => Head::Message(n),
            None => Head::Wait,
        },
    )
}

/// The replica split's say on the message (`msg` starts with it) while the transaction
/// reads on a replica or may write on the primary. True when it must wait for the primary.
#[inline(always)]
fn replica_gate(
    msg: &[u8],
    tag: u8,
    side: &mut ClientSide<'_>,
    flow: &Flow,
    out: &mut Outbound,
) -> bool {
    use super::super::reads::Take;
    let take = super::super::reads::replica_may_take(
        side.pool,
        msg,
        side.statements.as_deref(),
        tag,
        flow,
        out,
        side.encoding,
    );
    match take {
        Take::Pass => false,
        // Not proven to read: it waits for the primary (see `super::super::reads`).
        Take::Hold if out.reads_only => {
            out.held = true;
            true
        }
        Take::Hold => {
            // On the primary: it may write, and the transaction counts as a write.
            out.wrote = true;
            out.track_writes = false;
            false
        }
        Take::Refuse => {
            side.refuse = Some(super::super::reads::REFUSED_ON_REPLICA);
            false
        }
    }
}

/// What features learn from a client message before it goes: the tables it may write (for
/// the cache), a command on a whole database, a function call that may change the encoding.
#[inline(always)]
fn watch(
    app: &crate::app::App,
    side: &mut ClientSide<'_>,
    out: &mut Outbound,
    msg: &[u8],
    tag: u8,
) {
    if let Some(w) = out.writes.as_mut() {
        Plugged::note_write(w, msg, side.statements.as_deref(), side.encoding);
    }
    let body = &msg[HEADER_LEN..];
    match tag {
        fe::QUERY => super::super::hygiene::database_command(app, body, side.encoding),
        fe::PARSE => super::super::hygiene::database_command_parsed(app, body, side.encoding),
        // A function called by its number may be `set_config`.
        fe::FUNCTION_CALL => side.recoding = true,
        _ => {}
    }
}

/// What the hooks found in a message the session keeps: state Shoal does not follow, or an
/// encoding that may change.
#[inline(always)]
fn settle_side(side: &mut ClientSide<'_>, extras: &mut Option<Box<Extras>>) {
    if side.untracked {
        side.untracked = false;
        let x = Extras::get(extras);
        x.holds_state = true;
        x.keeps_state |= std::mem::take(&mut side.keeps);
    }
    if side.recoding && side.encoding != ClientEncoding::Unknown {
        // What follows is read once the server has said how it reads it.
        side.encoding = ClientEncoding::Unknown;
        Extras::get(extras).recoding = true;
    }
}

/// Claims the server for the client's notifications (once per transaction; see
/// [`crate::seam::Features::claim`]).
#[cold]
fn claim(
    pool: &crate::pool::Pool,
    extras: &mut Option<Box<Extras>>,
    server_pid: i32,
    client_pid: i32,
) {
    let x = Extras::get(extras);
    if !x.sets.notified {
        x.sets.notified = true;
        Plugged::claim(pool, server_pid, client_pid);
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
