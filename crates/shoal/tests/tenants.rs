//! Tenants end to end: real HTTP requests (curl) to the management API, real PostgreSQL
//! servers (two, to prove isolation), real clients; every routing method, the isolation
//! attacks, live changes under load, and a Supavisor provisioning script run unchanged.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const JWT_SECRET: &str = "test-jwt-secret-0123456789";

/// A second PostgreSQL server: tenants on different servers.
fn pg2() -> &'static Pg {
    static PG2: OnceLock<Pg> = OnceLock::new();
    PG2.get_or_init(|| Pg::start_on(free_port()))
}

/// An HS256 token as Supavisor's operators make them (header.payload.signature).
fn jwt(claims: Value) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let head = b64(br#"{"alg":"HS256","typ":"JWT"}"#);
    let body = b64(claims.to_string().as_bytes());
    let signing = format!("{head}.{body}");
    let sig = hmac_sha256(JWT_SECRET.as_bytes(), signing.as_bytes());
    format!("{signing}.{}", b64(&sig))
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize()
        .to_vec()
}

fn token() -> String {
    jwt(json!({"role": "service"}))
}

struct Http {
    base: String,
}

impl Http {
    fn new(shoal: &Shoal) -> Http {
        Http {
            base: format!("http://{}", shoal.api.expect("the API listens")),
        }
    }

    /// Sends a request with curl; returns (status, JSON body or Null).
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        auth: Option<&str>,
    ) -> (u16, Value) {
        let mut cmd = Command::new("curl");
        cmd.args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", method])
            .arg(format!("{}{path}", self.base));
        if let Some(t) = auth {
            cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        if let Some(b) = body {
            cmd.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
        }
        let out = cmd.output().expect("curl runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let code: u16 = code.trim().parse().unwrap_or(0);
        (code, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    fn authed(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call(method, path, body, Some(&token()))
    }
}

fn shoal_with_api(extra: &str) -> (Shoal, Http, tempfile::TempDir) {
    let data = tempfile::tempdir().unwrap();
    let config = base_config(
        pg(),
        &[],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\n[store]\ndata_dir = \"{}\"\n{extra}",
            data.path().display()
        ),
    );
    let shoal = Shoal::start_with_env(&config, &[("API_JWT_SECRET", JWT_SECRET)]);
    let http = Http::new(&shoal);
    (shoal, http, data)
}

/// A tenant on `pg` database `db` whose user `app` logs in with APP_PASSWORD.
fn tenant_body(pg: &Pg, db: &str, pool_size: usize) -> Value {
    json!({"tenant": {
        "db_host": "127.0.0.1",
        "db_port": pg.port,
        "db_database": db,
        "require_user": true,
        "default_max_clients": 100,
        "users": [{"db_user": "app", "db_password": APP_PASSWORD, "pool_size": pool_size, "mode_type": "transaction"}]
    }})
}

async fn connect(
    shoal: &Shoal,
    conninfo: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    shoal
        .try_connect(&format!("host=127.0.0.1 port={} {conninfo}", shoal.port()))
        .await
}

/// A client whose connection task reports the FATAL that ends it: (SQLSTATE, message).
async fn connect_watched(
    shoal: &Shoal,
    conninfo: &str,
) -> (
    tokio_postgres::Client,
    tokio::task::JoinHandle<(String, String)>,
) {
    let (client, conn) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port={} {conninfo}", shoal.port()),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let ended = tokio::spawn(async move {
        match conn.await {
            Err(e) => match e.as_db_error() {
                Some(d) => (d.code().code().to_owned(), d.message().to_owned()),
                None => ("none".into(), e.to_string()),
            },
            Ok(()) => ("none".into(), "closed without an error".into()),
        }
    });
    (client, ended)
}

