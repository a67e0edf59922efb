//! pgbench through Shoal: the classic load, asserting correctness (not speed).
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::process::Command;

use common::*;

/// A run that stalls (a lost wake-up in the relay leaves a client waiting for ever) fails
/// after this long instead of holding the suite until CI's own limit.
const STALL_LIMIT_SECS: &str = "240";

fn pgbench(shoal: &Shoal, db: &str, args: &[&str]) -> String {
    // coreutils' timeout: exit status 124 when the limit ended the run.
    let out = Command::new("timeout")
        .args(["--kill-after=5", STALL_LIMIT_SECS])
        .arg(pg().bin("pgbench"))
        .env("PGPASSWORD", APP_PASSWORD)
        .args(["-h", "127.0.0.1", "-U", "app"])
        .arg("-p")
        .arg(shoal.port().to_string())
        .args(args)
        .arg(db)
        .output()
        .expect("pgbench runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(
        out.status.code(),
        Some(124),
        "pgbench stalled: still running after {STALL_LIMIT_SECS} s: {text}"
    );
    assert!(out.status.success(), "pgbench failed: {text}");
    text
}

fn processed_and_failed(report: &str) -> (u64, u64) {
    let num = |prefix: &str| -> u64 {
        report
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == '/').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no '{prefix}' in pgbench output: {report}"))
    };
    (
        num("number of transactions actually processed: "),
        num("number of failed transactions: "),
    )
}

#[test]
fn pgbench_select_only_100_clients_through_pool_of_10() {
    let db = unique_db("bench");
    pg().create_database(&db);
    let shoal = Shoal::start(&base_config(pg(), &[&db], "[pool]\npool_size = 10\n"));
    pgbench(&shoal, &db, &["-i", "-q", "-s", "1"]);
    let report = pgbench(&shoal, &db, &["-S", "-c", "100", "-j", "2", "-T", "10"]);
    let (processed, failed) = processed_and_failed(&report);
    assert_eq!(failed, 0, "{report}");
    assert!(processed > 0, "{report}");
    assert!(pg().backends(&db) <= 10);
}

#[test]
fn pgbench_tpcb_extended_protocol() {
    let db = unique_db("bench");
    pg().create_database(&db);
    let shoal = Shoal::start(&base_config(pg(), &[&db], "[pool]\npool_size = 5\n"));
    pgbench(&shoal, &db, &["-i", "-q", "-s", "1"]);
    let report = pgbench(
        &shoal,
        &db,
        &["-M", "extended", "-c", "20", "-j", "2", "-t", "50"],
    );
    let (processed, failed) = processed_and_failed(&report);
    assert_eq!((processed, failed), (1000, 0), "{report}");
    // Every transaction's effect is there: pgbench_history got one row each.
    let out = Command::new("psql")
        .env("PGPASSWORD", APP_PASSWORD)
        .args([
            "-X",
            "-At",
            "-h",
            "127.0.0.1",
            "-U",
            "app",
            "-c",
            "SELECT count(*) FROM pgbench_history",
        ])
        .arg("-p")
        .arg(pg().port.to_string())
        .arg(&db)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1000");
}
