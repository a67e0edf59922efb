//! A scripted PostgreSQL: speaks enough of the protocol for Shoal to log in, prepare and
//! clean servers, and answers a few special queries in ways a real server cannot be made to
//! on demand (a reply of any size written as fast as the socket takes it, a reply split over
//! writes, a FATAL on cue). Relay and pool behaviour is then tested exactly and quickly.
//!
//! Queries: `big:N` returns one row of N bytes; `split:X` returns `X` in two writes; `fatal`
//! ends the connection with `57P01`; `SELECT 'x'` returns `x`; `BEGIN`/`COMMIT`/`ROLLBACK`
//! change the transaction status; anything else completes with its first word as the tag.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use shoal_wire::backend::{self, put_message, Severity};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct FakePg {
    pub addr: SocketAddr,
    /// Bytes of `big:` rows written to Shoal so far.
    pub big_written: Arc<AtomicU64>,
    /// Connections accepted so far.
    pub connections: Arc<AtomicU64>,
}

impl FakePg {
    pub async fn start() -> FakePg {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let big_written = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let (big, conns) = (big_written.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                // As PostgreSQL: no Nagle delay on a reply's last small write.
                let _ = s.set_nodelay(true);
                conns.fetch_add(1, Ordering::Relaxed);
                let big = big.clone();
                tokio::spawn(async move {
                    let _ = serve(s, big).await;
                });
            }
        });
        FakePg {
            addr,
            big_written,
            connections,
        }
    }
}

async fn read_exact_vec(s: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v).await?;
    Ok(v)
}

async fn serve(mut s: TcpStream, big: Arc<AtomicU64>) -> std::io::Result<()> {
    // Startup, after an SSLRequest declined.
    loop {
        let len = u32::from_be_bytes(read_exact_vec(&mut s, 4).await?.try_into().unwrap());
        let body = read_exact_vec(&mut s, len as usize - 4).await?;
        if body[..4] == [0x04, 0xd2, 0x16, 0x2f] {
            s.write_all(b"N").await?;
            continue;
        }
        break;
    }
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
    backend::backend_key_data(&mut out, 4242, 99);
    backend::ready_for_query(&mut out, b'I');
    s.write_all(&out).await?;
    let mut status = b'I';
    loop {
        let head = read_exact_vec(&mut s, 5).await?;
        let tag = head[0];
        let len = u32::from_be_bytes(head[1..5].try_into().unwrap()) as usize;
        let body = read_exact_vec(&mut s, len - 4).await?;
        let mut out = BytesMut::new();
        match tag {
            b'X' => return Ok(()),
            b'Q' => {
                let text = String::from_utf8_lossy(&body[..body.len() - 1]).to_string();
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
                        big.fetch_add(k as u64, Ordering::Relaxed);
                        left -= k;
                    }
                    let mut out = BytesMut::new();
                    complete(&mut out, "SELECT 1");
                    backend::ready_for_query(&mut out, status);
                    s.write_all(&out).await?;
                    continue;
                }
                if text == "fatal" {
                    backend::error_response(
                        &mut out,
                        Severity::Fatal,
                        "57P01",
                        "terminating connection due to administrator command",
                        None,
                    );
                    s.write_all(&out).await?;
                    // As PostgreSQL's own exit: the error, then the end of the stream (read
                    // to its end, so unread requests do not turn the close into a reset).
                    s.shutdown().await?;
                    let mut sink = [0u8; 4096];
                    while s.read(&mut sink).await.unwrap_or(0) > 0 {}
                    return Ok(());
                }
                if let Some(x) = text.strip_prefix("split:") {
                    row_description(&mut out);
                    data_row(&mut out, x);
                    s.write_all(&out).await?;
                    s.flush().await?;
                    tokio::task::yield_now().await;
                    let mut out = BytesMut::new();
                    complete(&mut out, "SELECT 1");
                    backend::ready_for_query(&mut out, status);
                    s.write_all(&out).await?;
                    continue;
                }
                for stmt in text.split(';').map(str::trim).filter(|t| !t.is_empty()) {
                    let upper = stmt.to_ascii_uppercase();
                    if let Some(v) = stmt
                        .strip_prefix("SELECT '")
                        .and_then(|v| v.strip_suffix('\''))
                    {
                        row_description(&mut out);
                        data_row(&mut out, v);
                        complete(&mut out, "SELECT 1");
                    } else if upper.starts_with("BEGIN") {
                        status = b'T';
                        complete(&mut out, "BEGIN");
                    } else if upper.starts_with("COMMIT") || upper.starts_with("ROLLBACK") {
                        status = b'I';
                        complete(
                            &mut out,
                            if upper.starts_with("COMMIT") {
                                "COMMIT"
                            } else {
                                "ROLLBACK"
                            },
                        );
                    } else if upper.starts_with("DISCARD") {
                        complete(&mut out, "DISCARD ALL");
                    } else {
                        let word = upper.split_whitespace().next().unwrap_or("SELECT");
                        let tag = if word == "SELECT" {
                            "SELECT 0".to_string()
                        } else {
                            word.to_string()
                        };
                        complete(&mut out, &tag);
                    }
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
