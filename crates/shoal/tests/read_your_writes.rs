//! Read-your-writes goes wherever the session goes: a client that wrote, then was taken up
//! by a new process (an upgrade) or parked and resumed at its pool's owner (a cluster),
//! still reads only where its write is visible. Real PostgreSQL primary and streaming
//! replicas whose replay is paused, so a read on a replica would miss the write.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::changes::metric;
use common::etcd::Etcd;
use common::replication::{until_reads_reach_replicas, with_table, Replicated};
use common::*;

/// Reads spread over the replicas and none is held back by lag.
const KEYS: &str = "read_routing = \"split\"\nmax_replica_lag = \"off\"";

/// Writes a row with every replica's replay paused; its id.
async fn write_with_replicas_paused(r: &Replicated, c: &tokio_postgres::Client) -> i32 {
    for replica in &r.replicas {
        replica.psql_admin("SELECT pg_wal_replay_pause()");
    }
    c.query_one("INSERT INTO t (v) VALUES (1) RETURNING id", &[])
        .await
        .unwrap()
        .get(0)
}

/// `reads` reads of row `id` through `c`, each of which must see it.
async fn read_back(c: &tokio_postgres::Client, id: i32, reads: usize) {
    for i in 0..reads {
        let row = c
            .query_one(
                "SELECT count(*), inet_server_port() FROM t WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap();
        let port = row.get::<_, i32>(1);
        assert_eq!(
            row.get::<_, i64>(0),
            1,
            "read {i} on port {port} missed the write"
        );
        // Paced over several replica checks of the session's new home.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn resume_replay(r: &Replicated) {
    for replica in &r.replicas {
        replica.psql_admin("SELECT pg_wal_replay_resume()");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_read_back_after_an_upgrade_moves_the_client() {
    let db = unique_db("ryw_upgrade");
    let r = with_table(&db);
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("upgrade.sock");
    let control = control.to_str().unwrap();
    let config = r.shoal_config(&db, KEYS, "");
    let mut old = Shoal::start_with_args(&config, &[], &["--upgrade-socket", control]);
    let c = old.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let id = write_with_replicas_paused(&r, &c).await;
    // A new process takes over; the client goes to it (its socket and its session) at the
    // end of its next transaction, which the old process serves.
    let new = Shoal::start_with_args(&config, &[], &["--upgrade-socket", control]);
    read_back(&c, id, 1).await;
    assert_eq!(
        old.wait(Duration::from_secs(30)),
        Some(true),
        "the old process hands over and exits: {}",
        old.log_tail(30)
    );
    assert!(new.log_contains("took over") || old.log_contains("took over"));
    read_back(&c, id, 50).await;
    // Once the replicas show the write, reads go to them again.
    resume_replay(&r);
    until_reads_reach_replicas(&r, &c).await;
}

const SECRET: (&str, &str) = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_read_back_after_a_relayed_client_parks_and_resumes() {
    let db = unique_db("ryw_parked");
    let r = with_table(&db);
    let etcd = Etcd::start();
    let node = |id: &str| {
        let cluster = format!(
            "[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\n\
             lease_ttl = 2\nsecret_env = \"{}\"\npark_idle_after = 0.3\n\
             [metrics]\nlisten = \"127.0.0.1:0\"\n",
            etcd.url, SECRET.0
        );
        Shoal::start_with_env(&r.shoal_config(&db, KEYS, &cluster), &[SECRET])
    };
    let (a, b) = (node("a"), node("b"));
    for n in [&a, &b] {
        n.connect(&db).await.simple_query("SELECT 1").await.unwrap();
    }
    let owns = |n: &Shoal| n.log_contains("pool owned by this node");
    assert!(owns(&a) != owns(&b), "exactly one node owns the pool");
    let relay = if owns(&a) { &b } else { &a };
    let c = relay.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let id = write_with_replicas_paused(&r, &c).await;
    for _ in 0..2 {
        // Idle past park_idle_after: its session at the owner goes; the next read takes it
        // up again from what the owner last shipped.
        let parks = metric(relay, "shoal_cluster_parks_total");
        eventually("the client parks", Duration::from_secs(10), || {
            metric(relay, "shoal_cluster_parks_total") > parks
        })
        .await;
        read_back(&c, id, 10).await;
    }
    resume_replay(&r);
    until_reads_reach_replicas(&r, &c).await;
}
