//! The dashboard in a real browser: Debian's Chromium, headless, driven by playwright-core
//! (`tests/clients/dashboard/dashboard.mjs`) against a real Shoal with pgbench and psql
//! going through it. Screenshots are kept in `target/dashboard-screenshots/`.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;

use common::*;

#[test]
fn an_operator_watches_pools_and_manages_tenants_in_chromium() {
    let db = unique_db("dashb");
    pg().create_database(&db);
    let data = tempfile::tempdir().unwrap();
    let extra = format!(
        "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
         [pool]\nquery_wait_timeout = 10\nslow_query_threshold = 0.2\n",
        data.path().display()
    );
    let s = Shoal::start_with_env(
        &base_config(pg(), &[&db], &extra),
        &[("SHOAL_API_TOKEN", API_TEST_TOKEN)],
    );
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let shots = format!("{root}/target/dashboard-screenshots");
    let out = Command::new("node")
        .arg(format!("{root}/tests/clients/dashboard/dashboard.mjs"))
        .env(
            "SHOAL_UI",
            format!("http://{}/ui", s.api.expect("api listener")),
        )
        .env("SHOAL_TOKEN", API_TEST_TOKEN)
        .env("SHOAL_HOST", s.addr.ip().to_string())
        .env("SHOAL_PORT", s.addr.port().to_string())
        .env("DB", &db)
        .env("PG_PORT", pg().port.to_string())
        .env("PGPASSWORD", APP_PASSWORD)
        .env("SCREENSHOTS", &shots)
        .output()
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser test failed:\n{stderr}\n{stdout}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("a JSON summary");
    assert_eq!(
        summary["steps"].as_array().map(Vec::len),
        Some(12),
        "every step ran: {summary}"
    );
}

/// On a node of a two-node cluster the Cluster section is offered (and no section that is
/// not configured), listing both nodes and the pool's owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_section_shows_the_nodes_and_owners() {
    let etcd = common::etcd::Etcd::start();
    let db = unique_db("dashc");
    pg().create_database(&db);
    let secret = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");
    let data: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes: Vec<Shoal> = ["a", "b"]
        .iter()
        .zip(&data)
        .map(|(id, dir)| {
            let extra = format!(
                "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n\
                 [cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n",
                dir.path().display(),
                etcd.url,
                secret.0
            );
            Shoal::start_with_env(
                &base_config(pg(), &[&db], &extra),
                &[secret, ("SHOAL_API_TOKEN", API_TEST_TOKEN)],
            )
        })
        .collect();
    for n in &nodes {
        n.connect(&db).await.simple_query("SELECT 1").await.unwrap();
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new("node")
        .arg(format!("{root}/tests/clients/dashboard/sections.mjs"))
        .env(
            "SHOAL_UI",
            format!("http://{}/ui", nodes[0].api.expect("api listener")),
        )
        .env("SHOAL_TOKEN", API_TEST_TOKEN)
        .env("NODES", "2")
        .env("POOL", &db)
        .env(
            "SCREENSHOTS",
            format!("{root}/target/dashboard-screenshots"),
        )
        .output()
        .expect("node runs");
    assert!(
        out.status.success(),
        "the cluster page failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}
