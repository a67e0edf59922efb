//! The admin console: every command, through real clients (tokio-postgres, psql, psycopg
//! running the PgBouncer exporter's queries), with admin, stats-only and refused users.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;
use tokio_postgres::SimpleQueryMessage;

const ADMIN_PASSWORD: &str = "admin-secret";

fn admin_config(pg: &Pg, db: &str, extra: &str) -> String {
    base_config(
        pg,
        &[db],
        &format!(
            "[admin]\nusers = [\"admin\"]\nstats_users = [\"watcher\"]\n\
             [users.admin]\npassword = \"{ADMIN_PASSWORD}\"\n\
             [users.watcher]\npassword = \"watch-secret\"\n{extra}"
        ),
    )
}

async fn console(shoal: &Shoal, user: &str, password: &str) -> tokio_postgres::Client {
    shoal.connect_as(user, password, "pgbouncer").await
}

/// Rows of a console query as (column names, rows of text).
async fn show(c: &tokio_postgres::Client, q: &str) -> (Vec<String>, Vec<Vec<Option<String>>>) {
    let msgs = c
        .simple_query(q)
        .await
        .unwrap_or_else(|e| panic!("{q}: {e:?}"));
    let mut cols = Vec::new();
    let mut rows = Vec::new();
    for m in msgs {
        if let SimpleQueryMessage::Row(r) = m {
            if cols.is_empty() {
                cols = r.columns().iter().map(|c| c.name().to_owned()).collect();
            }
            rows.push((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect());
        }
    }
    (cols, rows)
}

fn col<'a>(cols: &[String], row: &'a [Option<String>], name: &str) -> &'a str {
    let i = cols
        .iter()
        .position(|c| c == name)
        .unwrap_or_else(|| panic!("no column {name} in {cols:?}"));
    row[i].as_deref().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_commands_with_pgbouncer_columns() {
    let db = unique_db("admin");
    pg().create_database(&db);
    let shoal = Shoal::start(&admin_config(pg(), &db, ""));
    let app = shoal.connect(&db).await;
    for _ in 0..5 {
        app.simple_query("SELECT 1").await.unwrap();
    }
    let c = console(&shoal, "admin", ADMIN_PASSWORD).await;
    let (cols, rows) = show(&c, "SHOW POOLS").await;
    for name in [
        "database",
        "user",
        "cl_active",
        "cl_waiting",
        "sv_active",
        "sv_idle",
        "sv_used",
        "sv_login",
        "maxwait",
        "pool_mode",
    ] {
        assert!(
            cols.iter().any(|c| c == name),
            "SHOW POOLS has {name}: {cols:?}"
        );
    }
    let mine = rows
        .iter()
        .find(|r| col(&cols, r, "database") == db)
        .expect("our pool");
    assert_eq!(col(&cols, mine, "user"), "app");
    assert_eq!(col(&cols, mine, "cl_active"), "1");
    assert_eq!(col(&cols, mine, "pool_mode"), "transaction");
    let (cols, rows) = show(&c, "SHOW STATS").await;
    let mine = rows
        .iter()
        .find(|r| col(&cols, r, "database") == db)
        .expect("our stats");
    assert!(col(&cols, mine, "total_xact_count").parse::<u64>().unwrap() >= 5);
    assert!(
        col(&cols, mine, "total_query_count")
            .parse::<u64>()
            .unwrap()
            >= 5
    );
    assert!(col(&cols, mine, "total_sent").parse::<u64>().unwrap() > 0);
    let (cols, rows) = show(&c, "SHOW CLIENTS").await;
    assert!(rows
        .iter()
        .any(|r| col(&cols, r, "database") == db && col(&cols, r, "user") == "app"));
    let (cols, rows) = show(&c, "SHOW SERVERS").await;
    let server = rows
        .iter()
        .find(|r| col(&cols, r, "database") == db)
        .expect("a server");
    assert!(col(&cols, server, "remote_pid").parse::<i32>().unwrap() > 0);
    assert_eq!(col(&cols, server, "state"), "idle");
    let (cols, rows) = show(&c, "SHOW DATABASES").await;
    let d = rows
        .iter()
        .find(|r| col(&cols, r, "name") == db)
        .expect("our database");
    assert_eq!(col(&cols, d, "port"), pg().port.to_string());
    let (_, rows) = show(&c, "SHOW USERS").await;
    assert!(rows.iter().any(|r| r[0].as_deref() == Some("app")));
    let (cols, rows) = show(&c, "SHOW CONFIG").await;
    assert_eq!(cols, ["key", "value", "default", "changeable"]);
    assert!(rows
        .iter()
        .any(|r| r[0].as_deref() == Some("max_client_conn")));
    let (_, rows) = show(&c, "SHOW VERSION").await;
    assert!(rows[0][0].as_deref().unwrap().contains("Shoal"));
    let (cols, rows) = show(&c, "SHOW LISTS").await;
    assert_eq!(cols, ["list", "items"]);
    assert!(rows.iter().any(|r| r[0].as_deref() == Some("used_clients")));
    // Several statements in one query, and errors.
    let both = c.simple_query("SHOW VERSION; SHOW LISTS").await.unwrap();
    let completes = both
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::CommandComplete(_)))
        .count();
    assert_eq!(completes, 2, "two result sets");
    let e = c.simple_query("SHOW NOTHING").await.unwrap_err();
    assert_eq!(code(&e), "0A000");
    let e = c.simple_query("DROP TABLE x").await.unwrap_err();
    assert_eq!(code(&e), "42601");
    // The console keeps working after errors.
    show(&c, "SHOW POOLS").await;
    // psql, as an operator would.
    let out = Command::new("psql")
        .arg(format!(
            "host=127.0.0.1 port={} user=admin dbname=pgbouncer",
            shoal.port()
        ))
        .args(["-X", "-At", "-c", "SHOW LISTS"])
        .env("PGPASSWORD", ADMIN_PASSWORD)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("used_clients|"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_queries_run_through_psycopg() {
    let db = unique_db("exporter");
    pg().create_database(&db);
    let shoal = Shoal::start(&admin_config(pg(), &db, ""));
    let app = shoal.connect(&db).await;
    app.simple_query("SELECT 1").await.unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/ops/exporter_queries.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(format!(
            "host=127.0.0.1 port={} user=watcher password=watch-secret dbname=pgbouncer",
            shoal.port()
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let has = |q: &str, cols: &[&str]| {
        let got: Vec<&str> = v[q]["columns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap())
            .collect();
        for c in cols {
            assert!(got.contains(c), "{q} has {c}: {got:?}");
        }
        assert!(v[q]["rows"].as_u64().unwrap() >= 1, "{q} has rows");
    };
    // The columns the community exporter reads.
    has(
        "SHOW STATS",
        &[
            "database",
            "total_server_assignment_count",
            "total_xact_count",
            "total_query_count",
            "total_received",
            "total_sent",
            "total_xact_time",
            "total_query_time",
            "total_wait_time",
            "avg_xact_count",
            "avg_query_count",
            "avg_recv",
            "avg_sent",
            "avg_xact_time",
            "avg_query_time",
            "avg_wait_time",
        ],
    );
    has(
        "SHOW POOLS",
        &[
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
        ],
    );
    has(
        "SHOW DATABASES",
        &[
            "name",
            "host",
            "port",
            "database",
            "force_user",
            "pool_size",
            "min_pool_size",
            "reserve_pool",
            "pool_mode",
            "max_connections",
            "current_connections",
            "paused",
            "disabled",
        ],
    );
    has("SHOW CONFIG", &["key", "value", "default", "changeable"]);
    has("SHOW LISTS", &["list", "items"]);
    assert!(v["SHOW VERSION"]["first"][0]
        .as_str()
        .unwrap()
        .contains("PgBouncer 1."));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn who_may_use_the_console() {
    let db = unique_db("adminauth");
    pg().create_database(&db);
    let shoal = Shoal::start(&admin_config(pg(), &db, ""));
    let e = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "pgbouncer"))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "28000");
    let e = shoal
        .try_connect(&shoal.conninfo("admin", "wrong", "pgbouncer"))
        .await
        .unwrap_err();
    assert_eq!(code(&e), "28P01");
    let w = console(&shoal, "watcher", "watch-secret").await;
    show(&w, "SHOW POOLS").await;
    for cmd in ["PAUSE", "RESUME", "RELOAD", "SHUTDOWN", "KILL x"] {
        let e = w.simple_query(cmd).await.unwrap_err();
        assert_eq!(code(&e), "42501", "{cmd}");
    }
    // The alias.
    let a = shoal.connect_as("admin", ADMIN_PASSWORD, "shoal").await;
    show(&a, "SHOW VERSION").await;
}

/// PAUSE waits for running transactions, holds new ones, and closes servers, so PostgreSQL
/// can restart under Shoal; RESUME releases the held clients: nobody sees an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_restart_postgres_resume_without_errors() {
    let own = Pg::start_on(free_port());
    own.create_database("paused");
    let shoal = Shoal::start(&admin_config(&own, "paused", ""));
    let admin = console(&shoal, "admin", ADMIN_PASSWORD).await;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(shoal.connect("paused").await);
    }
    let traffic = common::traffic::Traffic::start(clients, "BEGIN; SELECT pg_sleep(0.005); COMMIT");
    traffic.wait_for(20).await;
    admin.simple_query("PAUSE paused").await.unwrap();
    // Paused: no transaction runs, no server is open.
    let before = traffic.done();
    assert_eq!(own.backends("paused"), 0, "PAUSE closed the servers");
    own.stop();
    own.pg_ctl_start();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(traffic.done() <= before + 4, "transactions were held");
    let (cols, rows) = show(&admin, "SHOW DATABASES").await;
    let d = rows
        .iter()
        .find(|r| col(&cols, r, "name") == "paused")
        .unwrap();
    assert_eq!(col(&cols, d, "paused"), "1");
    admin.simple_query("RESUME paused").await.unwrap();
    traffic.wait_for(20).await;
    let failures = traffic.stop().await;
    assert!(failures.is_empty(), "clients saw errors: {failures:?}");
    own.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_reload_suspend_wait_close_and_shutdown() {
    let db = unique_db("adminops");
    pg().create_database(&db);
    let mut shoal = Shoal::start(&admin_config(pg(), &db, ""));
    let admin = console(&shoal, "admin", ADMIN_PASSWORD).await;
    // KILL: the database's clients are ended with 57P01.
    let (client, conn) = tokio_postgres::connect(
        &shoal.conninfo("app", APP_PASSWORD, &db),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let ended = tokio::spawn(conn);
    client.simple_query("SELECT 1").await.unwrap();
    admin.simple_query(&format!("KILL {db}")).await.unwrap();
    let e = ended.await.unwrap().unwrap_err();
    assert_eq!(code(&e), "57P01");
    // The next login gets a fresh pool.
    let c = shoal.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    // RELOAD with a bigger pool, then WAIT_CLOSE returns (nothing retired is left open).
    let path = shoal.config_dir.path().join("shoal.toml");
    std::fs::write(&path, admin_config(pg(), &db, "[pool]\npool_size = 7\n")).unwrap();
    admin.simple_query("RELOAD").await.unwrap();
    let (cols, rows) = show(&admin, "SHOW CONFIG").await;
    let size = rows
        .iter()
        .find(|r| col(&cols, r, "key") == "default_pool_size")
        .unwrap();
    assert_eq!(col(&cols, size, "value"), "7");
    tokio::time::timeout(Duration::from_secs(10), admin.simple_query("WAIT_CLOSE"))
        .await
        .expect("WAIT_CLOSE returns")
        .unwrap();
    // A broken file: RELOAD fails with the reason, the old config stays.
    std::fs::write(&path, "[pool]\npool_size = \"lots\"\n").unwrap();
    let e = admin.simple_query("RELOAD").await.unwrap_err();
    assert_eq!(code(&e), "F0000");
    c.simple_query("SELECT 1").await.unwrap();
    // SUSPEND holds transactions; RESUME releases them.
    admin.simple_query("SUSPEND").await.unwrap();
    let held = tokio::spawn(async move { c.simple_query("SELECT 42").await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!held.is_finished(), "held while suspended");
    admin.simple_query("RESUME").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // SHUTDOWN: the process exits.
    admin.simple_query("SHUTDOWN").await.unwrap();
    assert_eq!(shoal.wait(Duration::from_secs(30)), Some(true));
}

/// The embedded default, as `scripts/quickstart` runs it (here on other ports): its user
/// reaches both its database and the console out of the box.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_default_user_reaches_the_console() {
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("default-config")
        .output()
        .expect("shoal runs");
    let default = String::from_utf8(out.stdout).unwrap();
    let api = default.find("[api]").expect("an [api] section");
    let config = default[..api]
        .replace("127.0.0.1:6432", "127.0.0.1:0")
        .replace("port = 5432", &format!("port = {}", pg().port));
    pg().psql_admin(
        "DO $$BEGIN CREATE ROLE shoal LOGIN PASSWORD 'shoal'; \
         EXCEPTION WHEN duplicate_object THEN NULL; END$$",
    );
    pg().create_database("shoal");
    let shoal = Shoal::start(&config);
    let db = shoal.connect_as("shoal", "shoal", "shoal").await;
    assert_eq!(simple_rows(&db, "SELECT current_user").await, vec!["shoal"]);
    let c = shoal.connect_as("shoal", "shoal", "pgbouncer").await;
    let (cols, rows) = show(&c, "SHOW POOLS").await;
    let at = cols
        .iter()
        .position(|c| c == "database")
        .expect("a database column");
    assert!(
        rows.iter().any(|r| r[at].as_deref() == Some("shoal")),
        "{rows:?}"
    );
}

/// A PgBouncer user's way in: `shoal import-pgbouncer pgbouncer.ini userlist.txt` writes a
/// configuration Shoal runs as is; the same client logs in with the same password, and the
/// settings Shoal cannot carry over are named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pgbouncer_configuration_is_imported_and_served() {
    let db = unique_db("pgbimport");
    pg().create_database(&db);
    let dir = tempfile::tempdir().unwrap();
    let ini = dir.path().join("pgbouncer.ini");
    let users = dir.path().join("userlist.txt");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n{db} = host=127.0.0.1 port={} pool_size=3\n\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = 0\nauth_type = scram-sha-256\n\
             auth_file = {}\npool_mode = transaction\nadmin_users = app\n\
             reserve_pool_size = 2\nlogfile = /var/log/pgbouncer.log\n",
            pg().port,
            users.display()
        ),
    )
    .unwrap();
    std::fs::write(&users, format!("\"app\" \"{APP_PASSWORD}\"\n")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_shoal"))
        .args(["import-pgbouncer"])
        .args([&ini, &users])
        .output()
        .expect("shoal runs");
    assert!(out.status.success());
    let config = String::from_utf8(out.stdout).unwrap();
    let notes = String::from_utf8_lossy(&out.stderr);
    assert!(notes.contains("reserve_pool_size"), "{notes}");
    assert!(notes.contains("logfile"), "{notes}");
    assert!(!notes.contains("needs these changes"), "{notes}\n{config}");
    let shoal = Shoal::start(&config);
    let c = shoal.connect(&db).await;
    assert_eq!(simple_rows(&c, "SELECT 40 + 2").await, vec!["42"]);
    let console = shoal.connect_as("app", APP_PASSWORD, "pgbouncer").await;
    let (cols, rows) = show(&console, "SHOW POOLS").await;
    assert!(
        rows.iter().any(|r| col(&cols, r, "database") == db),
        "{rows:?}"
    );
}

