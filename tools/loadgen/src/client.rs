//! A worker process: its share of the connections, each a task that logs in and then sends
//! a query every interval.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::BytesMut;
use hdrhistogram::Histogram;
use loadgen::hist::encode_hist;
use loadgen::net::bound_socket;

use shoal_wire::backend::{self, AuthRequest};
use shoal_wire::{frontend, md5, scram, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use crate::{Args, Report};

/// SCRAM salted passwords by (salt, iterations): PBKDF2 runs once per distinct salt.
type SaltedCache = HashMap<(Vec<u8>, u32), [u8; 32]>;

#[derive(Default)]
struct Stats {
    attempted: AtomicU64,
    connected: AtomicU64,
    held: AtomicU64,
    held_at_stop: AtomicU64,
    /// Queries sent and not yet answered.
    in_flight: AtomicU64,
    /// Queries count from now on (see `--steady-only`).
    counting: std::sync::atomic::AtomicBool,
    queries: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
    hist: Mutex<Option<Histogram<u64>>>,
    salted: Mutex<SaltedCache>,
    /// Queries slower than `--slow-ms`: (start, Unix ms; latency, ms; port).
    slow: Mutex<Vec<(u64, u64, u16)>>,
}

impl Stats {
    fn error(&self, what: String) {
        *self
            .errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(what)
            .or_insert(0) += 1;
    }

    fn report(&self, connect_done: Option<Duration>, final_hist: bool) -> Report {
        let hist = if final_hist {
            self.hist
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(encode_hist)
        } else {
            None
        };
        Report {
            attempted: self.attempted.load(Ordering::Relaxed),
            connected: self.connected.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            held_at_stop: self.held_at_stop.load(Ordering::Relaxed),
            queries: self.queries.load(Ordering::Relaxed),
            errors: self
                .errors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            connect_done_ms: connect_done.map(|d| d.as_millis() as u64),
            hist,
            done: final_hist,
        }
    }
}

pub async fn run_worker(args: Args, index: usize, workers: usize) -> anyhow::Result<()> {
    let mine = args.connections / workers + usize::from(index < args.connections % workers);
    let stats = Arc::new(Stats::default());
    *stats.hist.lock().unwrap_or_else(|e| e.into_inner()) =
        Some(Histogram::new_with_bounds(1, 60_000_000, 3)?);
    let mut targets: Vec<SocketAddr> = Vec::with_capacity(args.port.len());
    for &port in &args.port {
        let addr = tokio::net::lookup_host((args.host.as_str(), port))
            .await?
            .next()
            .context("target address")?;
        targets.push(addr);
    }
    anyhow::ensure!(!targets.is_empty(), "no --port given");
    let tls = match args.tls {
        true => Some(tls_connector(&args)?),
        false => None,
    };
    let args = Arc::new(args);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(Phase::Run);
    let started = Instant::now();
    let reporter = {
        let stats = stats.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                println!(
                    "{}",
                    serde_json::to_string(&stats.report(None, false)).unwrap_or_default()
                );
            }
        })
    };
    let per_worker_rate = args.connect_rate / workers as f64;
    let mut tasks = Vec::with_capacity(mine);
    for k in 0..mine {
        if per_worker_rate > 0.0 {
            let due = started + Duration::from_secs_f64(k as f64 / per_worker_rate);
            tokio::time::sleep_until(due.into()).await;
        }
        let source = loadgen::net::source_addr(args.source_octet, index, k);
        stats.attempted.fetch_add(1, Ordering::Relaxed);
        tasks.push(tokio::spawn(connection(
            args.clone(),
            tls.clone(),
            // Interleaved over workers, so every target gets its share of each worker.
            targets[(k * workers + index) % targets.len()],
            source,
            stats.clone(),
            stop_rx.clone(),
        )));
    }
    // The connect phase ends when every attempt has logged in or failed.
    while stats.connected.load(Ordering::Relaxed)
        + stats
            .errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .sum::<u64>()
        < mine as u64
        && started.elapsed() < Duration::from_secs(600)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let connect_done = started.elapsed();
    if args.steady_only {
        // Every worker's connections are in when the coordinator says so.
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            let _ = tx.send(());
        });
        let _ = rx.await;
    }
    stats.counting.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(args.duration)).await;
    stats
        .held_at_stop
        .store(stats.held.load(Ordering::Relaxed), Ordering::Relaxed);
    // The measurement ends here: no query starts after this, and those under way finish
    // before any connection closes, so none waits behind the teardown (closing very many
    // sockets at once keeps the kernel busy for seconds).
    let _ = stop_tx.send(Phase::Quiet);
    let quiet = Instant::now();
    while stats.in_flight.load(Ordering::Relaxed) > 0 && quiet.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop_tx.send(Phase::Close);
    for t in tasks {
        let _ = t.await;
    }
    reporter.abort();
    if let Some(dir) = &args.slow_log {
        let slow = std::mem::take(&mut *stats.slow.lock().unwrap_or_else(|e| e.into_inner()));
        let text: String = slow
            .iter()
            .map(|(at, ms, port)| format!("{at} {ms} {port}\n"))
            .collect();
        std::fs::write(dir.join(format!("slow-{index}.txt")), text)?;
    }
    println!(
        "{}",
        serde_json::to_string(&stats.report(Some(connect_done), true))?
    );
    Ok(())
}

