//! The start of a client connection: the untagged first packet (SSLRequest, GSSENCRequest,
//! CancelRequest or StartupMessage), answered before authentication.

use bytes::BytesMut;
use shoal_wire::sqlstate;
use shoal_wire::startup::{self, StartupMessage, StartupPacket, TLS_HANDSHAKE_BYTE};

use super::SessionError;
use crate::app::App;
use crate::net::ClientStream;

/// Reads first packets until a StartupMessage arrives. Returns `None` when the connection was
/// only a CancelRequest (handled here) or the client left.
pub async fn read_startup(
    stream: &mut ClientStream,
    app: &App,
) -> Result<Option<StartupMessage>, SessionError> {
    let mut buf = BytesMut::with_capacity(256);
    // As PostgreSQL: one SSLRequest and one GSSENCRequest at most (libpq may send both).
    let (mut ssl_done, mut gss_done) = (false, false);
    loop {
        let len = loop {
            if buf.first() == Some(&TLS_HANDSHAKE_BYTE) {
                // A direct-TLS client (sslnegotiation=direct) cannot read a plain error.
                return Err(SessionError::Quiet(
                    "client started TLS directly; TLS is not enabled".into(),
                ));
            }
            match startup::startup_len(&buf) {
                // As PostgreSQL: a first packet that is not one is logged, not answered
                // (whatever sent it does not speak the protocol).
                Err(e) => return Err(SessionError::Quiet(e.to_string())),
                Ok(Some(n)) => break n,
                Ok(None) => {}
            }
            if stream.read_buf(&mut buf).await? == 0 {
                return Ok(None);
            }
        };
        while buf.len() < len {
            buf.reserve(len - buf.len());
            if stream.read_buf(&mut buf).await? == 0 {
                return Ok(None);
            }
        }
        let packet = buf.split_to(len);
        match startup::parse_startup(&packet) {
            Ok(kind @ (StartupPacket::Ssl | StartupPacket::GssEnc)) => {
                let done = if matches!(kind, StartupPacket::Ssl) {
                    &mut ssl_done
                } else {
                    &mut gss_done
                };
                if std::mem::replace(done, true) {
                    return Err(SessionError::fatal(
                        sqlstate::PROTOCOL_VIOLATION,
                        "encryption was already negotiated on this connection",
                    ));
                }
                if !buf.is_empty() {
                    return Err(SessionError::fatal(
                        sqlstate::PROTOCOL_VIOLATION,
                        "received unencrypted data after encryption request",
                    ));
                }
                stream.write_all(b"N").await?;
            }
            Ok(StartupPacket::Cancel {
                process_id,
                secret_key,
            }) => {
                app.cancels.cancel(process_id, secret_key).await;
                return Ok(None);
            }
            Ok(StartupPacket::Startup(m)) => {
                if !buf.is_empty() {
                    return Err(SessionError::fatal(
                        sqlstate::PROTOCOL_VIOLATION,
                        "unexpected data after the startup packet",
                    ));
                }
                return Ok(Some(m));
            }
            Err(e @ startup::StartupError::UnsupportedProtocol { .. }) => {
                return Err(SessionError::fatal(
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    e.to_string(),
                ))
            }
            Err(e) => return Err(SessionError::Quiet(e.to_string())),
        }
    }
}
