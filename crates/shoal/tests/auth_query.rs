//! Users not in Shoal's configuration, found by the database's auth_query, with SCRAM and MD5
//! passthrough upstream (Shoal never learns their passwords), and a password rotated with
//! `ALTER ROLE` while clients are connected.

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
