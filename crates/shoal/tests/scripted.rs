//! The relay and the pool in one process, with no socket between the parts: clients reach
//! sessions over `tokio::io::duplex` pipes, and pools reach a scripted PostgreSQL
//! ([`common::fake_pg`]) over pipes too, through the server-side dial seam. Pipes of a few
//! KiB make back-pressure show at once; every wait is on a condition, not a clock.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use common::fake_pg::FakePg;
use common::raw::{self, Raw};
use shoal::app::App;
use shoal::config::Config;
use shoal::net::Stream;
use shoal::pool::{CheckoutError, Pool};
use shoal::route::RouteRequest;

/// Bytes each pipe buffers each way: far below what a test sends, so every large transfer
/// runs into back-pressure.
const PIPE: usize = 8 * 1024;

/// The coarse clock ticks on a runtime of its own that outlives every test's.
fn clock() {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let guard = rt.enter();
        shoal::clock::start();
        drop(guard);
        rt
    });
}

/// An App whose pools reach `fake` over pipes; `pool` adds `[pool]` settings.
fn app(fake: &FakePg, pool: &str) -> Arc<App> {
    app_reaching(fake, pool, Some(fake.dialer(PIPE)))
}

/// An App for `fake`'s database whose pools reach their servers through `dial` (`None`:
/// over TCP to `fake`).
fn app_reaching(fake: &FakePg, pool: &str, dial: Option<Arc<dyn shoal::server::Dial>>) -> Arc<App> {
    let size = if pool.contains("pool_size") {
        ""
    } else {
        "pool_size = 1\n"
    };
    app_configured(fake, "", &format!("[pool]\n{size}{pool}\n"), dial)
}

/// An App for `fake`'s database with `server` keys and further `sections` (`[pool]`,
/// more users) beside user `raw`.
fn app_configured(
    fake: &FakePg,
    server: &str,
    sections: &str,
    dial: Option<Arc<dyn shoal::server::Dial>>,
) -> Arc<App> {
    clock();
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n{server}\n\
         {sections}\n\
         [databases.fake]\nhost = \"127.0.0.1\"\nport = {}\n\
         [users.raw]\nauth_method = \"trust\"\nserver_user = \"app\"\nserver_password = \"x\"\n",
        fake.addr.port()
    );
    let config = Config::parse(&text, "test", &|_| None).unwrap();
    // Never sent: the app lives as long as the test.
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    std::mem::forget(stop);
    let app = App::new(config, shutdown).unwrap();
    if let Some(dial) = dial {
        app.routes.set_dial(dial);
    }
    app
}

/// A logged-in client served by a session of `app`, over a pipe.
async fn client(app: &Arc<App>) -> Raw {
    let (ours, theirs) = tokio::io::duplex(PIPE);
    tokio::spawn(shoal::session::serve(
        app.clone(),
        Stream::Buffered(Box::new(theirs)),
        None,
    ));
    Raw::login_over(Raw::over(ours), "raw", "fake", &[]).await
}

/// The pool the client `raw` uses on `fake`.
fn pool_of(app: &Arc<App>) -> Arc<Pool> {
    let routed = app
        .routes
        .resolve(&RouteRequest {
            user: "raw",
            database: "fake",
            server_name: None,
            reference: None,
            addr: None,
        })
        .unwrap();
    let user = routed.configured_user().unwrap().clone();
    app.routes.pool(&routed, &user).unwrap()
}

/// Lets every other task on this (current-thread) runtime run until none can progress.
async fn settle() {
    for _ in 0..2000 {
        tokio::task::yield_now().await;
    }
}

/// Waits (up to 20 s) for `cond`.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn copy_data(out: &mut BytesMut, data: &[u8]) {
    out.put_u8(b'd');
    out.put_u32(4 + data.len() as u32);
    out.put_slice(data);
}