async fn current_db(c: &tokio_postgres::Client) -> String {
    c.query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_tokens_are_required_and_checked() {
    let (_shoal, http, _data) = shoal_with_api("");
    assert_eq!(http.call("GET", "/api/health", None, None).0, 200);
    let (code, doc) = http.call("GET", "/api/openapi.json", None, None);
    assert_eq!(code, 200);
    assert_eq!(doc["openapi"], "3.0.3");
    // Also where Supavisor's users look for it.
    assert_eq!(http.call("GET", "/api/openapi", None, None), (200, doc));
    let (code, body) = http.call("GET", "/api/tenants", None, None);
    assert_eq!(code, 401);
    assert!(body.get("data").is_none(), "no data without a token");
    assert_eq!(
        http.call("GET", "/api/tenants", None, Some("nonsense")).0,
        401
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let expired = jwt(json!({"role": "service", "exp": now - 60}));
    assert_eq!(
        http.call("GET", "/api/tenants", None, Some(&expired)).0,
        401
    );
    let fresh = jwt(json!({"role": "service", "exp": now + 600}));
    assert_eq!(http.call("GET", "/api/tenants", None, Some(&fresh)).0, 200);
    // A token signed with another secret.
    let mut forged = token();
    forged.pop();
    forged.push(if forged.ends_with('A') { 'B' } else { 'A' });
    assert_eq!(http.call("GET", "/api/tenants", None, Some(&forged)).0, 401);
}

/// Every route the API serves is in the OpenAPI document, with its method, and nothing else
/// is.
#[test]
fn the_openapi_document_matches_the_routes() {
    let doc: Value = serde_json::from_str(shoal::api::OPENAPI).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let mut documented = Vec::new();
    for (path, item) in paths {
        for method in ["get", "put", "patch", "delete", "post"] {
            if item.get(method).is_some() {
                documented.push((method.to_string(), path.clone()));
            }
        }
    }
    let mut served: Vec<(String, String)> = shoal::api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    documented.sort();
    served.sort();
    assert_eq!(documented, served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_connect_validate_and_list() {
    let db = unique_db("tenant");
    pg().create_database(&db);
    let (shoal, http, _data) = shoal_with_api("");
    let (code, body) = http.authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 3)));
    assert_eq!(code, 201, "{body}");
    assert!(
        !body.to_string().contains(APP_PASSWORD),
        "no password in responses"
    );
    // Connectable as soon as PUT returns.
    let c = connect(
        &shoal,
        &format!("user=app.acme password={APP_PASSWORD} dbname=anything"),
    )
    .await
    .unwrap();
    assert_eq!(
        current_db(&c).await,
        db,
        "the tenant's database, whatever dbname says"
    );
    let (code, _) = http.authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 3)));
    assert_eq!(code, 200, "a second PUT updates");
    let (code, got) = http.authed("GET", "/api/tenants/acme", None);
    assert_eq!(code, 200);
    assert_eq!(got["data"]["db_database"], db.as_str());
    assert!(got["data"]["users"][0].get("db_password").is_none());
    let (_, list) = http.authed("GET", "/api/tenants?per_page=10", None);
    assert_eq!(list["total"], 1);
    // Validation errors name the fields.
    let (code, e) = http.authed(
        "PUT",
        "/api/tenants/bad",
        Some(json!({"tenant": {"db_port": 5432, "users": [{"db_user": "x"}], "allow_list": ["nope"]}})),
    );
    assert_eq!(code, 422);
    for f in [
        "db_host",
        "db_database",
        "users[0].db_password",
        "allow_list[0]",
    ] {
        assert!(e["errors"].get(f).is_some(), "{f} in {e}");
    }
    let (code, e) = http.authed(
        "PUT",
        "/api/tenants/Bad_Id",
        Some(tenant_body(pg(), &db, 3)),
    );
    assert_eq!(code, 422);
    assert!(e["errors"].get("external_id").is_some(), "{e}");
    let (code, e) = http.authed(
        "PUT",
        "/api/tenants/typed",
        Some(json!({"tenant": {"db_host": "h", "db_port": "not a number",
            "default_pool_size": "ten", "limit_wait": "3 parsecs", "users": []}})),
    );
    assert_eq!(code, 422);
    // Every problem at once, in words: the fields serde refuses and the rules the rest
    // breaks (no database named).
    assert_eq!(
        e["errors"]["db_port"][0], "a port between 1 and 65535, not \"not a number\"",
        "{e}"
    );
    assert_eq!(
        e["errors"]["default_pool_size"][0], "a whole number, 0 or more, not \"ten\"",
        "{e}"
    );
    let wait = e["errors"]["limit_wait"][0].as_str().unwrap_or("");
    assert!(wait.contains("is not a duration such as \"5s\""), "{e}");
    assert!(e["errors"].get("db_database").is_some(), "{e}");
    // server_reset: one of two words, kept and returned.
    let mut always = tenant_body(pg(), &db, 3);
    always["tenant"]["server_reset"] = json!("always");
    assert_eq!(
        http.authed("PUT", "/api/tenants/clean", Some(always.clone()))
            .0,
        201
    );
    let (_, got) = http.authed("GET", "/api/tenants/clean", None);
    assert_eq!(got["data"]["server_reset"], "always");
    always["tenant"]["server_reset"] = json!("sometimes");
    let (code, e) = http.authed("PUT", "/api/tenants/clean", Some(always));
    assert_eq!(code, 422);
    assert!(e["errors"].get("server_reset").is_some(), "{e}");
    assert_eq!(http.authed("DELETE", "/api/tenants/clean", None).0, 204);
    // The upstream is checked on create: a wrong password is named; check=false skips it.
    let mut wrong = tenant_body(pg(), &db, 3);
    wrong["tenant"]["users"][0]["db_password"] = json!("wrong");
    let (code, e) = http.authed("PUT", "/api/tenants/wrongpw", Some(wrong.clone()));
    assert_eq!(code, 422);
    assert!(e["errors"].get("users[0].db_password").is_some(), "{e}");
    let (code, _) = http.authed("PUT", "/api/tenants/wrongpw?check=false", Some(wrong));
    assert_eq!(code, 201);
    let (code, _) = http.authed("GET", "/api/tenants/nosuch", None);
    assert_eq!(code, 404);
    // Unknown tenant, wrong password: each refused with its own code.
    let e = connect(
        &shoal,
        &format!("user=app.nosuch password={APP_PASSWORD} dbname=x"),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(code_of(&e), "3D000", "{e}");
    let e = connect(&shoal, "user=app.acme password=wrong dbname=x")
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28P01", "{e}");
}

