//! The relay's hook seam: what becomes of each complete client message on its way to the
//! server, and of each server reply on its way back. The relay frames and validates
//! messages, follows the protocol's flow and moves bytes; a hook decides what the other side
//! gets, and may add replies of its own.
//!
//! Transaction mode's prepared-statement translation ([`Prepared`]) is the first hook;
//! session mode's [`PassThrough`] changes nothing. The relay is generic over its hook, so
//! a hook's checks compile into the loop instead of costing a call through a pointer for
//! every message. A new layer (query rules, a result cache, a read/write split choosing the
//! next transaction's server) is a new [`Hooks`] implementation wrapping one of these.

use std::collections::VecDeque;

use bytes::BytesMut;
use shoal_wire::frame::FrameError;

use super::outbound::ClientSink;
use crate::prepared::{ClientStatements, Expect, StatementRegistry, ToServer, Translator};
use crate::seam::Features as _;
use crate::server_session::ServerSession;
use crate::Plugged;

/// What a hook may see and change while one message passes: the client's side of the
/// session and the server's.
pub(super) struct HookCx<'a> {
    pub(super) registry: &'a StatementRegistry,
    pub(super) params: &'a [(String, String)],
    pub(super) client_id: u64,
    pub(super) statements: &'a mut Option<Box<ClientStatements>>,
    pub(super) server: &'a mut ServerSession,
    pub(super) max_prepared: usize,
    /// ReadyForQuery messages the client is still owed (a hook answering a request itself
    /// answers one).
    pub(super) pending: &'a mut u32,
    /// The client's transaction status now.
    pub(super) status: u8,
    /// The pool's query rules, when it has any, and its name (for their log lines).
    pub(super) rules: Option<&'a crate::seam::Rules>,
    pub(super) pool_name: &'a str,
    /// How the server reads the client's text now, and whether a message sent may change
    /// that before the server says (see [`super::Extras::recoding`]).
    pub(super) encoding: shoal_wire::sql::ClientEncoding,
    pub(super) recoding: &'a mut bool,
    /// A message sent leaves state Shoal does not follow (see [`super::Extras::holds_state`]).
    pub(super) untracked: &'a mut bool,
    /// Of it, state that surely lasts (see [`super::Extras::keeps_state`]).
    pub(super) keeps: &'a mut bool,
    /// This message is refused with `25006` and this message instead of being sent (a
    /// statement not proven to read, in a READ ONLY block on a replica).
    pub(super) refuse: Option<&'static str>,
}

pub(super) trait Hooks {
    /// A complete, valid client message: puts what the server is to get into `sink`
    /// (`ToServer::pass` sends the message as it is, from where it lies).
    fn client_message(
        &mut self,
        cx: &mut HookCx<'_>,
        msg: &[u8],
        sink: &mut ClientSink<'_>,
    ) -> Result<(), FrameError>;

    /// Whether the hook has replies of its own due before the next server reply. Asked
    /// after every message both ways: keep it cheap.
    fn replies_due(&self, server: &mut ServerSession) -> bool;

    /// Writes the replies [`Hooks::replies_due`] found due.
    fn emit_due(&mut self, cx: &mut HookCx<'_>, to_client: &mut BytesMut);

    /// A server reply the relay would pass on from where it lies (nothing of the hook's is
    /// due): whether the client is to see it (false: it is dropped).
    fn passes(&mut self, server: &mut ServerSession, tag: u8) -> bool;

    /// A server reply that goes through `to_client`: writes what the client is to see of
    /// it; returns whether the reply itself reached the client.
    fn server_reply(&mut self, cx: &mut HookCx<'_>, msg: &[u8], to_client: &mut BytesMut) -> bool;
}

/// Session mode: the client owns the server, and everything passes unchanged both ways.
pub(super) struct PassThrough;

impl Hooks for PassThrough {
    #[inline]
    fn client_message(
        &mut self,
        _: &mut HookCx<'_>,
        msg: &[u8],
        sink: &mut ClientSink<'_>,
    ) -> Result<(), FrameError> {
        sink.pass(msg);
        Ok(())
    }

    #[inline]
    fn replies_due(&self, _: &mut ServerSession) -> bool {
        false
    }

    #[inline]
    fn emit_due(&mut self, _: &mut HookCx<'_>, _: &mut BytesMut) {}

    #[inline]
    fn passes(&mut self, _: &mut ServerSession, _: u8) -> bool {
        true
    }

    #[inline]
    fn server_reply(&mut self, _: &mut HookCx<'_>, msg: &[u8], to_client: &mut BytesMut) -> bool {
        to_client.extend_from_slice(msg);
        true
    }
}

/// Transaction mode: the client's named statements are translated to pooler-wide names
/// prepared on demand on whichever server runs its transaction, and the replies Shoal's own
/// Parse and Close messages cause are hidden (see [`crate::prepared`]).
pub(super) struct Prepared;

fn queue(server: &mut ServerSession) -> &mut VecDeque<Expect> {
    server.translation().1
}

impl Hooks for Prepared {
    #[inline]
    fn client_message(
        &mut self,
        cx: &mut HookCx<'_>,
        msg: &[u8],
        sink: &mut ClientSink<'_>,
    ) -> Result<(), FrameError> {
        let refusal = match (cx.refuse, cx.rules) {
            (Some(why), _) => Some((shoal_wire::sqlstate::READ_ONLY_SQL_TRANSACTION, why.into())),
            (None, Some(rules)) => Plugged::refusal(
                rules,
                msg,
                cx.statements.as_deref(),
                cx.pool_name,
                cx.encoding,
            ),
            (None, None) => None,
        };
        let (statements, queue, dirty) = cx.server.translation();
        let mut t = Translator {
            registry: cx.registry,
            params: cx.params,
            client_id: cx.client_id,
            client: cx.statements,
            server: statements,
            queue,
            max_per_server: cx.max_prepared,
            dirty,
            encoding: cx.encoding,
            recoding: cx.recoding,
            untracked: cx.untracked,
            keeps: cx.keeps,
            aborted: cx.status == b'E',
        };
        match refusal {
            Some((code, message)) => {
                t.refuse(msg[0], code, message, sink);
                Ok(())
            }
            None => t.client_message(msg, sink),
        }
    }

    #[inline]
    fn replies_due(&self, server: &mut ServerSession) -> bool {
        crate::prepared::synthetic_due(queue(server))
    }

    #[inline]
    fn emit_due(&mut self, cx: &mut HookCx<'_>, to_client: &mut BytesMut) {
        crate::prepared::emit_due(
            queue(cx.server),
            cx.statements,
            to_client,
            cx.pending,
            cx.status,
        );
    }

    #[inline]
    fn passes(&mut self, server: &mut ServerSession, tag: u8) -> bool {
        crate::prepared::pass_reply(queue(server), tag)
    }

    #[inline]
    fn server_reply(&mut self, cx: &mut HookCx<'_>, msg: &[u8], to_client: &mut BytesMut) -> bool {
        let (statements, queue, _) = cx.server.translation();
        crate::prepared::server_reply(
            queue,
            statements,
            cx.statements,
            msg,
            to_client,
            cx.pending,
            cx.status,
        )
    }
}
