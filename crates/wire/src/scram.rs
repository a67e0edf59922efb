//! Server-side SCRAM-SHA-256 (RFC 5802, RFC 7677) as PostgreSQL speaks it, without channel
//! binding (offered only over TLS, which this listener does not terminate yet).
//!
//! The exchange is an explicit state machine: [`ServerExchange::new`] takes the client-first
//! message and yields server-first; [`ServerExchange::finish`] checks client-final and yields
//! server-final. Comparisons of keys are constant-time.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub const MECHANISM: &str = "SCRAM-SHA-256";
/// SCRAM with channel binding (`tls-server-end-point`), offered on TLS connections.
pub const MECHANISM_PLUS: &str = "SCRAM-SHA-256-PLUS";
/// PostgreSQL's default iteration count for new verifiers.
pub const DEFAULT_ITERATIONS: u32 = 4096;
const NONCE_LEN: usize = 18;

/// Why an exchange failed. `BadProof` is a wrong password; the others are broken clients.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScramError {
    #[error("malformed SCRAM message: {0}")]
    Malformed(&'static str),
    #[error("channel binding is not supported on this connection")]
    ChannelBinding,
    #[error("password authentication failed")]
    BadProof,
    #[error("the server's SCRAM verifier differs from the one the client was checked against (password changed?)")]
    VerifierChanged,
    #[error("invalid SCRAM secret: {0}")]
    BadSecret(&'static str),
}

/// A stored SCRAM verifier: what the server keeps instead of the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Verifier {
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub stored_key: [u8; 32],
    pub server_key: [u8; 32],
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Verifier(<redacted>)")
    }
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length");
    m.update(data);
    m.finalize().into_bytes().into()
}

/// PBKDF2-HMAC-SHA-256 of the password: the costly step, which callers should run off the
/// async worker threads and cache.
///
/// The password is first normalised with SASLprep (RFC 4013), as libpq and PostgreSQL do, so
/// a non-ASCII password that works against PostgreSQL works through Shoal; like PostgreSQL,
/// a password SASLprep refuses is used as it is.
pub fn salted_password(password: &str, salt: &[u8], iterations: u32) -> [u8; 32] {
    let prepared = stringprep::saslprep(password).unwrap_or(std::borrow::Cow::Borrowed(password));
    let mut out = [0u8; 32];
    pbkdf2::pbkdf2::<Hmac<Sha256>>(prepared.as_bytes(), salt, iterations, &mut out)
        .expect("HMAC accepts any key length");
    out
}

impl Verifier {
    /// Builds a verifier from a plain password with a fresh random salt.
    /// Checks a password given in cleartext against this verifier (the serverless front
    /// door asks for it so, as Neon's proxy does); on a match, the password's ClientKey
    /// (what SCRAM passthrough logs in upstream with). Compared in constant time.
    pub fn check_password(&self, password: &str) -> Option<[u8; 32]> {
        let salted = salted_password(password, &self.salt, self.iterations);
        let client_key = hmac(&salted, b"Client Key");
        let stored: [u8; 32] = Sha256::digest(client_key).into();
        bool::from(stored.ct_eq(&self.stored_key)).then_some(client_key)
    }

    pub fn from_password(password: &str) -> Verifier {
        let mut salt = vec![0u8; 16];
        rand::fill(&mut salt[..]);
        Self::from_password_with_salt(password, salt, DEFAULT_ITERATIONS)
    }

    pub fn from_password_with_salt(password: &str, salt: Vec<u8>, iterations: u32) -> Verifier {
        let salted = salted_password(password, &salt, iterations);
        let client_key = hmac(&salted, b"Client Key");
        Verifier {
            iterations,
            salt,
            stored_key: Sha256::digest(client_key).into(),
            server_key: hmac(&salted, b"Server Key"),
        }
    }

