//! rtload: very many realtime users, each a WebSocket speaking Phoenix channels as
//! realtime-js does (protocol 2.0: pushes as JSON arrays, broadcasts received as binary
//! frames; or 1.0 JSON), joined to a channel shared with `--channel-size` others (and,
//! with `--echo`, to a channel of its own), sending `--per-minute` broadcasts a minute to
//! each with the send time inside. Every receipt is timed from its send: delivered
//! messages a second and latency percentiles (HDR histogram).
//!
//! User `u` is in channel `room-(u / channel-size)`; a channel's users all connect to the
//! same one of `--addr`'s addresses, so several Shoal processes can share the users while
//! every channel stays on one. Worker processes hold the sockets (a process here may have
//! at most ~20,000 descriptors), each over its own loopback source addresses.

mod user;

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug, Clone)]
#[command(version, about)]
pub struct Args {
    /// Realtime endpoints (comma-separated); channels are spread over them.
    #[arg(long, value_delimiter = ',', default_value = "127.0.0.1:4001")]
    addr: Vec<SocketAddr>,
    #[arg(long, default_value = "bench")]
    tenant: String,
    /// The tenant's JWT.
    #[arg(long, env = "RT_TOKEN", default_value = "")]
    token: String,
    #[arg(long, default_value = "2.0.0")]
    vsn: String,
    #[arg(long, short = 'n', default_value_t = 1000)]
    users: usize,
    /// Users per shared channel.
    #[arg(long, default_value_t = 6)]
    channel_size: usize,
    /// Each user also joins a channel of its own (`broadcast.self`) and sends to it.
    #[arg(long)]
    echo: bool,
    /// Broadcasts a minute each user sends to each of its channels (0: idle users).
    #[arg(long, default_value_t = 2.0)]
    per_minute: f64,
    /// Broadcasts a minute each user sends to its own channel, when not `--per-minute`
    /// (the seed's workload: 2 a second in every channel, so 120 to one's own and 20 to a
    /// channel of six).
    #[arg(long)]
    echo_per_minute: Option<f64>,
    /// Bytes of filler in each message's payload.
    #[arg(long, default_value_t = 32)]
    payload: usize,
    /// Seconds of measurement, after every user has joined and `--warmup` has passed.
    #[arg(long, default_value_t = 30.0)]
    duration: f64,
    /// Seconds of sending before receipts count.
    #[arg(long, default_value_t = 5.0)]
    warmup: f64,
    /// Seconds to hold the users after the measurement (to take the server's measure).
    #[arg(long, default_value_t = 0.0)]
    hold: f64,
    /// New sockets a second over all workers.
    #[arg(long, default_value_t = 3000.0)]
    connect_rate: f64,
    /// Worker processes (default: enough for at most 12,000 users each).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Source addresses are 127.<octet>.x.y; give each generator its own.
    #[arg(long, default_value_t = 3)]
    source_octet: u8,
    /// Postgres Changes: each user's channel binds INSERTs of this table (in `public`);
    /// receipts are timed by the row's `t` (microseconds since the epoch when written).
    #[arg(long)]
    changes: Option<String>,
    /// Join the channels as private ones (broadcasts from the database).
    #[arg(long)]
    private: bool,
    /// Sign a token per user (`sub` = `user-<n>`, `team` = `t0`, role `authenticated`)
    /// with this HS256 secret, instead of sharing `--token`.
    #[arg(long, env = "RT_JWT_SECRET")]
    jwt_secret: Option<String>,
    /// Write the final report as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Internal: run as worker I of N.
    #[arg(long, hide = true)]
    worker: Option<String>,
}

/// What a worker reports every second, and at the end with its histogram.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
pub struct Report {
    pub joined: u64,
    pub failed: u64,
    pub sent: u64,
    pub received: u64,
    /// Sockets the server closed or dropped after joining.
    pub lost: u64,
    pub hist: Option<String>,
    pub done: bool,
    pub first_error: Option<String>,
}

