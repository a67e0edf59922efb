//! Shoal as a cluster: real etcd, real Shoal processes on loopback, real PostgreSQL. A client
//! may connect to any node; the pool's one owner runs its transactions.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::etcd::Etcd;
use common::*;

const SECRET: (&str, &str) = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");

/// A node of a cluster on `etcd` serving `db` (with `extra` config).
fn node(etcd: &Etcd, id: &str, db: &str, extra: &str) -> Shoal {
    let cluster = format!(
        "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n{extra}",
        etcd.url, SECRET.0
    );
    Shoal::start_with_env(&base_config(pg(), &[db], &cluster), &[SECRET])
}

/// A fresh database for a test.
fn cluster_db() -> String {
    let db = unique_db("cluster");
    pg().create_database(&db);
    db
}

/// Nodes `a` and `b` of a cluster on `etcd` serving `db`, each having served a query (so the
/// pool has its owner).
async fn two_nodes(etcd: &Etcd, db: &str, extra: &str) -> (Shoal, Shoal) {
    let a = node(etcd, "a", db, extra);
    let b = node(etcd, "b", db, extra);
    for n in [&a, &b] {
        n.connect(db).await.simple_query("SELECT 1").await.unwrap();
    }
    (a, b)
}

/// Of two nodes, the one that logged that it owns the pool (exactly one must have) and the
/// other.
fn owner_and_relay<'a>(a: &'a Shoal, b: &'a Shoal) -> (&'a Shoal, &'a Shoal) {
    let owns = |n: &Shoal| n.log_contains("pool owned by this node");
    assert!(owns(a) != owns(b), "exactly one node owns the pool");
    if owns(a) {
        (a, b)
    } else {
        (b, a)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_node_serves_a_pool_only_its_owner_opens_servers_for() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let a = node(&etcd, "a", &db, "[pool]\npool_size = 2\n");
    let b = node(&etcd, "b", &db, "[pool]\npool_size = 2\n");
    for n in [&a, &b] {
        let c = n.connect(&db).await;
        assert_eq!(simple_rows(&c, "SELECT 41 + 1").await, ["42"]);
    }
    let (owner, relay) = owner_and_relay(&a, &b);
    // The relaying node's clients came over one link (per shard), not a connection each.
    assert!(owner.log_count("node link accepted") <= 2);
    assert!(owner.log_contains("node link accepted"));
    // Many clients on both nodes at once: the cluster holds at most pool_size servers.
    let mut tasks = Vec::new();
    for i in 0..16 {
        let n = if i % 2 == 0 { &a } else { &b };
        let c = n.connect(&db).await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..20 {
                let r: i64 = c
                    .query_one("SELECT $1::int8 * 2", &[&(i as i64)])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(r, i as i64 * 2);
            }
        }));
    }
    let mut peak = 0;
    while !tasks.iter().all(|t| t.is_finished()) {
        peak = peak.max(pg().servers(&db));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(peak <= 2, "pool_size 2 is a cluster-wide cap: saw {peak}");
    assert!(pg().servers(&db) <= 2);
    // Beside them, the owner's one fence session.
    assert!(pg().backends(&db) <= 3);
    // The relaying node never owned the pool (its fence stayed closed: it opened no server).
    assert!(!relay.log_contains("pool owned by this node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_client_gets_every_protocol_feature_unchanged() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "").await;
    let (_, relay) = owner_and_relay(&a, &b);
    let mut c = relay.connect(&db).await;
    // Prepared statements (named, extended protocol) and parameters.
    let st = c.prepare("SELECT $1::text || '!'").await.unwrap();
    for w in ["one", "two"] {
        let r: String = c.query_one(&st, &[&w]).await.unwrap().get(0);
        assert_eq!(r, format!("{w}!"));
    }
    // Session SETs follow the client across transactions.
    c.batch_execute("SET application_name = 'relayed'")
        .await
        .unwrap();
    assert_eq!(simple_rows(&c, "SHOW application_name").await, ["relayed"]);
    // Errors keep their SQLSTATE, and the connection goes on.
    let e = c.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(code(&e), "22012");
    // A large result streams through.
    let rows = c
        .query(
            "SELECT g, repeat('x', 100) FROM generate_series(1, 100000) g",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 100_000);
    let last: i32 = rows[99_999].get(0);
    assert_eq!(last, 100_000);
    // COPY both ways.
    c.batch_execute("CREATE TABLE t (a int)").await.unwrap();
    {
        use futures_util::SinkExt;
        let tx = c.transaction().await.unwrap();
        let sink = tx.copy_in("COPY t FROM STDIN").await.unwrap();
        futures_util::pin_mut!(sink);
        let data: String = (1..=1000).map(|i| format!("{i}\n")).collect();
        sink.send(bytes::Bytes::from(data)).await.unwrap();
        assert_eq!(sink.finish().await.unwrap(), 1000);
        tx.commit().await.unwrap();
    }
    let out = std::process::Command::new("psql")
        .args(["-X", "-At", "-c", "COPY (SELECT sum(a) FROM t) TO STDOUT"])
        .arg(relay.conninfo("app", APP_PASSWORD, &db))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "500500");
    // A cancel sent to the relaying node reaches the query on the owner's server.
    let c = cancel_a_sleep(c, &db).await;
    c.simple_query("SELECT 1").await.unwrap();
}

/// Fetches `url` with curl: (status, body).
fn http_get(url: &str) -> (u16, String) {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", url])
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_metrics_and_api_describe_the_cluster() {
    let etcd = Etcd::start();
    let db = cluster_db();
    // Never parked: the held relayed client must still hold its session at the owner when the
    // owner's gauges are read, however long the steps before take on a slow machine.
    let extra = "park_idle_after = 0\n[admin]\nusers = [\"admin\"]\n[users.admin]\n\
                 password = \"admin-secret\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n";
    let a = node(&etcd, "a", &db, extra);
    let b = node(&etcd, "b", &db, extra);
    let mut held = Vec::new();
    for n in [&a, &b] {
        let c = n.connect(&db).await;
        c.simple_query("SELECT 1").await.unwrap();
        held.push(c);
    }
    let (owner, relay) = owner_and_relay(&a, &b);
    let owner_id = if std::ptr::eq(owner, &a) { "a" } else { "b" };
    // SHOW NODES: both nodes, this one marked, the owner holding the one pool.
    let (cols, rows) = console_rows(relay, "SHOW NODES").await;
    let col = |name: &str| cols.iter().position(|c| c == name).unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let ids: Vec<&str> = rows.iter().map(|r| r[col("node")].as_str()).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(rows.iter().filter(|r| r[col("self")] == "yes").count(), 1);
    let owner_row = rows.iter().find(|r| r[col("node")] == owner_id).unwrap();
    assert_eq!(owner_row[col("owned_pools")], "1");
    assert_eq!(owner_row[col("relayed_clients")], "1", "{rows:?}");
    // Each node reports its clients (every few seconds): the relaying node holds one.
    let relay_id = if owner_id == "a" { "b" } else { "a" };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (cols, rows) = console_rows(owner, "SHOW NODES").await;
        let col = |name: &str| cols.iter().position(|c| c == name).unwrap();
        let row = rows.iter().find(|r| r[col("node")] == relay_id).unwrap();
        if row[col("clients")].parse::<u64>().unwrap() >= 1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // SHOW POOLS on the relaying node names the owner.
    let (cols, rows) = console_rows(relay, "SHOW POOLS").await;
    let owner_col = cols
        .iter()
        .position(|c| c == "owner")
        .expect("an owner column");
    let pool = rows.iter().find(|r| r[0] == db).expect("the relayed pool");
    assert_eq!(pool[owner_col], owner_id);
    // /api/cluster and /metrics.
    let base = format!("http://{}", relay.metrics.unwrap());
    let (code, body) = http_get(&format!("{base}/api/cluster"));
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["nodes"].as_array().unwrap().len(), 2);
    assert_eq!(status["relayed_out"], 1);
    assert_eq!(status["lease_alive"], true);
    let (_, text) = http_get(&format!("{base}/metrics"));
    assert!(text.contains("shoal_cluster_nodes{} 2"), "{text}");
    assert!(
        text.contains("shoal_cluster_relayed_clients{direction=\"out\"} 1"),
        "{text}"
    );
    assert!(text.contains("shoal_cluster_link_bytes_total{peer=\""));
    let (_, text) = http_get(&format!("http://{}/metrics", owner.metrics.unwrap()));
    assert!(text.contains("shoal_cluster_owned_pools{} 1"), "{text}");
    // The owner took its pool over at PostgreSQL once; nobody was there before it.
    assert!(text.contains("shoal_cluster_takeovers_total{} 1"), "{text}");
    assert!(
        text.contains("shoal_cluster_takeover_ended_sessions_total{} 0"),
        "{text}"
    );
    assert!(
        text.contains("shoal_cluster_relayed_clients{direction=\"in\"} 1"),
        "{text}"
    );
}

/// Connects through `n` and runs a query, retrying until it works; returns how long it took.
async fn until_served(n: &Shoal, db: &str, limit: Duration) -> Duration {
    let start = tokio::time::Instant::now();
    loop {
        if let Ok(c) = n.try_connect(&n.conninfo("app", APP_PASSWORD, db)).await {
            if c.simple_query("SELECT 1").await.is_ok() {
                return start.elapsed();
            }
        }
        assert!(start.elapsed() < limit, "not served within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_is_replaced_and_idle_relayed_clients_move_unnoticed() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    // An idle relayed client with session state: a prepared statement and a SET.
    let idle = relay.connect(&db).await;
    let st = idle.prepare("SELECT $1::int4 + 1").await.unwrap();
    idle.batch_execute("SET application_name = 'moved'")
        .await
        .unwrap();
    assert_eq!(
        idle.query_one(&st, &[&1i32])
            .await
            .unwrap()
            .get::<_, i32>(0),
        2
    );
    // A relayed client inside a transaction block.
    let in_tx = relay.connect(&db).await;
    in_tx.batch_execute("BEGIN; SELECT 1").await.unwrap();
    owner.signal(libc::SIGKILL);
    let killed = std::time::Instant::now();
    // A client logging in while the pool changes hands (the owner dead, still registered)
    // waits for the new owner: its login succeeds (nothing of it had run anywhere).
    eventually("the owner died", Duration::from_secs(5), || {
        std::fs::read_to_string(format!("/proc/{}/stat", owner.pid())).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
    })
    .await;
    let newcomer = relay.connect(&db).await;
    assert_eq!(simple_rows(&newcomer, "SELECT 'waited'").await, ["waited"]);
    // The idle client goes on at the new owner with its statement and SET, not knowing.
    // (Once the relaying node knows: a statement sent at the very moment of the loss could
    // have run or not, and is refused.)
    eventually("the loss noticed", Duration::from_secs(5), || {
        relay.log_contains("moving it")
    })
    .await;
    let r: i32 = idle.query_one(&st, &[&41i32]).await.unwrap().get(0);
    assert_eq!(r, 42);
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(8), "failover took {took:?}");
    assert_eq!(simple_rows(&idle, "SHOW application_name").await, ["moved"]);
    // The one inside a transaction is told: its transaction is gone with its node.
    let e = in_tx.simple_query("COMMIT").await.unwrap_err();
    assert!(
        in_tx.is_closed() || e.code().is_some_and(|c| c.code() == "08006"),
        "{e:?}"
    );
    assert!(relay.log_contains("pool owned by this node"));
    // New clients too, and the cluster still holds at most pool_size servers.
    until_served(relay, &db, Duration::from_secs(10)).await;
    eventually("servers within pool_size", Duration::from_secs(10), || {
        pg().servers(&db) <= 2 && pg().backends(&db) <= 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_is_fenced_when_it_resumes_and_joins_again() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    // A client of the owner itself, which will be paused under it.
    let local = owner.connect(&db).await;
    local.simple_query("SELECT 1").await.unwrap();
    owner.signal(libc::SIGSTOP);
    // The other node takes the pool over once the paused node's lease expires.
    until_served(relay, &db, Duration::from_secs(15)).await;
    assert!(relay.log_contains("pool owned by this node"));
    owner.signal(libc::SIGCONT);
    // Resumed, the old owner must not use its servers: its client's next statement fails
    // rather than run beside the new owner.
    let e = local.simple_query("SELECT 1").await.unwrap_err();
    let db_error = e.as_db_error().expect("an error from Shoal");
    assert_eq!(db_error.code().code(), "08006");
    assert!(
        db_error.message().contains("no longer owned by this node"),
        "{db_error:?}"
    );
    // It joins again and relays its clients to the new owner.
    eventually("joined again", Duration::from_secs(15), || {
        owner.log_contains("joined the cluster again")
    })
    .await;
    until_served(owner, &db, Duration::from_secs(15)).await;
    eventually("servers within pool_size", Duration::from_secs(10), || {
        pg().servers(&db) <= 2 && pg().backends(&db) <= 3
    })
    .await;
}

/// A write queued at a paused owner never commits once the next owner serves: the next
/// owner has PostgreSQL end the old owner's servers before it serves (a check in the old
/// owner cannot do it: it may be paused between its check and its write). Without this, a
/// client that retries on `08006` wrote twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owners_queued_write_never_commits_after_the_next_owner_serves() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    owner
        .connect(&db)
        .await
        .batch_execute("CREATE TABLE ledger (who text)")
        .await
        .unwrap();
    // A client of the owner itself and a relayed one, each inside a transaction block with
    // a write done, on the owner's two servers.
    let local = owner.connect(&db).await;
    let relayed = relay.connect(&db).await;
    let mut pids = Vec::new();
    for (c, who) in [(&local, "local"), (&relayed, "relayed")] {
        c.batch_execute(&format!("BEGIN; INSERT INTO ledger VALUES ('{who} 1')"))
            .await
            .unwrap();
        pids.push(simple_rows(c, "SELECT pg_backend_pid()").await.concat());
    }
    owner.signal(libc::SIGSTOP);
    // Their next write and COMMIT wait in the paused owner's sockets.
    let pending: Vec<_> = [(local, "local"), (relayed, "relayed")]
        .into_iter()
        .map(|(c, who)| {
            tokio::spawn(async move {
                let sql = format!("INSERT INTO ledger VALUES ('{who} 2'); COMMIT");
                let r = c.simple_query(&sql).await.map(|_| ());
                (c, r, who)
            })
        })
        .collect();
    until_served(relay, &db, Duration::from_secs(15)).await;
    let fresh = relay.connect(&db).await;
    fresh
        .batch_execute("INSERT INTO ledger VALUES ('next owner')")
        .await
        .unwrap();
    // The old owner's servers were gone before the next owner served anyone.
    assert!(logged(
        relay,
        &[
            "ending the sessions of the pool's previous owner at PostgreSQL",
            "sessions=3"
        ]
    ));
    for pid in &pids {
        let left = pg().psql_admin(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
        ));
        assert_eq!(left, "0", "server {pid} of the paused owner still runs");
    }
    owner.signal(libc::SIGCONT);
    for p in pending {
        let (c, r, who) = p.await.unwrap();
        let Err(e) = r else {
            panic!(
                "the {who} client's transaction went on past a resumed owner; ledger {:?}\n\
                 owner:\n{}\nnext owner:\n{}",
                simple_rows(&fresh, "SELECT who FROM ledger ORDER BY who").await,
                owner.log_tail(60),
                relay.log_tail(60)
            );
        };
        assert!(
            c.is_closed() || e.code().is_some_and(|c| c.code() == "08006"),
            "{e:?}"
        );
    }
    assert_eq!(
        simple_rows(&fresh, "SELECT who FROM ledger ORDER BY who").await,
        ["next owner"],
        "only the next owner's write committed"
    );
    assert!(pg().servers(&db) <= 2);
}

/// Whether a line of `n`'s log has every one of `parts`.
fn logged(n: &Shoal, parts: &[&str]) -> bool {
    n.log
        .lock()
        .unwrap()
        .iter()
        .any(|l| parts.iter().all(|p| l.contains(p)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_pool_moves_to_a_joining_node_and_a_busy_one_stays() {
    let etcd = Etcd::start();
    let (idle_db, busy_db) = (unique_db("cluster"), unique_db("cluster"));
    pg().create_database(&idle_db);
    pg().create_database(&busy_db);
    let (idle_key, busy_key) = (format!("{idle_db}/app"), format!("{busy_db}/app"));
    // A joining node that rendezvous hashing gives both pools to.
    let joiner = (0..)
        .map(|i| format!("n{i}"))
        .find(|id| {
            [&idle_key, &busy_key]
                .iter()
                .all(|k| shoal_cluster::hrw::owner(k, ["a", id.as_str()]) == Some(id.as_str()))
        })
        .unwrap();
    let two = |id: &str| {
        let cluster = format!(
            "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n",
            etcd.url, SECRET.0
        );
        Shoal::start_with_env(
            &base_config(pg(), &[&idle_db, &busy_db], &cluster),
            &[SECRET],
        )
    };
    let a = two("a");
    a.connect(&idle_db)
        .await
        .simple_query("SELECT 1")
        .await
        .unwrap();
    let busy = a.connect(&busy_db).await;
    busy.simple_query("SELECT 1").await.unwrap();
    let n = two(&joiner);
    // The idle pool goes to the new node; the one with a client stays.
    eventually("the idle pool given up", Duration::from_secs(10), || {
        logged(&a, &["pool given up by this node", &idle_key])
    })
    .await;
    until_served(&a, &idle_db, Duration::from_secs(10)).await;
    assert!(logged(&n, &["pool owned by this node", &idle_key]));
    busy.simple_query("SELECT 1").await.unwrap();
    let via_new = n.connect(&busy_db).await;
    via_new.simple_query("SELECT 1").await.unwrap();
    assert!(!logged(&a, &["pool given up by this node", &busy_key]));
    assert!(!logged(&n, &["pool owned by this node", &busy_key]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_of_30_seconds_changes_nothing_for_clients() {
    let mut etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    let local = owner.connect(&db).await;
    let relayed = relay.connect(&db).await;
    etcd.stop();
    let outage = std::time::Instant::now();
    let mut rounds = 0;
    while outage.elapsed() < Duration::from_secs(30) {
        for c in [&local, &relayed] {
            c.simple_query("SELECT 1").await.unwrap_or_else(|e| {
                panic!(
                    "a client error {:?} into the outage: {e:?}",
                    outage.elapsed()
                )
            });
        }
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(rounds > 100);
    assert!(owner.log_contains("etcd cannot be reached, by any node"));
    etcd.restart();
    eventually("the lease renewed again", Duration::from_secs(15), || {
        owner.log_contains("cluster lease renewed again")
    })
    .await;
    for c in [&local, &relayed] {
        c.simple_query("SELECT 1").await.unwrap();
    }
    // No ownership changed, nothing was fenced.
    for n in [&a, &b] {
        assert!(!n.log_contains("owns no pools now"));
        assert!(!n.log_contains("pool given up"));
    }
    assert!(!relay.log_contains("pool owned by this node"));
    relay
        .connect(&db)
        .await
        .simple_query("SELECT 1")
        .await
        .unwrap();
}

/// A CA, and a certificate and key it signs for 127.0.0.1 (PEM), written into `dir`; returns
/// the `[cluster]` TLS keys naming the files.
fn node_certs(dir: &std::path::Path, ca: &(rcgen::Certificate, rcgen::KeyPair)) -> String {
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca.0, &ca.1).unwrap();
    let path = |f: &str| dir.join(f).to_str().unwrap().to_owned();
    std::fs::write(path("node.crt"), cert.pem()).unwrap();
    std::fs::write(path("node.key"), key.serialize_pem()).unwrap();
    std::fs::write(path("ca.crt"), ca.0.pem()).unwrap();
    format!(
        "tls_cert = \"{}\"\ntls_key = \"{}\"\ntls_ca = \"{}\"\n",
        path("node.crt"),
        path("node.key"),
        path("ca.crt")
    )
}

fn new_ca() -> (rcgen::Certificate, rcgen::KeyPair) {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    (params.self_signed(&key).unwrap(), key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_run_in_tls_and_a_node_of_another_ca_is_refused() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let ca = new_ca();
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let tls_node = |id: &str, tls: String| {
        let cluster = format!(
            "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n{tls}",
            etcd.url, SECRET.0
        );
        Shoal::start_with_env(&base_config(pg(), &[&db], &cluster), &[SECRET])
    };
    let a = tls_node("a", node_certs(dirs[0].path(), &ca));
    let b = tls_node("b", node_certs(dirs[1].path(), &ca));
    for n in [&a, &b] {
        n.connect(&db).await.simple_query("SELECT 1").await.unwrap();
    }
    let (owner, relay) = owner_and_relay(&a, &b);
    let c = relay.connect(&db).await;
    assert_eq!(simple_rows(&c, "SELECT 'over TLS'").await, ["over TLS"]);
    assert!(owner.log_contains("node link accepted"));
    // A node whose certificate another CA signed cannot link: its clients are refused
    // with a message saying why, and the owner logs the refusal.
    let stranger = tls_node("z", node_certs(dirs[2].path(), &new_ca()));
    let Err(e) = stranger
        .try_connect(&stranger.conninfo("app", APP_PASSWORD, &db))
        .await
    else {
        panic!("the stranger reached the pool's owner");
    };
    assert!(format!("{e:?}").contains("cannot reach node"), "{e:?}");
    eventually(
        "the owner refused the stranger",
        Duration::from_secs(5),
        || owner.log_contains("node link refused"),
    )
    .await;
}

/// Connects through `n`, retrying while the cluster is between owners.
async fn connect_retrying(n: &Shoal, db: &str) -> tokio_postgres::Client {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(c) = n.try_connect(&n.conninfo("app", APP_PASSWORD, db)).await {
            return c;
        }
        assert!(tokio::time::Instant::now() < deadline, "cannot connect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_commit_survives_an_owner_kill_exactly_once() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let a = node(&etcd, "a", &db, "[pool]\npool_size = 3\n");
    let b = node(&etcd, "b", &db, "[pool]\npool_size = 3\n");
    let c = node(&etcd, "c", &db, "[pool]\npool_size = 3\n");
    let nodes = [&a, &b, &c];
    for n in nodes {
        n.connect(&db).await.simple_query("SELECT 1").await.unwrap();
    }
    a.connect(&db)
        .await
        .batch_execute("CREATE TABLE ledger (worker int, seq int)")
        .await
        .unwrap();
    let owner_at = nodes
        .iter()
        .position(|n| n.log_contains("pool owned by this node"))
        .expect("an owner");
    let relays: Vec<&Shoal> = (0..3)
        .filter(|i| *i != owner_at)
        .map(|i| nodes[i])
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..6 {
        let n = relays[w % 2];
        let (addr, db, stop) = (
            n.conninfo("app", APP_PASSWORD, &db),
            db.clone(),
            stop.clone(),
        );
        let mut c = connect_retrying(n, &db).await;
        workers.push(tokio::spawn(async move {
            let (mut acked, mut failed) = (Vec::new(), 0);
            let mut seq = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                seq += 1;
                let sql = format!("INSERT INTO ledger VALUES ({w}, {seq})");
                match c.simple_query(&sql).await {
                    Ok(_) => acked.push(seq),
                    Err(_) => {
                        failed += 1;
                        if c.is_closed() {
                            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                            c = loop {
                                if let Ok((c, conn)) =
                                    tokio_postgres::connect(&addr, tokio_postgres::NoTls).await
                                {
                                    tokio::spawn(conn);
                                    break c;
                                }
                                assert!(tokio::time::Instant::now() < deadline);
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            };
                        }
                    }
                }
            }
            (w, acked, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    nodes[owner_at].signal(libc::SIGKILL);
    // The lease (2 s), a new owner, and a while of traffic there.
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut acked_total = 0;
    let mut failed_total = 0;
    for t in workers {
        let (w, acked, failed) = t.await.unwrap();
        failed_total += failed;
        acked_total += acked.len();
        let check = connect_retrying(relays[0], &db).await;
        let rows = simple_rows(
            &check,
            &format!("SELECT coalesce(string_agg(seq::text, ',' ORDER BY seq), '') FROM ledger WHERE worker = {w}"),
        )
        .await
        .concat();
        let present: Vec<i32> = rows
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        let mut dedup = present.clone();
        dedup.dedup();
        assert_eq!(dedup, present, "worker {w}: a commit applied twice");
        for s in &acked {
            assert!(
                present.binary_search(s).is_ok(),
                "worker {w}: acknowledged commit {s} lost"
            );
        }
    }
    println!("ledger: {acked_total} commits acknowledged, {failed_total} statements failed across the kill");
    // The workers went on after the kill (most moved without an error at all).
    assert!(acked_total > 200, "acked {acked_total}");
    // Only a statement in flight at the kill fails (and, at most, one more sent on the
    // closing connection before the worker sees it closed).
    assert!(failed_total <= 12, "{failed_total} failed statements");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relaying_node_affects_only_its_own_clients() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    let local = owner.connect(&db).await;
    local
        .batch_execute("CREATE TABLE IF NOT EXISTS t (a int)")
        .await
        .unwrap();
    // A relayed client leaves a transaction open, holding one of the two servers.
    let relayed = relay.connect(&db).await;
    relayed
        .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    relay.signal(libc::SIGKILL);
    // The owner ends the relayed session: its transaction rolls back, its server is free.
    eventually("the relayed transaction rolled back", Duration::from_secs(10), || {
        pg().psql_admin(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND state = 'idle in transaction'"
        )) == "0"
    })
    .await;
    assert_eq!(simple_rows(&local, "SELECT count(*) FROM t").await, ["0"]);
    // The owner's own clients never noticed; both servers serve them.
    for _ in 0..20 {
        local.simple_query("SELECT 1").await.unwrap();
    }
    let other = owner.connect(&db).await;
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    local.simple_query("SELECT 2").await.unwrap();
    other.batch_execute("COMMIT").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joining_and_leaving_under_load_fails_no_transaction() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let a = node(&etcd, "a", &db, "[pool]\npool_size = 2\n");
    let b = node(&etcd, "b", &db, "[pool]\npool_size = 2\n");
    let mut clients = Vec::new();
    for w in 0..4 {
        clients.push([&a, &b][w % 2].connect(&db).await);
    }
    let traffic = common::traffic::Traffic::start(clients, "SELECT 1");
    traffic.wait_for_each(5, "every client runs").await;
    let mut c = node(&etcd, "c", &db, "[pool]\npool_size = 2\n");
    // The new node serves clients too (relayed to the owner: the pool is busy, it stays).
    let via_c = c.connect(&db).await;
    via_c.simple_query("SELECT 1").await.unwrap();
    drop(via_c);
    traffic
        .wait_for_each(5, "every client runs on after c joined")
        .await;
    c.signal(libc::SIGTERM);
    assert_eq!(
        c.wait(Duration::from_secs(20)),
        Some(true),
        "c left cleanly"
    );
    traffic
        .wait_for_each(10, "every client runs on after c left")
        .await;
    let failures = traffic.stop().await;
    assert!(failures.is_empty(), "under a join or a leave: {failures:?}");
    assert!(
        !c.log_contains("pool owned by this node"),
        "a busy pool does not move"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shutting_down_under_load_hands_its_relayed_clients_on() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "[pool]\npool_size = 2\n").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(relay.connect(&db).await);
    }
    let traffic = common::traffic::Traffic::start(clients, "SELECT 1");
    traffic.wait_for_each(5, "every client runs").await;
    owner.signal(libc::SIGTERM);
    eventually(
        "the relaying node owns the pool",
        Duration::from_secs(20),
        || relay.log_contains("pool owned by this node"),
    )
    .await;
    traffic
        .wait_for_each(10, "every client runs on at the new owner")
        .await;
    let failures = traffic.stop().await;
    assert!(failures.is_empty(), "while the owner left: {failures:?}");
    // Handed back by the leaving owner, not lost with it.
    assert!(relay.log_contains("is shutting down"), "no hand-back seen");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relaying_node_shutting_down_tells_its_idle_clients_as_a_single_node_does() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "").await;
    let (owner, relay) = owner_and_relay(&a, &b);
    let (client, conn) = tokio_postgres::connect(
        &relay.conninfo("app", APP_PASSWORD, &db),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let ended = tokio::spawn(async move {
        conn.await
            .err()
            .and_then(|e| e.as_db_error().map(|d| d.code().code().to_owned()))
    });
    client.simple_query("SELECT 1").await.unwrap();
    relay.signal(libc::SIGTERM);
    let code = tokio::time::timeout(Duration::from_secs(15), ended)
        .await
        .expect("the client is told within the shutdown")
        .unwrap();
    assert_eq!(code.as_deref(), Some("57P01"));
    // The owner goes on serving.
    owner
        .connect(&db)
        .await
        .simple_query("SELECT 1")
        .await
        .unwrap();
}

/// An owner's own clients (connected to it, not relayed) are told `57P01` when it shuts
/// down, as a single node's are: never a bare close, idle or between statements of a
/// transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_shutting_down_tells_its_own_clients() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let (a, b) = two_nodes(&etcd, &db, "").await;
    let (owner, _relay) = owner_and_relay(&a, &b);
    let mut ended = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..2 {
        let (client, conn) = tokio_postgres::connect(
            &owner.conninfo("app", APP_PASSWORD, &db),
            tokio_postgres::NoTls,
        )
        .await
        .unwrap();
        ended.push(tokio::spawn(async move {
            conn.await
                .err()
                .and_then(|e| e.as_db_error().map(|d| d.code().code().to_owned()))
        }));
        client.simple_query("SELECT 1").await.unwrap();
        clients.push(client);
    }
    clients[1].simple_query("BEGIN").await.unwrap();
    owner.signal(libc::SIGTERM);
    // The one in a transaction block ends it (the shutdown waits for it), then is told too.
    let _ = clients[1].simple_query("COMMIT").await;
    for e in ended {
        let code = tokio::time::timeout(Duration::from_secs(15), e)
            .await
            .expect("the client is told within the shutdown")
            .unwrap();
        assert_eq!(code.as_deref(), Some("57P01"));
    }
}

/// The cluster status one node gives at `GET /api/cluster`.
fn api_cluster(n: &Shoal) -> serde_json::Value {
    let (code, body) = http_get(&format!("http://{}/api/cluster", n.metrics.unwrap()));
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Waits until the relaying node has `parked` clients parked and the owner serves `streams`
/// relayed ones.
async fn until_parked(relay: &Shoal, owner: &Shoal, parked: u64, streams: u64) {
    eventually(
        &format!("{parked} parked, {streams} relayed streams at the owner"),
        Duration::from_secs(10),
        || api_cluster(relay)["parked"] == parked && api_cluster(owner)["relayed_in"] == streams,
    )
    .await;
}

/// A relayed client idle past `park_idle_after` is parked: its session at the owner goes
/// (no stream, no session there), and its next statement resumes it there, unnoticed, with
/// its SETs, its prepared statements and its cancel key. One that leaves while parked costs
/// the owner nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relayed_client_is_parked_and_resumes_with_its_state() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let extra = "park_idle_after = 0.3\n[metrics]\nlisten = \"127.0.0.1:0\"\n";
    let (a, b) = two_nodes(&etcd, &db, extra).await;
    let (owner, relay) = owner_and_relay(&a, &b);
    let c = relay.connect(&db).await;
    c.batch_execute("SET application_name = 'parked-app'")
        .await
        .unwrap();
    let stmt = c.prepare("SELECT $1::int + 1").await.unwrap();
    until_parked(relay, owner, 1, 0).await;
    // Back: the same session, as far as the client can tell.
    let row = c.query_one(&stmt, &[&41i32]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
    assert_eq!(
        simple_rows(&c, "SHOW application_name").await,
        ["parked-app"]
    );
    let status = api_cluster(relay);
    assert_eq!(status["parked"], 0, "{status}");
    assert!(status["parks"].as_u64().unwrap() >= 1, "{status}");
    // Parked again, then a statement far larger than one read, and than what is kept until
    // the owner answers: it reaches the owner in pieces, all of them.
    until_parked(relay, owner, 1, 0).await;
    let big = "x".repeat(600_000);
    assert_eq!(
        simple_rows(&c, &format!("SELECT length('{big}')")).await,
        ["600000"]
    );
    // Parked again, then cancelled mid-query: the key the client holds still works.
    until_parked(relay, owner, 1, 0).await;
    let c = cancel_a_sleep(c, &db).await;
    assert_eq!(simple_rows(&c, "SELECT 1").await, ["1"]);
    // Parked, then gone: nothing is opened at the owner for it.
    until_parked(relay, owner, 1, 0).await;
    drop(c);
    eventually("the client gone", Duration::from_secs(10), || {
        api_cluster(relay)["relayed_out"] == 0
    })
    .await;
    assert_eq!(api_cluster(owner)["relayed_in"], 0);
    assert!(!relay.log_contains("ERROR") && !owner.log_contains("ERROR"));
}

/// A parked client's statement goes with its stream's opening, before the owner says it
/// takes the client up. An owner that is leaving refuses it unread: the relaying node keeps
/// the statement, waits for the pool's next owner and sends it there, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_clients_statement_refused_by_a_leaving_owner_runs_once_at_the_next() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let extra = "park_idle_after = 0.3\n[metrics]\nlisten = \"127.0.0.1:0\"\n";
    let (a, b) = two_nodes(&etcd, &db, extra).await;
    let (owner, relay) = owner_and_relay(&a, &b);
    direct(&db)
        .await
        .batch_execute("CREATE TABLE ledger (n int)")
        .await
        .unwrap();
    let c = relay.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    // A transaction at the owner keeps it from leaving while the client comes back.
    let holding = owner.connect(&db).await;
    holding.batch_execute("BEGIN; SELECT 1").await.unwrap();
    until_parked(relay, owner, 1, 0).await;
    owner.signal(libc::SIGTERM);
    eventually("the owner shutting down", Duration::from_secs(10), || {
        owner.log_contains("shutting down: no new connections")
    })
    .await;
    let insert = tokio::spawn(async move {
        c.batch_execute("INSERT INTO ledger VALUES (1)").await?;
        Ok::<_, tokio_postgres::Error>(c)
    });
    eventually(
        "the client waiting for the next owner",
        Duration::from_secs(10),
        || relay.log_contains("waits for the pool's next owner"),
    )
    .await;
    assert!(!insert.is_finished(), "it ran at the leaving owner");
    holding.batch_execute("COMMIT").await.unwrap();
    let c = tokio::time::timeout(Duration::from_secs(30), insert)
        .await
        .expect("the statement runs once the owner has left")
        .unwrap()
        .unwrap();
    assert!(relay.log_contains("pool owned by this node"));
    assert_eq!(simple_rows(&c, "SELECT count(*) FROM ledger").await, ["1"]);
}

/// Sessions other nodes relay to a pool's owner are those nodes' connections: they do not
/// count against the owner's `max_client_conn`, which bounds its own connections (an owner
/// counting them refused its own clients in a million-client connect storm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relayed_sessions_do_not_count_against_the_owners_max_client_conn() {
    let etcd = Etcd::start();
    let db = cluster_db();
    let start = |id: &str| {
        let cluster = format!(
            "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\npark_idle_after = 0\nsecret_env = \"{}\"\n",
            etcd.url, SECRET.0
        );
        let config = with_server_keys(&base_config(pg(), &[&db], &cluster), "max_client_conn = 2");
        Shoal::start_with_env(&config, &[SECRET])
    };
    let (a, b) = (start("a"), start("b"));
    for n in [&a, &b] {
        n.connect(&db).await.simple_query("SELECT 1").await.unwrap();
    }
    let (owner, relay) = owner_and_relay(&a, &b);
    // Two clients relayed to the owner, each with a session there (never parked).
    let relayed = [relay.connect(&db).await, relay.connect(&db).await];
    for c in &relayed {
        assert_eq!(simple_rows(c, "SELECT 6").await, ["6"]);
    }
    // The owner still takes two clients of its own, and refuses a third.
    let own = [owner.connect(&db).await, owner.connect(&db).await];
    for c in &own {
        assert_eq!(simple_rows(c, "SELECT 7").await, ["7"]);
    }
    for n in [owner, relay] {
        let err = n
            .try_connect(&n.conninfo("app", APP_PASSWORD, &db))
            .await
            .expect_err("a third client of the node's own is refused");
        assert_eq!(code(&err), "53300");
        assert!(
            format!("{err:?}").contains("max_client_conn (2)"),
            "{err:?}"
        );
    }
    // The relayed clients were not disturbed.
    for c in &relayed {
        assert_eq!(simple_rows(c, "SELECT 8").await, ["8"]);
    }
}
