//! Transaction-mode isolation: two clients on a pool of one server. Client A does something
//! that changes its session; client B, which necessarily gets the same server next, must see
//! nothing of it — B's view must equal a fresh direct connection's. Where Shoal carries A's
//! state (session SETs), A must still see it afterwards.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;

/// One state change to check: what A runs, what B probes, and whether A keeps its state.
struct Case {
    a_sql: &'static str,
    probe: &'static str,
    /// A sees its own change through the probe afterwards (the value it expects), even after
    /// B used the server in between.
    a_keeps: Option<&'static str>,
}

const fn case(a_sql: &'static str, probe: &'static str) -> Case {
    Case {
        a_sql,
        probe,
        a_keeps: None,
    }
}

const fn keeps(a_sql: &'static str, probe: &'static str, value: &'static str) -> Case {
    Case {
        a_sql,
        probe,
        a_keeps: Some(value),
    }
}

const WHO: &str = "SELECT current_user || '/' || session_user";
const TEMP_TABLES: &str =
    "SELECT count(*) FROM pg_catalog.pg_class WHERE relnamespace = pg_catalog.pg_my_temp_schema()";
const READ_ONLY: &str = "SHOW default_transaction_read_only";

const CASES: &[Case] = &[
    keeps("SET ROLE iso_other", WHO, "iso_other/app"),
    keeps(
        "SET SESSION AUTHORIZATION iso_other",
        WHO,
        "iso_other/iso_other",
    ),
    case("SELECT set_config('role', 'iso_other', false)", WHO),
    case(
        "SELECT set_config('search_path', 'pg_catalog', false)",
        "SHOW search_path",
    ),
    case(
        "SELECT pg_catalog.set_config('statement_timeout', '1', false)",
        "SHOW statement_timeout",
    ),
    case(
        "select set_config('default_transaction_read_only', 'on', false)",
        READ_ONLY,
    ),
    // Transaction-local (a bare `true`): gone at the statement's end, no state left. Beside
    // a session-level call in the same statement, the server still holds state.
    case(
        "SELECT set_config('search_path', 'pg_catalog', true)",
        "SHOW search_path",
    ),
    case(
        "SELECT set_config('statement_timeout', '7', true), set_config('role', 'iso_other', false)",
        WHO,
    ),
    keeps("SET default_transaction_read_only = on", READ_ONLY, "on"),
    keeps(
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
        READ_ONLY,
        "on",
    ),
    keeps(
        "/* a comment */ SET search_path = pg_catalog",
        "SHOW search_path",
        "pg_catalog",
    ),
    case("SELECT 1; SET search_path = pg_catalog", "SHOW search_path"),
    case(
        "DO $$BEGIN PERFORM set_config('search_path', 'pg_catalog', false); END$$",
        "SHOW search_path",
    ),
    keeps("SET application_name = 'iso_a'", "SHOW application_name", "iso_a"),
    keeps("SET TIME ZONE 'Asia/Tokyo'", "SHOW TimeZone", "Asia/Tokyo"),
    case(
        "CREATE TEMP TABLE iso_t AS SELECT 'secret' AS s",
        TEMP_TABLES,
    ),
    case("SELECT 1 AS a INTO TEMP iso_t2", TEMP_TABLES),
    case(
        "PREPARE iso_p AS SELECT 1",
        "SELECT count(*) FROM pg_catalog.pg_prepared_statements",
    ),
    case(
        "BEGIN; DECLARE iso_c CURSOR WITH HOLD FOR SELECT 1; COMMIT",
        "SELECT count(*) FROM pg_catalog.pg_cursors",
    ),
    case(
        "LISTEN iso_chan",
        "SELECT count(*) FROM pg_catalog.pg_listening_channels()",
    ),
    // What a simpler lexer missed: a `--` comment ended by a carriage return, identifiers
    // spelled in Unicode escapes, a cursor's WITH HOLD after the eighth word, pg_settings.
    case(
        "select 1 --x\r; select set_config('search_path','pg_catalog',false)",
        "SHOW search_path",
    ),
    case("--x\rcreate temp table iso_cr as select 1", TEMP_TABLES),
    case(
        "select U&\"!0073et_config\" UESCAPE '!'('role', 'iso_other', false)",
        WHO,
    ),
    case(
        "select U&\"\\0073\\0065\\0074\\005f\\0063\\006f\\006e\\0066\\0069\\0067\"('search_path', 'pg_catalog', false)",
        "SHOW search_path",
    ),
    case(
        "UPDATE pg_settings SET setting = 'pg_catalog' WHERE name = 'search_path'",
        "SHOW search_path",
    ),
    case(
        "BEGIN; declare iso_c9 binary insensitive no scroll cursor with hold for select 1; COMMIT",
        "SELECT count(*) FROM pg_catalog.pg_cursors",
    ),
    case(
        "SELECT pg_advisory_lock(4242)",
        "SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    ),
];

async fn first_value(c: &tokio_postgres::Client, sql: &str) -> String {
    simple_rows(c, sql)
        .await
        .into_iter()
        .next()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_never_reaches_the_next_client() {
    let db = unique_db("iso");
    pg().psql_admin(
        "DO $$BEGIN CREATE ROLE iso_other; EXCEPTION WHEN duplicate_object THEN NULL; END$$",
    );
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let fresh = direct(&db).await;
    let mut failures = Vec::new();
    for c in CASES {
        let expected = first_value(&fresh, c.probe).await;
        let a = shoal.connect(&db).await;
        if let Err(e) = a.batch_execute(c.a_sql).await {
            failures.push(format!("{}: A's statement failed: {e}", c.a_sql));
            continue;
        }
        let b = shoal.connect(&db).await;
        let seen = first_value(&b, c.probe).await;
        if seen != expected {
            failures.push(format!(
                "{}: B saw {seen:?} for {:?}, a fresh session sees {expected:?}",
                c.a_sql, c.probe
            ));
        }
        if let Some(keep) = c.a_keeps {
            let own = first_value(&a, c.probe).await;
            if own != keep {
                failures.push(format!(
                    "{}: A lost its own state: {own:?}, expected {keep:?}",
                    c.a_sql
                ));
            }
        }
        // The same through the extended protocol (a named statement, as drivers send it),
        // for single statements.
        if !c.a_sql.contains(';') && !c.a_sql.starts_with("DO") {
            let a2 = shoal.connect(&db).await;
            if a2.execute(c.a_sql, &[]).await.is_ok() {
                let b2 = shoal.connect(&db).await;
                let seen = first_value(&b2, c.probe).await;
                if seen != expected {
                    failures.push(format!(
                        "{} (extended protocol): B saw {seen:?}, a fresh session sees {expected:?}",
                        c.a_sql
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "leaks:\n{}", failures.join("\n"));
}

/// State Shoal does not carry (a temporary table) stays with its client as long as no other
/// client needed the server in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_state_is_kept_while_no_one_else_used_the_server() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let a = shoal.connect(&db).await;
    a.batch_execute("CREATE TEMP TABLE mine AS SELECT 7 AS v")
        .await
        .unwrap();
    for _ in 0..3 {
        assert_eq!(simple_rows(&a, "SELECT v FROM mine").await, vec!["7"]);
    }
}

/// Servers holding the state of clients that have left are cleaned for others before any
/// live client's: A keeps its temporary table while clients come and go (pgx's
/// `TestConnStress` lost its state this way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_clients_state_outlasts_the_state_of_clients_that_left() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\n");
    for i in 0..2 {
        let gone = shoal.connect(&db).await;
        gone.batch_execute(&format!("CREATE TEMP TABLE gone{i} (a int)"))
            .await
            .unwrap();
    }
    // Both servers now hold state of clients that have left (once their sessions end).
    let a = shoal.connect(&db).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        a.batch_execute("DROP TABLE IF EXISTS keep; CREATE TEMP TABLE keep AS SELECT 7 AS v")
            .await
            .unwrap();
        let b = shoal.connect(&db).await;
        b.batch_execute("SELECT 1").await.unwrap();
        drop(b);
        match a.simple_query("SELECT v FROM keep").await {
            Ok(_) => break,
            // The orphans' sessions may not have ended yet when B came: try again.
            Err(e) if std::time::Instant::now() < deadline => {
                assert_eq!(code(&e), "55000", "{e:?}");
            }
            Err(e) => panic!("A lost its temporary table to B: {e:?}"),
        }
    }
    for _ in 0..5 {
        let b = shoal.connect(&db).await;
        b.batch_execute("SELECT 1").await.unwrap();
        assert_eq!(simple_rows(&a, "SELECT v FROM keep").await, vec!["7"]);
    }
}

/// When a full pool has nothing but a live client's server to give, that client's state is
/// cleaned away, and its next statement is refused with an error saying so (never run
/// silently without its state); it goes on afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_client_whose_state_is_taken_is_told() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let a = shoal.connect(&db).await;
    a.batch_execute("CREATE TEMP TABLE keep AS SELECT 7 AS v")
        .await
        .unwrap();
    let b = shoal.connect(&db).await;
    assert_eq!(simple_rows(&b, "SELECT 1").await, vec!["1"]);
    let e = a
        .simple_query("SELECT v FROM keep")
        .await
        .expect_err("told");
    assert_eq!(code(&e), "55000", "{e:?}");
    let message = e
        .as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_default();
    assert!(message.contains("temporary tables"), "{message}");
    assert_eq!(simple_rows(&a, "SELECT 2").await, vec!["2"], "A goes on");
    // Once: a client whose only state is SETs Shoal replays is not told anything.
    let c = shoal.connect(&db).await;
    c.batch_execute("SET application_name = 'c'").await.unwrap();
    assert_eq!(simple_rows(&b, "SELECT 3").await, vec!["3"]);
    assert_eq!(simple_rows(&c, "SHOW application_name").await, vec!["c"]);
}

/// pgx parses the unnamed statement in one transaction and binds it in a later one: the Bind
/// must run this client's statement, never the one another client left on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnamed_statement_is_the_clients_own() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = BytesMut::new();
    raw::parse(&mut out, "", "SELECT 'a:' || $1::text");
    raw::sync(&mut out);
    a.send(&out).await;
    a.until_ready().await;
    // B leaves a same-shaped unnamed statement with a secret on the only server.
    let mut out = BytesMut::new();
    raw::parse(&mut out, "", "SELECT 'b-secret:' || $1::text");
    raw::sync(&mut out);
    b.send(&out).await;
    b.until_ready().await;
    let mut out = BytesMut::new();
    raw::bind(&mut out, "", "", &["x"]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    a.send(&out).await;
    let msgs = a.until_ready().await;
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "2DCZ", "{msgs:?}");
    assert_eq!(raw::first_column(&msgs[1]), "a:x");
    // A client that never parsed an unnamed statement gets PostgreSQL's error, not B's.
    let mut c = Raw::login(shoal.addr, "raw", &db, &[]).await;
    c.send(&out).await;
    let msgs = c.until_ready().await;
    assert_eq!(msgs[0].tag, 'E', "{msgs:?}");
    assert_eq!(msgs[0].code(), "26000");
    assert_eq!(
        msgs[0].field(b'M').as_deref(),
        Some("unnamed prepared statement does not exist")
    );
    assert_eq!(msgs.len(), 2, "then only ReadyForQuery: {msgs:?}");
    // And a simple query drops the unnamed statement, as in PostgreSQL.
    a.simple("SELECT 1").await.unwrap();
    a.send(&out).await;
    let msgs = a.until_ready().await;
    assert_eq!(msgs[0].code(), "26000");
}

/// A client cannot reach another client's statement through its pooler-wide name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooler_statement_names_are_not_reachable() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = BytesMut::new();
    raw::parse(&mut out, "mine", "SELECT 'b-secret'");
    raw::bind(&mut out, "", "mine", &[]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    b.send(&out).await;
    assert!(b.until_ready().await.iter().any(|m| m.tag == 'D'));
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    for guess in 1..=3 {
        let name = format!("shoal_{guess}");
        let mut out = BytesMut::new();
        raw::bind(&mut out, "", &name, &[]);
        raw::execute(&mut out, "");
        raw::sync(&mut out);
        a.send(&out).await;
        let msgs = a.until_ready().await;
        assert!(
            msgs.iter().all(|m| m.tag != 'D'),
            "{name} reached another client's statement"
        );
        assert_eq!(msgs[0].code(), "26000");
        assert_eq!(
            msgs[0].field(b'M'),
            Some(format!("prepared statement \"{name}\" does not exist"))
        );
        // SQL EXECUTE of the pooler's name does not reach it either.
        let e = a.simple(&format!("EXECUTE {name}")).await.unwrap_err();
        assert_eq!(e.code(), "26000", "{name} ran through SQL EXECUTE");
    }
}

/// psycopg (libpq < 17) deallocates its statements with SQL `DEALLOCATE`; `EXECUTE` of a
/// protocol-prepared name works; a duplicate Parse gets PostgreSQL's `42P05`; and none of it
/// breaks the server for the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_deallocate_execute_and_duplicate_names() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = BytesMut::new();
    raw::parse(&mut out, "_pg3_0", "SELECT $1::int * 2");
    raw::sync(&mut out);
    a.send(&out).await;
    a.until_ready().await;
    assert_eq!(a.simple("EXECUTE _pg3_0(21)").await.unwrap(), vec!["42"]);
    // A duplicate Parse.
    let mut out = BytesMut::new();
    raw::parse(&mut out, "_pg3_0", "SELECT 2");
    raw::sync(&mut out);
    a.send(&out).await;
    let msgs = a.until_ready().await;
    assert_eq!(msgs[0].code(), "42P05", "{msgs:?}");
    // Inside a transaction the duplicate fails it, as in PostgreSQL.
    a.simple("BEGIN").await.unwrap();
    a.send(&out).await;
    let msgs = a.until_ready().await;
    assert_eq!(msgs.last().unwrap().body, b"E", "transaction failed");
    a.simple("ROLLBACK").await.unwrap();
    // DEALLOCATE of the driver's name, then of a name that does not exist.
    let msgs = {
        let mut q = BytesMut::new();
        raw::query(&mut q, "DEALLOCATE _pg3_0");
        a.send(&q).await;
        a.until_ready().await
    };
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "CZ", "{msgs:?}");
    let e = a.simple("DEALLOCATE nothing_here").await.unwrap_err();
    assert_eq!(e.code(), "26000");
    // The name is free again; the same text parses under it.
    let mut out = BytesMut::new();
    raw::parse(&mut out, "_pg3_0", "SELECT $1::int * 2");
    raw::bind(&mut out, "", "_pg3_0", &["5"]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    a.send(&out).await;
    let msgs = a.until_ready().await;
    let row = msgs.iter().find(|m| m.tag == 'D').expect("a row");
    assert_eq!(raw::first_column(row), "10");
    // Another client on the same server prepares freely.
    let other = shoal.connect(&db).await;
    for i in 0..3 {
        let v: i32 = other
            .query_one("SELECT $1::int * 2", &[&i])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, i * 2);
    }
}