/// A 16 MB row to a client that reads nothing: once everything is quiet, what the server
/// could write is bounded by the pipes and the relay's high-water mark; then the whole row
/// arrives intact and the server serves the next query.
#[tokio::test]
async fn back_pressure_holds_a_reply_at_the_high_water_mark() {
    let fake = FakePg::start().await;
    let app = app(&fake, "");
    let mut c = client(&app).await;
    const SIZE: usize = 16 << 20;
    let mut out = BytesMut::new();
    raw::query(&mut out, &format!("big:{SIZE}"));
    c.send(&out).await;
    settle().await;
    let held = fake.shared.big_written.load(Ordering::Relaxed);
    assert!(held > 0, "the server started writing");
    // Two pipes, the relay's 256 KiB high-water mark and one read's worth of room.
    assert!(
        held < 1 << 20,
        "the relay buffered {held} bytes for a client that read nothing"
    );
    let msgs = c.until_ready().await;
    let row = msgs.iter().find(|m| m.tag == 'D').expect("the row");
    assert_eq!(row.body.len(), 2 + 4 + SIZE);
    assert!(row.body[6..].iter().all(|&b| b == b'x'));
    assert_eq!(c.simple("SELECT 'next'").await.unwrap(), vec!["next"]);
}

/// COPY in both directions streams through pipes far smaller than the data, and a CopyFail
/// leaves the server usable for the next client.
#[tokio::test]
async fn copy_streams_both_ways_and_a_copy_fail_leaves_the_server_clean() {
    let fake = FakePg::start().await;
    let app = app(&fake, "");
    let mut c = client(&app).await;
    let mut out = BytesMut::new();
    raw::query(&mut out, "copyout:50000");
    c.send(&out).await;
    let msgs = c.until_ready().await;
    let lines: Vec<_> = msgs.iter().filter(|m| m.tag == 'd').collect();
    assert_eq!(lines.len(), 50000);
    assert_eq!(lines[49999].body, b"line 49999\n");
    assert!(msgs
        .iter()
        .any(|m| m.tag == 'C' && m.body.starts_with(b"COPY 50000")));

    out.clear();
    raw::query(&mut out, "COPY t FROM STDIN");
    c.send(&out).await;
    assert_eq!(c.recv().await.unwrap().tag, 'G');
    let line = vec![b'y'; 1023];
    let mut batch = BytesMut::new();
    for _ in 0..4000 {
        let mut l = line.clone();
        l.push(b'\n');
        copy_data(&mut batch, &l);
    }
    batch.put_u8(b'c');
    batch.put_u32(4);
    // Written while Shoal streams it on: 4 MB through 8 KiB pipes.
    c.send(&batch).await;
    let done = c.until_ready().await;
    assert!(
        done.iter()
            .any(|m| m.tag == 'C' && m.body.starts_with(b"COPY 4000")),
        "{done:?}"
    );

    out.clear();
    raw::query(&mut out, "COPY t FROM STDIN");
    c.send(&out).await;
    assert_eq!(c.recv().await.unwrap().tag, 'G');
    out.clear();
    copy_data(&mut out, b"half a row");
    out.put_u8(b'f');
    out.put_u32(4 + 5);
    out.put_slice(b"oops\0");
    c.send(&out).await;
    let failed = c.until_ready().await;
    assert!(failed.iter().any(|m| m.tag == 'E' && m.code() == "57014"));
    drop(c);
    let mut other = client(&app).await;
    assert_eq!(other.simple("SELECT 'clean'").await.unwrap(), vec!["clean"]);
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 1);
}

