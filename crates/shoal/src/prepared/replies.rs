//! The server side of the translation: walking the reply stream against the queue of what the
//! server owes, hiding Shoal's own replies and adding the ones Shoal answers itself.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use bytes::BytesMut;
use shoal_wire::backend::{self, put_message, tag as be, Severity};
use shoal_wire::sqlstate;

use super::translate::{plan_error, retire};
use super::{ClientStatements, Expect, ServerStatements, StatementDef};

/// Emits the replies Shoal owes itself that are now due (at the head of the queue).
/// `pending` counts the ReadyForQuery messages the client is still owed (one is answered
/// here for each SQL `DEALLOCATE` Shoal handles itself); `status` is the transaction status
/// to report with it.
///
/// Runs after every server message: the check that nothing is due is inlined, the work is not.
#[inline]
pub fn emit_due(
    queue: &mut VecDeque<Expect>,
    client: &mut Option<Box<ClientStatements>>,
    out: &mut BytesMut,
    pending: &mut u32,
    status: u8,
) {
    if synthetic_due(queue) {
        emit_synthetic(queue, client, out, pending, status);
    }
}

/// Whether [`emit_due`] has something to emit.
#[inline]
pub fn synthetic_due(queue: &VecDeque<Expect>) -> bool {
    matches!(
        queue.front(),
        Some(
            Expect::SyntheticParse(_) | Expect::SyntheticClose(_) | Expect::SyntheticDeallocate(_)
        )
    )
}

#[inline(never)]
fn emit_synthetic(
    queue: &mut VecDeque<Expect>,
    client: &mut Option<Box<ClientStatements>>,
    out: &mut BytesMut,
    pending: &mut u32,
    status: u8,
) {
    loop {
        match queue.front() {
            Some(Expect::SyntheticParse(_)) => put_message(out, be::PARSE_COMPLETE, |_| {}),
            Some(Expect::SyntheticClose(name)) => {
                if let Some(c) = client.as_mut() {
                    c.named.remove(name);
                }
                put_message(out, be::CLOSE_COMPLETE, |_| {});
            }
            Some(Expect::SyntheticDeallocate(_)) => {
                if status == b'E' {
                    backend::error_response(
                        out,
                        Severity::Error,
                        sqlstate::IN_FAILED_SQL_TRANSACTION,
                        "current transaction is aborted, commands ignored until end of transaction block",
                        None,
                    );
                } else {
                    put_message(out, be::COMMAND_COMPLETE, |b| {
                        backend::put_cstr(b, "DEALLOCATE")
                    });
                }
                backend::ready_for_query(out, status);
                *pending = pending.saturating_sub(1);
            }
            _ => return,
        }
        queue.pop_front();
    }
}

/// Walks one server reply `msg` (a whole frame) against the queue: emits synthetic replies
/// due before it, then appends the reply itself to `out` unless it is hidden (or its
/// replacement, for [`Expect::Fail`]). Returns whether the reply reached the client. The
/// caller then calls [`emit_due`] for the synthetic replies that follow it.
pub fn server_reply(
    queue: &mut VecDeque<Expect>,
    server: &mut ServerStatements,
    client: &mut Option<Box<ClientStatements>>,
    msg: &[u8],
    out: &mut BytesMut,
    pending: &mut u32,
    status: u8,
) -> bool {
    let tag = msg[0];
    // Replies that can come at any time and belong to no request.
    if matches!(tag, be::NOTICE_RESPONSE | be::PARAMETER_STATUS) {
        out.extend_from_slice(msg);
        return true;
    }
    if tag == be::NOTIFICATION_RESPONSE {
        // The server listens only until its client's transaction ends (a carried LISTEN);
        // the pool's listener delivers the same notification (see `crate::notify`).
        return false;
    }
    emit_due(queue, client, out, pending, status);
    let Some(head) = queue.front() else {
        out.extend_from_slice(msg);
        return true;
    };
    if tag == be::ERROR_RESPONSE {
        error_reply(queue, server, client, msg, out);
        return true;
    }
    if tag == be::COPY_IN_RESPONSE && matches!(head, Expect::Execute(_)) {
        // The server ignores Syncs that reach it during COPY FROM STDIN: those already sent
        // after this Execute will never be answered.
        let mut i = 1;
        while i < queue.len() {
            if matches!(queue[i], Expect::Sync) {
                queue.remove(i);
            } else {
                i += 1;
            }
        }
        out.extend_from_slice(msg);
        return true;
    }
    let forward = pass_reply(queue, tag);
    if forward {
        out.extend_from_slice(msg);
    }
    forward
}