    /// Parses PostgreSQL's text form: `SCRAM-SHA-256$<iter>:<salt>$<StoredKey>:<ServerKey>`.
    pub fn parse(s: &str) -> Result<Verifier, ScramError> {
        let rest = s
            .strip_prefix("SCRAM-SHA-256$")
            .ok_or(ScramError::BadSecret("must start with SCRAM-SHA-256$"))?;
        let (params, keys) = rest
            .split_once('$')
            .ok_or(ScramError::BadSecret("missing '$' before the keys"))?;
        let (iter, salt) = params.split_once(':').ok_or(ScramError::BadSecret(
            "missing ':' after the iteration count",
        ))?;
        let (stored, server) = keys
            .split_once(':')
            .ok_or(ScramError::BadSecret("missing ':' between the keys"))?;
        let iterations: u32 = iter
            .parse()
            .map_err(|_| ScramError::BadSecret("iteration count is not a number"))?;
        if iterations == 0 {
            return Err(ScramError::BadSecret("iteration count must be positive"));
        }
        let salt = B64
            .decode(salt)
            .map_err(|_| ScramError::BadSecret("salt is not base64"))?;
        let key = |k: &str| -> Result<[u8; 32], ScramError> {
            B64.decode(k)
                .ok()
                .and_then(|v| <[u8; 32]>::try_from(v).ok())
                .ok_or(ScramError::BadSecret("keys must be 32 bytes of base64"))
        };
        Ok(Verifier {
            iterations,
            salt,
            stored_key: key(stored)?,
            server_key: key(server)?,
        })
    }

    /// A verifier no password matches, with a salt that is stable for `seed`: an exchange for
    /// a user that does not exist looks like one for a user that does (PostgreSQL does the
    /// same), so user names cannot be probed.
    pub fn unmatchable(seed: &[u8]) -> Verifier {
        let salt = Sha256::digest(seed)[..16].to_vec();
        let mut stored_key = [0u8; 32];
        rand::fill(&mut stored_key[..]);
        let mut server_key = [0u8; 32];
        rand::fill(&mut server_key[..]);
        Verifier {
            iterations: DEFAULT_ITERATIONS,
            salt,
            stored_key,
            server_key,
        }
    }

    pub fn to_text(&self) -> String {
        format!(
            "SCRAM-SHA-256${}:{}${}:{}",
            self.iterations,
            B64.encode(&self.salt),
            B64.encode(self.stored_key),
            B64.encode(self.server_key)
        )
    }
}

/// A server exchange between server-first and client-final.
///
/// Built with one allocation: the AuthMessage both signatures cover starts with
/// client-first-bare and server-first, so they are kept there, and client-final's part is
/// appended to the same string when it arrives (logins are a hot path with `-C`-style clients).
pub struct ServerExchange {
    verifier: Verifier,
    /// `client-first-bare,server-first,`: the AuthMessage up to client-final-without-proof.
    auth_message: String,
    /// Where the combined nonce (client's then server's) sits in `auth_message`.
    nonce: std::ops::Range<usize>,
    /// What the client's `c=` attribute must carry: its GS2 header again, and the channel
    /// binding data when it bound to the connection.
    gs2: Gs2,
}

/// The GS2 header a client sent (the authorization identity is always empty).
enum Gs2 {
    /// `n`: the client does not support channel binding.
    No,
    /// `y`: the client supports it but believes the server does not.
    Yes,
    /// `p=tls-server-end-point`: bound to this TLS certificate data.
    EndPoint(Vec<u8>),
}

impl Gs2 {
    fn header(&self) -> &'static [u8] {
        match self {
            Gs2::No => b"n,,",
            Gs2::Yes => b"y,,",
            Gs2::EndPoint(_) => b"p=tls-server-end-point,,",
        }
    }

    fn data(&self) -> &[u8] {
        match self {
            Gs2::EndPoint(d) => d,
            _ => &[],
        }
    }
}

/// Longest `c=` value accepted, decoded: the GS2 header and a SHA-512 end-point hash fit.
const MAX_BINDING_INPUT: usize = 128;

/// What channel binding the server side can offer for one exchange.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The client chose SCRAM-SHA-256-PLUS.
    pub plus: bool,
    /// The `tls-server-end-point` data of this connection, when it is TLS.
    pub end_point: Option<&'a [u8]>,
}

