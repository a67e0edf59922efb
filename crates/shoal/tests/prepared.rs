//! Named prepared statements in transaction mode, across server switches.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;
use futures_util::future::join_all;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_survive_server_switches_with_many_clients() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 3\n");
    let setup = shoal.connect(&db).await;
    setup
        .batch_execute("CREATE TABLE kv (k int primary key, v text)")
        .await
        .unwrap();
    let clients = join_all((0..30).map(|_| shoal.connect(&db))).await;
    let work = clients.iter().enumerate().map(|(i, c)| async move {
        // tokio-postgres prepares named statements and reuses them in later transactions.
        let ins = c.prepare("INSERT INTO kv VALUES ($1, $2)").await.unwrap();
        let sel = c.prepare("SELECT v FROM kv WHERE k = $1").await.unwrap();
        for j in 0..20i32 {
            let k = i as i32 * 1000 + j;
            c.execute(&ins, &[&k, &format!("v{k}")]).await.unwrap();
            let row = c.query_one(&sel, &[&k]).await.unwrap();
            assert_eq!(row.get::<_, String>(0), format!("v{k}"));
        }
    });
    join_all(work).await;
    let n: i64 = setup
        .query_one("SELECT count(*) FROM kv", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_parse_bind_close_and_errors_look_like_postgres() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\nmax_prepared_statements = 2\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    // Both clients prepare the same text under their own names.
    for (r, name) in [(&mut a, "mine"), (&mut b, "yours")] {
        let mut m = BytesMut::new();
        raw::parse(&mut m, name, "SELECT $1::int * 10");
        raw::sync(&mut m);
        r.send(&m).await;
        let tags: String = r.until_ready().await.iter().map(|m| m.tag).collect();
        assert_eq!(tags, "1Z");
    }
    // Hold one server with a transaction so the other client runs elsewhere, many times.
    a.simple("BEGIN").await.unwrap();
    for i in 0..5 {
        let mut m = BytesMut::new();
        raw::bind(&mut m, "", "yours", &[&i.to_string()]);
        raw::execute(&mut m, "");
        raw::sync(&mut m);
        b.send(&m).await;
        let msgs = b.until_ready().await;
        let tags: String = msgs.iter().map(|m| m.tag).collect();
        assert_eq!(tags, "2DCZ", "no stray ParseComplete");
        assert_eq!(raw::first_column(&msgs[1]), (i * 10).to_string());
    }
    a.simple("COMMIT").await.unwrap();
    // Close answers at once with Flush, and the name is gone for this client only.
    let mut m = BytesMut::new();
    raw::close_statement(&mut m, "yours");
    raw::flush(&mut m);
    b.send(&m).await;
    assert_eq!(b.recv().await.unwrap().tag, '3');
    let mut m = BytesMut::new();
    raw::bind(&mut m, "", "mine", &["7"]);
    raw::execute(&mut m, "");
    raw::sync(&mut m);
    a.send(&m).await;
    let msgs = a.until_ready().await;
    assert_eq!(raw::first_column(&msgs[1]), "70");
    // An error in a batch skips to Sync, like PostgreSQL: no reply for later messages.
    let mut m = BytesMut::new();
    raw::parse(&mut m, "broken", "SELEC 1");
    raw::bind(&mut m, "", "mine", &["1"]);
    raw::close_statement(&mut m, "mine");
    raw::sync(&mut m);
    a.send(&m).await;
    let tags: String = a.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "EZ");
    // "mine" was not closed (the Close was skipped) and still works; many statements on a
    // server limited to 2 are evicted and re-prepared transparently.
    for i in 0..6 {
        let mut m = BytesMut::new();
        raw::parse(&mut m, &format!("s{i}"), &format!("SELECT {i} + $1::int"));
        raw::bind(&mut m, "", &format!("s{i}"), &["1"]);
        raw::execute(&mut m, "");
        raw::bind(&mut m, "", "mine", &["2"]);
        raw::execute(&mut m, "");
        raw::sync(&mut m);
        a.send(&m).await;
        let msgs = a.until_ready().await;
        let tags: String = msgs.iter().map(|m| m.tag).collect();
        assert_eq!(tags, "12DC2DCZ");
        assert_eq!(raw::first_column(&msgs[2]), (i + 1).to_string());
        assert_eq!(raw::first_column(&msgs[5]), "20");
    }
    // A statement the client never prepared: PostgreSQL's own error.
    let mut m = BytesMut::new();
    raw::bind(&mut m, "", "nope", &[]);
    raw::sync(&mut m);
    a.send(&m).await;
    let msgs = a.until_ready().await;
    assert_eq!(msgs[0].code(), "26000");
}

