//! A scripted PostgreSQL: speaks enough of the protocol for Shoal to log in, prepare and
//! clean servers, and answers a few special queries in ways a real server cannot be made to
//! on demand (a reply of any size written as fast as the stream takes it, a reply split over
//! writes, a FATAL on cue, rows until cancelled). Relay and pool behaviour is then tested
//! exactly and quickly, over TCP or over in-process pipes ([`FakePg::dialer`]).
//!
//! Queries: `big:N` returns one row of N bytes; `split:X` returns `X` in two writes; `fatal`
//! ends the connection with `57P01`; `rows:N` streams rows of 1 KiB until N are sent or a
//! cancel arrives (then `57014`); `copyout:N` is a `COPY TO STDOUT` of N lines; `COPY ...
//! FROM STDIN` takes data until CopyDone (`COPY <lines>`) or CopyFail; `SELECT 'x'` returns
//! `x`; `BEGIN`/`COMMIT`/`ROLLBACK` change the transaction status; anything else completes
//! with its first word as the tag. CancelRequests arrive on the TCP listener.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{BufMut, BytesMut};
use shoal_wire::backend::{self, put_message, Severity};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// What every connection of one fake shares.
#[derive(Default)]
pub struct Shared {
    /// Bytes of `big:` rows written to Shoal so far.
    pub big_written: AtomicU64,
    /// Connections accepted so far (cancel connections not counted).
    pub connections: AtomicU64,
    /// Connections open now.
    pub open: AtomicU64,
    /// Cancel requests received, and the flags of the backends they reach.
    pub cancels: AtomicU64,
    backends: Mutex<HashMap<i32, Arc<AtomicBool>>>,
    next_pid: AtomicI32,
    /// Every simple query received, in the order the fake received them.
    pub queries: Mutex<Vec<String>>,
}

pub struct FakePg {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
}

impl FakePg {
    pub async fn start() -> FakePg {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            next_pid: AtomicI32::new(1000),
            ..Shared::default()
        });
        let sh = shared.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                // As PostgreSQL: no Nagle delay on a reply's last small write.
                let _ = s.set_nodelay(true);
                let sh = sh.clone();
                tokio::spawn(async move {
                    let _ = serve(s, sh).await;
                });
            }
        });
        FakePg { addr, shared }
    }

    /// Reaches this fake through in-process pipes of `buffer` bytes each way instead of TCP
    /// (cancel requests still come over TCP).
    pub fn dialer(&self, buffer: usize) -> Arc<dyn shoal::server::Dial> {
        Arc::new(Dialer {
            shared: self.shared.clone(),
            addr: self.addr,
            buffer,
        })
    }
}

struct Dialer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    buffer: usize,
}

impl shoal::server::Dial for Dialer {
    fn dial<'a>(&'a self, _: &'a shoal::server::Upstream) -> shoal::server::DialFuture<'a> {
        Box::pin(async move {
            let (ours, theirs) = tokio::io::duplex(self.buffer);
            let sh = self.shared.clone();
            tokio::spawn(async move {
                let _ = serve(theirs, sh).await;
            });
            Ok(shoal::net::Stream::Buffered(Box::new(ours)))
        })
    }

    fn cancel_addr(&self, _: &shoal::server::Upstream) -> Option<SocketAddr> {
        Some(self.addr)
    }
}

async fn read_exact_vec<S: AsyncRead + Unpin>(s: &mut S, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).await?;
    Ok(v)
}

/// Counts an open connection for as long as it is served.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    shared: Arc<Shared>,
) -> std::io::Result<()> {
    // Startup, after an SSLRequest declined; or a CancelRequest.
    loop {
        let len = u32::from_be_bytes(read_exact_vec(&mut s, 4).await?.try_into().unwrap());
        let body = read_exact_vec(&mut s, len as usize - 4).await?;
        if body[..4] == [0x04, 0xd2, 0x16, 0x2f] {
            s.write_all(b"N").await?;
            continue;
        }
        if body[..4] == [0x04, 0xd2, 0x16, 0x2e] {
            let pid = i32::from_be_bytes(body[4..8].try_into().unwrap());
            shared.cancels.fetch_add(1, Ordering::Relaxed);
            let flag = shared.backends.lock().unwrap().get(&pid).cloned();
            if let Some(f) = flag {
                f.store(true, Ordering::SeqCst);
            }
            return Ok(());
        }
        break;
    }
    shared.connections.fetch_add(1, Ordering::Relaxed);
    shared.open.fetch_add(1, Ordering::Relaxed);
    let _open = Open(shared.clone());
    let pid = shared.next_pid.fetch_add(1, Ordering::Relaxed);
    let cancelled = Arc::new(AtomicBool::new(false));
    shared
        .backends
        .lock()
        .unwrap()
        .insert(pid, cancelled.clone());
    let r = session(&mut s, &shared, pid, &cancelled).await;
    shared.backends.lock().unwrap().remove(&pid);
    r
}