/// Outcome of a successful exchange.
pub struct Authenticated {
    /// `server-final-message`, to send in AuthenticationSASLFinal.
    pub server_final: String,
    /// The client's ClientKey, recovered from its proof; lets Shoal authenticate upstream as
    /// the client without knowing the password.
    pub client_key: [u8; 32],
}

fn attr(part: Option<&str>, name: char) -> Result<&str, ScramError> {
    let part = part.ok_or(ScramError::Malformed("missing attribute"))?;
    let mut chars = part.chars();
    if chars.next() != Some(name) || chars.next() != Some('=') {
        return Err(ScramError::Malformed("unexpected attribute"));
    }
    Ok(&part[2..])
}

impl ServerExchange {
    /// Starts an exchange from the client-first message; returns the server-first message.
    pub fn new(client_first: &[u8], verifier: Verifier) -> Result<(Self, String), ScramError> {
        Self::with_binding(
            client_first,
            verifier,
            Binding {
                plus: false,
                end_point: None,
            },
        )
    }

    /// As [`ServerExchange::new`], on a connection that may offer channel binding: a client
    /// that chose SCRAM-SHA-256-PLUS must bind to `binding.end_point`; a client that says it
    /// could bind but believes the server cannot (`y`) while the server could is refused, as
    /// that is a downgrade (RFC 5802).
    pub fn with_binding(
        client_first: &[u8],
        verifier: Verifier,
        binding: Binding<'_>,
    ) -> Result<(Self, String), ScramError> {
        let mut server_nonce = [0u8; NONCE_LEN];
        rand::fill(&mut server_nonce[..]);
        Self::start(client_first, verifier, &B64.encode(server_nonce), binding)
    }

    /// As [`ServerExchange::new`] with a given server nonce (for test vectors).
    pub fn with_nonce(
        client_first: &[u8],
        verifier: Verifier,
        server_nonce: &str,
    ) -> Result<(Self, String), ScramError> {
        Self::start(
            client_first,
            verifier,
            server_nonce,
            Binding {
                plus: false,
                end_point: None,
            },
        )
    }

