//! A transaction-mode client's LISTEN/NOTIFY, from the session's side: telling the pool's
//! listener what the client listens to before the client learns its LISTEN is done, its own
//! NOTIFY reaching it before its ReadyForQuery, and its notifications written to its socket
//! (the listener itself is behind [`crate::seam::Features`]).

use std::task::{Context, Poll};

use bytes::BytesMut;
use shoal_wire::backend;
use shoal_wire::sqlstate;

use super::outbound::Outbound;
use super::{Extras, Session, SessionError};
use crate::error::ErrorKind;
use crate::mailbox::Mail;
use crate::seam::Features as _;
use crate::Plugged;

/// What the listener must do before the client's next ReadyForQuery goes out.
#[derive(Debug, Clone, Copy)]
pub(super) struct ListenerDue {
    /// The channels the client listens to changed.
    update: bool,
    /// The client's transaction may have notified: what it sent reaches the pool's
    /// listeners first (see [`crate::seam::Features::claim`]).
    barrier: bool,
}

/// At a ReadyForQuery from the server (at the head of what is left of its buffer): true when
/// the relay must stop before it and wait for the pool's listener ([`Outbound::listener_due`]
/// says why); otherwise the client's waiting notifications are put in front of it.
#[inline(never)]
pub(super) fn before_ready(
    x: &mut Extras,
    server: &mut crate::server::ServerConn,
    out: &mut Outbound,
) -> Result<bool, SessionError> {
    let status = server.buf.get(out.direct + shoal_wire::frame::HEADER_LEN);
    if status != Some(&b'I') || server.session.ready_is_hidden() {
        return Ok(false);
    }
    if let Some(due) = due_before_ready(x) {
        out.listener_due = Some(due);
        return Ok(true);
    }
    deliver_before_ready(x, &mut server.buf, out)?;
    Ok(false)
}

/// Called at a ReadyForQuery with status `I` the client is to see: if the listener must act
/// first, settles the client's transaction (as that ReadyForQuery will) and says what is due.
fn due_before_ready(x: &mut Extras) -> Option<ListenerDue> {
    if !x.sets.listener_due_before_ready() {
        return None;
    }
    let notified = x.sets.notified;
    // The ReadyForQuery's own `ready` finds nothing left to do.
    x.sets.ready(b'I');
    Some(ListenerDue {
        update: x.sets.listening_changed,
        barrier: notified,
    })
}

/// Puts the client's waiting notifications in front of a ReadyForQuery with status `I`, where
/// PostgreSQL delivers those that arrived during a transaction.
fn deliver_before_ready(
    x: &mut Extras,
    server_buf: &mut BytesMut,
    out: &mut Outbound,
) -> Result<(), SessionError> {
    let Some(sub) = x.listen.as_ref() else {
        return Ok(());
    };
    let mailbox = Plugged::mailbox(sub);
    if !mailbox.has_mail() {
        return Ok(());
    }
    out.spill_to_client(server_buf);
    match mailbox.take_into(&mut out.to_client) {
        Mail::Empty => Ok(()),
        Mail::Overflowed => Err(overflowed()),
    }
}

/// A `LISTEN` among other statements ran (it is not carried): the client gets a warning in
/// front of its CommandComplete.
#[cold]
pub(super) fn warn_uncarried(server_buf: &mut BytesMut, out: &mut Outbound) {
    out.spill_to_client(server_buf);
    backend::warning_notice(
        &mut out.to_client,
        "01000",
        "this LISTEN is not in force: in transaction mode Shoal carries LISTEN only when it is \
         sent as a statement of its own",
    );
}

