//! Real client libraries against Shoal in transaction mode, with many more workers than the
//! pool has servers (`tests/clients/`; dependencies are installed by `scripts/test`).
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

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
    let text = run_program(program, args, dir, &target(shoal.port(), &db));
    within_pool_of_four(&db);
    text
}

/// Waits until `db` has at most the pool's 4 servers (the pool's listener connection for
/// LISTEN/NOTIFY closes once nobody listens; a cluster's owner holds its fence session
/// beside them).
fn within_pool_of_four(db: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pg().servers(db) > 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool of 4 was not respected"
        );
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
}

/// Runs a suite (`program args... target... 20`) in `dir`; its output, which it must end
/// successfully.
fn run_program<S: AsRef<std::ffi::OsStr>>(
    program: &str,
    args: &[S],
    dir: &str,
    target: &[String],
) -> String {
    let out = Command::new(program)
        .current_dir(dir)
        .args(args)
        .args(target)
        .arg("20")
        .output()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} suite failed:\n{text}");
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

/// A CA and a certificate it signs for `localhost` and 127.0.0.1 (made now, no key checked
/// in), and the `[tls]` section requiring TLS with it; the CA is `ca.pem` in `dir`.
fn tls_required(dir: &std::path::Path) -> String {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Shoal clients test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_tls = \"require\"\n",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    )
}

/// The same suites over TLS (Shoal requiring it): psycopg 3 and asyncpg, node-postgres, pgx;
/// each once encrypting only (`sslmode=require`) and once verifying the certificate and the
/// host name against the CA (`verify-full`).
#[test]
fn client_libraries_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    let tls = tls_required(dir.path());
    let ca = dir.path().join("ca.pem").display().to_string();
    let url = |mode: &'static str| {
        let ca = ca.clone();
        move |port: u16, db: &str| {
            vec![match mode {
                "verify-full" => format!(
                    "postgresql://app:{APP_PASSWORD}@127.0.0.1:{port}/{db}?sslmode=verify-full&sslrootcert={ca}"
                ),
                _ => format!("postgresql://app:{APP_PASSWORD}@127.0.0.1:{port}/{db}?sslmode={mode}"),
            }]
        }
    };
    let py = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/python/compat.py"
    );
    let node = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/node/compat.js"
    );
    let go = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/go");
    // libpq's asynchronous API over TLS with results of many sizes: no stall.
    let sizes = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/clients/python/tls_sizes.py"
    );
    let text = run_with_config("python3", &[sizes], ".", &tls, url("require"));
    assert!(text.contains("result sizes"), "{text}");
    for (mode, node_mode) in [("require", "no-verify"), ("verify-full", "verify-full")] {
        let text = run_with_config("python3", &[py], ".", &tls, url(mode));
        assert!(
            text.contains("psycopg") && text.contains("asyncpg"),
            "{mode}: {text}"
        );
        let text = run_with_config("node", &[node], ".", &tls, url(node_mode));
        assert!(text.contains("node-postgres"), "{mode}: {text}");
        let text = run_with_config("go", &["run", "."], go, &tls, url(mode));
        assert!(text.contains("pgx v5"), "{mode}: {text}");
    }
}

/// The same suites through a node that relays every client to the pool's owner (a cluster
/// of two on a real etcd): prepared statements, SETs, COPY, LISTEN/NOTIFY, cancels and
/// errors, unchanged for the clients; the cluster holds at most the pool's size.
#[test]
fn client_libraries_through_a_relaying_node() {
    let etcd = common::etcd::Etcd::start();
    let db = unique_db("compat");
    pg().create_database(&db);
    let secret = ("SHOAL_CLUSTER_SECRET", "a-cluster-secret-for-tests");
    let node = |id: &str| {
        let extra = format!(
            "[pool]\npool_size = 4\n[cluster]\netcd = [\"{}\"]\nnode_id = \"{id}\"\nrelay_listen = \"127.0.0.1:0\"\nlease_ttl = 2\nsecret_env = \"{}\"\n",
            etcd.url, secret.0
        );
        Shoal::start_with_env(&base_config(pg(), &[&db], &extra), &[secret])
    };
    let (a, b) = (node("a"), node("b"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    for n in [&a, &b] {
        rt.block_on(async { n.connect(&db).await.simple_query("SELECT 1").await.unwrap() });
    }
    let relay = if a.log_contains("pool owned by this node") {
        &b
    } else {
        &a
    };
    assert!(!relay.log_contains("pool owned by this node"));
    let url = vec![format!(
        "postgresql://app:{APP_PASSWORD}@127.0.0.1:{}/{db}",
        relay.port()
    )];
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients");
    let suites: [(&str, Vec<String>, String, &str); 4] = [
        (
            "python3",
            vec![format!("{root}/python/compat.py")],
            ".".into(),
            "asyncpg",
        ),
        (
            "node",
            vec![format!("{root}/node/compat.js")],
            ".".into(),
            "node-postgres",
        ),
        (
            "go",
            vec!["run".into(), ".".into()],
            format!("{root}/go"),
            "pgx v5",
        ),
        (
            "java",
            vec![
                "-cp".into(),
                "lib/postgresql-42.7.4.jar".into(),
                "Compat.java".into(),
            ],
            format!("{root}/java"),
            "pgJDBC",
        ),
    ];
    for (program, args, dir, says) in suites {
        let target = if program == "java" {
            vec![
                format!("jdbc:postgresql://127.0.0.1:{}/{db}", relay.port()),
                "app".into(),
                APP_PASSWORD.into(),
            ]
        } else {
            url.clone()
        };
        let text = run_program(program, &args, &dir, &target);
        assert!(text.contains(says), "{text}");
        assert!(!relay.log_contains("pool owned by this node"));
    }
    // Four servers at most across the cluster.
    within_pool_of_four(&db);
}