fn code_of(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map(|d| d.code().code().to_owned())
        .unwrap_or_else(|| format!("no SQLSTATE: {e}"))
}

/// Two tenants on two PostgreSQL servers: whatever a client of one sends (user, dbname,
/// options), it never reaches the other's pool or a config-file pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated() {
    let db1 = unique_db("iso");
    let db2 = unique_db("iso");
    pg().create_database(&db1);
    pg2().create_database(&db2);
    let cfgdb = unique_db("cfg");
    pg().create_database(&cfgdb);
    let data = tempfile::tempdir().unwrap();
    let config = base_config(
        pg(),
        &[&cfgdb],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\n[store]\ndata_dir = \"{}\"\n",
            data.path().display()
        ),
    );
    let shoal = Shoal::start_with_env(&config, &[("API_JWT_SECRET", JWT_SECRET)]);
    let http = Http::new(&shoal);
    let mut a = tenant_body(pg(), &db1, 1);
    a["tenant"]["users"][0]["db_password"] = json!(APP_PASSWORD);
    assert_eq!(http.authed("PUT", "/api/tenants/alpha", Some(a)).0, 201);
    // Tenant beta: another server, another password for the same user name.
    pg2().psql_admin("ALTER ROLE app PASSWORD 'beta-secret'");
    let mut b = tenant_body(pg2(), &db2, 1);
    b["tenant"]["users"][0]["db_password"] = json!("beta-secret");
    assert_eq!(http.authed("PUT", "/api/tenants/beta", Some(b)).0, 201);
    let a1 = connect(
        &shoal,
        &format!("user=app.alpha password={APP_PASSWORD} dbname={db2}"),
    )
    .await
    .unwrap();
    assert_eq!(current_db(&a1).await, db1);
    let b1 = connect(&shoal, "user=app.beta password=beta-secret dbname=x")
        .await
        .unwrap();
    assert_eq!(current_db(&b1).await, db2);
    // Alpha's password does not open beta; beta's does not open alpha.
    let e = connect(&shoal, &format!("user=app.beta password={APP_PASSWORD}"))
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28P01");
    let e = connect(&shoal, "user=app.alpha password=beta-secret")
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28P01");
    // A user of one tenant naming the other in options: refused before any password.
    let e = connect(
        &shoal,
        &format!("user=app.alpha password={APP_PASSWORD} options=reference=beta"),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(code_of(&e), "28000", "{e}");
    // A tenant user with a config-file database name stays in its tenant.
    let c = connect(
        &shoal,
        &format!("user=app.alpha password={APP_PASSWORD} dbname={cfgdb}"),
    )
    .await
    .unwrap();
    assert_eq!(current_db(&c).await, db1);
    // The manager-less postgres.beta (a user beta does not list) is refused.
    let e = connect(&shoal, "user=postgres.beta password=postgres")
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28P01");
    // Session state of one tenant's client is invisible to the other's (pool of one each).
    a1.batch_execute("CREATE TEMP TABLE mine (x int)")
        .await
        .ok();
    let seen: i64 = b1
        .query_one("SELECT count(*) FROM pg_class WHERE relname = 'mine'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 0);
    // The config file's pool is unaffected.
    let cf = shoal.connect(&cfgdb).await;
    assert_eq!(current_db(&cf).await, cfgdb);
    pg2().psql_admin(&format!("ALTER ROLE app PASSWORD '{APP_PASSWORD}'"));
}

/// Routing by `options=reference=…` and by the TLS server name under `sni_base_domain`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_by_options_and_sni() {
    let db = unique_db("route");
    pg().create_database(&db);
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["*.db.test".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.path().join("c.pem"), cert.pem()).unwrap();
    std::fs::write(dir.path().join("k.pem"), key.serialize_pem()).unwrap();
    let (shoal, http, _data) = shoal_with_api(&format!(
        "[tenants]\nsni_base_domain = \"db.test\"\n[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        dir.path().join("c.pem").display(),
        dir.path().join("k.pem").display()
    ));
    assert_eq!(
        http.authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 2)))
            .0,
        201
    );
    let c = connect(
        &shoal,
        &format!("user=app password={APP_PASSWORD} options=reference=acme"),
    )
    .await
    .unwrap();
    assert_eq!(current_db(&c).await, db);
    // SNI: psql with host=acme.db.test resolved to 127.0.0.1 by hostaddr.
    let out = Command::new("psql")
        .arg(format!(
            "host=acme.db.test hostaddr=127.0.0.1 port={} user=app dbname=x sslmode=require",
            shoal.port()
        ))
        .args(["-X", "-At", "-c", "SELECT current_database()"])
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text, db);
    // An SNI of one tenant with a user naming another: refused.
    let out = Command::new("psql")
        .arg(format!(
            "host=acme.db.test hostaddr=127.0.0.1 port={} user=app.other dbname=x sslmode=require",
            shoal.port()
        ))
        .args(["-X", "-At", "-c", "SELECT 1"])
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(!out.status.success());
    // `other` does not exist: the suffix is part of the user name, so the password fails.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("password authentication failed"), "{err}");
}

