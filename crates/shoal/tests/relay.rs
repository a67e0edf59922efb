//! The relay and the pool against a scripted PostgreSQL ([`common::fake_pg`]): back-pressure
//! on a reply far larger than any buffer, a FATAL in the middle of a pipeline, first-come
//! first-served waiting for a server, and replies split over writes under concurrency (the
//! lost wake-up a readiness shortcut once caused).
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::BytesMut;
use common::fake_pg::FakePg;
use common::raw::{self, Raw};
use common::*;

fn config(fake: &FakePg, pool_size: usize) -> String {
    let mut c = String::from("[server]\nlisten = [\"127.0.0.1:0\"]\n");
    if let Ok(rt) = std::env::var("SHOAL_TEST_RUNTIME") {
        c.push_str(&format!("runtime = \"{rt}\"\n"));
    }
    c.push_str(&format!(
        "[pool]\npool_size = {pool_size}\nquery_wait_timeout = 30\n\
         [databases.fake]\nhost = \"127.0.0.1\"\nport = {}\n\
         [users.raw]\nauth_method = \"trust\"\nserver_user = \"app\"\nserver_password = \"x\"\n\
         [admin]\nusers = [\"raw\"]\n",
        fake.addr.port()
    ));
    c
}

/// A 96 MB row to a client that does not read: Shoal stops reading the server once its
/// side is full, so what the server could write is bounded by socket buffers and the
/// relay's high-water mark, not by the reply; then the whole row arrives intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_larger_than_any_buffer_is_held_back_not_buffered() {
    let fake = FakePg::start().await;
    let shoal = Shoal::start(&config(&fake, 1));
    let mut c = Raw::login(shoal.addr, "raw", "fake", &[]).await;
    const SIZE: usize = 96 << 20;
    let mut out = BytesMut::new();
    raw::query(&mut out, &format!("big:{SIZE}"));
    c.send(&out).await;
    // Wait until the server cannot write more (no progress for half a second).
    let mut last = 0;
    let mut still = 0;
    while still < 10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = fake.shared.big_written.load(Ordering::Relaxed);
        if now == last {
            still += 1;
        } else {
            still = 0;
            last = now;
        }
    }
    assert!(
        last < 48 << 20,
        "the server wrote {last} bytes to a client that read nothing"
    );
    let msgs = c.until_ready().await;
    let row = msgs.iter().find(|m| m.tag == 'D').expect("the row");
    assert_eq!(row.body.len(), 2 + 4 + SIZE);
    assert!(row.body[6..].iter().all(|&b| b == b'x'));
    assert_eq!(fake.shared.big_written.load(Ordering::Relaxed), SIZE as u64);
}

/// Three pipelined queries; the server answers the first and dies at the second. The client
/// gets the first result, an error for what was lost, a ReadyForQuery for each query, and
/// goes on with a new server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_in_the_middle_of_a_pipeline() {
    let fake = FakePg::start().await;
    let shoal = Shoal::start(&config(&fake, 1));
    let mut c = Raw::login(shoal.addr, "raw", "fake", &[]).await;
    let mut out = BytesMut::new();
    raw::query(&mut out, "SELECT 'one'");
    raw::query(&mut out, "fatal");
    raw::query(&mut out, "SELECT 'three'");
    c.send(&out).await;
    let first = c.until_ready().await;
    assert_eq!(
        first.iter().map(|m| m.tag).collect::<String>(),
        "TDCZ",
        "{first:?}"
    );
    let lost = c.until_ready().await;
    assert_eq!(lost[0].tag, 'E', "{lost:?}");
    assert_eq!(lost[0].code(), "57P01");
    let third = c.until_ready().await;
    assert_eq!(third.iter().map(|m| m.tag).collect::<String>(), "Z");
    assert_eq!(c.simple("SELECT 'after'").await.unwrap(), vec!["after"]);
}

/// Clients waiting for the only server get it in the order they asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_clients_are_served_first_come_first_served() {
    let fake = FakePg::start().await;
    let shoal = Shoal::start(&config(&fake, 1));
    let mut holder = Raw::login(shoal.addr, "raw", "fake", &[]).await;
    holder.simple("BEGIN").await.unwrap();
    let (console, conn) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(shoal.port())
        .user("raw")
        .dbname("pgbouncer")
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let waiting = || async {
        let rows = console.simple_query("SHOW POOLS").await.unwrap();
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get("cl_waiting").map(String::from),
                _ => None,
            })
            .unwrap_or_default()
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..4 {
        let mut c = Raw::login(shoal.addr, "raw", "fake", &[]).await;
        let tx = tx.clone();
        let mut out = BytesMut::new();
        raw::query(&mut out, &format!("SELECT 'w{i}'"));
        c.send(&out).await;
        tasks.push(tokio::spawn(async move {
            let msgs = c.until_ready().await;
            tx.send((i, msgs)).unwrap();
        }));
        // The next one asks only once this one waits.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while waiting().await != (i + 1).to_string() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "client {i} never waited"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    holder.simple("COMMIT").await.unwrap();
    for _ in 0..4 {
        let (i, msgs) = rx.recv().await.unwrap();
        assert!(msgs.iter().any(|m| m.tag == 'D'), "client {i} got no row");
    }
    // The order the one server ran them in (the order the test's tasks report their replies
    // in depends on how they are scheduled).
    let served: Vec<String> = fake
        .shared
        .queries
        .lock()
        .unwrap()
        .iter()
        .filter(|q| q.starts_with("SELECT 'w"))
        .cloned()
        .collect();
    let expected: Vec<String> = (0..4).map(|i| format!("SELECT 'w{i}'")).collect();
    assert_eq!(served, expected, "served out of order");
}

/// Replies split over two writes, 24 clients on a pool of 4, many rounds: every reply
/// arrives (a relay that skipped a side it thought idle once missed one and hung).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_replies_under_concurrency_all_arrive() {
    let fake = FakePg::start().await;
    let shoal = Shoal::start(&config(&fake, 4));
    let mut tasks = Vec::new();
    for i in 0..24 {
        let addr = shoal.addr;
        tasks.push(tokio::spawn(async move {
            let mut c = Raw::login(addr, "raw", "fake", &[]).await;
            for round in 0..150 {
                let v = format!("c{i}r{round}");
                let rows = c.simple(&format!("split:{v}")).await.unwrap();
                assert_eq!(rows, vec![v]);
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("every client finishes")
            .unwrap();
    }
    assert!(fake.shared.connections.load(Ordering::Relaxed) <= 4 + 1);
}
