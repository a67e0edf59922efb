//! Operating Shoal: `/metrics` read by the reference Prometheus parser while traffic moves
//! its values, `/health` and `/ready`.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::{Command, Stdio};

use common::*;
use serde_json::Value;

/// Fetches `url` with curl: (status, body).
fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", url]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = cmd.output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The samples of an exposition, as parsed by Python's `prometheus_client`.
fn parse(text: &str) -> Vec<(String, serde_json::Map<String, Value>, f64)> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/ops/parse_metrics.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the exposition does not parse: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Vec<(String, serde_json::Map<String, Value>, f64)> =
        serde_json::from_slice(&out.stdout).unwrap();
    v
}

fn sample(
    samples: &[(String, serde_json::Map<String, Value>, f64)],
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).and_then(Value::as_str) == Some(*v))
        })
        .map(|(_, _, v)| *v)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_traffic_and_parse() {
    let db = unique_db("metrics");
    pg().create_database(&db);
    let config = base_config(
        pg(),
        &[&db],
        "[metrics]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_TEST_METRICS_TOKEN\"\n",
    );
    let shoal = Shoal::start_with_env(&config, &[("SHOAL_TEST_METRICS_TOKEN", "scrape-me")]);
    let base = format!("http://{}", shoal.metrics.expect("metrics listener"));
    assert_eq!(
        get(&format!("{base}/metrics"), None).0,
        401,
        "the token is required"
    );
    let scrape = || {
        let (code, text) = get(&format!("{base}/metrics"), Some("scrape-me"));
        assert_eq!(code, 200);
        parse(&text)
    };
    let c = shoal.connect(&db).await;
    for _ in 0..20 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    c.batch_execute("BEGIN; SELECT 1; SELECT 2; COMMIT")
        .await
        .unwrap();
    let _ = c.simple_query("SELEKT").await.expect_err("a syntax error");
    let rows = c.simple_query("SELECT repeat('x', 100000)").await.unwrap();
    assert!(!rows.is_empty());
    let _ = shoal
        .try_connect(&shoal.conninfo("app", "wrong-password", &db))
        .await
        .expect_err("a wrong password");
    let pool = [("database", db.as_str()), ("user", "app")];
    let s = scrape();
    assert!(sample(&s, "shoal_pool_transactions_total", &pool) >= 22.0);
    assert!(sample(&s, "shoal_pool_queries_total", &pool) >= 23.0);
    assert!(sample(&s, "shoal_pool_bytes_sent_total", &pool) >= 100_000.0);
    assert!(sample(&s, "shoal_pool_bytes_received_total", &pool) > 0.0);
    assert_eq!(
        sample(
            &s,
            "shoal_pool_errors_total",
            &[("database", &db), ("class", "42")]
        ),
        1.0
    );
    assert_eq!(sample(&s, "shoal_pool_clients", &pool), 1.0);
    assert!(sample(&s, "shoal_pool_servers", &pool) >= 1.0);
    assert!(sample(&s, "shoal_pool_query_seconds_count", &pool) >= 23.0);
    assert!(sample(&s, "shoal_pool_transaction_seconds_count", &pool) >= 22.0);
    assert!(sample(&s, "shoal_pool_wait_seconds_count", &pool) >= 22.0);
    assert!(sample(&s, "shoal_connections_accepted_total", &[]) >= 2.0);
    assert_eq!(
        sample(
            &s,
            "shoal_connections_rejected_total",
            &[("reason", "auth")]
        ),
        1.0
    );
    assert_eq!(sample(&s, "shoal_auth_failures_total", &[]), 1.0);
    assert!(sample(&s, "shoal_open_fds", &[]) > 3.0);
    assert!(sample(&s, "shoal_resident_memory_bytes", &[]) > 1_000_000.0);
    // More traffic moves the counters.
    for _ in 0..5 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    let later = scrape();
    assert_eq!(
        sample(&later, "shoal_pool_queries_total", &pool),
        sample(&s, "shoal_pool_queries_total", &pool) + 5.0
    );
    drop(c);
    eventually(
        "the client leaves",
        std::time::Duration::from_secs(5),
        || sample(&scrape(), "shoal_pool_clients", &pool) == 0.0,
    )
    .await;
    // Health and readiness.
    assert_eq!(get(&format!("{base}/health"), None).0, 200);
    let (code, body) = get(&format!("{base}/ready"), None);
    assert_eq!(code, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_reports_an_unreachable_upstream() {
    let dead = free_port();
    let config = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
         [databases.gone]\nhost = \"127.0.0.1\"\nport = {dead}\n[users.app]\npassword = \"x\"\n"
    );
    let shoal = Shoal::start(&config);
    let base = format!("http://{}", shoal.metrics.unwrap());
    let (code, body) = get(&format!("{base}/ready"), None);
    assert_eq!(code, 503);
    assert!(body.contains("gone"), "{body}");
    assert_eq!(get(&format!("{base}/health"), None).0, 200);
}

/// SIGHUP re-reads the config file under load: a pool size changes in place, a new user can
/// log in, running clients see no error; an invalid file is refused and the old config stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load() {
    let db = unique_db("reload");
    pg().create_database(&db);
    let metrics = "[metrics]\nlisten = \"127.0.0.1:0\"\n";
    let shoal = Shoal::start(&base_config(
        pg(),
        &[&db],
        &format!("[pool]\npool_size = 2\n{metrics}"),
    ));
    let path = shoal.config_dir.path().join("shoal.toml");
    let base = format!("http://{}", shoal.metrics.unwrap());
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(shoal.connect(&db).await);
    }
    let traffic = common::traffic::Traffic::start(clients, "SELECT pg_sleep(0.001)");
    traffic.wait_for(50).await;
    let size = || {
        let (_, text) = get(&format!("{base}/metrics"), None);
        sample(
            &parse(&text),
            "shoal_pool_size",
            &[("database", db.as_str())],
        )
    };
    assert_eq!(size(), 2.0);
    // A bigger pool and a new user.
    let mut next = base_config(pg(), &[&db], &format!("[pool]\npool_size = 5\n{metrics}"));
    next.push_str(&format!(
        "[users.newbie]\npassword = \"newbie-secret\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n"
    ));
    std::fs::write(&path, &next).unwrap();
    shoal.signal(libc::SIGHUP);
    eventually("the reload", std::time::Duration::from_secs(10), || {
        shoal.log_contains("configuration reloaded")
    })
    .await;
    eventually("the resize", std::time::Duration::from_secs(10), || {
        size() == 5.0
    })
    .await;
    let newbie = shoal.connect_as("newbie", "newbie-secret", &db).await;
    newbie.simple_query("SELECT 1").await.unwrap();
    traffic.wait_for(50).await;
    // An invalid file: refused, the running config stays.
    std::fs::write(&path, "[pool]\npool_size = \"many\"\n").unwrap();
    shoal.signal(libc::SIGHUP);
    eventually("the refusal", std::time::Duration::from_secs(10), || {
        shoal.log_contains("configuration not reloaded")
    })
    .await;
    let again = shoal.connect_as("newbie", "newbie-secret", &db).await;
    again.simple_query("SELECT 1").await.unwrap();
    traffic.wait_for(20).await;
    let failures = traffic.stop().await;
    assert!(
        failures.is_empty(),
        "clients failed during reloads: {failures:?}"
    );
}