/// With `standard_conforming_strings = off` a backslash escapes a quote: startup parameters
/// spliced into SQL text could end their literal. Shoal passes them as bind parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_parameters_cannot_inject_sql() {
    let db = unique_db("iso");
    pg().create_database(&db);
    pg().psql_admin(&format!(
        "ALTER DATABASE {db} SET standard_conforming_strings = off"
    ));
    let shoal = Shoal::start(&base_config(pg(), &[&db], "[pool]\npool_size = 1\n"));
    let evil = "\\'),set_config('search_path','evil',false)--";
    let mut a = Raw::login(shoal.addr, "raw", &db, &[("application_name", evil)]).await;
    assert_eq!(a.simple("SHOW application_name").await.unwrap(), vec![evil]);
    assert_eq!(
        a.simple("SHOW search_path").await.unwrap(),
        vec!["\"$user\", public"]
    );
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    assert_eq!(
        b.simple("SHOW search_path").await.unwrap(),
        vec!["\"$user\", public"]
    );
}

/// Another client's statement, on the only server under the pooler's name, cannot be
/// replaced, run or dropped through SQL that hides the name from a simpler lexer (a comment
/// ended by a carriage return, Unicode escapes) or through the extended protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_sql_cannot_reach_pooler_statements() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut victim = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = BytesMut::new();
    raw::parse(&mut out, "v1", "SELECT $1::int");
    raw::sync(&mut out);
    victim.send(&out).await;
    victim.until_ready().await;
    let mut attacker = Raw::login(shoal.addr, "raw", &db, &[]).await;
    for n in 0..=3 {
        for sql in [
            format!("select 1 --x\r; deallocate shoal_{n}; prepare shoal_{n}(int) as select 666 + $1 * 0"),
            format!("select 1 --x\r; execute shoal_{n}(5)"),
            format!("execute U&\"!0073hoal_{n}\" UESCAPE '!'(5)"),
            format!("explain execute shoal_{n}(5)"),
            format!("deallocate U&\"\\0073hoal_{n}\""),
        ] {
            let e = attacker.simple(&sql).await.unwrap_err();
            assert_eq!(e.code(), "26000", "{sql}: {e:?}");
            // Through the extended protocol, unnamed and named.
            for name in ["", "a1"] {
                let mut out = BytesMut::new();
                raw::parse(&mut out, name, &sql);
                raw::bind(&mut out, "", name, &[]);
                raw::execute(&mut out, "");
                raw::sync(&mut out);
                attacker.send(&out).await;
                let msgs = attacker.until_ready().await;
                assert_eq!(msgs[0].code(), "26000", "{sql} as Parse {name:?}: {msgs:?}");
            }
        }
    }
    // The victim's statement is intact and its own.
    let mut out = BytesMut::new();
    raw::bind(&mut out, "", "v1", &["7"]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    victim.send(&out).await;
    let msgs = victim.until_ready().await;
    let row = msgs.iter().find(|m| m.tag == 'D').expect("a row");
    assert_eq!(raw::first_column(row), "7");
    // EXPLAIN EXECUTE of the client's own driver statement runs it, as EXECUTE does.
    let plan = victim.simple("EXPLAIN EXECUTE v1(3)").await.unwrap();
    assert!(plan.iter().any(|l| l.contains("Result")), "{plan:?}");
}

