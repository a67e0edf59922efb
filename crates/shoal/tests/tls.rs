//! Client-facing TLS with certificates made at run time (no key is checked in): libpq
//! (`psql`) with `sslmode=require` and `verify-full`, SNI choosing the certificate, a client
//! that starts TLS directly (ALPN `postgresql`), `client_tls = "require"`, and handshake
//! garbage.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Pki {
    dir: tempfile::TempDir,
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
}

impl Pki {
    /// A CA, and certificates it signs for `names` (plus 127.0.0.1), written as PEM files.
    fn new() -> Pki {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "Shoal test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let ca = params.self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki {
            dir,
            ca,
            ca_key: key,
        };
        std::fs::write(pki.path("ca.pem"), pki.ca.pem()).unwrap();
        pki
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Issues `<stem>.pem`/`<stem>.key` for `names`.
    fn issue(&self, stem: &str, names: &[&str]) {
        let mut sans: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        sans.push("127.0.0.1".into());
        let mut params = rcgen::CertificateParams::new(sans).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names[0]);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        std::fs::write(self.path(&format!("{stem}.pem")), cert.pem()).unwrap();
        std::fs::write(self.path(&format!("{stem}.key")), key.serialize_pem()).unwrap();
    }
}

fn shoal_with_tls(db: &str, pki: &Pki, mode: &str) -> Shoal {
    pki.issue("default", &["localhost"]);
    pki.issue("other", &["other.test"]);
    let tls = format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_tls = \"{mode}\"\n\
         [[tls.certificates]]\nserver_names = [\"other.test\"]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        pki.path("default.pem"),
        pki.path("default.key"),
        pki.path("other.pem"),
        pki.path("other.key"),
    );
    pg().create_database(db);
    Shoal::start(&base_config(pg(), &[db], &tls))
}

/// Runs `psql` through Shoal with a libpq connection string; returns (success, output).
fn psql(shoal: &Shoal, conn: &str, sql: &str) -> (bool, String) {
    let out = Command::new("psql")
        .arg(format!("port={} {conn}", shoal.port()))
        .args(["-X", "-At", "-c", sql])
        .env("PGPASSWORD", APP_PASSWORD)
        .env("PGCONNECT_TIMEOUT", "10")
        .output()
        .expect("psql runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text.trim().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_over_tls_with_sni_and_verification() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "allow");
    let ca = pki.path("ca.pem");
    // require: encrypted, no verification.
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=require"),
        "SELECT 1",
    );
    assert!(ok && out == "1", "{out}");
    // verify-full against the default certificate's name.
    let (ok, out) = psql(
        &shoal,
        &format!("host=localhost hostaddr=127.0.0.1 user=app dbname={db} sslmode=verify-full sslrootcert={ca}"),
        "SELECT 2",
    );
    assert!(ok && out == "2", "{out}");
    // SNI picks the other certificate: verify-full for other.test passes only with it.
    let (ok, out) = psql(
        &shoal,
        &format!("host=other.test hostaddr=127.0.0.1 user=app dbname={db} sslmode=verify-full sslrootcert={ca}"),
        "SELECT 3",
    );
    assert!(ok && out == "3", "{out}");
    // A name no certificate has fails verification (the default certificate is served).
    let (ok, out) = psql(
        &shoal,
        &format!("host=nope.test hostaddr=127.0.0.1 user=app dbname={db} sslmode=verify-full sslrootcert={ca}"),
        "SELECT 4",
    );
    assert!(!ok, "{out}");
    assert!(out.contains("does not match"), "{out}");
    // Plain text still works with "allow".
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=disable"),
        "SELECT 5",
    );
    assert!(ok && out == "5", "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_refuses_plain_text_before_any_password() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "require");
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=disable"),
        "SELECT 1",
    );
    assert!(!ok);
    assert!(out.contains("TLS is required"), "{out}");
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=require"),
        "SELECT 1",
    );
    assert!(ok && out == "1", "{out}");
}

