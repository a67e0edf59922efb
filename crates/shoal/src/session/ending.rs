//! The end of a session: the disconnection logged, and the client told why where it should
//! know (boxed apart from the idle future, which stays small).

use std::time::Duration;

use bytes::BytesMut;
use shoal_wire::backend::{self, Severity};

use super::{Session, SessionError};
use crate::logsafe::Escaped;
use crate::net::Stream;

pub(super) async fn send_error(
    stream: &mut Stream,
    severity: Severity,
    code: &str,
    message: &str,
    hint: Option<&str>,
) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    backend::error_response(&mut out, severity, code, message, hint);
    stream.write_all(&out).await
}

/// Logs the disconnection (boxed with the rest of the ending: the idle future stays small).
pub(super) async fn end_session(session: &mut Session, result: Result<(), SessionError>) {
    log_disconnect(session, &result);
    finish(session.id, &mut session.stream, result).await;
}

/// The `log_connections` line for a client that leaves. A session another node relays here
/// is not a connection of this node (the relaying node logs its client's comings and
/// goings): its end, at every park of an idle client too, is logged at debug, as its start
/// is.
#[inline(never)]
fn log_disconnect(session: &Session, result: &Result<(), SessionError>) {
    let relayed = matches!(session.stream, crate::net::Stream::Link(_));
    if relayed {
        tracing::debug!(conn = session.id, pool = %session.pool.name, "relayed session ended");
    } else if session.app.config.server.log_connections {
        let reason = match result {
            Ok(()) | Err(SessionError::ClientGone) => "client left",
            Err(e) => e.kind().label(),
        };
        tracing::info!(conn = session.id, pool = %session.pool.name, reason, "client disconnected");
    }
}

/// Logs how the session ended and tells the client why, where it should know.
pub(super) async fn finish(id: u64, stream: &mut Stream, result: Result<(), SessionError>) {
    match result {
        Ok(()) | Err(SessionError::ClientGone) => {
            tracing::debug!(conn = id, "client disconnected")
        }
        Err(e) => {
            tracing::info!(conn = id, peer = %stream.peer(), kind = %e.kind().label(), error = %Escaped(&e), "closing client connection");
            if let Some((code, message)) = e.client_message() {
                let _ = crate::timer::timeout(
                    Duration::from_secs(1),
                    send_error(stream, Severity::Fatal, code, &message, None),
                )
                .await;
            }
        }
    }
}