/// SETs Shoal carries for a client follow PostgreSQL's transaction rules: one rolled back to a
/// savepoint, one before a ROLLBACK AND CHAIN, and one in a pipeline that failed later are
/// gone; one released with its savepoint stays. Checked after another client used the only
/// server, so what A sees is what Shoal replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carried_sets_follow_savepoints_and_chains() {
    let db = unique_db("iso");
    pg().psql_admin(
        "DO $$BEGIN CREATE ROLE iso_other; EXCEPTION WHEN duplicate_object THEN NULL; END$$",
    );
    pg().psql_admin("GRANT iso_other TO app");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    // B logs in as the same user: the same pool, the same single server.
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let scripts: &[(&[&str], &str)] = &[
        (
            &[
                "BEGIN",
                "SAVEPOINT s",
                "SET ROLE iso_other",
                "ROLLBACK TO SAVEPOINT s",
                "COMMIT",
            ],
            "app/app",
        ),
        (
            &[
                "BEGIN",
                "SET ROLE iso_other",
                "ROLLBACK AND CHAIN",
                "COMMIT",
            ],
            "app/app",
        ),
        (
            &[
                "BEGIN",
                "SAVEPOINT s1",
                "SET application_name = 'kept'",
                "RELEASE SAVEPOINT s1",
                "SAVEPOINT s2",
                "SET ROLE iso_other",
                "ROLLBACK TO s2",
                "COMMIT",
            ],
            "app/app",
        ),
    ];
    for (statements, who) in scripts {
        for sql in *statements {
            a.simple(sql).await.unwrap();
        }
        b.simple("SELECT 1").await.unwrap();
        assert_eq!(a.simple(WHO).await.unwrap(), vec![*who], "{statements:?}");
    }
    assert_eq!(
        a.simple("SHOW application_name").await.unwrap(),
        vec!["kept"]
    );
    // A pipeline: the SET ran, a later statement failed, Sync ended the implicit
    // transaction: PostgreSQL rolled the SET back.
    let mut out = BytesMut::new();
    raw::parse(&mut out, "", "SET ROLE iso_other");
    raw::bind(&mut out, "", "", &[]);
    raw::execute(&mut out, "");
    raw::parse(&mut out, "", "SELECT 1/0");
    raw::bind(&mut out, "", "", &[]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    a.send(&out).await;
    let msgs = a.until_ready().await;
    assert!(msgs.iter().any(|m| m.code() == "22012"), "{msgs:?}");
    b.simple("SELECT 1").await.unwrap();
    assert_eq!(a.simple(WHO).await.unwrap(), vec!["app/app"]);
}

