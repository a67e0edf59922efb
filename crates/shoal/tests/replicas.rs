//! Read replicas against real streaming replication: a primary and two hot standbys made
//! with `pg_basebackup -R`, Shoal splitting reads from writes in front of them. Which
//! backend ran a statement is read from `inet_server_port()` (a stable function, so a
//! read may go to a replica).
#![allow(clippy::disallowed_methods)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::replication::{port_of, psql_in, until_reads_reach_replicas, with_table, Replicated};
use common::*;

/// Shoal in front of `r`'s primary for `db`, with its replicas and `keys` in the database's
/// section.
fn shoal(r: &Replicated, db: &str, keys: &str) -> Shoal {
    shoal_with(r, db, keys, "")
}

/// [`shoal`], with `extra` sections in the configuration.
fn shoal_with(r: &Replicated, db: &str, keys: &str, extra: &str) -> Shoal {
    Shoal::start(&r.shoal_config(db, keys, extra))
}

async fn spread(c: &tokio_postgres::Client, n: usize) -> HashMap<u16, usize> {
    let mut by_port = HashMap::new();
    for _ in 0..n {
        *by_port.entry(port_of(c).await).or_insert(0) += 1;
    }
    by_port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_spread_over_the_replicas_and_writes_reach_only_the_primary() {
    let db = unique_db("split");
    let r = with_table(&db);
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let by_port = spread(&c, 60).await;
    for p in &r.replicas {
        assert!(
            by_port.get(&p.port).copied().unwrap_or(0) > 0,
            "{by_port:?}"
        );
    }
    assert_eq!(by_port.get(&r.primary.port), None, "{by_port:?}");

    // Every kind of statement that writes, or might: each must run (a replica would refuse
    // it with 25006), so each reached the primary.
    let writes = [
        "INSERT INTO t (v) VALUES (1)",
        "UPDATE t SET v = v + 1 WHERE id = 1",
        "WITH d AS (DELETE FROM t WHERE v < 0 RETURNING id) SELECT count(*) FROM d",
        "WITH i AS (INSERT INTO t (v) VALUES (2) RETURNING id) SELECT id FROM i",
        "SELECT * FROM t FOR UPDATE",
        "SELECT * FROM t FOR SHARE",
        "SELECT nextval('s')",
        "SELECT setval('s', 10)",
        "SELECT pg_advisory_lock(7), pg_advisory_unlock(7)",
        "SELECT * INTO TEMP tt FROM t",
        "CREATE TEMP TABLE tmp (a int)",
        "BEGIN; SELECT 1; COMMIT",
        "SELECT 1; INSERT INTO t (v) VALUES (3)",
        "LISTEN ch; UNLISTEN ch",
        "SELECT set_config('app.x', '1', false)",
        "CREATE TABLE t2 (a int); DROP TABLE t2",
        "TRUNCATE t2_missing_is_an_error_not_a_write",
    ];
    for sql in writes {
        match c.simple_query(sql).await {
            Ok(_) => {}
            Err(e) if sql.starts_with("TRUNCATE") => assert_eq!(code(&e), "42P01"),
            Err(e) => panic!("{sql}: {e:?}"),
        }
    }
    // The extended protocol too, with parameters.
    c.execute("INSERT INTO t (v) VALUES ($1)", &[&4i32])
        .await
        .unwrap();
    let tx = c.query_one("SELECT nextval('s')", &[]).await.unwrap();
    assert!(tx.get::<_, i64>(0) > 10);
    // An explicit transaction without READ ONLY stays on the primary, reads included.
    c.simple_query("BEGIN").await.unwrap();
    assert_eq!(port_of(&c).await, r.primary.port);
    c.execute("INSERT INTO t (v) VALUES (5)", &[])
        .await
        .unwrap();
    c.simple_query("COMMIT").await.unwrap();
    // One declared READ ONLY may run on a replica (once the replicas show this client's
    // writes: until then its reads stay on the primary).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        c.simple_query("BEGIN READ ONLY").await.unwrap();
        let in_block = port_of(&c).await;
        assert_eq!(port_of(&c).await, in_block, "one transaction, one server");
        c.simple_query("COMMIT").await.unwrap();
        if in_block != r.primary.port {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never on a replica");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Writes that do not look like writes: a view over a writing function, a cast whose
/// function writes, an operator whose function writes, a quoted name that is another
/// function than its lower-case twin, functions that take a transaction id. Each must run
/// (a replica refuses it with 25006), so each reached the primary. Inside a READ ONLY
/// block, which cannot move, what is not proven is refused by Shoal, never trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_behind_views_casts_operators_and_names_reach_only_the_primary() {
    let db = unique_db("hidden");
    let r = with_table(&db);
    psql_in(
        &r.primary,
        &db,
        "CREATE TABLE log (at int);
         CREATE FUNCTION bump() RETURNS int LANGUAGE sql VOLATILE
           AS 'INSERT INTO log VALUES (1) RETURNING at';
         CREATE VIEW v AS SELECT bump() AS n;
         CREATE VIEW plain AS SELECT count(*) AS n FROM t;
         CREATE FUNCTION g() RETURNS int LANGUAGE sql STABLE AS 'SELECT 1';
         CREATE FUNCTION \"G\"() RETURNS int LANGUAGE sql VOLATILE
           AS 'INSERT INTO log VALUES (2) RETURNING at';
         CREATE TYPE mood AS (m int);
         CREATE FUNCTION to_mood(int) RETURNS mood LANGUAGE sql VOLATILE
           AS 'INSERT INTO log VALUES (3) RETURNING ROW(at)::mood';
         CREATE CAST (int AS mood) WITH FUNCTION to_mood(int);
         CREATE FUNCTION plus_log(int, int) RETURNS int LANGUAGE sql VOLATILE
           AS 'INSERT INTO log VALUES (4) RETURNING $1 + $2';
         CREATE OPERATOR ### (LEFTARG = int, RIGHTARG = int, FUNCTION = plus_log);",
    );
    r.wait_caught_up();
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    // The catalogue the proof reads is the primary's as of the first checks: wait until a
    // read of the new view is proven (it then goes to a replica).
    let replica_ports: Vec<u16> = r.replicas.iter().map(|p| p.port).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let row = c
            .query_one("SELECT n, inet_server_port() FROM plain", &[])
            .await
            .unwrap();
        if replica_ports.contains(&(row.get::<_, i32>(1) as u16)) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "plain views never reached a replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for sql in [
        "SELECT * FROM v",
        "SELECT 1::mood",
        "SELECT 1 ### 2",
        "SELECT \"G\"()",
        "SELECT txid_current()",
        "SELECT pg_current_xact_id()",
    ] {
        for _ in 0..5 {
            if let Err(e) = c.simple_query(sql).await {
                panic!("{sql} reached a replica: {e:?}");
            }
            if let Err(e) = c.query(sql, &[]).await {
                panic!("{sql} (extended) reached a replica: {e:?}");
            }
        }
    }
    // A READ ONLY block may run on a replica; what it cannot prove there is refused, not
    // passed: SET TRANSACTION READ WRITE, a COMMIT with a write behind it in one string.
    for later in [
        "SET TRANSACTION READ WRITE",
        "SET transaction_read_only = off",
        "COMMIT; INSERT INTO t (v) VALUES (9)",
    ] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            c.simple_query("BEGIN READ ONLY").await.unwrap();
            if port_of(&c).await != r.primary.port {
                break;
            }
            c.simple_query("COMMIT").await.unwrap();
            assert!(tokio::time::Instant::now() < deadline, "never on a replica");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let e = c.simple_query(later).await.expect_err(later);
        assert_eq!(code(&e), "25006", "{later}: {e:?}");
        let message = e
            .as_db_error()
            .map(|d| d.message().to_owned())
            .unwrap_or_default();
        assert!(
            message.contains("read replica"),
            "{later}: refused by Shoal, not the replica: {message}"
        );
        c.simple_query("ROLLBACK").await.unwrap();
    }
    // Every write above ran once per try on the primary, none on a replica.
    let logged = psql_in(&r.primary, &db, "SELECT count(*) FROM log");
    assert_eq!(
        logged, "40",
        "each of the four writing statements, ten times"
    );

    // In a READ ONLY block on a replica, a client that waits for its Parse's answer before
    // it sends the rest (Flush) is answered: each message is proven as it comes.
    let mut raw = Raw::login(s.addr, "raw", &db, &[]).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        raw.simple("BEGIN READ ONLY").await.unwrap();
        let port: u16 = raw.simple("SELECT inet_server_port()").await.unwrap()[0]
            .parse()
            .unwrap();
        if port != r.primary.port {
            break;
        }
        raw.simple("COMMIT").await.unwrap();
        assert!(tokio::time::Instant::now() < deadline, "never on a replica");
    }
    let mut b = BytesMut::new();
    raw::parse(&mut b, "ro", "SELECT count(*) FROM t");
    raw::describe(&mut b, b'S', "ro");
    raw::flush(&mut b);
    raw.send(&b).await;
    assert_eq!(raw.recv().await.map(|m| m.tag), Some('1'), "ParseComplete");
    assert_eq!(raw.recv().await.map(|m| m.tag), Some('t'));
    assert_eq!(raw.recv().await.map(|m| m.tag), Some('T'));
    let mut b = BytesMut::new();
    raw::bind(&mut b, "", "ro", &[]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    raw.send(&b).await;
    let tags: String = raw.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "2DCZ");
    // A write's Parse in the block is refused, and the rest of its unit skipped.
    let mut b = BytesMut::new();
    raw::parse(&mut b, "", "SELECT bump()");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    raw.send(&b).await;
    let msgs = raw.until_ready().await;
    assert_eq!(msgs[0].code(), "25006", "{}", msgs[0].text());
    assert_eq!(raw.simple("ROLLBACK").await.unwrap(), Vec::<String>::new());

    // A view redefined to write, straight on the primary (no DDL through Shoal): the
    // catalogue's version check sees it, and its reads go to the primary from then on.
    psql_in(
        &r.primary,
        &db,
        "CREATE OR REPLACE VIEW plain AS SELECT bump()::bigint AS n",
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        // Until it is seen, a replica may refuse the write (25006): no harm, and retried.
        let on = c
            .query_one("SELECT n, inet_server_port() FROM plain", &[])
            .await;
        if on.is_ok_and(|row| row.get::<_, i32>(1) as u16 == r.primary.port) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a view redefined outside Shoal was still sent to a replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..5 {
        let row = c
            .query_one("SELECT n, inet_server_port() FROM plain", &[])
            .await
            .expect("runs on the primary");
        assert_eq!(row.get::<_, i32>(1) as u16, r.primary.port);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_always_reads_its_own_writes() {
    let db = unique_db("ryw");
    let r = with_table(&db);
    // 2,000 writes, each read back at once. No lag limit: a replica whose replay is paused
    // stays in use, so only read-your-writes keeps a writer's reads away from it.
    let s = shoal(
        &r,
        &db,
        "read_routing = \"split\"\nmax_replica_lag = \"off\"\nreplica_check_interval = 0.05",
    );
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let stale = &r.replicas[0];
    stale.psql_admin("SELECT pg_wal_replay_pause()");
    let mut tasks = Vec::new();
    for k in 0..4 {
        let c = s.connect(&db).await;
        let replica_ports: Vec<u16> = r.replicas.iter().map(|p| p.port).collect();
        tasks.push(tokio::spawn(async move {
            let read = c
                .prepare("SELECT count(*), inet_server_port() FROM t WHERE id = $1")
                .await
                .unwrap();
            let mut on_replica = 0;
            for i in 0..500 {
                let id: i32 = c
                    .query_one(
                        "INSERT INTO t (v) VALUES ($1) RETURNING id",
                        &[&(k * 1000 + i)],
                    )
                    .await
                    .unwrap()
                    .get(0);
                // Read it back at once, then again until a replica serves the read: every
                // read must see the row.
                for attempt in 0..50 {
                    let row = c.query_one(&read, &[&id]).await.unwrap();
                    let port = row.get::<_, i32>(1) as u16;
                    assert_eq!(
                        row.get::<_, i64>(0),
                        1,
                        "row {id} missing on {port} (attempt {attempt})"
                    );
                    if replica_ports.contains(&port) {
                        on_replica += 1;
                        break;
                    }
                    if i % 50 != 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            on_replica
        }));
    }
    let mut on_replica = 0;
    for t in tasks {
        on_replica += t.await.unwrap();
    }
    assert!(
        on_replica > 0,
        "some reads of fresh rows were served by the live replica"
    );
    stale.psql_admin("SELECT pg_wal_replay_resume()");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_pipelined_behind_a_read_waits_for_the_primary() {
    let db = unique_db("pipeline");
    let r = with_table(&db);
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let mut raw = Raw::login(s.addr, "raw", &db, &[]).await;
    let mut on_replicas = 0;
    for round in 0..20 {
        // A read and a write in one packet, simple and extended: the write must not ride
        // along to the replica the read went to.
        let mut b = BytesMut::new();
        raw::query(&mut b, "SELECT inet_server_port()");
        raw::query(
            &mut b,
            &format!("INSERT INTO t (v) VALUES ({round}) RETURNING inet_server_port()"),
        );
        raw::parse(&mut b, "", "SELECT inet_server_port()");
        raw::bind(&mut b, "", "", &[]);
        raw::execute(&mut b, "");
        raw::sync(&mut b);
        raw::parse(
            &mut b,
            "",
            "UPDATE t SET v = v WHERE id = 1 RETURNING inet_server_port()",
        );
        raw::bind(&mut b, "", "", &[]);
        raw::execute(&mut b, "");
        raw::sync(&mut b);
        raw.send(&b).await;
        let mut ports = Vec::new();
        for _ in 0..4 {
            for m in raw.until_ready().await {
                assert_ne!(m.tag, 'E', "round {round}: {}", m.text());
                if m.tag == 'D' {
                    ports.push(raw::first_column(&m).parse::<u16>().unwrap());
                }
            }
        }
        assert_eq!(ports.len(), 4, "{ports:?}");
        assert_eq!(
            ports[1], r.primary.port,
            "the INSERT ran on the primary: {ports:?}"
        );
        assert_eq!(
            ports[3], r.primary.port,
            "the UPDATE ran on the primary: {ports:?}"
        );
        // (The read behind the INSERT may run on the primary: a transaction there takes
        // what is pipelined behind it.)
        if ports[0] != r.primary.port {
            on_replicas += 1;
        }
    }
    assert!(
        on_replicas > 0,
        "the reads ahead of the writes went to replicas"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_gets_no_reads_until_it_catches_up() {
    let db = unique_db("lag");
    let r = with_table(&db);
    let s = shoal(
        &r,
        &db,
        "read_routing = \"split\"\nmax_replica_lag = \"300ms\"",
    );
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let (paused, live) = (&r.replicas[0], &r.replicas[1]);
    paused.psql_admin("SELECT pg_wal_replay_pause()");
    c.execute("INSERT INTO t (v) VALUES (1)", &[])
        .await
        .unwrap();
    // Within a few checks the paused replica is past its limit and gets nothing.
    eventually(
        "the paused replica is banned for lag",
        Duration::from_secs(10),
        || s.log_contains("replica lags past max_replica_lag"),
    )
    .await;
    let by_port = spread(&c, 40).await;
    assert_eq!(by_port.get(&paused.port), None, "{by_port:?}");
    assert!(
        by_port.get(&live.port).copied().unwrap_or(0) > 0,
        "{by_port:?}"
    );
    // The row written is there in every read (the live replica has it).
    for _ in 0..10 {
        let n: i64 = c
            .query_one("SELECT count(*) FROM t", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
    }
    paused.psql_admin("SELECT pg_wal_replay_resume()");
    eventually("the replica caught up", Duration::from_secs(10), || {
        s.log_contains("replica caught up")
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while port_of(&c).await != paused.port {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reads never came back"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_down_is_left_out_and_taken_back() {
    let db = unique_db("down");
    let r = with_table(&db);
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let (down, live) = (&r.replicas[0], &r.replicas[1]);
    down.stop();
    // No read fails: the first client to find it down bans it and goes elsewhere.
    let by_port = spread(&c, 40).await;
    assert_eq!(by_port.get(&down.port), None, "{by_port:?}");
    assert!(
        by_port.get(&live.port).copied().unwrap_or(0) > 0,
        "{by_port:?}"
    );
    down.pg_ctl_start();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while port_of(&c).await != down.port {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reads never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // With both replicas down, reads go to the primary (replica_fallback = "primary").
    down.stop();
    live.stop();
    for _ in 0..5 {
        assert_eq!(port_of(&c).await, r.primary.port);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_and_sets_follow_the_client_across_the_split() {
    let db = unique_db("follow");
    let r = with_table(&db);
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    c.simple_query("SET application_name = 'split-test'")
        .await
        .unwrap();
    let read = c
        .prepare("SELECT inet_server_port(), current_setting('application_name')")
        .await
        .unwrap();
    let replica_ports: Vec<u16> = r.replicas.iter().map(|p| p.port).collect();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..30 {
        let row = c.query_one(&read, &[]).await.unwrap();
        let port = row.get::<_, i32>(0) as u16;
        assert!(replica_ports.contains(&port), "read on {port}");
        assert_eq!(row.get::<_, String>(1), "split-test");
        seen.insert(port);
    }
    assert_eq!(seen.len(), 2, "both replicas served the prepared read");
    // (Preparing a write is a transaction on the primary: the client's reads stay there
    // until the replicas show it, as after any write.)
    let write = c
        .prepare("INSERT INTO t (v) VALUES ($1) RETURNING inet_server_port()")
        .await
        .unwrap();
    for i in 0..10 {
        let row = c.query_one(&write, &[&i]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0) as u16, r.primary.port);
        // Right after its write, the client's read runs where the write is: the primary,
        // with the same statement and settings.
        let row = c.query_one(&read, &[]).await.unwrap();
        assert_eq!(row.get::<_, String>(1), "split-test");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_routing_sends_everything_to_replicas_and_errors_without_them() {
    let db = unique_db("ro");
    let r = with_table(&db);
    let s = shoal(
        &r,
        &db,
        "read_routing = \"replicas\"\nreplica_fallback = \"error\"",
    );
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    // A write reaches a replica, which refuses it as PostgreSQL does.
    let e = c
        .execute("INSERT INTO t (v) VALUES (1)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25006");
    for p in &r.replicas {
        p.stop();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        match c.simple_query("SELECT 1").await {
            Err(e) => break e,
            Ok(_) => {
                assert!(tokio::time::Instant::now() < deadline, "reads still served");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(code(&e), "08006", "{e:?}");
    let message = e
        .as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_default();
    assert!(message.contains("no read replica is usable"), "{message}");
    // The client goes on: the error ended only that statement.
    r.replicas[0].pg_ctl_start();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while c.simple_query("SELECT 1").await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "never served again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_takes_the_writes_when_the_primary_is_gone() {
    let db = unique_db("failover");
    let r = with_table(&db);
    let s = shoal(&r, &db, "read_routing = \"split\"");
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    // Acknowledged commits, each recorded by the client.
    let mut acknowledged = Vec::new();
    for i in 0..100 {
        let id: i32 = c
            .query_one("INSERT INTO t (v) VALUES ($1) RETURNING id", &[&i])
            .await
            .unwrap()
            .get(0);
        acknowledged.push(id);
    }
    let (new_primary, other) = (&r.replicas[0], &r.replicas[1]);
    let stopped = tokio::time::Instant::now();
    r.primary.stop();
    replication::promote(new_primary);
    let port = loop {
        match c
            .query_one(
                "INSERT INTO t (v) VALUES (-1) RETURNING inet_server_port()",
                &[],
            )
            .await
        {
            Ok(row) => break row.get::<_, i32>(0) as u16,
            Err(e) => {
                // Meanwhile writes fail as on a direct connection to a dead server, and
                // never reach a standby (which would answer 25006).
                assert_ne!(code(&e), "25006", "{e:?}");
                assert!(
                    stopped.elapsed() < Duration::from_secs(15),
                    "writes did not resume: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    eprintln!(
        "writes resumed {:?} after the primary stopped",
        stopped.elapsed()
    );
    assert_eq!(port, new_primary.port);
    assert!(s.log_contains("failover"), "the switch is logged");
    // Every acknowledged commit is on the new primary, exactly once.
    let ids: Vec<String> = acknowledged.iter().map(|i| i.to_string()).collect();
    let found = psql_in(
        new_primary,
        &db,
        &format!("SELECT count(*) FROM t WHERE id IN ({})", ids.join(",")),
    );
    assert_eq!(found, "100");
    // The other standby still follows the dead primary: it is in recovery and never
    // takes a write; writes keep going to the new primary.
    assert_eq!(other.psql_admin("SELECT pg_is_in_recovery()"), "t");
    for _ in 0..10 {
        let row = c
            .query_one(
                "INSERT INTO t (v) VALUES (-2) RETURNING inet_server_port()",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i32>(0) as u16, new_primary.port);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_replicas_are_set_and_changed_through_the_api() {
    let db = unique_db("tenant");
    let r = with_table(&db);
    let (s, _data) = shoal_with_token_api(&r.primary);
    let tenant = |replicas: serde_json::Value| {
        serde_json::json!({"tenant": {
            "db_host": "127.0.0.1",
            "db_port": r.primary.port,
            "db_database": db,
            "require_user": true,
            "users": [{"db_user": "app", "db_password": APP_PASSWORD, "pool_size": 3}],
            "replicas": replicas,
            "read_routing": "split",
            "max_replica_lag": "5s",
        }})
    };
    // A bad list is refused with the field named.
    let (code, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!([{"db_host": "", "db_port": 1}])),
    );
    assert_eq!(code, 422, "{body}");
    assert!(body.to_string().contains("replicas"), "{body}");
    let (code, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!([{"db_host": "127.0.0.1", "db_port": r.replicas[0].port}])),
    );
    assert_eq!(code, 201, "{body}");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=app.acme password={APP_PASSWORD} dbname=x",
        s.port()
    );
    let c = s.try_connect(&conninfo).await.unwrap();
    let first = r.replicas[0].port;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while port_of(&c).await != first {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reads never reached the replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The replica list changes live: new clients read from the new replica.
    let second = r.replicas[1].port;
    let (code, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!([{"db_host": "127.0.0.1", "db_port": second}])),
    );
    assert_eq!(code, 200, "{body}");
    let c2 = s.try_connect(&conninfo).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let port = port_of(&c2).await;
        assert_ne!(port, first, "the replica taken out of the list got a read");
        if port == second {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "reads never reached the new replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_session_attrs_chooses_per_client() {
    let db = unique_db("target");
    let r = with_table(&db);
    // Replicas listed, reads left on the primary: only clients that ask use them, and the
    // user whose own read_routing says so.
    let s = shoal_with(
        &r,
        &db,
        "",
        &format!(
            "[users.reader]\npassword = \"reader-secret\"\nserver_user = \"app\"\n\
             server_password = \"{APP_PASSWORD}\"\nread_routing = \"split\"\n"
        ),
    );
    let with = |attrs: &str| {
        format!(
            "{} options='-c target_session_attrs={attrs}'",
            s.conninfo("app", APP_PASSWORD, &db)
        )
    };
    let plain = s.connect(&db).await;
    let standby = s.try_connect(&with("standby")).await.unwrap();
    let prefer = s.try_connect(&with("prefer-standby")).await.unwrap();
    let reader = s.connect_as("reader", "reader-secret", &db).await;
    until_reads_reach_replicas(&r, &standby).await;
    until_reads_reach_replicas(&r, &reader).await;
    for _ in 0..10 {
        assert_eq!(port_of(&plain).await, r.primary.port);
        assert_ne!(port_of(&reader).await, r.primary.port);
        assert_ne!(port_of(&standby).await, r.primary.port);
        assert_ne!(port_of(&prefer).await, r.primary.port);
    }
    // A standby client's write reaches a standby, which refuses it.
    let e = standby
        .execute("INSERT INTO t (v) VALUES (1)", &[])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "25006");
    plain
        .execute("INSERT INTO t (v) VALUES (1)", &[])
        .await
        .unwrap();
    // A bad value is refused at login, with the values that would do.
    let Err(e) = s.try_connect(&with("replica")).await else {
        panic!("a bad target_session_attrs was accepted");
    };
    assert_eq!(code(&e), "22023", "{e:?}");
    // Without replicas: prefer-standby reads on the primary, standby gets an error.
    for p in &r.replicas {
        p.stop();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while standby.simple_query("SELECT 1").await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "standby reads still served"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(port_of(&prefer).await, r.primary.port);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_and_metrics_show_each_backend() {
    let db = unique_db("show");
    let r = with_table(&db);
    let s = shoal_with(
        &r,
        &db,
        "read_routing = \"split\"\nmax_replica_lag = \"300ms\"",
        "[admin]\nusers = [\"admin\"]\n[users.admin]\npassword = \"admin-secret\"\n\
         [metrics]\nlisten = \"127.0.0.1:0\"\n",
    );
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    spread(&c, 20).await;
    r.replicas[0].psql_admin("SELECT pg_wal_replay_pause()");
    c.execute("INSERT INTO t (v) VALUES (1)", &[])
        .await
        .unwrap();
    eventually("the paused replica lags", Duration::from_secs(10), || {
        s.log_contains("replica lags past max_replica_lag")
    })
    .await;
    let (cols, rows) = console_rows(&s, "SHOW REPLICAS").await;
    let col = |name: &str| cols.iter().position(|c| c == name).unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let by_port = |port: u16| {
        rows.iter()
            .find(|row| row[col("port")] == port.to_string())
            .unwrap_or_else(|| panic!("no row for {port}: {rows:?}"))
    };
    let primary = by_port(r.primary.port);
    assert_eq!(primary[col("role")], "primary");
    assert_eq!(primary[col("writer")], "yes");
    let paused = by_port(r.replicas[0].port);
    assert_eq!(paused[col("role")], "replica");
    assert_eq!(paused[col("state")], "lagging", "{rows:?}");
    assert!(
        paused[col("lag_ms")].parse::<u64>().unwrap() > 300,
        "{rows:?}"
    );
    let live = by_port(r.replicas[1].port);
    assert_eq!(live[col("state")], "ok", "{rows:?}");
    let reads: u64 = [paused, live]
        .iter()
        .map(|row| row[col("reads")].parse::<u64>().unwrap())
        .sum();
    assert!(reads >= 20, "{rows:?}");
    // SHOW POOLS lists the replicas' pools beside the primary's.
    let (_, pools) = console_rows(&s, "SHOW POOLS").await;
    let names: Vec<&str> = pools.iter().map(|row| row[0].as_str()).collect();
    for p in &r.replicas {
        let replica_db = format!("{db}@127.0.0.1:{}", p.port);
        assert!(names.contains(&replica_db.as_str()), "{names:?}");
    }
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", s.metrics.unwrap())])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let backend = format!("backend=\"127.0.0.1:{}\"", r.replicas[0].port);
    assert!(
        text.lines()
            .any(|l| l.starts_with("shoal_replica_backend_info")
                && l.contains(&backend)
                && l.contains("state=\"lagging\"")),
        "{text}"
    );
    assert!(text.contains("shoal_replica_lag_milliseconds"), "{text}");
    assert!(text.contains("shoal_replica_reads_total"), "{text}");
    r.replicas[0].psql_admin("SELECT pg_wal_replay_resume()");
}

/// The mixed script: every statement kind that writes or might, beside reads, in one
/// transaction script, so several clients interleave them.
const MIXED: &str = r#"\set id random(1, 1000)
SELECT v FROM t WHERE id = :id;
INSERT INTO t (v) VALUES (:id);
UPDATE t SET v = v + 1 WHERE id = :id;
SELECT count(*) FROM t WHERE v > :id;
SELECT * FROM t WHERE id = :id FOR UPDATE;
WITH d AS (DELETE FROM t WHERE id = :id - 500 RETURNING id) SELECT count(*) FROM d;
SELECT nextval('s');
SELECT pg_advisory_xact_lock(:id);
SELECT now(), length('x'), abs(-1);
BEGIN;
SELECT count(*) FROM t;
INSERT INTO t (v) VALUES (:id * -1);
COMMIT;
BEGIN READ ONLY;
SELECT max(id) FROM t;
COMMIT;
SELECT 1; INSERT INTO t (v) VALUES (0);
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_write_reaches_a_replica_under_a_mixed_load() {
    let db = unique_db("mixed");
    let r = with_table(&db);
    let s = shoal_with(
        &r,
        &db,
        "read_routing = \"split\"",
        "[admin]\nusers = [\"admin\"]\n[users.admin]\npassword = \"admin-secret\"\n",
    );
    let c = s.connect(&db).await;
    until_reads_reach_replicas(&r, &c).await;
    let script = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(script.path(), MIXED).unwrap();
    for mode in ["simple", "extended", "prepared"] {
        // pgbench ends a client at its first error (a replica's 25006 among them) and
        // exits non-zero.
        let out = std::process::Command::new("timeout")
            .args(["--kill-after=5", "120"])
            .arg(r.primary.bin("pgbench"))
            .env("PGPASSWORD", APP_PASSWORD)
            .args([
                "-n",
                "-h",
                "127.0.0.1",
                "-U",
                "app",
                "-c",
                "6",
                "-j",
                "2",
                "-t",
                "60",
            ])
            .args(["-M", mode, "-f"])
            .arg(script.path())
            .arg("-p")
            .arg(s.port().to_string())
            .arg(&db)
            .output()
            .expect("pgbench runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{mode}: {text}");
        assert!(
            !text.contains("25006") && !text.contains("read-only"),
            "{mode}: {text}"
        );
        assert!(
            text.contains("number of transactions actually processed: 360/360"),
            "{mode}: {text}"
        );
    }
    // Reads reached replicas: few in this script, whose clients write all the time (a
    // client's reads follow its writes to the primary until the replicas show them).
    let (cols, rows) = console_rows(&s, "SHOW REPLICAS").await;
    let reads = cols.iter().position(|c| c == "reads").unwrap();
    let total: u64 = rows
        .iter()
        .map(|row| row[reads].parse::<u64>().unwrap())
        .sum();
    assert!(total > 0, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_mode_client_keeps_a_replica_for_its_session() {
    let db = unique_db("session");
    let r = with_table(&db);
    let s = shoal(
        &r,
        &db,
        "pool_mode = \"session\"\nread_routing = \"replicas\"",
    );
    let replica_ports: Vec<u16> = r.replicas.iter().map(|p| p.port).collect();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..12 {
        let c = s.connect(&db).await;
        let port = port_of(&c).await;
        assert!(replica_ports.contains(&port), "session on {port}");
        // One server for the whole session.
        for _ in 0..5 {
            assert_eq!(port_of(&c).await, port);
        }
        seen.insert(port);
    }
    assert_eq!(seen.len(), 2, "sessions spread over both replicas");
}

/// What the split sends to a standby must run there: generated statements (calls, casts,
/// operators, views, quoting, comments, dollar quotes, Unicode escapes, READ ONLY blocks,
/// text in SJIS whose two-byte characters end in a backslash) go through Shoal to a
/// primary and a hot standby, and none may fail as only a standby fails it (`25006`, or a
/// transaction id refused during recovery): PostgreSQL's own verdict on what Shoal called
/// read-only. Cases: `SHOAL_PROPTEST_CASES` (default 40).
mod split_model {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    struct Env {
        addr: std::net::SocketAddr,
        db: String,
        replica_ports: Vec<u16>,
        _shoal: Shoal,
        _cluster: Replicated,
    }

    fn env() -> &'static Env {
        static ENV: OnceLock<Env> = OnceLock::new();
        ENV.get_or_init(|| {
            let db = unique_db("splitmodel");
            let r = with_table(&db);
            psql_in(
                &r.primary,
                &db,
                "CREATE TABLE log (at int);
                 CREATE FUNCTION bump() RETURNS int LANGUAGE sql VOLATILE
                   AS 'INSERT INTO log VALUES (1) RETURNING at';
                 CREATE VIEW v AS SELECT bump() AS n;
                 CREATE VIEW plain AS SELECT count(*)::int AS n FROM t;
                 CREATE FUNCTION g() RETURNS int LANGUAGE sql STABLE AS 'SELECT 1';
                 CREATE FUNCTION \"G\"() RETURNS int LANGUAGE sql VOLATILE
                   AS 'INSERT INTO log VALUES (2) RETURNING at';
                 CREATE TYPE mood AS (m int);
                 CREATE FUNCTION to_mood(int) RETURNS mood LANGUAGE sql VOLATILE
                   AS 'INSERT INTO log VALUES (3) RETURNING ROW(at)::mood';
                 CREATE CAST (int AS mood) WITH FUNCTION to_mood(int);
                 CREATE FUNCTION plus_log(int, int) RETURNS int LANGUAGE sql VOLATILE
                   AS 'INSERT INTO log VALUES (4) RETURNING $1 + $2';
                 CREATE OPERATOR ### (LEFTARG = int, RIGHTARG = int, FUNCTION = plus_log);",
            );
            r.wait_caught_up();
            let s = shoal(&r, &db, "read_routing = \"split\"");
            let replica_ports = r.replicas.iter().map(|p| p.port).collect();
            Env {
                addr: s.addr,
                db,
                replica_ports,
                _shoal: s,
                _cluster: r,
            }
        })
    }

    fn expr() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            Just("1"),
            Just("'x'"),
            Just("E'a\\'b'"),
            Just("$q$;INSERT INTO log VALUES (5);$q$"),
            Just("U&'\\0041'"),
            Just("g()"),
            Just("\"G\"()"),
            Just("bump()"),
            Just("txid_current()"),
            Just("pg_current_xact_id()"),
            Just("now()"),
            Just("1 ### 2"),
            Just("1::mood"),
            Just("'7'::int"),
            Just("(1 + 2)"),
            Just("lower('A')"),
            Just("nextval('s')"),
            Just("(SELECT n FROM plain)"),
            Just("(SELECT n FROM v)"),
            Just("inet_server_port()"),
        ]
    }

    fn from() -> impl Strategy<Value = &'static str> {
        prop_oneof![
            Just(""),
            Just(" FROM t"),
            Just(" FROM plain"),
            Just(" FROM v"),
            Just(" FROM t /* ; INSERT INTO log VALUES (6) */"),
            Just(" FROM t -- ; DELETE FROM log\n"),
        ]
    }

    /// One client request: its bytes and the client_encoding to send them in.
    fn request() -> impl Strategy<Value = (Vec<u8>, bool)> {
        prop_oneof![
            4 => (proptest::collection::vec(expr(), 1..3), from()).prop_map(|(es, f)| {
                (format!("SELECT {}{f}", es.join(", ")).into_bytes(), false)
            }),
            1 => Just((b"BEGIN READ ONLY".to_vec(), false)),
            1 => Just((b"COMMIT".to_vec(), false)),
            1 => Just((b"SET TRANSACTION READ WRITE".to_vec(), false)),
            1 => Just((b"COMMIT; INSERT INTO log VALUES (7)".to_vec(), false)),
            // In SJIS, 0x83 0x5C is one character: the INSERT is a statement of its own.
            1 => Just((b"SELECT E'\x83\x5c'; INSERT INTO log VALUES (8); --'".to_vec(), true)),
        ]
    }

    fn cases() -> u32 {
        std::env::var("SHOAL_PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(40)
    }

    /// The requests, in order, on one connection (`sjis` for the client's encoding);
    /// `Err` names a request that failed as only a standby fails.
    async fn run(requests: &[(Vec<u8>, bool)], sjis: bool) -> Result<usize, String> {
        let e = env();
        let extra: &[(&str, &str)] = if sjis {
            &[("client_encoding", "SJIS")]
        } else {
            &[]
        };
        let mut c = Raw::login(e.addr, "raw", &e.db, extra).await;
        let mut on_replica = 0;
        // Inside a READ ONLY block PostgreSQL refuses writes on any backend (25006): only
        // what a standby alone says counts there.
        let mut in_block = false;
        for (sql, wants_sjis) in requests {
            if *wants_sjis != sjis {
                continue;
            }
            let mut b = BytesMut::new();
            shoal_wire::backend::put_message(&mut b, b'Q', |m| {
                bytes::BufMut::put_slice(m, sql);
                bytes::BufMut::put_u8(m, 0);
            });
            c.send(&b).await;
            for m in c.until_ready().await {
                if m.tag == 'Z' {
                    in_block = m.body.first().is_some_and(|&s| s != b'I');
                }
                if m.tag == 'E' {
                    let text = m.text();
                    let standby_only = matches!(m.code().as_str(), "25006" | "25000")
                        && !text.contains("Shoal")
                        && !in_block;
                    if standby_only || text.contains("during recovery") {
                        return Err(format!("{}: {text}", String::from_utf8_lossy(sql)));
                    }
                }
                if m.tag == 'D' && sql.starts_with(b"SELECT inet_server_port()") {
                    let port: u16 = raw::first_column(&m).parse().unwrap_or(0);
                    on_replica += usize::from(e.replica_ports.contains(&port));
                }
            }
        }
        let mut b = BytesMut::new();
        raw::query(&mut b, "ROLLBACK");
        c.send(&b).await;
        c.until_ready().await;
        Ok(on_replica)
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: cases(),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn what_the_split_sends_to_a_standby_runs_there(
            requests in proptest::collection::vec(request(), 1..8)
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let result = rt.block_on(async {
                run(&requests, false).await?;
                run(&requests, true).await
            });
            prop_assert!(result.is_ok(), "{}", result.unwrap_err());
        }
    }

    /// The model is not empty: proven reads do reach the standby.
    #[test]
    fn reads_reach_the_standby() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let reads = vec![(b"SELECT inet_server_port(), g()".to_vec(), false); 5];
                if run(&reads, false).await.unwrap() > 0 {
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no read reached the standby"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
}
