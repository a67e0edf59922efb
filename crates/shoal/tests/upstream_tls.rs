//! TLS from Shoal to PostgreSQL in each `sslmode`, against a PostgreSQL started with
//! `ssl = on` and a certificate made at run time for `localhost` only.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

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

/// A CA made now, and a certificate it signs (PEM: certificate, key).
struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    fn new() -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa { cert, key }
    }

    fn issue(&self, common_name: &str) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Client certificates per user (PostgreSQL's `cert` authentication maps each to its role),
/// one of them with a key encrypted under a password (libpq's `sslpassword`); a wrong
/// password is refused saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_per_user_and_encrypted_keys() {
    let ca = TestCa::new();
    let (server_cert, server_key) = ca.issue("localhost");
    let hba = "hostssl all certuser1 127.0.0.1/32 cert\n\
               hostssl all certuser2 127.0.0.1/32 cert\n\
               host all all 127.0.0.1/32 scram-sha-256\n";
    let port = free_port();
    let tls_pg = Pg::start_with(
        port,
        &[
            ("server.crt", &server_cert),
            ("server.key", &server_key),
            ("ca.crt", &ca.cert.pem()),
            ("pg_hba.conf", hba),
        ],
        "-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key -c ssl_ca_file=ca.crt",
    );
    tls_pg.psql_admin("CREATE ROLE certuser1 LOGIN; CREATE ROLE certuser2 LOGIN");
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (c1, k1) = ca.issue("certuser1");
    let (c2, k2) = ca.issue("certuser2");
    let (c1, k1, c2) = (
        file("c1.pem", &c1),
        file("k1.pem", &k1),
        file("c2.pem", &c2),
    );
    let plain2 = file("k2-plain.pem", &k2);
    let k2 = dir.path().join("k2.pem").display().to_string();
    let out = std::process::Command::new("openssl")
        .args([
            "pkcs8",
            "-topk8",
            "-v2",
            "aes-256-cbc",
            "-passout",
            "pass:key-secret",
        ])
        .args(["-in", &plain2, "-out", &k2])
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read_to_string(&k2)
        .unwrap()
        .contains("ENCRYPTED PRIVATE KEY"));
    let extra = format!(
        "[databases.certdb]\nhost = \"127.0.0.1\"\nport = {port}\ndbname = \"app\"\nsslmode = \"require\"\n\
         [users.certuser1]\nauth_method = \"trust\"\nsslcert = \"{c1}\"\nsslkey = \"{k1}\"\n\
         [users.certuser2]\nauth_method = \"trust\"\nsslcert = \"{c2}\"\nsslkey = \"{k2}\"\nsslpassword_env = \"SHOAL_TEST_KEY_PW\"\n\
         [users.wrongpw]\nauth_method = \"trust\"\nserver_user = \"certuser2\"\nsslcert = \"{c2}\"\nsslkey = \"{k2}\"\nsslpassword = \"not-it\"\n"
    );
    let shoal = Shoal::start_with_env(
        &base_config(pg(), &[], &extra),
        &[("SHOAL_TEST_KEY_PW", "key-secret")],
    );
    for user in ["certuser1", "certuser2"] {
        let (client, conn) = tokio_postgres::Config::new()
            .host("127.0.0.1")
            .port(shoal.port())
            .user(user)
            .dbname("certdb")
            .connect(tokio_postgres::NoTls)
            .await
            .unwrap_or_else(|e| panic!("{user}: {e:?}"));
        tokio::spawn(conn);
        let who = simple_rows(
            &client,
            "SELECT current_user || ' ' || client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        )
        .await;
        assert_eq!(who, vec![format!("{user} /CN={user}")]);
    }
    let Err(e) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(shoal.port())
        .user("wrongpw")
        .dbname("certdb")
        .connect(tokio_postgres::NoTls)
        .await
    else {
        panic!("a key decrypted with the wrong password");
    };
    assert!(format!("{e:?}").contains("sslpassword"), "{e:?}");
    let log = shoal.log.lock().unwrap();
    assert!(!log
        .iter()
        .any(|l| l.contains("key-secret") || l.contains("not-it")));
    drop(log);
    tls_pg.stop();
}