    fn start(
        client_first: &[u8],
        verifier: Verifier,
        server_nonce: &str,
        binding: Binding<'_>,
    ) -> Result<(Self, String), ScramError> {
        let msg = std::str::from_utf8(client_first)
            .map_err(|_| ScramError::Malformed("client-first is not UTF-8"))?;
        let (cb_flag, rest) = msg
            .split_once(',')
            .ok_or(ScramError::Malformed("missing GS2 header"))?;
        let gs2 = match cb_flag {
            "n" | "y" if binding.plus => {
                return Err(ScramError::Malformed(
                    "SCRAM-SHA-256-PLUS chosen without channel binding",
                ))
            }
            "n" => Gs2::No,
            "y" if binding.end_point.is_some() => {
                return Err(ScramError::Malformed(
                    "channel binding negotiation error: the server supports channel binding",
                ))
            }
            "y" => Gs2::Yes,
            "p=tls-server-end-point" if binding.plus => Gs2::EndPoint(
                binding
                    .end_point
                    .ok_or(ScramError::ChannelBinding)?
                    .to_vec(),
            ),
            _ if cb_flag.starts_with("p=") => return Err(ScramError::ChannelBinding),
            _ => return Err(ScramError::Malformed("bad channel binding flag")),
        };
        let (authzid, bare) = rest
            .split_once(',')
            .ok_or(ScramError::Malformed("missing GS2 header"))?;
        if !authzid.is_empty() {
            return Err(ScramError::Malformed(
                "authorization identity not supported",
            ));
        }
        let mut parts = bare.split(',');
        let _user = attr(parts.next(), 'n')?; // PostgreSQL uses the startup user instead
        let client_nonce = attr(parts.next(), 'r')?;
        if client_nonce.is_empty() || !client_nonce.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(ScramError::Malformed("invalid client nonce"));
        }
        if parts.next().is_some() {
            return Err(ScramError::Malformed("unsupported SCRAM extension"));
        }
        // client-first-bare "," server-first "," client-final-without-proof: the nonce three
        // times (once in `bare`), the salt in base64, the largest binding data accepted, and
        // attribute names and the iteration count.
        let nonce_len = client_nonce.len() + server_nonce.len();
        let mut auth_message = String::with_capacity(
            bare.len()
                + 2 * nonce_len
                + verifier.salt.len() * 4 / 3
                + MAX_BINDING_INPUT * 4 / 3
                + 48,
        );
        auth_message.push_str(bare);
        auth_message.push(',');
        let first_at = auth_message.len();
        auth_message.push_str("r=");
        auth_message.push_str(client_nonce);
        auth_message.push_str(server_nonce);
        let nonce = first_at + 2..auth_message.len();
        auth_message.push_str(",s=");
        B64.encode_string(&verifier.salt, &mut auth_message);
        auth_message.push_str(",i=");
        auth_message.push_str(itoa::Buffer::new().format(verifier.iterations));
        let first = auth_message[first_at..].to_owned();
        auth_message.push(',');
        let ex = ServerExchange {
            verifier,
            auth_message,
            nonce,
            gs2,
        };
        Ok((ex, first))
    }

    /// Checks the client-final message and returns server-final on success.
    pub fn finish(mut self, client_final: &[u8]) -> Result<Authenticated, ScramError> {
        let msg = std::str::from_utf8(client_final)
            .map_err(|_| ScramError::Malformed("client-final is not UTF-8"))?;
        let (without_proof, proof) = msg
            .rsplit_once(",p=")
            .ok_or(ScramError::Malformed("missing proof"))?;
        let mut parts = without_proof.split(',');
        let cb = attr(parts.next(), 'c')?;
        if !self.binding_matches(cb) {
            return Err(ScramError::Malformed("channel binding data does not match"));
        }
        if attr(parts.next(), 'r')?.as_bytes() != self.auth_message[self.nonce.clone()].as_bytes() {
            return Err(ScramError::Malformed("nonce does not match"));
        }
        // 32 bytes are 44 characters of base64; the decoder wants room for its estimate.
        let mut decoded = [0u8; 36];
        if B64.decode_slice(proof, &mut decoded) != Ok(32) {
            return Err(ScramError::Malformed("proof is not 32 bytes of base64"));
        }
        let proof = &decoded[..32];
        self.auth_message.push_str(without_proof);
        let signature = hmac(&self.verifier.stored_key, self.auth_message.as_bytes());
        let mut client_key = [0u8; 32];
        for i in 0..32 {
            client_key[i] = proof[i] ^ signature[i];
        }
        let stored: [u8; 32] = Sha256::digest(client_key).into();
        if !bool::from(stored.ct_eq(&self.verifier.stored_key)) {
            return Err(ScramError::BadProof);
        }
        let server_signature = hmac(&self.verifier.server_key, self.auth_message.as_bytes());
        let mut server_final = String::with_capacity(2 + 44);
        server_final.push_str("v=");
        B64.encode_string(server_signature, &mut server_final);
        Ok(Authenticated {
            server_final,
            client_key,
        })
    }

    /// Whether client-final's `c=` carries the GS2 header the client opened with, followed by
    /// the connection's channel-binding data when it bound to it.
    fn binding_matches(&self, cb: &str) -> bool {
        let mut given = [0u8; MAX_BINDING_INPUT + 3];
        let Ok(n) = B64.decode_slice(cb, &mut given) else {
            return false;
        };
        let (header, data) = (self.gs2.header(), self.gs2.data());
        n == header.len() + data.len()
            && bool::from(given[..header.len()].ct_eq(header) & given[header.len()..n].ct_eq(data))
    }
}

/// The client side of an exchange, for tools that log in to PostgreSQL or Shoal (the load
/// generator). The costly PBKDF2 step is a parameter so callers can cache it per salt.
pub struct ClientExchange {
    client_first_bare: String,
    nonce: String,
}

/// What the client sends as client-final, and the server signature it must get back.
pub struct ClientFinal {
    pub message: String,
    pub server_signature: [u8; 32],
}

impl ClientExchange {
    /// Starts an exchange; returns the client-first message to send.
    pub fn new() -> (ClientExchange, String) {
        let mut raw = [0u8; NONCE_LEN];
        rand::fill(&mut raw[..]);
        let nonce = B64.encode(raw);
        let bare = format!("n=,r={nonce}");
        let first = format!("n,,{bare}");
        (
            ClientExchange {
                client_first_bare: bare,
                nonce,
            },
            first,
        )
    }

