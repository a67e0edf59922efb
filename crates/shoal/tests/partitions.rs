//! The cluster under network partitions: each Shoal node in a network namespace of its own,
//! etcd and PostgreSQL on a bridge beside them, and nftables dropping packets silently
//! between chosen parts (see `common::netns`). Clients write a ledger throughout; after each
//! partition heals, every acknowledged write is there exactly once, the pool never had more
//! servers than its size, and every error a client saw carried a SQLSTATE.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::etcd::Etcd;
use common::netns::Net;
use common::*;

const SECRET: (&str, &str) = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");
const POOL_SIZE: usize = 3;

/// Nodes in namespaces, etcd and a PostgreSQL of their own on the bridge.
struct Cluster {
    nodes: Vec<Node>,
    pg: Pg,
    etcd: Etcd,
    db: String,
    net: Net,
}

struct Node {
    shoal: Shoal,
    ns: String,
    addr: String,
}

impl Cluster {
    /// `None` where this machine cannot make namespaces (the test then says so and passes:
    /// it needs root's CAP_NET_ADMIN, as CI and the sessions have).
    fn start(tag: u8, nodes: &[&str]) -> Option<Cluster> {
        if !Net::available() {
            eprintln!("SKIPPED: network namespaces or nftables are not available here");
            return None;
        }
        let mut net = Net::new(tag);
        let hub = net.hub();
        let prefix = hub.trim_end_matches(".1");
        let hba = format!(
            "host all all 127.0.0.1/32 scram-sha-256\nhost all all {prefix}.0/24 scram-sha-256\n"
        );
        let pg = Pg::start_with(
            free_port(),
            &[("pg_hba.conf", &hba)],
            &format!("-c listen_addresses=127.0.0.1,{hub}"),
        );
        let db = unique_db("partition");
        pg.create_database(&db);
        let etcd = Etcd::start_on(&hub);
        let mut started = Vec::new();
        for (i, id) in nodes.iter().enumerate() {
            let (ns, addr) = net.node(10 + i as u8);
            let config = base_config(
                &pg,
                &[&db],
                &format!(
                    "[pool]\npool_size = {POOL_SIZE}\nquery_wait_timeout = 10\n\
                     [cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"{addr}:0\"\n\
                     lease_ttl = 2\nsecret_env = \"{}\"\n",
                    etcd.url, SECRET.0
                ),
            )
            .replacen(
                "listen = [\"127.0.0.1:0\"]",
                &format!("listen = [\"{addr}:0\"]"),
                1,
            )
            .replace("host = \"127.0.0.1\"", &format!("host = \"{hub}\""));
            let shoal = Shoal::start_in(Some(&ns), &config, &[SECRET], &[]);
            started.push(Node { shoal, ns, addr });
        }
        Some(Cluster {
            nodes: started,
            pg,
            etcd,
            db,
            net,
        })
    }

    /// Fails (with what the nodes logged) if a client saw an error without a SQLSTATE.
    fn no_unclear_errors(&self, unclear: &[String]) {
        if unclear.is_empty() {
            return;
        }
        for (i, n) in self.nodes.iter().enumerate() {
            let log = n.shoal.log.lock().unwrap();
            let notable: Vec<&String> = log
                .iter()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR ") || l.contains(" INFO "))
                .collect();
            eprintln!("node {i} ({}):", n.addr);
            for l in notable.iter().rev().take(80).rev() {
                eprintln!("  {l}");
            }
        }
        panic!("errors without a SQLSTATE: {unclear:?}");
    }

    /// Each node serves a query (so the pool has its owner); returns (owner, the other).
    async fn owner_and_relay(&self) -> (usize, usize) {
        for n in &self.nodes {
            n.shoal
                .connect(&self.db)
                .await
                .simple_query("SELECT 1")
                .await
                .unwrap();
        }
        let owner = self
            .nodes
            .iter()
            .position(|n| n.shoal.log_contains("pool owned by this node"))
            .expect("an owner");
        (owner, 1 - owner)
    }
}

/// What a ledger worker saw.
#[derive(Default)]
struct Seen {
    acked: Vec<u32>,
    /// Errors without a SQLSTATE (a bare close, a reset, a hang): each is a defect.
    unclear: Vec<String>,
    clear: usize,
}

/// Workers writing `(worker, seq)` rows through chosen nodes until stopped, reconnecting
/// (through the same node) when their connection ends.
struct Ledger {
    stop: Arc<AtomicBool>,
    progress: Vec<Arc<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<(usize, Seen)>>,
}