/// A CopyData header (and its first bytes) sent outside any COPY.
fn stray_copy_data(declared: u32, sent: usize) -> BytesMut {
    let mut b = BytesMut::new();
    b.extend_from_slice(b"d");
    b.extend_from_slice(&(declared + 4).to_be_bytes());
    b.extend_from_slice(&vec![b'x'; sent]);
    b
}

/// COPY messages outside a COPY, as PostgreSQL treats them (ignored), and never a server
/// handed to the next client with a client's message half-written to it: A sends a query and
/// the start of a long CopyData, then vanishes; B, on the only server, is served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_is_never_released_mid_message() {
    let db = unique_db("iso");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    for declared in [70_000u32, 1 << 30, 1_500_000_000] {
        let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
        let mut out = BytesMut::new();
        raw::query(&mut out, "SELECT 1");
        out.extend_from_slice(&stray_copy_data(declared, 100));
        a.send(&out).await;
        // A waits for its reply, then leaves with the CopyData unfinished.
        let msgs = a.until_ready().await;
        assert!(msgs.iter().any(|m| m.tag == 'D'), "{msgs:?}");
        drop(a);
        let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
        assert_eq!(
            b.simple("SELECT 'b'").await.unwrap(),
            vec!["b"],
            "declared {declared}"
        );
        assert_eq!(b.simple("SELECT 'b2'").await.unwrap(), vec!["b2"]);
    }
    // While idle: CopyData (short and long), CopyDone and CopyFail are ignored, and the
    // client's next query runs as usual.
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = stray_copy_data(10, 10);
    out.extend_from_slice(&stray_copy_data(200_000, 200_000));
    out.extend_from_slice(&[b'c', 0, 0, 0, 4]);
    out.extend_from_slice(&[b'f', 0, 0, 0, 7, b'n', b'o', 0]);
    raw::query(&mut out, "SELECT 'a'");
    a.send(&out).await;
    let msgs = a.until_ready().await;
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "TDCZ", "{msgs:?}");
    // A long one left unfinished while idle, then the client vanishes.
    a.send(&stray_copy_data(100_000, 50)).await;
    drop(a);
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    assert_eq!(b.simple("SELECT 'b3'").await.unwrap(), vec!["b3"]);
}