/// A TLS client configuration trusting only `--sslrootcert` (the system's roots are not
/// read: a benchmark's certificate is its own).
fn tls_connector(args: &Args) -> anyhow::Result<TlsConnector> {
    let path = args
        .sslrootcert
        .as_ref()
        .context("--tls needs --sslrootcert")?;
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in
        <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_slice_iter(
            &pem,
        )
    {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// SSLRequest, the server's `S`, then the TLS handshake.
async fn start_tls(
    args: &Args,
    connector: &TlsConnector,
    mut stream: tokio::net::TcpStream,
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut req = [0u8; 8];
    req[..4].copy_from_slice(&8i32.to_be_bytes());
    req[4..].copy_from_slice(&shoal_wire::startup::SSL_REQUEST_CODE.to_be_bytes());
    stream.write_all(&req).await?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).await?;
    anyhow::ensure!(answer[0] == b'S', "server refused TLS");
    let name = rustls::pki_types::ServerName::try_from(args.tls_server_name.clone())?;
    Ok(connector.connect(name, stream).await?)
}

async fn connection(
    args: Arc<Args>,
    tls: Option<TlsConnector>,
    target: SocketAddr,
    source: Ipv4Addr,
    stats: Arc<Stats>,
    stop: tokio::sync::watch::Receiver<Phase>,
) {
    let stream = match bound_socket(source) {
        Ok(s) => Box::pin(s.connect(target)).await,
        Err(e) => Err(e),
    };
    let stream = match stream {
        Ok(s) => s,
        Err(e) => return stats.error(format!("connect: {}", e.kind())),
    };
    let _ = stream.set_nodelay(true);
    match tls {
        None => session(args, stream, target.port(), stats, stop).await,
        // Boxed: the plain connection's task need not have room for TLS state.
        Some(connector) => match Box::pin(start_tls(&args, &connector, stream)).await {
            Ok(stream) => Box::pin(session(args, stream, target.port(), stats, stop)).await,
            Err(e) => stats.error(format!("tls: {e}")),
        },
    }
}

/// Where a worker's run is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Run,
    /// No new queries; the connections stay open.
    Quiet,
    /// Every connection closes.
    Close,
}

