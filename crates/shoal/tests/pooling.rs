//! Pool behaviour: sharing, growth and shrinking, limits, waiting, and session mode.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::raw::Raw;
use common::*;
use futures_util::future::join_all;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_share_three_servers_without_mixing_results() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_size = 3\n");
    let clients = join_all((0..50).map(|_| shoal.connect(&db))).await;
    let work = clients.iter().enumerate().map(|(i, c)| async move {
        for j in 0..20 {
            let v = (i * 1000 + j) as i32;
            let tx_sql = format!("BEGIN; SELECT {v}; COMMIT");
            let got = simple_rows(c, &tx_sql).await;
            assert_eq!(
                got,
                vec![v.to_string()],
                "client {i} got another client's result"
            );
            let row = c
                .query_typed(
                    "SELECT $1::int + 0",
                    &[(&v, tokio_postgres::types::Type::INT4)],
                )
                .await
                .unwrap();
            assert_eq!(row[0].get::<_, i32>(0), v);
        }
    });
    join_all(work).await;
    assert!(pg().backends(&db) <= 3, "pool_size 3 is a hard cap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_grows_on_demand_and_shrinks_when_idle() {
    let db = unique_db("pool");
    let shoal = shoal_for(
        &db,
        "[pool]\npool_size = 4\nmin_pool_size = 1\nserver_idle_timeout = 1\n",
    );
    let clients = join_all((0..4).map(|_| shoal.connect(&db))).await;
    // Four concurrent transactions need four servers.
    for c in &clients {
        c.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    assert_eq!(pg().backends(&db), 4);
    for c in &clients {
        c.batch_execute("COMMIT").await.unwrap();
    }
    // After server_idle_timeout the pool shrinks to min_pool_size.
    eventually(
        "pool shrinks to min_pool_size",
        Duration::from_secs(15),
        || pg().backends(&db) == 1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_pool_size_is_kept_warm_and_lifetime_retires_servers() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\nmin_pool_size = 2\nserver_lifetime = 1\n");
    let c = shoal.connect(&db).await;
    eventually(
        "min_pool_size servers open",
        Duration::from_secs(15),
        || pg().backends(&db) >= 2,
    )
    .await;
    let first: i32 = c
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    // server_lifetime = 1 s: the server is replaced; new pids appear.
    let mut replaced = false;
    for _ in 0..100 {
        let p: i32 = c
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        if p != first {
            let alive = pg().psql_admin(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {first}"
            ));
            if alive == "0" {
                replaced = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        replaced,
        "a server past server_lifetime is closed and replaced"
    );
}

/// A pool whose queue makes clients wait past half of `query_wait_timeout` refuses the next
/// one at once (53300) instead of queueing it to time out, and takes clients again as soon
/// as one gets a server without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_pool_sheds_new_waiters_at_once_and_recovers() {
    let db = unique_db("pool");
    let shoal = shoal_for(
        &db,
        "[pool]\npool_size = 1\nquery_wait_timeout = 2\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    );
    let a = shoal.connect(&db).await;
    a.batch_execute("BEGIN; SELECT 1").await.unwrap();
    // B waits for A's server past half the timeout, then holds it in a transaction.
    let b = shoal.connect(&db).await;
    let waiting = tokio::spawn(async move { b.batch_execute("BEGIN; SELECT 2").await.map(|_| b) });
    tokio::time::sleep(Duration::from_millis(1300)).await;
    a.batch_execute("COMMIT").await.unwrap();
    let b = waiting
        .await
        .unwrap()
        .expect("B was served within the timeout");
    // C finds the queue slow: refused at once, not after the timeout.
    let c = shoal.connect(&db).await;
    let started = std::time::Instant::now();
    let err = c.simple_query("SELECT 3").await.unwrap_err();
    assert_eq!(code(&err), "53300");
    let msg = err.as_db_error().unwrap().message().to_string();
    assert!(
        msg.contains("saturated") && msg.contains(&format!("{db}/app")),
        "{msg}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused without waiting"
    );
    // Once the server is free, the next client gets it at once, and the pool takes
    // waiters again.
    b.batch_execute("COMMIT").await.unwrap();
    assert_eq!(simple_rows(&c, "SELECT 4").await, ["4"]);
    c.batch_execute("BEGIN; SELECT 5").await.unwrap();
    let waiting = tokio::spawn(async move { a.simple_query("SELECT 6").await.map(|_| ()) });
    eventually("A waits for the server", Duration::from_secs(10), || {
        common::changes::metric(&shoal, "shoal_pool_clients_waiting") >= 1.0
    })
    .await;
    c.batch_execute("COMMIT").await.unwrap();
    waiting.await.unwrap().expect("a short wait again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_pool_gives_a_clear_error_after_query_wait_timeout() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\nquery_wait_timeout = 0.5\n");
    let holder = shoal.connect(&db).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = shoal.connect(&db).await;
    let err = waiter.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&err), "57014");
    let msg = err.as_db_error().unwrap().message().to_string();
    assert!(msg.contains(&format!("{db}/app")), "names the pool: {msg}");
    assert!(msg.contains("query_wait_timeout"), "{msg}");
    // The waiter's connection is still usable once the holder commits.
    holder.batch_execute("COMMIT").await.unwrap();
    let rows = waiter.simple_query("SELECT 2").await.unwrap();
    assert!(!rows.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_client_conn_limits_name_the_limit() {
    let db = unique_db("pool");
    pg().create_database(&db);
    let config = with_server_keys(&base_config(pg(), &[&db], ""), "max_client_conn = 2");
    let shoal = Shoal::start(&config);
    let _a = shoal.connect(&db).await;
    let _b = shoal.connect(&db).await;
    let err = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, &db))
        .await
        .expect_err("third client refused");
    assert_eq!(code(&err), "53300");
    assert!(
        format!("{err:?}").contains("max_client_conn (2)"),
        "{err:?}"
    );

    let db2 = unique_db("pool");
    pg().create_database(&db2);
    let config = base_config(pg(), &[], "")
        + &format!(
            "[databases.{db2}]\nport = {}\nmax_client_conn = 1\n",
            pg().port
        );
    let shoal = Shoal::start(&config);
    let _a = shoal.connect(&db2).await;
    let err = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, &db2))
        .await
        .expect_err("second client of the pool refused");
    assert_eq!(code(&err), "53300");
    assert!(
        format!("{err:?}").contains(&format!("pool \\\"{db2}/app\\\"")),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_state_does_not_leak_to_the_next_client() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_mode = \"session\"\npool_size = 1\n");
    let a = shoal.connect(&db).await;
    let pid_a: i32 = a
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    a.batch_execute(
        "SET search_path = leaked; SET statement_timeout = 4321; CREATE TEMP TABLE tmp_a (x int); PREPARE p AS SELECT 1; BEGIN; CREATE TABLE public.leaked_tx (x int)",
    )
    .await
    .unwrap();
    drop(a);
    let b = shoal.connect(&db).await;
    let pid_b: i32 = b
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pid_a, pid_b, "the same server is reused");
    let row = b
        .query_one(
            "SELECT current_setting('search_path'), current_setting('statement_timeout'), \
             (SELECT count(*) FROM pg_prepared_statements), to_regclass('tmp_a') IS NULL, \
             to_regclass('public.leaked_tx') IS NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "\"$user\", public");
    assert_eq!(row.get::<_, String>(1), "0");
    // tokio-postgres' own statement is the only one.
    assert_eq!(row.get::<_, i64>(2), 1);
    assert!(row.get::<_, bool>(3), "temp table dropped");
    assert!(
        row.get::<_, bool>(4),
        "the open transaction was rolled back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_listener_serves_clients() {
    let db = unique_db("pool");
    pg().create_database(&db);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = base_config(pg(), &[&db], "").replacen(
        "listen = [\"127.0.0.1:0\"]",
        &format!(
            "listen = [\"127.0.0.1:{port}\"]\nunix_socket_dir = \"{}\"",
            dir.path().display()
        ),
        1,
    );
    let _shoal = Shoal::start(&config);
    let (c, conn) = tokio_postgres::connect(
        &format!(
            "host={} port={port} user=app password={APP_PASSWORD} dbname={db}",
            dir.path().display()
        ),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let v: i32 = c.query_one("SELECT 5", &[]).await.unwrap().get(0);
    assert_eq!(v, 5);
    // PgBouncer's peer login: over the socket, a client running as Shoal's OS user reaches
    // the console under a name that is not configured, with no password (`psql -p 6432
    // pgbouncer` on a Debian host), and only the console.
    let sock = dir.path().display().to_string();
    let psql = |user: &str, database: &str| {
        std::process::Command::new("psql")
            .args([
                "-XAtq",
                "-h",
                &sock,
                "-p",
                &port.to_string(),
                "-U",
                user,
                "-d",
                database,
            ])
            .args(["-c", "SHOW STATE"])
            .env_remove("PGPASSWORD")
            .env("PGCONNECT_TIMEOUT", "5")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("psql runs")
    };
    let out = psql("operator", "pgbouncer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("active|yes"));
    // A configured user still gives its password; a database is never reached that way.
    let out = psql("app", "pgbouncer");
    assert!(
        !out.status.success(),
        "a configured user needs its password"
    );
    let out = psql("operator", &db);
    assert!(!out.status.success(), "only the console");
    // And raw TCP still works next to it.
    let mut r = Raw::login(
        format!("127.0.0.1:{port}").parse().unwrap(),
        "raw",
        &db,
        &[],
    )
    .await;
    assert_eq!(r.simple("SELECT 6").await.unwrap(), vec!["6"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_session_changes_do_not_leak_to_other_clients() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let a = shoal.connect(&db).await;
    let b = shoal.connect(&db).await;
    a.batch_execute("SET statement_timeout = 4321")
        .await
        .unwrap();
    a.batch_execute("SET search_path = leaked, public")
        .await
        .unwrap();
    a.batch_execute("LISTEN leaked_channel").await.unwrap();
    // B gets the same (only) server, cleaned.
    let row = b
        .query_one(
            "SELECT current_setting('statement_timeout'), current_setting('search_path'), \
             (SELECT count(*) FROM pg_listening_channels())",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "0");
    assert_eq!(row.get::<_, String>(1), "\"$user\", public");
    assert_eq!(row.get::<_, i64>(2), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_sets_follow_the_client_across_servers() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\n");
    let a = shoal.connect(&db).await;
    let b = shoal.connect(&db).await;
    a.batch_execute("SET statement_timeout = 4321")
        .await
        .unwrap();
    // A set inside a rolled-back transaction does not hold; one in a committed one does.
    a.batch_execute("BEGIN").await.unwrap();
    a.batch_execute("SET work_mem = '7MB'").await.unwrap();
    a.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    a.batch_execute("SET search_path = a_schema, public")
        .await
        .unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    for round in 0..6 {
        // B holds one server or the other in turn, so A's transactions move between them.
        b.batch_execute("BEGIN").await.unwrap();
        b.query_one("SELECT 1", &[]).await.unwrap();
        assert_eq!(
            show(&a, "statement_timeout").await,
            "4321ms",
            "round {round}"
        );
        assert_eq!(simple_rows(&a, "SHOW work_mem").await[0], "4MB");
        assert_eq!(
            simple_rows(&a, "SHOW search_path").await[0],
            "a_schema, public"
        );
        assert_eq!(
            show(&b, "statement_timeout").await,
            "0",
            "B never sees A's settings"
        );
        b.batch_execute("COMMIT").await.unwrap();
        assert_eq!(show(&b, "statement_timeout").await, "0");
    }
    a.batch_execute("RESET statement_timeout").await.unwrap();
    assert_eq!(show(&a, "statement_timeout").await, "0");
    assert_eq!(
        simple_rows(&a, "SHOW search_path").await[0],
        "a_schema, public"
    );
}

async fn show(c: &tokio_postgres::Client, name: &str) -> String {
    simple_rows(c, &format!("SHOW {name}")).await[0].clone()
}

/// Shoal's own idle connections to a database must not block a client's `DROP DATABASE` (or
/// `ALTER DATABASE ... RENAME`) of it, in either pool mode and through either protocol: they
/// are closed first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_database_is_not_blocked_by_idle_pooled_connections() {
    for mode in ["transaction", "session"] {
        let victim = unique_db("pool");
        let other = unique_db("pool");
        pg().create_database(&victim);
        pg().create_database(&other);
        let extra = format!("[pool]\npool_mode = \"{mode}\"\n");
        let shoal = Shoal::start(&base_config(pg(), &[&victim, &other], &extra));
        let v = shoal.connect(&victim).await;
        let vs = join_all((0..3).map(|_| shoal.connect(&victim))).await;
        for c in &vs {
            c.batch_execute("BEGIN").await.unwrap();
        }
        for c in &vs {
            c.batch_execute("COMMIT").await.unwrap();
        }
        assert!(pg().backends(&victim) >= 3, "idle pooled servers exist");
        drop(vs);
        drop(v);
        // Session mode: the servers go back to the pool once reset after their clients left.
        let pending = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{victim}' \
             AND (state <> 'idle' OR query NOT ILIKE 'DISCARD%')"
        );
        eventually("servers back in the pool", Duration::from_secs(10), || {
            mode == "transaction" || pg().psql_admin(&pending).trim() == "0"
        })
        .await;
        let o = shoal.connect(&other).await;
        let renamed = format!("{victim}_r");
        o.batch_execute(&format!("ALTER DATABASE {victim} RENAME TO {renamed}"))
            .await
            .unwrap_or_else(|e| panic!("{mode}: rename: {e}"));
        // The extended protocol (as pgJDBC sends it).
        o.execute(&format!("DROP DATABASE {renamed}"), &[])
            .await
            .unwrap_or_else(|e| panic!("{mode}: drop: {e}"));
    }
}

/// Each pool logs its counters every `stats_period` seconds while it is in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_log_their_stats() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\nstats_period = 1\n");
    let c = shoal.connect(&db).await;
    for _ in 0..5 {
        simple_rows(&c, "SELECT 1").await;
    }
    eventually("a pool stats line", Duration::from_secs(10), || {
        shoal.log_contains("pool stats")
    })
    .await;
    let log = shoal.log.lock().unwrap();
    let line = log.iter().find(|l| l.contains("pool stats")).unwrap();
    assert!(line.contains(&format!("pool={db}/app")), "{line}");
    for field in [
        "clients=1",
        "servers=",
        "transactions_per_s=",
        "avg_wait_us=",
    ] {
        assert!(line.contains(field), "{line}");
    }
}

/// `[databases."*"]`: any database name no entry lists reaches the wildcard's server, with
/// the client's name passed through; listed names and the console keep their meaning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wildcard_database_passes_names_through() {
    let listed = unique_db("pool");
    let first = unique_db("pool");
    let second = unique_db("pool");
    for db in [&listed, &first, &second] {
        pg().create_database(db);
    }
    let extra = format!(
        "[databases.\"*\"]\nhost = \"127.0.0.1\"\nport = {}\npool_size = 2\n\
         [admin]\nusers = [\"app\"]\n",
        pg().port
    );
    let config = base_config(pg(), &[&listed], &extra);
    let shoal = Shoal::start(&config);
    for db in [&listed, &first, &second] {
        let c = shoal.connect(db).await;
        assert_eq!(
            simple_rows(&c, "SELECT current_database()").await,
            vec![db.to_string()]
        );
    }
    // A name PostgreSQL does not know: its own error.
    let Err(e) = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "no_such_db_here"))
        .await
    else {
        panic!("an unknown database was accepted");
    };
    assert_eq!(code(&e), "3D000", "{e}");
    // The console is still the console.
    let console = shoal.connect_as("app", APP_PASSWORD, "pgbouncer").await;
    let rows = console.simple_query("SHOW POOLS").await.unwrap();
    assert!(!rows.is_empty());
    // `dbname` on the wildcard is refused with the reason.
    let bad = base_config(pg(), &[], "[databases.\"*\"]\ndbname = \"x\"\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, bad).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("passes the client's database name"));
}

