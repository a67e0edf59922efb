//! Answering a PostgreSQL server's authentication requests as a pool's upstream user:
//! cleartext, MD5 and SCRAM-SHA-256, with the configured password or, for auth_query users,
//! with the secret recovered from the client's own login (*passthrough*: the MD5 stored
//! secret, or SCRAM's ClientKey and the verifier it matched). No I/O, so the whole exchange is
//! tested here against `shoal_wire`'s SCRAM server.

use bytes::BytesMut;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use shoal_wire::backend::AuthRequest;
use shoal_wire::scram::ClientExchange;
use shoal_wire::{frontend, md5};

use super::{ServerError, Upstream};
use crate::config::Passthrough;

/// Where a SCRAM exchange stands.
enum Scram {
    None,
    /// With the password: postgres-protocol's client.
    Password(Box<ScramSha256>),
    /// Passthrough, before the server's challenge.
    Started(ClientExchange),
    /// Passthrough, the proof sent: the signature the server must answer with.
    Proved([u8; 32]),
}

/// One login's answers.
pub(super) struct Answerer<'a> {
    up: &'a Upstream,
    scram: Scram,
}

impl<'a> Answerer<'a> {
    pub fn new(up: &'a Upstream) -> Answerer<'a> {
        Answerer {
            up,
            scram: Scram::None,
        }
    }

    fn password(&self) -> Result<&'a str, ServerError> {
        self.up
            .password
            .as_deref()
            .ok_or_else(|| ServerError::NoPassword(self.up.user.clone()))
    }

