//! A raw protocol client: exact bytes out, decoded messages back. For protocol cases that
//! client libraries hide (pipelining, Flush, bad input, negotiation).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use shoal_wire::backend::put_message;
use shoal_wire::{frontend, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Any byte stream a raw client can speak over (TCP, or an in-process pipe to a session).
pub trait RawIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> RawIo for T {}

pub struct Raw {
    pub stream: Box<dyn RawIo>,
    buf: BytesMut,
    pub params: Vec<(String, String)>,
    pub key: (i32, i32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    pub tag: char,
    pub body: Vec<u8>,
}

impl Msg {
    /// The `C` (SQLSTATE) field of an ErrorResponse/NoticeResponse.
    pub fn field(&self, f: u8) -> Option<String> {
        let mut rest = &self.body[..];
        while let Some((&t, tail)) = rest.split_first() {
            if t == 0 {
                break;
            }
            let end = tail.iter().position(|&b| b == 0)?;
            if t == f {
                return Some(String::from_utf8_lossy(&tail[..end]).into_owned());
            }
            rest = &tail[end + 1..];
        }
        None
    }

    pub fn code(&self) -> String {
        self.field(b'C').unwrap_or_default()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn cstr(b: &mut BytesMut, s: &str) {
    b.put_slice(s.as_bytes());
    b.put_u8(0);
}

pub fn parse(b: &mut BytesMut, name: &str, sql: &str) {
    put_message(b, b'P', |b| {
        cstr(b, name);
        cstr(b, sql);
        b.put_i16(0);
    });
}

/// Bind with text parameters and text results.
pub fn bind(b: &mut BytesMut, portal: &str, stmt: &str, params: &[&str]) {
    put_message(b, b'B', |b| {
        cstr(b, portal);
        cstr(b, stmt);
        b.put_i16(0);
        b.put_u16(params.len() as u16);
        for p in params {
            b.put_i32(p.len() as i32);
            b.put_slice(p.as_bytes());
        }
        b.put_i16(0);
    });
}

pub fn describe(b: &mut BytesMut, kind: u8, name: &str) {
    put_message(b, b'D', |b| {
        b.put_u8(kind);
        cstr(b, name);
    });
}

pub fn execute(b: &mut BytesMut, portal: &str) {
    put_message(b, b'E', |b| {
        cstr(b, portal);
        b.put_i32(0);
    });
}

pub fn close_statement(b: &mut BytesMut, name: &str) {
    put_message(b, b'C', |b| {
        b.put_u8(b'S');
        cstr(b, name);
    });
}

pub fn sync(b: &mut BytesMut) {
    put_message(b, b'S', |_| {});
}

pub fn flush(b: &mut BytesMut) {
    put_message(b, b'H', |_| {});
}

pub fn query(b: &mut BytesMut, sql: &str) {
    frontend::query(b, sql);
}

impl Raw {
    pub async fn connect(addr: SocketAddr) -> Raw {
        Raw::over(TcpStream::connect(addr).await.expect("connect"))
    }

    pub fn over(stream: impl RawIo + 'static) -> Raw {
        Raw {
            stream: Box::new(stream),
            buf: BytesMut::new(),
            params: Vec::new(),
            key: (0, 0),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    /// Sends a StartupMessage for `user`/`database` plus `extra` parameters.
    pub async fn startup(&mut self, user: &str, database: &str, extra: &[(&str, &str)]) {
        let mut params = vec![("user", user), ("database", database)];
        params.extend_from_slice(extra);
        let mut b = BytesMut::new();
        frontend::startup(&mut b, &params);
        self.send(&b).await;
    }

    /// Reads one message; `None` on EOF. Panics after 20 s (a hang is a failure).
    pub async fn recv(&mut self) -> Option<Msg> {
        loop {
            if let Some(f) = Frame::split(&mut self.buf, 1 << 30).expect("valid framing") {
                return Some(Msg {
                    tag: f.tag() as char,
                    body: f.body().to_vec(),
                });
            }
            let n =
                tokio::time::timeout(Duration::from_secs(20), self.stream.read_buf(&mut self.buf))
                    .await
                    .expect("no reply within 20 s")
                    .unwrap_or(0);
            if n == 0 {
                return None;
            }
        }
    }

    /// Reads a single byte (for SSLRequest answers).
    pub async fn recv_byte(&mut self) -> Option<u8> {
        let mut b = [0u8; 1];
        match tokio::time::timeout(Duration::from_secs(20), self.stream.read(&mut b)).await {
            Ok(Ok(1)) => Some(b[0]),
            _ => None,
        }
    }

    /// Reads messages up to and including the next ReadyForQuery.
    pub async fn until_ready(&mut self) -> Vec<Msg> {
        let mut out = Vec::new();
        loop {
            let m = self
                .recv()
                .await
                .expect("connection closed before ReadyForQuery");
            let done = m.tag == 'Z';
            out.push(m);
            if done {
                return out;
            }
        }
    }

    /// Completes a trust login, recording ParameterStatus and BackendKeyData.
    pub async fn login(addr: SocketAddr, user: &str, db: &str, extra: &[(&str, &str)]) -> Raw {
        Raw::login_over(Raw::connect(addr).await, user, db, extra).await
    }

    /// [`Raw::login`] over a stream already open.
    pub async fn login_over(mut r: Raw, user: &str, db: &str, extra: &[(&str, &str)]) -> Raw {
        r.startup(user, db, extra).await;
        for m in r.until_ready().await {
            match m.tag {
                'S' => {
                    let mut parts = m.body.split(|&b| b == 0);
                    let k = String::from_utf8_lossy(parts.next().unwrap()).into_owned();
                    let v = String::from_utf8_lossy(parts.next().unwrap()).into_owned();
                    r.params.push((k, v));
                }
                'K' => {
                    r.key = (
                        i32::from_be_bytes(m.body[0..4].try_into().unwrap()),
                        i32::from_be_bytes(m.body[4..8].try_into().unwrap()),
                    )
                }
                'E' => panic!("login failed: {}", m.text()),
                _ => {}
            }
        }
        r
    }

    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Runs a simple query and returns the text of the first column of each row, or the
    /// error message.
    pub async fn simple(&mut self, sql: &str) -> Result<Vec<String>, Msg> {
        let mut b = BytesMut::new();
        query(&mut b, sql);
        self.send(&b).await;
        let mut rows = Vec::new();
        let mut err = None;
        for m in self.until_ready().await {
            match m.tag {
                'D' => rows.push(first_column(&m)),
                'E' => err = Some(m),
                _ => {}
            }
        }
        err.map_or(Ok(rows), Err)
    }
}

/// The first column of a DataRow as text.
pub fn first_column(m: &Msg) -> String {
    let len = i32::from_be_bytes(m.body[2..6].try_into().unwrap());
    if len < 0 {
        return "NULL".into();
    }
    String::from_utf8_lossy(&m.body[6..6 + len as usize]).into_owned()
}
