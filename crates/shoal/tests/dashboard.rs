//! The dashboard's server side against a real Shoal: nothing without a session; a login
//! with the API's token opens one in an HttpOnly, SameSite=Strict cookie; the feed's
//! numbers move with traffic through Shoal; logging out ends the session.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// `curl` to the dashboard: the status, the `Set-Cookie` header (if any) and the body.
fn ui(s: &Shoal, method: &str, path: &str, cookie: &str, body: &str) -> (u16, String, String) {
    let out = Command::new("curl")
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
