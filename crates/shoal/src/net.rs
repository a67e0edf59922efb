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
    /// Taken away (the session is over).
    Closed,
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "client stream already closed")
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
            ClientStream::Closed => Err(closed()),
        }
    }

    /// Readiness without a waiter node in the caller's future: the socket keeps the waker.
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            ClientStream::Tcp(s) => s.poll_read_ready(cx),
            ClientStream::Unix(s) => s.poll_read_ready(cx),
            ClientStream::Closed => Poll::Ready(Err(closed())),
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
            ClientStream::Closed => Poll::Ready(Err(closed())),
        }
    }

    pub fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            ClientStream::Tcp(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Unix(s) => Pin::new(s).poll_write(cx, data),
            ClientStream::Closed => Poll::Ready(Err(closed())),
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
            ClientStream::Closed => Err(closed()),
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
            ClientStream::Closed => "closed".into(),
        }
    }
}
