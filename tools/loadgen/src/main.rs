//! loadgen: opens very many PostgreSQL client connections (completing startup and
//! authentication), then has each run a small query every `--interval` seconds, like a fleet
//! of mostly idle serverless clients. Reports connect rate, connections held, achieved QPS,
//! latency percentiles (HDR histogram) and errors by SQLSTATE.
//!
//! A process may hold at most ~20,000 descriptors here, so `--workers` child processes share
//! the connections; each binds its sockets over many 127.x.y.z source addresses so one source
//! address's ~28k ephemeral ports do not run out.

mod client;

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Parser;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// One port, or several separated by commas (the nodes of a cluster): connections are
    /// spread over them evenly.
    #[arg(long, value_delimiter = ',', default_value = "6432")]
    port: Vec<u16>,
    #[arg(long, default_value = "postgres")]
    user: String,
    #[arg(long, env = "PGPASSWORD", default_value = "")]
    password: String,
    #[arg(long, default_value = "postgres")]
    dbname: String,
    /// Connections to open and hold, over all workers.
    #[arg(long, short = 'n', default_value_t = 1000)]
    connections: usize,
    /// Seconds between two queries of one connection (0: no queries, only hold).
    #[arg(long, default_value_t = 50.0)]
    interval: f64,
    /// Seconds to run after every connection has been attempted.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// New connections per second over all workers (0: all at once, a connect storm).
    #[arg(long, default_value_t = 0.0)]
    connect_rate: f64,
    /// Worker processes (default: enough for at most 15,000 connections each).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    #[arg(long, default_value = "SELECT 1")]
    query: String,
    /// Source addresses are 127.<second octet>.x.y; give each generator its own.
    #[arg(long, default_value_t = 1)]
    source_octet: u8,
    /// Connect over TLS (SSLRequest, then a TLS handshake), verifying the server against
    /// `--sslrootcert` and `--tls-server-name`.
    #[arg(long)]
    tls: bool,
    /// PEM CA file that signed the server's certificate (with `--tls`).
    #[arg(long)]
    sslrootcert: Option<std::path::PathBuf>,
    /// Name the server's certificate must carry (with `--tls`).
    #[arg(long, default_value = "localhost")]
    tls_server_name: String,
    /// Count only queries sent once every connection (of every worker) has been attempted
    /// and has logged in or failed: the steady state, not the connect storm. The hold's
    /// `--duration` then starts there too.
    #[arg(long)]
    steady_only: bool,
    /// Record every query slower than this many milliseconds (its start, latency and node
    /// port) in `--slow-log`.
    #[arg(long, default_value_t = 200)]
    slow_ms: u64,
    /// A directory where each worker writes its slow queries (`slow-I.txt`: start in Unix
    /// milliseconds, latency in milliseconds, port), to tell a stall of one node from one of
    /// all.
    #[arg(long)]
    slow_log: Option<std::path::PathBuf>,
    /// Write the final report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as worker I of N.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// What a worker reports every second, and once more at the end with its histogram.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
pub struct Report {
    pub attempted: u64,
    pub connected: u64,
    pub held: u64,
    /// Connections held when the worker was told to stop.
    pub held_at_stop: u64,
    pub queries: u64,
    pub errors: BTreeMap<String, u64>,
    pub connect_done_ms: Option<u64>,
    pub hist: Option<String>,
    pub done: bool,
}

/// The final summary over all workers.
#[derive(Serialize, Debug)]
struct Summary {
    connections: usize,
    connected: u64,
    held_at_end: u64,
    connect_seconds: Option<f64>,
    connect_rate: Option<f64>,
    queries: u64,
    qps: f64,
    latency_ms: BTreeMap<String, f64>,
    errors: BTreeMap<String, u64>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(w) = args.worker.clone() {
        let (i, n) = loadgen::workers::parse_worker(&w)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        return rt.block_on(client::run_worker(args, i, n));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(coordinate(args))
}

async fn coordinate(args: Args) -> anyhow::Result<()> {
    let workers = if args.workers > 0 {
        args.workers
    } else {
        args.connections.div_ceil(15_000).max(1)
    };
    let (mut children, mut rx) = loadgen::workers::Workers::spawn::<Report>(workers)?;
    let started = std::time::Instant::now();
    let mut latest: Vec<Report> = vec![Report::default(); workers];
    // Told once every connection has been attempted (see `--steady-only`).
    let mut steady_told = false;
    let mut last_print = std::time::Instant::now();
    let mut last_queries = 0u64;
    while let Some((i, r)) = rx.recv().await {
        latest[i] = r;
        let attempted: u64 = latest
            .iter()
            .map(|r| r.connected + r.errors.values().sum::<u64>())
            .sum();
        if !steady_told && attempted >= args.connections as u64 {
            steady_told = true;
            children.tell("steady");
        }
        if last_print.elapsed() >= Duration::from_secs(1) || latest.iter().all(|r| r.done) {
            let sum = |f: fn(&Report) -> u64| latest.iter().map(f).sum::<u64>();
            let queries = sum(|r| r.queries);
            let errors: u64 = latest.iter().flat_map(|r| r.errors.values()).sum();
            eprint!(
                "\r[{:>5.0}s] connected {:>7}/{} held {:>7} queries {:>9} ({:>6.0}/s) errors {:>5}   ",
                started.elapsed().as_secs_f64(),
                sum(|r| r.connected),
                args.connections,
                sum(|r| r.held),
                queries,
                (queries - last_queries) as f64 / last_print.elapsed().as_secs_f64(),
                errors
            );
            last_queries = queries;
            last_print = std::time::Instant::now();
        }
        if latest.iter().all(|r| r.done) {
            break;
        }
    }
    eprintln!();
    for c in &mut children.0 {
        let _ = c.wait();
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut errors = BTreeMap::new();
    for r in &latest {
        if let Some(h) = &r.hist {
            hist.add(loadgen::hist::decode_hist(h)?)?;
        }
        for (k, v) in &r.errors {
            *errors.entry(k.clone()).or_insert(0) += v;
        }
    }
    let connect_ms = latest
        .iter()
        .map(|r| r.connect_done_ms)
        .collect::<Option<Vec<_>>>();
    let connect_seconds = connect_ms.map(|v| v.into_iter().max().unwrap_or(0) as f64 / 1000.0);
    let connected: u64 = latest.iter().map(|r| r.connected).sum();
    let queries: u64 = latest.iter().map(|r| r.queries).sum();
    let mut latency_ms = BTreeMap::new();
    if !hist.is_empty() {
        for (name, q) in [("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999)] {
            latency_ms.insert(name.to_string(), hist.value_at_quantile(q) as f64 / 1000.0);
        }
        latency_ms.insert("max".into(), hist.max() as f64 / 1000.0);
    }
    let summary = Summary {
        connections: args.connections,
        connected,
        held_at_end: latest.iter().map(|r| r.held_at_stop).sum(),
        connect_seconds,
        connect_rate: connect_seconds
            .filter(|s| *s > 0.0)
            .map(|s| connected as f64 / s),
        queries,
        qps: queries as f64 / args.duration.max(0.001),
        latency_ms,
        errors,
    };
    let text = serde_json::to_string_pretty(&summary)?;
    println!("{text}");
    if let Some(path) = &args.json {
        std::fs::write(path, text)?;
    }
    Ok(())
}
