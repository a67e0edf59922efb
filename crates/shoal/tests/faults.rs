//! Failures: cancels, dying servers, vanishing clients, an upstream that is down, shutdown.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_query() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "");
    let c = shoal.connect(&db).await;
    let c = cancel_a_sleep(c, &db).await;
    // The connection goes on.
    c.simple_query("SELECT 1").await.unwrap();
}

/// A client waiting for a server in a full pool is let go by its cancel at once (57014), not
/// when a server frees up; the client holding the server sees nothing of it, and the
/// cancelled client's connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_wait_for_a_server() {
    let db = unique_db("fault");
    let shoal = shoal_for(
        &db,
        "[pool]\npool_size = 1\nquery_wait_timeout = \"60s\"\n[admin]\nusers = [\"admin\"]\n\
         [users.admin]\npassword = \"admin-secret\"\n",
    );
    let holder = shoal.connect(&db).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = shoal.connect(&db).await;
    let token = waiter.cancel_token();
    let query = tokio::spawn(async move {
        let r = waiter.simple_query("SELECT 2").await;
        (waiter, r)
    });
    let waiting = || async {
        let (cols, rows) = console_rows(&shoal, "SHOW POOLS").await;
        let at = cols
            .iter()
            .position(|c| c == "cl_waiting")
            .expect("cl_waiting");
        rows.iter().any(|r| r[at] == "1")
    };
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !waiting().await {
        assert!(std::time::Instant::now() < until, "the client never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let (waiter, r) = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the cancel ended the wait before a server freed up")
        .unwrap();
    assert_eq!(code(&r.expect_err("cancelled")), "57014");
    holder.batch_execute("SELECT 3; COMMIT").await.unwrap();
    let rows = simple_rows(&waiter, "SELECT 4").await;
    assert_eq!(rows, vec!["4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stress_never_hits_the_wrong_query() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "[pool]\npool_size = 4\n");
    let wrong = Arc::new(AtomicUsize::new(0));
    let cancelled = Arc::new(AtomicUsize::new(0));
    // Bystanders are never cancelled: any 57014 they see is a cancel delivered to the wrong
    // query.
    let mut bystanders = Vec::new();
    for _ in 0..6 {
        let c = shoal.connect(&db).await;
        let wrong = wrong.clone();
        bystanders.push(tokio::spawn(async move {
            for _ in 0..150 {
                match c.simple_query("SELECT pg_sleep(0.001)").await {
                    Ok(_) => {}
                    Err(e) if code(&e) == "57014" => {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => panic!("bystander failed: {e:?}"),
                }
            }
        }));
    }
    // Targets run short queries while cancels race their completion, then one long query
    // that a cancel must stop; some close their connection mid-way.
    let mut targets = Vec::new();
    for t in 0..10 {
        let shoal_conn = shoal.conninfo("app", APP_PASSWORD, &db);
        let cancelled = cancelled.clone();
        targets.push(tokio::spawn(async move {
            for round in 0..6 {
                let (c, conn) = tokio_postgres::connect(&shoal_conn, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                let conn_task = tokio::spawn(conn);
                let token = c.cancel_token();
                let racer = {
                    let token = token.clone();
                    tokio::spawn(async move {
                        for _ in 0..5 {
                            let _ = token.cancel_query(tokio_postgres::NoTls).await;
                        }
                    })
                };
                for _ in 0..5 {
                    match c.simple_query("SELECT pg_sleep(0.002)").await {
                        Ok(_) => {}
                        Err(e) if code(&e) == "57014" => {}
                        Err(e) => panic!("target failed: {e:?}"),
                    }
                }
                racer.await.unwrap();
                let long = tokio::spawn(async move {
                    let r = c.simple_query("SELECT pg_sleep(20)").await;
                    (r.map(|_| ()), c)
                });
                // Cancels sent before the query reaches a server are (rightly) dropped:
                // keep cancelling until it stops.
                while !long.is_finished() {
                    let _ = token.cancel_query(tokio_postgres::NoTls).await;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let (r, c) = long.await.unwrap();
                assert_eq!(code(&r.unwrap_err()), "57014");
                cancelled.fetch_add(1, Ordering::Relaxed);
                if (t + round) % 3 == 0 {
                    conn_task.abort();
                }
                drop(c);
            }
        }));
    }
    for t in targets {
        t.await.unwrap();
    }
    for b in bystanders {
        b.await.unwrap();
    }
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "a cancel reached another client's query"
    );
    assert_eq!(
        cancelled.load(Ordering::Relaxed),
        60,
        "every long query was cancelled"
    );
    // Shoal is alive and serving.
    let c = shoal.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
}

/// Inside a transaction block the client's session dies with its server, as on a direct
/// connection: it gets PostgreSQL's own FATAL and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_server_mid_transaction_passes_the_fatal_on_and_closes() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "");
    let mut r = common::raw::Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.simple("BEGIN").await.unwrap();
    let pid = r.simple("SELECT pg_backend_pid()").await.unwrap()[0].clone();
    pg().psql_admin(&format!("SELECT pg_terminate_backend({pid})"));
    let m = r.recv().await.expect("the server's FATAL");
    assert_eq!(m.tag, 'E');
    assert_eq!(m.field(b'S').as_deref(), Some("FATAL"));
    assert_eq!(m.code(), "57P01", "{}", m.text());
    assert!(m
        .text()
        .contains("terminating connection due to administrator command"));
    assert!(r.recv().await.is_none(), "then the connection is closed");
    // Other clients are unaffected.
    let c = shoal.connect(&db).await;
    assert_eq!(simple_rows(&c, "SELECT 1").await, vec!["1"]);
}

/// The server's own FATAL code reaches the client unchanged in both modes, here PostgreSQL's
/// idle-in-transaction timeout (25P03), as on a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_in_transaction_timeout_keeps_its_code() {
    for mode in ["transaction", "session"] {
        let db = unique_db("fault");
        let shoal = shoal_for(&db, &format!("[pool]\npool_mode = \"{mode}\"\n"));
        let mut r = common::raw::Raw::login(shoal.addr, "raw", &db, &[]).await;
        r.simple("BEGIN").await.unwrap();
        r.simple("SET SESSION idle_in_transaction_session_timeout = 100")
            .await
            .unwrap();
        // The client stays idle inside its transaction until PostgreSQL ends the session.
        let m = r.recv().await.expect("the server's FATAL");
        assert_eq!(m.field(b'S').as_deref(), Some("FATAL"), "{mode}");
        assert_eq!(m.code(), "25P03", "{mode}: {}", m.text());
        assert!(r.recv().await.is_none(), "then the connection is closed");
    }
}

/// Outside a transaction block (a statement running in autocommit) the client gets an ERROR
/// saying what happened and goes on with a new server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_server_under_an_autocommit_statement_gives_an_error_and_the_client_goes_on() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "");
    let c = shoal.connect(&db).await;
    let pid: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let running = c.simple_query("SELECT pg_sleep(30)");
    let kill = async {
        wait_until_running(&db, "SELECT pg_sleep(30)").await;
        pg().psql_admin(&format!("SELECT pg_terminate_backend({pid})"));
    };
    let (err, ()) = tokio::join!(running, kill);
    let err = err.unwrap_err();
    assert_eq!(code(&err), "57P01", "{err:?}");
    assert!(
        format!("{err:?}").contains("may or may not have completed"),
        "{err:?}"
    );
    let pid2: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_ne!(pid, pid2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_idle_server_is_not_reused() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let c = shoal.connect(&db).await;
    let pid: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    pg().psql_admin(&format!("SELECT pg_terminate_backend({pid})"));
    eventually("backend gone", Duration::from_secs(10), || {
        pg().backends(&db) == 0
    })
    .await;
    let pid2: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_ne!(pid, pid2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_killed_mid_transaction_is_rolled_back_before_reuse() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\nquery_wait_timeout = 5\n");
    let setup = shoal.connect(&db).await;
    setup.batch_execute("CREATE TABLE t (x int)").await.unwrap();
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.simple("BEGIN").await.unwrap();
    r.simple("INSERT INTO t VALUES (1)").await.unwrap();
    r.simple("LOCK TABLE t IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    drop(r);
    // The next client gets the (only) server with nothing of the dead client's transaction.
    setup
        .batch_execute("SET lock_timeout = '3s'")
        .await
        .unwrap();
    let n: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    // A client killed while its query runs: the query is cancelled and the server closed, so
    // the pool of one is usable again well before pg_sleep(60) would end.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::query(&mut b, "SELECT pg_sleep(60)");
    r.send(&b).await;
    wait_until_running(&db, "SELECT pg_sleep(60)").await;
    drop(r);
    let v: i32 = setup.query_one("SELECT 7", &[]).await.unwrap().get(0);
    assert_eq!(v, 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_at_start_then_up() {
    let port = free_port();
    let config = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n[pool]\nserver_connect_timeout = 2\n\
         [databases.app]\nport = {port}\n[users.app]\npassword = \"{APP_PASSWORD}\"\n"
    );
    let shoal = Shoal::start(&config);
    let err = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "app"))
        .await
        .expect_err("no upstream yet");
    assert!(code(&err).starts_with("08"), "{err:?}");
    let text = format!("{err:?}");
    assert!(text.contains("cannot connect"), "{text}");
    // The client is not shown where the upstream is; the operator's log says it.
    assert!(!text.contains(&format!("127.0.0.1:{port}")), "{text}");
    eventually("the log names the upstream", Duration::from_secs(5), || {
        shoal.log_contains(&format!("127.0.0.1:{port}"))
    })
    .await;
    let second = Pg::start_on(port);
    let c = shoal.connect("app").await;
    c.simple_query("SELECT 1").await.unwrap();
    second.stop();
}

/// A COMMIT still running when `shutdown_timeout` passes is not cut: its real outcome reaches
/// the client, and only then is the client told the server is shutting down (57P01).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_flight_at_the_shutdown_deadline_reports_its_outcome() {
    let db = unique_db("fault");
    pg().create_database(&db);
    let setup = direct(&db).await;
    setup
        .batch_execute(
            "CREATE TABLE t (x int);
             CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
               $$BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END$$;
             CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON t DEFERRABLE INITIALLY DEFERRED
               FOR EACH ROW EXECUTE FUNCTION slow_commit();",
        )
        .await
        .unwrap();
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "shutdown_timeout = 0.3");
    let mut shoal = Shoal::start(&config);
    let client = shoal.connect(&db).await;
    client
        .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    let commit = tokio::spawn(async move {
        let r = client.batch_execute("COMMIT").await;
        (r, client)
    });
    // The COMMIT runs (its deferred trigger sleeps) when the shutdown begins.
    let running =
        "SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND state = 'active'";
    eventually("the COMMIT runs", Duration::from_secs(10), || {
        pg().psql_admin(running).trim() == "1"
    })
    .await;
    shoal.signal(libc::SIGTERM);
    let (result, client) = commit.await.unwrap();
    result.expect("the COMMIT's own outcome, not an error");
    let err = client.simple_query("SELECT 1").await.unwrap_err();
    assert!(err.is_closed() || code(&err) == "57P01", "{err:?}");
    assert_eq!(shoal.wait(Duration::from_secs(15)), Some(true));
    let n: i64 = setup
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1, "committed, as reported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_transactions_finish() {
    let db = unique_db("fault");
    pg().create_database(&db);
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "shutdown_timeout = 20");
    let mut shoal = Shoal::start(&config);
    let busy = shoal.connect(&db).await;
    let mut idle = common::raw::Raw::login(shoal.addr, "raw", &db, &[]).await;
    idle.simple("SELECT 1").await.unwrap();
    busy.batch_execute("CREATE TABLE t (x int); BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    shoal.signal(libc::SIGTERM);
    // The listener goes away.
    let conninfo = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut refused = false;
    for _ in 0..200 {
        if shoal.try_connect(&conninfo).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(refused, "new connections are refused during shutdown");
    // The running transaction can still finish; once the process has been quiet for a
    // moment its client is told and closed.
    busy.batch_execute("INSERT INTO t VALUES (2); COMMIT")
        .await
        .unwrap();
    assert_eq!(
        shoal.wait(Duration::from_secs(15)),
        Some(true),
        "exits cleanly once drained"
    );
    let err = busy.simple_query("SELECT 1").await.unwrap_err();
    assert!(err.is_closed() || code(&err) == "57P01", "{err:?}");
    // Idle clients are told, as PostgreSQL tells its sessions, then disconnected.
    let m = idle.recv().await.expect("a FATAL before the close");
    assert_eq!(m.tag, 'E');
    assert_eq!(m.field(b'S').as_deref(), Some("FATAL"));
    assert_eq!(m.code(), "57P01", "{}", m.text());
    assert!(idle.recv().await.is_none());
    let d = direct(&db).await;
    let n: i64 = d
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_queries_on_a_dying_server_are_answered_once_and_not_rerun() {
    let db = unique_db("fault");
    let shoal = shoal_for(&db, "");
    let setup = shoal.connect(&db).await;
    setup.batch_execute("CREATE TABLE t (x int)").await.unwrap();
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::query(&mut b, "SELECT pg_sleep(30)");
    raw::query(&mut b, "INSERT INTO t VALUES (1)");
    r.send(&b).await;
    wait_until_running(&db, "SELECT pg_sleep(30)").await;
    pg().psql_admin(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}' AND query = 'SELECT pg_sleep(30)'"
    ));
    let msgs = r.until_ready().await;
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(
        tags, "TEZ",
        "RowDescription came before the sleep; then the error"
    );
    assert_eq!(msgs[1].code(), "57P01");
    let second: String = r.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(
        second, "Z",
        "the second query's ReadyForQuery, without running it"
    );
    assert_eq!(r.simple("SELECT count(*) FROM t").await.unwrap(), vec!["0"]);
}

/// A server that fails while Shoal prepares it for a client (here: it stops answering the
/// reset) has seen nothing of the client's, so the client is served by another server instead
/// of getting an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_failing_before_any_client_byte_is_replaced() {
    let db = unique_db("fault");
    // A pool of one: the next client has no other server to get, so it must take A's.
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\nserver_reset_timeout = 1\n");
    let mut a = common::raw::Raw::login(shoal.addr, "raw", &db, &[]).await;
    let pid = a.simple("SELECT pg_backend_pid()").await.unwrap()[0].clone();
    // A leaves session state, so the next client's checkout must reset that server.
    a.simple("SET application_name = 'a'").await.unwrap();
    let stop = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    stop("-STOP");
    let mut b = common::raw::Raw::login(shoal.addr, "raw", &db, &[]).await;
    let got = b.simple("SELECT 'b', pg_backend_pid()").await;
    stop("-CONT");
    assert_eq!(got.unwrap(), vec!["b"]);
    eventually("the replacement is logged", Duration::from_secs(5), || {
        shoal.log_contains("server_timeout") && shoal.log_contains("retry=true")
    })
    .await;
}