/// Resize under load (no client notices), ban (clients ended with the reason, new logins
/// refused), unban, terminate, delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_changes_under_load() {
    let db = unique_db("live");
    pg().create_database(&db);
    let (shoal, http, _data) = shoal_with_api("[tenants]\npool_idle_close = 600\n");
    assert_eq!(
        http.authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 2)))
            .0,
        201
    );
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(
            connect(&shoal, &format!("user=app.acme password={APP_PASSWORD}"))
                .await
                .unwrap(),
        );
    }
    let traffic = common::traffic::Traffic::start(clients, "SELECT pg_sleep(0.002), 1");
    traffic.wait_for(50).await;
    // Grow, then shrink, the pool while the clients run.
    for size in [4, 1, 3] {
        assert_eq!(
            http.authed(
                "PUT",
                "/api/tenants/acme",
                Some(tenant_body(pg(), &db, size))
            )
            .0,
            200
        );
        traffic.wait_for(30).await;
        let (_, pools) = http.authed("GET", "/api/tenants/acme/pools", None);
        assert_eq!(pools["data"][0]["pool_size"], size, "{pools}");
        assert!(
            pools["data"][0]["clients"].as_u64().unwrap() >= 4,
            "{pools}"
        );
    }
    let failures = traffic.stop().await;
    assert!(failures.is_empty(), "resizing failed clients: {failures:?}");
    assert!(pg().backends(&db) <= 4);
    // Ban: a connected client is ended with the reason; new logins are refused.
    let (c, ended) =
        connect_watched(&shoal, &format!("user=app.acme password={APP_PASSWORD}")).await;
    c.simple_query("SELECT 1").await.unwrap();
    let (code, _) = http.authed(
        "PATCH",
        "/api/tenants/acme",
        Some(json!({"tenant": {"banned": true, "ban_reason": "unpaid invoice"}})),
    );
    assert_eq!(code, 200);
    let (code, message) = ended.await.unwrap();
    assert_eq!(code, "57P01");
    assert!(message.contains("banned: unpaid invoice"), "{message}");
    assert!(c.simple_query("SELECT 1").await.is_err());
    let e = connect(&shoal, &format!("user=app.acme password={APP_PASSWORD}"))
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "08004");
    assert!(format!("{e:?}").contains("unpaid invoice"), "{e:?}");
    // Unban.
    let (code, _) = http.authed(
        "PATCH",
        "/api/tenants/acme",
        Some(json!({"tenant": {"banned": false}})),
    );
    assert_eq!(code, 200);
    let c = connect(&shoal, &format!("user=app.acme password={APP_PASSWORD}"))
        .await
        .unwrap();
    c.simple_query("SELECT 1").await.unwrap();
    // Terminate: the client is ended, the tenant stays.
    let (code, t) = http.authed("GET", "/api/tenants/acme/terminate", None);
    assert_eq!(code, 200);
    assert_eq!(t["clients"], 1, "{t}");
    assert!(c.simple_query("SELECT 1").await.is_err());
    let (c, ended) =
        connect_watched(&shoal, &format!("user=app.acme password={APP_PASSWORD}")).await;
    c.simple_query("SELECT 1").await.unwrap();
    // Delete: ended, and the tenant is gone.
    assert_eq!(http.authed("DELETE", "/api/tenants/acme", None).0, 204);
    let (code, message) = ended.await.unwrap();
    assert_eq!(code, "57P01");
    assert!(message.contains("deleted"), "{message}");
    let e = connect(&shoal, &format!("user=app.acme password={APP_PASSWORD}"))
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "3D000");
    assert_eq!(http.authed("DELETE", "/api/tenants/acme", None).0, 404);
}