/// State changed inside a function cannot be seen in SQL text: with the default
/// `server_reset = "dirty"` it reaches the next client (documented), with `"always"` it never
/// does, and a client keeps its carried SETs either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_reset_always_cleans_what_no_lexer_sees() {
    for (reset, leaks) in [("dirty", true), ("always", false)] {
        let db = unique_db("iso");
        let shoal = shoal_for(
            &db,
            &format!("[pool]\npool_size = 1\nserver_reset = \"{reset}\"\n"),
        );
        let fresh = direct(&db).await;
        fresh
            .batch_execute(
                "CREATE FUNCTION sneaky() RETURNS int LANGUAGE sql AS \
                 $$ SELECT length(set_config('search_path', 'pg_catalog', false)) $$",
            )
            .await
            .unwrap();
        let expected = first_value(&fresh, "SHOW search_path").await;
        let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
        a.simple("SELECT sneaky()").await.unwrap();
        let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
        let seen = b.simple("SHOW search_path").await.unwrap();
        assert_eq!(seen[0] != expected, leaks, "{reset}: B saw {seen:?}");
        a.simple("SET application_name = 'a-keeps'").await.unwrap();
        b.simple("SELECT 1").await.unwrap();
        assert_eq!(
            a.simple("SHOW application_name").await.unwrap(),
            vec!["a-keeps"],
            "{reset}"
        );
    }
}