/// The rest of what PgBouncer's console answers: RECONNECT, DISABLE/ENABLE, SHOW TOTALS and
/// STATE; SET and SHOW FDS are refused with what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_disable_enable_totals_and_state() {
    let db = unique_db("adminmore");
    pg().create_database(&db);
    let shoal = Shoal::start(&admin_config(pg(), &db, "[pool]\npool_size = 1\n"));
    let admin = console(&shoal, "admin", ADMIN_PASSWORD).await;
    // RECONNECT: the idle server is closed, the next transaction gets a new backend.
    let c = shoal.connect(&db).await;
    let before = simple_rows(&c, "SELECT pg_backend_pid()").await;
    admin.simple_query("RECONNECT").await.unwrap();
    let after = simple_rows(&c, "SELECT pg_backend_pid()").await;
    assert_ne!(before, after, "a new server after RECONNECT");
    // DISABLE: new logins are refused and told why; a connected client goes on; ENABLE.
    admin.simple_query(&format!("DISABLE {db}")).await.unwrap();
    let Err(e) = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, &db))
        .await
    else {
        panic!("a login to a disabled database is refused");
    };
    assert_eq!(code(&e), "57P03");
    assert!(format!("{e:?}").contains("DISABLE"), "{e:?}");
    assert_eq!(simple_rows(&c, "SELECT 1").await, vec!["1"]);
    admin.simple_query(&format!("ENABLE {db}")).await.unwrap();
    shoal
        .connect(&db)
        .await
        .simple_query("SELECT 1")
        .await
        .unwrap();
    // SHOW TOTALS: every database's transactions together.
    let (cols, rows) = show(&admin, "SHOW TOTALS").await;
    let xacts = rows
        .iter()
        .find(|r| col(&cols, r, "name") == "total_xact_count")
        .map(|r| col(&cols, r, "value").parse::<u64>().unwrap())
        .expect("a total_xact_count row");
    assert!(xacts >= 3, "{rows:?}");
    // SHOW STATE follows PAUSE and RESUME.
    let state = |rows: &[Vec<Option<String>>], cols: &[String], key: &str| {
        rows.iter()
            .find(|r| col(cols, r, "key") == key)
            .map(|r| col(cols, r, "value").to_owned())
    };
    let (cols, rows) = show(&admin, "SHOW STATE").await;
    assert_eq!(state(&rows, &cols, "active").as_deref(), Some("yes"));
    admin.simple_query("PAUSE").await.unwrap();
    let (cols, rows) = show(&admin, "SHOW STATE").await;
    assert_eq!(state(&rows, &cols, "paused").as_deref(), Some("yes"));
    admin.simple_query("RESUME").await.unwrap();
    let (cols, rows) = show(&admin, "SHOW STATE").await;
    assert_eq!(state(&rows, &cols, "paused").as_deref(), Some("no"));
    // SET and SHOW FDS say what Shoal does instead.
    let e = admin
        .simple_query("SET default_pool_size = 5")
        .await
        .unwrap_err();
    assert_eq!(code(&e), "0A000");
    assert!(format!("{e:?}").contains("RELOAD"), "{e:?}");
    let e = admin.simple_query("SHOW FDS").await.unwrap_err();
    assert!(format!("{e:?}").contains("--upgrade-socket"), "{e:?}");
}
