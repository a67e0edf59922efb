//! The per-core data plane's packing: shards open only under load, idle transaction-mode
//! clients move between shards at the moment they go idle, and no client ever sees another's
//! results while they move (each client checks every answer is its own).
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// A Shoal on the per-core data plane with two shards and the given packing thresholds.
fn sharded(db: &str, open_busy: f64, close_busy: f64) -> Shoal {
    pg().create_database(db);
    let config = base_config(pg(), &[db], "[metrics]\nlisten = \"127.0.0.1:0\"\n")
        .replace("runtime = \"per_core\"\n", "")
        .replace("runtime = \"multi_thread\"\n", "");
    let config = with_server_keys(
        &config,
        &format!(
            "runtime = \"per_core\"\nworker_threads = 2\nshard_open_busy = {open_busy}\nshard_close_busy = {close_busy}\nshard_open_idle_cores = 0"
        ),
    );
    Shoal::start(&config)
}

/// Whether this kernel accepts the steering program (some sandboxes refuse it; Shoal then
/// hands misrouted connections over between shards, so only the no-hand-over assertions
/// depend on it).
fn kernel_steers() -> bool {
    let first =
        shoal::listener::bind_tcp_std("127.0.0.1:0".parse().unwrap(), 16, true).expect("bind");
    let addr = first.local_addr().unwrap();
    let _second = shoal::listener::bind_tcp_std(addr, 16, true).expect("bind second");
    match shoal::reuseport::steer(&first, 1) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("the kernel refuses SO_ATTACH_REUSEPORT_CBPF here ({e}): hand-over counts not checked");
            false
        }
    }
}

/// The metrics page, scraped once.
fn scrape(shoal: &Shoal) -> String {
    let url = format!(
        "http://{}/metrics",
        shoal.metrics.expect("metrics listener")
    );
    let out = Command::new("curl")
        .args(["-s", &url])
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the first sample whose line starts with `prefix` (-1 if none).
fn value(text: &str, prefix: &str) -> i64 {
    text.lines()
        .find(|l| l.starts_with(prefix) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(-1)
}

/// Samples of the gauges this test follows: (shards open, clients on shard 0, on shard 1).
fn shard_gauges(shoal: &Shoal) -> (i64, i64, i64) {
    let text = scrape(shoal);
    (
        value(&text, "shoal_shards_open"),
        value(&text, "shoal_shard_clients{shard=\"0\"}"),
        value(&text, "shoal_shard_clients{shard=\"1\"}"),
    )
}

/// One query per client, each asking for its own number back.
async fn round(clients: &[tokio_postgres::Client]) {
    let mut tasks = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        tasks.push(async move {
            let rows = simple_rows(c, &format!("SELECT {i}")).await;
            assert_eq!(rows, vec![i.to_string()], "client {i} got another's answer");
        });
    }
    futures_util::future::join_all(tasks).await;
}

/// Runs rounds of queries, `pause` apart, until the gauges satisfy `done`, within `limit`.
async fn rounds_until(
    shoal: &Shoal,
    clients: &[tokio_postgres::Client],
    pause: Duration,
    limit: Duration,
    what: &str,
    done: impl Fn((i64, i64, i64)) -> bool,
) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        round(clients).await;
        let g = shard_gauges(shoal);
        if done(g) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {g:?}");
        tokio::time::sleep(pause).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn light_load_keeps_every_client_on_one_shard() {
    let db = unique_db("packed");
    let shoal = sharded(&db, 0.75, 0.35);
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(shoal.connect(&db).await);
    }
    // With one shard open the kernel is steered to give every connection to shard 0's
    // socket: none was accepted by the closed shard and handed over. (Unless the machine was
    // so busy that the second shard opened for a moment: a connection queued on its socket
    // as it closed again is rightly handed over.)
    if kernel_steers() && !shoal.log_contains("shard(s) open") {
        assert_eq!(
            value(&scrape(&shoal), "shoal_shard_handovers_total"),
            0,
            "connections reached the closed shard"
        );
    }
    // Under light traffic every client stays on shard 0 (a client the login storm put
    // elsewhere would move when it next goes idle).
    rounds_until(
        &shoal,
        &clients,
        Duration::from_millis(100),
        Duration::from_secs(20),
        "not packed",
        |g| g == (1, 16, 0),
    )
    .await;
    round(&clients).await;
    drop(clients);
    eventually("clients counted out", Duration::from_secs(10), || {
        shard_gauges(&shoal) == (1, 0, 0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_open_under_load_and_pack_back_when_it_passes() {
    let db = unique_db("spread");
    // Thresholds so low that steady traffic opens the second shard and only quiet closes it.
    // Quiet is not zero work: a scrape of the metrics page costs shard 0 a few milliseconds in
    // a debug build (~2 % of a 200 ms monitor interval), so closing must tolerate that
    // (`close_busy` well above it) or the shard closes only by luck.
    let shoal = sharded(&db, 0.08, 0.04);
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(shoal.connect(&db).await);
    }
    // Under load the second shard opens, and clients going idle move to balance.
    rounds_until(
        &shoal,
        &clients,
        Duration::ZERO,
        Duration::from_secs(30),
        "no spread (open, shard 0, shard 1)",
        |(open, s0, s1)| open == 2 && s1 > 0 && s0 + s1 == 16,
    )
    .await;
    // Quiet: the second shard closes; its clients leave it when they next go idle (a round
    // of queries may itself reopen the shard for a moment, so quiet and retry).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        // Polled slowly: scraping the metrics is work for shard 0 too.
        while shard_gauges(&shoal).0 != 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the second shard stays open"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        round(&clients).await;
        let (open, s0, s1) = shard_gauges(&shoal);
        if (s0, s1) == (16, 0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no packing back: open {open}, shard 0 {s0}, shard 1 {s1}"
        );
    }
    // The servers followed their clients: everything still answers, in a transaction too.
    for (i, c) in clients.iter().enumerate() {
        c.batch_execute("BEGIN").await.unwrap();
        assert_eq!(
            simple_rows(c, &format!("SELECT {i}")).await,
            vec![i.to_string()]
        );
        c.batch_execute("COMMIT").await.unwrap();
    }
}
