//! Wire-protocol behaviour through Shoal, with a real PostgreSQL behind it.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use bytes::BytesMut;
use common::raw::{self, Raw};
use common::*;
use futures_util::future::join_all;

#[tokio::test]
async fn simple_and_extended_queries_work() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let c = shoal.connect(&db).await;
    let rows = simple_rows(&c, "SELECT 1; SELECT 'two'").await;
    assert_eq!(rows, ["1", "two"]);
    let row = c.query_typed_raw_one("SELECT $1::int + 1", 41).await;
    assert_eq!(row, 42);
}

trait TypedOne {
    async fn query_typed_raw_one(&self, sql: &str, arg: i32) -> i32;
}

impl TypedOne for tokio_postgres::Client {
    async fn query_typed_raw_one(&self, sql: &str, arg: i32) -> i32 {
        let rows = self
            .query_typed(sql, &[(&arg, tokio_postgres::types::Type::INT4)])
            .await
            .unwrap();
        rows[0].get(0)
    }
}

#[tokio::test]
async fn pipelined_extended_batches_get_every_reply_in_order() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\n");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    for i in 0..50 {
        raw::parse(&mut b, "", "SELECT $1::int * 2");
        raw::bind(&mut b, "", "", &[&i.to_string()]);
        raw::execute(&mut b, "");
        raw::sync(&mut b);
    }
    r.send(&b).await;
    for i in 0..50 {
        let msgs = r.until_ready().await;
        let tags: String = msgs.iter().map(|m| m.tag).collect();
        assert_eq!(tags, "12DCZ", "batch {i}");
        assert_eq!(raw::first_column(&msgs[2]), (i * 2).to_string());
    }
    // tokio-postgres pipelines concurrent queries on one connection too.
    let c = shoal.connect(&db).await;
    let futs = (0..100).map(|i| c.query_typed_raw_one("SELECT $1::int", i));
    let got = join_all(futs).await;
    assert_eq!(got, (0..100).collect::<Vec<_>>());
}

#[tokio::test]
async fn error_in_pipeline_skips_to_sync_like_postgres() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::parse(&mut b, "", "SELECT 1/0");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::parse(&mut b, "", "SELECT 1");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    raw::parse(&mut b, "", "SELECT 7");
    raw::bind(&mut b, "", "", &[]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    r.send(&b).await;
    let first: String = r.until_ready().await.iter().map(|m| m.tag).collect();
    // 1/0 fails at Bind (constant folding), as it does directly against PostgreSQL; the
    // rest of the batch is skipped up to Sync.
    assert_eq!(first, "1EZ");
    let second = r.until_ready().await;
    assert_eq!(raw::first_column(&second[2]), "7");
}

#[tokio::test]
async fn flush_without_sync_gets_replies_at_once() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::parse(&mut b, "s1", "SELECT $1::text AS v");
    raw::describe(&mut b, b'S', "s1");
    raw::flush(&mut b);
    r.send(&b).await;
    assert_eq!(r.recv().await.unwrap().tag, '1');
    assert_eq!(r.recv().await.unwrap().tag, 't');
    assert_eq!(r.recv().await.unwrap().tag, 'T');
    // The server stays with this client until Sync: the statement is still there.
    b.clear();
    raw::bind(&mut b, "", "s1", &["hello"]);
    raw::execute(&mut b, "");
    raw::sync(&mut b);
    r.send(&b).await;
    let msgs = r.until_ready().await;
    assert_eq!(raw::first_column(&msgs[1]), "hello");
}

#[tokio::test]
async fn copy_in_and_out() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let c = shoal.connect(&db).await;
    c.batch_execute("CREATE TABLE t (a int, b text)")
        .await
        .unwrap();
    // Raw simple-protocol COPY FROM STDIN.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::query(&mut b, "COPY t FROM STDIN");
    r.send(&b).await;
    assert_eq!(r.recv().await.unwrap().tag, 'G');
    b.clear();
    for i in 0..1000 {
        shoal_wire::backend::put_message(&mut b, b'd', |b| {
            b.extend_from_slice(format!("{i}\trow {i}\n").as_bytes())
        });
    }
    shoal_wire::backend::put_message(&mut b, b'c', |_| {});
    r.send(&b).await;
    let tags: String = r.until_ready().await.iter().map(|m| m.tag).collect();
    assert_eq!(tags, "CZ");
    // COPY TO STDOUT through psql, and psql's \copy FROM as a second writer.
    let out = std::process::Command::new("psql")
        .args([
            "-X",
            "-At",
            "-c",
            "COPY (SELECT sum(a), count(*) FROM t) TO STDOUT",
        ])
        .arg(shoal.conninfo("app", APP_PASSWORD, &db))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "499500\t1000");
    // Extended-protocol COPY (tokio-postgres), inside a transaction.
    use futures_util::SinkExt;
    let mut c = shoal.connect(&db).await;
    let tx = c.transaction().await.unwrap();
    let sink = tx.copy_in("COPY t FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    sink.send(bytes::Bytes::from_static(b"5000\tx\n"))
        .await
        .unwrap();
    assert_eq!(sink.finish().await.unwrap(), 1);
    tx.commit().await.unwrap();
    let n: i64 = c
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1001);
    // The pool of one is free again: another client gets the server.
    let other = shoal.connect(&db).await;
    other.simple_query("SELECT 1").await.unwrap();
}