#[test]
fn pgbench_prepared_50_clients_pool_of_5() {
    let db = unique_db("prep");
    pg().create_database(&db);
    let shoal = Shoal::start(&base_config(pg(), &[&db], "[pool]\npool_size = 5\n"));
    let run = |args: &[&str]| {
        let out = std::process::Command::new(pg().bin("pgbench"))
            .env("PGPASSWORD", APP_PASSWORD)
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "app",
                "-p",
                &shoal.port().to_string(),
            ])
            .args(args)
            .arg(&db)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        text
    };
    run(&["-i", "-q", "-s", "1"]);
    let report = run(&["-M", "prepared", "-c", "50", "-j", "2", "-T", "10"]);
    assert!(
        report.contains("number of failed transactions: 0 "),
        "{report}"
    );
    let processed: u64 = report
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(processed > 0, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_churn_of_one_shot_queries() {
    // tokio-postgres prepares a new named statement for each `query(&str)` and closes it when
    // dropped: Close, Sync, Parse of the same text, Describe, Sync arrive in one flight.
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\n");
    let c = shoal.connect(&db).await;
    for i in 0..50 {
        let v: i32 = c.query_one("SELECT $1::int", &[&i]).await.unwrap().get(0);
        assert_eq!(v, i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_ddl_changed_the_result_type_works() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let admin = shoal.connect(&db).await;
    admin
        .batch_execute("CREATE TABLE t (a int); INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let run = |name: &'static str| {
        let mut m = BytesMut::new();
        raw::bind(&mut m, "", name, &[]);
        raw::execute(&mut m, "");
        raw::sync(&mut m);
        m
    };
    let mut m = BytesMut::new();
    raw::parse(&mut m, "all_of_t", "SELECT * FROM t");
    m.extend_from_slice(&run("all_of_t"));
    r.send(&m).await;
    let tags: String = r.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "12DCZ");
    admin
        .batch_execute("ALTER TABLE t ADD COLUMN b int DEFAULT 7")
        .await
        .unwrap();
    // PostgreSQL's error is passed on, as it would be on a direct connection...
    r.send(&run("all_of_t")).await;
    let msgs = r.until_ready().await;
    assert_eq!(msgs[0].code(), "0A000", "{}", msgs[0].text());
    // ...and the retry runs a freshly prepared statement, without the client re-preparing.
    r.send(&run("all_of_t")).await;
    let msgs = r.until_ready().await;
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "2DCZ");
    let columns = i16::from_be_bytes([msgs[1].body[0], msgs[1].body[1]]);
    assert_eq!(columns, 2);
}

/// A client that prepares a statement after DDL must get it planned on the new schema, as a
/// direct connection would: not `XX000 cache lookup failed for type`, not `0A000`, not the old
/// parameter types, even though another client prepared the same text before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_clients_after_ddl_get_statements_planned_afresh() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let admin = shoal.connect(&db).await;
    admin
        .batch_execute(
            "CREATE TYPE mood AS ENUM ('ok', 'sad');
             CREATE TABLE m (v mood); INSERT INTO m VALUES ('ok');
             CREATE TABLE w (a int); INSERT INTO w VALUES (1);",
        )
        .await
        .unwrap();
    // The parameter's type is the enum itself (fixed when the statement is parsed).
    let by_mood = |value: &str| {
        let mut m = BytesMut::new();
        raw::parse(&mut m, "q", "SELECT v::text FROM m WHERE v = $1");
        raw::bind(&mut m, "", "q", &[value]);
        raw::execute(&mut m, "");
        raw::sync(&mut m);
        m
    };
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r.send(&by_mood("ok")).await;
    let tags: String = r.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "12DCZ");
    let first = shoal.connect(&db).await;
    let s = first.prepare("SELECT * FROM w").await.unwrap();
    assert_eq!(s.columns().len(), 1);
    first.query(&s, &[]).await.unwrap();
    // The type is dropped and made again (a new OID); the table gets a column.
    admin
        .batch_execute(
            "DROP TABLE m; DROP TYPE mood; CREATE TYPE mood AS ENUM ('ok', 'sad', 'glad');
             CREATE TABLE m (v mood); INSERT INTO m VALUES ('glad');
             ALTER TABLE w ADD COLUMN b text DEFAULT 'new'",
        )
        .await
        .unwrap();
    let mut r2 = Raw::login(shoal.addr, "raw", &db, &[]).await;
    r2.send(&by_mood("glad")).await;
    let msgs = r2.until_ready().await;
    let tags: String = msgs.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "12DCZ", "{msgs:?}");
    assert_eq!(raw::first_column(&msgs[2]), "glad");
    let second = shoal.connect(&db).await;
    let s = second.prepare("SELECT * FROM w").await.unwrap();
    assert_eq!(s.columns().len(), 2, "described on the new schema");
    let rows = second.query(&s, &[]).await.unwrap();
    assert_eq!(rows[0].get::<_, String>(1), "new");
}

