//! Realtime across the nodes of a cluster (real etcd, two real Shoal processes): a
//! broadcast from a client of either node, or over HTTP to either, reaches the subscribers
//! of both, in order.
#![allow(clippy::disallowed_methods)]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::etcd::Etcd;
use common::phoenix::Phx;
use common::*;

const CLUSTER_SECRET: (&str, &str) = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");
const JWT_SECRET: &str = "cluster-realtime-jwt-secret-0123456789";

fn token() -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 600;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &serde_json::json!({"role": "anon", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(JWT_SECRET.as_bytes()),
    )
    .unwrap()
}

/// A node of a cluster on `etcd` with realtime on and the tenant `acme` in its store.
fn node(etcd: &Etcd, id: &str, data: &tempfile::TempDir) -> (Shoal, SocketAddr) {
    let extra = format!(
        "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n\
         [api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
         [realtime]\nlisten = \"127.0.0.1:0\"\n",
        etcd.url,
        CLUSTER_SECRET.0,
        data.path().display()
    );
    let s = Shoal::start_with_env(
        &base_config(pg(), &[], &extra),
        &[
            CLUSTER_SECRET,
            ("SHOAL_API_TOKEN", API_TEST_TOKEN),
            ("API_JWT_SECRET", "unused-secret-0123456789"),
        ],
    );
    let (status, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(pg(), "app", serde_json::json!({ "jwt_secret": JWT_SECRET })),
    );
    assert_eq!(status, 201, "{body}");
    let rt = s.realtime.expect("realtime listens");
    (s, rt)
}

/// Waits until a broadcast from `from` reaches `to` (the nodes see each other): sends a
/// probe at a time until one arrives.
async fn until_linked(from: &mut Phx, to: &mut Phx) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for i in 0.. {
        assert!(
            std::time::Instant::now() < deadline,
            "the nodes never linked"
        );
        from.broadcast("realtime:room", "probe", serde_json::json!({"i": i}))
            .await;
        let got = tokio::time::timeout(Duration::from_millis(300), async {
            to.until(|m| m["event"] == "broadcast").await
        })
        .await;
        if got.is_ok() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcasts_reach_subscribers_on_every_node_in_order() {
    let etcd = Etcd::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_a, rt_a) = node(&etcd, "a", &da);
    let (b, rt_b) = node(&etcd, "b", &db);
    let t = token();
    let mut on_a = Phx::connect(rt_a, "acme", &t).await.unwrap();
    let mut on_b = Phx::connect(rt_b, "acme", &t).await.unwrap();
    for p in [&mut on_a, &mut on_b] {
        assert_eq!(
            p.join("realtime:room", serde_json::json!({})).await["status"],
            "ok"
        );
    }
    until_linked(&mut on_a, &mut on_b).await;
    until_linked(&mut on_b, &mut on_a).await;
    // Drain the probes: a marker after them.
    on_a.broadcast("realtime:room", "mark", serde_json::json!({}))
        .await;
    on_b.until(|m| m["payload"]["event"] == "mark").await;
    on_b.broadcast("realtime:room", "mark", serde_json::json!({}))
        .await;
    on_a.until(|m| m["payload"]["event"] == "mark").await;

    for i in 0..100 {
        on_a.broadcast("realtime:room", "m", serde_json::json!({"i": i}))
            .await;
    }
    for i in 0..100 {
        let m = on_b.until(|m| m["payload"]["event"] == "m").await;
        assert_eq!(m["payload"]["payload"]["i"], i, "in order across nodes");
    }
    on_b.broadcast("realtime:room", "back", serde_json::json!({"ok": 1}))
        .await;
    let m = on_a.until(|m| m["payload"]["event"] == "back").await;
    assert_eq!(m["payload"]["payload"]["ok"], 1);
    // Over HTTP to node b: node a's subscriber gets it too.
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
        .args([
            "-H",
            &format!("apikey: {t}"),
            "-H",
            "Content-Type: application/json",
        ])
        .args([
            "-d",
            r#"{"messages":[{"topic":"room","event":"rest","payload":{"n":7}}]}"#,
        ])
        .arg(format!("http://{rt_b}/t/acme/api/broadcast"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "202");
    let m = on_a.until(|m| m["payload"]["event"] == "rest").await;
    assert_eq!(m["payload"]["payload"]["n"], 7);
    drop(b);
}
