//! The client transport seam: TCP or Unix sockets, TLS, and any other byte stream (an
//! in-process `tokio::io::duplex` in tests), behind the few operations the session needs.
//!
//! Reads go through `poll_read`, which lets tokio forget a socket's readiness when a read
//! returns less than the buffer could take: the next wait then costs no extra `read` that
//! would only say "would block". An idle client on a socket holds no buffer: the session
//! waits for readiness alone ([`ClientStream::poll_read_ready`]) and takes a buffer only when
//! bytes are there ([`ClientStream::read_now`]). A stream that buffers by itself (TLS
//! records, a duplex pipe; [`ClientStream::is_buffered`]) cannot say "readable" without
//! reading, so for it the idle wait reads.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Any byte stream a client can arrive on.
pub trait ClientIo: AsyncRead + AsyncWrite + Send + Sync + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Sync + Unpin> ClientIo for T {}

pub enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A stream that owns its buffering (no readiness to wait on).
    Buffered(Box<dyn ClientIo>),
    /// TLS over TCP (buffered too).
    Tls(Box<crate::tls::ClientTlsStream>),
    /// Only while the transport is being replaced (the TLS handshake).
    Upgrading,
}

fn upgrading() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "client transport is being upgraded",
    )
}

/// Reads what is available into `buf`'s spare capacity (`Ready(Ok(0))` is end of stream).
pub fn poll_read_buf<S: AsyncRead + Unpin>(
    s: &mut S,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    tokio_util::io::poll_read_buf(Pin::new(s), cx, buf)
}

/// A write through TLS. rustls takes the plaintext and makes records at once, then writes
/// them as far as the socket takes them: when it reports the plaintext taken, records may
/// still wait inside it (the socket was full). A flush still pending leaves the waker
/// registered for the socket; the caller sees the records through `wants_flush` and must
/// flush them before it counts its bytes as sent (nothing else would: no write may follow).
pub fn poll_write_tls<S: AsyncWrite + Unpin>(
    s: &mut S,
    cx: &mut Context<'_>,
    data: &[u8],
) -> Poll<io::Result<usize>> {
    match Pin::new(&mut *s).poll_write(cx, data) {
        Poll::Ready(Ok(n)) => {
            if let Poll::Ready(Err(e)) = Pin::new(&mut *s).poll_flush(cx) {
                return Poll::Ready(Err(e));
            }
            Poll::Ready(Ok(n))
        }
        other => other,
    }
}

