//! Users not in Shoal's configuration, found by the database's auth_query, with SCRAM and MD5
//! passthrough upstream (Shoal never learns their passwords), and a password rotated with
//! `ALTER ROLE` while clients are connected.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;

fn config(db: &str, ttl: f64) -> String {
    base_config(
        pg(),
        &[],
        &format!(
            "[databases.{db}]\nport = {}\nauth_user = \"app\"\nauth_query_cache_ttl = {ttl}\n",
            pg().port
        ),
    )
}

async fn who(shoal: &Shoal, user: &str, password: &str, db: &str) -> Result<String, String> {
    match shoal.try_connect(&shoal.conninfo(user, password, db)).await {
        Ok(c) => Ok(simple_rows(&c, "SELECT current_user").await[0].clone()),
        Err(e) => Err(code(&e)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_query_users_with_scram_and_md5_passthrough() {
    let db = unique_db("aq");
    pg().create_database(&db);
    pg().psql_admin(&format!(
        "CREATE ROLE aq_scram LOGIN PASSWORD 'pw-one'; GRANT ALL ON DATABASE {db} TO aq_scram"
    ));
    let shoal = Shoal::start(&config(&db, 0.0));
    assert_eq!(
        who(&shoal, "aq_scram", "pw-one", &db).await,
        Ok("aq_scram".into())
    );
    // MD5: md5user's secret is an MD5 hash, and PostgreSQL asks it for MD5.
    assert_eq!(
        who(&shoal, "md5user", MD5_PASSWORD, &db).await,
        Ok("md5user".into())
    );
    assert_eq!(
        who(&shoal, "aq_scram", "wrong", &db).await,
        Err("28P01".into())
    );
    assert_eq!(
        who(&shoal, "no_such_role", "x", &db).await,
        Err("28P01".into())
    );
    // A client connected before the password changes goes on.
    let before = shoal.connect_as("aq_scram", "pw-one", &db).await;
    pg().psql_admin("ALTER ROLE aq_scram PASSWORD 'pw-two'");
    assert_eq!(simple_rows(&before, "SELECT 1").await, vec!["1"]);
    // The new password works at once (cache TTL 0); the old one no longer does.
    assert_eq!(
        who(&shoal, "aq_scram", "pw-two", &db).await,
        Ok("aq_scram".into())
    );
    assert_eq!(
        who(&shoal, "aq_scram", "pw-one", &db).await,
        Err("28P01".into())
    );
    // Shoal's log never holds the passwords.
    let log = shoal.log.lock().unwrap();
    assert!(!log
        .iter()
        .any(|l| l.contains("pw-one") || l.contains("pw-two")));
}

/// With a cache, a changed password fails once (the cached secret is old), which drops the
/// cached secret: the next login looks it up again and works — a stale cache never locks a
/// user out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_cached_secret_is_dropped_after_a_failure() {
    let db = unique_db("aq");
    pg().create_database(&db);
    pg().psql_admin(&format!(
        "CREATE ROLE aq_cached LOGIN PASSWORD 'c-one'; GRANT ALL ON DATABASE {db} TO aq_cached"
    ));
    let shoal = Shoal::start(&config(&db, 3600.0));
    assert_eq!(
        who(&shoal, "aq_cached", "c-one", &db).await,
        Ok("aq_cached".into())
    );
    pg().psql_admin("ALTER ROLE aq_cached PASSWORD 'c-two'");
    assert_eq!(
        who(&shoal, "aq_cached", "c-two", &db).await,
        Err("28P01".into())
    );
    assert_eq!(
        who(&shoal, "aq_cached", "c-two", &db).await,
        Ok("aq_cached".into())
    );
}

/// A role PostgreSQL would refuse (NOLOGIN, CONNECTION LIMIT 0, CONNECT revoked, past VALID
/// UNTIL) is refused by Shoal too, although a server logged in as it waits in the pool (no
/// new upstream login would let PostgreSQL say no).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_postgres_refuses_are_refused_with_a_pooled_server() {
    let db = unique_db("aq");
    pg().create_database(&db);
    let shoal = Shoal::start(&config(&db, 0.0));
    let cases = [
        ("aq_nologin", "ALTER ROLE aq_nologin NOLOGIN"),
        ("aq_connlimit", "ALTER ROLE aq_connlimit CONNECTION LIMIT 0"),
        (
            "aq_noconnect",
            "REVOKE CONNECT ON DATABASE {db} FROM PUBLIC, aq_noconnect; GRANT CONNECT ON DATABASE {db} TO app",
        ),
        ("aq_expired", "ALTER ROLE aq_expired VALID UNTIL '2001-01-01'"),
    ];
    for (role, change) in cases {
        pg().psql_admin(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD 'pw'; GRANT ALL ON DATABASE {db} TO {role}"
        ));
        // A login leaves a server for the role in the pool.
        assert_eq!(who(&shoal, role, "pw", &db).await, Ok(role.to_string()));
        pg().psql_admin(&change.replace("{db}", &db));
        assert_eq!(
            who(&shoal, role, "pw", &db).await,
            Err("28P01".into()),
            "{role} after: {change}"
        );
    }
    // PUBLIC keeps CONNECT for the roles that follow.
    pg().psql_admin(&format!("GRANT CONNECT ON DATABASE {db} TO PUBLIC"));
}

/// VALID UNTIL is checked on every login, also on one served from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_role_expires_on_time() {
    let db = unique_db("aq");
    pg().create_database(&db);
    pg().psql_admin(&format!(
        "CREATE ROLE aq_soon LOGIN PASSWORD 'pw'; GRANT ALL ON DATABASE {db} TO aq_soon; \
         DO $$BEGIN EXECUTE format('ALTER ROLE aq_soon VALID UNTIL %L', now() + interval '2 seconds'); END$$"
    ));
    let shoal = Shoal::start(&config(&db, 600.0));
    assert_eq!(
        who(&shoal, "aq_soon", "pw", &db).await,
        Ok("aq_soon".into())
    );
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        match who(&shoal, "aq_soon", "pw", &db).await {
            Err(code) => {
                assert_eq!(code, "28P01");
                break;
            }
            Ok(_) => assert!(
                tokio::time::Instant::now() < deadline,
                "the role still logs in after its VALID UNTIL"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
