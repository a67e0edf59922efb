//! The realtime service against clients that misbehave, over real sockets: each tenant's
//! limits answered with Realtime's messages (and one tenant's flood leaving another's
//! channels alone), malformed frames and oversized payloads, a reader that stops reading,
//! a socket that stops heartbeating, and tokens verified by a tenant's JWKS.
#![allow(clippy::disallowed_methods)]

mod common;

use std::net::SocketAddr;

use common::phoenix::{Ended, Phx};
use common::*;
use tokio_tungstenite::tungstenite::Message;

const SECRET: &str = "limits-realtime-jwt-secret-0123456789";

fn token(exp_in: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": "authenticated", "exp": now + exp_in}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

/// A Shoal with realtime on (`extra` in its section) and the tenants `tenants` as
/// `(id, realtime fields)`.
fn shoal_with(
    extra: &str,
    tenants: &[(&str, serde_json::Value)],
) -> (Shoal, tempfile::TempDir, SocketAddr) {
    let (s, data) = shoal_with_token_api_and(
        pg(),
        &format!("[realtime]\nlisten = \"127.0.0.1:0\"\n{extra}"),
    );
    for (id, fields) in tenants {
        put_tenant(&s, id, fields.clone());
    }
    let rt = s.realtime.expect("realtime listens");
    (s, data, rt)
}

fn put_tenant(s: &Shoal, id: &str, mut fields: serde_json::Value) {
    if fields.get("jwt_jwks").is_none() {
        fields["jwt_secret"] = SECRET.into();
    }
    let (status, body) = api(
        s,
        "PUT",
        &format!("/api/tenants/{id}"),
        &tenant_body(pg(), "app", fields),
    );
    assert!(status == 201 || status == 200, "{status} {body}");
}

fn reason(reply: &serde_json::Value) -> &str {
    reply["response"]["reason"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_limits_are_enforced_with_realtime_s_messages() {
    let (s, _data, rt) = shoal_with(
        "",
        &[(
            "acme",
            serde_json::json!({
                "max_concurrent_users": 2,
                "max_joins_per_second": 3,
                "max_payload_size_in_kb": 1,
            }),
        )],
    );
    let t = token(3600);
    // Sockets connected at once.
    let mut a = Phx::connect(rt, "acme", &t).await.unwrap();
    let b = Phx::connect(rt, "acme", &t).await.unwrap();
    let refused = Phx::connect(rt, "acme", &t)
        .await
        .err()
        .expect("a third is refused");
    assert_eq!(
        refused,
        (429, r#"{"error":"Too many connected users"}"#.to_owned())
    );
    drop(b);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut c = loop {
        match Phx::connect(rt, "acme", &t).await {
            Ok(c) => break c,
            Err(_) if std::time::Instant::now() < deadline => tokio::task::yield_now().await,
            Err(e) => panic!("a seat never came free: {e:?}"),
        }
    };
    // Joins per second, all sockets together: three at once, not four. The joins are sent
    // together, so the bucket cannot refill between them however slow the machine is: after
    // c's join it holds two to three. (A bucket refilled to just under one may let a later
    // join through after a refusal; a refusal is answered before an earlier join's success.)
    let joined = c.join("realtime:j1", serde_json::json!({})).await;
    assert_eq!(joined["status"], "ok", "{joined}");
    let mut refs = Vec::new();
    for n in 1..=6 {
        let config = serde_json::json!({ "config": {} });
        refs.push(a.push(&format!("realtime:j{n}"), "phx_join", config).await);
    }
    let replies = a.replies(&refs).await;
    let ok = replies.iter().filter(|r| r["status"] == "ok").count();
    assert!((2..=3).contains(&ok), "{replies:?}");
    assert!(
        replies[..2].iter().all(|r| r["status"] == "ok"),
        "{replies:?}"
    );
    for refused in replies.iter().filter(|r| r["status"] != "ok") {
        assert_eq!(
            reason(refused),
            "ClientJoinRateLimitReached: Too many joins per second"
        );
    }
    // The largest payload: refused with a reason, and the socket goes on.
    let r = a
        .broadcast("realtime:j1", "big", "x".repeat(2000).into())
        .await;
    let reply = a.reply(&r).await;
    assert_eq!(
        reason(&reply),
        "Payload too large: max_payload_size_in_kb exceeded"
    );
    let r = a.push("phoenix", "heartbeat", serde_json::json!({})).await;
    assert_eq!(a.reply(&r).await["status"], "ok");
    // A frame far past it closes the socket, and no one else notices.
    a.send_raw(Message::text("y".repeat(200 * 1024))).await;
    assert!(matches!(a.ended().await, Ended::Closed(_) | Ended::Dropped));
    let r = c.push("phoenix", "heartbeat", serde_json::json!({})).await;
    assert_eq!(c.reply(&r).await["status"], "ok");

    // Private-only: public channels are refused; private ones wait for their policies.
    let mut fields = serde_json::json!({"private_only": true});
    fields["max_joins_per_second"] = 1000.into();
    put_tenant(&s, "acme", fields);
    let reply = c.join("realtime:pub", serde_json::json!({})).await;
    assert_eq!(
        reason(&reply),
        "PrivateOnly: This project only allows private channels"
    );
    let reply = c
        .join("realtime:priv", serde_json::json!({"private": true}))
        .await;
    assert!(
        reason(&reply).starts_with(
            "Unauthorized: You do not have permissions to read from this Channel topic: priv"
        ),
        "{reply}"
    );
    // A banned tenant's sockets end, and new ones are refused as Realtime does.
    let mut fields = serde_json::json!({"banned": true});
    fields["max_joins_per_second"] = 1000.into();
    put_tenant(&s, "acme", fields);
    match c.ended().await {
        Ended::Closed(Some(f)) => assert_eq!(u16::from(f.code), 1008, "{f:?}"),
        other => panic!("{other:?}"),
    }
    let refused = Phx::connect(rt, "acme", &t).await.err().unwrap();
    assert_eq!(
        refused,
        (
            403,
            r#"{"error":"Realtime was disabled for this tenant"}"#.to_owned()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenant_s_flood_is_cut_off_and_another_tenant_s_channel_misses_nothing() {
    let (s, _data, rt) = shoal_with(
        "[metrics]\nlisten = \"127.0.0.1:0\"\n",
        &[
            ("acme", serde_json::json!({"max_events_per_second": 20})),
            ("beta", serde_json::json!({})),
        ],
    );
    let t = token(3600);
    let mut flooder = Phx::connect(rt, "acme", &t).await.unwrap();
    assert_eq!(
        flooder.join("realtime:flood", serde_json::json!({})).await["status"],
        "ok"
    );
    let mut tx = Phx::connect(rt, "beta", &t).await.unwrap();
    let mut rx = Phx::connect(rt, "beta", &t).await.unwrap();
    assert_eq!(
        tx.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    assert_eq!(
        rx.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    // Both at once: acme's flood and beta's 200 messages.
    let flood = tokio::spawn(async move {
        for i in 0..200 {
            flooder
                .broadcast("realtime:flood", "f", serde_json::json!({"i": i}))
                .await;
        }
        let system = flooder.until(|m| m["event"] == "system").await;
        let close = flooder.until(|m| m["event"] == "phx_close").await;
        (system, close)
    });
    for i in 0..200 {
        tx.broadcast("realtime:room", "m", serde_json::json!({"i": i}))
            .await;
    }
    for i in 0..200 {
        let m = rx.until(|m| m["event"] == "broadcast").await;
        assert_eq!(m["payload"]["payload"]["i"], i, "beta's messages, in order");
    }
    let (system, close) = flood.await.unwrap();
    assert_eq!(
        system["payload"]["message"], "Too many messages per second",
        "{system}"
    );
    assert_eq!(system["payload"]["channel"], "flood", "{system}");
    assert_eq!(close["topic"], "realtime:flood");
    // Over HTTP, the same limit answers 429.
    let batch: Vec<_> = (0..50)
        .map(|i| serde_json::json!({"topic": "flood", "event": "e", "payload": {"i": i}}))
        .collect();
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", "POST"])
        .args([
            "-H",
            &format!("apikey: {t}"),
            "-H",
            "Content-Type: application/json",
        ])
        .args(["-d", &serde_json::json!({"messages": batch}).to_string()])
        .arg(format!("http://{rt}/t/acme/api/broadcast"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.ends_with("\n429"), "{text}");
    assert!(text.contains("You have exceeded your rate limit"), "{text}");
    // The metrics tell the two tenants apart.
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            &format!("http://{}/metrics", s.metrics.expect("metrics")),
        ])
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&out.stdout);
    let value = |prefix: &str| -> f64 {
        page.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in {page}"))
    };
    assert!(value(r#"shoal_realtime_limited_total{tenant="acme"}"#) >= 2.0);
    assert_eq!(value(r#"shoal_realtime_limited_total{tenant="beta"}"#), 0.0);
    assert!(value(r#"shoal_realtime_deliveries_total{tenant="beta"}"#) >= 200.0);
    assert_eq!(value(r#"shoal_realtime_sockets{tenant="beta"}"#), 2.0);
    assert_eq!(value(r#"shoal_realtime_channels{tenant="beta"}"#), 1.0);
    assert!(value(r#"shoal_realtime_messages_total{tenant="beta"}"#) >= 200.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_close_only_their_own_socket() {
    let (_s, _data, rt) = shoal_with("", &[("acme", serde_json::json!({}))]);
    let t = token(3600);
    let mut tx = Phx::connect(rt, "acme", &t).await.unwrap();
    let mut rx = Phx::connect(rt, "acme", &t).await.unwrap();
    assert_eq!(
        tx.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    assert_eq!(
        rx.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    for bad in [
        Message::text("not json at all"),
        Message::text(r#"{"topic": 1, "event": "x"}"#),
        Message::binary(vec![9u8, 1, 2, 3]),
        Message::binary(vec![3u8, 200, 1, 1]),
    ] {
        let mut victim = Phx::connect(rt, "acme", &t).await.unwrap();
        assert_eq!(
            victim.join("realtime:room", serde_json::json!({})).await["status"],
            "ok"
        );
        victim.send_raw(bad.clone()).await;
        match victim.ended().await {
            Ended::Closed(Some(f)) => {
                assert_eq!(u16::from(f.code), 1003, "{bad:?}: {f:?}");
                assert!(!f.reason.is_empty(), "{bad:?}: a reason");
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    // A client that closes is answered with a close frame of its own code (not a dropped
    // connection, which clients report as 1006).
    let mut leaving = Phx::connect(rt, "acme", &t).await.unwrap();
    leaving
        .send_raw(Message::Close(Some(
            tokio_tungstenite::tungstenite::protocol::CloseFrame {
                code: 1000.into(),
                reason: "bye".into(),
            },
        )))
        .await;
    match leaving.ended().await {
        Ended::Closed(Some(f)) => assert_eq!(u16::from(f.code), 1000, "{f:?}"),
        other => panic!("a client's close was not answered: {other:?}"),
    }
    // A well-formed message of an unknown kind gets an error and the socket stays.
    let r = tx
        .push("realtime:room", "no_such_event", serde_json::json!({}))
        .await;
    assert_eq!(reason(&tx.reply(&r).await), "unknown event");
    let r = tx
        .push("realtime:elsewhere", "broadcast", serde_json::json!({}))
        .await;
    assert_eq!(reason(&tx.reply(&r).await), "unmatched topic");
    tx.broadcast("realtime:room", "after", serde_json::json!({"ok": true}))
        .await;
    let m = rx.until(|m| m["event"] == "broadcast").await;
    assert_eq!(
        m["payload"]["event"], "after",
        "the others were not touched: {m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_reading_is_cut_off_and_holds_up_no_one() {
    let (_s, _data, rt) = shoal_with("", &[("acme", serde_json::json!({}))]);
    let t = token(3600);
    let mut slow = Phx::connect_with(rt, "acme", &t, Some(4096)).await.unwrap();
    let mut fast = Phx::connect(rt, "acme", &t).await.unwrap();
    let mut tx = Phx::connect(rt, "acme", &t).await.unwrap();
    for p in [&mut slow, &mut fast, &mut tx] {
        assert_eq!(
            p.join("realtime:firehose", serde_json::json!({})).await["status"],
            "ok"
        );
    }
    // `slow` reads nothing from here on; `fast` keeps up, 100 messages at a time.
    let filler = "z".repeat(8 * 1024);
    for batch in 0..30 {
        for i in 0..100 {
            let n = batch * 100 + i;
            tx.broadcast(
                "realtime:firehose",
                "m",
                serde_json::json!({"n": n, "f": filler}),
            )
            .await;
        }
        for i in 0..100 {
            let m = fast.until(|m| m["event"] == "broadcast").await;
            assert_eq!(m["payload"]["payload"]["n"], batch * 100 + i);
        }
    }
    match slow.ended().await {
        Ended::Closed(Some(f)) => {
            assert_eq!(u16::from(f.code), 1013, "{f:?}");
            assert!(f.reason.contains("too slow"), "{f:?}");
        }
        // The close frame may not fit behind what the reader left unread.
        Ended::Dropped | Ended::Closed(None) => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_that_stops_heartbeating_is_closed_and_its_presence_leaves() {
    let (_s, _data, rt) = shoal_with(
        "heartbeat_timeout = 2\n",
        &[("acme", serde_json::json!({}))],
    );
    let t = token(3600);
    let mut silent = Phx::connect(rt, "acme", &t).await.unwrap();
    let mut watcher = Phx::connect(rt, "acme", &t).await.unwrap();
    let cfg = |key: &str| serde_json::json!({"presence": {"key": key, "enabled": true}});
    assert_eq!(
        watcher.join("realtime:lobby", cfg("watcher")).await["status"],
        "ok"
    );
    assert_eq!(
        silent.join("realtime:lobby", cfg("silent")).await["status"],
        "ok"
    );
    let r = silent
        .push(
            "realtime:lobby",
            "presence",
            serde_json::json!({"event": "track", "payload": {"at": 1}}),
        )
        .await;
    assert_eq!(silent.reply(&r).await["status"], "ok");
    let joined = watcher
        .until(|m| m["event"] == "presence_diff" && m["payload"]["joins"].get("silent").is_some())
        .await;
    assert!(joined["payload"]["leaves"].as_object().unwrap().is_empty());
    // `watcher` heartbeats while it waits; `silent` says nothing more.
    watcher
        .until(|m| m["event"] == "presence_diff" && m["payload"]["leaves"].get("silent").is_some())
        .await;
    match silent.ended().await {
        Ended::Closed(Some(f)) => assert!(f.reason.contains("heartbeat timeout"), "{f:?}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_verified_with_the_tenant_s_jwks() {
    let jwks: serde_json::Value =
        serde_json::from_str(include_str!("../../realtime/testdata/jwks.json")).unwrap();
    let (s, _data, rt) = shoal_with("", &[("acme", serde_json::json!({"jwt_jwks": jwks}))]);
    let (status, body) = api(&s, "GET", "/api/tenants/acme", &serde_json::json!({}));
    assert_eq!(status, 200);
    assert!(
        body.to_string().find("jwt_jwks").is_none(),
        "write-only: {body}"
    );
    let ec = jsonwebtoken::EncodingKey::from_ec_pem(include_bytes!(
        "../../realtime/testdata/es256-test-key.pem"
    ))
    .unwrap();
    let sign = |kid: &str| {
        let mut h = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        h.kid = Some(kid.into());
        let exp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 600;
        jsonwebtoken::encode(&h, &serde_json::json!({"role": "anon", "exp": exp}), &ec).unwrap()
    };
    let mut p = Phx::connect(rt, "acme", &sign("ec-1")).await.unwrap();
    assert_eq!(
        p.join("realtime:room", serde_json::json!({})).await["status"],
        "ok"
    );
    let (status, body) = Phx::connect(rt, "acme", &sign("nope")).await.err().unwrap();
    assert_eq!(status, 401);
    assert!(
        body.contains(r#"Failed to generate JWT signer for key ID (kid) \"nope\""#),
        "{body}"
    );
    // The tenant's secret was never set: HS tokens are refused.
    let (status, _) = Phx::connect(rt, "acme", &token(600)).await.err().unwrap();
    assert_eq!(status, 401);
    // A JWKS Shoal cannot use is refused by the API, naming the field.
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(
            pg(),
            "app",
            serde_json::json!({"jwt_jwks": {"keys": [{"kty": "EC"}]}}),
        ),
    );
    assert_eq!(status, 422, "{body}");
    assert!(body.to_string().contains("jwt_jwks"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_per_client_and_bytes_per_second_are_enforced() {
    let (_s, _data, rt) = shoal_with(
        "",
        &[(
            "acme",
            serde_json::json!({"max_channels_per_client": 2, "max_bytes_per_second": 1000}),
        )],
    );
    let t = token(3600);
    let mut p = Phx::connect(rt, "acme", &t).await.unwrap();
    for topic in ["realtime:c1", "realtime:c2"] {
        assert_eq!(p.join(topic, serde_json::json!({})).await["status"], "ok");
    }
    let reply = p.join("realtime:c3", serde_json::json!({})).await;
    assert_eq!(reason(&reply), "ChannelRateLimitReached: Too many channels");
    // A re-join of a joined channel is no new channel.
    assert_eq!(
        p.join("realtime:c1", serde_json::json!({})).await["status"],
        "ok"
    );
    // 1000 bytes a second: the burst passes, then the channel is shut down.
    for _ in 0..5 {
        p.broadcast("realtime:c1", "b", "x".repeat(400).into())
            .await;
    }
    let system = p.until(|m| m["event"] == "system").await;
    assert_eq!(
        system["payload"]["message"], "Too many bytes per second",
        "{system}"
    );
    p.until(|m| m["event"] == "phx_close" && m["topic"] == "realtime:c1")
        .await;
    // The socket goes on.
    let r = p.push("phoenix", "heartbeat", serde_json::json!({})).await;
    assert_eq!(p.reply(&r).await["status"], "ok");
}
