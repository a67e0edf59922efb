//! The transport seam, one for both sides: a client's stream (TCP, Unix, TLS accepted by
//! Shoal) and a server's (TCP, TLS to PostgreSQL), or any other byte stream (an in-process
//! `tokio::io::duplex` in tests, a client relayed by another node over a node link), behind the few operations the
//! session and the relay need. One type means one copy of the TLS write and flush rules.
//!
//! Reads go through `poll_read`, which lets tokio forget a socket's readiness when a read
//! returns less than the buffer could take: the next wait then costs no extra `read` that
//! would only say "would block". An idle client on a socket holds no buffer: the session
//! waits for readiness alone ([`Stream::poll_read_ready`]) and takes a buffer only when
//! bytes are there ([`Stream::read_now`]). A stream that buffers by itself (TLS records, a
//! duplex pipe; [`Stream::is_buffered`]) cannot say "readable" without reading, so for it the
//! idle wait reads.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Any byte stream a peer can be reached over.
pub trait Io: AsyncRead + AsyncWrite + Send + Sync + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Sync + Unpin> Io for T {}

/// TLS that Shoal opened to a server.
pub type UpstreamTlsStream = tokio_rustls::client::TlsStream<TcpStream>;

pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A stream that owns its buffering (no readiness to wait on).
    Buffered(Box<dyn Io>),
    /// The serverless front door's WebSocket, as the bytes it carries (see
    /// `crate::serverless`): buffered as `Buffered`; its login may ask for a cleartext
    /// password. `true`: the WebSocket came over TLS.
    WebSocket(Box<dyn Io>, bool),
    /// One HTTP query of the serverless front door, as the protocol its handler speaks
    /// for it: buffered as `Buffered`; its login always asks for a cleartext password
    /// (the handler has it from the connection string). `true`: the request came over TLS.
    Http(Box<dyn Io>, bool),
    /// TLS a client started with Shoal (buffered too).
    Tls(Box<crate::tls::ClientTlsStream>),
    /// TLS Shoal started with a server (buffered too).
    TlsUpstream(Box<UpstreamTlsStream>),
    /// A client another node relays over a node link (its readiness is the link's inbox).
    Link(shoal_cluster::link::LinkStream),
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
fn poll_write_tls<S: AsyncWrite + Unpin>(
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

impl Stream {
    /// Readiness without a waiter node in the caller's future: the socket keeps the waker. A
    /// buffered stream is always "ready" (only a read can tell).
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(s) => s.poll_read_ready(cx),
            Stream::Unix(s) => s.poll_read_ready(cx),
            Stream::Link(s) => s.poll_read_ready(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_) | Stream::TlsUpstream(_))
    }

    /// Whether the client's bytes crossed the network encrypted: TLS with Shoal, or the
    /// serverless front door's `wss://` and `https://`.
    pub fn is_encrypted(&self) -> bool {
        matches!(
            self,
            Stream::Tls(_)
                | Stream::TlsUpstream(_)
                | Stream::WebSocket(_, true)
                | Stream::Http(_, true)
        )
    }

    /// A stream that buffers by itself: the idle wait must read (see the module doc).
    pub fn is_buffered(&self) -> bool {
        matches!(
            self,
            Stream::Buffered(_)
                | Stream::WebSocket(..)
                | Stream::Http(..)
                | Stream::Tls(_)
                | Stream::TlsUpstream(_)
        )
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
            Stream::Tcp(s) => poll_read_buf(s, cx, buf),
            Stream::Unix(s) => poll_read_buf(s, cx, buf),
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                poll_read_buf(s, cx, buf)
            }
            Stream::Tls(s) => poll_read_buf(s, cx, buf),
            Stream::TlsUpstream(s) => poll_read_buf(s, cx, buf),
            Stream::Link(s) => s.poll_read_buf(cx, buf),
            Stream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    pub fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, data),
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                Pin::new(s).poll_write(cx, data)
            }
            Stream::Tls(s) => poll_write_tls(&mut **s, cx, data),
            Stream::TlsUpstream(s) => poll_write_tls(&mut **s, cx, data),
            Stream::Link(s) => s.poll_write_data(cx, data),
            Stream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    /// TLS records made but not yet on the socket: see [`poll_write_tls`].
    pub fn wants_flush(&self) -> bool {
        match self {
            Stream::Tls(s) => s.get_ref().1.wants_write(),
            Stream::TlsUpstream(s) => s.get_ref().1.wants_write(),
            _ => false,
        }
    }

    /// Pushes out what [`Stream::wants_flush`] reports (and what a buffered stream holds).
    pub fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(_) | Stream::Unix(_) | Stream::Link(_) => Poll::Ready(Ok(())),
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                Pin::new(s).poll_flush(cx)
            }
            Stream::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
            Stream::TlsUpstream(s) => Pin::new(&mut **s).poll_flush(cx),
            Stream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    fn poll_shutdown_inner(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                Pin::new(s).poll_shutdown(cx)
            }
            Stream::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
            Stream::TlsUpstream(s) => Pin::new(&mut **s).poll_shutdown(cx),
            Stream::Link(s) => {
                s.close("");
                Poll::Ready(Ok(()))
            }
            Stream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }

    /// Reads at least one byte (or EOF) into `buf`, waiting as needed.
    pub async fn read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        if buf.capacity() - buf.len() < 512 {
            buf.reserve(4096);
        }
        std::future::poll_fn(|cx| self.poll_read_buf(cx, buf)).await
    }

    /// Writes all of `data` and flushes it: with TLS, what rustls still holds after the last
    /// write would otherwise wait until the next one, which may never come.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        AsyncWriteExt::write_all(self, data).await?;
        std::future::poll_fn(|cx| self.poll_flush(cx)).await
    }

    /// Whether the peer closed or sent something while nobody was reading (a server that
    /// sat idle in its pool): one read that does not wait, for buffered streams; the socket
    /// alone for the others. Whatever a read finds is lost, so only a stream about to be
    /// dropped when the answer is yes may be asked.
    pub fn peer_spoke(&mut self) -> bool {
        let mut probe = [0u8; 1];
        let tcp = match self {
            Stream::Tcp(s) => s,
            Stream::TlsUpstream(s) => s.get_ref().0,
            Stream::Tls(s) => &s.get_ref().0.inner,
            Stream::Unix(s) => {
                return !matches!(s.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
            }
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                let mut buf = tokio::io::ReadBuf::new(&mut probe);
                return Pin::new(&mut **s).poll_read(&mut cx, &mut buf).is_ready();
            }
            Stream::Link(s) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                return s.poll_read_ready(&mut cx).is_ready();
            }
            Stream::Upgrading => return true,
        };
        // Readiness alone decides whether to look (no read while the socket is not known
        // readable); a read that finds nothing clears stale readiness.
        !matches!(tcp.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// The socket's descriptor, for [`ClientFds`].
    pub fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match self {
            Stream::Tcp(s) => Some(s.as_raw_fd()),
            Stream::Unix(s) => Some(s.as_raw_fd()),
            Stream::Tls(s) => Some(s.get_ref().0.inner.as_raw_fd()),
            Stream::TlsUpstream(s) => Some(s.get_ref().0.as_raw_fd()),
            Stream::Buffered(_)
            | Stream::WebSocket(..)
            | Stream::Http(..)
            | Stream::Link(_)
            | Stream::Upgrading => None,
        }
    }

    /// The peer's address (none for Unix sockets and in-process streams).
    pub fn peer_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            Stream::Tcp(s) => s.peer_addr().ok(),
            Stream::Tls(s) => s.get_ref().0.inner.peer_addr().ok(),
            Stream::TlsUpstream(s) => s.get_ref().0.peer_addr().ok(),
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
            (Stream::Tcp(_), Some(a)) => a.to_string(),
            (Stream::Tcp(_), None) => "?".into(),
            (Stream::Tls(_) | Stream::TlsUpstream(_), Some(a)) => format!("{a} (TLS)"),
            (Stream::Tls(_) | Stream::TlsUpstream(_), None) => "? (TLS)".into(),
            (Stream::Unix(_), _) => "unix".into(),
            (Stream::Buffered(_), _) => "in-process".into(),
            (Stream::WebSocket(..), Some(a)) => format!("{a} (WebSocket)"),
            (Stream::WebSocket(..), None) => "? (WebSocket)".into(),
            (Stream::Http(..), Some(a)) => format!("{a} (HTTP)"),
            (Stream::Http(..), None) => "? (HTTP)".into(),
            (Stream::Link(s), Some(a)) => format!("{a} (relayed by {})", s.peer()),
            (Stream::Link(s), None) => format!("? (relayed by {})", s.peer()),
            (Stream::Upgrading, _) => "upgrading".into(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Buffered(s) | Stream::WebSocket(s, _) | Stream::Http(s, _) => {
                Pin::new(s).poll_read(cx, buf)
            }
            Stream::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
            Stream::TlsUpstream(s) => Pin::new(&mut **s).poll_read(cx, buf),
            Stream::Link(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Upgrading => Poll::Ready(Err(upgrading())),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Stream::poll_write(self.get_mut(), cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Stream::poll_flush(self.get_mut(), cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().poll_shutdown_inner(cx)
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