/// Large results and copies, both ways, inside one transaction: the relay keeps reading and
/// writing across tokio's cooperative-scheduling yields (each 20 MB stream spends the task's
/// budget many times over) and never waits on a side it did not register, while a second
/// client queues for the pool's only server and gets it once the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_streams_inside_a_transaction_keep_the_relay_moving() {
    use futures_util::{SinkExt, StreamExt};
    use std::time::Duration;
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut a = shoal.connect(&db).await;
    a.batch_execute("CREATE TABLE big (t text)").await.unwrap();
    let b = shoal.connect(&db).await;
    let limit = Duration::from_secs(120);
    let tx = a.transaction().await.unwrap();
    // B waits for the server A holds.
    let waiting = tokio::spawn(async move {
        let v: i32 = b.query_one("SELECT 7", &[]).await.unwrap().get(0);
        v
    });
    for round in 0..3 {
        let rows = tokio::time::timeout(
            limit,
            tx.simple_query("SELECT repeat('x', 1000) FROM generate_series(1, 20000)"),
        )
        .await
        .expect("a large result arrives whole")
        .unwrap();
        let got = rows
            .iter()
            .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
            .count();
        assert_eq!(got, 20000, "round {round}");
        let one: i32 = tx
            .query_one("SELECT $1::int", &[&round])
            .await
            .unwrap()
            .get(0);
        assert_eq!(one, round);
        // 20 MB in: 20,000 lines of 1,000 bytes, sent in 64 KiB chunks.
        let line = format!("{}\n", "y".repeat(999));
        let chunk = bytes::Bytes::from(line.repeat(64));
        let sink = tx.copy_in("COPY big FROM STDIN").await.unwrap();
        futures_util::pin_mut!(sink);
        tokio::time::timeout(limit, async {
            for _ in 0..(20000 / 64) {
                sink.send(chunk.clone()).await.unwrap();
            }
            sink.as_mut().finish().await.unwrap()
        })
        .await
        .expect("a large copy in completes");
        // And out again.
        let stream = tx
            .copy_out("COPY (SELECT t FROM big) TO STDOUT")
            .await
            .unwrap();
        futures_util::pin_mut!(stream);
        let bytes = tokio::time::timeout(limit, async {
            let mut n = 0usize;
            while let Some(part) = stream.next().await {
                n += part.unwrap().len();
            }
            n
        })
        .await
        .expect("a large copy out completes");
        // Every round adds 312 chunks of 64 lines.
        assert_eq!(bytes, (round as usize + 1) * (20000 / 64 * 64) * 1000);
        assert!(!waiting.is_finished(), "B got the server A holds");
    }
    tx.commit().await.unwrap();
    let v = tokio::time::timeout(limit, waiting)
        .await
        .expect("B gets the server after A's commit")
        .unwrap();
    assert_eq!(v, 7);
}

#[tokio::test]
async fn startup_parameters_reach_the_server_and_hold() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "[pool]\npool_size = 3\n");
    let mut r = Raw::login(
        shoal.addr,
        "raw",
        &db,
        &[
            ("application_name", "paramtest"),
            ("client_encoding", "utf8"),
            (
                "options",
                "-c search_path=foo,public -c statement_timeout=12345",
            ),
            ("DateStyle", "SQL, DMY"),
        ],
    )
    .await;
    // Reported exactly as the server spells them.
    assert_eq!(r.param("client_encoding"), Some("UTF8"));
    assert_eq!(r.param("application_name"), Some("paramtest"));
    assert_eq!(r.param("DateStyle"), Some("SQL, DMY"));
    // Another client with other settings uses the servers in between.
    let mut other = Raw::login(shoal.addr, "raw", &db, &[("application_name", "other")]).await;
    for _ in 0..5 {
        let rows = r
            .simple("SELECT current_setting('search_path') || '|' || current_setting('statement_timeout') || '|' || current_setting('application_name')")
            .await
            .unwrap();
        assert_eq!(rows, vec!["foo,public|12345ms|paramtest".to_string()]);
        let rows = other.simple("SELECT current_setting('application_name') || current_setting('statement_timeout')").await.unwrap();
        assert_eq!(rows, vec!["other0".to_string()]);
    }
}

#[tokio::test]
async fn ssl_and_gssenc_requests_are_declined_then_login_works() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    r.send(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]).await;
    assert_eq!(r.recv_byte().await, Some(b'N'));
    r.send(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30]).await;
    assert_eq!(r.recv_byte().await, Some(b'N'));
    r.startup("raw", &db, &[]).await;
    let tags: String = r
        .until_ready()
        .await
        .iter()
        .map(|m| m.tag)
        .filter(|t| *t != 'S')
        .collect();
    assert_eq!(tags, "RKZ");
}

