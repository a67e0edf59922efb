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

/// Runs `node SCRIPT ARGS` in `tests/clients/serverless` with `env`; checks it succeeds
/// and prints `expect`.
fn node(script: &str, args: &[&str], env: &[(&str, &str)], expect: &str) {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/serverless"
    );
    let out = std::process::Command::new("node")
        .current_dir(dir)
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("node runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    assert!(text.contains(expect), "{text}");
}

/// Runs the driver's suite (`tests/clients/serverless/neon.mjs`) against a fresh database;
/// `pipeline` is the driver's `pipelineConnect` ("password", its default, or "false").
fn driver_suite(extra: &str, pipeline: &str) {
    let db = unique_db("neon");
    pg().create_database(&db);
    let (shoal, ws) = serverless_shoal(&db, extra);
    // The host and port in the connection string are the driver's to pass to wsProxy;
    // the WebSocket goes to Shoal's front door.
    let dsn = format!(
        "postgresql://app:{APP_PASSWORD}@127.0.0.1:{}/{db}",
        shoal.port()
    );
    node(
        "neon.mjs",
        &[&ws.to_string(), &dsn, "20"],
        &[("NEON_PIPELINE", pipeline)],
        &format!("(pipelineConnect {pipeline}): 20 workers ok"),
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

/// A Shoal with the token API (tenants), the serverless front door with small limits, and
/// metrics; returns it, its store and the front door's address.
fn http_shoal() -> (Shoal, tempfile::TempDir, std::net::SocketAddr) {
    let (s, data) = shoal_with_token_api_and(
        pg(),
        "[serverless]\nlisten = \"127.0.0.1:0\"\nmax_request_size = 4096\nmax_response_size = 65536\nrequest_timeout = \"2s\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    );
    let addr = s.ready_addr("serverless").expect("the serverless listener");
    (s, data, addr)
}

/// A tenant `id` through the API, on a fresh database (pool size 2); returns the database.
fn tenant(s: &Shoal, id: &str, extra: serde_json::Value) -> String {
    let db = unique_db(&format!("neon_{id}"));
    pg().create_database(&db);
    let (status, body) = api(
        s,
        "PUT",
        &format!("/api/tenants/{id}"),
        &tenant_body(pg(), &db, extra),
    );
    assert_eq!(status, 201, "{body}");
    db
}

/// Both of the driver's modes against a tenant created through the API: HTTP (`neon()`,
/// `transaction()`: `tests/clients/serverless/neon-http.mjs`) and WebSocket (`neon.mjs`).
#[test]
fn neons_driver_over_http_and_websocket_for_an_api_tenant() {
    let (s, _data, addr) = http_shoal();
    let db = tenant(&s, "edge", serde_json::json!({}));
    let dsn = format!(
        "postgresql://app.edge:{APP_PASSWORD}@127.0.0.1:{}/{db}",
        s.port()
    );
    node(
        "neon-http.mjs",
        &[&addr.to_string(), &dsn],
        &[],
        "over HTTP: ok",
    );
    node(
        "neon.mjs",
        &[&addr.to_string(), &dsn, "4"],
        &[],
        "(pipelineConnect password): 4 workers ok",
    );
    // A hundred concurrent one-shot queries shared the tenant's two servers.
    assert!(pg().servers(&db) <= 2, "more servers than the pool's 2");
}

/// With a certificate in `[tls]`, the driver's `wss://` and `https://`, the certificate the
/// pooler serves to TCP clients; `client_tls = "require"` holds for the front door too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn neons_driver_over_tls() {
    let (ca, cert, key) = ca_and_server_cert();
    let files = tempfile::tempdir().unwrap();
    let path = |name: &str, pem: &str| {
        let p = files.path().join(name);
        std::fs::write(&p, pem).unwrap();
        p.display().to_string()
    };
    let (ca, cert, key) = (
        path("ca.pem", &ca),
        path("cert.pem", &cert),
        path("key.pem", &key),
    );
    let db = unique_db("neon_tls");
    pg().create_database(&db);
    let (shoal, door) = serverless_shoal(
        &db,
        &format!("[tls]\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\nclient_tls = \"require\"\n"),
    );
    let target = format!("localhost:{}", door.port());
    let dsn = format!(
        "postgresql://app:{APP_PASSWORD}@localhost:{}/{db}",
        shoal.port()
    );
    let env = [("NEON_TLS", "1"), ("NODE_EXTRA_CA_CERTS", ca.as_str())];
    node(
        "neon.mjs",
        &[&target, &dsn, "4"],
        &env,
        "(pipelineConnect password): 4 workers ok",
    );
    node("neon-http.mjs", &[&target, &dsn], &env, "over HTTP: ok");
    // Plain text from loopback reaches the login, which requires TLS.
    let plain = format!("postgresql://app:{APP_PASSWORD}@h/{db}");
    let (status, body) = post(
        door,
        &[("Neon-Connection-String", plain.as_str())],
        r#"{"query": "SELECT 1"}"#,
    )
    .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("28000")),
        "{body}"
    );
}

