//! The link's streams over an in-memory connection.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc::UnboundedReceiver;

use super::frame::{self, Kind};
use super::mux::WINDOW;
use super::*;

fn status(v: u64) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    std::sync::Arc::new(std::sync::atomic::AtomicU64::new(v))
}

/// Two ends of a link, driven; the acceptor's incoming streams and cancels.
fn pair() -> (Link, Link, UnboundedReceiver<Incoming>) {
    let (a, b) = tokio::io::duplex(64 * 1024);
    let (conn, _) = Link::new("acceptor".into(), Side::Connector, Default::default());
    let (acc, incoming) = Link::new("connector".into(), Side::Acceptor, status(77));
    tokio::spawn(drive(a, conn.clone()));
    tokio::spawn(drive(b, acc.clone()));
    (conn, acc, incoming)
}

async fn next_stream(rx: &mut UnboundedReceiver<Incoming>) -> (LinkStream, bytes::Bytes) {
    match rx.recv().await.expect("a stream") {
        Incoming::Stream(s, what) => (s, what),
        Incoming::Cancel(..) => panic!("a cancel, not a stream"),
    }
}

#[tokio::test]
async fn streams_carry_bytes_both_ways_apart() {
    let (conn, _acc, mut incoming) = pair();
    let mut s1 = conn.open(b"first").unwrap();
    let mut s2 = conn.open(b"second").unwrap();
    let (mut r1, w1) = next_stream(&mut incoming).await;
    let (mut r2, w2) = next_stream(&mut incoming).await;
    assert_eq!((&w1[..], &w2[..]), (&b"first"[..], &b"second"[..]));
    s2.write_all(b"to two").await.unwrap();
    s1.write_all(b"to one").await.unwrap();
    let mut b = [0u8; 6];
    r1.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"to one");
    r2.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"to two");
    r1.write_all(b"back").await.unwrap();
    let mut b = [0u8; 4];
    s1.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"back");
}

#[tokio::test]
async fn a_reader_that_stops_stalls_only_its_own_stream() {
    let (conn, _acc, mut incoming) = pair();
    let mut slow = conn.open(b"slow").unwrap();
    let mut other = conn.open(b"other").unwrap();
    let (mut slow_r, _) = next_stream(&mut incoming).await;
    let (mut other_r, _) = next_stream(&mut incoming).await;
    let data: Vec<u8> = (0..WINDOW * 4).map(|i| (i % 251) as u8).collect();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        slow.write_all(&sent).await.unwrap();
        slow
    });
    // The writer fills the window and waits; the other stream is not held up behind it.
    tokio::task::yield_now().await;
    other.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    other_r.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    assert!(!writer.is_finished(), "a write past the window must wait");
    let mut got = vec![0u8; data.len()];
    slow_r.read_exact(&mut got).await.unwrap();
    assert_eq!(got, data);
    writer.await.unwrap();
}

#[tokio::test]
async fn a_closed_stream_reads_as_ended_and_refuses_writes() {
    let (conn, _acc, mut incoming) = pair();
    let mut s = conn.open(b"x").unwrap();
    let (mut r, _) = next_stream(&mut incoming).await;
    s.write_all(b"last words").await.unwrap();
    drop(s);
    let mut got = Vec::new();
    r.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"last words");
    assert!(r.write_all(b"anyone?").await.is_err());
    assert_eq!(conn.streams(), 0);
}

#[tokio::test]
async fn a_killed_link_fails_every_stream() {
    let (conn, acc, mut incoming) = pair();
    let mut s = conn.open(b"x").unwrap();
    let (mut r, _) = next_stream(&mut incoming).await;
    acc.kill("test");
    let mut b = [0u8; 1];
    let e = r.read(&mut b).await.unwrap_err();
    assert!(e.to_string().contains("test"), "{e}");
    // The connector's end sees the connection go.
    let e = s.read(&mut b).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionAborted);
    assert!(conn.open(b"y").is_err());
}

