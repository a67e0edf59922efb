//! Shoal as a library, in-process: a session served over `tokio::io::duplex` (no socket
//! between the client and Shoal) against a real PostgreSQL, through the transport seam that
//! TLS will use too.

mod common;

use common::*;
use shoal::app::App;
use shoal::config::Config;
use shoal::net::ClientStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_over_an_in_process_pipe() {
    let db = unique_db("inproc");
    pg().create_database(&db);
    let config = Config::parse(&base_config(pg(), &[&db], ""), "test", &|_| None).unwrap();
    shoal::clock::start();
    let (_stop, shutdown) = tokio::sync::watch::channel(false);
    let app = App::new(config, shutdown).unwrap();
    let mut clients = Vec::new();
    for i in 0..3 {
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        tokio::spawn(shoal::session::serve(
            app.clone(),
            ClientStream::Buffered(Box::new(theirs)),
            None,
        ));
        let (client, conn) = tokio_postgres::Config::new()
            .user("app")
            .password(APP_PASSWORD)
            .dbname(&db)
            .connect_raw(ours, tokio_postgres::NoTls)
            .await
            .expect("login over the pipe");
        tokio::spawn(conn);
        clients.push((i, client));
    }
    // Idle waits on a buffered transport read; several clients share the pool; prepared
    // statements and transactions work as over TCP.
    for round in 0..3 {
        for (i, c) in &clients {
            let v: i32 = c
                .query_one("SELECT $1::int * 10 + $2::int", &[i, &round])
                .await
                .unwrap()
                .get(0);
            assert_eq!(v, i * 10 + round);
        }
    }
    let (_, c) = &clients[0];
    c.batch_execute("BEGIN; CREATE TEMP TABLE t (a int); COMMIT")
        .await
        .unwrap();
    assert_eq!(simple_rows(c, "SELECT 42").await, vec!["42"]);
}