impl ClientStream {
    /// Readiness without a waiter node in the caller's future: the socket keeps the waker. A
    /// buffered stream is always "ready" (only a read can tell).
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            ClientStream::Tcp(s) => s.poll_read_ready(cx),
            ClientStream::Unix(s) => s.poll_read_ready(cx),
            ClientStream::Buffered(_) | ClientStream::Tls(_) | ClientStream::Upgrading => {
                Poll::Ready(Ok(()))
            }
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }

    /// A stream that buffers by itself: the idle wait must read (see the module doc).
    pub fn is_buffered(&self) -> bool {
        matches!(self, ClientStream::Buffered(_) | ClientStream::Tls(_))
    }

    /// One read that does not wait: `Ok(None)` if nothing was there (stale readiness).
    pub fn read_now(&mut self, buf: &mut BytesMut) -> io::Result<Option<usize>> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match self.poll_read_buf(&mut cx, buf) {
            Poll::Ready(r) => r.map(Some),
            Poll::Pending => Ok(None),
        }
    }

    pub fn poll_read_buf(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        match self {
            ClientStream::Tcp(s) => poll_read_buf(s, cx, buf),
            ClientStream::Unix(s) => poll_read_buf(s, cx, buf),
            ClientStream::Buffered(s) => poll_read_buf(s, cx, buf),
            ClientStream::Tls(s) => poll_read_buf(s, cx, buf),
            ClientStream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    pub fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            ClientStream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Unix(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Buffered(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Tls(s) => poll_write_tls(&mut **s, cx, data),
            ClientStream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    /// TLS records made but not yet on the socket: see [`poll_write_tls`].
    pub fn wants_flush(&self) -> bool {
        match self {
            ClientStream::Tls(s) => s.get_ref().1.wants_write(),
            _ => false,
        }
    }

    /// Pushes out what [`ClientStream::wants_flush`] reports.
    pub fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            ClientStream::Tcp(_) | ClientStream::Unix(_) => Poll::Ready(Ok(())),
            ClientStream::Buffered(s) => Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
            ClientStream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    /// Reads at least one byte (or EOF) into `buf`, waiting as needed.
    pub async fn read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        if buf.capacity() - buf.len() < 512 {
            buf.reserve(4096);
        }
        std::future::poll_fn(|cx| self.poll_read_buf(cx, buf)).await
    }

    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.write_all(data).await,
            ClientStream::Unix(s) => s.write_all(data).await,
            ClientStream::Buffered(s) => {
                s.write_all(data).await?;
                s.flush().await
            }
            ClientStream::Tls(s) => {
                s.write_all(data).await?;
                s.flush().await
            }
            ClientStream::Upgrading => Err(upgrading()),
        }
    }

    /// The socket's descriptor, for [`ClientFds`].
    pub fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match self {
            ClientStream::Tcp(s) => Some(s.as_raw_fd()),
            ClientStream::Unix(s) => Some(s.as_raw_fd()),
            ClientStream::Tls(s) => Some(s.get_ref().0.inner.as_raw_fd()),
            ClientStream::Buffered(_) | ClientStream::Upgrading => None,
        }
    }

    /// The client's address (none for Unix sockets).
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            ClientStream::Tcp(s) => s.peer_addr().ok(),
            ClientStream::Tls(s) => s.get_ref().0.inner.peer_addr().ok(),
            _ => None,
        }
    }

    /// How logs name the client (its address asked of the socket).
    pub fn peer(&self) -> String {
        self.describe_peer(self.peer_addr())
    }

    /// How logs name the client whose address is already known (from `accept`).
    pub fn describe_peer(&self, addr: Option<std::net::SocketAddr>) -> String {
        match (self, addr) {
            (ClientStream::Tcp(_), Some(a)) => a.to_string(),
            (ClientStream::Tcp(_), None) => "?".into(),
            (ClientStream::Tls(_), Some(a)) => format!("{a} (TLS)"),
            (ClientStream::Tls(_), None) => "? (TLS)".into(),
            (ClientStream::Unix(_), _) => "unix".into(),
            (ClientStream::Buffered(_), _) => "in-process".into(),
            (ClientStream::Upgrading, _) => "upgrading".into(),
        }
    }
}

/// The descriptors of logged-in clients' sockets, one bit each (an idle client must stay
/// cheap), so that shutdown can reach clients that wait idle without a timer or a waiter of
/// their own: it shuts their read side, their task wakes to end of stream and tells the client
/// why (`57P01`) before closing.
#[derive(Default)]
pub struct ClientFds {
    bits: std::sync::Mutex<Vec<u64>>,
}

impl ClientFds {
    pub fn insert(&self, fd: std::os::fd::RawFd) {
        let Ok(fd) = usize::try_from(fd) else { return };
        let mut bits = self.bits.lock().unwrap_or_else(|e| e.into_inner());
        if bits.len() <= fd / 64 {
            bits.resize(fd / 64 + 1, 0);
        }
        bits[fd / 64] |= 1 << (fd % 64);
    }

    /// Must be called before the socket is closed (so a reused number is never touched).
    pub fn remove(&self, fd: std::os::fd::RawFd) {
        let Ok(fd) = usize::try_from(fd) else { return };
        let mut bits = self.bits.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = bits.get_mut(fd / 64) {
            *w &= !(1 << (fd % 64));
        }
    }

    /// Shuts the read side of every registered client socket.
    pub fn shut_reads(&self) -> usize {
        let bits = self.bits.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for (i, w) in bits.iter().enumerate() {
            let mut w = *w;
            while w != 0 {
                let b = w.trailing_zeros() as usize;
                w &= w - 1;
                let fd = (i * 64 + b) as std::os::fd::RawFd;
                // SAFETY: the descriptor belongs to a live client socket: sessions remove
                // theirs (under this lock, which is held here) before their socket closes.
                #[allow(unsafe_code)]
                let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                let _ = socket2::SockRef::from(&borrowed).shutdown(std::net::Shutdown::Read);
                n += 1;
            }
        }
        n
    }
}
