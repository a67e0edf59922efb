//! Client authentication against the configured users: SCRAM-SHA-256, MD5 or trust.

use bytes::BytesMut;
use shoal_wire::backend;
use shoal_wire::frontend::{self, tag};
use shoal_wire::scram::{Binding, ScramError, ServerExchange, MECHANISM, MECHANISM_PLUS};
use shoal_wire::{md5, sqlstate, Frame};
use subtle::ConstantTimeEq;

use super::SessionError;
use crate::config::{ClientAuth, User};
use crate::error::ErrorKind;
use crate::net::Stream;
use crate::passwords::PasswordMemo;

/// Authentication messages are small; a larger one is an attack or a bug.
const MAX_AUTH_MESSAGE: usize = 8192;

async fn read_password_message(stream: &mut Stream) -> Result<Frame, SessionError> {
    let mut buf = BytesMut::with_capacity(512);
    loop {
        if let Some(f) = Frame::split(&mut buf, MAX_AUTH_MESSAGE).map_err(|e| {
            SessionError::fatal(
                ErrorKind::ClientProtocol,
                sqlstate::PROTOCOL_VIOLATION,
                e.to_string(),
            )
        })? {
            if f.tag() != tag::PASSWORD {
                return Err(SessionError::fatal(
                    ErrorKind::ClientProtocol,
                    sqlstate::PROTOCOL_VIOLATION,
                    format!(
                        "expected a password message, got message type '{}'",
                        f.tag() as char
                    ),
                ));
            }
            if !buf.is_empty() {
                return Err(SessionError::fatal(
                    ErrorKind::ClientProtocol,
                    sqlstate::PROTOCOL_VIOLATION,
                    "unexpected data after the password message",
                ));
            }
            return Ok(f);
        }
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(SessionError::ClientGone);
        }
    }
}

fn auth_failed(user: &str) -> SessionError {
    SessionError::fatal(
        ErrorKind::Auth,
        sqlstate::INVALID_PASSWORD,
        format!("password authentication failed for user \"{user}\""),
    )
}

fn malformed(e: impl std::fmt::Display) -> SessionError {
    SessionError::fatal(
        ErrorKind::ClientProtocol,
        sqlstate::PROTOCOL_VIOLATION,
        e.to_string(),
    )
}

/// A login as a user Shoal does not serve: a SCRAM exchange that no password passes, ending
/// with the same `28P01` a wrong password gets, so that which users exist cannot be probed.
/// (The reason is in Shoal's log.) `seed` makes the fake salt stable per user name.
pub async fn refuse_unknown(stream: &mut Stream, name: &str, seed: &[u8]) -> SessionError {
    let user = User::named(
        name,
        ClientAuth::Scram(Box::new(shoal_wire::scram::Verifier::unmatchable(seed))),
    );
    match authenticate(stream, &user, None, &mut BytesMut::new()).await {
        Ok(_) => auth_failed(name),
        Err(e) => e,
    }
}