async fn session<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    shared: &Shared,
    pid: i32,
    cancelled: &AtomicBool,
) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    backend::authentication_ok(&mut out);
    for (k, v) in [
        ("server_version", "15.0 (fake)"),
        ("server_encoding", "UTF8"),
        ("client_encoding", "UTF8"),
        ("DateStyle", "ISO, MDY"),
        ("integer_datetimes", "on"),
        ("standard_conforming_strings", "on"),
        ("TimeZone", "UTC"),
        ("is_superuser", "off"),
        ("application_name", ""),
    ] {
        backend::parameter_status(&mut out, k, v);
    }
    backend::backend_key_data(&mut out, pid, 99);
    backend::ready_for_query(&mut out, b'I');
    s.write_all(&out).await?;
    let mut status = b'I';
    // A COPY FROM STDIN in progress: bytes and lines received.
    let mut copy_in: Option<(u64, u64)> = None;
    loop {
        let head = read_exact_vec(s, 5).await?;
        let tag = head[0];
        let len = u32::from_be_bytes(head[1..5].try_into().unwrap()) as usize;
        let body = read_exact_vec(s, len - 4).await?;
        let mut out = BytesMut::new();
        if let Some((bytes, lines)) = copy_in.as_mut() {
            match tag {
                b'd' => {
                    *bytes += body.len() as u64;
                    *lines += body.iter().filter(|&&b| b == b'\n').count() as u64;
                    continue;
                }
                b'c' => {
                    complete(&mut out, &format!("COPY {lines}"));
                    backend::ready_for_query(&mut out, status);
                }
                b'f' => {
                    backend::error_response(
                        &mut out,
                        Severity::Error,
                        "57014",
                        "COPY from stdin failed",
                        None,
                    );
                    backend::ready_for_query(&mut out, status);
                }
                _ => continue,
            }
            copy_in = None;
            s.write_all(&out).await?;
            continue;
        }
        match tag {
            b'X' => return Ok(()),
            b'Q' => {
                let text = String::from_utf8_lossy(&body[..body.len() - 1]).to_string();
                shared
                    .queries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(text.clone());
                if script(s, shared, &text, status, cancelled).await? {
                    continue;
                }
                if text.to_ascii_uppercase().starts_with("COPY") && text.contains("FROM STDIN") {
                    put_message(&mut out, b'G', |b| {
                        b.put_u8(0);
                        b.put_u16(1);
                        b.put_u16(0);
                    });
                    copy_in = Some((0, 0));
                    s.write_all(&out).await?;
                    continue;
                }
                for stmt in text.split(';').map(str::trim).filter(|t| !t.is_empty()) {
                    answer_statement(&mut out, stmt, &mut status);
                }
                backend::ready_for_query(&mut out, status);
            }
            b'P' => put_message(&mut out, b'1', |_| {}),
            b'B' => put_message(&mut out, b'2', |_| {}),
            b'D' => {
                if body.first() == Some(&b'S') {
                    put_message(&mut out, b't', |b| b.put_u16(0));
                }
                put_message(&mut out, b'n', |_| {});
            }
            b'E' => complete(&mut out, "SELECT 0"),
            b'C' => put_message(&mut out, b'3', |_| {}),
            b'S' => backend::ready_for_query(&mut out, status),
            _ => {}
        }
        if !out.is_empty() {
            s.write_all(&out).await?;
        }
    }
}

