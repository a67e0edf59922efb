//! The machine's own price of one more process on a request's path: two processes passing a
//! small message over loopback TCP and back, the way a relaying node passes a client's
//! query to the pool's owner. `bench/cluster` prints it beside the relay's added latency.
//!
//! Measured three ways, back to back: with the two processes on different CPUs (each
//! message wakes a CPU that went idle: on a virtual machine without halt polling, the
//! dearest case), on one CPU, and where the scheduler puts them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const MESSAGE: usize = 32;
const ROUND_TRIPS: usize = 20_000;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, port, cpu] = &args[..] {
        if flag == "--echo" {
            pin(cpu.parse()?);
            return echo(port.parse()?);
        }
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = serde_json::Map::new();
    if cpus > 1 {
        report.insert("other_cpu_us".into(), measure(Some((0, 1)))?);
    }
    report.insert("same_cpu_us".into(), measure(Some((0, 0)))?);
    report.insert("unpinned_us".into(), measure(None)?);
    println!("{}", serde_json::Value::Object(report));
    Ok(())
}

/// Round trips with this process on `cpus.0` and the echoing one on `cpus.1` (anywhere,
/// with none).
fn measure(cpus: Option<(i32, i32)>) -> anyhow::Result<serde_json::Value> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let (here, there) = cpus.unwrap_or((-1, -1));
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["--echo", &port.to_string(), &there.to_string()])
        .spawn()?;
    pin(here);
    let (mut s, _) = listener.accept()?;
    s.set_nodelay(true)?;
    let mut buf = [1u8; MESSAGE];
    let mut took = Vec::with_capacity(ROUND_TRIPS);
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
        took.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(s);
    child.wait()?;
    pin(-1);
    Ok(percentiles(took))
}

/// Keeps this process on `cpu` (any CPU, for -1).
#[allow(unsafe_code)]
fn pin(cpu: i32) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET and sched_setaffinity get
    // valid pointers to it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        for c in 0..cpus {
            if cpu < 0 || c == cpu as usize {
                libc::CPU_SET(c, &mut set);
            }
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The other process: sends back every message it gets, until the connection ends.
fn echo(port: u16) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut buf = [0u8; MESSAGE];
    loop {
        match s.read_exact(&mut buf) {
            Ok(()) => s.write_all(&buf)?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

fn percentiles(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| (v[((v.len() - 1) as f64 * q) as usize] * 10.0).round() / 10.0;
    serde_json::json!({ "p50": at(0.5), "p99": at(0.99) })
}
