//! Limits on what a database's, tenant's or user's clients may ask: a cap on
//! `statement_timeout` that no client setting lifts, a rate of queries per second that
//! queues or refuses, and a number of transactions at once.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::{Duration, Instant};

use common::*;

fn message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_else(|| e.to_string())
}

/// Shoal in front of a fresh database with `keys` in its section and `extra` appended.
fn limited(prefix: &str, keys: &str, extra: &str) -> (Shoal, String) {
    let db = unique_db(prefix);
    pg().create_database(&db);
    let config = base_config(pg(), &[&db], extra).replace(
        &format!("[databases.{db}]\n"),
        &format!("[databases.{db}]\n{keys}\n"),
    );
    (Shoal::start(&config), db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_setting_lifts_the_statement_timeout_cap() {
    let (s, db) = limited("limit_timeout", "max_statement_timeout = \"1s\"", "");
    let c = s.connect(&db).await;
    assert_eq!(simple_rows(&c, "SHOW statement_timeout").await, ["1s"]);
    let e = c.simple_query("SELECT pg_sleep(3)").await.unwrap_err();
    assert_eq!(code(&e), "57014", "{e:?}");
    assert!(message(&e).contains("statement timeout"), "{e}");
    // A client that lifts its own setting is cancelled by Shoal a second past the cap.
    c.simple_query("SET statement_timeout = 0").await.unwrap();
    let start = Instant::now();
    let e = c.simple_query("SELECT pg_sleep(10)").await.unwrap_err();
    assert_eq!(code(&e), "57014", "{e:?}");
    assert!(
        start.elapsed() < Duration::from_secs(6),
        "{:?}",
        start.elapsed()
    );
    // The client goes on, and quick statements are untouched.
    assert_eq!(simple_rows(&c, "SELECT 1").await, ["1"]);
    // A startup parameter above the cap is held to it.
    let (raised, conn) = tokio_postgres::connect(
        &format!(
            "{} options='-c statement_timeout=0'",
            s.conninfo("app", APP_PASSWORD, &db)
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    assert_eq!(simple_rows(&raised, "SHOW statement_timeout").await, ["1s"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_refuses_or_queues() {
    let (s, db) = limited(
        "limit_rate",
        "rate_limit = 5\nrate_burst = 5\nlimit_wait = \"0s\"",
        "",
    );
    let c = s.connect(&db).await;
    let mut refused = 0;
    for _ in 0..20 {
        if let Err(e) = c.simple_query("SELECT 1").await {
            assert_eq!(code(&e), "53400", "{e:?}");
            assert!(message(&e).contains("rate limit exceeded"), "{e}");
            refused += 1;
        }
    }
    assert!(refused >= 10, "{refused} of 20 refused");
    drop(c);
    drop(s);

    // Queued: ten queries at 5/s with a burst of 5 take about a second, and none fails.
    let (s, db) = limited(
        "limit_rate_queue",
        "rate_limit = 5\nrate_burst = 5\nlimit_wait = \"5s\"",
        "",
    );
    let c = s.connect(&db).await;
    let start = Instant::now();
    for _ in 0..10 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    assert!(
        start.elapsed() >= Duration::from_millis(700),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limit_refuses_or_waits_for_a_running_transaction() {
    let (s, db) = limited(
        "limit_conc",
        "max_concurrency = 1\nlimit_wait = \"0s\"\npool_size = 4",
        "",
    );
    let a = s.connect(&db).await;
    let b = s.connect(&db).await;
    a.simple_query("BEGIN; SELECT 1").await.unwrap();
    let e = b.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&e), "53400", "{e:?}");
    assert!(message(&e).contains("max_concurrency is 1"), "{e}");
    a.simple_query("COMMIT").await.unwrap();
    assert_eq!(simple_rows(&b, "SELECT 2").await, ["2"]);
    drop((a, b, s));

    // Waiting: the second transaction runs once the first ends.
    let (s, db) = limited(
        "limit_conc_wait",
        "max_concurrency = 1\nlimit_wait = \"10s\"\npool_size = 4",
        ADMIN,
    );
    let a = s.connect(&db).await;
    let b = s.connect(&db).await;
    a.simple_query("BEGIN; SELECT 1").await.unwrap();
    let waiting = tokio::spawn(async move { simple_rows(&b, "SELECT 3").await });
    wait_until_waiting(&s).await;
    assert!(!waiting.is_finished());
    a.simple_query("COMMIT").await.unwrap();
    assert_eq!(waiting.await.unwrap(), ["3"]);
}

/// Waits until SHOW LIMITS counts a client waiting for a slot.
async fn wait_until_waiting(s: &Shoal) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (cols, rows) = console_rows(s, "SHOW LIMITS").await;
        let i = cols.iter().position(|c| c == "waiting").unwrap();
        if rows.iter().any(|r| r[i] == "1") {
            return;
        }
        assert!(Instant::now() < deadline, "nobody waits: {rows:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const ADMIN: &str = "[admin]\nusers = [\"admin\"]\n[users.admin]\npassword = \"admin-secret\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_limits_apply_beside_the_databases_and_tenants_get_theirs_through_the_api() {
    let (s, db) = limited(
        "limit_user",
        "limit_wait = \"0s\"",
        &format!("[users.app]\npassword = \"{APP_PASSWORD}\"\nrate_limit = 0.01\nrate_burst = 2\n"),
    );
    let c = s.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    c.simple_query("SELECT 1").await.unwrap();
    let e = c.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&e), "53400", "{e:?}");
    assert!(message(&e).contains("user \"app\""), "{e}");
    let other = s.connect_as("raw", "unused", &db).await;
    assert_eq!(
        simple_rows(&other, "SELECT 4").await,
        ["4"],
        "another user's own budget"
    );

    let (s, _data) = shoal_with_token_api(pg());
    let db = unique_db("limit_tenant");
    pg().create_database(&db);
    let tenant = |extra: serde_json::Value| tenant_body(pg(), &db, extra);
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/lim",
        &tenant(serde_json::json!({"rate_limit": -1})),
    );
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("rate_limit"), "{body}");
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/lim",
        &tenant(serde_json::json!({"max_concurrency": 1, "limit_wait": "0s"})),
    );
    assert_eq!(status, 201, "{body}");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=app.lim password={APP_PASSWORD} dbname=x",
        s.port()
    );
    let a = s.try_connect(&conninfo).await.unwrap();
    let b = s.try_connect(&conninfo).await.unwrap();
    a.simple_query("BEGIN; SELECT 1").await.unwrap();
    let e = b.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&e), "53400", "{e:?}");
    assert!(message(&e).contains("tenant \"lim\""), "{e}");
    a.simple_query("COMMIT").await.unwrap();
    // Lifted live.
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/lim",
        &tenant(serde_json::json!({})),
    );
    assert_eq!(status, 200, "{body}");
    a.simple_query("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(simple_rows(&b, "SELECT 5").await, ["5"]);
    a.simple_query("COMMIT").await.unwrap();
}
