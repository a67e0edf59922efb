//! A worker process: its share of the users, each a task holding one socket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;

use crate::{Args, Report};

/// Where the run is, as the coordinator says on the worker's stdin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Joining,
    Sending,
    Counting,
    Stopped,
    Exit,
}

#[derive(Default)]
struct Stats {
    joined: AtomicU64,
    failed: AtomicU64,
    sent: AtomicU64,
    received: AtomicU64,
    lost: AtomicU64,
    hist: Mutex<Option<Histogram<u64>>>,
    first_error: Mutex<Option<String>>,
}

impl Stats {
    fn fail(&self, what: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(what);
    }

    fn report(&self, done: bool) -> Report {
        let hist = if done {
            self.hist
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(loadgen::hist::encode_hist)
        } else {
            None
        };
        Report {
            joined: self.joined.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            hist,
            done,
            first_error: self
                .first_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

pub async fn run_worker(args: Args, index: usize, workers: usize) -> anyhow::Result<()> {
    let args = Arc::new(args);
    let stats = Arc::new(Stats::default());
    *stats.hist.lock().unwrap_or_else(|e| e.into_inner()) = Some(loadgen::hist::new_hist());
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(Phase::Joining);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let phase = match line.as_deref().unwrap_or("exit").trim() {
                "send" => Phase::Sending,
                "count" => Phase::Counting,
                "stop" => Phase::Stopped,
                _ => Phase::Exit,
            };
            let _ = phase_tx.send(phase);
            if phase == Phase::Exit {
                return;
            }
        }
        let _ = phase_tx.send(Phase::Exit);
    });
    {
        let stats = stats.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                println!(
                    "{}",
                    serde_json::to_string(&stats.report(false)).unwrap_or_default()
                );
            }
        });
    }
    let per_worker_rate = args.connect_rate / workers as f64;
    let started = Instant::now();
    for (k, u) in (index..args.users).step_by(workers).enumerate() {
        if per_worker_rate > 0.0 {
            tokio::time::sleep_until(started + Duration::from_secs_f64(k as f64 / per_worker_rate))
                .await;
        }
        let source = loadgen::net::source_addr(args.source_octet, index, k);
        tokio::spawn(user(
            args.clone(),
            u,
            source,
            stats.clone(),
            phase_rx.clone(),
        ));
    }
    let mut phase = phase_rx.clone();
    while *phase.borrow_and_update() != Phase::Exit {
        if phase.changed().await.is_err() {
            break;
        }
    }
    println!("{}", serde_json::to_string(&stats.report(true))?);
    std::process::exit(0);
}

/// One of a user's channels: its topic and when it sends next.
struct Channel {
    topic: String,
    join_ref: &'static str,
    next: Instant,
    /// Between this user's sends to it (`None`: it sends none).
    every: Option<Duration>,
}

struct Conn {
    ws: tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>,
    v2: bool,
    next_ref: u64,
}

