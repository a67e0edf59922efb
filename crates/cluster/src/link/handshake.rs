//! How two nodes prove to each other that they hold the cluster's secret before a link
//! carries anything: each side sends a fresh 32-byte nonce, and each answers with an
//! HMAC-SHA256 over both nonces and both node ids under the secret, labelled by its role so
//! that one side's answer is never valid as the other's. Neither answer can be replayed
//! (the other side's nonce is new every time), and the secret never crosses the wire.
//! Compared in constant time.
//!
//! This authenticates the link's start only; on an untrusted network the link should run
//! inside TLS (`[cluster] tls`).

use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MAGIC: &[u8; 8] = b"SHOALLNK";
const VERSION: u16 = 1;
const MAX_ID: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("link i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer is not a Shoal node link (bad magic)")]
    NotALink,
    #[error("the peer speaks link version {0}, this node {VERSION}")]
    Version(u16),
    #[error("node id too long or not UTF-8")]
    BadId,
    #[error("the peer could not prove it holds the cluster secret")]
    BadProof,
    #[error("the peer refused this node's proof (is the cluster secret the same on both?)")]
    Refused,
}

type HmacSha256 = Hmac<Sha256>;

/// The proof one side gives: an HMAC over the role, both nonces and both ids.
pub fn proof(
    secret: &[u8],
    role: &str,
    nonce_c: &[u8; 32],
    nonce_a: &[u8; 32],
    connector: &str,
    acceptor: &str,
) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(role.as_bytes());
    m.update(&[0]);
    m.update(nonce_c);
    m.update(nonce_a);
    m.update(connector.as_bytes());
    m.update(&[0]);
    m.update(acceptor.as_bytes());
    m.finalize().into_bytes().into()
}

fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.ct_eq(b).into()
}

async fn write_id<W: AsyncWrite + Unpin>(w: &mut W, id: &str) -> Result<(), HandshakeError> {
    if id.len() > MAX_ID {
        return Err(HandshakeError::BadId);
    }
    w.write_u8(id.len() as u8).await?;
    w.write_all(id.as_bytes()).await?;
    Ok(())
}

async fn read_id<R: AsyncRead + Unpin>(r: &mut R) -> Result<String, HandshakeError> {
    let n = r.read_u8().await? as usize;
    let mut b = vec![0; n];
    r.read_exact(&mut b).await?;
    String::from_utf8(b).map_err(|_| HandshakeError::BadId)
}

/// The connecting side. Returns the acceptor's node id once both proofs checked out.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    secret: &[u8],
    me: &str,
) -> Result<String, HandshakeError> {
    let nonce_c: [u8; 32] = rand::random();
    let mut hello = Vec::with_capacity(64);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_be_bytes());
    hello.extend_from_slice(&nonce_c);
    io.write_all(&hello).await?;
    write_id(io, me).await?;
    io.flush().await?;
    let version = io.read_u16().await?;
    if version != VERSION {
        return Err(HandshakeError::Version(version));
    }
    let mut nonce_a = [0u8; 32];
    io.read_exact(&mut nonce_a).await?;
    let mut theirs = [0u8; 32];
    io.read_exact(&mut theirs).await?;
    let peer = read_id(io).await?;
    let expected = proof(secret, "acceptor", &nonce_c, &nonce_a, me, &peer);
    if !same(&theirs, &expected) {
        return Err(HandshakeError::BadProof);
    }
    let mine = proof(secret, "connector", &nonce_c, &nonce_a, me, &peer);
    io.write_all(&mine).await?;
    io.flush().await?;
    match io.read_u8().await {
        Ok(1) => Ok(peer),
        _ => Err(HandshakeError::Refused),
    }
}

/// The accepting side. Returns the connector's node id once both proofs checked out.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    secret: &[u8],
    me: &str,
) -> Result<String, HandshakeError> {
    let mut magic = [0u8; 8];
    io.read_exact(&mut magic).await?;
    if &magic != MAGIC {
        return Err(HandshakeError::NotALink);
    }
    let version = io.read_u16().await?;
    if version != VERSION {
        // Said so that the other side can log it; then the connection ends.
        let _ = io.write_u16(VERSION).await;
        return Err(HandshakeError::Version(version));
    }
    let mut nonce_c = [0u8; 32];
    io.read_exact(&mut nonce_c).await?;
    let peer = read_id(io).await?;
    let nonce_a: [u8; 32] = rand::random();
    let mine = proof(secret, "acceptor", &nonce_c, &nonce_a, &peer, me);
    let mut reply = Vec::with_capacity(80);
    reply.extend_from_slice(&VERSION.to_be_bytes());
    reply.extend_from_slice(&nonce_a);
    reply.extend_from_slice(&mine);
    io.write_all(&reply).await?;
    write_id(io, me).await?;
    io.flush().await?;
    let mut theirs = [0u8; 32];
    io.read_exact(&mut theirs).await?;
    let expected = proof(secret, "connector", &nonce_c, &nonce_a, &peer, me);
    if !same(&theirs, &expected) {
        return Err(HandshakeError::BadProof);
    }
    io.write_u8(1).await?;
    io.flush().await?;
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn nodes_with_the_same_secret_link() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (c, s) = tokio::join!(
            connect(&mut a, b"0123456789abcdef", "n1"),
            accept(&mut b, b"0123456789abcdef", "n2")
        );
        assert_eq!(c.unwrap(), "n2");
        assert_eq!(s.unwrap(), "n1");
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_on_both_sides() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (c, s) = tokio::join!(
            async move {
                // Returns, and so closes its end, on the bad proof.
                connect(&mut a, b"0123456789abcdef", "n1").await
            },
            accept(&mut b, b"fedcba9876543210", "n2")
        );
        assert!(matches!(c, Err(HandshakeError::BadProof)), "{c:?}");
        // The acceptor waits for a proof that never comes: the connector gave up.
        assert!(s.is_err());
    }

    #[tokio::test]
    async fn something_else_than_a_node_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (_, s) = tokio::join!(
            async {
                a.write_all(b"\0\0\0\x08\x04\xd2\x16\x2f").await.unwrap();
                a
            },
            accept(&mut b, b"0123456789abcdef", "n2")
        );
        assert!(matches!(s, Err(HandshakeError::NotALink)), "{s:?}");
    }

    #[test]
    fn the_roles_proofs_differ() {
        let n = [7u8; 32];
        let a = proof(b"k", "acceptor", &n, &n, "x", "y");
        let c = proof(b"k", "connector", &n, &n, "x", "y");
        assert_ne!(a, c);
        assert_ne!(a, proof(b"k", "acceptor", &n, &n, "y", "x"));
    }
}
