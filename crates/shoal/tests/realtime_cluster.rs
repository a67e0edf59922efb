//! Realtime across the nodes of a cluster (real etcd, two real Shoal processes): a
//! broadcast from a client of either node, or over HTTP to either, reaches the subscribers
//! of both, in order; presence tracked on one node is seen on the other, leaves with its
//! socket or its node, and comes back whole to a node that restarts.
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
    node_on(etcd, id, data, pg(), "app", JWT_SECRET)
}

/// [`node`] with the tenant's database `db` on `pg`, its tokens signed with `secret`.
fn node_on(
    etcd: &Etcd,
    id: &str,
    data: &tempfile::TempDir,
    pg: &Pg,
    db: &str,
    secret: &str,
) -> (Shoal, SocketAddr) {
    let extra = format!(
        "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n\
         [api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
         [realtime]\nlisten = \"127.0.0.1:0\"\n",
        etcd.url,
        CLUSTER_SECRET.0,
        data.path().display()
    );
    let s = Shoal::start_with_env(
        &base_config(pg, &[], &extra),
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
        &tenant_body(pg, db, serde_json::json!({ "jwt_secret": secret })),
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

/// The presence keys in a `presence_state` or a diff's `joins`/`leaves`.
fn keys(v: &serde_json::Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    k.sort();
    k
}

fn with_presence(key: &str) -> serde_json::Value {
    serde_json::json!({"presence": {"key": key, "enabled": true}})
}

async fn track(p: &mut Phx, name: &str) {
    let r = p
        .push(
            "realtime:lobby",
            "presence",
            serde_json::json!({"event": "track", "payload": {"name": name}}),
        )
        .await;
    assert_eq!(p.reply(&r).await["status"], "ok");
}

/// Joins the lobby on `rt` until its presence state holds `key` (a node learns of another
/// node's presences over its stream, a moment after they happen); the socket.
async fn join_seeing(rt: SocketAddr, key: &str) -> (Phx, Vec<String>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut p = Phx::connect(rt, "acme", &token()).await.unwrap();
        assert_eq!(
            p.join("realtime:lobby", with_presence("watcher")).await["status"],
            "ok"
        );
        let state = p.until(|m| m["event"] == "presence_state").await;
        let present = keys(&state["payload"]);
        if present.iter().any(|k| k == key) {
            return (p, present);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{key} never seen: {present:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_is_the_same_on_every_node_and_leaves_with_its_node() {
    let etcd = Etcd::start();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, rt_a) = node(&etcd, "a", &da);
    let (b, rt_b) = node(&etcd, "b", &db);
    let t = token();
    // Ann is on node a.
    let mut ann = Phx::connect(rt_a, "acme", &t).await.unwrap();
    assert_eq!(
        ann.join("realtime:lobby", with_presence("ann")).await["status"],
        "ok"
    );
    track(&mut ann, "Ann").await;
    // A watcher on node b sees her, in its state or as a join.
    let (mut watcher, present) = join_seeing(rt_b, "ann").await;
    assert_eq!(present, vec!["ann"]);
    // Bob tracks on node b: ann's node sees him.
    let mut bob = Phx::connect(rt_b, "acme", &t).await.unwrap();
    assert_eq!(
        bob.join("realtime:lobby", with_presence("bob")).await["status"],
        "ok"
    );
    track(&mut bob, "Bob").await;
    let diff = ann
        .until(|m| m["event"] == "presence_diff" && keys(&m["payload"]["joins"]) == ["bob"])
        .await;
    assert_eq!(diff["payload"]["joins"]["bob"]["metas"][0]["name"], "Bob");
    // Ann's socket closes: node b's watcher sees her leave.
    drop(ann);
    watcher
        .until(|m| m["event"] == "presence_diff" && keys(&m["payload"]["leaves"]) == ["ann"])
        .await;

    // A node that joins later (b's successor) learns a's presences whole on its new stream.
    let mut cat = Phx::connect(rt_a, "acme", &t).await.unwrap();
    assert_eq!(
        cat.join("realtime:lobby", with_presence("cat")).await["status"],
        "ok"
    );
    track(&mut cat, "Cat").await;
    drop((watcher, bob));
    drop(b);
    let (b2, rt_b2) = node(&etcd, "b2", &tempfile::tempdir().unwrap());
    let (mut watcher, present) = join_seeing(rt_b2, "cat").await;
    assert!(present.contains(&"cat".to_owned()), "{present:?}");
    // Node a dies: its presences leave node b.
    drop(a);
    watcher
        .until(|m| {
            m["event"] == "presence_diff"
                && keys(&m["payload"]["leaves"]).contains(&"cat".to_owned())
        })
        .await;
    drop(b2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_changes_reach_subscribers_on_every_node_once() {
    use common::changes::{change, logical_pg, run_sql, subscribe, token, SECRET};
    let pg = logical_pg();
    let db = unique_db("rt_cluster_changes");
    pg.create_database(&db);
    run_sql(
        pg,
        &db,
        "CREATE TABLE t (id int PRIMARY KEY); GRANT SELECT ON t TO authenticated;",
    );
    let etcd = Etcd::start();
    let (da, dbb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_a, rta) = node_on(&etcd, "node-a", &da, pg, &db, SECRET);
    let (_b, rtb) = node_on(&etcd, "node-b", &dbb, pg, &db, SECRET);
    let binding = serde_json::json!([{"event": "INSERT", "schema": "public", "table": "t"}]);
    let mut on_a = Phx::connect(rta, "acme", &token("u")).await.unwrap();
    let mut on_b = Phx::connect(rtb, "acme", &token("u")).await.unwrap();
    subscribe(&mut on_a, "realtime:t", binding.clone()).await;
    subscribe(&mut on_b, "realtime:t", binding).await;
    // Each node streams for its own subscribers: a slot each.
    let slots = pg.psql_admin(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'shoal_realtime_%' AND database = '{db}'"
    ));
    assert_eq!(slots, "2");
    run_sql(pg, &db, "INSERT INTO t SELECT generate_series(1, 4)");
    for p in [&mut on_a, &mut on_b] {
        let mut ids = Vec::new();
        while ids.last() != Some(&4) {
            ids.push(change(p).await["data"]["record"]["id"].as_i64().unwrap());
        }
        // Once each: nothing is relayed between nodes on top of each node's own stream.
        assert_eq!(ids, [1, 2, 3, 4]);
    }
}
