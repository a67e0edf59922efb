//! What an operator sees of replicas: one row per backend of every pool with replicas (the
//! console's `SHOW REPLICAS`) and the `shoal_replica_*` metric families.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{ReplicaSet, Role, Writer};
use crate::pool::Pool;

/// One backend of a pool with replicas, as the console, metrics and dashboard show it.
#[derive(serde::Serialize)]
pub struct BackendRow {
    /// The client-facing pool (its primary's name).
    pub pool: String,
    pub host: String,
    pub port: u16,
    /// `primary`, `replica`, `down` or `unknown`, as last checked.
    pub role: &'static str,
    /// `ok`, `banned`, `lagging`, `down`, or for the primary: `writer` / `standby`.
    pub state: &'static str,
    /// Whether writes go here now.
    pub writer: bool,
    pub lag_bytes: Option<u64>,
    pub lag_ms: Option<u64>,
    pub reads: u64,
    pub bans: u64,
    pub servers: usize,
    pub in_use: usize,
    /// Labels of the backend's pool in `shoal_pool_*` (its route key's database).
    #[serde(skip)]
    pub database: String,
}

fn known(v: u64) -> Option<u64> {
    (v != u64::MAX).then_some(v)
}

/// Every backend of each pool in `sets` with its replicas: its primary first.
pub fn rows(sets: &[(Arc<Pool>, Arc<ReplicaSet>)]) -> Vec<BackendRow> {
    let mut out = Vec::new();
    let now = crate::clock::now_ms();
    for (p, set) in sets {
        let writer = set.writer();
        let primary_role = set.primary_role();
        out.push(BackendRow {
            pool: p.name.clone(),
            host: p.upstream.host.clone(),
            port: p.upstream.port,
            role: primary_role.label(),
            state: match (writer, primary_role) {
                (Writer::Configured, Role::Down) => "down",
                (Writer::Configured, _) => "writer",
                (_, Role::Down) => "down",
                _ => "standby",
            },
            writer: writer == Writer::Configured,
            lag_bytes: None,
            lag_ms: None,
            reads: 0,
            bans: 0,
            servers: p.stats.servers.load(Ordering::Relaxed),
            in_use: p.in_use(),
            database: p.database().to_owned(),
        });
        for (i, m) in set.members.iter().enumerate() {
            let is_writer = writer == Writer::Member(i);
            out.push(BackendRow {
                pool: p.name.clone(),
                host: m.host.host.clone(),
                port: m.host.port,
                role: m.role().label(),
                state: if is_writer {
                    "writer"
                } else if m.role() == Role::Down {
                    "down"
                } else if m.banned(now) {
                    "banned"
                } else if m.lagging() {
                    "lagging"
                } else {
                    "ok"
                },
                writer: is_writer,
                lag_bytes: known(m.lag_bytes.load(Ordering::Relaxed)),
                lag_ms: known(m.lag_ms.load(Ordering::Relaxed)),
                reads: m.reads.load(Ordering::Relaxed),
                bans: m.bans.load(Ordering::Relaxed),
                servers: m.pool.stats.servers.load(Ordering::Relaxed),
                in_use: m.pool.in_use(),
                database: m.pool.database().to_owned(),
            });
        }
    }
    out
}

/// The `shoal_replica_*` metric families.
pub fn encode(
    sets: &[(Arc<Pool>, Arc<ReplicaSet>)],
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use crate::metrics::LabelValue;
    use shoal_control::metrics::{counter, gauge};
    let rows = rows(sets);
    if rows.is_empty() {
        return Ok(());
    }
    let labels = |r: &BackendRow| {
        vec![
            ("pool", LabelValue::new(&r.pool)),
            (
                "backend",
                LabelValue::new(&format!("{}:{}", r.host, r.port)),
            ),
        ]
    };
    let with_state = |r: &BackendRow| {
        let mut l = labels(r);
        l.push(("role", LabelValue::new(r.role)));
        l.push(("state", LabelValue::new(r.state)));
        l
    };
    gauge(
        e,
        "shoal_replica_backend_info",
        "Each backend of a pool with replicas: its role and state as last checked (value 1)",
        &rows.iter().map(|r| (with_state(r), 1)).collect::<Vec<_>>(),
    )?;
    gauge(
        e,
        "shoal_replica_writer",
        "1 for the backend that takes the pool's writes now",
        &rows
            .iter()
            .map(|r| (labels(r), i64::from(r.writer)))
            .collect::<Vec<_>>(),
    )?;
    let lag_ms: Vec<_> = rows
        .iter()
        .filter_map(|r| r.lag_ms.map(|v| (labels(r), v as i64)))
        .collect();
    gauge(
        e,
        "shoal_replica_lag_milliseconds",
        "How old the state a replica shows is (since the primary passed its replay position)",
        &lag_ms,
    )?;
    let lag_bytes: Vec<_> = rows
        .iter()
        .filter_map(|r| r.lag_bytes.map(|v| (labels(r), v as i64)))
        .collect();
    gauge(
        e,
        "shoal_replica_lag_bytes",
        "WAL a replica has not replayed yet",
        &lag_bytes,
    )?;
    counter(
        e,
        "shoal_replica_reads",
        "Transactions routed to a replica for reading",
        &rows
            .iter()
            .filter(|r| !r.writer)
            .map(|r| (labels(r), r.reads))
            .collect::<Vec<_>>(),
    )?;
    counter(
        e,
        "shoal_replica_bans",
        "Times a replica was banned (a failed check, or a failure a client met)",
        &rows.iter().map(|r| (labels(r), r.bans)).collect::<Vec<_>>(),
    )?;
    Ok(())
}