/// A cancel while rows stream: the server stops, the client gets `57014` after the rows
/// already sent and nothing after its ReadyForQuery, and the same server serves on.
#[tokio::test]
async fn cancel_while_streaming_ends_the_reply_cleanly() {
    let fake = FakePg::start().await;
    let app = app(&fake, "");
    let mut c = client(&app).await;
    let mut out = BytesMut::new();
    raw::query(&mut out, "rows:100000000");
    c.send(&out).await;
    let mut rows = 0;
    while rows < 200 {
        if c.recv().await.unwrap().tag == 'D' {
            rows += 1;
        }
    }
    let (pipe, theirs) = tokio::io::duplex(PIPE);
    tokio::spawn(shoal::session::serve(
        app.clone(),
        Stream::Buffered(Box::new(theirs)),
        None,
    ));
    let mut cancel = Raw::over(pipe);
    let mut req = BytesMut::new();
    req.put_u32(16);
    req.put_u32(80877102);
    req.put_i32(c.key.0);
    req.put_i32(c.key.1);
    cancel.send(&req).await;
    assert!(
        cancel.recv().await.is_none(),
        "a cancel connection gets no reply"
    );
    let rest = c.until_ready().await;
    let error = rest.iter().find(|m| m.tag == 'E').expect("an error");
    assert_eq!(error.code(), "57014");
    assert!(rest
        .iter()
        .skip_while(|m| m.tag != 'E')
        .all(|m| m.tag != 'D'));
    assert_eq!(c.simple("SELECT 'after'").await.unwrap(), vec!["after"]);
    assert_eq!(fake.shared.cancels.load(Ordering::Relaxed), 1);
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 1);
}

/// Three pipelined queries over the extended protocol; the server dies at the second. The
/// client gets the first result, an error, a ReadyForQuery per Sync, and goes on.
#[tokio::test]
async fn a_fatal_in_an_extended_pipeline() {
    let fake = FakePg::start().await;
    let app = app(&fake, "");
    let mut c = client(&app).await;
    let mut out = BytesMut::new();
    raw::query(&mut out, "SELECT 'one'");
    raw::parse(&mut out, "", "SELECT 1");
    raw::bind(&mut out, "", "", &[]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    raw::query(&mut out, "fatal");
    raw::query(&mut out, "SELECT 'four'");
    c.send(&out).await;
    let tags = |m: &[common::raw::Msg]| m.iter().map(|m| m.tag).collect::<String>();
    assert_eq!(tags(&c.until_ready().await), "TDCZ");
    assert_eq!(tags(&c.until_ready().await), "12CZ");
    let lost = c.until_ready().await;
    assert_eq!(lost[0].code(), "57P01", "{lost:?}");
    assert_eq!(tags(&c.until_ready().await), "Z");
    assert_eq!(c.simple("SELECT 'after'").await.unwrap(), vec!["after"]);
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 2);
}

