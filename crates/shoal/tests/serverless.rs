//! The serverless front door: Neon's serverless driver, unmodified (from npm, run by Node),
//! over WebSocket into the same pools as TCP clients; and what it does with bad input.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::*;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

fn serverless_shoal(db: &str, extra: &str) -> (Shoal, std::net::SocketAddr) {
    let shoal = Shoal::start(&base_config(
        pg(),
        &[db],
        &format!(
            "[pool]\npool_size = 4\nquery_wait_timeout = 10\n[serverless]\nlisten = \"127.0.0.1:0\"\n{extra}"
        ),
    ));
    let ws = shoal
        .ready_addr("serverless")
        .expect("the serverless listener");
    (shoal, ws)
}

/// Runs the driver's suite (`tests/clients/serverless/neon.mjs`) against a fresh database;
/// `pipeline` is the driver's `pipelineConnect` ("password", its default, or "false").
fn driver_suite(extra: &str, pipeline: &str) {
    let db = unique_db("neon");
    pg().create_database(&db);
    let (shoal, ws) = serverless_shoal(&db, extra);
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/serverless"
    );
    // The host and port in the connection string are the driver's to pass to wsProxy;
    // the WebSocket goes to Shoal's front door.
    let dsn = format!(
        "postgresql://app:{APP_PASSWORD}@127.0.0.1:{}/{db}",
        shoal.port()
    );
    let out = std::process::Command::new("node")
        .current_dir(dir)
        .args(["neon.mjs", &ws.to_string(), &dsn, "20"])
        .env("NEON_PIPELINE", pipeline)
        .output()
        .expect("node runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the driver's suite failed:\n{text}");
    assert!(
        text.contains(&format!("(pipelineConnect {pipeline}): 20 workers ok")),
        "{text}"
    );
    // Twenty WebSocket clients shared the pool's four servers.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while pg().backends(&db) > 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "more servers than the pool's 4"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The driver's defaults: startup, password (asked for in cleartext) and first query sent
/// at once.
#[test]
fn neons_driver_with_pipelined_connect() {
    driver_suite("", "password");
}

/// With `cleartext_password = false` the password goes by SCRAM, the driver waiting for
/// the server's challenge.
#[test]
fn neons_driver_with_scram() {
    driver_suite("cleartext_password = false\n", "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_answer() {
    let db = unique_db("neon");
    pg().create_database(&db);
    let (_shoal, ws) = serverless_shoal(&db, "");
    // A plain HTTP request is refused, not served.
    let mut tcp = tokio::net::TcpStream::connect(ws).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut reply = vec![0u8; 256];
    let n = tcp.read(&mut reply).await.unwrap();
    let status = String::from_utf8_lossy(&reply[..n]).to_string();
    assert!(
        status.starts_with("HTTP/1.1 4"),
        "a request that is no WebSocket upgrade: {status}"
    );
    // A startup of an unknown protocol version gets PostgreSQL's own answer, then a close.
    let (mut socket, _) = tokio_tungstenite::connect_async(format!("ws://{ws}/v2"))
        .await
        .unwrap();
    socket
        .send(Message::binary(&b"\x00\x00\x00\x08\x12\x34\x56\x78"[..]))
        .await
        .unwrap();
    let mut got = Vec::new();
    while let Some(Ok(m)) = tokio::time::timeout(Duration::from_secs(10), socket.next())
        .await
        .expect("an answer")
    {
        match m {
            Message::Binary(b) => got.extend_from_slice(&b),
            Message::Close(_) => break,
            _ => {}
        }
    }
    assert_eq!(got.first(), Some(&b'E'), "an ErrorResponse: {got:?}");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("0A000") && text.contains("unsupported frontend protocol"),
        "feature_not_supported: {text}"
    );
}
