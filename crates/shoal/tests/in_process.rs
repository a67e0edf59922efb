//! Shoal as a library, in-process: a session served over `tokio::io::duplex` (no socket
//! between the client and Shoal) against a real PostgreSQL, through the transport seam that
//! TLS will use too.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use shoal::app::App;
use shoal::config::Config;
use shoal::net::Stream;

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
            Stream::Buffered(Box::new(theirs)),
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

/// A client that reads slowly: `chunk` bytes, then a pause of a millisecond. Shoal's writes
/// to it fill the socket and stay pending, as with a busy client on a slow network.
struct SlowReader<S> {
    inner: S,
    chunk: usize,
    pause: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for SlowReader<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        if let Some(p) = self.pause.as_mut() {
            std::task::ready!(p.as_mut().poll(cx));
            self.pause = None;
        }
        let n = buf.remaining().min(self.chunk);
        let mut small = tokio::io::ReadBuf::new(buf.initialize_unfilled_to(n));
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut small);
        let filled = small.filled().len();
        buf.advance(filled);
        if filled > 0 {
            let pause = tokio::time::sleep(std::time::Duration::from_millis(1));
            self.pause = Some(Box::pin(pause));
        }
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for SlowReader<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Replies of every size around the relay's buffer boundaries (its read chunk, its
/// high-water mark, the 1 MiB step a large message grows by) to a slow TLS client, in both
/// pool modes: each must arrive whole. Shoal's end of the socket gets a small send buffer (as
/// under memory pressure), so most writes find it full: records rustls made but could not put
/// on the socket once stayed in its buffer after the last write, and the reply never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_replies_to_a_slow_tls_client_always_complete() {
    let (ca, cert, key) = ca_and_server_cert();
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).display().to_string();
    std::fs::write(path("cert.pem"), cert).unwrap();
    std::fs::write(path("key.pem"), key).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in
        <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_slice_iter(
            ca.as_bytes(),
        )
    {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut client_tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    client_tls.alpn_protocols = vec![b"postgresql".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client_tls));
    shoal::clock::start();
    for mode in ["transaction", "session"] {
        let db = unique_db("tlsbig");
        pg().create_database(&db);
        let extra = format!(
            "[tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n[pool]\npool_mode = \"{mode}\"\n",
            path("cert.pem"),
            path("key.pem"),
        );
        let config = Config::parse(&base_config(pg(), &[&db], &extra), "test", &|_| None).unwrap();
        let (_stop, shutdown) = tokio::sync::watch::channel(false);
        let app = App::new(config, shutdown).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connect = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (accepted, tcp) = tokio::join!(listener.accept(), connect);
        let (ours, peer) = accepted.unwrap();
        socket2::SockRef::from(&ours)
            .set_send_buffer_size(8192)
            .unwrap();
        tokio::spawn(shoal::session::serve(app, Stream::Tcp(ours), Some(peer)));
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = connector.connect(name, tcp.unwrap()).await.expect("TLS");
        let slow = SlowReader {
            inner: tls,
            chunk: 16384,
            pause: None,
        };
        let (client, conn) = tokio_postgres::Config::new()
            .user("app")
            .password(APP_PASSWORD)
            .dbname(&db)
            .connect_raw(slow, tokio_postgres::NoTls)
            .await
            .expect("login over TLS");
        tokio::spawn(conn);
        for base in [8192i64, 65536, 262144, 1 << 20, 2 << 20] {
            for delta in [-300i64, -77, -13, -1, 0, 1, 29, 150, 400] {
                let n = base + delta;
                let sql = format!("SELECT repeat('A', {n})");
                let reply = client.simple_query(&sql);
                let rows = tokio::time::timeout(std::time::Duration::from_secs(60), reply)
                    .await
                    .unwrap_or_else(|_| panic!("{mode}: a {n}-byte reply never completed"))
                    .unwrap();
                let got = rows
                    .iter()
                    .find_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::len),
                        _ => None,
                    })
                    .unwrap_or(0);
                assert_eq!(got as i64, n, "{mode}");
            }
        }
    }
}

/// Names of this process's threads that are shard threads.
fn shard_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with("shoal-shard-"))
                .count()
        })
        .unwrap_or(0)
}

/// Two nodes in one process, each with its own per-core shard threads (2 and 3): each
/// serves its own clients on its own shards and counts them there, and each node's threads
/// end when it stops. With the shards a process global, the second node would have shared
/// the first one's count and its threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_in_one_process_keep_their_own_shards() {
    shoal::clock::start();
    let mut nodes = Vec::new();
    for (n, prefix) in [(2, "shards_a"), (3, "shards_b")] {
        let db = unique_db(prefix);
        pg().create_database(&db);
        let text = with_server_keys(&base_config(pg(), &[&db], ""), "shard_packing = false");
        let config = Config::parse(&text, "test", &|_| None).unwrap();
        let shards = shoal::shard::Shards::start(n, false).unwrap();
        let listeners = shoal::run::bind(&config, &shards).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = shards.clone();
        let ready_file = ready.clone();
        let served = tokio::spawn(async move {
            let stop = async {
                let _ = stopped.await;
            };
            shoal::run::serve_on(config, serving, listeners, Some(&ready_file), stop).await
        });
        eventually(
            "the node is ready",
            std::time::Duration::from_secs(10),
            || ready.exists(),
        )
        .await;
        let text = std::fs::read_to_string(&ready).unwrap();
        let addr: std::net::SocketAddr = text
            .lines()
            .find_map(|l| l.strip_prefix("tcp "))
            .unwrap()
            .parse()
            .unwrap();
        nodes.push((n, db, shards, addr, stop, served, dir));
    }
    assert_eq!(
        shard_threads(),
        5,
        "each node started its own shard threads"
    );
    let mut clients = Vec::new();
    for (n, db, _, addr, ..) in &nodes {
        for _ in 0..6 {
            let (c, conn) = tokio_postgres::Config::new()
                .host(addr.ip().to_string())
                .port(addr.port())
                .user("app")
                .password(APP_PASSWORD)
                .dbname(db)
                .connect(tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            clients.push((*n, db.clone(), c));
        }
    }
    for (_, db, c) in &clients {
        assert_eq!(
            simple_rows(c, "SELECT current_database()").await,
            vec![db.clone()]
        );
    }
    for (n, _, shards, ..) in &nodes {
        let counts = shards.client_counts();
        assert_eq!(counts.len(), *n, "node with {n} shards: {counts:?}");
        assert_eq!(
            counts.iter().sum::<usize>(),
            6,
            "node with {n} shards: {counts:?}"
        );
    }
    drop(clients);
    for (_, _, shards, _, stop, served, _dir) in nodes {
        let _ = stop.send(());
        served.await.unwrap().unwrap();
        shards.stop();
    }
    eventually(
        "every shard thread has ended",
        std::time::Duration::from_secs(10),
        || shard_threads() == 0,
    )
    .await;
}
