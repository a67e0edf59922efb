//! Postgres Changes against a real PostgreSQL with `wal_level = logical`: bindings with
//! each filter, row-level security letting one user see a row and not another, column
//! privileges, a write right after `SUBSCRIBED`, values as `to_jsonb` renders them, the
//! capture surviving a killed replication connection and a PostgreSQL restart with every
//! change delivered exactly once and in order, and the slot and publication dropped when
//! the last subscriber leaves.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::changes::*;
use common::phoenix::Phx;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_shows_each_user_only_their_rows() {
    let s = setup(
        "rt_rls",
        "CREATE TABLE notes (id bigint PRIMARY KEY, owner text NOT NULL, body text, secret text);
         ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON notes FOR SELECT TO authenticated
           USING (owner IN (current_setting('request.jwt.claims', true)::json->>'sub', 'everyone'));
         GRANT SELECT (id, owner, body) ON notes TO authenticated;",
    );
    let mut alice = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let mut bob = Phx::connect(s.rt, "acme", &token("bob")).await.unwrap();
    let all = serde_json::json!([{"event": "*", "schema": "public", "table": "notes"}]);
    let ids = subscribe(&mut alice, "realtime:notes", all.clone()).await;
    subscribe(&mut bob, "realtime:notes", all).await;
    run_sql(
        s.pg,
        &s.db,
        "INSERT INTO notes VALUES (1, 'alice', 'for alice', 's1');
         INSERT INTO notes VALUES (2, 'bob', 'for bob', 's2');
         UPDATE notes SET body = 'still alice''s' WHERE id = 1;
         DELETE FROM notes WHERE id = 2;
         INSERT INTO notes VALUES (3, 'everyone', 'the fence', 's3');",
    );
    let mut seen = Vec::new();
    loop {
        let c = change(&mut alice).await;
        assert_eq!(c["ids"], serde_json::json!(ids), "{c}");
        let d = &c["data"];
        let id = d["record"]["id"]
            .as_i64()
            .or(d["old_record"]["id"].as_i64());
        seen.push((d["type"].as_str().unwrap().to_owned(), id.unwrap()));
        // `secret` is not readable by the role: never sent.
        assert!(d["record"].get("secret").is_none(), "{c}");
        assert!(
            !d["columns"].to_string().contains("secret"),
            "{}",
            d["columns"]
        );
        if id == Some(3) {
            break;
        }
    }
    // Deletes carry the old key to every subscriber (no row is left to check), as
    // Supabase's do.
    let want = |v: &[(&str, i64)]| -> Vec<(String, i64)> {
        v.iter().map(|(k, i)| (k.to_string(), *i)).collect()
    };
    assert_eq!(
        seen,
        want(&[("INSERT", 1), ("UPDATE", 1), ("DELETE", 2), ("INSERT", 3)])
    );
    let mut seen = Vec::new();
    loop {
        let d = change(&mut bob).await["data"].clone();
        let id = d["record"]["id"]
            .as_i64()
            .or(d["old_record"]["id"].as_i64())
            .unwrap();
        seen.push((d["type"].as_str().unwrap().to_owned(), id));
        if id == 3 {
            break;
        }
    }
    assert_eq!(
        seen,
        want(&[("INSERT", 2), ("DELETE", 2), ("INSERT", 3)]),
        "bob never sees alice's row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_filter_selects_its_rows() {
    let s = setup(
        "rt_filter",
        "CREATE TABLE items (id int PRIMARY KEY, name text, price numeric, done bool);
         GRANT SELECT ON items TO authenticated;",
    );
    let mut p = Phx::connect(s.rt, "acme", &token("u")).await.unwrap();
    let filters = [
        "id=eq.2",
        "id=neq.2",
        "price=lt.10",
        "price=lte.10",
        "price=gt.10",
        "price=gte.10",
        "name=in.(pear,\"fig, dried\")",
        "done=eq.true",
        "id=not.in.(1,2)",
        // PostgREST's pattern and null operators.
        "name=like.*i*",
        "name=ilike.P%",
        "name=match.^[ak]",
        "name=imatch.^F",
        "done=is.null",
        "price=isdistinct.10",
        "done=not.is.true",
    ];
    let bindings: Vec<serde_json::Value> = filters
        .iter()
        .map(|f| serde_json::json!({"event": "INSERT", "schema": "public", "table": "items", "filter": f}))
        .collect();
    let ids = subscribe(&mut p, "realtime:items", bindings.into()).await;
    run_sql(
        s.pg,
        &s.db,
        "INSERT INTO items VALUES (1, 'apple', 9.5, false), (2, 'pear', 10, true),
           (3, 'fig, dried', 10.25, NULL), (4, 'kiwi', NULL, true);",
    );
    // Which filters each row passes, by position in `filters`.
    let want: [(i64, &[usize]); 4] = [
        (1, &[1, 2, 3, 11, 14, 15]),
        (2, &[0, 3, 5, 6, 7, 10]),
        (3, &[1, 4, 5, 6, 8, 9, 12, 13, 14, 15]),
        (4, &[1, 7, 8, 9, 11, 14]),
    ];
    for (id, passes) in want {
        let c = change(&mut p).await;
        assert_eq!(c["data"]["record"]["id"], id, "{c}");
        let mut got: Vec<u64> = serde_json::from_value(c["ids"].clone()).unwrap();
        got.sort_unstable();
        let mut expected: Vec<u64> = passes.iter().map(|&i| ids[i]).collect();
        expected.sort_unstable();
        assert_eq!(got, expected, "row {id}: {c}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_sends_only_the_columns_named_and_the_primary_key() {
    let s = setup(
        "rt_select",
        "CREATE TABLE docs (id int PRIMARY KEY, title text, body text);
         ALTER TABLE docs REPLICA IDENTITY FULL;
         GRANT SELECT ON docs TO authenticated;",
    );
    let mut p = Phx::connect(s.rt, "acme", &token("u")).await.unwrap();
    let binding =
        serde_json::json!({"event": "*", "schema": "public", "table": "docs", "select": ["title"]});
    subscribe(&mut p, "realtime:docs", serde_json::json!([binding])).await;
    run_sql(
        s.pg,
        &s.db,
        "INSERT INTO docs VALUES (1, 'draft', 'a long body');
         UPDATE docs SET title = 'final' WHERE id = 1;",
    );
    let insert = change(&mut p).await;
    assert_eq!(
        insert["data"]["record"],
        serde_json::json!({"id": 1, "title": "draft"}),
        "{insert}"
    );
    let names: Vec<&str> = insert["data"]["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["id", "title"]);
    let update = change(&mut p).await;
    assert_eq!(
        update["data"]["record"],
        serde_json::json!({"id": 1, "title": "final"})
    );
    // The old row of a REPLICA IDENTITY FULL table, selected as well.
    assert_eq!(
        update["data"]["old_record"],
        serde_json::json!({"id": 1, "title": "draft"})
    );
}

/// Slots of this test binary's captures of `db`.
fn slots(pg: &Pg, db: &str) -> usize {
    pg.psql_admin(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'shoal_realtime_%' AND database = '{db}'"
    ))
    .parse()
    .unwrap()
}

fn publications(pg: &Pg, db: &str) -> usize {
    run_sql(
        pg,
        db,
        "SELECT count(*) FROM pg_publication WHERE pubname LIKE 'shoal_realtime_%'",
    )
    .parse()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_and_publication_go_with_the_last_subscriber() {
    let s = setup(
        "rt_cleanup",
        "CREATE TABLE t (id int PRIMARY KEY); GRANT SELECT ON t TO authenticated;",
    );
    assert_eq!(slots(s.pg, &s.db), 0);
    let binding = serde_json::json!([{"event": "*", "schema": "public", "table": "t"}]);
    let mut a = Phx::connect(s.rt, "acme", &token("a")).await.unwrap();
    let mut b = Phx::connect(s.rt, "acme", &token("b")).await.unwrap();
    subscribe(&mut a, "realtime:t", binding.clone()).await;
    subscribe(&mut b, "realtime:t", binding).await;
    assert_eq!(
        slots(s.pg, &s.db),
        1,
        "one slot for the tenant's subscribers"
    );
    assert_eq!(publications(s.pg, &s.db), 1);
    // One leaves: the capture stays for the other.
    let r = a
        .push("realtime:t", "phx_leave", serde_json::json!({}))
        .await;
    assert_eq!(a.reply(&r).await["status"], "ok");
    run_sql(s.pg, &s.db, "INSERT INTO t VALUES (1)");
    assert_eq!(change(&mut b).await["data"]["record"]["id"], 1);
    assert_eq!(slots(s.pg, &s.db), 1);
    // The last one's socket closes: nothing is kept for nobody.
    drop(b);
    eventually("the slot is dropped", Duration::from_secs(15), || {
        slots(s.pg, &s.db) == 0
    })
    .await;
    eventually(
        "the publication is dropped",
        Duration::from_secs(15),
        || publications(s.pg, &s.db) == 0,
    )
    .await;
    // A tenant deleted while subscribed: its sockets end, and its slot goes with them.
    let mut c = Phx::connect(s.rt, "acme", &token("c")).await.unwrap();
    subscribe(
        &mut c,
        "realtime:t",
        serde_json::json!([{"event": "*", "schema": "public", "table": "t"}]),
    )
    .await;
    assert_eq!(slots(s.pg, &s.db), 1);
    let (status, body) = api(
        &s.shoal,
        "DELETE",
        "/api/tenants/acme",
        &serde_json::Value::Null,
    );
    assert!(status == 200 || status == 204, "{status} {body}");
    eventually(
        "the deleted tenant's slot is dropped",
        Duration::from_secs(15),
        || slots(s.pg, &s.db) == 0,
    )
    .await;
}

/// Every slot in `db`, whoever made it.
fn all_slots(pg: &Pg, db: &str) -> usize {
    pg.psql_admin(&format!(
        "SELECT count(*) FROM pg_replication_slots WHERE database = '{db}'"
    ))
    .parse()
    .unwrap()
}

/// Reads `sql` through `c` until a run is answered from the cache; its rows.
async fn until_cached(s: &Setup, c: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    let hits = || metric(&s.shoal, "shoal_cache_hits") + metric(&s.shoal, "shoal_cache_hits_total");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let before = hits();
        let rows = simple_rows(c, sql).await;
        if hits() > before {
            return rows;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never answered from the cache: {sql}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads `sql` through `c` until it returns `want` (a write straight to PostgreSQL
/// reaches the cache through the change stream).
async fn until_read(c: &tokio_postgres::Client, sql: &str, want: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let rows = simple_rows(c, sql).await;
        if rows == [want] {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{sql} returned {rows:?}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A database's changes reach the result cache and Postgres Changes through one slot: the
/// cache's stream comes first, a subscriber's capture takes it over, and both go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_and_postgres_changes_share_one_slot() {
    let s = setup_tenant(
        logical_pg(),
        "rt_one_slot",
        "CREATE TABLE items (id int PRIMARY KEY, n int); INSERT INTO items VALUES (1, 1);
         GRANT SELECT ON items TO authenticated;",
        serde_json::json!({"cache": true, "cache_all_reads": true}),
    );
    let c = s.shoal.connect_as("app.acme", APP_PASSWORD, &s.db).await;
    let read = "SELECT n FROM items WHERE id = 1";
    assert_eq!(until_cached(&s, &c, read).await, ["1"]);
    assert_eq!(all_slots(s.pg, &s.db), 1, "the cache's stream");
    assert_eq!(slots(s.pg, &s.db), 0, "no tenant's capture yet");
    run_sql(s.pg, &s.db, "UPDATE items SET n = 2 WHERE id = 1");
    until_read(&c, read, "2").await;

    let mut p = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let binding = serde_json::json!([{"event": "*", "schema": "public", "table": "items"}]);
    subscribe(&mut p, "realtime:items", binding).await;
    assert_eq!(all_slots(s.pg, &s.db), 1, "one slot for both");
    assert_eq!(slots(s.pg, &s.db), 1, "the tenant's capture took it over");
    run_sql(s.pg, &s.db, "UPDATE items SET n = 3 WHERE id = 1");
    assert_eq!(change(&mut p).await["data"]["record"]["n"], 3);
    until_read(&c, read, "3").await;
    assert_eq!(until_cached(&s, &c, read).await, ["3"]);
    run_sql(s.pg, &s.db, "UPDATE items SET n = 4 WHERE id = 1");
    assert_eq!(change(&mut p).await["data"]["record"]["n"], 4);
    until_read(&c, read, "4").await;
    assert_eq!(all_slots(s.pg, &s.db), 1);

    // The subscriber leaves: the slot stays for the cache, which still follows changes.
    drop(p);
    run_sql(s.pg, &s.db, "UPDATE items SET n = 5 WHERE id = 1");
    until_read(&c, read, "5").await;
    assert_eq!(until_cached(&s, &c, read).await, ["5"]);
    assert_eq!(all_slots(s.pg, &s.db), 1);
}

/// The other order: a subscriber's capture runs first, and the cache joins its stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_joins_a_subscribers_stream() {
    let s = setup_tenant(
        logical_pg(),
        "rt_joins_slot",
        "CREATE TABLE items (id int PRIMARY KEY, n int); INSERT INTO items VALUES (1, 1);
         GRANT SELECT ON items TO authenticated;",
        serde_json::json!({"cache": true, "cache_all_reads": true}),
    );
    let mut p = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let binding = serde_json::json!([{"event": "*", "schema": "public", "table": "items"}]);
    subscribe(&mut p, "realtime:items", binding).await;
    let c = s.shoal.connect_as("app.acme", APP_PASSWORD, &s.db).await;
    let read = "SELECT n FROM items WHERE id = 1";
    assert_eq!(until_cached(&s, &c, read).await, ["1"]);
    run_sql(s.pg, &s.db, "UPDATE items SET n = 2 WHERE id = 1");
    assert_eq!(change(&mut p).await["data"]["record"]["n"], 2);
    until_read(&c, read, "2").await;
    assert_eq!((all_slots(s.pg, &s.db), slots(s.pg, &s.db)), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_are_rendered_as_to_jsonb_renders_them() {
    let big =
        "(SELECT string_agg(md5(i::text || random()::text), '') FROM generate_series(1, 400) i)";
    let s = setup(
        "rt_types",
        &format!(
            "CREATE TYPE mood AS ENUM ('sad', 'happy');
             CREATE TABLE kinds (id int PRIMARY KEY, n numeric, f float8, j json, jb jsonb,
               arr int[], tarr text[], ts timestamptz, t timestamp, d date, b bytea, u uuid,
               m mood, nothing text, flag bool, iv interval, big text);
             ALTER TABLE kinds REPLICA IDENTITY FULL;
             CREATE TABLE keyed (id int PRIMARY KEY, flag bool, big text);
             INSERT INTO keyed VALUES (1, true, {big});
             GRANT SELECT ON kinds, keyed TO authenticated;"
        ),
    );
    let mut p = Phx::connect(s.rt, "acme", &token("u")).await.unwrap();
    subscribe(
        &mut p,
        "realtime:kinds",
        serde_json::json!([
            {"event": "*", "schema": "public", "table": "kinds"},
            {"event": "UPDATE", "schema": "public", "table": "keyed"}
        ]),
    )
    .await;
    run_sql(
        s.pg,
        &s.db,
        &format!(
            "INSERT INTO kinds VALUES (1, 12345678901234567890.123, 1.5e300, '{{\"a\": [1, 2.50]}}',
               '{{\"b\": {{\"c\": null}}}}', '{{1,NULL,3}}', '{{\"x,y\",z}}',
               '2024-03-01 12:34:56.789+02', '2024-03-01 12:34:56', '2024-03-01',
               '\\x00ff10', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'happy', NULL, true,
               '1 day 02:03:04', {big});
             UPDATE kinds SET flag = false WHERE id = 1;
             UPDATE keyed SET flag = false WHERE id = 1;"
        ),
    );
    let expected = |table: &str| -> serde_json::Value {
        let sql = format!("SET TimeZone = 'UTC'; SELECT to_jsonb(k) FROM {table} k WHERE id = 1");
        serde_json::from_str(run_sql(s.pg, &s.db, &sql).lines().last().unwrap()).unwrap()
    };
    let insert = change(&mut p).await["data"].clone();
    assert_eq!(insert["type"], "INSERT");
    let mut inserted = expected("kinds");
    inserted["flag"] = true.into();
    assert_eq!(
        insert["record"], inserted,
        "every type as to_jsonb writes it"
    );
    let types: Vec<&str> = insert["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "int4",
            "numeric",
            "float8",
            "json",
            "jsonb",
            "_int4",
            "_text",
            "timestamptz",
            "timestamp",
            "date",
            "bytea",
            "uuid",
            "mood",
            "text",
            "bool",
            "interval",
            "text"
        ]
    );
    let ts = insert["commit_timestamp"].as_str().unwrap();
    assert!(ts.ends_with('Z') && ts.len() == 24, "{ts}");
    // The unchanged TOASTed value comes from the old row (REPLICA IDENTITY FULL).
    let update = change(&mut p).await["data"].clone();
    assert_eq!(update["type"], "UPDATE");
    assert_eq!(update["record"], expected("kinds"));
    assert_eq!(update["old_record"], inserted);
    // Without the old row, it is left out, and the old record is the key.
    let keyed = change(&mut p).await["data"].clone();
    assert_eq!(keyed["table"], "keyed");
    assert_eq!(keyed["record"], serde_json::json!({"id": 1, "flag": false}));
    assert_eq!(keyed["old_record"], serde_json::json!({}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_stream_and_a_restarted_postgres_lose_and_repeat_nothing() {
    // Its own cluster: it is restarted.
    let pg: &'static Pg = Box::leak(Box::new(Pg::start_with(
        free_port(),
        &[],
        "-c wal_level=logical -c max_replication_slots=10 -c max_wal_senders=10",
    )));
    pg.psql_admin("CREATE ROLE authenticated NOLOGIN");
    let s = setup_on(
        pg,
        "rt_faults",
        "CREATE TABLE ledger (id int PRIMARY KEY); GRANT SELECT ON ledger TO authenticated;",
    );
    let mut p = Phx::connect(s.rt, "acme", &token("u")).await.unwrap();
    subscribe(
        &mut p,
        "realtime:ledger",
        serde_json::json!([{"event": "INSERT", "schema": "public", "table": "ledger"}]),
    )
    .await;
    const N: i32 = 300;
    let db = s.db.clone();
    let writer = tokio::spawn(async move {
        let mut client: Option<tokio_postgres::Client> = None;
        let mut id = 1;
        while id <= N {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                match tokio_postgres::connect(
                    &format!(
                        "host=127.0.0.1 port={} user=app password={APP_PASSWORD} dbname={db}",
                        pg.port
                    ),
                    tokio_postgres::NoTls,
                )
                .await
                {
                    Ok((c, conn)) => {
                        tokio::spawn(conn);
                        client = Some(c);
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                }
            }
            let c = client.as_ref().unwrap();
            // An insert whose outcome is unknown is tried again: the key keeps it once.
            match c
                .execute(
                    "INSERT INTO ledger VALUES ($1) ON CONFLICT DO NOTHING",
                    &[&id],
                )
                .await
            {
                Ok(_) => id += 1,
                Err(_) => client = None,
            }
            if id == 100 {
                let active = "SELECT coalesce(max(active_pid), 0) FROM pg_replication_slots \
                              WHERE slot_name LIKE 'shoal_realtime_%'";
                let before = tokio::task::block_in_place(|| pg.psql_admin(active));
                assert_ne!(before, "0", "the capture streams");
                tokio::task::block_in_place(|| {
                    pg.psql_admin(&format!("SELECT pg_terminate_backend({before})"))
                });
                // Writes went on while the stream was down; the next fault waits for it.
                let back = || {
                    let now = pg.psql_admin(active);
                    now != "0" && now != before
                };
                eventually("the stream is back", Duration::from_secs(20), back).await;
            }
            if id == 200 {
                tokio::task::block_in_place(|| {
                    pg.stop();
                    pg.pg_ctl_start();
                });
                client = None;
            }
        }
    });
    let mut got = Vec::new();
    while got.last() != Some(&N) {
        let c = change(&mut p).await;
        got.push(c["data"]["record"]["id"].as_i64().unwrap() as i32);
    }
    writer.await.unwrap();
    let want: Vec<i32> = (1..=N).collect();
    assert_eq!(got, want, "every committed row once, in commit order");
    let failures = s
        .shoal
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("change stream failed"))
        .count();
    assert!(
        failures >= 2,
        "the stream was cut twice, and resumed: {failures}"
    );
}

const CLIENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/realtime/");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_js_gets_writes_made_right_after_subscribed() {
    use tokio::io::AsyncBufReadExt;
    let s = setup(
        "rt_js",
        "CREATE TABLE notes (id int PRIMARY KEY, body text); GRANT SELECT ON notes TO authenticated;",
    );
    let db = direct_on(s.pg, &s.db).await;
    for (round, vsn) in ["2.0.0", "1.0.0"].into_iter().enumerate() {
        let mut child = tokio::process::Command::new("node")
            .arg(format!("{CLIENTS}changes.mjs"))
            .env("RT_URL", format!("ws://{}/t/acme/realtime/v1", s.rt))
            .env("RT_TOKEN", token("js"))
            .env("RT_VSN", vsn)
            .env("RT_EXPECT", "4")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("node runs");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next_line().await.unwrap().expect("a first line");
        assert_eq!(first, r#"{"subscribed":true}"#);
        // Written the moment the client says SUBSCRIBED: all of it must arrive.
        let base = round as i32 * 10;
        db.batch_execute(&format!(
            "INSERT INTO notes VALUES ({a}, 'one'); INSERT INTO notes VALUES ({b}, 'two');
             UPDATE notes SET body = 'uno' WHERE id = {a}; DELETE FROM notes WHERE id = {b};",
            a = base + 1,
            b = base + 2
        ))
        .await
        .unwrap();
        let last = lines.next_line().await.unwrap().expect("the changes");
        let r: serde_json::Value = serde_json::from_str(&last).unwrap();
        let all = r["all"].as_array().unwrap();
        let kinds: Vec<&str> = all
            .iter()
            .map(|c| c["eventType"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            ["INSERT", "INSERT", "UPDATE", "DELETE"],
            "{vsn}: {r}"
        );
        assert_eq!(all[0]["schema"], "public");
        assert_eq!(all[0]["table"], "notes");
        assert_eq!(
            all[0]["new"],
            serde_json::json!({"id": base + 1, "body": "one"})
        );
        assert_eq!(all[2]["new"]["body"], "uno");
        assert_eq!(all[3]["old"], serde_json::json!({"id": base + 2}));
        assert!(all[0]["commit_timestamp"].as_str().unwrap().ends_with('Z'));
        assert!(all[0]["errors"].is_null(), "{r}");
        // The filtered binding gets only the insert of id 2 (of the first round).
        if round == 0 {
            assert_eq!(r["filtered"].as_array().unwrap().len(), 1, "{vsn}: {r}");
            assert_eq!(r["filtered"][0]["new"]["id"], 2);
        }
        child.wait().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_sharing_a_token_share_one_check_per_batch() {
    let s = setup(
        "rt_batch",
        "CREATE TABLE feed (id int PRIMARY KEY, team text);
         ALTER TABLE feed ENABLE ROW LEVEL SECURITY;
         CREATE POLICY team ON feed FOR SELECT TO authenticated
           USING (team = current_setting('request.jwt.claims', true)::json->>'sub');
         GRANT SELECT ON feed TO authenticated;",
    );
    let binding = serde_json::json!([{"event": "INSERT", "schema": "public", "table": "feed"}]);
    let mut subs = Vec::new();
    let red = token("red");
    for _ in 0..20 {
        let mut p = Phx::connect(s.rt, "acme", &red).await.unwrap();
        subscribe(&mut p, "realtime:feed", binding.clone()).await;
        subs.push(p);
    }
    let before = metric(
        &s.shoal,
        "shoal_realtime_postgres_changes_authorizations_total",
    );
    // 100 rows in one transaction: one batch, half of them the subscribers' team's.
    run_sql(
        s.pg,
        &s.db,
        "INSERT INTO feed SELECT i, CASE WHEN i % 2 = 0 THEN 'red' ELSE 'blue' END
           FROM generate_series(1, 100) i",
    );
    for p in &mut subs {
        let mut ids = Vec::new();
        while ids.len() < 50 {
            ids.push(change(p).await["data"]["record"]["id"].as_i64().unwrap());
        }
        assert_eq!(ids, (1..=50).map(|i| i * 2).collect::<Vec<_>>());
    }
    let queries = metric(
        &s.shoal,
        "shoal_realtime_postgres_changes_authorizations_total",
    ) - before;
    // The policies read once, and one evaluation of the batch, for all twenty.
    assert!(
        (1.0..=2.0).contains(&queries),
        "{queries} authorization queries for 20 subscribers and 100 rows"
    );
}

/// A client that drops for a moment and comes back (realtime-js with `params.resume`,
/// through a relay that is cut, as a restarted proxy cuts it, or frozen, as a network that
/// drops everything would be: then Shoal hears nothing and the new connection takes the
/// session from the old one) misses no broadcast and no change sent meanwhile, and the
/// others see no presence leave. The same cut without `resume` loses messages and shows
/// the leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_comes_back_with_resume_misses_nothing() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let s = setup(
        "rt_resume",
        "CREATE TABLE notes (id int PRIMARY KEY, body text); GRANT SELECT ON notes TO authenticated;",
    );
    let db = direct_on(s.pg, &s.db).await;
    for (round, (resume, cut)) in [(true, "cut"), (true, "freeze"), (false, "cut")]
        .into_iter()
        .enumerate()
    {
        let mut child = tokio::process::Command::new("node")
            .arg(format!("{CLIENTS}resume.mjs"))
            .env("RT_URL", format!("ws://{}/t/acme/realtime/v1", s.rt))
            .env("RT_TOKEN", token("js"))
            .env("RT_ROWS", "10")
            .env("RT_RESUME", if resume { "1" } else { "0" })
            .env("RT_CUT", cut)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("node runs");
        let mut stdin = child.stdin.take().unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut next = async || lines.next_line().await.unwrap().expect("a line");
        assert_eq!(next().await, r#"{"subscribed":true}"#);
        let base = round as i32 * 100;
        let insert = |from: i32, to: i32| {
            format!(
                "INSERT INTO notes SELECT i, 'x' FROM generate_series({}, {}) i",
                base + from,
                base + to
            )
        };
        db.batch_execute(&insert(1, 5)).await.unwrap();
        stdin.write_all(b"go\n").await.unwrap();
        assert_eq!(next().await, r#"{"cut":true}"#);
        // Written while the client is away.
        db.batch_execute(&insert(6, 10)).await.unwrap();
        stdin.write_all(b"go\n").await.unwrap();
        let r: serde_json::Value = serde_json::from_str(&next().await).unwrap();
        eprintln!("resume = {resume}, {cut}: {r}");
        let ids: Vec<i64> = r["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_i64().unwrap())
            .collect();
        if resume {
            assert_eq!(r["missing"], 0, "every broadcast arrives: {r}");
            assert_eq!(
                ids,
                (1..=10).map(|i| i64::from(base) + i).collect::<Vec<_>>(),
                "{r}"
            );
            assert_eq!(r["leaves"], 0, "nobody saw the client leave: {r}");
            assert_eq!(r["rejoined"], "joined", "{r}");
        } else {
            assert!(
                r["missing"].as_i64().unwrap() > 0 || ids.len() < 10,
                "without resume, the cut loses something: {r}"
            );
            assert!(r["leaves"].as_i64().unwrap() >= 1, "{r}");
        }
        child.wait().await.unwrap();
    }
}