/// A tenant's `client_idle_timeout` disconnects its idle clients (57P05); its allow list and
/// `enforce_ssl` refuse logins before any password; `default_parameter_status` answers a
/// login with no server; a password changed by PUT applies to new logins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_tenant_rules() {
    let db = unique_db("rules");
    pg().create_database(&db);
    let (shoal, http, _data) = shoal_with_api("");
    let mut t = tenant_body(pg(), &db, 2);
    t["tenant"]["client_idle_timeout"] = json!(1);
    t["tenant"]["default_parameter_status"] = json!({"server_version": "99.0-tenant"});
    assert_eq!(
        http.authed("PUT", "/api/tenants/idle", Some(t.clone())).0,
        201
    );
    let (c, ended) =
        connect_watched(&shoal, &format!("user=app.idle password={APP_PASSWORD}")).await;
    let (code, message) = tokio::time::timeout(Duration::from_secs(20), ended)
        .await
        .expect("the idle client is disconnected")
        .unwrap();
    assert_eq!(code, "57P05", "{message}");
    assert!(c.is_closed());
    // The allow list.
    let mut deny = t.clone();
    deny["tenant"]["allow_list"] = json!(["10.0.0.0/8"]);
    deny["tenant"]["client_idle_timeout"] = json!(0);
    assert_eq!(http.authed("PUT", "/api/tenants/idle", Some(deny)).0, 200);
    let e = connect(&shoal, &format!("user=app.idle password={APP_PASSWORD}"))
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28000");
    assert!(format!("{e:?}").contains("not allowed"), "{e:?}");
    // TLS required.
    let mut tls = t.clone();
    tls["tenant"]["enforce_ssl"] = json!(true);
    tls["tenant"]["client_idle_timeout"] = json!(0);
    assert_eq!(http.authed("PUT", "/api/tenants/idle", Some(tls)).0, 200);
    let e = connect(&shoal, &format!("user=app.idle password={APP_PASSWORD}"))
        .await
        .err()
        .unwrap();
    assert_eq!(code_of(&e), "28000");
    assert!(format!("{e:?}").contains("TLS is required"), "{e:?}");
    // A password change applies to new logins (the upstream role changes with it).
    let role = unique_db("role");
    pg().psql_admin(&format!("CREATE ROLE {role} LOGIN PASSWORD 'first-secret'"));
    let mut first = t.clone();
    first["tenant"]["client_idle_timeout"] = json!(0);
    first["tenant"]["users"][0]["db_user"] = json!(role);
    first["tenant"]["users"][0]["db_password"] = json!("first-secret");
    assert_eq!(
        http.authed("PUT", "/api/tenants/rot", Some(first.clone()))
            .0,
        201
    );
    let before = connect(&shoal, &format!("user={role}.rot password=first-secret"))
        .await
        .unwrap();
    before.simple_query("SELECT 1").await.unwrap();
    pg().psql_admin(&format!("ALTER ROLE {role} PASSWORD 'rotated-secret'"));
    let mut rotated = first.clone();
    rotated["tenant"]["users"][0]["db_password"] = json!("rotated-secret");
    assert_eq!(http.authed("PUT", "/api/tenants/rot", Some(rotated)).0, 200);
    let c = connect(&shoal, &format!("user={role}.rot password=rotated-secret"))
        .await
        .unwrap();
    let who: String = c
        .query_one("SELECT current_user", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, role);
    let old = connect(&shoal, &format!("user={role}.rot password=first-secret")).await;
    assert_eq!(code_of(&old.err().unwrap()), "28P01");
    // The client connected before keeps working.
    before.simple_query("SELECT 1").await.unwrap();
}

