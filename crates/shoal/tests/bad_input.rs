//! Hostile or broken clients get a clear FATAL and a closed connection; others go on.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

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

/// As PostgreSQL: a first packet that is not a startup packet is logged and the connection
/// closed without a reply (the peer does not speak the protocol).
async fn expect_silent_close(r: &mut Raw) {
    assert!(r.recv().await.is_none(), "closed without a reply");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_before_startup() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    r.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    expect_silent_close(&mut r).await;
    // A length that is too small.
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 4]).await;
    expect_silent_close(&mut r).await;
    // A startup packet whose parameters are not terminated.
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 12, 0, 3, 0, 0, b'u', b's', b'e', b'r'])
        .await;
    expect_silent_close(&mut r).await;
    // A startup without a user: PostgreSQL's FATAL.
    let mut r = Raw::connect(shoal.addr).await;
    let mut b = BytesMut::new();
    shoal_wire::frontend::startup(&mut b, &[("database", "x")]);
    r.send(&b).await;
    expect_fatal(&mut r, "28000", "no PostgreSQL user name").await;
    // One SSLRequest is answered; a second is a protocol violation.
    let mut r = Raw::connect(shoal.addr).await;
    let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    r.send(&ssl).await;
    assert_eq!(r.recv_byte().await, Some(b'N'));
    r.send(&ssl).await;
    expect_fatal(&mut r, "08P01", "already negotiated").await;
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

    // Bodies that do not match their message type never reach a server.
    for (tag, body) in [
        (b'H', &b"x"[..]),
        (b'S', b"\0"),
        (b'Q', b"SELECT 1"),
        (b'P', b"s\0SELECT 1\0\0\x05"),
        (b'E', b"\0\0"),
    ] {
        let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
        let mut b = BytesMut::new();
        shoal_wire::backend::put_message(&mut b, tag, |m| m.put_slice(body));
        r.send(&b).await;
        expect_fatal(&mut r, "08P01", "malformed").await;
    }

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

/// A query followed by a malformed Flush: PostgreSQL would answer the query, reject the
/// Flush and ignore everything until a Sync, so a server in that state must never reach the
/// next client (on a pool of one, client B would get A's error and then no answer at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_message_after_a_query_never_reaches_the_next_client() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    for round in 0..3 {
        let mut a = Raw::login(shoal.addr, "raw", &db, &[("application_name", "a")]).await;
        let mut b = BytesMut::new();
        raw::query(&mut b, "SELECT pg_sleep(0.2)");
        shoal_wire::backend::put_message(&mut b, b'H', |m| m.put_u8(0));
        a.send(&b).await;
        let mut got_fatal = false;
        while let Some(m) = a.recv().await {
            if m.tag == 'E' {
                assert_eq!(m.code(), "08P01", "round {round}: {}", m.text());
                got_fatal = true;
            }
        }
        assert!(
            got_fatal,
            "round {round}: A is told its message was malformed"
        );
        let mut other = Raw::login(shoal.addr, "raw", &db, &[]).await;
        let msgs = {
            let mut b = BytesMut::new();
            raw::query(&mut b, "SELECT 'b-only'");
            other.send(&b).await;
            other.until_ready().await
        };
        let tags: String = msgs.iter().map(|m| m.tag).collect();
        assert_eq!(tags, "TDCZ", "round {round}: B sees exactly its own reply");
        assert_eq!(raw::first_column(&msgs[1]), "b-only");
    }
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

/// A user name with a newline must not forge a log line; a NUL never reaches the log raw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_text_is_escaped_in_logs() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    r.startup("evil\nINFO forged line", &db, &[]).await;
    // Unknown users get the same SCRAM exchange as known ones.
    assert_eq!(r.recv().await.map(|m| m.tag), Some('R'));
    drop(r);
    eventually("the refusal is logged", Duration::from_secs(10), || {
        shoal.log_contains("evil\\nINFO forged line")
    })
    .await;
    let log = shoal.log.lock().unwrap();
    assert!(
        !log.iter().any(|l| l.starts_with("INFO forged")),
        "a forged line: {log:?}"
    );
}

/// Server messages in the client's encoding (not UTF-8) are relayed, not judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_text_in_latin9_is_relayed() {
    let db = unique_db("bad");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[("client_encoding", "LATIN9")]).await;
    // SELECT 'é'::int, with é as LATIN9's single byte 0xE9.
    let mut b = BytesMut::new();
    shoal_wire::backend::put_message(&mut b, b'Q', |m| {
        m.put_slice(b"SELECT '\xe9'::int");
        m.put_u8(0);
    });
    r.send(&b).await;
    let msgs = r.until_ready().await;
    assert_eq!(msgs[0].tag, 'E', "{msgs:?}");
    assert_eq!(msgs[0].code(), "22P02");
    assert!(
        msgs[0].body.windows(1).any(|w| w == [0xe9]),
        "the byte as sent"
    );
    let notice = {
        let mut b = BytesMut::new();
        shoal_wire::backend::put_message(&mut b, b'Q', |m| {
            m.put_slice(b"DO $$BEGIN RAISE NOTICE '\xe9t\xe9'; END$$");
            m.put_u8(0);
        });
        r.send(&b).await;
        r.until_ready().await
    };
    assert!(notice.iter().any(|m| m.tag == 'N'), "{notice:?}");
    assert_eq!(r.simple("SELECT 1").await.unwrap(), vec!["1"]);
}

