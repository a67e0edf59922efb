//! Cancel requests forwarded to the server running a client's query.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The server a cancel should go to.
#[derive(Clone, Copy, Debug)]
pub struct CancelTarget {
    pub addr: SocketAddr,
    pub process_id: i32,
    pub secret_key: i32,
}

/// Sends a CancelRequest to a server and waits until PostgreSQL has acted on it.
pub async fn forward(target: CancelTarget) {
    if let Err(e) = send_cancel(target).await {
        tracing::warn!(server = %target.addr, error = %e, "forwarding cancel request failed");
    }
}

async fn send_cancel(target: CancelTarget) -> std::io::Result<()> {
    let mut buf = BytesMut::new();
    shoal_wire::frontend::cancel_request(&mut buf, target.process_id, target.secret_key);
    if target.addr.ip().is_unspecified() {
        // A server reached by a dialed stream that names no cancel address.
        return Err(std::io::Error::other("the server takes no cancel requests"));
    }
    let send = async {
        let mut s = TcpStream::connect(target.addr).await?;
        s.write_all(&buf).await?;
        // PostgreSQL closes the connection once it has signalled the backend.
        let mut sink = [0u8; 16];
        while s.read(&mut sink).await? > 0 {}
        Ok(())
    };
    crate::timer::timeout(Duration::from_secs(5), send)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("cancel timed out")))
}