/// Clients on pipes, the server on TCP (readiness-driven): replies split over two writes,
/// 12 clients on a pool of 3, on one thread so every interleaving of the two sides' wake-ups
/// is taken many times. A relay that skips a side it thinks idle hangs here.
#[tokio::test]
async fn split_replies_on_one_thread_all_arrive() {
    let fake = FakePg::start().await;
    let app = app_reaching(&fake, "pool_size = 3", None);
    let mut tasks = Vec::new();
    for i in 0..12 {
        let mut c = client(&app).await;
        tasks.push(tokio::spawn(async move {
            for round in 0..100 {
                let v = format!("c{i}r{round}");
                assert_eq!(c.simple(&format!("split:{v}")).await.unwrap(), vec![v]);
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("every client finishes")
            .unwrap();
    }
    assert!(fake.shared.connections.load(Ordering::Relaxed) <= 3);
}

/// Checkouts beyond the pool size wait in arrival order.
#[tokio::test]
async fn pool_checkouts_are_first_come_first_served() {
    let fake = FakePg::start().await;
    let app = app(&fake, "");
    let pool = pool_of(&app);
    let held = pool.checkout().await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..5 {
        let (p, tx) = (pool.clone(), tx.clone());
        tokio::spawn(async move {
            let lease = p.checkout().await.unwrap();
            tx.send(i).unwrap();
            lease.checkin();
        });
        until("the checkout waits", || {
            pool.stats.waiting.load(Ordering::Relaxed) == i + 1
        })
        .await;
    }
    held.checkin();
    for expected in 0..5 {
        assert_eq!(rx.recv().await, Some(expected), "served out of order");
    }
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 1);
    assert_eq!(pool.idle_count(), 1);
}

/// A checkout dropped while it waits (its client's cancel, a login timing out) is no longer
/// counted as waiting.
#[tokio::test]
async fn a_checkout_dropped_while_waiting_is_not_counted_as_waiting() {
    let fake = FakePg::start().await;
    let app = app(&fake, "query_wait_timeout = 30");
    let pool = pool_of(&app);
    let held = pool.checkout().await.unwrap();
    let p = pool.clone();
    let waiter = tokio::spawn(async move { p.checkout().await.map(|l| l.checkin()) });
    until("the checkout waits", || {
        pool.stats.waiting.load(Ordering::Relaxed) == 1
    })
    .await;
    waiter.abort();
    until("the dropped checkout is not counted", || {
        pool.stats.waiting.load(Ordering::Relaxed) == 0
    })
    .await;
    held.checkin();
}

/// A checkout that finds every server busy for `query_wait_timeout` fails, naming the pool
/// and the setting.
#[tokio::test]
async fn pool_wait_is_bounded_by_query_wait_timeout() {
    let fake = FakePg::start().await;
    let app = app(&fake, "query_wait_timeout = 0.2");
    let pool = pool_of(&app);
    let _held = pool.checkout().await.unwrap();
    let started = std::time::Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(10), pool.checkout())
        .await
        .expect("the wait ends")
        .err()
        .expect("no server for the second");
    // Not before the timeout; after it by at most a quarter of it (the upkeep's sweep), with
    // room for a loaded machine.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert!(
        matches!(e, CheckoutError::WaitTimeout { size: 1, .. }),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("query_wait_timeout") && text.contains("fake/raw"),
        "{text}"
    );
    assert_eq!(pool.stats.waiting.load(Ordering::Relaxed), 0);
}

/// A paused pool holds checkouts until it is resumed; one that waits too long fails.
#[tokio::test]
async fn pool_pause_holds_checkouts_until_resume() {
    let fake = FakePg::start().await;
    let app = app(&fake, "query_wait_timeout = 30");
    let pool = pool_of(&app);
    pool.pause();
    let p = pool.clone();
    let waiter = tokio::spawn(async move { p.checkout().await.map(|l| l.checkin()) });
    until("the checkout waits", || {
        pool.stats.waiting.load(Ordering::Relaxed) == 1
    })
    .await;
    assert!(!waiter.is_finished());
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 0);
    pool.resume();
    waiter.await.unwrap().unwrap();
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 1);
}

/// Growing a pool lets waiting checkouts through at once; shrinking closes idle servers
/// beyond the new size and caps what can be held.
#[tokio::test]
async fn pool_resizes_in_place() {
    let fake = FakePg::start().await;
    let app = app(&fake, "query_wait_timeout = 30");
    let pool = pool_of(&app);
    let first = pool.checkout().await.unwrap();
    let p = pool.clone();
    let second = tokio::spawn(async move { p.checkout().await.unwrap() });
    until("the second waits", || {
        pool.stats.waiting.load(Ordering::Relaxed) == 1
    })
    .await;
    pool.resize(3).await;
    let second = second.await.unwrap();
    let third = pool.checkout().await.unwrap();
    assert_eq!(pool.in_use(), 3);
    first.checkin();
    second.checkin();
    third.checkin();
    assert_eq!(pool.idle_count(), 3);
    pool.resize(1).await;
    assert_eq!(pool.idle_count(), 1);
    until("two servers closed", || {
        fake.shared.open.load(Ordering::Relaxed) == 1
    })
    .await;
    let _one = pool.checkout().await.unwrap();
    assert!(
        pool.try_checkout(0).is_none(),
        "one server at a time after shrinking"
    );
}

