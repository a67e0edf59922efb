//! The dashboard's server side against a real Shoal: nothing without a session; a login
//! with the API's token opens one in an HttpOnly, SameSite=Strict cookie; the feed's
//! numbers move with traffic through Shoal; the pools page is sorted, filtered and paged on
//! the server; the tenant routes answer the session as the API does; requests from another
//! site's page are refused; logging out ends the session. (The page itself is driven in a
//! browser by `dashboard_browser.rs`.)
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// `curl` to the dashboard as its page would send it (a change with the page's `Origin`,
/// as a browser's `fetch` sends it): the status, the `Set-Cookie` header (if any) and the
/// body.
fn ui(s: &Shoal, method: &str, path: &str, cookie: &str, body: &str) -> (u16, String, String) {
    if method == "GET" {
        return ui_with(s, method, path, cookie, body, &[]);
    }
    let origin = format!("Origin: http://{}", s.api.expect("api listener"));
    ui_with(s, method, path, cookie, body, &[&origin])
}

/// [`ui`] with more headers.
fn ui_with(
    s: &Shoal,
    method: &str,
    path: &str,
    cookie: &str,
    body: &str,
    headers: &[&str],
) -> (u16, String, String) {
    let mut cmd = Command::new("curl");
    for h in headers {
        cmd.args(["-H", h]);
    }
    let out = cmd
        .args(["-s", "-D", "-", "-X", method])
        .arg(format!("http://{}{path}", s.api.expect("api listener")))
        .args(["-H", &format!("Cookie: {cookie}")])
        .args(["-H", "Content-Type: application/json", "--data-raw", body])
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let set_cookie = head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .unwrap_or("")
        .to_owned();
    (status, set_cookie, body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_needs_a_session_and_moves_with_traffic() {
    let db = unique_db("dash");
    pg().create_database(&db);
    let data = tempfile::tempdir().unwrap();
    let extra = format!(
        "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n",
        data.path().display()
    );
    let s = Shoal::start_with_env(
        &base_config(pg(), &[&db], &extra),
        &[("SHOAL_API_TOKEN", API_TEST_TOKEN)],
    );
    // Nothing without a session, and no session from a wrong token.
    assert_eq!(ui(&s, "GET", "/ui/feed", "", "").0, 401);
    let (status, cookie, _) = ui(&s, "POST", "/ui/login", "", r#"{"token": "wrong"}"#);
    assert_eq!((status, cookie.as_str()), (401, ""));
    assert_eq!(
        ui(&s, "GET", "/ui/feed", "shoal_ui=made-up", "").0,
        401,
        "a made-up session is none"
    );
    let login = format!(r#"{{"token": "{API_TEST_TOKEN}"}}"#);
    let (status, cookie, _) = ui(&s, "POST", "/ui/login", "", &login);
    assert_eq!(status, 204);
    assert!(
        cookie.contains("HttpOnly")
            && cookie.contains("SameSite=Strict")
            && cookie.contains("Path=/ui"),
        "{cookie}"
    );
    let session = cookie.split(';').next().unwrap().trim().to_owned();
    // Traffic through Shoal shows up in the feed.
    let c = s.connect(&db).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        for _ in 0..20 {
            c.simple_query("SELECT 1").await.unwrap();
        }
        let (status, _, body) = ui(&s, "GET", "/ui/feed", &session, "");
        assert_eq!(status, 200, "{body}");
        let feed: serde_json::Value = serde_json::from_str(&body).unwrap();
        let moved = feed["samples"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["transactions"].as_f64().unwrap_or(0.0) > 0.0 && x["pools"] == 1);
        if moved {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the feed never moved: {feed}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Logging out ends the session.
    let (status, cookie, _) = ui(&s, "POST", "/ui/logout", &session, "");
    assert_eq!(status, 204);
    assert!(cookie.contains("Max-Age=0"), "{cookie}");
    assert_eq!(ui(&s, "GET", "/ui/feed", &session, "").0, 401);
}

/// A Shoal with the API and one database, and a session cookie for its dashboard.
fn logged_in(db: &str, data: &std::path::Path) -> (Shoal, String) {
    let extra = format!(
        "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n",
        data.display()
    );
    let s = Shoal::start_with_env(
        &base_config(pg(), &[db], &extra),
        &[("SHOAL_API_TOKEN", API_TEST_TOKEN)],
    );
    let login = format!(r#"{{"token": "{API_TEST_TOKEN}"}}"#);
    let (status, cookie, _) = ui(&s, "POST", "/ui/login", "", &login);
    assert_eq!(status, 204);
    let session = cookie.split(';').next().unwrap().trim().to_owned();
    (s, session)
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_sections_and_tenants_answer_a_session_only() {
    let db = unique_db("dashp");
    pg().create_database(&db);
    let data = tempfile::tempdir().unwrap();
    let (s, session) = logged_in(&db, data.path());
    for path in [
        "/ui/api/pools",
        "/ui/api/pool?name=x",
        "/ui/api/sections",
        "/ui/api/tenants",
        "/ui/api/tenants/acme",
    ] {
        let (status, _, body) = ui(&s, "GET", path, "", "");
        assert_eq!(status, 401, "{path}: {body}");
        assert!(json(&body)["error"].is_string(), "{path}: {body}");
    }
    // Another site's page is refused even with the cookie.
    let (status, _, body) = ui_with(
        &s,
        "DELETE",
        "/ui/api/tenants/acme",
        &session,
        "",
        &["Origin: https://elsewhere.example"],
    );
    assert_eq!(status, 401, "the tenant routes refuse it: {body}");
    let (status, _, _) = ui_with(
        &s,
        "GET",
        "/ui/api/pools",
        &session,
        "",
        &["Origin: https://elsewhere.example"],
    );
    assert_eq!(status, 403);
    // The page and its files, locked down.
    let (status, _, body) = ui_with(&s, "GET", "/ui", "", "", &[]);
    assert_eq!(status, 200);
    assert!(body.contains("<title>Shoal</title>"), "{body}");
    let head = Command::new("curl")
        .args(["-s", "-D", "-", "-o", "/dev/null"])
        .arg(format!("http://{}/ui/assets/app.js", s.api.unwrap()))
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&head.stdout).to_lowercase();
    assert!(
        head.contains("content-security-policy: default-src 'none'; script-src 'self'"),
        "{head}"
    );
    assert!(head.contains("text/javascript"), "{head}");
    assert_eq!(ui(&s, "GET", "/ui/assets/nope.js", "", "").0, 404);

    // Pools: sorted, filtered and paged on the server, with their sparklines.
    let c = s.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    let (status, _, body) = ui(&s, "GET", "/ui/api/pools?per_page=0", &session, "");
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = ui(
        &s,
        "GET",
        "/ui/api/pools?filter=nothing-like-it",
        &session,
        "",
    );
    assert_eq!(status, 200);
    assert_eq!(json(&body)["total"], 0, "{body}");
    let page = eventually_json(
        &s,
        &session,
        "/ui/api/pools?sort=tps&desc=true&per_page=1",
        |p| {
            p["data"][0]["spark"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        },
    )
    .await;
    assert_eq!(page["total"], 1, "{page}");
    let row = &page["data"][0];
    assert_eq!(row["database"], db.as_str(), "{page}");
    assert_eq!(row["user"], "app");
    assert_eq!(row["cl_active"], 1, "{page}");
    let name = row["name"].as_str().unwrap().to_owned();
    let (status, _, body) = ui(
        &s,
        "GET",
        &format!("/ui/api/pool?name={}", name.replace('/', "%2F")),
        &session,
        "",
    );
    assert_eq!(status, 200, "{body}");
    let pool = json(&body);
    assert_eq!(pool["pool"]["name"], name.as_str());
    assert_eq!(pool["servers"].as_array().map(Vec::len), Some(1), "{pool}");
    assert_eq!(pool["slow_threshold_ms"], 0);
    assert_eq!(ui(&s, "GET", "/ui/api/pool?name=gone", &session, "").0, 404);

    // Sections: none of the optional features is configured here.
    let (_, _, body) = ui(&s, "GET", "/ui/api/sections", &session, "");
    let sections = json(&body);
    for f in ["cluster", "realtime", "replicas", "cache"] {
        assert!(sections[f].is_null(), "{f}: {sections}");
    }

    // Tenants, as the API answers: created, found by search, patched with its users (a
    // user sent without a password keeps it), a new user without one refused.
    let body = tenant_body(pg(), &db, serde_json::json!({}));
    let (status, _, created) = ui(
        &s,
        "PUT",
        "/ui/api/tenants/dash-t",
        &session,
        &body.to_string(),
    );
    assert_eq!(status, 201, "{created}");
    let (_, _, found) = ui(&s, "GET", "/ui/api/tenants?search=DASH", &session, "");
    assert_eq!(json(&found)["total"], 1, "{found}");
    let (_, _, none) = ui(&s, "GET", "/ui/api/tenants?search=zzz", &session, "");
    assert_eq!(json(&none)["total"], 0, "{none}");
    let patch = serde_json::json!({"tenant": {"users": [{"db_user": "app", "pool_size": 3}]}});
    let (status, _, body) = ui(
        &s,
        "PATCH",
        "/ui/api/tenants/dash-t",
        &session,
        &patch.to_string(),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["data"]["users"][0]["pool_size"], 3, "{body}");
    let t = s.connect_as("app.dash-t", APP_PASSWORD, &db).await;
    t.simple_query("SELECT 1")
        .await
        .expect("the password was kept");
    let patch = serde_json::json!({"tenant": {"users": [
        {"db_user": "app"}, {"db_user": "newcomer"}
    ]}});
    let (status, _, body) = ui(
        &s,
        "PATCH",
        "/ui/api/tenants/dash-t",
        &session,
        &patch.to_string(),
    );
    assert_eq!(status, 422, "{body}");
    assert!(
        json(&body)["errors"]["users[1].db_password"].is_array(),
        "{body}"
    );

    // A change never comes from a GET, nor from a request without the page's Origin: an
    // <img> or a link on another page (another port of this host included) cannot act.
    let (status, _, body) = ui(&s, "GET", "/ui/api/tenants/dash-t/terminate", &session, "");
    assert_eq!(status, 405, "terminate is not a GET here: {body}");
    let (status, _, body) = ui_with(
        &s,
        "POST",
        "/ui/api/tenants/dash-t/terminate",
        &session,
        "",
        &[],
    );
    assert_eq!(status, 401, "no Origin: {body}");
    let origin = format!("Origin: http://{}", s.api.unwrap());
    let (status, _, body) = ui_with(
        &s,
        "POST",
        "/ui/api/tenants/dash-t/terminate",
        &session,
        "",
        &[&origin, "Sec-Fetch-Site: same-site"],
    );
    assert_eq!(status, 401, "another port's page: {body}");
    t.simple_query("SELECT 1")
        .await
        .expect("nothing was terminated by the refused requests");
    let (status, _, body) = ui(&s, "POST", "/ui/api/tenants/dash-t/terminate", &session, "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["clients"], 1, "{body}");
}

/// Polls a dashboard route until `ok` holds for its JSON.
async fn eventually_json(
    s: &Shoal,
    session: &str,
    path: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, _, body) = ui(s, "GET", path, session, "");
        assert_eq!(status, 200, "{body}");
        let v = json(&body);
        if ok(&v) {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "{path}: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_realtime_and_cache_sections_appear_when_configured() {
    let pg = common::changes::logical_pg();
    let db = unique_db("dashs");
    pg.create_database(&db);
    direct_on(pg, &db)
        .await
        .batch_execute(
            "CREATE TABLE items (id int, name text); INSERT INTO items VALUES (1, 'one')",
        )
        .await
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let extra = format!(
        "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
         [realtime]\nlisten = \"127.0.0.1:0\"\n",
        data.path().display()
    );
    let config = base_config(pg, &[&db], &extra).replace(
        &format!("[databases.{db}]\n"),
        &format!("[databases.{db}]\ncache = true\ncache_all_reads = true\n"),
    );
    let s = Shoal::start_with_env(&config, &[("SHOAL_API_TOKEN", API_TEST_TOKEN)]);
    let login = format!(r#"{{"token": "{API_TEST_TOKEN}"}}"#);
    let (_, cookie, _) = ui(&s, "POST", "/ui/login", "", &login);
    let session = cookie.split(';').next().unwrap().trim().to_owned();
    let c = s.connect(&db).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let sections = loop {
        c.simple_query("SELECT name FROM items WHERE id = 1")
            .await
            .unwrap();
        let (_, _, body) = ui(&s, "GET", "/ui/api/sections", &session, "");
        let v = json(&body);
        if v["cache"][0]["hits"].as_u64().unwrap_or(0) > 0 {
            break v;
        }
        assert!(tokio::time::Instant::now() < deadline, "no cache hit: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let cache = &sections["cache"][0];
    assert!(
        cache["hit_ratio"].as_f64().is_some_and(|r| r > 0.0),
        "{sections}"
    );
    assert!(cache["entries"].as_u64().unwrap_or(0) >= 1, "{sections}");
    assert!(
        sections["realtime"].is_array(),
        "realtime is configured: {sections}"
    );
    assert!(
        sections["cluster"].is_null() && sections["replicas"].is_null(),
        "{sections}"
    );
}