/// Sends a named Parse and a Sync; returns the tags of the replies.
async fn parse_named(r: &mut Raw, name: &str, sql: &str) -> (String, Vec<raw::Msg>) {
    let mut out = BytesMut::new();
    raw::parse(&mut out, name, sql);
    raw::sync(&mut out);
    r.send(&out).await;
    let msgs = r.until_ready().await;
    (msgs.iter().map(|m| m.tag).collect(), msgs)
}

/// A named Parse PostgreSQL rejects, or skips (after an earlier error in the batch, or inside
/// a failed transaction block), leaves no statement behind: the name can be prepared again,
/// also when the server already holds the same text for another client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_or_skipped_parses_leave_no_name() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut other = Raw::login(shoal.addr, "raw", &db, &[]).await;
    assert_eq!(parse_named(&mut other, "o", "SELECT 2").await.0, "1Z");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let (tags, msgs) = parse_named(&mut r, "bad-stmt", "SELECT $1::nonexistent_type").await;
    assert_eq!(tags, "EZ");
    assert_eq!(msgs[0].code(), "42704");
    assert_eq!(parse_named(&mut r, "bad-stmt", "SELECT 1").await.0, "1Z");
    // Skipped after an error earlier in the batch (one text new, one the server has).
    let mut out = BytesMut::new();
    raw::parse(&mut out, "first", "SELEC nonsense");
    raw::parse(&mut out, "skipped", "SELECT 3");
    raw::parse(&mut out, "skipped2", "SELECT 2");
    raw::sync(&mut out);
    r.send(&out).await;
    let msgs = r.until_ready().await;
    assert_eq!(msgs.iter().map(|m| m.tag).collect::<String>(), "EZ");
    for name in ["first", "skipped", "skipped2"] {
        assert_eq!(
            parse_named(&mut r, name, "SELECT 2").await.0,
            "1Z",
            "{name}"
        );
    }
    // Inside a failed transaction block.
    r.simple("BEGIN").await.unwrap();
    assert!(r.simple("SELECT 1/0").await.is_err());
    for (name, sql) in [("aborted", "SELECT 4"), ("aborted2", "SELECT 2")] {
        let (tags, msgs) = parse_named(&mut r, name, sql).await;
        assert_eq!(tags, "EZ", "{name}");
        assert_eq!(msgs[0].code(), "25P02", "{name}");
    }
    // A statement that ends the block parses.
    let (tags, _) = parse_named(&mut r, "rb", "ROLLBACK").await;
    assert_eq!(tags, "1Z");
    r.simple("ROLLBACK").await.unwrap();
    for name in ["aborted", "aborted2"] {
        assert_eq!(
            parse_named(&mut r, name, "SELECT 2").await.0,
            "1Z",
            "{name}"
        );
    }
}