/// A noisy tenant saturating its pool of one (and flooding logins with a wrong password)
/// does not slow a quiet tenant's clients: the quiet client's queries never wait behind the
/// noisy queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noisy_tenant_does_not_slow_a_quiet_one() {
    let db = unique_db("noisy");
    pg().create_database(&db);
    let (shoal, http, _data) = shoal_with_api("");
    assert_eq!(
        http.authed("PUT", "/api/tenants/noisy", Some(tenant_body(pg(), &db, 1)))
            .0,
        201
    );
    assert_eq!(
        http.authed("PUT", "/api/tenants/quiet", Some(tenant_body(pg(), &db, 2)))
            .0,
        201
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut noise = Vec::new();
    // Twenty clients queueing for one server, each holding it 50 ms.
    for _ in 0..20 {
        let c = connect(&shoal, &format!("user=app.noisy password={APP_PASSWORD}"))
            .await
            .unwrap();
        let stop = stop.clone();
        noise.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = c.simple_query("SELECT pg_sleep(0.05)").await;
            }
        }));
    }
    // And a flood of failing logins.
    for _ in 0..4 {
        let stop = stop.clone();
        let port = shoal.port();
        noise.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let _ = tokio_postgres::connect(
                    &format!("host=127.0.0.1 port={port} user=app.noisy password=wrong"),
                    tokio_postgres::NoTls,
                )
                .await;
            }
        }));
    }
    // The noisy queue is full: a noisy query now waits about a second.
    let noisy = connect(&shoal, &format!("user=app.noisy password={APP_PASSWORD}"))
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    noisy.simple_query("SELECT 1").await.unwrap();
    let noisy_wait = t0.elapsed();
    let quiet = connect(&shoal, &format!("user=app.quiet password={APP_PASSWORD}"))
        .await
        .unwrap();
    let mut lat = Vec::new();
    for _ in 0..50 {
        let t0 = std::time::Instant::now();
        quiet.simple_query("SELECT 1").await.unwrap();
        lat.push(t0.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    for n in noise {
        n.await.unwrap();
    }
    lat.sort();
    let median = lat[lat.len() / 2];
    assert!(
        noisy_wait > Duration::from_millis(200),
        "the noisy tenant was saturated (waited {noisy_wait:?})"
    );
    assert!(
        median * 10 < noisy_wait,
        "the quiet tenant's median query ({median:?}) is far below the noisy queue's wait ({noisy_wait:?})"
    );
}

/// A tenant reaching its PostgreSQL over verified TLS (`upstream_ssl`, `upstream_verify =
/// "peer"`, `upstream_tls_ca`); a CA that did not sign the server's certificate fails the
/// create check, naming the problem. Unused tenant pools are closed after
/// `pool_idle_close`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_tls_per_tenant_and_idle_pools_close() {
    let (ca, cert, key) = common::ca_and_server_cert();
    let port = free_port();
    let tls_pg = Pg::start_with(
        port,
        &[("server.crt", &cert), ("server.key", &key)],
        "-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key",
    );
    let (shoal, http, _data) = shoal_with_api("[tenants]\npool_idle_close = 0.5\n");
    let mut t = tenant_body(&tls_pg, "app", 2);
    t["tenant"]["db_host"] = json!("localhost");
    t["tenant"]["ip_version"] = json!("v4");
    t["tenant"]["upstream_ssl"] = json!(true);
    t["tenant"]["upstream_verify"] = json!("peer");
    t["tenant"]["upstream_tls_ca"] = json!(ca);
    let (code, body) = http.authed("PUT", "/api/tenants/secure", Some(t.clone()));
    assert_eq!(code, 201, "{body}");
    let c = connect(&shoal, &format!("user=app.secure password={APP_PASSWORD}"))
        .await
        .unwrap();
    let ssl: String = c
        .query_one(
            "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ssl, "true");
    // Another CA: the certificate does not verify.
    let (other_ca, _, _) = common::ca_and_server_cert();
    let mut wrong = t.clone();
    wrong["tenant"]["upstream_tls_ca"] = json!(other_ca);
    let (code, e) = http.authed("PUT", "/api/tenants/insecure", Some(wrong));
    assert_eq!(code, 422);
    assert!(
        e["errors"]["db_host"][0]
            .as_str()
            .unwrap()
            .contains("certificate"),
        "{e}"
    );
    // The pool closes once its last client has been gone for pool_idle_close.
    let (_, pools) = http.authed("GET", "/api/tenants/secure/pools", None);
    assert_eq!(pools["data"].as_array().unwrap().len(), 1, "{pools}");
    drop(c);
    eventually("the unused pool closes", Duration::from_secs(15), || {
        let (_, pools) = http.authed("GET", "/api/tenants/secure/pools", None);
        pools["data"].as_array().is_some_and(|a| a.is_empty())
    })
    .await;
    // The next login makes it again.
    let c = connect(&shoal, &format!("user=app.secure password={APP_PASSWORD}"))
        .await
        .unwrap();
    c.simple_query("SELECT 1").await.unwrap();
    tls_pg.stop();
}

/// A provisioning script written for Supavisor's API (curl PUT with its JSON), unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supavisor_provisioning_script_runs_unchanged() {
    let db = unique_db("supa");
    pg().create_database(&db);
    let (shoal, http, _data) = shoal_with_api("");
    let script = r#"
set -eu
curl -sf -X PUT "$API/api/tenants/$TENANT" \
  --header "Accept: application/json" \
  --header "Content-Type: application/json" \
  --header "Authorization: Bearer $JWT" \
  --data-raw "{
  \"tenant\": {
    \"db_host\": \"127.0.0.1\",
    \"db_port\": $DB_PORT,
    \"db_database\": \"$DB_NAME\",
    \"ip_version\": \"auto\",
    \"enforce_ssl\": false,
    \"require_user\": false,
    \"auth_query\": \"SELECT rolname, rolpassword FROM pg_authid WHERE rolname=\$1;\",
    \"users\": [
      {
        \"db_user\": \"postgres\",
        \"db_password\": \"postgres\",
        \"pool_size\": 3,
        \"mode_type\": \"transaction\",
        \"is_manager\": true
      }
    ]
  }
}"
"#;
    let out = Command::new("bash")
        .args(["-c", script])
        .env("API", &http.base)
        .env("TENANT", "dev-tenant")
        .env("JWT", token())
        .env("DB_PORT", pg().port.to_string())
        .env("DB_NAME", &db)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(created["data"]["db_database"], db.as_str());
    // require_user = false: a user the tenant does not list logs in through auth_query
    // (SCRAM passthrough upstream).
    let c = connect(
        &shoal,
        &format!("user=app.dev-tenant password={APP_PASSWORD}"),
    )
    .await
    .unwrap();
    let who: String = c
        .query_one("SELECT current_user", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "app");
    assert_eq!(current_db(&c).await, db);
}

