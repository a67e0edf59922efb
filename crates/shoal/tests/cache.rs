//! The result cache against a real PostgreSQL with logical replication on: replies served
//! from it are the bytes PostgreSQL sent; every kind of change makes them stale (a write
//! through Shoal, a write straight to PostgreSQL, a trigger's write, a TRUNCATE); clients
//! whose settings differ never share an entry; memory stays under its cap; and readers
//! running beside writers never see a result older than their own last write.
#![allow(clippy::disallowed_methods)]

mod common;

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;

/// A cluster with `wal_level = logical` (the cache follows changes through it).
fn logical_pg() -> &'static Pg {
    static PG: OnceLock<Pg> = OnceLock::new();
    PG.get_or_init(|| {
        Pg::start_with(
            free_port(),
            &[],
            "-c wal_level=logical -c max_replication_slots=40 -c max_wal_senders=40",
        )
    })
}

/// A fresh database with `setup` run in it.
fn fresh_db(prefix: &str, setup: &str) -> String {
    let db = unique_db(prefix);
    let pg = logical_pg();
    pg.create_database(&db);
    let out = std::process::Command::new(pg.bin("psql"))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "app",
            "-d",
            &db,
        ])
        .args(["-v", "ON_ERROR_STOP=1", "-q", "-c", setup])
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    db
}

/// The console user of [`console_rows`].
const ADMIN: &str = "[admin]\nusers = [\"admin\"]\n[users.admin]\npassword = \"admin-secret\"\n";

/// Shoal in front of `db` with the cache keys `keys` in its database section.
fn cached_shoal(db: &str, keys: &str, extra: &str) -> Shoal {
    let extra = format!("{ADMIN}{extra}");
    let config = base_config(logical_pg(), &[db], &extra).replace(
        &format!("[databases.{db}]\n"),
        &format!("[databases.{db}]\n{keys}\n"),
    );
    Shoal::start(&config)
}

async fn direct_to(db: &str) -> tokio_postgres::Client {
    direct_on(logical_pg(), db).await
}

/// The first pool's SHOW CACHE row, by column.
async fn cache_row(s: &Shoal) -> HashMap<String, String> {
    let (cols, rows) = console_rows(s, "SHOW CACHE").await;
    let row = rows.into_iter().next().unwrap_or_default();
    cols.into_iter().zip(row).collect()
}

/// A SHOW CACHE column summed over every pool.
async fn counter(s: &Shoal, name: &str) -> u64 {
    let (cols, rows) = console_rows(s, "SHOW CACHE").await;
    let i = cols
        .iter()
        .position(|c| c == name)
        .expect("a SHOW CACHE column");
    rows.iter().map(|r| r[i].parse::<u64>().unwrap_or(0)).sum()
}