/// Whether a client message may make its server send a notification: SQL that mentions
/// `notify` (`NOTIFY`, `pg_notify`, a function so named), sent or bound. Asked only while
/// someone in the pool listens.
#[cold]
pub(super) fn may_notify(
    tag: u8,
    body: &[u8],
    statements: &Option<Box<crate::prepared::ClientStatements>>,
) -> bool {
    use shoal_wire::frontend::tag as fe;
    let mut r = shoal_wire::frame::Reader::new(body);
    let text = match tag {
        fe::QUERY => body,
        fe::PARSE => {
            let _ = r.cstr_bytes();
            r.rest()
        }
        fe::BIND => {
            let _portal = r.cstr_bytes();
            match (r.cstr_bytes(), statements) {
                (Ok(name), Some(s)) => s.text_of(name).unwrap_or_default(),
                _ => return false,
            }
        }
        _ => return false,
    };
    text.windows(6).any(|w| w.eq_ignore_ascii_case(b"notify"))
}

/// The client left more notifications unread than Shoal holds for it.
pub(super) fn overflowed() -> SessionError {
    SessionError::fatal(
        ErrorKind::ClientLimit,
        sqlstate::PROGRAM_LIMIT_EXCEEDED,
        format!(
            "closing the connection: the client left more than {} KiB of notifications unread",
            crate::mailbox::MAX_PENDING / 1024
        ),
    )
}

impl Session {
    /// Does what [`ListenerDue`] says, waiting for the listener (bounded by the pool's
    /// `server_connect_timeout`: a listener that cannot reach the server yet must not hold the
    /// client, which is warned instead).
    pub(super) async fn sync_listener(&mut self, due: ListenerDue, server_pid: i32) {
        let mut waits = Vec::with_capacity(2);
        if due.barrier {
            waits.extend(Plugged::barrier(&self.pool, server_pid));
        }
        let x = Extras::get(&mut self.extras);
        if due.update {
            x.sets.listening_changed = false;
            if x.listen.is_none() {
                x.listen = Plugged::listen(&self.pool);
            }
            if let Some(sub) = x.listen.as_mut() {
                waits.extend(Plugged::listen_to(sub, &x.sets.listening));
            }
        }
        let limit = self.pool.settings.connect_timeout;
        let mut late = false;
        for w in waits {
            late |= crate::timer::timeout(limit, w).await.is_err();
        }
        let Some(sub) = x.listen.as_ref() else { return };
        if late {
            tracing::warn!(conn = self.id, pool = %self.pool.name, "listener connection not ready; the client goes on without it");
            let mut msg = BytesMut::new();
            backend::warning_notice(
                &mut msg,
                "01000",
                "Shoal's listening connection to the server is not ready: notifications are delivered once it is",
            );
            Plugged::mailbox(sub).put(&msg);
        }
        if x.sets.listening.is_empty() && !Plugged::mailbox(sub).has_mail() {
            // Listens to nothing any more: the client is an ordinary one again.
            x.listen = None;
        }
    }

    /// The transaction ended without the ReadyForQuery that ends a claim: end it now.
    pub(super) fn end_claim(&mut self, server_pid: i32) {
        if let Some(x) = self.extras.as_mut() {
            if std::mem::take(&mut x.sets.notified) {
                Plugged::unclaim(&self.pool, server_pid);
            }
        }
    }

    /// Writes the idle client's notifications as they come. Ready with what ends the idle
    /// wait: a write error, or too much left unread.
    pub(super) fn poll_mail(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), SessionError>> {
        let Some(sub) = self.extras.as_ref().and_then(|x| x.listen.as_ref()) else {
            return Poll::Pending;
        };
        let stream = &mut self.stream;
        match Plugged::mailbox(sub).poll_deliver(cx, |cx, b| stream.poll_write(cx, b)) {
            Poll::Ready(Ok(Mail::Overflowed)) => Poll::Ready(Err(overflowed())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e.into())),
            Poll::Ready(Ok(Mail::Empty)) | Poll::Pending => {
                if stream.wants_flush() {
                    if let Poll::Ready(Err(e)) = stream.poll_flush(cx) {
                        return Poll::Ready(Err(e.into()));
                    }
                }
                Poll::Pending
            }
        }
    }
}
