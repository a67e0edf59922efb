//! What a client is answered while it holds no server: messages that need none, a unit
//! refused before it reached one, and a server lost under it.

use bytes::{Buf, BytesMut};
use shoal_wire::backend::{self, ErrorFields, Severity};
use shoal_wire::frame::next_frame_len;
use shoal_wire::frontend::{self, tag as fe};
use shoal_wire::sqlstate;

use super::ending::send_error;
use super::flow::Flow;
use super::{encoding_of, Session, SessionError};
use crate::config::PoolMode;
use crate::error::{known_code, ErrorKind};
use crate::logsafe::Escaped;
use crate::seam::Features as _;
use crate::{prepared, Plugged};

/// What the buffered client messages call for while no server is held.
pub(super) enum Idle {
    /// Need more bytes before anything can be decided.
    NeedMore,
    /// The next message needs a server.
    NeedServer,
    Terminate,
}

impl Session {
    /// Handles buffered messages that need no server: Terminate, a lone Sync, stray copy
    /// messages, and messages of a batch whose error was already reported.
    pub(super) async fn handle_idle_messages(&mut self) -> Result<Idle, SessionError> {
        let max = self.app.config.server.max_packet_size;
        let mut out = BytesMut::new();
        let result = loop {
            let Some(n) = next_frame_len(&self.cbuf, max).map_err(SessionError::from_frame)? else {
                break Idle::NeedMore;
            };
            frontend::validate(self.cbuf[0], &self.cbuf[shoal_wire::frame::HEADER_LEN..n])
                .map_err(SessionError::from_frame)?;
            match self.cbuf[0] {
                fe::TERMINATE => break Idle::Terminate,
                fe::SYNC | fe::QUERY | fe::FUNCTION_CALL if self.skip_until_sync => {
                    self.skip_until_sync = false;
                    backend::ready_for_query(&mut out, b'I');
                }
                fe::SYNC => backend::ready_for_query(&mut out, b'I'),
                // A named Parse of a statement servers already accepted: no server needed (a
                // client blocked in a synchronous prepare must not wait for a busy pool).
                fe::PARSE
                    if !self.skip_until_sync
                        && self.pool.settings.mode == PoolMode::Transaction
                        && Plugged::rules(&self.pool).is_none_or(|r| {
                            Plugged::refusal(
                                &r,
                                &self.cbuf[..n],
                                self.statements.as_deref(),
                                &self.pool.name,
                                encoding_of(&self.extras),
                            )
                            .is_none()
                        })
                        && prepared::parse_without_server(
                            &self.pool.statements,
                            &self.params,
                            &mut self.statements,
                            &self.cbuf[..n],
                            encoding_of(&self.extras),
                        ) =>
                {
                    backend::put_message(&mut out, b'1', |_| {});
                }
                fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL => {}
                _ if self.skip_until_sync => {}
                _ => break Idle::NeedServer,
            }
            self.cbuf.advance(n);
        };
        if !out.is_empty() {
            self.stream.write_all(&out).await?;
        }
        Ok(result)
    }

    /// Tells a client over a rate or concurrency limit that its unit was refused.
    pub(super) async fn refuse_over_limit(
        &mut self,
        r: crate::seam::Refusal,
    ) -> Result<(), SessionError> {
        self.app.metrics.rejected(ErrorKind::ClientLimit);
        tracing::debug!(conn = self.id, pool = %self.pool.name, reason = %r.0, "over a limit");
        self.fail_unit(sqlstate::CONFIGURATION_LIMIT_EXCEEDED, &r.0)
            .await
    }

    /// Reports an error for the client's current unit of work (a Query, or an extended batch
    /// up to its Sync) that could not reach a server; the client can go on afterwards.
    pub(super) async fn fail_unit(
        &mut self,
        code: &str,
        message: &str,
    ) -> Result<(), SessionError> {
        send_error(&mut self.stream, Severity::Error, code, message, None).await?;
        self.skip_until_sync = true;
        Ok(())
    }

    /// The server died under a transaction-mode client outside a transaction block (its
    /// statement was running in autocommit): tell the client with an ERROR (its connection to
    /// Shoal is fine), answer the ReadyForQuery it still expects, and let it go on.
    pub(super) async fn report_server_loss(
        &mut self,
        flow: &Flow,
        fatal: Option<Box<ErrorFields>>,
    ) -> Result<(), SessionError> {
        let (code, detail) = match &fatal {
            Some(f) => (known_code(&f.code), f.message.as_str()),
            None => (
                sqlstate::CONNECTION_FAILURE,
                "server closed the connection unexpectedly",
            ),
        };
        let message = format!(
            "server connection lost while running the statement ({detail}); it may or may not have completed; the next statement runs on another server connection"
        );
        tracing::warn!(conn = self.id, pool = %self.pool.name, message = %Escaped(&message));
        if flow.pending > 0 || flow.unsynced || flow.copy_in {
            let mut out = BytesMut::new();
            backend::error_response(&mut out, Severity::Error, code, &message, None);
            for _ in 0..flow.pending {
                backend::ready_for_query(&mut out, b'I');
            }
            self.skip_until_sync = flow.unsynced;
            self.stream.write_all(&out).await?;
        }
        Ok(())
    }

    /// The server was lost inside a transaction block: the client's session is gone with the
    /// server's, as on a direct connection, and the server's own FATAL is passed on. A fenced
    /// node's servers may have been ended by the pool's next owner (its FATAL says
    /// "administrator command"): the error says why.
    #[cold]
    pub(super) fn lost_in_block(&self, fatal: Option<Box<ErrorFields>>) -> SessionError {
        let (kind, code, message) = match fatal {
            _ if self.pool.fence.fenced() => (
                ErrorKind::Fenced,
                sqlstate::CONNECTION_FAILURE,
                "this Shoal node stopped serving the pool (its cluster lease lapsed); the transaction was ended: reconnect".to_string(),
            ),
            Some(f) => (ErrorKind::ServerLost, known_code(&f.code), f.message),
            None => (
                ErrorKind::ServerLost,
                sqlstate::CONNECTION_FAILURE,
                "server closed the connection unexpectedly".to_string(),
            ),
        };
        tracing::warn!(conn = self.id, pool = %self.pool.name, message = %Escaped(&message), "server lost inside a transaction; closing the client");
        SessionError::fatal(kind, code, message)
    }
}