/// Servers idle past `server_idle_timeout` are closed by the reaper; a server past
/// `server_lifetime` is closed when it comes back instead of being reused.
#[tokio::test]
async fn pool_reaps_idle_servers_and_retires_old_ones() {
    let fake = FakePg::start().await;
    let app = app(&fake, "pool_size = 2\nserver_idle_timeout = 0.3");
    let pool = pool_of(&app);
    pool.checkout().await.unwrap().checkin();
    assert_eq!(fake.shared.open.load(Ordering::Relaxed), 1);
    until("the idle server closed", || {
        fake.shared.open.load(Ordering::Relaxed) == 0
    })
    .await;
    assert_eq!(pool.stats.servers.load(Ordering::Relaxed), 0);

    let fake = FakePg::start().await;
    let app = self::app(&fake, "server_lifetime = 0.3");
    let pool = pool_of(&app);
    let lease = pool.checkout().await.unwrap();
    let born = shoal::clock::now_ms();
    until("the server outlived its lifetime", || {
        shoal::clock::now_ms() >= born + 400
    })
    .await;
    lease.checkin();
    assert_eq!(pool.idle_count(), 0, "an expired server is not kept");
    until("the expired server closed", || {
        fake.shared.open.load(Ordering::Relaxed) == 0
    })
    .await;
    pool.checkout().await.unwrap().checkin();
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 2);
}

/// An ended pool wakes its waiters with an error, refuses new checkouts, closes its idle
/// servers at once, and a server still held closes when it comes back.
#[tokio::test]
async fn an_ended_pool_serves_no_one() {
    let fake = FakePg::start().await;
    let app = app(&fake, "query_wait_timeout = 30");
    let pool = pool_of(&app);
    let held = pool.checkout().await.unwrap();
    let p = pool.clone();
    let waiter = tokio::spawn(async move { p.checkout().await.map(|_| ()) });
    until("the checkout waits", || {
        pool.stats.waiting.load(Ordering::Relaxed) == 1
    })
    .await;
    pool.end("tenant deleted".into()).await;
    assert!(matches!(
        waiter.await.unwrap(),
        Err(CheckoutError::Closed(_))
    ));
    assert!(matches!(
        pool.checkout().await,
        Err(CheckoutError::Closed(_))
    ));
    assert_eq!(pool.ended(), Some("tenant deleted"));
    held.checkin();
    assert_eq!(
        pool.idle_count(),
        0,
        "a server coming back to an ended pool closes"
    );
    until("the held server closed", || {
        fake.shared.open.load(Ordering::Relaxed) == 0
    })
    .await;

    let fake = FakePg::start().await;
    let app = self::app(&fake, "");
    let pool = pool_of(&app);
    pool.checkout().await.unwrap().checkin();
    assert_eq!(pool.idle_count(), 1);
    pool.end("banned".into()).await;
    assert_eq!(pool.idle_count(), 0);
    until("the idle server closed", || {
        fake.shared.open.load(Ordering::Relaxed) == 0
    })
    .await;
}

/// A server a client left its own state on goes back to that client; another client gets a
/// clean or a new server while the pool has room, and the state-holding one (to be cleaned)
/// only when nothing else can be had within `pool_size`.
#[tokio::test]
async fn a_server_holding_a_clients_state_waits_for_that_client() {
    let fake = FakePg::start().await;
    let app = app(&fake, "pool_size = 2\nquery_wait_timeout = 30");
    let pool = pool_of(&app);
    let (a, b) = (101, 102);
    let mut lease = pool.checkout_for(a).await.unwrap();
    let held_by_a = lease.id;
    lease.session.mark_dirty();
    lease.session.transaction_ended(a);
    lease.checkin();
    // Another client: a new server, not the one holding a's state.
    let other = pool.checkout_for(b).await.unwrap();
    assert_ne!(other.id, held_by_a);
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 2);
    let b_server = other.id;
    other.checkin();
    // a gets its own server back even though b's was returned more recently.
    let mine = pool.try_checkout(a).expect("an idle server");
    assert_eq!(mine.id, held_by_a);
    mine.checkin();
    // b again: the clean one; nobody's state is touched.
    let again = pool.checkout_for(b).await.unwrap();
    assert_eq!(again.id, b_server);
    // With b holding the other server and no room left, a third client gets a's server
    // (its plan then cleans it).
    let third = pool.checkout_for(103).await.unwrap();
    assert_eq!(third.id, held_by_a);
    assert_eq!(
        third.session.fit(103),
        shoal::server_session::Fit::Other,
        "its state is another's: prepare_for cleans it"
    );
    assert_eq!(fake.shared.connections.load(Ordering::Relaxed), 2);
    assert_eq!(pool.stats.servers.load(Ordering::Relaxed), 2);
}