#[tokio::test]
async fn protocol_3_2_is_negotiated_down() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    let mut b = BytesMut::new();
    shoal_wire::frontend::startup(
        &mut b,
        &[
            ("user", "raw"),
            ("database", &db),
            ("_pq_.test_option", "x"),
        ],
    );
    b[7] = 2;
    r.send(&b).await;
    let first = r.recv().await.unwrap();
    assert_eq!(first.tag, 'v');
    assert_eq!(&first.body[..4], &(3i32 << 16).to_be_bytes());
    assert_eq!(&first.body[4..8], &1i32.to_be_bytes());
    assert!(first.text().contains("_pq_.test_option"));
    let rest = r.until_ready().await;
    assert!(rest.iter().all(|m| m.tag != 'E'));
    assert_eq!(r.simple("SELECT 1").await.unwrap(), vec!["1"]);
}

#[tokio::test]
async fn other_protocol_versions_get_a_clear_fatal() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::connect(shoal.addr).await;
    let mut b = BytesMut::new();
    shoal_wire::frontend::startup(&mut b, &[("user", "raw")]);
    b[5] = 2; // protocol 2.0
    r.send(&b).await;
    let m = r.recv().await.unwrap();
    assert_eq!(m.tag, 'E');
    assert_eq!(m.code(), "0A000");
    assert!(m
        .field(b'M')
        .unwrap()
        .contains("unsupported frontend protocol 2.0"));
    assert!(r.recv().await.is_none());
}

#[tokio::test]
async fn notices_function_calls_and_terminate() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    raw::query(
        &mut b,
        "DO $$ BEGIN RAISE NOTICE 'hello from plpgsql'; END $$",
    );
    r.send(&b).await;
    let msgs = r.until_ready().await;
    let notice = msgs
        .iter()
        .find(|m| m.tag == 'N')
        .expect("a NoticeResponse");
    assert_eq!(notice.field(b'M').as_deref(), Some("hello from plpgsql"));
    // FunctionCall: int4pl(20, 22) by OID 177.
    b.clear();
    shoal_wire::backend::put_message(&mut b, b'F', |b| {
        use bytes::BufMut;
        b.put_i32(177);
        b.put_i16(0);
        b.put_i16(2);
        for v in [20i32, 22] {
            let s = v.to_string();
            b.put_i32(s.len() as i32);
            b.put_slice(s.as_bytes());
        }
        b.put_i16(0);
    });
    r.send(&b).await;
    let msgs = r.until_ready().await;
    assert_eq!(msgs[0].tag, 'V');
    assert_eq!(&msgs[0].body[4..], b"42");
    b.clear();
    shoal_wire::frontend::terminate(&mut b);
    r.send(&b).await;
    assert!(r.recv().await.is_none(), "Terminate closes the connection");
}

#[tokio::test]
async fn session_mode_passes_the_real_backend_pid() {
    let db = unique_db("proto");
    let shoal = shoal_for(&db, "[pool]\npool_mode = \"session\"\n");
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let pid = r.simple("SELECT pg_backend_pid()").await.unwrap();
    assert_eq!(pid, vec![r.key.0.to_string()]);
    // Transaction mode hands out Shoal's own key instead.
    let db2 = unique_db("proto");
    let shoal2 = shoal_for(&db2, "");
    let mut r2 = Raw::login(shoal2.addr, "raw", &db2, &[]).await;
    let pid2 = r2.simple("SELECT pg_backend_pid()").await.unwrap();
    assert_ne!(pid2, vec![r2.key.0.to_string()]);
}

/// The protocol's maximum of 65,535 parameters (an unsigned 16-bit count): Parse with that
/// many declared types and Bind with that many values reach PostgreSQL, named statement
/// (translated) and unnamed alike, in both pool modes.
#[tokio::test]
async fn the_maximum_of_65535_parameters_passes() {
    for mode in ["transaction", "session"] {
        let db = unique_db("params");
        let shoal = shoal_for(&db, &format!("[pool]\npool_mode = \"{mode}\"\n"));
        let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
        let values: Vec<String> = (1..=65535).map(|i| (i % 1000).to_string()).collect();
        let values: Vec<&str> = values.iter().map(String::as_str).collect();
        for name in ["", "many"] {
            let mut b = BytesMut::new();
            shoal_wire::backend::put_message(&mut b, b'P', |b| {
                use bytes::BufMut;
                raw::cstr(b, name);
                raw::cstr(b, "SELECT $1::int4 + $65535::int4");
                b.put_u16(65535);
                for _ in 0..65535 {
                    b.put_u32(23);
                }
            });
            raw::bind(&mut b, "", name, &values);
            raw::execute(&mut b, "");
            raw::sync(&mut b);
            r.send(&b).await;
            let msgs = r.until_ready().await;
            let tags: String = msgs.iter().map(|m| m.tag).collect();
            assert_eq!(tags, "12DCZ", "{mode} {name:?}: {msgs:?}");
            assert_eq!(raw::first_column(&msgs[2]), "536", "1 + 535");
        }
    }
}
