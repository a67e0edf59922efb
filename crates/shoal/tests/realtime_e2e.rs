//! Supabase Realtime's own end-to-end tool (`realtime-check.ts` from supabase/realtime,
//! unmodified, run with Bun from npm) against Shoal: every suite it has, functional and
//! load. Beside Shoal's realtime it needs Supabase's Auth and PostgREST, played by the
//! stand-ins of `tests/clients/realtime-e2e/standins.mjs`, and a database as Supabase's
//! image sets it up (the API roles and their default privileges). The tool's own SQL (Bun's
//! driver) and the stand-ins' REST statements reach the database through Shoal's pooler.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::changes::*;
use common::*;
use tokio::io::AsyncBufReadExt;

const E2E: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/clients/realtime-e2e/"
);

/// What Supabase's Postgres image gives a project's database before anything else runs:
/// the API roles, and table privileges for them on whatever the owner creates in `public`.
const SUPABASE_IMAGE: &str = "
    GRANT USAGE ON SCHEMA public TO anon, authenticated, service_role;
    ALTER DEFAULT PRIVILEGES IN SCHEMA public
      GRANT ALL ON TABLES TO anon, authenticated, service_role;
    ALTER DEFAULT PRIVILEGES IN SCHEMA public
      GRANT ALL ON SEQUENCES TO anon, authenticated, service_role;
    ALTER DEFAULT PRIVILEGES IN SCHEMA public
      GRANT ALL ON FUNCTIONS TO anon, authenticated, service_role;
    CREATE PUBLICATION supabase_realtime;";

/// A project key: a long-lived token with `role`, as Supabase issues its anon and service keys.
fn key(role: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": role, "iss": "supabase", "iat": now(), "exp": now() + 86_400}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

/// Starts the Auth/PostgREST stand-ins in front of Shoal; the child and its port.
async fn standins(s: &Setup) -> (tokio::process::Child, u16) {
    let mut child = tokio::process::Command::new("node")
        .arg(format!("{E2E}standins.mjs"))
        .env("REALTIME", s.rt.to_string())
        .env("TENANT", "acme")
        .env("JWT_SECRET", SECRET)
        .env("DATABASE_URL", database_url(s))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines
        .next_line()
        .await
        .unwrap()
        .expect("the stand-ins start");
    let port = first
        .strip_prefix("listening ")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line: {first}"));
    (child, port)
}

fn database_url(s: &Setup) -> String {
    format!(
        "postgresql://app.acme:{APP_PASSWORD}@{}/{}?sslmode=disable",
        s.shoal.addr, s.db
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn supabases_own_e2e_tool_passes_against_shoal() {
    let pg = logical_pg();
    pg.psql_admin(
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'service_role') THEN
             CREATE ROLE service_role NOLOGIN BYPASSRLS;
           END IF;
         END $$",
    );
    let s = setup_on(pg, "rt_e2e", SUPABASE_IMAGE);
    eventually(
        "Shoal installs its realtime schema",
        Duration::from_secs(30),
        || {
            run_sql(
                pg,
                &s.db,
                "SELECT to_regclass('realtime.messages') IS NOT NULL",
            ) == "t"
        },
    )
    .await;
    let (_standins, port) = standins(&s).await;
    let out = tokio::process::Command::new(format!("{E2E}node_modules/.bin/bun"))
        .arg(format!("{E2E}supabase/realtime-check.ts"))
        .args(["--env", "local", "--json"])
        .args(["--url", &format!("http://127.0.0.1:{port}")])
        .args(["--db-url", &database_url(&s)])
        .args(["--publishable-key", &key("anon")])
        .args(["--secret-key", &key("service_role")])
        .current_dir(E2E)
        .stderr(Stdio::piped())
        .output()
        .await
        .expect("bun runs");
    let log = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {}\n{log}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let failed: Vec<String> = report["suites"]
        .as_object()
        .expect("suites")
        .iter()
        .flat_map(|(suite, r)| {
            r["tests"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|t| t["passed"] != true)
                .map(move |t| format!("{suite} / {}: {}", t["name"], t["error"]))
        })
        .collect();
    let summary = &report["summary"];
    eprintln!("realtime-check: {summary}");
    assert!(
        failed.is_empty(),
        "realtime-check {summary}; failed:\n{}\n{log}",
        failed.join("\n")
    );
    assert_eq!(
        summary["total"], 52,
        "every test of the tool ran: {summary}"
    );
}
