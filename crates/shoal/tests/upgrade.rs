//! Zero-downtime restart: a second Shoal process takes the listening sockets over from the
//! first (`--upgrade-socket`) while pgbench opens a connection per transaction through it;
//! no transaction fails, and the first process drains and exits.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_load_fails_no_transaction() {
    let db = unique_db("upgrade");
    pg().create_database(&db);
    let init = Command::new(pg().bin("pgbench"))
        .args([
            "-i",
            "-q",
            "-s",
            "1",
            "-h",
            "127.0.0.1",
            "-p",
            &pg().port.to_string(),
            "-U",
            "app",
            &db,
        ])
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap();
    let metrics = "[metrics]\nlisten = \"127.0.0.1:0\"\n";
    let config = with_server_keys(&base_config(pg(), &[&db], metrics), "shutdown_timeout = 10");
    let mut old = Shoal::start_with_args(&config, &[], &["--upgrade-socket", control]);
    let port = old.port();
    // pgbench: a new connection for every transaction, for 8 seconds.
    let bench = std::thread::spawn({
        let db = db.clone();
        move || {
            Command::new(pg().bin("pgbench"))
                .args([
                    "-n",
                    "-S",
                    "-C",
                    "-c",
                    "4",
                    "-j",
                    "2",
                    "-T",
                    "8",
                    "-h",
                    "127.0.0.1",
                ])
                .args(["-p", &port.to_string(), "-U", "app", &db])
                .env("PGPASSWORD", APP_PASSWORD)
                .output()
                .unwrap()
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The upgrade: a new process on the same control socket.
    let new = Shoal::start_with_args(&config, &[], &["--upgrade-socket", control]);
    assert_eq!(new.port(), port, "the same listening socket");
    assert_eq!(new.metrics, old.metrics, "the metrics listener too");
    assert_eq!(
        old.wait(Duration::from_secs(30)),
        Some(true),
        "the old process drains and exits"
    );
    assert!(old.log_contains("took over") || new.log_contains("took over"));
    let out = bench.join().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "pgbench failed:\n{text}");
    let processed: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    assert!(processed > 100, "{text}");
    let failed = text
        .lines()
        .find(|l| l.starts_with("number of failed transactions"))
        .unwrap_or("number of failed transactions: 0");
    assert!(failed.contains(": 0 "), "{text}");
    // The new process serves, and can itself be upgraded later.
    let c = new.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    assert!(std::path::Path::new(control).exists());
}

/// A second Shoal started on an address a running one serves refuses to start, saying why,
/// instead of joining its listening socket's group and taking its clients when it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_cannot_take_a_served_address() {
    let db = unique_db("upg");
    pg().create_database(&db);
    let port = free_port();
    let config = base_config(pg(), &[&db], "").replace(
        "listen = [\"127.0.0.1:0\"]",
        &format!("listen = [\"127.0.0.1:{port}\"]"),
    );
    let first = Shoal::start(&config);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shoal.toml");
    std::fs::write(&path, &config).unwrap();
    let mut second = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("--config")
        .arg(&path)
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("shoal runs");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while second.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            second.kill().unwrap();
            panic!("the second process started on a served address");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let out = second.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "the second process must not run: {text}"
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(
        text.contains("already listening") || text.contains("in use"),
        "{text}"
    );
    // The first goes on serving.
    let c = first.connect(&db).await;
    assert_eq!(simple_rows(&c, "SELECT 1").await, vec!["1"]);
}

/// Upgrade under steady load: 16 long-lived clients run back-to-back transactions (named
/// prepared statements, a session SET) through the upgrade. Each is handed to the new process
/// at a transaction boundary with its session: not one client error, every acknowledged
/// commit is in the ledger exactly once, every commit in the ledger was acknowledged, each
/// client keeps its SET, and the old process leaves as soon as its clients are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_under_steady_load_errs_no_client_and_loses_no_commit() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let db = unique_db("upgrade");
    pg().create_database(&db);
    let setup = direct(&db).await;
    setup
        .batch_execute("CREATE TABLE ledger (client int, seq int, PRIMARY KEY (client, seq))")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap().to_owned();
    let config = with_server_keys(
        &base_config(pg(), &[&db], "[pool]\npool_size = 4\n"),
        "shutdown_timeout = 60",
    );
    let mut old = Shoal::start_with_args(&config, &[], &["--upgrade-socket", &control]);
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for c in 0..16i32 {
        let client = old.connect(&db).await;
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            client
                .batch_execute(&format!("SET application_name = 'ledger-{c}'"))
                .await
                .map_err(|e| format!("client {c}: SET: {e}"))?;
            let insert = client
                .prepare("INSERT INTO ledger VALUES ($1, $2)")
                .await
                .map_err(|e| format!("client {c}: prepare: {e}"))?;
            let mut acked = Vec::new();
            let mut seq = 0i32;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                let run = async {
                    client.batch_execute("BEGIN").await?;
                    client.execute(&insert, &[&c, &seq]).await?;
                    client.batch_execute("COMMIT").await
                };
                run.await
                    .map_err(|e| format!("client {c}: transaction {seq}: {e:?}"))?;
                acked.push(seq);
                if seq % 25 == 0 {
                    let name = client
                        .query_one("SHOW application_name", &[])
                        .await
                        .map_err(|e| format!("client {c}: SHOW: {e}"))?;
                    let name: String = name.get(0);
                    if name != format!("ledger-{c}") {
                        return Err(format!("client {c} lost its SET: {name}"));
                    }
                }
            }
            Ok::<_, String>((c, acked))
        }));
    }
    let running = || async {
        let n: i64 = direct(&db)
            .await
            .query_one("SELECT count(*) FROM ledger", &[])
            .await
            .unwrap()
            .get(0);
        n
    };
    // Load is steady before the upgrade starts.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while running().await < 200 {
        assert!(tokio::time::Instant::now() < deadline, "no load");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let new = Shoal::start_with_args(&config, &[], &["--upgrade-socket", &control]);
    assert_eq!(
        old.wait(Duration::from_secs(30)),
        Some(true),
        "the old process hands its clients over and exits well before shutdown_timeout"
    );
    // Load goes on through the new process alone.
    let after = running().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while running().await < after + 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no load after the upgrade"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut acknowledged = std::collections::BTreeSet::new();
    for w in workers {
        let (c, acked) = w.await.unwrap().unwrap_or_else(|e| panic!("{e}"));
        assert!(!acked.is_empty());
        for s in acked {
            acknowledged.insert((c, s));
        }
    }
    let rows = direct(&db)
        .await
        .query("SELECT client, seq FROM ledger", &[])
        .await
        .unwrap();
    let stored: std::collections::BTreeSet<(i32, i32)> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rows.len(), stored.len(), "no commit twice");
    assert_eq!(
        stored, acknowledged,
        "every acknowledged commit stored, and no stored commit reported failed"
    );
    assert!(new.log_contains("took over") || old.log_contains("took over"));
}