/// A token for `sub` with `role`, expiring `exp_in` seconds from now, signed with `secret`.
fn signed(secret: &str, role: &str, sub: &str, exp_in: i64) -> String {
    let now = common::changes::now();
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": role, "sub": sub, "exp": now + exp_in}),
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

/// Bearer tokens (the driver's `authToken`): checked with the tenant's `jwt_secret`, each
/// query runs with the token's role and claims, so row-level security decides what it sees
/// (`tests/clients/serverless/neon-claims.mjs`, with the real driver); forged, expired and
/// malformed tokens are refused with clear answers that never echo them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_run_queries_under_their_claims() {
    const SECRET: &str = "serverless-claims-jwt-secret-0123456789";
    let (s, _data, addr) = http_shoal();
    let db = tenant(&s, "claims", serde_json::json!({"jwt_secret": SECRET}));
    let role = "shoal_http_reader";
    pg().psql_admin(&format!(
        "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN \
         CREATE ROLE {role} NOLOGIN; END IF; END $$; GRANT {role} TO app"
    ));
    common::changes::run_sql(
        pg(),
        &db,
        &format!(
            "CREATE TABLE notes (owner text, body text); \
             INSERT INTO notes VALUES ('alice', 'a1'), ('alice', 'a2'), ('bob', 'b1'); \
             ALTER TABLE notes ENABLE ROW LEVEL SECURITY; \
             CREATE POLICY mine ON notes FOR SELECT \
               USING (owner = current_setting('request.jwt.claims', true)::json->>'sub'); \
             GRANT SELECT ON notes TO {role}"
        ),
    );
    let dsn = format!("postgresql://app.claims:{APP_PASSWORD}@127.0.0.1/{db}");
    let (alice, bob) = (
        signed(SECRET, role, "alice", 3600),
        signed(SECRET, role, "bob", 3600),
    );
    let forged = signed(
        "not-the-tenants-secret-0123456789abcdef",
        role,
        "alice",
        3600,
    );
    node(
        "neon-claims.mjs",
        &[&addr.to_string(), &dsn, role, &alice, &bob, &forged],
        &[],
        "with authToken: ok",
    );

    let ask = |authorization: String| {
        let dsn = dsn.clone();
        async move {
            let headers = [
                ("Neon-Connection-String", dsn.as_str()),
                ("Authorization", authorization.as_str()),
            ];
            post(
                addr,
                &headers,
                r#"{"query": "SELECT body FROM notes", "params": []}"#,
            )
            .await
        }
    };
    let expired = signed(SECRET, role, "alice", -60);
    let (status, body) = ask(format!("Bearer {expired}")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("28000")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("expired") && !message.contains(&expired),
        "{body}"
    );
    let (status, body) = ask("Basic YXBwOnNlY3JldA==".into()).await;
    assert_eq!(status, 400, "{body}");
    assert!(!body.to_string().contains("YXBw"), "{body}");
    // A wrong password is refused whatever the token says.
    let headers = [
        (
            "Neon-Connection-String",
            format!("postgresql://app.claims:wrong@127.0.0.1/{db}"),
        ),
        ("Authorization", format!("Bearer {alice}")),
    ];
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (status, body) = post(addr, &headers, r#"{"query": "SELECT 1", "params": []}"#).await;
    assert_eq!(status, 401, "{body}");
}

/// POSTs `body` to the front door's `/sql` with `headers`; (status, JSON body).
async fn post(
    addr: std::net::SocketAddr,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, serde_json::Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = format!(
        "POST /sql HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), tcp.read_to_end(&mut reply))
        .await
        .expect("an answer within 20 s")
        .unwrap();
    let reply = String::from_utf8_lossy(&reply).to_string();
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_queries_get_clear_answers_and_keep_tenants_apart() {
    let (s, _data, addr) = http_shoal();
    let a = tenant(&s, "ta", serde_json::json!({}));
    let b = tenant(&s, "tb", serde_json::json!({}));
    tenant(
        &s,
        "lim",
        serde_json::json!({"max_concurrency": 1, "limit_wait": "0s"}),
    );
    let dsn =
        |user: &str, password: &str, db: &str| format!("postgresql://{user}:{password}@h/{db}");
    let (ta, tb) = (
        dsn("app.ta", APP_PASSWORD, &a),
        dsn("app.tb", APP_PASSWORD, &b),
    );
    let q = |sql: &str| serde_json::json!({"query": sql, "params": []}).to_string();
    let arrays = [
        ("Neon-Array-Mode", "true"),
        ("Neon-Raw-Text-Output", "true"),
    ];
    let with = |conn: &str| -> Vec<(String, String)> {
        std::iter::once(("Neon-Connection-String".to_owned(), conn.to_owned()))
            .chain(arrays.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    };
    async fn send(
        addr: std::net::SocketAddr,
        headers: &[(String, String)],
        body: &str,
    ) -> (u16, serde_json::Value) {
        let h: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        post(addr, &h, body).await
    }

    // Each tenant sees its own database only.
    for (conn, mark) in [(&ta, "a"), (&tb, "b")] {
        let create = format!("CREATE TABLE mark AS SELECT '{mark}'::text AS m");
        assert_eq!(send(addr, &with(conn), &q(&create)).await.0, 200);
    }
    for (conn, mark) in [(&ta, "a"), (&tb, "b")] {
        let (status, body) = send(addr, &with(conn), &q("SELECT m FROM mark")).await;
        assert_eq!((status, &body["rows"]), (200, &serde_json::json!([[mark]])));
    }
    // Objects and JSON values without Neon's headers.
    let plain = [("Neon-Connection-String".to_owned(), ta.clone())];
    let (status, body) = send(
        addr,
        &plain,
        &q("SELECT 1 AS n, true AS t, '{\"k\": 1}'::jsonb AS j, 2::bigint AS big"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rows"],
        serde_json::json!([{"n": 1, "t": true, "j": {"k": 1}, "big": "2"}])
    );
    // Arrays as JSON arrays, each element by its type, as PostgreSQL writes them.
    let (status, body) = send(
        addr,
        &plain,
        &q(
            "SELECT ARRAY[1, NULL]::int[] AS i, ARRAY['a b', 'NULL', NULL, 'q\"\\']::text[] AS t, \
            '[0:1][1:2]={{1.5,NaN},{3,4}}'::float8[] AS f, ARRAY['{\"k\": [1]}']::jsonb[] AS j, \
            ARRAY[10000000000]::bigint[] AS big, '{}'::bool[] AS e",
        ),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["rows"],
        serde_json::json!([{
            "i": [1, null],
            "t": ["a b", "NULL", null, "q\"\\"],
            "f": [[1.5, "NaN"], [3.0, 4.0]],
            "j": [{"k": [1]}],
            "big": ["10000000000"],
            "e": []
        }])
    );

    // Malformed requests: 400 with a message that says what is wrong.
    let (status, body) = post(addr, &[], &q("SELECT 1")).await;
    assert_eq!(status, 400);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("Neon-Connection-String"),
        "{body}"
    );
    let (status, body) = send(addr, &with(&ta), "{\"query\": ").await;
    assert_eq!(status, 400);
    assert!(body["message"].as_str().unwrap().contains("JSON"), "{body}");
    let (status, _) = send(addr, &with("mysql://u:p@h/d"), &q("SELECT 1")).await;
    assert_eq!(status, 400);
    // Too large a body: 413.
    let big = q(&format!("SELECT '{}'", "x".repeat(5000)));
    assert_eq!(send(addr, &with(&ta), &big).await.0, 413);
    // Bad password: 401; unknown tenant: 404; neither reaches a server.
    let (status, body) = send(addr, &with(&dsn("app.ta", "wrong", &a)), &q("SELECT 1")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("28P01")),
        "{body}"
    );
    let (status, body) = send(
        addr,
        &with(&dsn("app.nope", APP_PASSWORD, &a)),
        &q("SELECT 1"),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    // A bearer token (the driver's authToken) for a tenant without keys to check it with is
    // refused, not ignored, and never echoed.
    let mut bearer = with(&ta);
    bearer.push((
        "Authorization".into(),
        "Bearer eyJ.secret-claims.sig".into(),
    ));
    let (status, body) = send(addr, &bearer, &q("SELECT 1")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("28000")),
        "{body}"
    );
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("authToken")
            && message.contains("jwt_secret")
            && !message.contains("secret-claims"),
        "{body}"
    );
    // A statement's error: 400 with PostgreSQL's fields.
    let (status, body) = send(addr, &with(&ta), &q("SELEC 1")).await;
    assert_eq!(
        (status, body["code"].as_str(), body["position"].as_str()),
        (400, Some("42601"), Some("1")),
        "{body}"
    );

    // Over the tenant's limit: 429, while a TCP client holds its one place.
    let tcp = s
        .try_connect(&s.conninfo("app.lim", APP_PASSWORD, "x"))
        .await
        .unwrap();
    tcp.simple_query("BEGIN; SELECT 1").await.unwrap();
    let lim = dsn("app.lim", APP_PASSWORD, "x");
    let (status, body) = send(addr, &with(&lim), &q("SELECT 1")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (429, Some("53400")),
        "{body}"
    );
    tcp.simple_query("COMMIT").await.unwrap();
    assert_eq!(send(addr, &with(&lim), &q("SELECT 1")).await.0, 200);

    // Too large an answer: 507, the statement stopped, the pool still serves.
    let (status, body) = send(
        addr,
        &with(&ta),
        &q("SELECT repeat('x', 1000) FROM generate_series(1, 100000)"),
    )
    .await;
    assert_eq!(status, 507, "{body}");
    // Past the request timeout: 504, and the statement is cancelled (not left to run).
    let (status, body) = send(addr, &with(&ta), &q("SELECT pg_sleep(30)")).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (504, Some("57014")),
        "{body}"
    );
    eventually("the timed-out statement cancelled", Duration::from_secs(10), || {
        pg().psql_admin(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{a}' AND state = 'active' AND query LIKE 'SELECT pg_sleep%'"
        )) == "0"
    })
    .await;
    let (status, body) = send(addr, &with(&ta), &q("SELECT m FROM mark")).await;
    assert_eq!((status, &body["rows"]), (200, &serde_json::json!([["a"]])));
    assert!(pg().servers(&a) <= 2, "more servers than the pool's 2");

    // Counted per transport and status.
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", s.metrics.unwrap())])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&metrics.stdout);
    for (status, n) in [
        ("400", 4),
        ("401", 2),
        ("404", 1),
        ("413", 1),
        ("429", 1),
        ("504", 1),
        ("507", 1),
    ] {
        let line = format!("shoal_serverless_http_requests_total{{status=\"{status}\"}} {n}");
        assert!(text.contains(&line), "{line} in:\n{text}");
    }
}

