//! The cluster's fence at PostgreSQL, step by step against a real server: a new owner's
//! mark ends everything the old owner's mark enlisted (whatever its clients ran), and the
//! old mark can enlist nothing after it. No etcd and no timing: each step is awaited.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::*;
use shoal::app::App;
use shoal::config::Config;
use shoal::pool::pg_fence::{namespace, FenceError, Mark};
use shoal::route::RouteRequest;
use shoal::server::{ServerConn, Upstream};

const STEP: Duration = Duration::from_secs(5);

/// How the pool of user `app` on `db` reaches PostgreSQL (as the non-superuser `app`).
fn upstream(db: &str) -> Upstream {
    let config = Config::parse(&base_config(pg(), &[db], ""), "test", &|_| None).unwrap();
    let (stop, shutdown) = tokio::sync::watch::channel(false);
    std::mem::forget(stop);
    let app = App::new(config, shutdown).unwrap();
    let routed = app
        .routes
        .resolve(&RouteRequest {
            user: "app",
            database: db,
            server_name: None,
            reference: None,
            addr: None,
        })
        .unwrap();
    let user = routed.configured_user().unwrap().clone();
    app.routes.pool(&routed, &user).unwrap().upstream.clone()
}

fn alive(pid: i32) -> bool {
    pg().psql_admin(&format!(
        "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
    )) == "1"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_ends_the_old_owners_servers_and_the_old_mark_enlists_nothing_more() {
    shoal::clock::start();
    let db = unique_db("pgfence");
    pg().create_database(&db);
    let up = upstream(&db);
    direct(&db)
        .await
        .batch_execute("CREATE TABLE ledger (who text)")
        .await
        .unwrap();
    let old = Mark::take_over(&up, "p", STEP).await.unwrap();
    // A server of the old owner whose client dropped every advisory lock of its session,
    // then left a write uncommitted (its COMMIT would come after the owner resumes).
    let mut server = ServerConn::connect(&up, STEP).await.unwrap();
    old.enlist(server.process_id).await.unwrap();
    for sql in ["SELECT pg_advisory_unlock_all()", "DISCARD ALL"] {
        server.simple_query(sql).await.unwrap();
    }
    server
        .simple_query("BEGIN; INSERT INTO ledger VALUES ('old owner')")
        .await
        .unwrap();
    // A session of the same role that is no server of the pool, and another pool's owner.
    let bystander = direct(&db).await;
    let other = Mark::take_over(&up, "another pool", STEP).await.unwrap();
    let mut others_server = ServerConn::connect(&up, STEP).await.unwrap();
    other.enlist(others_server.process_id).await.unwrap();

    let new = Mark::take_over(&up, "p", STEP).await.unwrap();
    // Gone by the time the new owner has its mark: the old mark and its server.
    assert!(!alive(old.pid), "the old mark still runs");
    assert!(
        !alive(server.process_id),
        "the old owner's server still runs"
    );
    assert!(server.simple_query("COMMIT").await.is_err());
    // Nothing else was touched, and the old owner's write is not there.
    assert_eq!(
        simple_rows(&bystander, "SELECT count(*) FROM ledger").await,
        ["0"]
    );
    assert!(alive(other.pid) && alive(others_server.process_id));
    others_server.simple_query("SELECT 1").await.unwrap();
    // The old mark cannot enlist a server it opens after resuming; the new one can.
    let late = ServerConn::connect(&up, STEP).await.unwrap();
    assert!(old.enlist(late.process_id).await.is_err());
    new.enlist(late.process_id).await.unwrap();
    // Each pool's locks are its own.
    assert_ne!(namespace("p"), namespace("another pool"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_is_enlisted_while_a_new_owner_takes_over() {
    shoal::clock::start();
    let db = unique_db("pgfence");
    pg().create_database(&db);
    let up = upstream(&db);
    let mark = Mark::take_over(&up, "p", STEP).await.unwrap();
    // What a new owner holds first: the freeze, exclusively.
    let taker = direct(&db).await;
    taker
        .query(
            "SELECT pg_advisory_lock($1, 2147483647)",
            &[&namespace("p")],
        )
        .await
        .unwrap();
    let server = ServerConn::connect(&up, STEP).await.unwrap();
    assert!(matches!(
        mark.enlist(server.process_id).await,
        Err(FenceError::Superseded)
    ));
    // PostgreSQL shows a DBA what holds the pool's locks.
    assert_eq!(
        pg().psql_admin(&format!(
            "SELECT application_name FROM pg_stat_activity WHERE pid = {}",
            mark.pid
        )),
        shoal::pool::pg_fence::MARK_NAME
    );
}