fn tls_client(pki: &Pki) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(pki.path("ca.pem")).unwrap();
    for c in
        <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_slice_iter(
            &pem,
        )
    {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// PostgreSQL 17's `sslnegotiation=direct`: the ClientHello is the first thing sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_tls_with_alpn() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "require");
    let tcp = tokio::net::TcpStream::connect(shoal.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tls_client(&pki)
        .connect(name, tcp)
        .await
        .expect("direct TLS");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"postgresql"[..]));
    let (client, conn) = tokio_postgres::Config::new()
        .user("app")
        .password(APP_PASSWORD)
        .dbname(&db)
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .expect("login over direct TLS");
    tokio::spawn(conn);
    let v: i32 = client.query_one("SELECT 7", &[]).await.unwrap().get(0);
    assert_eq!(v, 7);
    // Through SSLRequest with the same client stack.
    let mut tcp = tokio::net::TcpStream::connect(shoal.addr).await.unwrap();
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"S");
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tls_client(&pki).connect(name, tcp).await.unwrap();
    let (client, conn) = tokio_postgres::Config::new()
        .user("app")
        .password(APP_PASSWORD)
        .dbname(&db)
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .expect("login after SSLRequest");
    tokio::spawn(conn);
    for i in 0..20 {
        let v: i32 = client
            .query_one("SELECT $1::int", &[&i])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, i);
    }
}

/// Garbage instead of a ClientHello, and a client that stops mid-handshake: closed, and
/// Shoal goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_garbage_and_stalls() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "allow");
    let mut tcp = tokio::net::TcpStream::connect(shoal.addr).await.unwrap();
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"S");
    tcp.write_all(b"this is not a TLS record at all\r\n\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tcp.read_to_end(&mut rest),
    )
    .await
    .expect("closed, not left hanging");
    // Direct TLS that stops after one byte of a record.
    let mut stalled = tokio::net::TcpStream::connect(shoal.addr).await.unwrap();
    stalled.write_all(&[0x16, 0x03]).await.unwrap();
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=require"),
        "SELECT 1",
    );
    assert!(ok && out == "1", "{out}");
    drop(stalled);
    let _ = Path::new(&pki.path("ca.pem"));
}

/// SCRAM-SHA-256-PLUS: libpq's `channel_binding=require` binds the login to the certificate
/// Shoal served, so a man in the middle with another certificate could not relay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_require_works_over_tls() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "allow");
    for host in [
        "host=localhost hostaddr=127.0.0.1",
        "host=other.test hostaddr=127.0.0.1",
    ] {
        let (ok, out) = psql(
            &shoal,
            &format!("{host} user=app dbname={db} sslmode=require channel_binding=require"),
            "SELECT 1",
        );
        assert!(ok && out == "1", "{host}: {out}");
    }
    // Without TLS there is nothing to bind to: libpq refuses, as against PostgreSQL.
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=disable channel_binding=require"),
        "SELECT 1",
    );
    assert!(!ok, "{out}");
    assert!(out.contains("channel binding"), "{out}");
}

/// SIGHUP re-reads the certificate files: new logins get the renewed certificate, a
/// connection made before keeps working, and a broken file is refused with the old
/// certificate kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_reload_on_sighup_without_dropping_clients() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "allow");
    let ca = pki.path("ca.pem");
    let verify = |host: &str| {
        psql(
            &shoal,
            &format!("host={host} hostaddr=127.0.0.1 user=app dbname={db} sslmode=verify-full sslrootcert={ca}"),
            "SELECT 1",
        )
    };
    // A client connected over TLS before the reload.
    let tcp = tokio::net::TcpStream::connect(shoal.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tls_client(&pki).connect(name, tcp).await.unwrap();
    let (before, conn) = tokio_postgres::Config::new()
        .user("app")
        .password(APP_PASSWORD)
        .dbname(&db)
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    assert!(!verify("renewed.test").0, "not yet");
    // Renew: the default certificate now names renewed.test.
    pki.issue("default", &["renewed.test"]);
    shoal.signal(libc::SIGHUP);
    eventually("the reload", std::time::Duration::from_secs(10), || {
        shoal.log_contains("TLS certificates reloaded")
    })
    .await;
    let (ok, out) = verify("renewed.test");
    assert!(ok, "{out}");
    let v: i32 = before.query_one("SELECT 5", &[]).await.unwrap().get(0);
    assert_eq!(v, 5, "the connection made before the reload goes on");
    // A broken key file: refused, the renewed certificate stays in use.
    std::fs::write(pki.path("default.key"), "not a key").unwrap();
    shoal.signal(libc::SIGHUP);
    eventually("the refusal", std::time::Duration::from_secs(10), || {
        shoal.log_contains("not reloaded")
    })
    .await;
    let (ok, out) = verify("renewed.test");
    assert!(ok, "{out}");
}