/// A server reply that Shoal passes on or hides but never rewrites (anything but
/// ErrorResponse and CopyInResponse), with no synthetic reply due before it
/// ([`synthetic_due`]): moves the queue past it and says whether the client sees it. Writes
/// nothing, so the caller can send the reply from where it lies.
#[inline]
pub fn pass_reply(queue: &mut VecDeque<Expect>, tag: u8) -> bool {
    if matches!(tag, be::NOTICE_RESPONSE | be::PARAMETER_STATUS) {
        return true;
    }
    if tag == be::NOTIFICATION_RESPONSE {
        // Dropped, as in `server_reply`.
        return false;
    }
    let Some(head) = queue.front() else {
        return true;
    };
    let (done, forward) = match (head, tag) {
        (Expect::Parse(def, _), be::PARSE_COMPLETE) => {
            def.validated.store(true, Ordering::Relaxed);
            (true, true)
        }
        (Expect::HideParse(def), be::PARSE_COMPLETE) => {
            def.validated.store(true, Ordering::Relaxed);
            (true, false)
        }
        (Expect::ParseUnnamed(_), be::PARSE_COMPLETE) => (true, true),
        (Expect::HideParseUnnamed(_), be::PARSE_COMPLETE) => (true, false),
        (Expect::HideClose(_), be::CLOSE_COMPLETE) => (true, false),
        (Expect::HideTarget, be::PARSE_COMPLETE | be::CLOSE_COMPLETE) => (true, false),
        (Expect::HideSync, be::READY_FOR_QUERY) => (true, false),
        (Expect::Bind(_), be::BIND_COMPLETE) => (true, true),
        (Expect::DescribeStatement(_), b't') => (false, true),
        (Expect::DescribeStatement(_) | Expect::DescribePortal, b'T' | b'n') => (true, true),
        (Expect::Execute(_), be::COMMAND_COMPLETE | b'I' | b's') => (true, true),
        (Expect::Execute(_), _) => (false, true),
        (Expect::Close, be::CLOSE_COMPLETE) => (true, true),
        (Expect::Sync | Expect::Query(_), be::READY_FOR_QUERY) => (true, true),
        (Expect::Query(_), _) => (false, true),
        // Anything else is passed on untouched; the queue stays as it is.
        _ => (false, true),
    };
    if done {
        queue.pop_front();
    }
    forward
}

/// Forgets the client's name for `def` (unless a later Parse gave the name another statement).
fn forget(client: &mut Option<Box<ClientStatements>>, name: &[u8], def: &StatementDef) {
    if let Some(c) = client.as_mut() {
        if c.named.get(name).is_some_and(|d| d.id == def.id) {
            c.named.remove(name);
        }
    }
}

/// An ErrorResponse: a simple query goes on to its ReadyForQuery; in an extended batch the
/// server skips to the next Sync, and so does the queue.
fn error_reply(
    queue: &mut VecDeque<Expect>,
    server: &mut ServerStatements,
    client: &mut Option<Box<ClientStatements>>,
    msg: &[u8],
    out: &mut BytesMut,
) {
    let fields = backend::parse_error(&msg[shoal_wire::frame::HEADER_LEN..]).unwrap_or_default();
    match queue.front() {
        Some(Expect::Fail(f)) => {
            backend::error_response(out, Severity::Error, f.0, &f.1, None);
        }
        Some(head) => {
            match head {
                Expect::Bind(Some(def)) | Expect::DescribeStatement(Some(def))
                    if plan_error(&fields) =>
                {
                    retire(def)
                }
                // Shoal's own bookkeeping was wrong about this server: start it afresh
                // before anyone else uses it.
                Expect::HideParse(_)
                | Expect::HideParseUnnamed(_)
                | Expect::HideClose(_)
                | Expect::Parse(..) => server.needs_clean = true,
                _ => {}
            }
            out.extend_from_slice(msg);
            if matches!(head, Expect::Query(_) | Expect::Sync | Expect::HideSync) {
                return;
            }
        }
        None => {
            out.extend_from_slice(msg);
            return;
        }
    }
    // Statements whose Parse was skipped (or failed) do not exist on the server; a skipped
    // Close leaves its statement there.
    while let Some(e) = queue.front() {
        match e {
            Expect::Sync | Expect::HideSync | Expect::Query(_) | Expect::SyntheticDeallocate(_) => {
                break
            }
            Expect::Parse(def, name) => {
                // PostgreSQL did not create the client's statement: the name is free again.
                server.remove(def.id);
                forget(client, name, def);
            }
            Expect::SyntheticParse(name) => {
                if let Some(c) = client.as_mut() {
                    c.named.remove(name);
                }
            }
            Expect::HideParse(def) => server.remove(def.id),
            Expect::ParseUnnamed(seq) | Expect::HideParseUnnamed(seq) => {
                // Unless a later Parse replaced it, the client's unnamed statement is gone.
                if server.unnamed_owner.is_some_and(|(_, s)| s == *seq) {
                    server.unnamed_owner = None;
                }
                if let Some(c) = client.as_mut() {
                    if c.unnamed.as_ref().is_some_and(|u| u.seq == *seq) {
                        c.unnamed = None;
                    }
                }
            }
            Expect::HideClose(id) => {
                server.insert(*id, usize::MAX);
            }
            _ => {}
        }
        queue.pop_front();
    }
}
