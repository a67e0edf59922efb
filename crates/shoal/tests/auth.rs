//! Client authentication (SCRAM, MD5, trust) and upstream authentication (SCRAM, MD5,
//! cleartext), with real clients and a real PostgreSQL.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;

fn shoal_with_users(db: &str, users: &str) -> Shoal {
    pg().create_database(db);
    Shoal::start(&base_config(pg(), &[db], users))
}

#[tokio::test]
async fn scram_login_succeeds_and_wrong_password_is_28p01() {
    let db = unique_db("auth");
    let shoal = shoal_with_users(&db, "");
    let c = shoal.connect(&db).await;
    assert_eq!(
        c.query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
        "app"
    );
    let err = shoal
        .try_connect(&shoal.conninfo("app", "wrong", &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&err), "28P01");
    assert!(format!("{err:?}").contains("password authentication failed for user \\\"app\\\""));
}

#[tokio::test]
async fn md5_clients_and_stored_secrets() {
    let db = unique_db("auth");
    let scram_secret = shoal_wire::scram::Verifier::from_password("s3cret").to_text();
    let md5_secret = shoal_wire::md5::stored_secret("alice", "alice-pw");
    let users = format!(
        "[users.alice]\nauth_method = \"md5\"\nsecret = \"{md5_secret}\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n\
         [users.bob]\nsecret = \"{scram_secret}\"\nserver_user = \"app\"\nserver_password_env = \"BOB_UPSTREAM\"\n"
    );
    pg().create_database(&db);
    let shoal = Shoal::start_with_env(
        &base_config(pg(), &[&db], &users),
        &[("BOB_UPSTREAM", APP_PASSWORD)],
    );
    let a = shoal.connect_as("alice", "alice-pw", &db).await;
    a.simple_query("SELECT 1").await.unwrap();
    let err = shoal
        .try_connect(&shoal.conninfo("alice", "nope", &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&err), "28P01");
    let b = shoal.connect_as("bob", "s3cret", &db).await;
    assert_eq!(
        b.query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
        "app"
    );
    let err = shoal
        .try_connect(&shoal.conninfo("bob", "nope", &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&err), "28P01");
}

#[tokio::test]
async fn psql_logs_in_with_scram_and_md5() {
    let db = unique_db("auth");
    let users = "[users.carol]\nauth_method = \"md5\"\npassword = \"carol-pw\"\nserver_user = \"app\"\nserver_password = \"app-secret\"\n";
    let shoal = shoal_with_users(&db, users);
    for (user, pw) in [("app", APP_PASSWORD), ("carol", "carol-pw")] {
        let out = std::process::Command::new("psql")
            .args(["-X", "-At", "-c", "SELECT 40 + 2"])
            .arg(shoal.conninfo(user, pw, &db))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{user}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
    }
}

#[tokio::test]
async fn unknown_user_and_database_get_their_sqlstates() {
    let db = unique_db("auth");
    let shoal = shoal_with_users(&db, "");
    // An unknown user is told exactly what a wrong password is told (no user probing).
    let unknown = shoal
        .try_connect(&shoal.conninfo("nobody", "x", &db))
        .await
        .err()
        .unwrap();
    let wrong = shoal
        .try_connect(&shoal.conninfo("app", "x", &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&unknown), "28P01");
    assert_eq!(code(&wrong), "28P01");
    let text = |e: &tokio_postgres::Error| e.as_db_error().unwrap().message().to_string();
    assert_eq!(
        text(&unknown).replace("nobody", "USER"),
        text(&wrong).replace("app", "USER")
    );
    eventually(
        "the log says why",
        std::time::Duration::from_secs(5),
        || shoal.log_contains("is not configured"),
    )
    .await;
    let err = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, "nodb"))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&err), "3D000");
}

#[tokio::test]
async fn trust_only_when_configured() {
    let db = unique_db("auth");
    let shoal = shoal_with_users(&db, "");
    // `raw` is configured with auth_method = "trust": any password (or none) is accepted.
    let c = shoal.connect_as("raw", "anything", &db).await;
    c.simple_query("SELECT 1").await.unwrap();
    // `app` is not: a missing password fails.
    let err = shoal
        .try_connect(&format!(
            "host=127.0.0.1 port={} user=app dbname={db}",
            shoal.port()
        ))
        .await
        .err()
        .unwrap();
    assert!(format!("{err:?}").contains("password"), "{err:?}");
}