impl Conn {
    async fn push(
        &mut self,
        join_ref: &str,
        topic: &str,
        event: &str,
        payload: &str,
    ) -> anyhow::Result<String> {
        let r = self.next_ref.to_string();
        self.next_ref += 1;
        let text = if self.v2 {
            format!(r#"["{join_ref}","{r}","{topic}","{event}",{payload}]"#)
        } else {
            format!(
                r#"{{"topic":"{topic}","event":"{event}","payload":{payload},"ref":"{r}","join_ref":"{join_ref}"}}"#
            )
        };
        self.ws.send(Message::text(text)).await?;
        Ok(r)
    }
}

async fn user(
    args: Arc<Args>,
    u: usize,
    source: std::net::Ipv4Addr,
    stats: Arc<Stats>,
    phase: tokio::sync::watch::Receiver<Phase>,
) {
    let mut conn = match join(&args, u, source).await {
        Ok(c) => c,
        Err(e) => return stats.fail(format!("{e:#}")),
    };
    stats.joined.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = traffic(&args, u, &mut conn, &stats, phase).await {
        stats.lost.fetch_add(1, Ordering::Relaxed);
        stats
            .first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(format!("user {u}: {e:#}"));
    }
}

fn channels(args: &Args, u: usize) -> Vec<(String, &'static str)> {
    let room = if args.changes.is_some() {
        "changes"
    } else {
        "room"
    };
    let mut v = vec![(
        format!("realtime:{room}-{}", u / args.channel_size.max(1)),
        "1",
    )];
    if args.echo {
        v.push((format!("realtime:echo-{u}"), "2"));
    }
    v
}

async fn join(args: &Args, u: usize, source: std::net::Ipv4Addr) -> anyhow::Result<Conn> {
    let addr = args.addr[(u / args.channel_size.max(1)) % args.addr.len()];
    let tcp = loadgen::net::bound_socket(source)?.connect(addr).await?;
    let token = match &args.jwt_secret {
        Some(secret) => user_token(secret, u),
        None => args.token.clone(),
    };
    let url = format!(
        "ws://{addr}/t/{}/realtime/v1/websocket?vsn={}&apikey={token}",
        args.tenant, args.vsn
    );
    // Small buffers: a generator holds tens of thousands of these.
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let (ws, _) = tokio_tungstenite::client_async_with_config(url, tcp, Some(config)).await?;
    let mut conn = Conn {
        ws,
        v2: args.vsn.starts_with('2'),
        next_ref: 1,
    };
    let changes = args.changes.as_deref().map_or(String::new(), |table| {
        format!(r#","postgres_changes":[{{"event":"INSERT","schema":"public","table":"{table}"}}]"#)
    });
    let config = format!(
        r#"{{"config":{{"broadcast":{{"self":true,"ack":false}},"presence":{{"key":"","enabled":false}},"private":{}{changes}}}}}"#,
        args.private
    );
    let config = config.as_str();
    let mut waiting = Vec::new();
    for (topic, join_ref) in channels(args, u) {
        waiting.push(conn.push(join_ref, &topic, "phx_join", config).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !waiting.is_empty() {
        let m = tokio::time::timeout_at(deadline, conn.ws.next())
            .await
            .map_err(|_| anyhow::anyhow!("no join reply within 60 s"))?;
        let Some(Ok(Message::Text(t))) = m else {
            anyhow::bail!("the socket ended while joining: {m:?}");
        };
        let v: serde_json::Value = serde_json::from_str(&t)?;
        let (r, payload) = if conn.v2 {
            (&v[1], &v[4])
        } else {
            (&v["ref"], &v["payload"])
        };
        if let Some(i) = waiting.iter().position(|w| r == w.as_str()) {
            anyhow::ensure!(payload["status"] == "ok", "join refused: {payload}");
            waiting.swap_remove(i);
        }
    }
    Ok(conn)
}

/// User `u`'s own token: HS256 over `{role, sub, team, exp}`.
fn user_token(secret: &str, u: usize) -> String {
    use base64::Engine;
    use hmac::Mac;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let exp = now_us() / 1_000_000 + 24 * 3600;
    let head = b64(br#"{"alg":"HS256","typ":"JWT"}"#);
    let body = b64(format!(
        r#"{{"role":"authenticated","sub":"user-{u}","team":"t0","exp":{exp}}}"#
    )
    .as_bytes());
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes any key length");
    mac.update(format!("{head}.{body}").as_bytes());
    format!("{head}.{body}.{}", b64(&mac.finalize().into_bytes()))
}

/// The send time a broadcast carries (`"t":` microseconds), found in a frame of either
/// version without parsing it.
fn sent_at(frame: &[u8]) -> Option<u64> {
    let mut at = frame.windows(4).position(|w| w == br#""t":"#)? + 4;
    // PostgreSQL writes `"t": 1` (jsonb), Shoal `"t":1`.
    while frame.get(at) == Some(&b' ') {
        at += 1;
    }
    let digits = frame[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&frame[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

async fn traffic(
    args: &Args,
    u: usize,
    conn: &mut Conn,
    stats: &Stats,
    mut phase: tokio::sync::watch::Receiver<Phase>,
) -> anyhow::Result<()> {
    let every =
        |per_minute: f64| (per_minute > 0.0).then(|| Duration::from_secs_f64(60.0 / per_minute));
    let start = Instant::now();
    let mut chans: Vec<Channel> = channels(args, u)
        .into_iter()
        .enumerate()
        .map(|(i, (topic, join_ref))| {
            let own = topic.starts_with("realtime:echo-");
            let interval = every(match args.echo_per_minute {
                Some(n) if own => n,
                _ => args.per_minute,
            });
            // Spread over the interval so the load is steady, not in waves.
            let phase = interval.map_or(Duration::ZERO, |d| {
                d.mul_f64(((u * 7919 + i * 104_729) % 10_007) as f64 / 10_007.0)
            });
            Channel {
                topic,
                join_ref,
                next: start + phase,
                every: interval,
            }
        })
        .collect();
    let interval = chans.iter().find_map(|c| c.every);
    let filler = "x".repeat(args.payload);
    let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let mut heartbeat = Instant::now() + Duration::from_secs(25);
    loop {
        let now_phase = *phase.borrow();
        let sending = interval.is_some() && matches!(now_phase, Phase::Sending | Phase::Counting);
        let next_send = if sending {
            chans
                .iter()
                .filter(|c| c.every.is_some())
                .map(|c| c.next)
                .min()
                .unwrap_or(far)
        } else {
            far
        };
        tokio::select! {
            m = conn.ws.next() => {
                let frame = match m {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Text(t))) => t.into(),
                    Some(Ok(Message::Close(f))) => anyhow::bail!("closed by the server: {f:?}"),
                    Some(Ok(_)) => continue,
                    Some(Err(e)) => return Err(e.into()),
                    None => anyhow::bail!("the socket ended"),
                };
                if *phase.borrow() == Phase::Counting {
                    if let Some(t) = sent_at(&frame) {
                        stats.received.fetch_add(1, Ordering::Relaxed);
                        let us = now_us().saturating_sub(t).max(1);
                        if let Some(h) = stats.hist.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
                            let _ = h.record(us.min(60_000_000));
                        }
                    }
                }
            }
            () = tokio::time::sleep_until(next_send) => {
                let Some(c) = chans.iter_mut().filter(|c| c.every.is_some()).min_by_key(|c| c.next) else { continue };
                let Some(d) = c.every else { continue };
                c.next += d;
                let payload = format!(
                    r#"{{"type":"broadcast","event":"m","payload":{{"t":{},"f":"{filler}"}}}}"#,
                    now_us()
                );
                let (join_ref, topic) = (c.join_ref, c.topic.clone());
                conn.push(join_ref, &topic, "broadcast", &payload).await?;
                if *phase.borrow() == Phase::Counting {
                    stats.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
            () = tokio::time::sleep_until(heartbeat) => {
                heartbeat += Duration::from_secs(25);
                conn.push("", "phoenix", "heartbeat", "{}").await?;
            }
            changed = phase.changed() => {
                if changed.is_err() || *phase.borrow() == Phase::Exit {
                    let _ = conn.ws.close(None).await;
                    return Ok(());
                }
                if *phase.borrow() == Phase::Sending {
                    // Sending starts now: no burst of sends overdue since the joins.
                    let now = Instant::now();
                    for c in &mut chans {
                        c.next = now + c.next.saturating_duration_since(start);
                    }
                }
            }
        }
    }
}
