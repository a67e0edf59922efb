//! TLS from Shoal to PostgreSQL in each `sslmode`, against a PostgreSQL started with
//! `ssl = on` and a certificate made at run time for `localhost` only.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sslmode_against_a_tls_server() {
    let (ca, cert, key) = common::ca_and_server_cert();
    let port = free_port();
    let tls_pg = Pg::start_with(
        port,
        &[("server.crt", &cert), ("server.key", &key)],
        "-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key",
    );
    let dir = tempfile::tempdir().unwrap();
    let ca_path = dir.path().join("ca.pem");
    std::fs::write(&ca_path, ca).unwrap();
    let ca_path = ca_path.display();
    let db = |name: &str, host: &str, mode: &str| {
        format!(
            "[databases.{name}]\nhost = \"{host}\"\nport = {port}\ndbname = \"app\"\nsslmode = \"{mode}\"\nsslrootcert = \"{ca_path}\"\n"
        )
    };
    let plain_pg = pg();
    let extra = [
        db("plain", "127.0.0.1", "disable"),
        db("preferred", "127.0.0.1", "prefer"),
        db("required", "127.0.0.1", "require"),
        db("chain", "127.0.0.1", "verify-ca"),
        db("full", "localhost", "verify-full"),
        db("mismatch", "127.0.0.1", "verify-full"),
        format!(
            "[databases.nossl]\nhost = \"127.0.0.1\"\nport = {}\ndbname = \"app\"\nsslmode = \"require\"\n",
            plain_pg.port
        ),
    ]
    .concat();
    let shoal = Shoal::start(&base_config(plain_pg, &[], &extra));
    let ssl_in_use = "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    for (name, expected) in [
        ("plain", "false"),
        ("preferred", "true"),
        ("required", "true"),
        ("chain", "true"),
        ("full", "true"),
    ] {
        let c = shoal.connect(name).await;
        assert_eq!(simple_rows(&c, ssl_in_use).await, vec![expected], "{name}");
    }
    // verify-full with a name the certificate does not have: refused, saying why and naming
    // the pool, without the upstream address.
    let e = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "mismatch"))
        .await
        .err()
        .unwrap();
    let text = format!("{e:?}");
    assert_eq!(code(&e), "08006", "{text}");
    assert!(
        text.contains("mismatch/app") && text.contains("TLS"),
        "{text}"
    );
    assert!(!text.contains(&port.to_string()), "{text}");
    // require against a server without SSL.
    let e = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "nossl"))
        .await
        .err()
        .unwrap();
    assert!(format!("{e:?}").contains("does not support SSL"), "{e:?}");
    tls_pg.stop();
}
