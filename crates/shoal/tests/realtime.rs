//! The realtime service through Supabase's official clients (`tests/clients/realtime`):
//! realtime-js 2.119.1 on Node.js with the `ws` transport, and `realtime` 2.34.1 for
//! Python. Clients subscribe, broadcast (in protocol 2.0, 1.0 and across them), see each
//! other's presence, broadcast over HTTP and refresh their tokens; a channel's token
//! expiring or going bad shuts it with Realtime's message; a request with a bad, expired
//! or missing token, or for an unknown tenant, is refused before the upgrade.
#![allow(clippy::disallowed_methods)]

mod common;

use std::net::SocketAddr;
use std::process::Command;

use common::*;

const SECRET: &str = "acme-realtime-jwt-secret-0123456789";

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn token(secret: &str, exp_in: i64) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": "authenticated", "exp": now() + exp_in}),
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

const CLIENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/realtime/");

fn realtime_shoal() -> (Shoal, tempfile::TempDir, SocketAddr) {
    let (s, data) = shoal_with_token_api_and(pg(), "[realtime]\nlisten = \"127.0.0.1:0\"\n");
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(pg(), "app", serde_json::json!({ "jwt_secret": SECRET })),
    );
    assert_eq!(status, 201, "{body}");
    assert!(
        body.get("jwt_secret").is_none(),
        "the secret is never given back: {body}"
    );
    let rt = s.realtime.expect("realtime listens");
    (s, data, rt)
}

/// Runs a realtime-js script of `tests/clients/realtime`; its one line of JSON.
fn run_js(script: &str, rt: SocketAddr, token: &str, vsn: &str) -> serde_json::Value {
    run_client(
        Command::new("node").arg(format!("{CLIENTS}{script}")),
        rt,
        token,
        &[("RT_VSN", vsn)],
    )
}

/// Runs a client script with the endpoint and token in its environment, and `env`.
fn run_client(
    cmd: &mut Command,
    rt: SocketAddr,
    token: &str,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let out = cmd
        .env("RT_URL", format!("ws://{rt}/t/acme/realtime/v1"))
        .env("RT_TOKEN", token)
        .envs(env.iter().copied())
        .output()
        .expect("the client runs");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "no JSON from realtime-js ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_js_clients_subscribe_and_broadcast_in_both_versions() {
    let (_s, _data, rt) = realtime_shoal();
    for vsn in ["2.0.0", "1.0.0"] {
        let r = run_js("broadcast.mjs", rt, &token(SECRET, 3600), vsn);
        assert_eq!(r["ack"], "ok", "{vsn}: {r}");
        let payload = serde_json::json!({"text": "héllo", "n": 1});
        for who in ["seenByA", "seenByB"] {
            let m = &r[who][0];
            assert_eq!(m["event"], "greeting", "{vsn} {who}: {r}");
            assert_eq!(m["payload"], payload, "{vsn} {who}: {r}");
        }
    }
}