#[derive(Serialize, Debug)]
struct Summary {
    users: usize,
    joined: u64,
    failed: u64,
    lost: u64,
    channels: usize,
    sent: u64,
    received: u64,
    seconds: f64,
    sent_per_second: f64,
    delivered_per_second: f64,
    latency_ms: std::collections::BTreeMap<String, f64>,
    first_error: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if let Some(w) = args.worker.clone() {
        let (i, n) = loadgen::workers::parse_worker(&w)?;
        return rt.block_on(user::run_worker(args, i, n));
    }
    rt.block_on(coordinate(args))
}

async fn coordinate(args: Args) -> anyhow::Result<()> {
    let workers = if args.workers > 0 {
        args.workers
    } else {
        args.users.div_ceil(12_000).max(1)
    };
    let (mut children, mut rx) = loadgen::workers::Workers::spawn::<Report>(workers)?;
    let started = std::time::Instant::now();
    let mut latest = vec![Report::default(); workers];
    // Phases: joining, then warm-up, measuring, holding.
    let mut measuring_since: Option<std::time::Instant> = None;
    let mut told_start = false;
    let mut last_print = std::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            got = rx.recv() => match got {
                Some((i, r)) => latest[i] = r,
                None => break,
            },
            _ = tick.tick() => {}
        }
        let sum = |f: fn(&Report) -> u64| latest.iter().map(f).sum::<u64>();
        let settled = sum(|r| r.joined) + sum(|r| r.failed);
        if !told_start && settled >= args.users as u64 {
            told_start = true;
            children.tell("send");
            let warmup = Duration::from_secs_f64(args.warmup);
            tokio::time::sleep(warmup).await;
            children.tell("count");
            // Markers for a driving script (bench/realtime) to take the server's measure.
            eprintln!("\n## measuring");
            measuring_since = Some(std::time::Instant::now());
        }
        if let Some(since) = measuring_since {
            if since.elapsed().as_secs_f64() >= args.duration {
                children.tell("stop");
                eprintln!("\n## measured");
                measuring_since = None;
                if args.hold > 0.0 {
                    eprintln!("## holding {} s", args.hold);
                    tokio::time::sleep(Duration::from_secs_f64(args.hold)).await;
                }
                children.tell("exit");
            }
        }
        if last_print.elapsed() >= Duration::from_secs(1) {
            eprint!(
                "\r[{:>5.0}s] joined {:>7}/{} failed {:>5} lost {:>5} sent {:>9} received {:>10}   ",
                started.elapsed().as_secs_f64(),
                sum(|r| r.joined),
                args.users,
                sum(|r| r.failed),
                sum(|r| r.lost),
                sum(|r| r.sent),
                sum(|r| r.received),
            );
            last_print = std::time::Instant::now();
        }
        if latest.iter().all(|r| r.done) {
            break;
        }
    }
    eprintln!();
    summarize(&args, &latest)
}

fn summarize(args: &Args, latest: &[Report]) -> anyhow::Result<()> {
    let mut hist = loadgen::hist::new_hist();
    for r in latest {
        if let Some(h) = &r.hist {
            hist.add(loadgen::hist::decode_hist(h)?)?;
        }
    }
    let mut latency_ms = std::collections::BTreeMap::new();
    if !hist.is_empty() {
        for (name, q) in [("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999)] {
            latency_ms.insert(name.to_string(), hist.value_at_quantile(q) as f64 / 1000.0);
        }
        latency_ms.insert("max".into(), hist.max() as f64 / 1000.0);
    }
    let sum = |f: fn(&Report) -> u64| latest.iter().map(f).sum::<u64>();
    let seconds = args.duration;
    let summary = Summary {
        users: args.users,
        joined: sum(|r| r.joined),
        failed: sum(|r| r.failed),
        lost: sum(|r| r.lost),
        channels: args.users.div_ceil(args.channel_size.max(1))
            + if args.echo { args.users } else { 0 },
        sent: sum(|r| r.sent),
        received: sum(|r| r.received),
        seconds,
        sent_per_second: sum(|r| r.sent) as f64 / seconds,
        delivered_per_second: hist.len() as f64 / seconds,
        latency_ms,
        first_error: latest.iter().find_map(|r| r.first_error.clone()),
    };
    let text = serde_json::to_string_pretty(&summary)?;
    println!("{text}");
    if let Some(path) = &args.json {
        std::fs::write(path, text)?;
    }
    Ok(())
}