/// A server that never answers the connection.
struct Hanging;

impl shoal::server::Dial for Hanging {
    fn dial<'a>(&'a self, _: &'a shoal::server::Upstream) -> shoal::server::DialFuture<'a> {
        Box::pin(std::future::pending())
    }
}

/// A checkout given up while its server is being opened (the client cancelled, or went
/// away) gives back the room it took: the pool can still open `pool_size` servers.
#[tokio::test]
async fn a_checkout_given_up_while_connecting_gives_its_room_back() {
    let fake = FakePg::start().await;
    let app = app_reaching(&fake, "", Some(Arc::new(Hanging)));
    let pool = pool_of(&app);
    for _ in 0..3 {
        let attempt = tokio::time::timeout(Duration::from_millis(50), pool.checkout()).await;
        assert!(attempt.is_err(), "the server never answers");
        assert_eq!(pool.stats.servers.load(Ordering::Relaxed), 0);
        assert_eq!(pool.in_use(), 0);
    }
}

/// Fencing in one process (the lease is the App's, not the process's): a pool owned under a
/// lease serves until its deadline; past it, the next statement never reaches a server and
/// the client is closed with `08006`, to reconnect where the pool's owner now is. A second
/// node in the same process, under a lease of its own, serves on.
#[tokio::test]
async fn past_the_lease_deadline_a_statement_never_reaches_a_server() {
    let fake = FakePg::start().await;
    let owned = |app: &Arc<App>| {
        app.routes.lease.set_clustered();
        let pool = pool_of(app);
        assert!(pool.fence.fenced(), "a cluster's pool starts closed");
        pool.fence.own();
        app.routes
            .lease
            .set_deadline(std::time::Instant::now() + Duration::from_secs(60));
    };
    let app = app(&fake, "");
    owned(&app);
    let other = app_reaching(&fake, "", Some(fake.dialer(PIPE)));
    owned(&other);
    let mut c = client(&app).await;
    let mut on_other = client(&other).await;
    assert_eq!(c.simple("SELECT 'owned'").await.unwrap(), vec!["owned"]);
    app.routes.lease.set_deadline(std::time::Instant::now());
    assert_eq!(
        on_other.simple("SELECT 'other'").await.unwrap(),
        vec!["other"],
        "the other node's lease is its own"
    );
    let mut out = BytesMut::new();
    raw::query(&mut out, "SELECT 'late'");
    c.send(&out).await;
    let refused = c.recv().await.expect("an answer");
    assert_eq!(refused.tag, 'E');
    assert_eq!(refused.code(), "08006", "{refused:?}");
    assert!(refused.text().contains("did not run"), "{refused:?}");
    assert!(c.recv().await.is_none(), "the client is closed");
    assert_eq!(
        on_other.simple("SELECT 'still'").await.unwrap(),
        vec!["still"]
    );
    let seen = fake.shared.queries.lock().unwrap().clone();
    assert!(seen.iter().any(|q| q.contains("'owned'")));
    assert!(!seen.iter().any(|q| q.contains("'late'")), "{seen:?}");
}