/// Logs in over direct TLS trusting only the test CA; returns the client and the DER of the
/// certificate the server presented.
async fn tls_login(
    shoal: &Shoal,
    connector: &tokio_rustls::TlsConnector,
    db: &str,
) -> Result<(tokio_postgres::Client, Vec<u8>), String> {
    let tcp = tokio::net::TcpStream::connect(shoal.addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let presented = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec())
        .unwrap_or_default();
    let (client, conn) = tokio_postgres::Config::new()
        .user("app")
        .password(APP_PASSWORD)
        .dbname(db)
        .connect_raw(tls, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("login: {e}"))?;
    tokio::spawn(conn);
    Ok((client, presented))
}

fn pem_der(path: &str) -> Vec<u8> {
    let pem = std::fs::read(path).unwrap();
    let cert =
        <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_slice_iter(
            &pem,
        )
        .next()
        .unwrap()
        .unwrap();
    cert.as_ref().to_vec()
}

/// Certificates renewed three times while clients keep logging in over TLS and long-lived TLS
/// clients keep running transactions: not one login or transaction fails, and logins after
/// each reload are served the renewed certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_renewal_under_load_fails_nothing() {
    let db = unique_db("tls");
    let pki = Pki::new();
    let shoal = shoal_with_tls(&db, &pki, "require");
    let connector = tls_client(&pki);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut workers = Vec::new();
    // Two long-lived clients running transactions back to back.
    for _ in 0..2 {
        let (client, _) = tls_login(&shoal, &connector, &db).await.unwrap();
        let (stop, done) = (stop.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match client.query_one("SELECT 1 + 1", &[]).await {
                    Ok(row) if row.get::<_, i32>(0) == 2 => {
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    other => failures.push(format!("{other:?}")),
                }
            }
            failures
        }));
    }
    // Three clients logging in again and again (a new TLS handshake each time).
    for _ in 0..3 {
        let (shoal_addr, connector, db) = (shoal.addr, connector.clone(), db.clone());
        let (stop, done) = (stop.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let attempt = async {
                    let tcp = tokio::net::TcpStream::connect(shoal_addr)
                        .await
                        .map_err(|e| e.to_string())?;
                    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
                    let tls = connector
                        .connect(name, tcp)
                        .await
                        .map_err(|e| format!("handshake: {e}"))?;
                    let (client, conn) = tokio_postgres::Config::new()
                        .user("app")
                        .password(APP_PASSWORD)
                        .dbname(&db)
                        .connect_raw(tls, tokio_postgres::NoTls)
                        .await
                        .map_err(|e| format!("login: {e}"))?;
                    tokio::spawn(conn);
                    let v: i32 = client
                        .query_one("SELECT 7", &[])
                        .await
                        .map_err(|e| e.to_string())?
                        .get(0);
                    if v != 7 {
                        return Err(format!("got {v}"));
                    }
                    Ok::<_, String>(())
                };
                match attempt.await {
                    Ok(()) => {
                        done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => failures.push(e),
                }
            }
            failures
        }));
    }
    for round in 1..=3usize {
        // Some traffic before each renewal.
        let target = done.load(std::sync::atomic::Ordering::Relaxed) + 50;
        eventually("traffic", std::time::Duration::from_secs(30), || {
            done.load(std::sync::atomic::Ordering::Relaxed) >= target
        })
        .await;
        pki.issue("default", &["localhost", &format!("round{round}.test")]);
        shoal.signal(libc::SIGHUP);
        eventually("the reload", std::time::Duration::from_secs(10), || {
            shoal.log_count("TLS certificates reloaded") >= round
        })
        .await;
        let (_, presented) = tls_login(&shoal, &connector, &db).await.unwrap();
        assert_eq!(
            presented,
            pem_der(&pki.path("default.pem")),
            "a login after reload {round} gets the renewed certificate"
        );
    }
    let target = done.load(std::sync::atomic::Ordering::Relaxed) + 50;
    eventually(
        "traffic after the last renewal",
        std::time::Duration::from_secs(30),
        || done.load(std::sync::atomic::Ordering::Relaxed) >= target,
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    assert!(failures.is_empty(), "failed under reload: {failures:?}");
}