/// Runs the exchange the user's method calls for. `end_point`: the connection's TLS channel
/// binding data, when it is TLS (SCRAM-SHA-256-PLUS is offered then). On success the closing
/// messages (SASLFinal, AuthenticationOk) are left in `done`, unsent, for the caller to send
/// with the session's parameters: one write and one wake-up of the client fewer.
pub async fn authenticate(
    stream: &mut Stream,
    user: &User,
    end_point: Option<&[u8]>,
    done: &mut BytesMut,
) -> Result<Option<[u8; 32]>, SessionError> {
    // Room for the largest challenge (SCRAM's server-first) without growing.
    let mut out = BytesMut::with_capacity(256);
    // SCRAM recovers the client's ClientKey: what SCRAM passthrough logs in upstream with.
    let mut client_key = None;
    match &user.auth {
        ClientAuth::Trust => {}
        ClientAuth::Cert => {
            // As PostgreSQL's `cert`: a client certificate verified at the TLS handshake
            // (against `[tls] ca_file`) whose common name is the user name.
            let cn = match &*stream {
                Stream::Tls(s) => crate::tls::peer_common_name(s),
                _ => None,
            };
            let Some(cn) = cn else {
                return Err(SessionError::fatal(
                    ErrorKind::Auth,
                    sqlstate::INVALID_AUTHORIZATION,
                    "connection requires a valid client certificate",
                ));
            };
            if !bool::from(cn.as_bytes().ct_eq(user.name.as_bytes())) {
                tracing::info!(user = %crate::logsafe::Escaped(&user.name), certificate_cn = %crate::logsafe::Escaped(&cn), "certificate does not name the user");
                return Err(SessionError::fatal(
                    ErrorKind::Auth,
                    sqlstate::INVALID_AUTHORIZATION,
                    format!(
                        "certificate authentication failed for user \"{}\"",
                        user.name
                    ),
                ));
            }
        }
        ClientAuth::Md5(stored) => {
            let mut salt = [0u8; 4];
            rand::fill(&mut salt[..]);
            backend::authentication_md5(&mut out, salt);
            stream.write_all(&out).await?;
            let f = read_password_message(stream).await?;
            let given = frontend::parse_password(f.body()).map_err(malformed)?;
            let expected = md5::salted_response(stored, salt);
            if !bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
                return Err(auth_failed(&user.name));
            }
        }
        ClientAuth::Scram(verifier) => {
            if end_point.is_some() {
                backend::authentication_sasl(&mut out, &[MECHANISM_PLUS, MECHANISM]);
            } else {
                backend::authentication_sasl(&mut out, &[MECHANISM]);
            }
            stream.write_all(&out).await?;
            let f = read_password_message(stream).await?;
            let (mechanism, client_first) =
                frontend::parse_sasl_initial(f.body()).map_err(malformed)?;
            let plus = mechanism == MECHANISM_PLUS && end_point.is_some();
            if mechanism != MECHANISM && !plus {
                return Err(SessionError::fatal(
                    ErrorKind::ClientProtocol,
                    sqlstate::PROTOCOL_VIOLATION,
                    format!(
                        "client selected an invalid SASL authentication mechanism \"{mechanism}\""
                    ),
                ));
            }
            let binding = Binding { plus, end_point };
            let (exchange, server_first) =
                ServerExchange::with_binding(client_first, (**verifier).clone(), binding)
                    .map_err(malformed)?;
            out.clear();
            backend::authentication_sasl_continue(&mut out, server_first.as_bytes());
            stream.write_all(&out).await?;
            let f = read_password_message(stream).await?;
            let finished = match exchange.finish(f.body()) {
                Ok(finished) => finished,
                Err(ScramError::BadProof) => return Err(auth_failed(&user.name)),
                Err(e) => return Err(malformed(e)),
            };
            backend::authentication_sasl_final(done, finished.server_final.as_bytes());
            client_key = Some(finished.client_key);
        }
    }
    backend::authentication_ok(done);
    Ok(client_key)
}

/// Asks for the password in cleartext and checks it against the user's secret: for the
/// serverless front door, whose driver sends the password before it is asked (as Neon's
/// proxy asks it). The password crosses the WebSocket as sent: TLS or loopback only.
/// Returns the password's SCRAM ClientKey for passthrough, when the user has a verifier.
pub async fn cleartext(
    stream: &mut Stream,
    user: &User,
    memo: &PasswordMemo,
    done: &mut BytesMut,
) -> Result<Option<[u8; 32]>, SessionError> {
    let check = match &user.auth {
        ClientAuth::Trust => None,
        ClientAuth::Cert => {
            return Err(SessionError::fatal(
                ErrorKind::Auth,
                sqlstate::INVALID_AUTHORIZATION,
                "this user logs in with a TLS client certificate, which the serverless front door does not carry",
            ))
        }
        auth => Some(auth.clone()),
    };
    let mut client_key = None;
    if let Some(auth) = check {
        let mut out = BytesMut::with_capacity(16);
        backend::authentication_cleartext_password(&mut out);
        stream.write_all(&out).await?;
        let f = read_password_message(stream).await?;
        let given = frontend::parse_password(f.body())
            .map_err(malformed)?
            .to_owned();
        let remembered = memo.key(&user.name, &auth, &given);
        if let Some(key) = memo.get(&remembered) {
            backend::authentication_ok(done);
            return Ok(key);
        }
        // PBKDF2 (4,096 rounds and more) is kept off the data-plane shard.
        let name = user.name.clone();
        let checked = crate::control::spawn(async move {
            match &auth {
                ClientAuth::Scram(v) => v.check_password(&given).map(Some),
                ClientAuth::Md5(stored) => {
                    let ours = md5::stored_secret(&name, &given);
                    bool::from(ours.as_bytes().ct_eq(stored.as_bytes())).then_some(None)
                }
                ClientAuth::Trust | ClientAuth::Cert => Some(None),
            }
        })
        .await
        .ok()
        .flatten();
        match checked {
            Some(key) => {
                memo.insert(remembered, key);
                client_key = key;
            }
            None => return Err(auth_failed(&user.name)),
        }
    }
    backend::authentication_ok(done);
    Ok(client_key)
}
