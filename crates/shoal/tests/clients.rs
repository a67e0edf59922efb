//! Real client libraries against Shoal in transaction mode, with many more workers than the
//! pool has servers (`tests/clients/`; dependencies are installed by `scripts/test`).

mod common;

use std::process::Command;

use common::*;

fn run_suite(program: &str, args: &[&str]) -> String {
    run_suite_in(program, args, ".")
}

fn run_suite_in(program: &str, args: &[&str], dir: &str) -> String {
    run_with(program, args, dir, |port, db| {
        vec![format!(
            "postgresql://app:{APP_PASSWORD}@127.0.0.1:{port}/{db}"
        )]
    })
}

fn run_with(
    program: &str,
    args: &[&str],
    dir: &str,
    target: impl Fn(u16, &str) -> Vec<String>,
) -> String {
    run_with_config(program, args, dir, "", target)
}

fn run_with_config(
    program: &str,
    args: &[&str],
    dir: &str,
    extra: &str,
    target: impl Fn(u16, &str) -> Vec<String>,
) -> String {
    let db = unique_db("compat");
    let shoal = shoal_for(&db, &format!("[pool]\npool_size = 4\n{extra}"));
    let out = Command::new(program)
        .current_dir(dir)
        .args(args)
        .args(target(shoal.port(), &db))
        .arg("20")
        .output()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} suite failed:\n{text}");
    assert!(pg().backends(&db) <= 4, "the pool of 4 was respected");
    text
}

#[test]
fn python_psycopg3_and_asyncpg() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/python/compat.py"
    );
    let text = run_suite("python3", &[script]);
    assert!(
        text.contains("psycopg") && text.contains("asyncpg"),
        "{text}"
    );
    println!("{text}");
}

#[test]
fn node_postgres() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/node/compat.js"
    );
    let text = run_suite("node", &[script]);
    assert!(text.contains("node-postgres"), "{text}");
    println!("{text}");
}

#[test]
fn go_pgx_v5() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/go");
    let text = run_suite_in("go", &["run", "."], dir);
    assert!(text.contains("pgx v5"), "{text}");
    println!("{text}");
}

#[test]
fn java_pgjdbc() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/java");
    let text = run_with(
        "java",
        &["-cp", "lib/postgresql-42.7.4.jar", "Compat.java"],
        dir,
        |port, db| {
            vec![
                format!("jdbc:postgresql://127.0.0.1:{port}/{db}"),
                "app".into(),
                APP_PASSWORD.into(),
            ]
        },
    );
    assert!(text.contains("pgJDBC"), "{text}");
    println!("{text}");
}

/// A certificate for `localhost` (self-signed, made now) and the `[tls]` section requiring it.
fn tls_required(dir: &std::path::Path) -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_tls = \"require\"\n",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    )
}

/// The same suites over TLS (Shoal requiring it): psycopg 3 and asyncpg, node-postgres, pgx.
#[test]
fn client_libraries_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tls_required(dir.path());
    let url = |mode: &'static str| {
        move |port: u16, db: &str| {
            vec![format!(
                "postgresql://app:{APP_PASSWORD}@127.0.0.1:{port}/{db}?sslmode={mode}"
            )]
        }
    };
    let py = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/python/compat.py"
    );
    let text = run_with_config("python3", &[py], ".", &tls, url("require"));
    assert!(
        text.contains("psycopg") && text.contains("asyncpg"),
        "{text}"
    );
    let node = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/node/compat.js"
    );
    let text = run_with_config("node", &[node], ".", &tls, url("no-verify"));
    assert!(text.contains("node-postgres"), "{text}");
    let go = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/go");
    let text = run_with_config("go", &["run", "."], go, &tls, url("require"));
    assert!(text.contains("pgx v5"), "{text}");
}