/// `auth_method = "cert"`: a client certificate chaining to `[tls] ca_file` whose common name
/// is the user name; a certificate for another name, from an untrusted CA, or none is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_authentication() {
    use std::os::unix::fs::PermissionsExt;
    let db = unique_db("tls");
    let pki = Pki::new();
    pki.issue("default", &["localhost"]);
    pki.issue("certuser", &["certuser"]);
    pki.issue("someone", &["someone"]);
    let stranger = Pki::new();
    stranger.issue("certuser", &["certuser"]);
    for p in [&pki, &stranger] {
        for k in ["certuser.key", "someone.key"] {
            let path = p.path(k);
            if Path::new(&path).exists() {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        }
    }
    let extra = format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nca_file = \"{}\"\n\
         [users.certuser]\nauth_method = \"cert\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n",
        pki.path("default.pem"),
        pki.path("default.key"),
        pki.path("ca.pem"),
    );
    pg().create_database(&db);
    let shoal = Shoal::start(&base_config(pg(), &[&db], &extra));
    let login = |p: &Pki, stem: &str| {
        psql(
            &shoal,
            &format!(
                "host=127.0.0.1 user=certuser dbname={db} sslmode=require sslcert={} sslkey={}",
                p.path(&format!("{stem}.pem")),
                p.path(&format!("{stem}.key"))
            ),
            "SELECT current_user",
        )
    };
    let (ok, out) = login(&pki, "certuser");
    assert!(ok && out == "app", "{out}");
    let (ok, out) = login(&pki, "someone");
    assert!(!ok);
    assert!(out.contains("certificate authentication failed"), "{out}");
    let (ok, out) = login(&stranger, "certuser");
    assert!(!ok, "an untrusted CA is refused: {out}");
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=certuser dbname={db} sslmode=require"),
        "SELECT 1",
    );
    assert!(!ok);
    assert!(out.contains("requires a valid client certificate"), "{out}");
    // Password users are unaffected by ca_file.
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={db} sslmode=require"),
        "SELECT 1",
    );
    assert!(ok && out == "1", "{out}");
}

/// `client_tls` per database (and per user) tightens or loosens the global setting, checked
/// before any password is exchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_tls_per_database_and_user() {
    let strict = unique_db("tls");
    let lax = unique_db("tls");
    pg().create_database(&strict);
    pg().create_database(&lax);
    let pki = Pki::new();
    pki.issue("default", &["localhost"]);
    let extra = format!(
        "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n\
         [databases.{strict}]\nport = {port}\nclient_tls = \"require\"\n\
         [databases.{lax}]\nport = {port}\n\
         [users.raw]\nauth_method = \"trust\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\nclient_tls = \"require\"\n",
        pki.path("default.pem"),
        pki.path("default.key"),
        port = pg().port,
    );
    let shoal = Shoal::start(&base_config(pg(), &[], &extra));
    let plain = |user: &str, db: &str| {
        psql(
            &shoal,
            &format!("host=127.0.0.1 user={user} dbname={db} sslmode=disable"),
            "SELECT 1",
        )
    };
    let (ok, out) = plain("app", &strict);
    assert!(!ok && out.contains("TLS is required"), "{out}");
    let (ok, out) = plain("app", &lax);
    assert!(ok, "{out}");
    let (ok, out) = plain("raw", &lax);
    assert!(
        !ok && out.contains("TLS is required"),
        "the user's own setting: {out}"
    );
    let (ok, out) = psql(
        &shoal,
        &format!("host=127.0.0.1 user=app dbname={strict} sslmode=require"),
        "SELECT 1",
    );
    assert!(ok, "{out}");
}