/// Answers the special queries (see the module doc); false for anything else.
async fn script<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    shared: &Shared,
    text: &str,
    status: u8,
    cancelled: &AtomicBool,
) -> std::io::Result<bool> {
    let mut out = BytesMut::new();
    if let Some(n) = text.strip_prefix("big:") {
        let n: usize = n.trim().parse().unwrap();
        row_description(&mut out);
        out.put_u8(b'D');
        out.put_u32((4 + 2 + 4 + n) as u32);
        out.put_u16(1);
        out.put_u32(n as u32);
        s.write_all(&out).await?;
        let chunk = vec![b'x'; 64 * 1024];
        let mut left = n;
        while left > 0 {
            let k = left.min(chunk.len());
            s.write_all(&chunk[..k]).await?;
            shared.big_written.fetch_add(k as u64, Ordering::Relaxed);
            left -= k;
        }
        out.clear();
    } else if text == "fatal" {
        backend::error_response(
            &mut out,
            Severity::Fatal,
            "57P01",
            "terminating connection due to administrator command",
            None,
        );
        s.write_all(&out).await?;
        // As PostgreSQL's own exit: the error, then the end of the stream (read to its end,
        // so unread requests do not turn the close into a reset).
        s.shutdown().await?;
        let mut sink = [0u8; 4096];
        while s.read(&mut sink).await.unwrap_or(0) > 0 {}
        return Err(std::io::ErrorKind::ConnectionAborted.into());
    } else if let Some(x) = text.strip_prefix("split:") {
        row_description(&mut out);
        data_row(&mut out, x);
        s.write_all(&out).await?;
        s.flush().await?;
        tokio::task::yield_now().await;
        out.clear();
    } else if let Some(n) = text.strip_prefix("rows:") {
        let n: u64 = n.trim().parse().unwrap();
        cancelled.store(false, Ordering::SeqCst);
        row_description(&mut out);
        s.write_all(&out).await?;
        let row = "r".repeat(1024);
        let mut sent = 0;
        while sent < n && !cancelled.load(Ordering::SeqCst) {
            out.clear();
            data_row(&mut out, &row);
            s.write_all(&out).await?;
            sent += 1;
            if sent % 64 == 0 {
                tokio::task::yield_now().await;
            }
        }
        out.clear();
        if cancelled.swap(false, Ordering::SeqCst) {
            backend::error_response(
                &mut out,
                Severity::Error,
                "57014",
                "canceling statement due to user request",
                None,
            );
            backend::ready_for_query(&mut out, status);
            s.write_all(&out).await?;
            return Ok(true);
        }
    } else if let Some(n) = text.strip_prefix("copyout:") {
        let n: u64 = n.trim().parse().unwrap();
        put_message(&mut out, b'H', |b| {
            b.put_u8(0);
            b.put_u16(1);
            b.put_u16(0);
        });
        for i in 0..n {
            put_message(&mut out, b'd', |b| {
                b.put_slice(format!("line {i}\n").as_bytes())
            });
        }
        put_message(&mut out, b'c', |_| {});
        complete(&mut out, &format!("COPY {n}"));
        backend::ready_for_query(&mut out, status);
        s.write_all(&out).await?;
        return Ok(true);
    } else {
        return Ok(false);
    }
    complete(&mut out, "SELECT 1");
    backend::ready_for_query(&mut out, status);
    s.write_all(&out).await?;
    Ok(true)
}

fn answer_statement(out: &mut BytesMut, stmt: &str, status: &mut u8) {
    let upper = stmt.to_ascii_uppercase();
    if let Some(v) = stmt
        .strip_prefix("SELECT '")
        .and_then(|v| v.strip_suffix('\''))
    {
        row_description(out);
        data_row(out, v);
        complete(out, "SELECT 1");
    } else if upper.starts_with("BEGIN") {
        *status = b'T';
        complete(out, "BEGIN");
    } else if upper.starts_with("COMMIT") || upper.starts_with("ROLLBACK") {
        *status = b'I';
        complete(
            out,
            if upper.starts_with("COMMIT") {
                "COMMIT"
            } else {
                "ROLLBACK"
            },
        );
    } else if upper.starts_with("DISCARD") {
        complete(out, "DISCARD ALL");
    } else {
        let word = upper.split_whitespace().next().unwrap_or("SELECT");
        let tag = if word == "SELECT" {
            "SELECT 0".to_string()
        } else {
            word.to_string()
        };
        complete(out, &tag);
    }
}

fn row_description(out: &mut BytesMut) {
    put_message(out, b'T', |b| {
        b.put_u16(1);
        backend::put_cstr(b, "v");
        b.put_u32(0);
        b.put_u16(0);
        b.put_u32(25);
        b.put_i16(-1);
        b.put_i32(-1);
        b.put_u16(0);
    });
}

fn data_row(out: &mut BytesMut, v: &str) {
    put_message(out, b'D', |b| {
        b.put_u16(1);
        b.put_u32(v.len() as u32);
        b.put_slice(v.as_bytes());
    });
}

fn complete(out: &mut BytesMut, tag: &str) {
    put_message(out, b'C', |b| backend::put_cstr(b, tag));
}