#[tokio::test]
async fn upstream_md5_and_cleartext() {
    let db = unique_db("auth");
    let users = format!(
        "[users.m]\npassword = \"client-pw\"\nserver_user = \"md5user\"\nserver_password = \"{MD5_PASSWORD}\"\n\
         [users.p]\npassword = \"client-pw\"\nserver_user = \"plainuser\"\nserver_password = \"{PLAIN_PASSWORD}\"\n\
         [users.bad]\npassword = \"client-pw\"\nserver_user = \"md5user\"\nserver_password = \"wrong\"\n"
    );
    let shoal = shoal_with_users(&db, &users);
    for (user, upstream) in [("m", "md5user"), ("p", "plainuser")] {
        let c = shoal.connect_as(user, "client-pw", &db).await;
        let who: String = c
            .query_one("SELECT current_user::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(who, upstream);
    }
    // A wrong upstream password is reported with PostgreSQL's code and the pool's name.
    let err = shoal
        .try_connect(&shoal.conninfo("bad", "client-pw", &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&err), "28P01");
    assert!(format!("{err:?}").contains(&format!("{db}/bad")), "{err:?}");
}

#[test]
fn check_config_explains_errors_with_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[server]\nlisten = [\"127.0.0.1:6432\"]\n\n[users.x]\nauth_method = \"md5\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("check-config")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.toml:4:"), "{err}");
    assert!(err.contains("no password"), "{err}");
    let good = dir.path().join("good.toml");
    std::fs::write(&good, shoal::config::EMBEDDED_DEFAULT).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("check-config")
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_shoal"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("shoal "));
}

/// A non-ASCII password is SASLprep-normalised on both sides, as between libpq and
/// PostgreSQL: the client's library sends the proof of the normalised form.
#[tokio::test]
async fn non_ascii_passwords_are_saslprep_normalised() {
    let db = unique_db("auth");
    let users = format!(
        "[users.uni]\npassword = \"\u{2168}\u{00AD}\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n"
    );
    let shoal = shoal_with_users(&db, &users);
    let (client, conn) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(shoal.port())
        .user("uni")
        .password("\u{2168}\u{00AD}".as_bytes())
        .dbname(&db)
        .connect(tokio_postgres::NoTls)
        .await
        .expect("the normalised password is accepted");
    tokio::spawn(conn);
    assert_eq!(simple_rows(&client, "SELECT 1").await, vec!["1"]);
    // The same password written in its normal form works too: both are "IX".
    let (client, conn) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(shoal.port())
        .user("uni")
        .password("IX")
        .dbname(&db)
        .connect(tokio_postgres::NoTls)
        .await
        .expect("the normal form is the same password");
    tokio::spawn(conn);
    assert_eq!(simple_rows(&client, "SELECT 1").await, vec!["1"]);
}

/// Failed logins from one address as one user slow down and then ban that pair for the
/// window; the same user from elsewhere, and other users, are unaffected.
#[tokio::test]
async fn failed_logins_are_delayed_then_banned() {
    let db = unique_db("auth");
    pg().create_database(&db);
    let config = with_server_keys(
        &base_config(pg(), &[&db], ""),
        "auth_failure_ban = 3\nauth_failure_window = 30",
    );
    let shoal = Shoal::start(&config);
    let started = std::time::Instant::now();
    for _ in 0..3 {
        let e = shoal
            .try_connect(&shoal.conninfo("app", "wrong", &db))
            .await
            .err()
            .unwrap();
        assert_eq!(code(&e), "28P01");
    }
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(300),
        "the second and third failures were delayed"
    );
    // Banned now, even with the right password.
    let e = shoal
        .try_connect(&shoal.conninfo("app", APP_PASSWORD, &db))
        .await
        .err()
        .unwrap();
    assert_eq!(code(&e), "28000");
    assert!(format!("{e:?}").contains("too many failed logins"), "{e:?}");
    // Another user from the same address is not affected.
    let c = shoal.connect_as("raw", "any", &db).await;
    c.simple_query("SELECT 1").await.unwrap();
}

/// Passwords never reach the log, at any level.
#[tokio::test]
async fn secrets_are_not_logged_even_at_trace() {
    let db = unique_db("auth");
    pg().create_database(&db);
    let config = base_config(pg(), &[&db], "");
    let shoal = Shoal::start_with_env(&config, &[("SHOAL_LOG", "trace")]);
    let c = shoal.connect(&db).await;
    c.simple_query("SELECT 1").await.unwrap();
    let wrong = "wrong-secret-0xC0FFEE";
    let _ = shoal
        .try_connect(&shoal.conninfo("app", wrong, &db))
        .await
        .err()
        .unwrap();
    let _ = shoal
        .try_connect(&shoal.conninfo("nobody", wrong, &db))
        .await
        .err()
        .unwrap();
    eventually(
        "the refusals are logged",
        std::time::Duration::from_secs(5),
        || shoal.log_contains("login refused") && shoal.log_contains("closing client connection"),
    )
    .await;
    let log = shoal.log.lock().unwrap();
    for secret in [APP_PASSWORD, wrong] {
        assert!(
            !log.iter().any(|l| l.contains(secret)),
            "{secret} appears in the log"
        );
    }
}