    /// The passthrough secret, used only when no password is configured.
    fn passthrough(&self) -> Option<&'a Passthrough> {
        match self.up.password {
            None => self.up.passthrough.as_deref(),
            Some(_) => None,
        }
    }

    /// Writes the answer to `request` into `out`; true when there is one to send (none to
    /// AuthenticationOk, nor to a SASL final message, which is only checked).
    pub fn answer(
        &mut self,
        request: AuthRequest<'_>,
        out: &mut BytesMut,
    ) -> Result<bool, ServerError> {
        match request {
            AuthRequest::Ok => return Ok(false),
            AuthRequest::Cleartext => frontend::password(out, self.password()?),
            AuthRequest::Md5 { salt } => {
                let stored = match self.passthrough() {
                    Some(Passthrough::Md5(s)) => s.clone(),
                    _ => md5::stored_secret(&self.up.user, self.password()?),
                };
                frontend::password(out, &md5::salted_response(&stored, salt));
            }
            AuthRequest::Sasl { mechanisms } => self.start_scram(&mechanisms, out)?,
            AuthRequest::SaslContinue(data) => self.prove(data, out)?,
            AuthRequest::SaslFinal(data) => {
                self.check_server(data)?;
                return Ok(false);
            }
            AuthRequest::Other(code) => {
                return Err(ServerError::Protocol(format!(
                    "unsupported authentication request {code}"
                )))
            }
        }
        Ok(true)
    }

    fn start_scram(&mut self, mechanisms: &[&str], out: &mut BytesMut) -> Result<(), ServerError> {
        if !mechanisms.contains(&"SCRAM-SHA-256") {
            return Err(ServerError::Protocol(format!(
                "server offers no supported SASL mechanism ({mechanisms:?})"
            )));
        }
        if let Some(Passthrough::Scram { .. }) = self.passthrough() {
            let (exchange, first) = ClientExchange::new();
            frontend::sasl_initial_response(out, "SCRAM-SHA-256", first.as_bytes());
            self.scram = Scram::Started(exchange);
            return Ok(());
        }
        let s = ScramSha256::new(self.password()?.as_bytes(), ChannelBinding::unsupported());
        frontend::sasl_initial_response(out, "SCRAM-SHA-256", s.message());
        self.scram = Scram::Password(Box::new(s));
        Ok(())
    }

    /// Answers the server's challenge with the client's proof.
    fn prove(&mut self, challenge: &[u8], out: &mut BytesMut) -> Result<(), ServerError> {
        match std::mem::replace(&mut self.scram, Scram::None) {
            Scram::Password(mut s) => {
                s.update(challenge)
                    .map_err(|e| ServerError::Protocol(e.to_string()))?;
                frontend::sasl_response(out, s.message());
                self.scram = Scram::Password(s);
            }
            Scram::Started(exchange) => {
                let Some(Passthrough::Scram {
                    client_key,
                    verifier,
                }) = self.passthrough()
                else {
                    return Err(ServerError::Protocol("no passthrough key".into()));
                };
                let v = shoal_wire::scram::Verifier::parse(verifier)
                    .map_err(|e| ServerError::Protocol(e.to_string()))?;
                let fin = exchange
                    .respond_with_key(challenge, client_key, &v)
                    .map_err(|e| ServerError::Passthrough(e.to_string()))?;
                frontend::sasl_response(out, fin.message.as_bytes());
                self.scram = Scram::Proved(fin.server_signature);
            }
            Scram::None | Scram::Proved(_) => {
                return Err(ServerError::Protocol(
                    "SASL continue out of order (before SASL start, or twice)".into(),
                ))
            }
        }
        Ok(())
    }

    /// Checks the server's signature: a server that cannot prove it knows the verifier is
    /// not the database the pool was configured for.
    fn check_server(&mut self, server_final: &[u8]) -> Result<(), ServerError> {
        let bad = |e: &dyn std::fmt::Display| {
            ServerError::Protocol(format!("server SCRAM signature: {e}"))
        };
        match std::mem::replace(&mut self.scram, Scram::None) {
            Scram::Password(mut s) => s.finish(server_final).map_err(|e| bad(&e)),
            Scram::Proved(expected) => {
                shoal_wire::scram::verify_server_final(server_final, &expected).map_err(|e| bad(&e))
            }
            Scram::None | Scram::Started(_) => Err(ServerError::Protocol(
                "SASL final before the client's proof".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::{Buf, BytesMut};
    use shoal_wire::backend::AuthRequest;
    use shoal_wire::scram::{ServerExchange, Verifier};

    use super::Answerer;
    use crate::config::Passthrough;
    use crate::server::{ServerError, Upstream};

    fn upstream(password: Option<&str>, passthrough: Option<Passthrough>) -> Upstream {
        Upstream {
            user: "app".into(),
            password: password.map(Into::into),
            passthrough: passthrough.map(Arc::new),
            ..Upstream::nowhere()
        }
    }

    /// The body of the one `p` message in `out`.
    fn body(out: &BytesMut) -> Vec<u8> {
        let mut b = &out[..];
        assert_eq!(b.get_u8(), b'p');
        let len = b.get_i32() as usize;
        assert_eq!(len - 4, b.len(), "one whole message");
        b.to_vec()
    }

    /// A SASLInitialResponse's mechanism and data.
    fn initial(out: &BytesMut) -> (String, Vec<u8>) {
        let b = body(out);
        let nul = b.iter().position(|&c| c == 0).unwrap();
        let mut rest = &b[nul + 1..];
        let len = rest.get_i32() as usize;
        assert_eq!(len, rest.len());
        (String::from_utf8(b[..nul].to_vec()).unwrap(), rest.to_vec())
    }

    /// Runs a whole SCRAM exchange against a server holding `verifier`: the server's
    /// outcome, and the answerer's to the server's final message.
    fn scram_against(up: &Upstream, verifier: Verifier) -> Result<(), String> {
        let mut a = Answerer::new(up);
        let mut out = BytesMut::new();
        let sasl = AuthRequest::Sasl {
            mechanisms: vec!["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"],
        };
        assert!(a.answer(sasl, &mut out).map_err(|e| e.to_string())?);
        let (mechanism, first) = initial(&out);
        assert_eq!(mechanism, "SCRAM-SHA-256");
        let (server, challenge) =
            ServerExchange::new(&first, verifier).map_err(|e| e.to_string())?;
        out.clear();
        let continued = AuthRequest::SaslContinue(challenge.as_bytes());
        assert!(a.answer(continued, &mut out).map_err(|e| e.to_string())?);
        let done = server.finish(&body(&out)).map_err(|e| e.to_string())?;
        out.clear();
        let fin = AuthRequest::SaslFinal(done.server_final.as_bytes());
        let sent = a.answer(fin, &mut out).map_err(|e| e.to_string())?;
        assert!(
            !sent && out.is_empty(),
            "nothing answers the server's final"
        );
        Ok(())
    }

    #[test]
    fn cleartext_and_md5_answer_with_the_password() {
        let up = upstream(Some("s3cret"), None);
        let mut out = BytesMut::new();
        assert!(Answerer::new(&up)
            .answer(AuthRequest::Cleartext, &mut out)
            .unwrap());
        assert_eq!(body(&out), b"s3cret\0");
        out.clear();
        let salt = [1, 2, 3, 4];
        let md5 = AuthRequest::Md5 { salt };
        assert!(Answerer::new(&up).answer(md5, &mut out).unwrap());
        let want = shoal_wire::md5::salted_response(
            &shoal_wire::md5::stored_secret("app", "s3cret"),
            salt,
        );
        assert_eq!(body(&out), format!("{want}\0").as_bytes());
        out.clear();
        assert!(!Answerer::new(&up)
            .answer(AuthRequest::Ok, &mut out)
            .unwrap());
        assert!(out.is_empty());
    }

    #[test]
    fn md5_passthrough_answers_with_the_stored_secret() {
        let stored = shoal_wire::md5::stored_secret("app", "theirs");
        let up = upstream(None, Some(Passthrough::Md5(stored.clone())));
        let mut out = BytesMut::new();
        let salt = [9, 8, 7, 6];
        let md5 = AuthRequest::Md5 { salt };
        Answerer::new(&up).answer(md5, &mut out).unwrap();
        let want = shoal_wire::md5::salted_response(&stored, salt);
        assert_eq!(body(&out), format!("{want}\0").as_bytes());
    }

    #[test]
    fn scram_with_the_password_logs_in_and_a_wrong_one_does_not() {
        let up = upstream(Some("s3cret"), None);
        assert_eq!(
            scram_against(&up, Verifier::from_password("s3cret")),
            Ok(())
        );
        let wrong = upstream(Some("guess"), None);
        assert!(scram_against(&wrong, Verifier::from_password("s3cret")).is_err());
    }

    #[test]
    fn scram_passthrough_logs_in_with_the_client_key_alone() {
        let verifier = Verifier::from_password_with_salt("theirs", b"saltsalt".to_vec(), 4096);
        let client_key = verifier.check_password("theirs").unwrap();
        let secret = Passthrough::Scram {
            client_key,
            verifier: verifier.to_text().into(),
        };
        let up = upstream(None, Some(secret));
        assert_eq!(scram_against(&up, verifier.clone()), Ok(()));
        // A server holding another verifier for the user is refused.
        assert!(scram_against(&up, Verifier::from_password("other")).is_err());
    }

    #[test]
    fn a_server_that_cannot_prove_the_verifier_is_refused() {
        let up = upstream(Some("s3cret"), None);
        let mut a = Answerer::new(&up);
        let mut out = BytesMut::new();
        let sasl = AuthRequest::Sasl {
            mechanisms: vec!["SCRAM-SHA-256"],
        };
        a.answer(sasl, &mut out).unwrap();
        let (_, first) = initial(&out);
        let (_, challenge) =
            ServerExchange::new(&first, Verifier::from_password("s3cret")).unwrap();
        out.clear();
        a.answer(AuthRequest::SaslContinue(challenge.as_bytes()), &mut out)
            .unwrap();
        let forged = format!("v={}", "A".repeat(44));
        let e = a
            .answer(AuthRequest::SaslFinal(forged.as_bytes()), &mut out)
            .unwrap_err();
        assert!(
            matches!(e, ServerError::Protocol(ref m) if m.contains("signature")),
            "{e}"
        );
    }

    #[test]
    fn requests_out_of_order_or_unsupported_are_errors_not_panics() {
        let up = upstream(Some("s3cret"), None);
        let mut out = BytesMut::new();
        let cases = [
            AuthRequest::SaslContinue(b"r=x,s=eA==,i=4096"),
            AuthRequest::SaslFinal(b"v=AAAA"),
            AuthRequest::Sasl {
                mechanisms: vec!["SCRAM-SHA-1"],
            },
            AuthRequest::Other(7),
        ];
        for request in cases {
            let e = Answerer::new(&up).answer(request, &mut out).unwrap_err();
            assert!(matches!(e, ServerError::Protocol(_)), "{e}");
        }
        let none = upstream(None, None);
        let e = Answerer::new(&none)
            .answer(AuthRequest::Cleartext, &mut out)
            .unwrap_err();
        assert!(
            matches!(e, ServerError::NoPassword(ref u) if u == "app"),
            "{e}"
        );
    }
}
