//! Query rules through real clients: each matcher and action in the simple and the extended
//! protocol, the ways around a rule that must not work (case, comments, quoting, dollar
//! quotes, a statement prepared before the rule, a pipelined batch), transactions failed as
//! PostgreSQL fails them, and rules changed live.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;

/// Rules for database `db`, as TOML tables.
fn rules(db: &str, tables: &[&str]) -> String {
    tables
        .iter()
        .map(|t| format!("[[databases.{db}.rules]]\n{t}\n"))
        .collect()
}

fn shoal_with_rules(db: &str, tables: &[&str]) -> Shoal {
    let config = base_config(pg(), &[db], "") + &rules(db, tables);
    Shoal::start(&config)
}

fn fresh_db(prefix: &str) -> String {
    let db = unique_db(prefix);
    pg().create_database(&db);
    db
}

async fn refused(c: &tokio_postgres::Client, sql: &str, rule: &str) {
    let e = c.simple_query(sql).await.expect_err(sql);
    assert_eq!(code(&e), "42501", "{sql}: {e:?}");
    let message = e
        .as_db_error()
        .map(|d| d.message().to_owned())
        .unwrap_or_default();
    assert!(message.contains(rule), "{sql}: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_matcher_refuses_what_it_names_however_it_is_written() {
    let db = fresh_db("rules");
    let fp_of_lookup = shoal_wire::facts::facts("SELECT relname FROM pg_class WHERE oid = 1")
        .unwrap()
        .fingerprints[0]
        .clone();
    let s = shoal_with_rules(
        &db,
        &[
            "name = \"no-drop\"\nstatement = \"DROP\"\naction = \"deny\"",
            "function = \"pg_terminate_backend\"\naction = \"deny\"",
            "statement = \"SET statement_timeout\"\naction = \"deny\"",
            &format!("name = \"no-lookup\"\nfingerprint = \"{fp_of_lookup}\"\naction = \"deny\""),
            "name = \"no-secrets\"\nregex = \"(?i)secret_table\"\naction = \"deny\"",
        ],
    );
    let c = s.connect(&db).await;
    c.simple_query("CREATE TABLE t (id int)").await.unwrap();
    for sql in [
        "DROP TABLE t",
        "/* hi */ dRoP\tTABLE \"t\"",
        "SELECT 1; DROP TABLE t",
        "PREPARE p AS SELECT 1; DROP TABLE IF EXISTS nothing",
    ] {
        refused(&c, sql, "no-drop").await;
    }
    for sql in [
        "SELECT pg_terminate_backend(0)",
        "select PG_TERMINATE_BACKEND(0)",
        "SELECT \"pg_catalog\".\"pg_terminate_backend\"(0)",
        "SELECT $q$x$q$, pg_terminate_backend(0)",
        "WITH k AS (SELECT pg_terminate_backend(0)) SELECT * FROM k",
    ] {
        refused(&c, sql, "function pg_terminate_backend").await;
    }
    refused(
        &c,
        "SET LOCAL Statement_Timeout = 0",
        "SET statement_timeout",
    )
    .await;
    refused(
        &c,
        "select relname from pg_class where oid = 42",
        "no-lookup",
    )
    .await;
    refused(&c, "SELECT * FROM Secret_Table", "no-secrets").await;
    // What no rule names runs, and the client goes on after each refusal.
    c.simple_query("SET work_mem = '8MB'").await.unwrap();
    c.simple_query("SELECT 'pg_terminate_backend(0)'")
        .await
        .unwrap();
    let n: i64 = c
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0, "the table is still there");
    // The extended protocol: refused at Parse, and for a statement prepared before.
    let e = c
        .query("SELECT pg_terminate_backend($1)", &[&0i32])
        .await
        .unwrap_err();
    assert_eq!(code(&e), "42501", "{e:?}");
    let e = c.execute("DROP TABLE t", &[]).await.unwrap_err();
    assert_eq!(code(&e), "42501", "{e:?}");
    c.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_fails_the_transaction_it_is_in() {
    let db = fresh_db("rules_tx");
    let s = shoal_with_rules(&db, &["statement = \"TRUNCATE\"\naction = \"deny\""]);
    let c = s.connect(&db).await;
    c.simple_query("CREATE TABLE t (id int)").await.unwrap();
    c.simple_query("BEGIN").await.unwrap();
    c.simple_query("INSERT INTO t VALUES (1)").await.unwrap();
    refused(&c, "TRUNCATE t", "TRUNCATE").await;
    // As after any error in a transaction block.
    let e = c.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&e), "25P02", "{e:?}");
    c.simple_query("ROLLBACK").await.unwrap();
    let n: i64 = c
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    // A pipelined batch: an INSERT, then a refused statement, one Sync. PostgreSQL would
    // fail the batch at the second, rolling back the first: so must this.
    let mut raw = Raw::login(s.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::parse(&mut b, "", "INSERT INTO t VALUES (2)");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::parse(&mut b, "", "TRUNCATE t");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    raw.send(&b).await;
    let replies = raw.until_ready().await;
    let tags: String = replies.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "12CEZ", "{replies:?}");
    let error = replies.iter().find(|m| m.tag == 'E').unwrap();
    assert_eq!(error.code(), "42501");
    assert_eq!(raw.simple("SELECT count(*) FROM t").await.unwrap(), ["0"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_change_live_and_hold_statements_prepared_before() {
    let db = fresh_db("rules_live");
    let s = shoal_with_rules(&db, &[]);
    let c = s.connect(&db).await;
    let lock = c
        .prepare("SELECT pg_advisory_lock($1::bigint)")
        .await
        .unwrap();
    c.query(&lock, &[&1i64]).await.unwrap();
    c.simple_query("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    // An SQL PREPARE before the rule, and one among other statements (which Shoal does not
    // follow).
    c.simple_query("PREPARE sql_lock(bigint) AS SELECT pg_advisory_lock($1)")
        .await
        .unwrap();
    c.simple_query("SELECT 1; PREPARE hidden AS SELECT pg_advisory_lock(2)")
        .await
        .unwrap();
    let path = s.config_dir.path().join("shoal.toml");
    let config = base_config(pg(), &[&db], "")
        + &rules(
            &db,
            &[
                "function = \"pg_advisory_lock\"\naction = \"deny\"",
                "name = \"watch\"\nstatement = \"SELECT\"\naction = \"log\"",
            ],
        );
    std::fs::write(&path, config).unwrap();
    s.signal(libc::SIGHUP);
    eventually("the reload", Duration::from_secs(10), || {
        s.log_contains("configuration reloaded")
    })
    .await;
    // The same client, its statement prepared before the rule: held to it now.
    let e = c.query(&lock, &[&1i64]).await.unwrap_err();
    assert_eq!(code(&e), "42501", "{e:?}");
    // So is the SQL-prepared one; one Shoal never saw prepared cannot be shown harmless.
    for sql in ["EXECUTE sql_lock(1)", "EXECUTE hidden"] {
        let e = c.simple_query(sql).await.unwrap_err();
        assert_eq!(code(&e), "42501", "{sql}: {e:?}");
    }
    // A function rule naming the schema holds for a call left to the search path.
    assert_eq!(
        code(
            &c.simple_query("SELECT pg_catalog.pg_advisory_lock(3)")
                .await
                .unwrap_err()
        ),
        "42501"
    );
    // A log rule lets the statement run and says so.
    c.simple_query("SELECT 1").await.unwrap();
    eventually("the log rule's line", Duration::from_secs(5), || {
        s.log_contains("query rule matched (action log)") && s.log_contains("watch")
    })
    .await;
}

/// A function rule holds for the functions behind the database's own operators, casts and
/// views: a statement that never names the function still runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_rules_see_behind_operators_casts_and_views() {
    let db = fresh_db("rules_behind");
    direct(&db)
        .await
        .batch_execute(
            "CREATE OPERATOR ## (RIGHTARG = float8, FUNCTION = pg_sleep);
             CREATE VIEW slow AS SELECT 1 AS s FROM pg_sleep(0);
             CREATE VIEW on_slow AS SELECT * FROM slow;
             CREATE TYPE nap AS (n int);
             CREATE FUNCTION to_nap(int) RETURNS nap LANGUAGE sql
               AS 'SELECT ROW($1)::nap FROM pg_sleep(0)';
             CREATE CAST (int AS nap) WITH FUNCTION to_nap(int);
             CREATE VIEW fine AS SELECT 1 AS n;",
        )
        .await
        .unwrap();
    let s = shoal_with_rules(
        &db,
        &["name = \"no-sleep\"\nfunction = \"pg_catalog.pg_sleep\"\naction = \"deny\""],
    );
    let c = s.connect(&db).await;
    for sql in [
        "SELECT ## 0.0",
        "SELECT * FROM slow",
        "SELECT * FROM on_slow",
        "SELECT pg_sleep(0)",
    ] {
        refused(&c, sql, "no-sleep").await;
    }
    // The cast's function calls pg_sleep only inside its body: a function the client wrote,
    // which no proxy sees (docs/rules.md); the cast itself is followed to to_nap.
    c.simple_query("SELECT 1::nap").await.unwrap();
    assert_eq!(simple_rows(&c, "SELECT n FROM fine").await, ["1"]);
    // Such a view cannot be made through Shoal (its CREATE calls the function); one made
    // elsewhere is seen at once when any DDL passes through Shoal, and by the catalogue's
    // version check (every 2 s) when none does.
    refused(&c, "CREATE VIEW later AS SELECT ## 0.0 AS s", "no-sleep").await;
    direct(&db)
        .await
        .batch_execute("CREATE VIEW later AS SELECT 1 AS s FROM pg_sleep(0)")
        .await
        .unwrap();
    c.simple_query("CREATE TABLE any_ddl ()").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while c.simple_query("SELECT * FROM later").await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the catalogue was not read again after the DDL"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    refused(&c, "SELECT * FROM later", "no-sleep").await;
    direct(&db)
        .await
        .batch_execute("CREATE VIEW unseen AS SELECT 1 AS s FROM pg_sleep(0)")
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while c.simple_query("SELECT * FROM unseen").await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a view made outside Shoal was not seen by the version check"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    refused(&c, "SELECT * FROM unseen", "no-sleep").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_mode_pool_with_rules_is_refused_with_the_reason() {
    let db = fresh_db("rules_session");
    let config = base_config(pg(), &[&db], "[pool]\npool_mode = \"session\"\n")
        + &rules(&db, &["statement = \"DROP\"\naction = \"deny\""]);
    let s = Shoal::start(&config);
    let Err(e) = s.try_connect(&s.conninfo("app", APP_PASSWORD, &db)).await else {
        panic!("a session-mode pool with rules let a client in");
    };
    assert_eq!(code(&e), "0A000", "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_and_metrics_count_each_rules_matches() {
    let db = fresh_db("rules_show");
    let extra = "[admin]\nusers = [\"admin\"]\n[users.admin]\npassword = \"admin-secret\"\n\
                 [metrics]\nlisten = \"127.0.0.1:0\"\n";
    let config = base_config(pg(), &[&db], extra)
        + &rules(
            &db,
            &[
                "name = \"no-drop\"\nstatement = \"DROP\"\naction = \"deny\"",
                "name = \"watch\"\nfunction = \"now\"\naction = \"log\"",
            ],
        );
    let s = Shoal::start(&config);
    let c = s.connect(&db).await;
    for _ in 0..3 {
        refused(&c, "DROP TABLE IF EXISTS x", "no-drop").await;
    }
    c.simple_query("SELECT now()").await.unwrap();
    let (cols, rows) = console_rows(&s, "SHOW RULES").await;
    let col = |name: &str| cols.iter().position(|c| c == name).unwrap();
    let row = |rule: &str| {
        rows.iter()
            .find(|r| r[col("rule")] == rule)
            .unwrap_or_else(|| panic!("{rule}: {rows:?}"))
            .clone()
    };
    assert_eq!(row("no-drop")[col("matched")], "3");
    assert_eq!(row("no-drop")[col("matches")], "statement DROP");
    assert_eq!(row("watch")[col("action")], "log");
    assert_eq!(row("watch")[col("matched")], "1");
    let out = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", s.metrics.unwrap())])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.starts_with("shoal_rule_matches_total")
                && l.contains("rule=\"no-drop\"")
                && l.ends_with(" 3")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_rules_are_set_and_changed_through_the_api() {
    let db = fresh_db("rules_tenant");
    let (s, _data) = shoal_with_token_api(pg());
    let tenant = |rules: serde_json::Value| {
        serde_json::json!({"tenant": {
            "db_host": "127.0.0.1",
            "db_port": pg().port,
            "db_database": db,
            "require_user": true,
            "users": [{"db_user": "app", "db_password": APP_PASSWORD, "pool_size": 2}],
            "query_rules": rules,
        }})
    };
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!([{"statement": "DORP", "action": "deny"}])),
    );
    assert_eq!(code_, 422, "{body}");
    assert!(body.to_string().contains("query_rules"), "{body}");
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(
            serde_json::json!([{"name": "no-truncate", "statement": "TRUNCATE", "action": "deny"}]),
        ),
    );
    assert_eq!(code_, 201, "{body}");
    let c = s
        .try_connect(&format!(
            "host=127.0.0.1 port={} user=app.acme password={APP_PASSWORD} dbname=x",
            s.port()
        ))
        .await
        .unwrap();
    c.simple_query("CREATE TABLE IF NOT EXISTS t (a int)")
        .await
        .unwrap();
    refused(&c, "TRUNCATE t", "no-truncate").await;
    // Lifted live: the same client may now.
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!([])),
    );
    assert_eq!(code_, 200, "{body}");
    c.simple_query("TRUNCATE t").await.unwrap();
}