/// JSON logs: every line an object; logins and disconnections with their reason; slow
/// queries and pool exhaustion warned about (rate-limited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_with_connections_slow_queries_and_exhaustion() {
    let db = unique_db("logs");
    pg().create_database(&db);
    let config = base_config(
        pg(),
        &[&db],
        "[pool]\npool_size = 1\nslow_query_threshold = 0.05\nquery_wait_timeout = 10\n",
    );
    let shoal = Shoal::start_with_env(&config, &[("SHOAL_LOG_FORMAT", "json")]);
    let a = shoal.connect(&db).await;
    let b = shoal.connect(&db).await;
    let (ra, rb) = tokio::join!(
        a.simple_query("SELECT pg_sleep(0.2)"),
        b.simple_query("SELECT pg_sleep(0.2)")
    );
    ra.unwrap();
    rb.unwrap();
    // Many slow queries, one warning per second at most.
    for _ in 0..3 {
        a.simple_query("SELECT pg_sleep(0.06)").await.unwrap();
    }
    drop(a);
    eventually(
        "the disconnection is logged",
        std::time::Duration::from_secs(5),
        || shoal.log_contains("client disconnected"),
    )
    .await;
    let lines: Vec<String> = shoal.log.lock().unwrap().clone();
    let parsed: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let with = |msg: &str| -> Vec<&Value> {
        parsed
            .iter()
            .filter(|v| v["fields"]["message"].as_str() == Some(msg))
            .collect()
    };
    assert!(!with("client logged in").is_empty());
    let gone = with("client disconnected");
    assert_eq!(gone[0]["fields"]["reason"], "client left");
    assert!(!with("pool exhausted: clients are waiting for a server").is_empty());
    let slow = with("slow query");
    assert!(
        !slow.is_empty() && slow.len() <= 2,
        "rate-limited: {}",
        slow.len()
    );
    assert_eq!(slow[0]["level"], "WARN");
}