/// A temporary table stays with the client that made it while the pool has room: another
/// client's transactions in between get other servers, not its (which would be cleaned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_temp_table_survives_other_clients_while_the_pool_has_room() {
    let db = unique_db("pool");
    let shoal = shoal_for(&db, "[pool]\npool_size = 20\n");
    let a = shoal.connect(&db).await;
    let b = shoal.connect(&db).await;
    a.batch_execute("CREATE TEMP TABLE mine (x int); INSERT INTO mine VALUES (7)")
        .await
        .unwrap();
    for round in 0..10 {
        let v: i32 = b
            .query_one("SELECT $1::int", &[&round])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, round);
        let x: i32 = a
            .query_one("SELECT x FROM mine", &[])
            .await
            .unwrap_or_else(|e| panic!("round {round}: the temp table is gone: {e}"))
            .get(0);
        assert_eq!(x, 7);
    }
}

/// A login with startup parameters the pool has not seen reports what a server says for
/// them, so the first such login takes a server; those arriving meanwhile wait for its
/// answer instead of each taking one (a connect storm would otherwise hold the whole pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_logins_with_new_parameters_learn_them_from_one_server() {
    let db = unique_db("learn");
    let shoal = shoal_for(&db, "[pool]\npool_size = 8\n");
    let clients = join_all((0..24).map(|_| shoal.connect(&db))).await;
    assert_eq!(
        pg().backends(&db),
        1,
        "24 simultaneous first logins opened more than one server"
    );
    for c in &clients {
        assert_eq!(simple_rows(c, "SELECT 7").await, ["7"]);
    }
}