/// Logs in, then queries every interval until told to stop.
async fn session<S: AsyncRead + AsyncWrite + Unpin>(
    args: Arc<Args>,
    mut stream: S,
    port: u16,
    stats: Arc<Stats>,
    mut stop: tokio::sync::watch::Receiver<Phase>,
) {
    let mut buf = BytesMut::new();
    // Boxed, and freed once logged in: each of a million connections holds its task.
    if let Err(e) = Box::pin(login(&args, &mut stream, &mut buf, &stats)).await {
        return stats.error(format!("login: {e}"));
    }
    stats.connected.fetch_add(1, Ordering::Relaxed);
    stats.held.fetch_add(1, Ordering::Relaxed);
    // Spread the queries: each connection starts at a random point of the interval.
    let interval = Duration::from_secs_f64(args.interval.max(0.0));
    let mut query = BytesMut::new();
    frontend::query(&mut query, &args.query);
    let mut next = Instant::now() + interval.mul_f64(rand::random_range(0.0..1.0));
    buf = BytesMut::new();
    loop {
        if args.interval <= 0.0 {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next.into()) => {}
            _ = stop.changed() => break,
        }
        if *stop.borrow() != Phase::Run {
            break;
        }
        next += interval;
        let t0 = Instant::now();
        let counted = !args.steady_only || stats.counting.load(Ordering::Relaxed);
        // Counted before the query goes: the worker's quiet phase waits for it.
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        let answer = Box::pin(run_query(&mut stream, &query, &mut buf)).await;
        stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        match answer {
            Ok(None) if !counted => {}
            Ok(None) => {
                let us = t0.elapsed().as_micros() as u64;
                stats.queries.fetch_add(1, Ordering::Relaxed);
                let ms = us / 1000;
                if ms >= args.slow_ms && args.slow_log.is_some() {
                    let now_ms = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_millis() as u64;
                    let mut slow = stats.slow.lock().unwrap_or_else(|e| e.into_inner());
                    slow.push((now_ms - ms, ms, port));
                }
                if let Some(h) = stats
                    .hist
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                {
                    let _ = h.record(us.max(1));
                }
            }
            Ok(Some(code)) => stats.error(code),
            Err(e) => {
                stats.error(format!("query: {e}"));
                stats.held.fetch_sub(1, Ordering::Relaxed);
                return;
            }
        }
        // An idle connection keeps no buffer.
        buf = BytesMut::new();
    }
    // Boxed: only the end of the run needs it.
    Box::pin(async move {
        let _ = stop.wait_for(|p| *p == Phase::Close).await;
        stats.held.fetch_sub(1, Ordering::Relaxed);
        let mut bye = BytesMut::new();
        frontend::terminate(&mut bye);
        let _ = stream.write_all(&bye).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
) -> anyhow::Result<Frame> {
    loop {
        if let Some(f) = Frame::split(buf, 1 << 26)? {
            return Ok(f);
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(4096);
        }
        if stream.read_buf(buf).await? == 0 {
            anyhow::bail!("closed");
        }
    }
}

/// Runs one simple query; returns the SQLSTATE of an error, if any.
async fn run_query<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    query: &[u8],
    buf: &mut BytesMut,
) -> anyhow::Result<Option<String>> {
    stream.write_all(query).await?;
    let mut code = None;
    loop {
        let f = read_frame(stream, buf).await?;
        match f.tag() {
            b'Z' => return Ok(code),
            b'E' => code = Some(backend::parse_error(f.body())?.code),
            _ => {}
        }
    }
}

async fn login<S: AsyncRead + AsyncWrite + Unpin>(
    args: &Args,
    stream: &mut S,
    buf: &mut BytesMut,
    stats: &Stats,
) -> anyhow::Result<()> {
    let mut out = BytesMut::new();
    frontend::startup(
        &mut out,
        &[("user", &args.user), ("database", &args.dbname)],
    );
    stream.write_all(&out).await?;
    let mut exchange: Option<scram::ClientExchange> = None;
    let mut expected_signature = None;
    loop {
        let f = read_frame(stream, buf).await?;
        out.clear();
        match f.tag() {
            b'R' => match backend::parse_auth(f.body())? {
                AuthRequest::Ok => continue,
                AuthRequest::Cleartext => frontend::password(&mut out, &args.password),
                AuthRequest::Md5 { salt } => {
                    let stored = md5::stored_secret(&args.user, &args.password);
                    frontend::password(&mut out, &md5::salted_response(&stored, salt));
                }
                AuthRequest::Sasl { .. } => {
                    let (ex, first) = scram::ClientExchange::new();
                    frontend::sasl_initial_response(&mut out, scram::MECHANISM, first.as_bytes());
                    exchange = Some(ex);
                }
                AuthRequest::SaslContinue(data) => {
                    let ex = exchange.take().context("SASL continue out of order")?;
                    let fin = ex.respond(data, |salt, iters| {
                        // Computed under the lock: in a connect storm thousands of logins reach
                        // this point at once, and each computing PBKDF2 itself before the first
                        // result is cached stalls them all (logins then pile up in the pooler
                        // and its max_logins_in_progress refuses the rest).
                        *stats
                            .salted
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .entry((salt.to_vec(), iters))
                            .or_insert_with(|| scram::salted_password(&args.password, salt, iters))
                    })?;
                    frontend::sasl_response(&mut out, fin.message.as_bytes());
                    expected_signature = Some(fin.server_signature);
                }
                AuthRequest::SaslFinal(data) => {
                    let sig = expected_signature.context("SASL final out of order")?;
                    scram::verify_server_final(data, &sig)?;
                    continue;
                }
                AuthRequest::Other(n) => anyhow::bail!("unsupported auth request {n}"),
            },
            b'E' => anyhow::bail!("{}", backend::parse_error(f.body())?.code),
            b'Z' => return Ok(()),
            _ => continue,
        }
        stream.write_all(&out).await?;
    }
}
