//! The client transport seam: TCP or Unix socket today, TLS or io_uring later, behind the few
//! operations the session needs.
//!
//! Reads go through `poll_read`, which lets tokio forget a socket's readiness when a read
//! returns less than the buffer could take: the next wait then costs no extra `read` that
//! would only say "would block". An idle client holds no buffer: the session waits with
//! [`ClientStream::readable`] and takes a buffer only when bytes are there.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

pub enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// Reads what is available into `buf`'s spare capacity (`Ready(Ok(0))` is end of stream).
pub fn poll_read_buf<S: AsyncRead + Unpin>(
    s: &mut S,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    tokio_util::io::poll_read_buf(Pin::new(s), cx, buf)
}

impl ClientStream {
    /// Waits until a read would not block (data, EOF or error), holding no buffer meanwhile.
    pub async fn readable(&self) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.readable().await,
            ClientStream::Unix(s) => s.readable().await,
        }
    }

    /// Readiness without a waiter node in the caller's future: the socket keeps the waker.
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            ClientStream::Tcp(s) => s.poll_read_ready(cx),
            ClientStream::Unix(s) => s.poll_read_ready(cx),
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
        }
    }

    pub fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            ClientStream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Unix(s) => Pin::new(s).poll_write(cx, data),
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
        }
    }

    /// The socket's descriptor, for [`ClientFds`].
    pub fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        match self {
            ClientStream::Tcp(s) => Some(s.as_raw_fd()),
            ClientStream::Unix(s) => Some(s.as_raw_fd()),
        }
    }

    /// The client's IP address (none for Unix sockets).
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        match self {
            ClientStream::Tcp(s) => s.peer_addr().ok().map(|a| a.ip()),
            _ => None,
        }
    }

    pub fn peer(&self) -> String {
        match self {
            ClientStream::Tcp(s) => s
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "?".into()),
            ClientStream::Unix(_) => "unix".into(),
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
