//! What the Postgres Changes and database-broadcast tests share: a cluster with logical
//! decoding, tokens, SQL as `app`, Shoal with a realtime tenant on a fresh database, and
//! a bare Phoenix client's subscriptions.

use std::net::SocketAddr;
use std::sync::OnceLock;

use super::phoenix::Phx;
use super::*;

pub const SECRET: &str = "changes-realtime-jwt-secret-0123456789";

/// A cluster with logical decoding on, and the roles Supabase's tokens name.
pub fn logical_pg() -> &'static Pg {
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

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A token for user `sub` with role `authenticated`.
pub fn token(sub: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": "authenticated", "sub": sub, "exp": now() + 3600}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

/// Runs `sql` in `db` as `app`.
pub fn run_sql(pg: &Pg, db: &str, sql: &str) -> String {
    run_sql_output(pg, db, sql).0
}

/// Runs `sql` in `db` as `app`: what psql printed, and its warnings and notices.
pub fn run_sql_output(pg: &Pg, db: &str, sql: &str) -> (String, String) {
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
    (
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub struct Setup {
    pub shoal: Shoal,
    pub _data: tempfile::TempDir,
    pub rt: SocketAddr,
    pub db: String,
    pub pg: &'static Pg,
}

/// Shoal with realtime, tenant `acme` on a fresh database of `pg` made with `schema`.
pub fn setup_on(pg: &'static Pg, prefix: &str, schema: &str) -> Setup {
    setup_tenant(pg, prefix, schema, serde_json::json!({}))
}

/// [`setup_on`] with more of the tenant's settings (`extra`).
pub fn setup_tenant(
    pg: &'static Pg,
    prefix: &str,
    schema: &str,
    extra: serde_json::Value,
) -> Setup {
    let db = unique_db(prefix);
    pg.create_database(&db);
    run_sql(pg, &db, schema);
    let (shoal, data) = shoal_with_token_api_and(
        pg,
        "[realtime]\nlisten = \"127.0.0.1:0\"\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    );
    let (status, body) = api(
        &shoal,
        "PUT",
        "/api/tenants/acme",
        &tenant_body(pg, &db, {
            let mut t = serde_json::json!({ "jwt_secret": SECRET });
            if let (Some(t), Some(extra)) = (t.as_object_mut(), extra.as_object()) {
                t.extend(extra.clone());
            }
            t
        }),
    );
    assert_eq!(status, 201, "{body}");
    let rt = shoal.realtime.expect("realtime listens");
    Setup {
        shoal,
        _data: data,
        rt,
        db,
        pg,
    }
}

pub fn setup(prefix: &str, schema: &str) -> Setup {
    setup_on(logical_pg(), prefix, schema)
}

/// Joins `topic` with `bindings`; the ids the reply gives them, once `SUBSCRIBED`.
pub async fn subscribe(p: &mut Phx, topic: &str, bindings: serde_json::Value) -> Vec<u64> {
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
pub async fn change(p: &mut Phx) -> serde_json::Value {
    p.until(|m| m["event"] == "postgres_changes").await["payload"].clone()
}

/// The sum of the samples of metric `name` (all labels) on Shoal's metrics page.
pub fn metric(shoal: &Shoal, name: &str) -> f64 {
    let url = format!(
        "http://{}/metrics",
        shoal.metrics.expect("metrics listener")
    );
    let out = std::process::Command::new("curl")
        .args(["-s", &url])
        .output()
        .expect("curl runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
