//! Cancel requests forwarded to the server running a client's query.

use std::net::{IpAddr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The server a cancel should go to. 32 bytes, where a `SocketAddr` alone takes 32: every
/// client's cancel slot holds one and must stay in its 128-byte allocation (an IPv6 flow
/// label means nothing to a cancel connection; the scope id is kept for link-local servers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CancelTarget {
    ip: IpAddr,
    port: u16,
    scope_id: u32,
    pub process_id: i32,
    pub secret_key: i32,
}

impl CancelTarget {
    pub fn new(addr: SocketAddr, process_id: i32, secret_key: i32) -> CancelTarget {
        let scope_id = match addr {
            SocketAddr::V6(a) => a.scope_id(),
            SocketAddr::V4(_) => 0,
        };
        CancelTarget {
            ip: addr.ip(),
            port: addr.port(),
            scope_id,
            process_id,
            secret_key,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        match self.ip {
            IpAddr::V6(ip) => SocketAddr::V6(SocketAddrV6::new(ip, self.port, 0, self.scope_id)),
            IpAddr::V4(_) => SocketAddr::new(self.ip, self.port),
        }
    }
}

/// Sends a CancelRequest to a server and waits until PostgreSQL has acted on it.
pub async fn forward(target: CancelTarget) {
    if let Err(e) = send_cancel(target).await {
        tracing::warn!(server = %target.addr(), error = %e, "forwarding cancel request failed");
    }
}

async fn send_cancel(target: CancelTarget) -> std::io::Result<()> {
    let mut buf = BytesMut::new();
    shoal_wire::frontend::cancel_request(&mut buf, target.process_id, target.secret_key);
    if target.ip.is_unspecified() {
        // A server reached by a dialed stream that names no cancel address.
        return Err(std::io::Error::other("the server takes no cancel requests"));
    }
    let send = async {
        let mut s = TcpStream::connect(target.addr()).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_keeps_the_address_a_cancel_connects_to() {
        for addr in ["10.1.2.3:5432", "[::1]:6543", "[fe80::1%7]:5432"] {
            let addr: SocketAddr = addr.parse().expect("address");
            let t = CancelTarget::new(addr, 7, -9);
            assert_eq!(t.addr(), addr);
            assert_eq!((t.process_id, t.secret_key), (7, -9));
        }
        assert!(std::mem::size_of::<Option<CancelTarget>>() <= 32);
    }
}