/// The PostgreSQL store shared by two Shoal processes: a change through one is live on the
/// other within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_store_carries_changes_between_nodes() {
    let meta = unique_db("meta");
    pg().create_database(&meta);
    let db = unique_db("shared");
    pg().create_database(&db);
    let url = format!(
        "postgres://app:{APP_PASSWORD}@127.0.0.1:{}/{meta}",
        pg().port
    );
    let key = "ab".repeat(32);
    let start = || {
        let data = tempfile::tempdir().unwrap();
        let config = base_config(
            pg(),
            &[],
            &format!(
                "[api]\nlisten = \"127.0.0.1:0\"\n[store]\nurl = \"{url}\"\ndata_dir = \"{}\"\nresync_interval = 30\n",
                data.path().display()
            ),
        );
        let s = Shoal::start_with_env(
            &config,
            &[("API_JWT_SECRET", JWT_SECRET), ("SHOAL_ENC_KEY", &key)],
        );
        (s, data)
    };
    let (one, _d1) = start();
    let (two, _d2) = start();
    let http1 = Http::new(&one);
    let http2 = Http::new(&two);
    assert_eq!(
        http1
            .authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 2)))
            .0,
        201
    );
    let started = std::time::Instant::now();
    let conninfo = format!("user=app.acme password={APP_PASSWORD}");
    let mut ok = false;
    while started.elapsed() < Duration::from_secs(1) {
        if connect(&two, &conninfo).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "the tenant was live on the second node within a second");
    // No password in the metadata database.
    let (meta_client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let body: String = meta_client
        .query_one(
            "SELECT body FROM shoal_tenants WHERE external_id = 'acme'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        body.contains("enc:v1:") && !body.contains(APP_PASSWORD),
        "{body}"
    );
    // Pages and searches are answered by the shared store.
    let (status, found) = http2.authed("GET", "/api/tenants?search=CM&per_page=5", None);
    assert_eq!(
        (status, &found["total"]),
        (200, &serde_json::json!(1)),
        "{found}"
    );
    assert_eq!(found["data"][0]["external_id"], "acme", "{found}");
    let (_, none) = http2.authed("GET", "/api/tenants?search=a_m", None);
    assert_eq!(none["total"], 0, "a search's _ is no wildcard: {none}");
    let (_, past) = http2.authed("GET", "/api/tenants?page=99999999999", None);
    assert_eq!(
        (
            past["total"].as_u64(),
            past["data"].as_array().map(Vec::len)
        ),
        (Some(1), Some(0)),
        "{past}"
    );
    // Delete through the second: the first drops it within a second.
    assert_eq!(http2.authed("DELETE", "/api/tenants/acme", None).0, 204);
    let started = std::time::Instant::now();
    let mut gone = false;
    while started.elapsed() < Duration::from_secs(1) {
        if let Err(e) = connect(&one, &conninfo).await {
            if code_of(&e) == "3D000" {
                gone = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        gone,
        "the delete was live on the first node within a second"
    );
}

/// The management API against its own OpenAPI document, by schemathesis (PyPI): generated
/// valid and invalid requests to every route, responses checked against the document (status
/// codes, content types, schemas), bounded in time and seeded so a run is repeatable.
/// Excluded: "schema-valid request rejected" (positive_data_acceptance), since the tenant body
/// has rules across fields that OpenAPI 3.0 cannot state (one `is_manager` user when
/// `require_user` is false, distinct user names); the document says them in words, and the
/// server answers them with 422 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_conforms_to_its_openapi_document() {
    let (shoal, _http, _data) = shoal_with_api("");
    let base = format!("http://{}", shoal.api.expect("the API listens"));
    let token = jwt(json!({"role": "api"}));
    // Its caches go to a scratch directory, not the source tree.
    let scratch = tempfile::tempdir().unwrap();
    let cwd = scratch.path().to_owned();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .current_dir(&cwd)
            .args(["-m", "schemathesis.cli", "run"])
            .arg(format!("{base}/api/openapi.json"))
            .args(["-H", &format!("Authorization: Bearer {token}")])
            .args([
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
            ])
            .args([
                "--max-examples",
                "40",
                "--seed",
                "20261125",
                "--max-failures",
                "20",
            ])
            .args(["--request-timeout", "10"])
            .env("NO_COLOR", "1")
            .output()
            .expect("python3 runs (scripts/test installs schemathesis)")
    })
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        !text.contains("No module named"),
        "schemathesis is not installed (scripts/test installs it): {text}"
    );
    assert!(out.status.success(), "conformance failures:\n{text}");
}

