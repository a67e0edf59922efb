//! The client transport seam: TCP or Unix socket today, TLS or io_uring later, behind the few
//! operations the session needs. Reads go into a caller-provided buffer only once the socket
//! is readable, so an idle client holds no buffer at all.

use std::io;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};

pub enum ClientStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl ClientStream {
    /// Waits until a read would not block (data, EOF or error), holding no buffer meanwhile.
    pub async fn readable(&self) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.readable().await,
            ClientStream::Unix(s) => s.readable().await,
        }
    }

    /// Reads what is available into `buf`; `Ok(0)` is end of stream, `WouldBlock` a spurious
    /// wake-up.
    pub fn try_read_buf(&self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => s.try_read_buf(buf),
            ClientStream::Unix(s) => s.try_read_buf(buf),
        }
    }

    /// Reads at least one byte (or EOF) into `buf`, waiting as needed.
    pub async fn read_buf(&self, buf: &mut BytesMut) -> io::Result<usize> {
        loop {
            self.readable().await?;
            match self.try_read_buf(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.write_all(data).await,
            ClientStream::Unix(s) => s.write_all(data).await,
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

impl ClientStream {
    pub async fn writable(&self) -> io::Result<()> {
        match self {
            ClientStream::Tcp(s) => s.writable().await,
            ClientStream::Unix(s) => s.writable().await,
        }
    }

    pub fn try_write(&self, data: &[u8]) -> io::Result<usize> {
        match self {
            ClientStream::Tcp(s) => s.try_write(data),
            ClientStream::Unix(s) => s.try_write(data),
        }
    }
}
