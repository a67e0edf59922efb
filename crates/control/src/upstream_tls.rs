//! TLS from Shoal to PostgreSQL, per database, with libpq's `sslmode` meanings: `prefer`
//! (TLS when offered, unverified), `require` (TLS, unverified), `verify-ca` (chain verified),
//! `verify-full` (chain and host name verified), and a client certificate when configured.

use rustls::pki_types::pem::PemObject;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error, RootCertStore, SignatureScheme};

use crate::config::{SslMode, UpstreamTlsSettings};

/// Why upstream TLS could not be set up (names the file).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamTlsError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{0}")]
    Config(String),
}

/// A database's TLS client configuration, built once per pool.
pub struct UpstreamTls {
    pub mode: SslMode,
    pub sni: bool,
    pub config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UpstreamTls({:?})", self.mode)
    }
}

fn read_pem(path: &std::path::Path) -> Result<Vec<u8>, UpstreamTlsError> {
    std::fs::read(path).map_err(|e| UpstreamTlsError::Read {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// A client key from PEM: plain (PKCS#8, PKCS#1 or SEC1), or encrypted PKCS#8 (`ENCRYPTED
/// PRIVATE KEY`, PBES2: what `openssl pkcs8 -topk8 -v2 aes-256-cbc` and `openssl genpkey
/// -aes256` write) decrypted with `password`, as libpq does with `sslpassword`.
fn client_key(
    pem: &[u8],
    password: Option<&crate::config::KeyPassword>,
) -> Result<rustls::pki_types::PrivateKeyDer<'static>, String> {
    let text = String::from_utf8_lossy(pem);
    if text.contains("Proc-Type: 4,ENCRYPTED") {
        return Err(
            "the key is encrypted in OpenSSL's legacy PEM format; convert it with \
                    `openssl pkcs8 -topk8 -v2 aes-256-cbc -in old.key -out new.key`"
                .into(),
        );
    }
    if let Some(start) = text.find("-----BEGIN ENCRYPTED PRIVATE KEY-----") {
        let Some(password) = password else {
            return Err("the key is encrypted: set sslpassword (or sslpassword_env)".into());
        };
        let (_, doc) = pkcs8::SecretDocument::from_pem(&text[start..])
            .map_err(|e| format!("not a PEM encrypted key: {e}"))?;
        let encrypted = pkcs8::EncryptedPrivateKeyInfo::try_from(doc.as_bytes())
            .map_err(|e| format!("not an encrypted PKCS#8 key: {e}"))?;
        let plain = encrypted.decrypt(password.0.as_bytes()).map_err(|_| {
            "cannot decrypt the key: wrong sslpassword, or an unsupported cipher".to_string()
        })?;
        return Ok(rustls::pki_types::PrivateKeyDer::Pkcs8(
            plain.as_bytes().to_vec().into(),
        ));
    }
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => "no private key found".to_string(),
        e => e.to_string(),
    })
}

/// Accepts any certificate (`prefer`/`require`: encryption without authentication, as libpq
/// does without a root certificate), still checking the handshake's signatures.
#[derive(Debug)]
struct Unverified(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(Error::InvalidCertificate(CertificateError::NotValidForName))
            | Err(Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. })) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

impl UpstreamTls {
    /// The client configuration for `settings`; `None` for `sslmode = "disable"`.
    pub fn build(settings: &UpstreamTlsSettings) -> Result<Option<UpstreamTls>, UpstreamTlsError> {
        if settings.mode == SslMode::Disable {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| UpstreamTlsError::Config(e.to_string()))?;
        let verify = matches!(settings.mode, SslMode::VerifyCa | SslMode::VerifyFull);
        let builder = if verify {
            let mut roots = RootCertStore::empty();
            match &settings.rootcert {
                Some(path) => {
                    let pem = read_pem(path)?;
                    for c in CertificateDer::pem_slice_iter(&pem) {
                        let c = c.map_err(|e| UpstreamTlsError::Read {
                            path: path.display().to_string(),
                            reason: e.to_string(),
                        })?;
                        roots.add(c).map_err(|e| UpstreamTlsError::Read {
                            path: path.display().to_string(),
                            reason: e.to_string(),
                        })?;
                    }
                }
                // The system's trusted roots (a managed PostgreSQL with a public CA).
                None => {
                    let found = rustls_native_certs::load_native_certs();
                    let (added, _) = roots.add_parsable_certificates(found.certs);
                    if added == 0 {
                        return Err(UpstreamTlsError::Config(format!(
                            "sslmode {:?} without sslrootcert needs the system's root certificates, and none were found",
                            settings.mode
                        )));
                    }
                }
            }
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| UpstreamTlsError::Config(e.to_string()))?;
            if settings.mode == SslMode::VerifyCa {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
            } else {
                builder.with_webpki_verifier(webpki)
            }
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
        };
        let config = match (&settings.cert, &settings.key) {
            (Some(cert), Some(key)) => {
                let pem = read_pem(cert)?;
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<_, _>>()
                    .map_err(|e| UpstreamTlsError::Read {
                        path: cert.display().to_string(),
                        reason: e.to_string(),
                    })?;
                let pem = read_pem(key)?;
                let key_der =
                    client_key(&pem, settings.key_password.as_ref()).map_err(|reason| {
                        UpstreamTlsError::Read {
                            path: key.display().to_string(),
                            reason,
                        }
                    })?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|e| UpstreamTlsError::Config(e.to_string()))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(UpstreamTlsError::Config(
                    "sslcert and sslkey go together".into(),
                ))
            }
        };
        let mut config = config;
        config.enable_sni = settings.sni;
        Ok(Some(UpstreamTls {
            mode: settings.mode,
            sni: settings.sni,
            config: Arc::new(config),
        }))
    }
}