/// A patch of another field keeps the tenant's write-only `jwt_secret` (it is never read
/// back, so a patch built from what GET shows does not carry it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_keeps_the_jwt_secret_it_does_not_name() {
    let (s, _data, rt) = realtime_shoal();
    let (status, body) = api(
        &s,
        "PATCH",
        "/api/tenants/acme",
        &serde_json::json!({"tenant": {"default_max_clients": 500}}),
    );
    assert_eq!(status, 200, "{body}");
    let r = run_js("broadcast.mjs", rt, &token(SECRET, 3600), "2.0.0");
    assert_eq!(r["ack"], "ok", "the secret still verifies tokens: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_js_clients_see_each_other_present_and_leaving() {
    let (_s, _data, rt) = realtime_shoal();
    for vsn in ["2.0.0", "1.0.0"] {
        let r = run_js("presence.mjs", rt, &token(SECRET, 3600), vsn);
        assert_eq!(r["tracked"], serde_json::json!(["ok", "ok"]), "{vsn}: {r}");
        assert_eq!(r["seenByB"]["alice"][0]["name"], "Alice", "{vsn}: {r}");
        assert_eq!(r["seenByB"]["bob"][0]["name"], "Bob", "{vsn}: {r}");
        assert_eq!(r["leftOfB"], serde_json::json!(["alice"]), "{vsn}: {r}");
        assert_eq!(r["after"], serde_json::json!(["bob"]), "{vsn}: {r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcasts_over_http_reach_subscribers() {
    let (_s, _data, rt) = realtime_shoal();
    let r = run_js("rest.mjs", rt, &token(SECRET, 3600), "2.0.0");
    assert_eq!(r["single"], serde_json::json!({"success": true}), "{r}");
    assert_eq!(r["batch"], "ok", "{r}");
    assert_eq!(
        r["got"],
        serde_json::json!([
            {"event": "batch", "payload": {"m": 1}},
            {"event": "poke", "payload": {"n": 7}},
        ]),
        "{r}"
    );
    // Refused without the tenant's token, or with a body that is not a batch.
    let post = |auth: &str, body: &str| {
        let out = Command::new("curl")
            .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", "POST"])
            .args([
                "-H",
                auth,
                "-H",
                "Content-Type: application/json",
                "-d",
                body,
            ])
            .arg(format!("http://{rt}/t/acme/realtime/v1/api/broadcast"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.rsplit_once('\n')
            .map(|(_, c)| c.trim().to_owned())
            .unwrap_or_default()
    };
    let good = format!("apikey: {}", token(SECRET, 3600));
    assert_eq!(post("X-None: 1", r#"{"messages":[]}"#), "401");
    assert_eq!(
        post(
            &format!("apikey: {}", token("wrong", 60)),
            r#"{"messages":[]}"#
        ),
        "401"
    );
    assert_eq!(post(&good, r#"{"nope":1}"#), "422");
    assert_eq!(
        post(
            &good,
            r#"{"messages":[{"topic":"room","event":"e","payload":{}}]}"#
        ),
        "202"
    );
}

/// The HTTP status and body of a WebSocket upgrade request to `path`.
fn upgrade(rt: SocketAddr, path: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "5"])
        .args(["-H", "Connection: Upgrade", "-H", "Upgrade: websocket"])
        .args(["-H", "Sec-WebSocket-Version: 13"])
        .args(["-H", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="])
        .arg(format!("http://{rt}{path}"))
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_and_unknown_tenants_are_refused_before_the_upgrade() {
    let (_s, _data, rt) = realtime_shoal();
    let good = token(SECRET, 3600);
    let (code_, _) = upgrade(
        rt,
        &format!("/t/acme/realtime/v1/websocket?vsn=2.0.0&apikey={good}"),
    );
    assert_eq!(code_, 101, "a good token upgrades");
    for (path, want, says) in [
        (
            "/t/acme/realtime/v1/websocket?vsn=2.0.0".to_owned(),
            401,
            r#"{"error":"API key is missing"}"#,
        ),
        (
            format!(
                "/t/acme/realtime/v1/websocket?vsn=2.0.0&apikey={}",
                token("wrong", 3600)
            ),
            401,
            "Failed to validate JWT signature",
        ),
        (
            "/t/acme/realtime/v1/websocket?vsn=2.0.0&apikey=not-a-jwt".to_owned(),
            401,
            "The token provided is not a valid JWT",
        ),
        (
            format!(
                "/t/acme/realtime/v1/websocket?vsn=2.0.0&apikey={}",
                token(SECRET, -60)
            ),
            401,
            "Token has expired",
        ),
        (
            format!("/t/nobody/socket/websocket?vsn=2.0.0&apikey={good}"),
            404,
            "Tenant not found",
        ),
        (
            format!("/t/acme/socket/websocket?vsn=3.0.0&apikey={good}"),
            400,
            "vsn",
        ),
        (
            // realtime-js adds /websocket itself: a user who gives it the socket's URL is
            // told the endpoint to give instead.
            format!("/t/acme/realtime/v1/websocket/websocket?vsn=2.0.0&apikey={good}"),
            404,
            "Give the client the endpoint /t/acme/realtime/v1 instead",
        ),
    ] {
        let (got, body) = upgrade(rt, &path);
        assert_eq!(got, want, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_tokens_expire_refresh_and_are_refused_with_realtime_s_messages() {
    let (_s, _data, rt) = realtime_shoal();
    let short = token(SECRET, 3);
    let other = token(SECRET, 7200);
    let bad = token("not the tenant's secret", 3600);
    let r = run_client(
        Command::new("node").arg(format!("{CLIENTS}token.mjs")),
        rt,
        &token(SECRET, 3600),
        &[
            ("RT_SHORT_TOKEN", &short),
            ("RT_OTHER_TOKEN", &other),
            ("RT_BAD_TOKEN", &bad),
        ],
    );
    let expired = &r["expired"];
    assert_eq!(
        expired["statuses"],
        serde_json::json!(["SUBSCRIBED", "CLOSED"]),
        "{r}"
    );
    let system = &expired["system"][0];
    assert_eq!(system["status"], "error", "{r}");
    assert_eq!(system["extension"], "system", "{r}");
    assert_eq!(system["channel"], "expiring", "{r}");
    let text = system["message"].as_str().unwrap_or_default();
    assert!(
        text.starts_with("Token has expired ") && text.ends_with(" seconds ago"),
        "{r}"
    );
    assert_eq!(r["ack"], "ok", "{r}");
    let refused = &r["refused"];
    assert_eq!(refused["got"], serde_json::json!([{"n": 1}]), "{r}");
    assert_eq!(
        refused["system"][0]["message"], "Failed to validate JWT signature",
        "{r}"
    );
    assert_eq!(
        refused["statuses"],
        serde_json::json!(["SUBSCRIBED", "CLOSED"]),
        "{r}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_broadcasts_tracks_presence_and_refreshes_its_token() {
    let (_s, _data, rt) = realtime_shoal();
    let other = token(SECRET, 7200);
    let bad = token("not the tenant's secret", 3600);
    let r = run_client(
        Command::new("python3").arg(format!("{CLIENTS}py_clients.py")),
        rt,
        &token(SECRET, 3600),
        &[("RT_OTHER_TOKEN", &other), ("RT_BAD_TOKEN", &bad)],
    );
    assert_eq!(
        r["subscribed"],
        serde_json::json!(["SUBSCRIBED", "SUBSCRIBED"]),
        "{r}"
    );
    let greeting = serde_json::json!([{"text": "héllo", "n": 1}]);
    assert_eq!(r["seenByA"], greeting, "self: {r}");
    assert_eq!(r["seenByB"], greeting, "{r}");
    assert_eq!(r["presentToB"], serde_json::json!(["alice"]), "{r}");
    assert_eq!(r["leaves"], serde_json::json!(["alice"]), "{r}");
    assert_eq!(r["pokes"], serde_json::json!([{"n": 7}, {"n": 8}]), "{r}");
    assert!(
        r["errors"]
            .to_string()
            .contains("Failed to validate JWT signature"),
        "{r}"
    );
    assert_eq!(r["statusesOfB"][0], "SUBSCRIBED", "{r}");
}