/// Clients logged in now, from `/metrics`.
fn logged_in_clients(s: &Shoal) -> u64 {
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", s.metrics.unwrap())])
        .output()
        .unwrap();
    String::from_utf8_lossy(&metrics.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("shoal_clients{} "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "no shoal_clients in {}",
                String::from_utf8_lossy(&metrics.stdout)
            )
        })
}

/// A session an HTTP query left clean serves the next query with the same connection
/// string (no new login); one that changed session state is never served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_sessions_are_kept_only_when_clean() {
    let (s, _data, addr) = http_shoal();
    let db = tenant(&s, "warm", serde_json::json!({}));
    let conn = format!("postgresql://app.warm:{APP_PASSWORD}@h/{db}");
    let headers = [
        ("Neon-Connection-String", conn.as_str()),
        ("Neon-Array-Mode", "true"),
        ("Neon-Raw-Text-Output", "true"),
    ];
    let q = |sql: &str| serde_json::json!({ "query": sql }).to_string();
    let path = q("SELECT current_setting('search_path')");
    let (status, body) = post(addr, &headers, &path).await;
    assert_eq!(status, 200, "{body}");
    let default_path = body["rows"][0][0].clone();
    for _ in 0..5 {
        assert_eq!(post(addr, &headers, &q("SELECT 1")).await.0, 200);
    }
    assert_eq!(
        logged_in_clients(&s),
        1,
        "one session served all six queries"
    );
    // A query that changes the session: its session ends, the next query gets a fresh one.
    let (status, body) = post(addr, &headers, &q("SET search_path TO nowhere")).await;
    assert_eq!(status, 200, "{body}");
    eventually("the changed session ended", Duration::from_secs(10), || {
        logged_in_clients(&s) == 0
    })
    .await;
    let (status, body) = post(addr, &headers, &path).await;
    assert_eq!(
        (status, &body["rows"][0][0]),
        (200, &default_path),
        "{body}"
    );
    // Another password of the same user finds no kept session: it logs in, and fails.
    let wrong = format!("postgresql://app.warm:wrong@h/{db}");
    let (status, _) = post(
        addr,
        &[("Neon-Connection-String", wrong.as_str())],
        &q("SELECT 1"),
    )
    .await;
    assert_eq!(status, 401);
}