#[tokio::test]
async fn cancels_and_probes_reach_the_peer() {
    let (conn, _acc, mut incoming) = pair();
    conn.cancel(1234, -5).unwrap();
    match incoming.recv().await.unwrap() {
        Incoming::Cancel(pid, key) => assert_eq!((pid, key), (1234, -5)),
        Incoming::Stream(..) => panic!("a stream, not a cancel"),
    }
    conn.ping();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while conn.rtt().is_zero() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(!conn.rtt().is_zero(), "the probe was answered");
    assert_eq!(
        conn.peer_status().map(|(v, _)| v),
        Some(77),
        "with the peer's status"
    );
    assert!(conn.silent_for() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_peer_overrunning_a_window_loses_the_link() {
    let (mut raw, b) = tokio::io::duplex(1024 * 1024);
    let (acc, mut incoming) = Link::new("connector".into(), Side::Acceptor, status(0));
    let driver = tokio::spawn(drive(b, acc));
    let mut out = BytesMut::new();
    frame::put_frame(&mut out, Kind::Open, 1, b"x");
    let chunk = vec![0u8; frame::MAX_PAYLOAD];
    for _ in 0..(WINDOW / frame::MAX_PAYLOAD + 1) {
        frame::put_frame(&mut out, Kind::Data, 1, &chunk);
    }
    raw.write_all(&out).await.unwrap();
    let why = driver.await.unwrap();
    assert!(why.contains("window"), "{why}");
    let (_s, _) = next_stream(&mut incoming).await;
}

#[tokio::test]
async fn a_peer_may_not_open_streams_numbered_as_ours() {
    let (mut raw, b) = tokio::io::duplex(1024);
    let (acc, _incoming) = Link::new("connector".into(), Side::Acceptor, status(0));
    let driver = tokio::spawn(drive(b, acc));
    let mut out = BytesMut::new();
    frame::put_frame(&mut out, Kind::Open, 2, b"x");
    raw.write_all(&out).await.unwrap();
    let why = driver.await.unwrap();
    assert!(why.contains("may not"), "{why}");
}

#[tokio::test]
async fn state_snapshots_arrive_whole_and_replace_each_other() {
    let (conn, _acc, mut incoming) = pair();
    let s = conn.open(b"x").unwrap();
    let (r, _) = next_stream(&mut incoming).await;
    // Larger than one frame: sent in pieces.
    let big: Vec<u8> = (0..200_000).map(|i| (i % 253) as u8).collect();
    r.send_state(&big).unwrap();
    r.send_state(b"newer").unwrap();
    // A data byte after them proves they arrived (frames keep their order).
    let mut r = r;
    r.write_all(b"!").await.unwrap();
    let mut s = s;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(s.state().as_deref(), Some(&b"newer"[..]));
    r.send_state(&big).unwrap();
    r.write_all(b"!").await.unwrap();
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(s.state().as_deref(), Some(&big[..]));
    r.send_state(b"").unwrap();
    r.write_all(b"!").await.unwrap();
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(s.state().as_deref(), Some(&b""[..]));
}

#[tokio::test]
async fn a_silent_peer_is_blamed_only_while_this_side_runs() {
    // A peer that reads nothing and answers nothing.
    let (_raw, b) = tokio::io::duplex(1024 * 1024);
    let (link, _incoming) = Link::new("mute".into(), Side::Connector, status(0));
    let driver = tokio::spawn(drive(b, link.clone()));
    link.ping();
    tokio::time::sleep(Duration::from_millis(60)).await;
    link.ping();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(
        link.silent_for() >= Duration::from_millis(60),
        "our driver ran its turns and nothing came back"
    );
    driver.abort();

    // This side's driver never runs (a starved thread): the silence is not the peer's.
    let (link, _incoming) = Link::new("mute".into(), Side::Connector, status(0));
    link.ping();
    tokio::time::sleep(Duration::from_millis(60)).await;
    link.ping();
    assert!(link.silent_for() < Duration::from_millis(30));
    tokio::time::sleep(Duration::from_millis(60)).await;
    link.ping();
    assert!(link.silent_for() < Duration::from_millis(30));
}

#[tokio::test]
async fn a_link_is_quiet_until_the_peer_sends_something() {
    let (conn, acc, _incoming) = pair();
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        acc.quiet_for() >= Duration::from_millis(30),
        "nothing came yet"
    );
    conn.ping();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while conn.rtt().is_zero() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        acc.quiet_for() < Duration::from_millis(30),
        "the peer's probe was heard"
    );
    assert_eq!((conn.side(), acc.side()), (Side::Connector, Side::Acceptor));
}
