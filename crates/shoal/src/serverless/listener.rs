//! The front door's connections: TLS with the pooler's own certificates (chosen by SNI as
//! for TCP clients) when Shoal has one, told apart from plain text by the first byte (a
//! TLS handshake record); plain text, which carries passwords as they are, only from
//! loopback then unless `accept_plain = "anywhere"`. Handshakes run in tasks of their own,
//! so a slow client delays nobody; axum is handed finished connections.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::either::Either;

use crate::app::App;
use crate::config::AcceptPlain;

/// A TLS handshake record's first byte.
const HANDSHAKE: u8 = 0x16;
/// How long a connection may take to say what it is and finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

pub type Io = Either<crate::tls::WebTlsStream, TcpStream>;

/// Connections ready for HTTP, as axum's `Listener`.
pub struct DoorListener {
    ready: mpsc::Receiver<(Io, SocketAddr)>,
    local: SocketAddr,
}

/// A front-door connection's peer address and whether it came over TLS (`ConnectInfo`).
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    pub tls: bool,
}

impl Connected<IncomingStream<'_, DoorListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, DoorListener>) -> Peer {
        Peer {
            addr: *stream.remote_addr(),
            tls: matches!(stream.io(), Either::Left(_)),
        }
    }
}

impl axum::serve::Listener for DoorListener {
    type Io = Io;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Io, SocketAddr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept task ended (the runtime is shutting down): wait for the end.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Whether a plain-text connection from `peer` is served.
fn plain_allowed(peer: IpAddr, have_certificate: bool, accept: AcceptPlain) -> bool {
    !have_certificate || accept == AcceptPlain::Anywhere || peer.to_canonical().is_loopback()
}

/// Accepts on `listener` and hands each connection, once it is TLS or allowed plain text,
/// to the returned listener.
pub fn start(
    app: Arc<App>,
    listener: TcpListener,
    accept: AcceptPlain,
) -> std::io::Result<DoorListener> {
    let local = listener.local_addr()?;
    let (tx, ready) = mpsc::channel(1024);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors, say: breathe, then go on.
                    tracing::warn!(error = %e, "serverless front door: accept failed");
                    crate::timer::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (app, tx) = (app.clone(), tx.clone());
            tokio::spawn(async move {
                let io =
                    crate::timer::timeout(HANDSHAKE_TIMEOUT, classify(&app, tcp, peer, accept));
                if let Ok(Some(io)) = io.await {
                    let _ = tx.send((io, peer)).await;
                }
            });
        }
    });
    Ok(DoorListener { ready, local })
}

async fn classify(app: &App, tcp: TcpStream, peer: SocketAddr, accept: AcceptPlain) -> Option<Io> {
    let _ = tcp.set_nodelay(true);
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await.ok()? == 0 {
        return None;
    }
    let have_certificate = app.tls.serves_web();
    if first[0] == HANDSHAKE && have_certificate {
        return match app.tls.accept_web(tcp).await {
            Ok(tls) => Some(Either::Left(tls)),
            Err(e) => {
                tracing::debug!(%peer, error = %e, "serverless front door: TLS handshake failed");
                None
            }
        };
    }
    if plain_allowed(peer.ip(), have_certificate, accept) {
        return Some(Either::Right(tcp));
    }
    refuse_plain(tcp).await;
    None
}

/// Tells a plain-text client from afar to come back with TLS, and closes.
async fn refuse_plain(mut tcp: TcpStream) {
    let body = r#"{"message":"this front door takes https:// and wss:// from other hosts: passwords must not cross the network in plain text"}"#;
    let reply = format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tcp.write_all(reply.as_bytes()).await;
    let _ = tcp.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_only_from_loopback_when_tls_is_there() {
        let far: IpAddr = "10.1.2.3".parse().unwrap();
        let near: IpAddr = "127.0.0.2".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert!(plain_allowed(far, false, AcceptPlain::Loopback));
        assert!(!plain_allowed(far, true, AcceptPlain::Loopback));
        assert!(plain_allowed(far, true, AcceptPlain::Anywhere));
        assert!(plain_allowed(near, true, AcceptPlain::Loopback));
        assert!(plain_allowed(mapped, true, AcceptPlain::Loopback));
        assert!(plain_allowed(
            "::1".parse().unwrap(),
            true,
            AcceptPlain::Loopback
        ));
    }
}