/// Sessions kept for the next HTTP query never cost a real client its place: a login that
/// `max_client_conn` (the server's, or a tenant's per pool) would refuse ends them first,
/// and the limits still hold once none are left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_http_sessions_make_room_for_clients() {
    let data = tempfile::tempdir().unwrap();
    let config = base_config(
        pg(),
        &[],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
             [serverless]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
            data.path().display()
        ),
    );
    let s = Shoal::start_with_env(
        &with_server_keys(&config, "max_client_conn = 3"),
        &[
            ("SHOAL_API_TOKEN", API_TEST_TOKEN),
            ("API_JWT_SECRET", "unused-secret-0123456789"),
        ],
    );
    let addr = s.ready_addr("serverless").expect("the serverless listener");
    let db = tenant(&s, "room", serde_json::json!({"default_max_clients": 2}));
    let other = tenant(&s, "other", serde_json::json!({}));
    let http = |app_name: &str| {
        let conn =
            format!("postgresql://app.room:{APP_PASSWORD}@h/{db}?application_name={app_name}");
        async move {
            let (status, body) = post(
                addr,
                &[("Neon-Connection-String", conn.as_str())],
                r#"{"query": "SELECT 1 AS one", "params": []}"#,
            )
            .await;
            assert_eq!(
                (status, &body["rows"][0]["one"]),
                (200, &serde_json::json!(1)),
                "{body}"
            );
        }
    };
    // Two connection strings (application names differ): two sessions kept, the pool's
    // max_client_conn (2) reached.
    http("a").await;
    http("b").await;
    assert_eq!(logged_in_clients(&s), 2, "both sessions kept");
    // A third is let in: the kept ones made room.
    http("c").await;
    eventually("the kept sessions left", Duration::from_secs(10), || {
        logged_in_clients(&s) == 1
    })
    .await;
    http("d").await;
    assert_eq!(logged_in_clients(&s), 2);
    // The server's max_client_conn (3): TCP clients of another tenant get in past the two
    // kept sessions, and the limit holds once no kept session is left.
    let tcp = |n: u32| {
        let s = &s;
        let other = &other;
        async move {
            let c = s
                .try_connect(&s.conninfo("app.other", APP_PASSWORD, other))
                .await;
            c.map(|c| (n, c))
        }
    };
    let mut clients = Vec::new();
    for n in 0..3 {
        let (_, c) = tcp(n)
            .await
            .unwrap_or_else(|e| panic!("TCP client {n}: {e}"));
        assert_eq!(simple_rows(&c, "SELECT 1").await, vec!["1".to_string()]);
        clients.push(c);
    }
    let Err(refused) = tcp(3).await else {
        panic!("a fourth client is over max_client_conn");
    };
    assert_eq!(code(&refused), "53300", "{refused}");
}
