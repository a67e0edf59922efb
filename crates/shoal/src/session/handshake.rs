//! The start of a client connection: the untagged first packets (SSLRequest, GSSENCRequest,
//! CancelRequest or StartupMessage), answered before authentication.
//!
//! [`read_packet`] reads one packet and says what it is; [`negotiate`] is the loop around it,
//! and the one place where a TLS upgrade slots in: answer an SSLRequest with `S`, replace the
//! stream with the TLS one, read on.

use bytes::BytesMut;
use shoal_wire::sqlstate;
use shoal_wire::startup::{self, StartupMessage, StartupPacket, TLS_HANDSHAKE_BYTE};

use super::SessionError;
use crate::app::App;
use crate::error::ErrorKind;
use crate::net::Stream;

/// What a client's first packet asked for.
pub enum FirstPacket {
    Startup(StartupMessage),
    Cancel {
        process_id: i32,
        secret_key: i32,
    },
    SslRequest,
    GssEncRequest,
    /// The client started TLS without asking (`sslnegotiation=direct`).
    DirectTls,
}

/// Reads one first packet. `None` when the client left. `buf` holds what was read past it.
pub async fn read_packet(
    stream: &mut Stream,
    buf: &mut BytesMut,
) -> Result<Option<FirstPacket>, SessionError> {
    let len = loop {
        if buf.first() == Some(&TLS_HANDSHAKE_BYTE) {
            return Ok(Some(FirstPacket::DirectTls));
        }
        match startup::startup_len(buf) {
            // As PostgreSQL: a first packet that is not one is logged, not answered (whatever
            // sent it does not speak the protocol).
            Err(e) => return Err(SessionError::Quiet(e.to_string())),
            Ok(Some(n)) => break n,
            Ok(None) => {}
        }
        if stream.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    };
    while buf.len() < len {
        buf.reserve(len - buf.len());
        if stream.read_buf(buf).await? == 0 {
            return Ok(None);
        }
    }
    let packet = buf.split_to(len);
    match startup::parse_startup(&packet) {
        Ok(StartupPacket::Ssl) => Ok(Some(FirstPacket::SslRequest)),
        Ok(StartupPacket::GssEnc) => Ok(Some(FirstPacket::GssEncRequest)),
        Ok(StartupPacket::Cancel {
            process_id,
            secret_key,
        }) => Ok(Some(FirstPacket::Cancel {
            process_id,
            secret_key,
        })),
        Ok(StartupPacket::Startup(m)) => Ok(Some(FirstPacket::Startup(m))),
        Err(e @ startup::StartupError::UnsupportedProtocol { .. }) => Err(SessionError::fatal(
            ErrorKind::ClientProtocol,
            sqlstate::FEATURE_NOT_SUPPORTED,
            e.to_string(),
        )),
        Err(e) => Err(SessionError::Quiet(e.to_string())),
    }
}

/// Reads first packets until a StartupMessage arrives, answering encryption requests and
/// routing cancel requests. `None` when the connection was only a CancelRequest or the
/// client left.
pub async fn negotiate(
    stream: &mut Stream,
    app: &App,
) -> Result<Option<StartupMessage>, SessionError> {
    // Large enough that the first read does not grow it (see `Stream::read_buf`).
    let mut buf = BytesMut::with_capacity(1024);
    // As PostgreSQL: one SSLRequest and one GSSENCRequest at most (libpq may send both).
    let (mut ssl_done, mut gss_done) = (false, false);
    loop {
        let Some(packet) = read_packet(stream, &mut buf).await? else {
            return Ok(None);
        };
        let ssl = matches!(packet, FirstPacket::SslRequest);
        let done = match packet {
            FirstPacket::Startup(m) => {
                if !buf.is_empty() {
                    return Err(SessionError::fatal(
                        ErrorKind::ClientProtocol,
                        sqlstate::PROTOCOL_VIOLATION,
                        "unexpected data after the startup packet",
                    ));
                }
                return Ok(Some(m));
            }
            FirstPacket::Cancel {
                process_id,
                secret_key,
            } => {
                if !app.cancels.cancel(process_id, secret_key).await {
                    if let Some(node) = app.cluster.get() {
                        node.forward_cancel(process_id, secret_key).await;
                    }
                }
                return Ok(None);
            }
            FirstPacket::DirectTls => {
                if ssl_done || !app.tls.enabled() || !matches!(stream, Stream::Tcp(_)) {
                    // A direct-TLS client cannot read a plain error.
                    return Err(SessionError::Quiet(
                        "client started TLS directly; TLS is not enabled".into(),
                    ));
                }
                ssl_done = true;
                let hello = buf.split().freeze();
                upgrade(stream, app, hello).await?;
                continue;
            }
            FirstPacket::SslRequest => &mut ssl_done,
            FirstPacket::GssEncRequest => &mut gss_done,
        };
        if std::mem::replace(done, true) {
            return Err(SessionError::fatal(
                ErrorKind::ClientProtocol,
                sqlstate::PROTOCOL_VIOLATION,
                "encryption was already negotiated on this connection",
            ));
        }
        if !buf.is_empty() {
            return Err(SessionError::fatal(
                ErrorKind::ClientProtocol,
                sqlstate::PROTOCOL_VIOLATION,
                "received unencrypted data after encryption request",
            ));
        }
        let tls = ssl && app.tls.enabled() && matches!(stream, Stream::Tcp(_));
        if tls {
            stream.write_all(b"S").await?;
            upgrade(stream, app, bytes::Bytes::new()).await?;
        } else {
            // Declined: the client goes on in plain text.
            stream.write_all(b"N").await?;
        }
    }
}

/// Replaces a TCP client's stream with TLS over it (`hello`: bytes of the handshake already
/// read).
async fn upgrade(stream: &mut Stream, app: &App, hello: bytes::Bytes) -> Result<(), SessionError> {
    let Stream::Tcp(tcp) = std::mem::replace(stream, Stream::Upgrading) else {
        return Err(SessionError::Quiet("TLS over a non-TCP stream".into()));
    };
    match app.tls.accept(tcp, hello).await {
        Ok(tls) => {
            app.metrics
                .tls_handshakes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            *stream = Stream::Tls(Box::new(tls));
            Ok(())
        }
        // The client cannot read a plain error in the middle of a TLS handshake.
        Err(e) => {
            app.metrics
                .tls_handshake_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(SessionError::Quiet(format!("TLS handshake failed: {e}")))
        }
    }
}