/// The shared store over TLS, verified like any upstream (`sslmode = "verify-full"` with the
/// store's CA): tenants are stored and read through it, and PostgreSQL sees the store's
/// connections encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_store_speaks_tls() {
    let (ca, cert, key) = common::ca_and_server_cert();
    let port = free_port();
    let tls_pg = Pg::start_with(
        port,
        &[("server.crt", &cert), ("server.key", &key)],
        "-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key",
    );
    tls_pg.create_database("meta");
    let data = tempfile::tempdir().unwrap();
    let ca_path = data.path().join("ca.pem");
    std::fs::write(&ca_path, ca).unwrap();
    let url = format!("postgres://app:{APP_PASSWORD}@localhost:{port}/meta");
    let config = base_config(
        pg(),
        &[],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\n[store]\nurl = \"{url}\"\ndata_dir = \"{}\"\n\
             sslmode = \"verify-full\"\nsslrootcert = \"{}\"\n",
            data.path().display(),
            ca_path.display()
        ),
    );
    let key = "cd".repeat(32);
    let shoal = Shoal::start_with_env(
        &config,
        &[("API_JWT_SECRET", JWT_SECRET), ("SHOAL_ENC_KEY", &key)],
    );
    let http = Http::new(&shoal);
    let db = unique_db("tlsstore");
    pg().create_database(&db);
    let (code, body) = http.authed("PUT", "/api/tenants/acme", Some(tenant_body(pg(), &db, 2)));
    assert_eq!(code, 201, "{body}");
    let (code, got) = http.authed("GET", "/api/tenants/acme", None);
    assert_eq!(code, 200);
    assert_eq!(got["data"]["db_database"], db.as_str());
    let encrypted = tls_pg.psql_admin(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
         WHERE datname = 'meta' AND ssl",
    );
    assert_ne!(encrypted.trim(), "0", "the store's connections use TLS");
    tls_pg.stop();
}

/// Two nodes of a cluster sharing a tenant store: a tenant's client reaches the tenant's
/// pool whichever node it connects to (one owns the pool, the other relays to it), routed by
/// `user.tenant`, and tenants stay apart through the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_served_through_either_node_of_a_cluster() {
    let etcd = common::etcd::Etcd::start();
    let meta = unique_db("meta");
    pg().create_database(&meta);
    let (db1, db2) = (unique_db("tclu"), unique_db("tclu"));
    pg().create_database(&db1);
    pg().create_database(&db2);
    let url = format!(
        "postgres://app:{APP_PASSWORD}@127.0.0.1:{}/{meta}",
        pg().port
    );
    let key = "cd".repeat(32);
    let secret = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");
    let start = |id: &str| {
        let data = tempfile::tempdir().unwrap();
        let config = base_config(
            pg(),
            &[],
            &format!(
                "[api]\nlisten = \"127.0.0.1:0\"\n[store]\nurl = \"{url}\"\ndata_dir = \"{}\"\n\
                 [cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n",
                data.path().display(),
                etcd.url,
                secret.0
            ),
        );
        let s = Shoal::start_with_env(
            &config,
            &[
                ("API_JWT_SECRET", JWT_SECRET),
                ("SHOAL_ENC_KEY", &key),
                secret,
            ],
        );
        (s, data)
    };
    let (one, _d1) = start("one");
    let (two, _d2) = start("two");
    let http = Http::new(&one);
    for (t, db) in [("acme", &db1), ("umbrella", &db2)] {
        let (code, body) = http.authed(
            "PUT",
            &format!("/api/tenants/{t}"),
            Some(tenant_body(pg(), db, 2)),
        );
        assert_eq!(code, 201, "{body}");
    }
    for (t, db) in [("acme", &db1), ("umbrella", &db2)] {
        let conninfo = format!("user=app.{t} password={APP_PASSWORD}");
        for node in [&one, &two] {
            // The store's change reaches the other node within a moment.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            let c = loop {
                match connect(node, &conninfo).await {
                    Ok(c) => break c,
                    Err(e) => assert!(std::time::Instant::now() < deadline, "{e:?}"),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(&current_db(&c).await, db);
        }
    }
    // Each tenant's pool is owned by one node; the other relayed to it.
    for t in ["acme", "umbrella"] {
        let owns =
            |n: &Shoal| {
                n.log.lock().unwrap().iter().any(|l| {
                    l.contains("pool owned by this node") && l.contains(&format!("{t}/app"))
                })
            };
        assert!(owns(&one) != owns(&two), "tenant {t}: exactly one owner");
    }
}