    /// Answers server-first. `salted` maps (salt, iterations) to the salted password.
    pub fn respond(
        self,
        server_first: &[u8],
        salted: impl FnOnce(&[u8], u32) -> [u8; 32],
    ) -> Result<ClientFinal, ScramError> {
        let first = self.parse_server_first(server_first)?;
        let salted = salted(&first.salt, first.iterations);
        let client_key = hmac(&salted, b"Client Key");
        let stored_key: [u8; 32] = Sha256::digest(client_key).into();
        let server_key = hmac(&salted, b"Server Key");
        Ok(self.client_final(&first, &client_key, &stored_key, &server_key))
    }

    /// Answers server-first without the password (SCRAM passthrough): with the ClientKey
    /// recovered from a client's proof and the verifier that client was checked against. The
    /// server must use that verifier's salt and iteration count (it does while the password is
    /// unchanged); otherwise this fails with [`ScramError::VerifierChanged`].
    pub fn respond_with_key(
        self,
        server_first: &[u8],
        client_key: &[u8; 32],
        verifier: &Verifier,
    ) -> Result<ClientFinal, ScramError> {
        let first = self.parse_server_first(server_first)?;
        if first.salt != verifier.salt || first.iterations != verifier.iterations {
            return Err(ScramError::VerifierChanged);
        }
        Ok(self.client_final(
            &first,
            client_key,
            &verifier.stored_key,
            &verifier.server_key,
        ))
    }

    fn parse_server_first<'a>(
        &self,
        server_first: &'a [u8],
    ) -> Result<ServerFirst<'a>, ScramError> {
        let msg = std::str::from_utf8(server_first)
            .map_err(|_| ScramError::Malformed("server-first is not UTF-8"))?;
        let mut parts = msg.split(',');
        let nonce = attr(parts.next(), 'r')?;
        if !nonce.starts_with(&self.nonce) {
            return Err(ScramError::Malformed("server nonce does not extend ours"));
        }
        let salt = B64
            .decode(attr(parts.next(), 's')?)
            .map_err(|_| ScramError::Malformed("salt is not base64"))?;
        let iterations: u32 = attr(parts.next(), 'i')?
            .parse()
            .map_err(|_| ScramError::Malformed("bad iteration count"))?;
        Ok(ServerFirst {
            msg,
            nonce,
            salt,
            iterations,
        })
    }

    /// client-final with its proof, and the server signature to expect.
    fn client_final(
        &self,
        first: &ServerFirst<'_>,
        client_key: &[u8; 32],
        stored_key: &[u8; 32],
        server_key: &[u8; 32],
    ) -> ClientFinal {
        let without_proof = format!("c=biws,r={}", first.nonce);
        let auth_message = format!("{},{},{}", self.client_first_bare, first.msg, without_proof);
        let signature = hmac(stored_key, auth_message.as_bytes());
        let mut proof = [0u8; 32];
        for i in 0..32 {
            proof[i] = client_key[i] ^ signature[i];
        }
        ClientFinal {
            message: format!("{without_proof},p={}", B64.encode(proof)),
            server_signature: hmac(server_key, auth_message.as_bytes()),
        }
    }
}

/// A parsed server-first message.
struct ServerFirst<'a> {
    msg: &'a str,
    nonce: &'a str,
    salt: Vec<u8>,
    iterations: u32,
}

/// Checks server-final against the expected signature (constant-time).
pub fn verify_server_final(server_final: &[u8], expected: &[u8; 32]) -> Result<(), ScramError> {
    let msg = std::str::from_utf8(server_final)
        .map_err(|_| ScramError::Malformed("server-final is not UTF-8"))?;
    let sig = B64
        .decode(attr(Some(msg), 'v')?)
        .map_err(|_| ScramError::Malformed("server signature is not base64"))?;
    if bool::from(sig.as_slice().ct_eq(expected.as_slice())) {
        Ok(())
    } else {
        Err(ScramError::BadProof)
    }
}

#[cfg(test)]
mod tests;