/// A statement or login that takes longer than this counts as a hang.
const HANG: Duration = Duration::from_secs(60);

fn classify(e: &tokio_postgres::Error, during: &str, seen: &mut Seen) {
    if e.as_db_error().is_some() {
        seen.clear += 1;
    } else {
        let at = humantime_now();
        seen.unclear.push(format!("{during} at {at}: {e}"));
    }
}

/// The wall clock's minutes and seconds, as the nodes' logs show them (UTC).
fn humantime_now() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let s = t.as_secs();
    format!(
        "{:02}:{:02}.{:06}",
        (s / 60) % 60,
        s % 60,
        t.subsec_micros()
    )
}

impl Ledger {
    async fn start(conninfos: Vec<String>) -> Ledger {
        let stop = Arc::new(AtomicBool::new(false));
        let mut progress = Vec::new();
        let mut tasks = Vec::new();
        for (w, info) in conninfos.into_iter().enumerate() {
            let (stop, done) = (stop.clone(), Arc::new(AtomicU64::new(0)));
            progress.push(done.clone());
            tasks.push(tokio::spawn(async move {
                let mut seen = Seen::default();
                let mut client: Option<tokio_postgres::Client> = None;
                let mut seq = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let c = match client.take() {
                        Some(c) if !c.is_closed() => c,
                        _ => match tokio::time::timeout(
                            HANG,
                            tokio_postgres::connect(&info, tokio_postgres::NoTls),
                        )
                        .await
                        {
                            Ok(Ok((c, conn))) => {
                                tokio::spawn(conn);
                                c
                            }
                            Ok(Err(e)) => {
                                classify(&e, "login", &mut seen);
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            }
                            Err(_) => {
                                seen.unclear.push("login hung".into());
                                continue;
                            }
                        },
                    };
                    seq += 1;
                    let sql = format!("INSERT INTO ledger VALUES ({w}, {seq})");
                    match tokio::time::timeout(HANG, c.simple_query(&sql)).await {
                        Ok(Ok(_)) => {
                            seen.acked.push(seq);
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Err(e)) => {
                            classify(&e, "statement", &mut seen);
                            // A FATAL ends the session: the connection is not used again
                            // (its end may not have been read yet).
                            if e.as_db_error().is_some_and(|d| d.severity() == "FATAL") {
                                continue;
                            }
                        }
                        Err(_) => seen.unclear.push(format!("statement {seq} hung")),
                    }
                    client = Some(c);
                }
                (w, seen)
            }));
        }
        Ledger {
            stop,
            progress,
            tasks,
        }
    }

    fn done(&self, workers: &[usize]) -> Vec<u64> {
        workers
            .iter()
            .map(|w| self.progress[*w].load(Ordering::Relaxed))
            .collect()
    }

    /// Waits until each of `workers` has acknowledged `more` writes beyond now.
    async fn until_progress(&self, workers: &[usize], more: u64, what: &str) {
        let base = self.done(workers);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self
            .done(workers)
            .iter()
            .zip(&base)
            .any(|(n, b)| *n < b + more)
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: workers {workers:?} at {:?}, from {base:?}",
                self.done(workers)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the workers and checks the ledger in `db` of `pg`.
    /// Returns the errors without a SQLSTATE the workers saw.
    async fn check(self, pg: &Pg, db: &str) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut unclear = Vec::new();
        let direct = direct_on(pg, db).await;
        let mut acked_total = 0;
        for t in self.tasks {
            let (w, seen) = t.await.unwrap();
            acked_total += seen.acked.len();
            for e in &seen.unclear {
                unclear.push(format!("worker {w}: {e}"));
            }
            let present: Vec<u32> = direct
                .query(
                    "SELECT seq FROM ledger WHERE worker = $1 ORDER BY seq",
                    &[&(w as i32)],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, i32>(0) as u32)
                .collect();
            let mut once = present.clone();
            once.dedup();
            assert_eq!(once, present, "worker {w}: a write applied twice");
            for s in &seen.acked {
                assert!(
                    present.binary_search(s).is_ok(),
                    "worker {w}: acknowledged write {s} lost"
                );
            }
            println!(
                "worker {w}: {} acknowledged, {} clear errors",
                seen.acked.len(),
                seen.clear
            );
        }
        assert!(acked_total > 0);
        unclear
    }
}