/// Parse (unless `sql` is `None`), Bind, Execute and Sync of statement `name`: the first
/// column of each row, or the error.
async fn extended(r: &mut Raw, name: &str, sql: Option<&str>) -> Result<Vec<String>, raw::Msg> {
    let mut out = bytes::BytesMut::new();
    if let Some(sql) = sql {
        raw::parse(&mut out, name, sql);
    }
    raw::bind(&mut out, "", name, &[]);
    raw::execute(&mut out, "");
    raw::sync(&mut out);
    r.send(&out).await;
    let msgs = r.until_ready().await;
    if let Some(e) = msgs.iter().find(|m| m.tag == 'E') {
        return Err(e.clone());
    }
    Ok(msgs
        .iter()
        .filter(|m| m.tag == 'D')
        .map(raw::first_column)
        .collect())
}

/// SQL `EXECUTE`, `EXPLAIN EXECUTE` and `DEALLOCATE` of a protocol-level statement, sent
/// through the extended protocol (as asyncpg and tokio-postgres send every query): the
/// client's name is mapped as in a simple query, the statement it names is prepared first on
/// whichever server runs it (here after another client pushed it out of a server that keeps
/// two), and a `DEALLOCATE` forgets the client's name only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_execute_and_deallocate_through_the_extended_protocol() {
    let db = unique_db("prep");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\nmax_prepared_statements = 2\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    // Same user, same pool of one server.
    let mut b = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut out = bytes::BytesMut::new();
    raw::parse(&mut out, "drv", "SELECT $1::int * 2");
    raw::sync(&mut out);
    a.send(&out).await;
    a.until_ready().await;
    // A named statement whose text is the EXECUTE, parsed once and bound again and again.
    assert_eq!(
        extended(&mut a, "ex", Some("EXECUTE drv(21)"))
            .await
            .unwrap(),
        ["42"]
    );
    for round in 0..3 {
        // Another client fills the one server's two statement slots.
        for i in 0..3 {
            let sql = format!("SELECT {i} + {round}");
            let v = extended(&mut b, &format!("b{round}_{i}"), Some(&sql))
                .await
                .unwrap();
            assert_eq!(v, [(i + round).to_string()]);
        }
        assert_eq!(
            extended(&mut a, "ex", None).await.unwrap(),
            ["42"],
            "named, round {round}"
        );
        let unnamed = extended(&mut a, "", Some("execute DRV (21)"))
            .await
            .unwrap();
        assert_eq!(unnamed, ["42"], "unnamed, round {round}");
    }
    let plan = extended(&mut a, "", Some("EXPLAIN (COSTS OFF) EXECUTE drv(1)"))
        .await
        .unwrap();
    assert!(plan.iter().any(|l| l.contains("Result")), "{plan:?}");
    // Another client's name is not this client's.
    let e = extended(&mut b, "", Some("EXECUTE drv(21)"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "26000", "{}", e.text());
    // DEALLOCATE through Parse: the client's name goes, nothing else.
    assert_eq!(
        extended(&mut b, "other", Some("SELECT 4 * 2"))
            .await
            .unwrap(),
        ["8"]
    );
    assert_eq!(
        extended(&mut a, "same", Some("SELECT 4 * 2"))
            .await
            .unwrap(),
        ["8"]
    );
    extended(&mut a, "", Some("DEALLOCATE same")).await.unwrap();
    assert_eq!(
        extended(&mut b, "other", None).await.unwrap(),
        ["8"],
        "the shared copy stays"
    );
    let e = extended(&mut a, "same", None).await.unwrap_err();
    assert_eq!(e.code(), "26000", "{}", e.text());
    assert_eq!(
        extended(&mut a, "", Some("DEALLOCATE drv")).await.unwrap(),
        Vec::<String>::new()
    );
    let e = extended(&mut a, "", Some("EXECUTE drv(21)"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), "26000", "{}", e.text());
    let e = extended(&mut a, "drv", None).await.unwrap_err();
    assert_eq!(e.code(), "26000", "{}", e.text());
    assert_eq!(
        extended(&mut b, "other", None).await.unwrap(),
        ["8"],
        "the server's copy stays"
    );
    // DEALLOCATE ALL through Parse.
    assert_eq!(
        extended(&mut a, "seven", Some("SELECT 7")).await.unwrap(),
        ["7"]
    );
    extended(&mut a, "", Some("DEALLOCATE ALL")).await.unwrap();
    let e = extended(&mut a, "seven", None).await.unwrap_err();
    assert_eq!(e.code(), "26000", "{}", e.text());
    assert_eq!(extended(&mut b, "other", None).await.unwrap(), ["8"]);
}
