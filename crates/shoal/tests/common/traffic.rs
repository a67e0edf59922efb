//! Clients running a statement back to back, for tests that change things under load and
//! then assert that no client saw an error.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Traffic {
    stop: Arc<AtomicBool>,
    /// Statements each client completed.
    done: Vec<Arc<AtomicU64>>,
    workers: Vec<tokio::task::JoinHandle<Vec<String>>>,
}

impl Traffic {
    /// Each client runs `sql` (simple protocol) in a loop until [`Traffic::stop`].
    pub fn start(clients: Vec<tokio_postgres::Client>, sql: &'static str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let done: Vec<Arc<AtomicU64>> = clients.iter().map(|_| Arc::default()).collect();
        let workers = clients
            .into_iter()
            .zip(&done)
            .map(|(c, done)| {
                let (stop, done) = (stop.clone(), done.clone());
                tokio::spawn(async move {
                    let mut failures = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match c.simple_query(sql).await {
                            Ok(_) => {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => failures.push(format!("{e:?}")),
                        }
                    }
                    failures
                })
            })
            .collect();
        Traffic {
            stop,
            done,
            workers,
        }
    }

    /// Statements completed so far.
    pub fn done(&self) -> u64 {
        self.done.iter().map(|d| d.load(Ordering::Relaxed)).sum()
    }

    /// Waits until `n` more statements have completed.
    pub async fn wait_for(&self, n: u64) {
        let target = self.done() + n;
        super::eventually("traffic", Duration::from_secs(30), || self.done() >= target).await;
    }

    /// Waits until every client has completed `n` more statements (`what` names the moment,
    /// should one of them stall).
    #[allow(dead_code)]
    pub async fn wait_for_each(&self, n: u64, what: &str) {
        let from: Vec<u64> = self
            .done
            .iter()
            .map(|d| d.load(Ordering::Relaxed))
            .collect();
        super::eventually(what, Duration::from_secs(30), || {
            self.done
                .iter()
                .zip(&from)
                .all(|(d, f)| d.load(Ordering::Relaxed) >= f + n)
        })
        .await;
    }

    /// Stops the clients; returns every error they saw.
    pub async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        let mut failures = Vec::new();
        for w in self.workers {
            failures.extend(w.await.unwrap());
        }
        failures
    }
}