/// Sockets that connect and never log in do not count against `max_client_conn`: they cannot
/// lock real users out. Per-address and global caps on logins in progress bound them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_logins_do_not_lock_out_users() {
    let db = unique_db("bad");
    pg().create_database(&db);
    let config = with_server_keys(
        &base_config(pg(), &[&db], ""),
        "max_client_conn = 3\nmax_logins_per_address = 20\nclient_login_timeout = 30",
    );
    let shoal = Shoal::start(&config);
    // A socket that asks for SSL (so Shoal has surely started its login) and then says
    // nothing more.
    let stall = || async {
        let mut r = Raw::connect(shoal.addr).await;
        r.send(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]).await;
        assert_eq!(r.recv_byte().await, Some(b'N'));
        r
    };
    let mut silent = Vec::new();
    for _ in 0..15 {
        silent.push(stall().await);
    }
    // A user logs in and works although 15 sockets sit in the login phase.
    let mut c = Raw::login(shoal.addr, "raw", &db, &[]).await;
    assert_eq!(c.simple("SELECT 1").await.unwrap(), vec!["1"]);
    // Five more silent sockets reach the per-address cap; the next login from that address
    // is refused with a message naming the limit, while logged-in clients go on.
    for _ in 0..5 {
        silent.push(stall().await);
    }
    let mut refused = Raw::connect(shoal.addr).await;
    refused.startup("raw", &db, &[]).await;
    expect_fatal(&mut refused, "53300", "max_logins_per_address (20)").await;
    assert_eq!(c.simple("SELECT 2").await.unwrap(), vec!["2"]);
    // Once the silent sockets go, logins are accepted again.
    drop(silent);
    let mut d = None;
    for _ in 0..100 {
        let mut r = Raw::connect(shoal.addr).await;
        r.startup("raw", &db, &[]).await;
        if r.recv().await.is_some_and(|m| m.tag == 'R') {
            d = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(d.is_some(), "logins accepted again");
}

/// Large messages: COPY data and result rows are streamed through whatever their size; a
/// huge query is bounded per client by `max_packet_size` and for all clients together by
/// `max_large_message_memory`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_are_streamed_or_bounded() {
    let db = unique_db("bad");
    pg().create_database(&db);
    let config = with_server_keys(
        &base_config(pg(), &[&db], ""),
        "max_packet_size = 4194304\nmax_large_message_memory = 3145728",
    );
    let shoal = Shoal::start(&config);
    let c = shoal.connect(&db).await;
    c.batch_execute("CREATE TABLE big (t text)").await.unwrap();
    // A 6 MB COPY row (larger than max_packet_size) goes through in one CopyData message.
    let row = "x".repeat(6 << 20);
    {
        use futures_util::SinkExt;
        let sink = c.copy_in("COPY big FROM STDIN").await.unwrap();
        futures_util::pin_mut!(sink);
        let mut data = row.clone().into_bytes();
        data.push(b'\n');
        sink.send(bytes::Bytes::from(data)).await.unwrap();
        assert_eq!(sink.finish().await.unwrap(), 1);
    }
    // And comes back as one 6 MB row.
    let got: String = c.query_one("SELECT t FROM big", &[]).await.unwrap().get(0);
    assert_eq!(got.len(), row.len());
    // A 2 MB query fits both limits.
    let q = format!("SELECT length('{}')", "y".repeat(2 << 20));
    assert_eq!(simple_rows(&c, &q).await, vec![(2 << 20).to_string()]);
    // Two clients sending 2 MB queries at once, each half sent: both do not fit the 3 MB
    // budget, so exactly one is refused, and the other is answered once it sends the rest.
    let mut big = BytesMut::new();
    raw::query(&mut big, &q);
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    use tokio::io::AsyncWriteExt;
    let _ = a.stream.write_all(&big[..1 << 20]).await;
    let _ = b.stream.write_all(&big[..1 << 20]).await;
    let (refused, mut survivor) = tokio::select! {
        m = a.recv() => (m, b),
        m = b.recv() => (m, a),
    };
    let m = refused.expect("an error for the one that does not fit");
    assert_eq!(m.code(), "53200", "{}", m.text());
    assert!(m.text().contains("max_large_message_memory"));
    survivor.send(&big[1 << 20..]).await;
    let msgs = survivor.until_ready().await;
    assert_eq!(raw::first_column(&msgs[1]), (2 << 20).to_string());
    // The budget is free again.
    assert_eq!(simple_rows(&c, &q).await, vec![(2 << 20).to_string()]);
}
