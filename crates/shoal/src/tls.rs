//! Client-facing TLS: certificates loaded from PEM files, one chosen per connection by the
//! server name the client asks for (SNI), and the handshake that turns a client's socket into
//! a TLS stream — after an SSLRequest, or directly (PostgreSQL 17's `sslnegotiation=direct`,
//! ALPN `postgresql`).

use rustls::pki_types::pem::PemObject;
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::config::{ClientTls, TlsSection};

/// Why TLS could not be set up; names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("{path}: no certificate found (PEM \"CERTIFICATE\" blocks expected)")]
    NoCertificate { path: String },
    #[error("{path}: no private key found (PEM PKCS#8, RSA or EC key expected)")]
    NoKey { path: String },
    #[error("{path}: the key does not fit the certificate or is not supported: {reason}")]
    BadKey { path: String, reason: String },
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// A certificate chain and its key, ready to sign handshakes.
fn load_pair(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let pem = read(cert)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Read {
            path: cert.display().to_string(),
            source: std::io::Error::other(e),
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert.display().to_string(),
        });
    }
    let pem = read(key)?;
    let key_der: PrivateKeyDer<'static> = match PrivateKeyDer::from_pem_slice(&pem) {
        Ok(k) => k,
        Err(rustls::pki_types::pem::Error::NoItemsFound) => {
            return Err(TlsError::NoKey {
                path: key.display().to_string(),
            })
        }
        Err(e) => {
            return Err(TlsError::Read {
                path: key.display().to_string(),
                source: std::io::Error::other(e),
            })
        }
    };
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| TlsError::BadKey {
            path: key.display().to_string(),
            reason: e.to_string(),
        })?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| TlsError::BadKey {
        path: key.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(Arc::new(certified))
}

/// Picks the certificate for the server name a client asked for; the default one otherwise.
#[derive(Debug)]
struct BySni {
    default: Arc<CertifiedKey>,
    named: Vec<(String, Arc<CertifiedKey>)>,
}

impl BySni {
    fn pick(&self, name: Option<&str>) -> Arc<CertifiedKey> {
        name.and_then(|n| {
            self.named
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, c)| c.clone())
        })
        .unwrap_or_else(|| self.default.clone())
    }
}

impl ResolvesServerCert for BySni {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.pick(hello.server_name()))
    }
}

/// The largest TLS record Shoal writes to a client, header included.
pub const MAX_TLS_RECORD: usize = 8192;

/// What Shoal needs to serve TLS to clients. The certificates can be replaced while Shoal
/// runs ([`TlsState::reload`]); connections already made keep theirs.
pub struct TlsState {
    pub mode: ClientTls,
    loaded: std::sync::RwLock<Arc<Loaded>>,
}

/// One generation of loaded certificates.
struct Loaded {
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    /// The same certificates for HTTP and WebSockets (ALPN `http/1.1`): the serverless
    /// front door.
    web: Option<tokio_rustls::TlsAcceptor>,
    certs: Option<Arc<BySni>>,
}

impl TlsState {
    /// Loads every certificate and key named in `[tls]`; fails naming the file at fault.
    pub fn load(section: &TlsSection) -> Result<TlsState, TlsError> {
        Ok(TlsState {
            mode: section.mode(),
            loaded: std::sync::RwLock::new(Arc::new(Self::load_files(section)?)),
        })
    }

    /// Re-reads the certificate and key files (SIGHUP). A file that cannot be used is
    /// refused with the reason and the certificates in use stay.
    pub fn reload(&self, section: &TlsSection) -> Result<(), TlsError> {
        let fresh = Self::load_files(section)?;
        *self.loaded.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(fresh);
        Ok(())
    }