/// A login as `user` with `password` (MD5) from `peer`, over a pipe: the session ready for
/// queries, or the error it answered with.
async fn md5_login(
    app: &Arc<App>,
    peer: &str,
    user: &str,
    password: &str,
) -> Result<Raw, raw::Msg> {
    let (ours, theirs) = tokio::io::duplex(PIPE);
    tokio::spawn(shoal::session::serve(
        app.clone(),
        Stream::Buffered(Box::new(theirs)),
        Some(peer.parse().unwrap()),
    ));
    let mut r = Raw::over(ours);
    r.startup(user, "fake", &[]).await;
    loop {
        let m = r.recv().await.expect("an answer");
        match m.tag {
            'R' if m.body.len() == 8 && m.body[..4] == 5u32.to_be_bytes() => {
                let salt: [u8; 4] = m.body[4..8].try_into().unwrap();
                let stored = shoal_wire::md5::stored_secret(user, password);
                let mut b = BytesMut::new();
                let answer = shoal_wire::md5::salted_response(&stored, salt);
                shoal_wire::frontend::password(&mut b, &answer);
                r.send(&b).await;
            }
            'E' => return Err(m),
            'Z' => return Ok(r),
            _ => {}
        }
    }
}

/// Failed logins, in paused time: from one address as one user, each failure after the
/// first is answered later (100 ms, then 200 ms); the third bans the pair, right password or
/// not, until `auth_failure_window` has passed, and then the right password gets in. The same
/// user from another address, and another user, are unaffected throughout.
#[tokio::test(start_paused = true)]
async fn failed_logins_are_delayed_banned_and_forgiven() {
    let fake = FakePg::start().await;
    let app = app_configured(
        &fake,
        "auth_failure_ban = 3\nauth_failure_window = 60",
        "[pool]\npool_size = 1\n[users.pw]\nauth_method = \"md5\"\npassword = \"right\"\n\
         server_user = \"app\"\nserver_password = \"x\"\n",
        Some(fake.dialer(PIPE)),
    );
    let (guesser, other) = ("10.0.0.1:5000", "10.0.0.2:5000");
    let mut waited = Vec::new();
    for _ in 0..3 {
        let started = tokio::time::Instant::now();
        let e = md5_login(&app, guesser, "pw", "wrong")
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), "28P01", "{}", e.text());
        waited.push(started.elapsed());
    }
    assert!(waited[0] < Duration::from_millis(100), "{waited:?}");
    assert!(waited[1] >= Duration::from_millis(100), "{waited:?}");
    assert!(waited[2] >= Duration::from_millis(200), "{waited:?}");
    // Banned now, even with the right password; not so the same user from elsewhere, or
    // another user from the same address.
    let e = md5_login(&app, guesser, "pw", "right")
        .await
        .err()
        .expect("banned");
    assert_eq!(e.code(), "28000", "{}", e.text());
    assert!(e.text().contains("too many failed logins"), "{}", e.text());
    let mut c = md5_login(&app, other, "pw", "right")
        .await
        .expect("another address");
    assert_eq!(c.simple("SELECT 'in'").await.unwrap(), vec!["in"]);
    drop(c);
    let mut c = Raw::login_over(
        {
            let (ours, theirs) = tokio::io::duplex(PIPE);
            tokio::spawn(shoal::session::serve(
                app.clone(),
                Stream::Buffered(Box::new(theirs)),
                Some(guesser.parse().unwrap()),
            ));
            Raw::over(ours)
        },
        "raw",
        "fake",
        &[],
    )
    .await;
    assert_eq!(c.simple("SELECT 'in'").await.unwrap(), vec!["in"]);
    drop(c);
    // Still banned just before the window ends; forgiven after it.
    tokio::time::advance(Duration::from_secs(55)).await;
    let e = md5_login(&app, guesser, "pw", "right")
        .await
        .err()
        .expect("still banned");
    assert_eq!(e.code(), "28000", "{}", e.text());
    tokio::time::advance(Duration::from_secs(6)).await;
    let mut c = md5_login(&app, guesser, "pw", "right")
        .await
        .expect("forgiven");
    assert_eq!(c.simple("SELECT 'in'").await.unwrap(), vec!["in"]);
}