/// Samples the pool's servers at PostgreSQL (not the owners' fence sessions) until
/// stopped; `peak` is the most seen at once.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl Sampler {
    async fn start(pg: &Pg, db: &str) -> Sampler {
        let (admin, conn) = tokio_postgres::connect(
            &format!(
                "host=127.0.0.1 port={} user=postgres password=postgres dbname=postgres",
                pg.port
            ),
            tokio_postgres::NoTls,
        )
        .await
        .expect("admin connection");
        tokio::spawn(conn);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let sql = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND backend_type = 'client backend' AND application_name IS DISTINCT FROM 'shoal fence'"
        );
        let task = tokio::spawn(async move {
            let mut peak = 0;
            while !s.load(Ordering::Relaxed) {
                let n: i64 = admin.query_one(&sql, &[]).await.unwrap().get(0);
                peak = peak.max(n as usize);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            peak
        });
        Sampler { stop, task }
    }

    async fn peak(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// Under way before a cut: the ledger table, four workers writing (two through the owner,
/// two through the other node) and the server sampler, each worker past its first writes.
struct Load {
    owner: usize,
    relay: usize,
    ledger: Ledger,
    sampler: Sampler,
}

async fn under_load(c: &Cluster) -> Load {
    let (owner, relay) = c.owner_and_relay().await;
    c.nodes[owner]
        .shoal
        .connect(&c.db)
        .await
        .batch_execute("CREATE TABLE ledger (worker int, seq int)")
        .await
        .unwrap();
    let info = |n: usize| c.nodes[n].shoal.conninfo("app", APP_PASSWORD, &c.db);
    let ledger = Ledger::start(vec![info(owner), info(owner), info(relay), info(relay)]).await;
    let sampler = Sampler::start(&c.pg, &c.db).await;
    ledger
        .until_progress(&[0, 1, 2, 3], 20, "before the cut")
        .await;
    Load {
        owner,
        relay,
        ledger,
        sampler,
    }
}

impl Load {
    /// Stops the load and checks what every test of a cut checks: the ledger exact, no
    /// error without a SQLSTATE, never more servers than the pool's size.
    async fn check(self, c: &Cluster) {
        let peak = self.sampler.peak().await;
        let unclear = self.ledger.check(&c.pg, &c.db).await;
        c.no_unclear_errors(&unclear);
        assert!(
            peak <= POOL_SIZE,
            "{peak} servers for pool_size {POOL_SIZE}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_the_owner_but_not_from_etcd_loses_and_mixes_nothing() {
    let Some(c) = Cluster::start(1, &["a", "b"]) else {
        return;
    };
    let load = under_load(&c).await;
    let (owner, relay, ledger) = (load.owner, load.relay, &load.ledger);
    c.net
        .cut_from_hosts(&c.nodes[relay].ns, &[c.nodes[owner].addr.as_str()]);
    // The owner's own clients go on while the other node cannot reach it.
    ledger
        .until_progress(&[0, 1], 100, "the owner's clients during the cut")
        .await;
    let stalled = ledger.done(&[2, 3]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        ledger
            .done(&[2, 3])
            .iter()
            .zip(&stalled)
            .all(|(n, s)| n - s <= 1),
        "relayed writes cannot be acknowledged through a cut link"
    );
    c.net.heal(&c.nodes[relay].ns);
    // Relayed clients go on once the link carries again.
    ledger
        .until_progress(&[2, 3], 20, "relayed clients after the cut")
        .await;
    load.check(&c).await;
    // Nobody claimed the pool: its owner never lost etcd.
    assert!(!c.nodes[relay].shoal.log_contains("pool owned by this node"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_cut_from_etcd_but_not_from_the_others_hands_its_pool_over_safely() {
    let Some(c) = Cluster::start(2, &["a", "b"]) else {
        return;
    };
    let load = under_load(&c).await;
    let (owner, relay, ledger) = (load.owner, load.relay, &load.ledger);
    let hub = c.net.hub();
    c.net
        .cut_from_port(&c.nodes[owner].ns, &hub, c.etcd.client_port());
    // The other node renews, so the cut one fences its pool; its lease expires and the
    // other takes the pool over (PostgreSQL ending whatever the old owner had there).
    eventually("the pool taken over", Duration::from_secs(30), || {
        c.nodes[relay].shoal.log_contains("pool owned by this node")
    })
    .await;
    assert!(c.nodes[owner]
        .shoal
        .log_contains("cluster lease lapsed: this node owns no pools now"));
    ledger
        .until_progress(&[2, 3], 20, "the new owner's clients")
        .await;
    c.net.heal(&c.nodes[owner].ns);
    // The cut node joins again by itself and relays its clients to the new owner.
    ledger
        .until_progress(&[0, 1], 20, "the old owner's clients after the cut")
        .await;
    load.check(&c).await;
}