/// Two listen addresses through an upgrade: each address's sockets go to the shards that had
/// them, and both addresses keep serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_keeps_every_listen_address() {
    let db = unique_db("upg");
    pg().create_database(&db);
    let (p1, p2) = (free_port(), free_port());
    let config = base_config(pg(), &[&db], "").replace(
        "listen = [\"127.0.0.1:0\"]",
        &format!("listen = [\"127.0.0.1:{p1}\", \"127.0.0.1:{p2}\"]"),
    );
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap().to_owned();
    let mut old = Shoal::start_with_args(&config, &[], &["--upgrade-socket", &control]);
    let new = Shoal::start_with_args(&config, &[], &["--upgrade-socket", &control]);
    assert_eq!(old.wait(Duration::from_secs(30)), Some(true));
    for port in [p1, p2] {
        for _ in 0..20 {
            let conninfo =
                format!("host=127.0.0.1 port={port} user=app password={APP_PASSWORD} dbname={db}");
            let c = new
                .try_connect(&conninfo)
                .await
                .unwrap_or_else(|e| panic!("port {port}: {e}"));
            assert_eq!(simple_rows(&c, "SELECT 1").await, vec!["1"]);
        }
    }
}

/// A client the new process will not take (its pool is in session mode in the new
/// configuration) stays with the old process, which goes on serving it until it leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_the_new_process_refuses_stays_served() {
    let db = unique_db("upg");
    pg().create_database(&db);
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap().to_owned();
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "shutdown_timeout = 60");
    let mut old = Shoal::start_with_args(&config, &[], &["--upgrade-socket", &control]);
    let client = old.connect(&db).await;
    client
        .batch_execute("SET application_name = 'stays'")
        .await
        .unwrap();
    let session_mode = config.replace("[pool]\n", "[pool]\npool_mode = \"session\"\n");
    assert_ne!(session_mode, config);
    let _new = Shoal::start_with_args(&session_mode, &[], &["--upgrade-socket", &control]);
    for i in 0..20 {
        let v: i32 = client
            .query_one("SELECT $1::int", &[&i])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, i);
    }
    let name: String = client
        .query_one("SHOW application_name", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, "stays");
    assert_eq!(
        old.wait(Duration::from_millis(200)),
        None,
        "still serving its client"
    );
    drop(client);
    assert_eq!(
        old.wait(Duration::from_secs(30)),
        Some(true),
        "leaves once its last client has"
    );
}

/// Realtime sockets through an upgrade: the new process takes the realtime listener, the
/// old one closes its sockets with 1012 (service restart, which the official clients
/// answer by reconnecting), and a socket opened again on the same address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_sockets_are_told_to_reconnect_and_the_new_process_serves_them() {
    use common::phoenix::{Ended, Phx};
    let secret = "upgrade-realtime-jwt-secret-0123456789";
    let data = tempfile::tempdir().unwrap();
    let rt_port = free_port();
    let config = base_config(
        pg(),
        &[],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n[realtime]\nlisten = \"127.0.0.1:{rt_port}\"\n",
            data.path().display()
        ),
    );
    let env = [
        ("SHOAL_API_TOKEN", API_TEST_TOKEN),
        ("API_JWT_SECRET", "unused-secret-0123456789"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap().to_owned();
    let mut old = Shoal::start_with_args(&config, &env, &["--upgrade-socket", &control]);
    let (status, body) = api(
        &old,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(pg(), "app", serde_json::json!({ "jwt_secret": secret })),
    );
    assert_eq!(status, 201, "{body}");
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &serde_json::json!({"role": "anon", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap();
    let rt = old.realtime.expect("realtime listens");
    let mut before = Phx::connect(rt, "acme", &token).await.unwrap();
    assert_eq!(
        before.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );

    let new = Shoal::start_with_args(&config, &env, &["--upgrade-socket", &control]);
    assert_eq!(new.realtime, Some(rt), "the same address");
    match before.ended().await {
        Ended::Closed(Some(f)) => assert_eq!(u16::from(f.code), 1012, "{f:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(old.wait(Duration::from_secs(30)), Some(true));
    let mut a = Phx::connect(rt, "acme", &token).await.unwrap();
    let mut b = Phx::connect(rt, "acme", &token).await.unwrap();
    assert_eq!(
        a.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    assert_eq!(
        b.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    a.broadcast("realtime:room", "hello", serde_json::json!({"n": 1}))
        .await;
    let m = b.until(|m| m["event"] == "broadcast").await;
    assert_eq!(m["payload"]["payload"]["n"], 1, "{m}");
}