    fn current(&self) -> Arc<Loaded> {
        self.loaded
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn load_files(section: &TlsSection) -> Result<Loaded, TlsError> {
        let (Some(cert), Some(key)) = (&section.cert_file, &section.key_file) else {
            return Ok(Loaded {
                acceptor: None,
                web: None,
                certs: None,
            });
        };
        let default = load_pair(cert, key)?;
        let mut named = Vec::new();
        for c in &section.certificates {
            let pair = load_pair(&c.cert_file, &c.key_file)?;
            for n in &c.server_names {
                named.push((n.clone(), pair.clone()));
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::BadKey {
                path: cert.display().to_string(),
                reason: e.to_string(),
            })?;
        let builder = match &section.ca_file {
            None => builder.with_no_client_auth(),
            // Clients may present a certificate; if they do it must chain to these CAs.
            Some(ca) => {
                let pem = read(ca)?;
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(&pem) {
                    let c = c.map_err(|e| TlsError::Read {
                        path: ca.display().to_string(),
                        source: std::io::Error::other(e),
                    })?;
                    roots.add(c).map_err(|e| TlsError::BadKey {
                        path: ca.display().to_string(),
                        reason: e.to_string(),
                    })?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::BadKey {
                    path: ca.display().to_string(),
                    reason: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(Arc::new(BySni {
            default: default.clone(),
            named: named.clone(),
        }));
        let mut web = config.clone();
        web.alpn_protocols = vec![b"http/1.1".to_vec()];
        // PostgreSQL's ALPN name: required by clients that start TLS directly.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        // Records no larger than libpq's initial 8 KiB input buffer: with bigger ones, a
        // client on libpq's asynchronous API can wait for bytes that already sit decrypted
        // inside its TLS library (psycopg, ruby-pg and others have hung so).
        config.max_fragment_size = Some(MAX_TLS_RECORD);
        Ok(Loaded {
            acceptor: Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))),
            web: Some(tokio_rustls::TlsAcceptor::from(Arc::new(web))),
            certs: Some(Arc::new(BySni { default, named })),
        })
    }

    /// The `tls-server-end-point` channel binding data (RFC 5929) of a connection made with
    /// `server_name`: the SHA-256 hash of the certificate served to it. (Certificates signed
    /// with SHA-384 or SHA-512 would need that hash instead; SHA-256 and weaker use SHA-256.)
    pub fn end_point(&self, server_name: Option<&str>) -> Option<Vec<u8>> {
        use sha2::Digest;
        let cert = self.current().certs.as_ref()?.pick(server_name);
        let leaf = cert.cert.first()?;
        Some(sha2::Sha256::digest(leaf.as_ref()).to_vec())
    }

    /// Whether encryption requests are answered `S`.
    pub fn enabled(&self) -> bool {
        self.current().acceptor.is_some() && self.mode != ClientTls::Disable
    }

    /// The TLS handshake over `tcp`, whose first bytes may already have been read
    /// (`already`, for a client that started TLS directly).
    pub async fn accept(&self, tcp: TcpStream, already: Bytes) -> io::Result<ClientTlsStream> {
        let acceptor = self
            .current()
            .acceptor
            .clone()
            .ok_or_else(|| io::Error::other("TLS is not configured"))?;
        acceptor
            .accept(Prefixed {
                prefix: already,
                inner: tcp,
            })
            .await
    }
}

impl TlsState {
    /// Whether a certificate is loaded for HTTP and WebSockets (the serverless front door).
    pub fn serves_web(&self) -> bool {
        self.current().web.is_some()
    }

    /// The TLS handshake of an HTTP or WebSocket client of the serverless front door.
    pub async fn accept_web(&self, tcp: TcpStream) -> io::Result<WebTlsStream> {
        let acceptor = self
            .current()
            .web
            .clone()
            .ok_or_else(|| io::Error::other("TLS is not configured"))?;
        acceptor.accept(tcp).await
    }
}

/// An HTTP or WebSocket client's TLS stream.
pub type WebTlsStream = tokio_rustls::server::TlsStream<TcpStream>;

/// A client's TLS stream.
pub type ClientTlsStream = tokio_rustls::server::TlsStream<Prefixed<TcpStream>>;

/// The common name of the certificate a client presented (verified during the handshake).
pub fn peer_common_name(s: &ClientTlsStream) -> Option<String> {
    let leaf = s.get_ref().1.peer_certificates()?.first()?;
    common_name(leaf.as_ref())
}

/// The first common name (CN) in a DER certificate's subject, in any of the string types
/// certificates use for it.
fn common_name(der: &[u8]) -> Option<String> {
    use x509_cert::der::asn1::{Ia5StringRef, PrintableStringRef, TeletexStringRef, Utf8StringRef};
    use x509_cert::der::{Decode, Tag, Tagged};
    const CN: x509_cert::der::asn1::ObjectIdentifier =
        x509_cert::der::asn1::ObjectIdentifier::new_unwrap("2.5.4.3");
    let cert = x509_cert::Certificate::from_der(der).ok()?;
    let value = cert
        .tbs_certificate
        .subject
        .0
        .iter()
        .flat_map(|rdn| rdn.0.iter())
        .find(|atv| atv.oid == CN)?
        .value
        .clone();
    let text = match value.tag() {
        Tag::Utf8String => value.decode_as::<Utf8StringRef<'_>>().ok()?.to_string(),
        Tag::PrintableString => value
            .decode_as::<PrintableStringRef<'_>>()
            .ok()?
            .to_string(),
        Tag::Ia5String => value.decode_as::<Ia5StringRef<'_>>().ok()?.to_string(),
        Tag::TeletexString => value.decode_as::<TeletexStringRef<'_>>().ok()?.to_string(),
        _ => return None,
    };
    Some(text)
}

/// The server name (SNI) a TLS client asked for.
pub fn server_name(s: &ClientTlsStream) -> Option<&str> {
    s.get_ref().1.server_name()
}

/// A stream whose first bytes were already read: they are read again first.
pub struct Prefixed<S> {
    prefix: Bytes,
    pub inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    fn cert_with(name: Option<rcgen::DnValue>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "Shoal tests");
        if let Some(value) = name {
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, value);
        }
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn reads_the_common_name_in_each_string_type() {
        for (value, want) in [
            (rcgen::DnValue::Utf8String("alice".into()), "alice"),
            (
                rcgen::DnValue::PrintableString("bob".try_into().unwrap()),
                "bob",
            ),
            (
                rcgen::DnValue::Ia5String("carol".try_into().unwrap()),
                "carol",
            ),
        ] {
            let der = cert_with(Some(value));
            assert_eq!(super::common_name(&der).as_deref(), Some(want));
        }
        assert_eq!(super::common_name(&cert_with(None)), None);
        assert_eq!(super::common_name(b"not a certificate"), None);
    }
}
