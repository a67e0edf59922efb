//! TLS on node links (`[cluster] tls_cert`, `tls_key`, `tls_ca`): both sides present a
//! certificate signed by the nodes' CA and check the other's; the connecting side checks the
//! server's against the relay address it dialled. The cluster secret's proof then runs inside.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::config::ClusterTls;

#[derive(Debug, thiserror::Error)]
pub enum NodeTlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Bad { path: String, reason: String },
}

pub struct NodeTls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub connector: tokio_rustls::TlsConnector,
}

fn read(path: &Path) -> Result<Vec<u8>, NodeTlsError> {
    std::fs::read(path).map_err(|source| NodeTlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn bad(path: &Path, reason: impl ToString) -> NodeTlsError {
    NodeTlsError::Bad {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NodeTlsError> {
    let pem = read(path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "no certificate in the file"));
    }
    Ok(certs)
}

impl NodeTls {
    pub fn load(c: &ClusterTls) -> Result<NodeTls, NodeTlsError> {
        let chain = certs(&c.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&read(&c.key)?).map_err(|e| bad(&c.key, e))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in certs(&c.ca)? {
            roots.add(ca).map_err(|e| bad(&c.ca, e))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| bad(&c.ca, e))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&c.cert, e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad(&c.cert, e))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&c.cert, e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| bad(&c.key, e))?;
        Ok(NodeTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
        })
    }
}

/// The name a peer's certificate must carry: the host of its relay address.
pub fn server_name(relay: &str) -> Option<ServerName<'static>> {
    let host = match relay.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => relay,
    };
    ServerName::try_from(host.to_owned()).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn relay_addresses_name_their_host() {
        use rustls::pki_types::ServerName;
        assert!(matches!(
            super::server_name("127.0.0.1:7432"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            super::server_name("[::1]:7432"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            super::server_name("node-a.internal:7432"),
            Some(ServerName::DnsName(_))
        ));
    }
}