/// A database name made to break the exposition (a quote, a newline, a forged series, a
/// backslash) stays inside its label value: the scrape parses, nothing is injected, and the
/// label reads back exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_cannot_break_or_forge_metrics() {
    let db = unique_db("metrics");
    pg().create_database(&db);
    let hostile = "x\"} 1\nshoal_injected_total{a=\"b\\";
    let toml_key = hostile
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let config = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[metrics]\nlisten = \"127.0.0.1:0\"\n\
         [databases.\"{toml_key}\"]\nhost = \"127.0.0.1\"\nport = {}\ndbname = \"{db}\"\n\
         [users.raw]\nauth_method = \"trust\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n",
        pg().port
    );
    let shoal = Shoal::start(&config);
    let base = format!("http://{}", shoal.metrics.expect("metrics listener"));
    let (client, conn) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(shoal.port())
        .user("raw")
        .dbname(hostile)
        .connect(tokio_postgres::NoTls)
        .await
        .expect("login to the oddly named database");
    tokio::spawn(conn);
    client.simple_query("SELECT 1").await.unwrap();
    let (code, text) = get(&format!("{base}/metrics"), None);
    assert_eq!(code, 200);
    let s = parse(&text);
    assert!(
        s.iter().all(|(n, _, _)| !n.starts_with("shoal_injected")),
        "a series was forged:\n{text}"
    );
    assert_eq!(
        sample(&s, "shoal_pool_clients", &[("database", hostile)]),
        1.0,
        "{text}"
    );
}

/// Logs written to a pipe carry no colour escapes unless asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_to_a_pipe_are_plain_text() {
    let db = unique_db("logs");
    pg().create_database(&db);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shoal.toml");
    std::fs::write(&path, base_config(pg(), &[&db], "")).unwrap();
    for (flag, coloured) in [("auto", false), ("never", false), ("always", true)] {
        let ready = dir.path().join(format!("ready-{flag}"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_shoal"))
            .arg("--config")
            .arg(&path)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--log-color", flag])
            .env_remove("NO_COLOR")
            .env("SHOAL_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        eventually("shoal listens", std::time::Duration::from_secs(30), || {
            ready.exists()
        })
        .await;
        child.kill().unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("INFO"), "{flag}: {text}");
        assert_eq!(text.contains('\u{1b}'), coloured, "{flag}: {text:?}");
    }
}