/// Runs `sql` until a run is answered from the cache (the stream must cover its tables
/// first); returns the rows of that run.
async fn until_hit(s: &Shoal, c: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let before = counter(s, "hits").await;
        let rows = simple_rows(c, sql).await;
        if counter(s, "hits").await > before {
            return rows;
        }
        assert!(
            Instant::now() < deadline,
            "never answered from the cache: {sql}; SHOW CACHE: {:?}",
            cache_row(s).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `sql` returns `want` through `c`, and how long that took.
async fn until_rows(c: &tokio_postgres::Client, sql: &str, want: &[&str]) -> Duration {
    let start = Instant::now();
    loop {
        let rows = simple_rows(c, sql).await;
        if rows == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{sql} returned {rows:?}, waiting for {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

const ITEMS: &str = "CREATE TABLE items (id int PRIMARY KEY, name text, n int);
    INSERT INTO items SELECT g, 'item ' || g, g * 10 FROM generate_series(1, 50) g;";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_is_the_reply_postgres_sent_and_reaches_no_server() {
    let db = fresh_db("cache_hit", ITEMS);
    let s = cached_shoal(
        &db,
        "cache = true\ncache_all_reads = true\npool_size = 1",
        "",
    );
    let c = s.connect(&db).await;
    let sql = "SELECT id, name, n FROM items WHERE id < 20 ORDER BY id";
    let rows = until_hit(&s, &c, sql).await;
    // The pool's one server held by another client's open transaction: a hit needs none.
    let holder = s.connect(&db).await;
    holder.simple_query("BEGIN; SELECT 1").await.unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(2), simple_rows(&c, sql))
        .await
        .expect("a hit waits for no server");
    assert_eq!(answered, rows);
    holder.simple_query("COMMIT").await.unwrap();

    // The simple protocol: a miss (PostgreSQL's bytes, relayed) against a hit.
    let other = "SELECT count(*), sum(n) FROM items";
    let mut r = Raw::login(s.addr, "raw", &db, &[]).await;
    let ask = |sql: &str| {
        let mut b = BytesMut::new();
        raw::query(&mut b, sql);
        b
    };
    let mut replies = Vec::new();
    for _ in 0..2 {
        r.send(&ask(other)).await;
        replies.push(r.until_ready().await);
    }
    assert_eq!(replies[0], replies[1]);
    let hits = counter(&s, "hits").await;
    r.send(&ask(other)).await;
    assert_eq!(r.until_ready().await, replies[0]);
    assert_eq!(counter(&s, "hits").await, hits + 1);

    // An unnamed statement answered from the cache is still the client's unnamed
    // statement: a Bind of it alone (no Parse) runs that text.
    let unnamed = |parse: Option<&str>, id: &str| {
        let mut b = BytesMut::new();
        if let Some(sql) = parse {
            raw::parse(&mut b, "", sql);
        }
        raw::bind(&mut b, "", "", &[id]);
        raw::execute(&mut b, "");
        raw::sync(&mut b);
        b
    };
    let name = Some("SELECT name FROM items WHERE id = $1::int");
    r.send(&unnamed(name, "3")).await;
    let first = r.until_ready().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let hits = counter(&s, "hits").await;
        r.send(&unnamed(name, "3")).await;
        assert_eq!(r.until_ready().await, first);
        if counter(&s, "hits").await > hits {
            break;
        }
        assert!(Instant::now() < deadline, "never a hit");
    }
    // Another text through a server, then the first again from the cache: the unnamed
    // statement is the first text.
    r.send(&unnamed(
        Some("SELECT n FROM items WHERE id = $1::int"),
        "3",
    ))
    .await;
    r.until_ready().await;
    let hits = counter(&s, "hits").await;
    r.send(&unnamed(name, "3")).await;
    assert_eq!(r.until_ready().await, first);
    assert_eq!(counter(&s, "hits").await, hits + 1);
    r.send(&unnamed(None, "4")).await;
    let rows: Vec<String> = r
        .until_ready()
        .await
        .iter()
        .filter(|m| m.tag == 'D')
        .map(raw::first_column)
        .collect();
    assert_eq!(rows, ["item 4"]);

    // The extended protocol with parameters, text and binary results (tokio-postgres asks
    // for binary), and no server used: every server of the pool is busy elsewhere.
    let stmt = c
        .prepare("SELECT id, name FROM items WHERE n > $1 ORDER BY id")
        .await
        .unwrap();
    let first: Vec<(i32, String)> = c
        .query(&stmt, &[&400i32])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let hits = counter(&s, "hits").await;
    let again: Vec<(i32, String)> = c
        .query(&stmt, &[&400i32])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(first, again);
    assert_eq!(first.len(), 10);
    assert!(counter(&s, "hits").await > hits, "the repeat was a hit");
    let other_value: i64 = c.query(&stmt, &[&490i32]).await.unwrap().len() as i64;
    assert_eq!(other_value, 1, "another parameter value is another entry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_shoal_and_straight_to_postgres_make_entries_stale() {
    let db = fresh_db(
        "cache_writes",
        &format!(
            "{ITEMS}
            CREATE TABLE totals (k text PRIMARY KEY, v int);
            INSERT INTO totals VALUES ('items', 50);
            CREATE FUNCTION count_items() RETURNS trigger LANGUAGE plpgsql AS
              $$ BEGIN UPDATE totals SET v = v + 1 WHERE k = 'items'; RETURN NEW; END $$;
            CREATE TABLE arrivals (id int);
            CREATE TRIGGER counted AFTER INSERT ON arrivals FOR EACH ROW EXECUTE FUNCTION count_items();"
        ),
    );
    let s = cached_shoal(&db, "cache = true\ncache_all_reads = true", "");
    let reader = s.connect(&db).await;
    let writer = s.connect(&db).await;
    let outside = direct_to(&db).await;
    let name = "SELECT name FROM items WHERE id = 1";
    let total = "SELECT v FROM totals WHERE k = 'items'";
    until_hit(&s, &reader, name).await;
    until_hit(&s, &reader, total).await;

    // Through Shoal: the writer reads its own write at once, and so does everyone else.
    writer
        .simple_query("UPDATE items SET name = 'renamed' WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(simple_rows(&writer, name).await, ["renamed"]);
    assert_eq!(simple_rows(&reader, name).await, ["renamed"]);
    // Inside a transaction block: stale once the commit is acknowledged.
    writer.simple_query("BEGIN").await.unwrap();
    writer
        .simple_query("UPDATE items SET name = 'in a block' WHERE id = 1")
        .await
        .unwrap();
    writer.simple_query("COMMIT").await.unwrap();
    assert_eq!(simple_rows(&reader, name).await, ["in a block"]);

    // Straight to PostgreSQL: seen through the change stream.
    until_hit(&s, &reader, name).await;
    outside
        .simple_query("UPDATE items SET name = 'outside' WHERE id = 1")
        .await
        .unwrap();
    until_rows(&reader, name, &["outside"]).await;

    // A trigger's write, through Shoal and from outside.
    until_hit(&s, &reader, total).await;
    writer
        .simple_query("INSERT INTO arrivals VALUES (1)")
        .await
        .unwrap();
    assert_eq!(simple_rows(&reader, total).await, ["51"]);
    until_hit(&s, &reader, total).await;
    outside
        .simple_query("INSERT INTO arrivals VALUES (2)")
        .await
        .unwrap();
    until_rows(&reader, total, &["52"]).await;

    // TRUNCATE, from outside.
    let count = "SELECT count(*) FROM items";
    until_hit(&s, &reader, count).await;
    outside.simple_query("TRUNCATE items").await.unwrap();
    until_rows(&reader, count, &["0"]).await;
    let row = cache_row(&s).await;
    assert!(
        row["invalidated_by_writes"].parse::<u64>().unwrap() > 0,
        "{row:?}"
    );
    assert!(
        row["invalidated_by_stream"].parse::<u64>().unwrap() > 0,
        "{row:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_with_other_settings_or_roles_never_share_an_entry() {
    let db = fresh_db(
        "cache_keys",
        "CREATE SCHEMA a; CREATE SCHEMA b;
         CREATE TABLE a.t (v text); INSERT INTO a.t VALUES ('from a');
         CREATE TABLE b.t (v text); INSERT INTO b.t VALUES ('from b');
         CREATE ROLE alice; CREATE ROLE bob;
         CREATE TABLE notes (owner name, body text);
         INSERT INTO notes VALUES ('alice', 'alice''s note'), ('bob', 'bob''s note');
         ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON notes USING (owner = current_user);
         GRANT SELECT ON notes TO alice, bob;",
    );
    let s = cached_shoal(&db, "cache = true\ncache_all_reads = true", "");
    let one = s.connect(&db).await;
    let two = s.connect(&db).await;
    one.simple_query("SET search_path = a").await.unwrap();
    two.simple_query("SET search_path = b").await.unwrap();
    let sql = "SELECT v FROM t";
    assert_eq!(until_hit(&s, &one, sql).await, ["from a"]);
    assert_eq!(simple_rows(&two, sql).await, ["from b"]);
    assert_eq!(until_hit(&s, &two, sql).await, ["from b"]);
    assert_eq!(simple_rows(&one, sql).await, ["from a"]);

    one.simple_query("SET ROLE alice").await.unwrap();
    two.simple_query("SET ROLE bob").await.unwrap();
    let sql = "SELECT body FROM public.notes";
    assert_eq!(until_hit(&s, &one, sql).await, ["alice's note"]);
    assert_eq!(simple_rows(&two, sql).await, ["bob's note"]);
    assert_eq!(until_hit(&s, &two, sql).await, ["bob's note"]);
    assert_eq!(simple_rows(&one, sql).await, ["alice's note"]);
}

/// Supabase's row security reads the caller's claims from a setting: such a table is never
/// kept, so one user is never served another's rows (a policy on the role alone is kept,
/// per role: see `clients_with_other_settings_or_roles_never_share_an_entry`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_security_that_reads_settings_is_never_kept() {
    let db = fresh_db(
        "cache_claims",
        "CREATE ROLE authenticated;
         CREATE TABLE notes (owner text, body text);
         INSERT INTO notes VALUES ('u1', 'u1''s note'), ('u2', 'u2''s note');
         ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON notes
           USING (owner = current_setting('request.jwt.claims', true)::json->>'sub');
         GRANT SELECT ON notes TO authenticated;",
    );
    let s = cached_shoal(&db, "cache = true\ncache_all_reads = true", "");
    let sql = "SELECT body FROM notes";
    for (user, note) in [
        ("u1", "u1's note"),
        ("u2", "u2's note"),
        ("u1", "u1's note"),
    ] {
        let c = s.connect(&db).await;
        // As PostgREST does: the claims and the role for one transaction.
        let tx = format!(
            "BEGIN; SELECT set_config('request.jwt.claims', '{{\"sub\": \"{user}\"}}', true); \
             SET LOCAL ROLE authenticated; {sql}; COMMIT"
        );
        let rows: Vec<String> = c
            .simple_query(&tx)
            .await
            .unwrap()
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .filter(|v| v.ends_with("note"))
            .collect();
        assert_eq!(rows, [note], "{user}");
    }
    // Claims and role a client holds as session SETs (in its key): each client reads its
    // own rows, and none of it is ever kept.
    let hits = counter(&s, "hits").await;
    for (user, note) in [("u1", "u1's note"), ("u2", "u2's note")] {
        let c = s.connect(&db).await;
        c.simple_query(&format!(
            "SET request.jwt.claims = '{{\"sub\": \"{user}\"}}'"
        ))
        .await
        .unwrap();
        c.simple_query("SET ROLE authenticated").await.unwrap();
        for _ in 0..3 {
            assert_eq!(simple_rows(&c, sql).await, [note], "{user}");
        }
    }
    assert_eq!(
        counter(&s, "hits").await,
        hits,
        "a table whose policy reads a setting was kept"
    );
}

/// Row security turned on outside Shoal (no DDL passes through it, the change stream
/// carries none): the catalogue's version check sees it, what was kept is no longer
/// served, and the table is not kept again while its policy reads a setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_made_outside_shoal_ends_what_was_kept() {
    let db = fresh_db(
        "cache_late_policy",
        "CREATE ROLE reader;
         CREATE TABLE notes (owner text, body text);
         INSERT INTO notes VALUES ('u1', 'u1''s note'), ('u2', 'u2''s note');
         GRANT SELECT ON notes TO reader;",
    );
    let s = cached_shoal(
        &db,
        "cache = true\ncache_all_reads = true\ncache_ttl = \"1h\"",
        "",
    );
    let c = s.connect(&db).await;
    c.simple_query("SET request.jwt.claims = '{\"sub\": \"u1\"}'")
        .await
        .unwrap();
    c.simple_query("SET ROLE reader").await.unwrap();
    let sql = "SELECT body FROM notes ORDER BY body";
    assert_eq!(until_hit(&s, &c, sql).await, ["u1's note", "u2's note"]);
    direct_to(&db)
        .await
        .batch_execute(
            "ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
             CREATE POLICY mine ON notes
               USING (owner = current_setting('request.jwt.claims', true)::json->>'sub');",
        )
        .await
        .unwrap();
    until_rows(&c, sql, &["u1's note"]).await;
    let hits = counter(&s, "hits").await;
    for _ in 0..3 {
        assert_eq!(simple_rows(&c, sql).await, ["u1's note"]);
    }
    assert_eq!(
        counter(&s, "hits").await,
        hits,
        "kept after its policy came"
    );
    // Seen by a version check, not by DDL through Shoal: the catalogue read twice.
    let (cols, rows) = console_rows(&s, "SHOW CATALOGUES").await;
    let row: HashMap<String, String> = cols.into_iter().zip(rows[0].clone()).collect();
    assert_eq!(row["read"], "yes", "{row:?}");
    assert!(row["generation"].parse::<u64>().unwrap() >= 2, "{row:?}");
    assert!(
        row["version_checks"].parse::<u64>().unwrap() >= 1,
        "{row:?}"
    );
}

/// State a client leaves in its session that Shoal does not replay (a `set_config`, a
/// `SET` among other statements, a temporary table shadowing a table) is not in any key:
/// such a client neither fills the cache for others nor is served from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_no_key_holds_keeps_a_client_out_of_the_cache() {
    let db = fresh_db(
        "cache_state",
        "CREATE SCHEMA s1;
         CREATE TABLE public.t (v text); INSERT INTO public.t VALUES ('from public');
         CREATE TABLE s1.t (v text); INSERT INTO s1.t VALUES ('from s1');",
    );
    let s = cached_shoal(&db, "cache = true\ncache_all_reads = true", "");
    let sql = "SELECT v FROM t";
    for setup in [
        "SELECT set_config('search_path', 's1', false)",
        "SET search_path = s1; SELECT 1",
        "CREATE TEMP TABLE t AS SELECT 'from s1'::text AS v",
    ] {
        let a = s.connect(&db).await;
        a.simple_query(setup).await.unwrap();
        for _ in 0..3 {
            assert_eq!(simple_rows(&a, sql).await, ["from s1"], "{setup}");
        }
        let b = s.connect(&db).await;
        assert_eq!(
            until_hit(&s, &b, sql).await,
            ["from public"],
            "{setup}: B was served A's reply"
        );
        assert_eq!(
            simple_rows(&a, sql).await,
            ["from s1"],
            "{setup}: A was served B's reply"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_what_is_opted_in_and_never_what_changes_by_itself_is_kept() {
    let db = fresh_db("cache_optin", ITEMS);
    let fp = shoal_wire::facts::facts("SELECT name FROM items WHERE id = 1")
        .unwrap()
        .fingerprints[0]
        .clone();
    let s = cached_shoal(
        &db,
        &format!("cache = true\ncache_fingerprints = [\"{fp}\"]"),
        "",
    );
    let c = s.connect(&db).await;
    // A listed fingerprint, whatever the value; a hint with its own TTL.
    until_hit(&s, &c, "SELECT name FROM items WHERE id = 7").await;
    until_hit(
        &s,
        &c,
        "/* shoal:cache ttl=1h */ SELECT n FROM items WHERE id = 3",
    )
    .await;
    // Neither hinted nor listed; or volatile, or reading the clock, or in a block.
    for sql in [
        "SELECT n FROM items WHERE id = 3",
        "/* shoal:cache */ SELECT random()",
        "/* shoal:cache */ SELECT now()",
        "/* shoal:cache */ SELECT CURRENT_TIMESTAMP",
        "/* shoal:cache */ SELECT 'now'::timestamptz",
        "/* shoal:cache */ SELECT ('n' || 'ow')::timestamptz",
        "/* shoal:cache */ SELECT count(*) FROM pg_class",
    ] {
        let hits = counter(&s, "hits").await;
        for _ in 0..3 {
            simple_rows(&c, sql).await;
        }
        assert_eq!(
            counter(&s, "hits").await,
            hits,
            "{sql} was answered from the cache"
        );
    }
    c.simple_query("BEGIN").await.unwrap();
    let hits = counter(&s, "hits").await;
    simple_rows(&c, "SELECT name FROM items WHERE id = 7").await;
    assert_eq!(counter(&s, "hits").await, hits, "inside a block");
    c.simple_query("COMMIT").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_missing_one_key_together_run_it_once() {
    let db = fresh_db("cache_stampede", "SELECT 1");
    let s = cached_shoal(
        &db,
        "cache = true\ncache_all_reads = true\npool_size = 4",
        "",
    );
    // Slow, reading no table, calling only immutable functions.
    let sql = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 1000000) \
               SELECT count(*) FROM r";
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(s.connect(&db).await);
    }
    let runs = clients.iter().map(|c| simple_rows(c, sql));
    let results = futures_util::future::join_all(runs).await;
    assert!(results.iter().all(|r| r == &["1000000"]), "{results:?}");
    assert_eq!(counter(&s, "fills").await, 1, "{:?}", cache_row(&s).await);
    assert!(counter(&s, "waits").await >= 1, "{:?}", cache_row(&s).await);
    assert_eq!(counter(&s, "misses").await + counter(&s, "hits").await, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_distinct_queries_stays_under_the_memory_cap() {
    let db = fresh_db("cache_flood", ITEMS);
    let s = cached_shoal(
        &db,
        "cache = true\ncache_all_reads = true\ncache_max_memory = \"256kB\"",
        "",
    );
    let c = s.connect(&db).await;
    until_hit(&s, &c, "SELECT name FROM items WHERE id = 1").await;
    for i in 0..3000 {
        simple_rows(
            &c,
            &format!("SELECT name, repeat('x', 200) FROM items WHERE id = {i}"),
        )
        .await;
    }
    let row = cache_row(&s).await;
    let bytes: u64 = row["bytes"].parse().unwrap();
    assert!(bytes <= 256 * 1024, "{row:?}");
    assert!(row["evictions"].parse::<u64>().unwrap() > 0, "{row:?}");
    assert!(row["fills"].parse::<u64>().unwrap() > 1000, "{row:?}");
}

/// Readers, writers through Shoal and a writer straight to PostgreSQL, together for a
/// minute, held to the guarantee docs/cache.md gives:
/// - a writer reads its own writes;
/// - once a write through Shoal is acknowledged, no read that starts after it returns what
///   it replaced;
/// - an outside write shows in every read that starts later than the stream's delay after
///   its commit (one second here, with room for a loaded test machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_beside_writers_never_read_the_past() {
    use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    const WRITERS: i32 = 3;
    const BOUND: Duration = Duration::from_secs(1);
    let db = fresh_db(
        "cache_checker",
        "CREATE TABLE counters (id int PRIMARY KEY, v bigint NOT NULL);
         INSERT INTO counters SELECT g, 0 FROM generate_series(0, 3) g;",
    );
    let s = cached_shoal(
        &db,
        "cache = true\ncache_all_reads = true\npool_size = 4",
        "",
    );
    let warm = s.connect(&db).await;
    until_hit(&s, &warm, "SELECT v FROM counters WHERE id = 1").await;
    let run_for = Duration::from_secs(60);
    let start = Instant::now();
    // Each row's last acknowledged value through Shoal; the outside writer's commits.
    let acked: Arc<[AtomicI64; 4]> = Arc::new(Default::default());
    let outside_commits: Arc<Mutex<Vec<(Instant, i64)>>> = Arc::default();
    let mut tasks = Vec::new();
    for w in 1..=WRITERS {
        let c = s.connect(&db).await;
        let acked = acked.clone();
        tasks.push(tokio::spawn(async move {
            let mut last = 0i64;
            let read = format!("SELECT v FROM counters WHERE id = {w}");
            while start.elapsed() < run_for {
                let wrote: i64 = simple_rows(
                    &c,
                    &format!("UPDATE counters SET v = v + 1 WHERE id = {w} RETURNING v"),
                )
                .await[0]
                    .parse()
                    .unwrap();
                assert!(wrote > last);
                last = wrote;
                acked[w as usize].store(wrote, SeqCst);
                for _ in 0..5 {
                    let seen: i64 = simple_rows(&c, &read).await[0].parse().unwrap();
                    assert_eq!(seen, last, "writer {w} read {seen} after writing {last}");
                }
            }
            last
        }));
    }
    let mut readers = Vec::new();
    for _ in 0..2 {
        let c = s.connect(&db).await;
        let acked = acked.clone();
        let outside_commits = outside_commits.clone();
        readers.push(tokio::spawn(async move {
            let mut reads = 0u64;
            while start.elapsed() < run_for {
                // What must show, known before the read starts.
                let asked = Instant::now();
                let mut floor: [i64; 4] = std::array::from_fn(|i| acked[i].load(SeqCst));
                floor[0] = outside_commits
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(at, _)| asked.duration_since(*at) > BOUND)
                    .map(|(_, v)| *v)
                    .max()
                    .unwrap_or(0);
                for row in c
                    .simple_query("SELECT id, v FROM counters ORDER BY id")
                    .await
                    .unwrap()
                {
                    if let tokio_postgres::SimpleQueryMessage::Row(r) = row {
                        let id: usize = r.get(0).unwrap().parse().unwrap();
                        let v: i64 = r.get(1).unwrap().parse().unwrap();
                        assert!(
                            v >= floor[id],
                            "row {id} read as {v}, older than {} written before the read began",
                            floor[id]
                        );
                    }
                }
                reads += 1;
            }
            reads
        }));
    }
    // The outside writer: each value must show through Shoal within the bound.
    let outside = direct_to(&db).await;
    let watcher = s.connect(&db).await;
    let mut delays = Vec::new();
    let mut v = 0;
    while start.elapsed() < run_for {
        v += 1;
        outside
            .simple_query(&format!("UPDATE counters SET v = {v} WHERE id = 0"))
            .await
            .unwrap();
        outside_commits.lock().unwrap().push((Instant::now(), v));
        let shown = until_rows(
            &watcher,
            "SELECT v FROM counters WHERE id = 0",
            &[&v.to_string()],
        )
        .await;
        delays.push(shown);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in tasks {
        assert!(t.await.unwrap() > 10);
    }
    for r in readers {
        assert!(r.await.unwrap() > 10);
    }
    delays.sort();
    let p99 = delays[delays.len() * 99 / 100];
    assert!(
        p99 < Duration::from_secs(1),
        "p99 {p99:?} over {} writes",
        delays.len()
    );
    let row = cache_row(&s).await;
    assert!(row["hits"].parse::<u64>().unwrap() > 100, "{row:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_turns_its_cache_on_and_off_and_purges_it_through_the_api() {
    let db = fresh_db("cache_tenant", ITEMS);
    let (s, _data) = shoal_with_token_api(logical_pg());
    let tenant = |extra: serde_json::Value| tenant_body(logical_pg(), &db, extra);
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!({"cache": true, "cache_ttl": "a while"})),
    );
    assert_eq!(code_, 422, "{body}");
    assert!(body.to_string().contains("cache_ttl"), "{body}");
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!({"cache": true, "cache_all_reads": true, "cache_ttl": "1h"})),
    );
    assert_eq!(code_, 201, "{body}");
    let c = s
        .try_connect(&format!(
            "host=127.0.0.1 port={} user=app.acme password={APP_PASSWORD} dbname=x",
            s.port()
        ))
        .await
        .unwrap();
    let sql = "SELECT name FROM items WHERE id = 2";
    let purge = || {
        api(
            &s,
            "DELETE",
            "/api/tenants/acme/cache",
            &serde_json::json!({}),
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert_eq!(simple_rows(&c, sql).await, ["item 2"]);
        let (code_, body) = api(&s, "GET", "/api/tenants/acme/pools", &serde_json::json!({}));
        assert_eq!(code_, 200, "{body}");
        // Kept once the stream covers the table.
        let (_, again) = purge();
        if again["entries"].as_u64() > Some(0) {
            break;
        }
        assert!(Instant::now() < deadline, "never kept: {again}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(purge().1["entries"], 0, "purged");
    // Off, live: nothing is kept.
    let (code_, body) = api(
        &s,
        "PUT",
        "/api/tenants/acme",
        &tenant(serde_json::json!({})),
    );
    assert_eq!(code_, 200, "{body}");
    for _ in 0..3 {
        assert_eq!(simple_rows(&c, sql).await, ["item 2"]);
    }
    assert_eq!(purge().1["entries"], 0);
    let (code_, _) = api(
        &s,
        "DELETE",
        "/api/tenants/nobody/cache",
        &serde_json::json!({}),
    );
    assert_eq!(code_, 404);
}
