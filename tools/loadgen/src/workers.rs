//! Worker processes: the same binary run again with `--worker I/N`, each writing one line
//! of JSON (its report) to stdout every so often and reading the coordinator's orders on
//! stdin. A process here may hold at most ~20,000 descriptors, hence several.

use std::io::BufRead;

use anyhow::Context;
use serde::de::DeserializeOwned;

/// Worker processes, killed if the coordinator stops early (an error, a panic).
pub struct Workers(pub Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Workers {
    /// Starts `n` workers with this process's arguments; their reports, by worker index.
    pub fn spawn<R: DeserializeOwned + Send + 'static>(
        n: usize,
    ) -> anyhow::Result<(Workers, tokio::sync::mpsc::UnboundedReceiver<(usize, R)>)> {
        let exe = std::env::current_exe()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut children = Workers(Vec::new());
        for i in 0..n {
            let mut child = std::process::Command::new(&exe)
                .args(std::env::args_os().skip(1))
                .arg("--worker")
                .arg(format!("{i}/{n}"))
                .stdout(std::process::Stdio::piped())
                .stdin(std::process::Stdio::piped())
                .spawn()
                .context("spawning a worker")?;
            let stdout = child.stdout.take().context("worker stdout")?;
            children.0.push(child);
            let tx = tx.clone();
            // A thread per worker reads its reports: a handful of workers, and the runtime
            // stays free of tokio's process driver (which Shoal does without).
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(r) = serde_json::from_str::<R>(&line) {
                        let _ = tx.send((i, r));
                    }
                }
            });
        }
        Ok((children, rx))
    }

    /// Writes `line` to every worker's stdin.
    pub fn tell(&mut self, line: &str) {
        use std::io::Write;
        for c in &mut self.0 {
            if let Some(stdin) = c.stdin.as_mut() {
                let _ = writeln!(stdin, "{line}");
            }
        }
    }
}

/// `--worker I/N` read.
pub fn parse_worker(w: &str) -> anyhow::Result<(usize, usize)> {
    w.split_once('/')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .context("--worker I/N")
}
