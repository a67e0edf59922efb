//! Hostile or broken clients get a clear FATAL and a closed connection; others go on.

mod common;

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use common::raw::{self, Raw};
use common::*;

async fn expect_fatal(r: &mut Raw, code: &str, needle: &str) {
    let m = r.recv().await.expect("an ErrorResponse before the close");
    assert_eq!(m.tag, 'E', "got {m:?}");
    assert_eq!(m.field(b'S').as_deref(), Some("FATAL"));
    assert_eq!(m.code(), code, "{}", m.text());
    let msg = m.field(b'M').unwrap();
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
    assert!(
        r.recv().await.is_none(),
        "connection closed after the FATAL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_startup() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    r.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    expect_fatal(&mut r, "08P01", "invalid length of startup packet").await;
    // A length that is too small.
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 4]).await;
    expect_fatal(&mut r, "08P01", "invalid length").await;
    // A startup packet whose parameters are not terminated.
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 12, 0, 3, 0, 0, b'u', b's', b'e', b'r'])
        .await;
    expect_fatal(&mut r, "08P01", "startup packet").await;
    // A startup without a user.
    let mut r = Raw::connect(shoal.addr).await;
    let mut b = BytesMut::new();
    shoal_wire::frontend::startup(&mut b, &[("database", "x")]);
    r.send(&b).await;
    expect_fatal(&mut r, "08P01", "no PostgreSQL user name").await;
    // Shoal still serves.
    let mut ok = Raw::login(shoal.addr, "raw", &db, &[]).await;
    assert_eq!(ok.simple("SELECT 1").await.unwrap(), vec!["1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_malformed_and_unknown_messages() {
    let db = unique_db("bad");
    pg().create_database(&db);
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "max_packet_size = 65536");
    let shoal = Shoal::start(&config);
    let bystander = shoal.connect(&db).await;

    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    b.put_u8(b'Q');
    b.put_i32(100_000_000);
    r.send(&b).await;
    expect_fatal(&mut r, "54000", "exceeds the limit of 65536 bytes").await;

    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.send(&[b'Q', 0, 0, 0, 2]).await;
    expect_fatal(&mut r, "08P01", "invalid message length").await;

    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.send(&[b'!', 0, 0, 0, 4]).await;
    expect_fatal(&mut r, "08P01", "invalid frontend message type").await;

    // An unknown message in the middle of a transaction: the server is rolled back.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.simple("BEGIN").await.unwrap();
    r.send(&[b'~', 0, 0, 0, 4]).await;
    expect_fatal(&mut r, "08P01", "invalid frontend message type").await;

    // Malformed SCRAM exchange.
    let mut r = Raw::connect(shoal.addr).await;
    r.startup("app", &db, &[]).await;
    assert_eq!(r.recv().await.unwrap().tag, 'R');
    let mut b = BytesMut::new();
    shoal_wire::frontend::sasl_initial_response(&mut b, "SCRAM-SHA-256", b"garbage");
    r.send(&b).await;
    expect_fatal(&mut r, "08P01", "malformed SCRAM message").await;

    let v: i32 = bystander.query_one("SELECT 3", &[]).await.unwrap().get(0);
    assert_eq!(v, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_that_never_finishes_times_out() {
    let db = unique_db("bad");
    pg().create_database(&db);
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "client_login_timeout = 0.5");
    let shoal = Shoal::start(&config);
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 40]).await; // announces 40 bytes, sends 4
    expect_fatal(&mut r, "08P01", "client_login_timeout").await;
    // Stuck in the middle of SCRAM.
    let mut r = Raw::connect(shoal.addr).await;
    r.startup("app", &db, &[]).await;
    assert_eq!(r.recv().await.unwrap().tag, 'R');
    expect_fatal(&mut r, "08P01", "client_login_timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_stops_reading_does_not_block_others() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\n");
    let mut slow = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    // Tens of megabytes of result, never read.
    raw::query(
        &mut b,
        "SELECT repeat('x', 1000) FROM generate_series(1, 100000)",
    );
    slow.send(&b).await;
    // Others keep working through the remaining server, repeatedly.
    let other = shoal.connect(&db).await;
    for i in 0..50 {
        let v: i32 = other
            .query_one("SELECT $1::int", &[&i])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, i);
    }
    // When the slow client finally goes away its server is released (closed, since the
    // query was still running), and both servers serve again.
    drop(slow);
    let c2 = shoal.connect(&db).await;
    other.batch_execute("BEGIN").await.unwrap();
    let v: i32 = tokio::time::timeout(Duration::from_secs(10), c2.query_one("SELECT 9", &[]))
        .await
        .expect("second server free again")
        .unwrap()
        .get(0);
    assert_eq!(v, 9);
}
