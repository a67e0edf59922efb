//! A database's change stream: every committed change to a table the cache keeps results
//! of, from any client of the database (through Shoal or not, by triggers too), seen
//! through logical replication and applied to the tables' versions (see
//! [`super::freshness`]).
//!
//! Runs on the control runtime, with two connections as the pool's user: one for SQL (the
//! publication, markers) and one in replication mode; which tables it may follow is the
//! database's catalogue's to say ([`crate::analysis::catalogue`]). The slot is
//! `TEMPORARY`: PostgreSQL drops it when the connection ends, so no WAL is ever kept for
//! a Shoal that is gone; a new connection starts a new slot from the present, and
//! everything kept before is dropped (the epoch moves), since changes in between were
//! not seen. The publication (`shoal_cache`) lists the tables results were wanted for.
//!
//! A table is covered once the stream carries its changes: it is added to the
//! publication, then a marker is written to the WAL (`pg_logical_emit_message`); when the
//! marker comes back through the stream, every transaction that committed before the
//! addition has been passed, and every later change to the table will be.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use shoal_wire::backend::tag as be;
use shoal_wire::pgoutput::{self, Message, ReplicationMessage};

use super::freshness::{Freshness, Table, BY_RESET, BY_STREAM};
use crate::analysis::catalogue::Relation;
use crate::server::{ServerConn, ServerError};

/// The publication every Shoal streams its cached tables from.
pub const PUBLICATION: &str = "shoal_cache";
/// The prefix of Shoal's markers in the WAL.
const MARKER: &str = "shoal-cache";
const TIMEOUT: Duration = Duration::from_secs(10);
/// How often the server hears how far the stream was read (so the slot lets WAL go).
const STATUS_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("the change stream sent something unexpected: {0}")]
    Protocol(String),
    #[error("the stream ended")]
    Ended,
}

/// The task: keeps a stream open while any pool caches results of the database.
pub async fn run(weak: Weak<Freshness>) {
    let mut backoff = Duration::from_secs(1);
    loop {
        let Some(f) = weak.upgrade() else { return };
        let result = Stream::open(&f).await;
        let error = match result {
            Ok(mut s) => {
                backoff = Duration::from_secs(1);
                let e = s.follow(&f).await.err().unwrap_or(StreamError::Ended);
                drop(s);
                e
            }
            Err(e) => e,
        };
        lost(&f);
        match error {
            StreamError::Ended if Arc::strong_count(&f) <= 1 => {
                drop_publication(&f).await;
                return;
            }
            e => {
                tracing::warn!(database = %f.label, error = %e, "cache change stream failed; nothing is served from the cache until it is back");
                f.state.lock().unwrap_or_else(|e| e.into_inner()).last_error = Some(e.to_string());
            }
        }
        drop(f);
        crate::timer::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// The stream is gone: nothing is covered, and nothing kept before is served.
fn lost(f: &Freshness) {
    for t in f.tables() {
        t.set_covered(false);
    }
    f.reset(BY_RESET);
    let mut s = f.state.lock().unwrap_or_else(|e| e.into_inner());
    s.connected = false;
    s.slot = None;
}

/// Caching of the database is off everywhere in this process: its publication goes.
async fn drop_publication(f: &Freshness) {
    if let Ok(mut c) = ServerConn::connect(&f.upstream, TIMEOUT).await {
        let sql = format!("DROP PUBLICATION IF EXISTS {PUBLICATION}");
        if let Err(e) = crate::timer::timeout(TIMEOUT, c.simple_query(&sql)).await {
            tracing::warn!(database = %f.label, error = ?e, "could not drop the cache's publication");
        }
    }
}

struct Stream {
    control: ServerConn,
    replication: ServerConn,
    /// Relation ids to names, as the stream described them.
    relations: HashMap<u32, String>,
    /// Tables changed by the transaction being streamed.
    changed: Vec<String>,
    in_transaction: bool,
    /// How far the stream was read, at a transaction boundary.
    read_lsn: u64,
    next_marker: u64,
    /// Markers written and not yet back, with the tables each covers.
    markers: HashMap<u64, Vec<Arc<Table>>>,
    status_sent: u64,
}

impl Stream {
    async fn open(f: &Freshness) -> Result<Stream, StreamError> {
        let mut control = ServerConn::connect(&f.upstream, TIMEOUT).await?;
        let create = format!("CREATE PUBLICATION {PUBLICATION}");
        match crate::timer::timeout(TIMEOUT, control.simple_query(&create)).await {
            Ok(Ok(())) => {}
            Ok(Err(ServerError::Db(e))) if e.code == "42710" => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(StreamError::Protocol("CREATE PUBLICATION timed out".into())),
        }
        let mut replication =
            ServerConn::connect_with(&f.upstream, TIMEOUT, &[("replication", "database")]).await?;
        let slot = format!("shoal_cache_{:016x}", rand::random::<u64>());
        let sql =
            format!("CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT");
        crate::timer::timeout(TIMEOUT, replication.simple_query(&sql))
            .await
            .map_err(|_| StreamError::Protocol("creating the slot timed out".into()))??;
        replication
            .start_replication(&format!(
                "START_REPLICATION SLOT {slot} LOGICAL 0/0 \
                 (proto_version '1', publication_names '{PUBLICATION}', messages 'true')"
            ))
            .await?;
        {
            let mut s = f.state.lock().unwrap_or_else(|e| e.into_inner());
            s.connected = true;
            s.last_error = None;
            s.slot = Some(slot);
        }
        tracing::info!(database = %f.label, "cache change stream started");
        let now = crate::clock::now_ms();
        Ok(Stream {
            control,
            replication,
            relations: HashMap::new(),
            changed: Vec::new(),
            in_transaction: false,
            read_lsn: 0,
            next_marker: 1,
            markers: HashMap::new(),
            status_sent: now,
        })
    }

    /// Reads the stream until it fails, or no pool caches the database any more.
    async fn follow(&mut self, f: &Arc<Freshness>) -> Result<(), StreamError> {
        let mut tick = crate::timer::interval(Duration::from_secs(1));
        self.cover(f).await?;
        loop {
            tokio::select! {
                frame = self.replication.read_frame() => {
                    let frame = frame?;
                    self.on_frame(f, frame.tag(), frame.body()).await?;
                }
                () = f.wake.notified() => self.cover(f).await?,
                () = tick.tick() => {
                    if Arc::strong_count(f) <= 1 {
                        return Err(StreamError::Ended);
                    }
                    self.cover(f).await?;
                    let now = crate::clock::now_ms();
                    if now.saturating_sub(self.status_sent) >= STATUS_EVERY.as_millis() as u64 {
                        self.send_status(f).await?;
                    }
                }
            }
        }
    }

    async fn on_frame(&mut self, f: &Freshness, tag: u8, body: &[u8]) -> Result<(), StreamError> {
        match tag {
            be::COPY_DATA => {}
            be::ERROR_RESPONSE => {
                let e = shoal_wire::backend::parse_error(body).map_err(ServerError::from)?;
                return Err(ServerError::Db(e).into());
            }
            b'c' => return Err(StreamError::Protocol("the server ended the stream".into())),
            _ => return Ok(()),
        }
        let bad = |e: pgoutput::PgOutputError| StreamError::Protocol(e.to_string());
        match pgoutput::replication_message(body).map_err(bad)? {
            ReplicationMessage::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                if !self.in_transaction {
                    self.read_lsn = self.read_lsn.max(wal_end);
                }
                if reply_requested {
                    self.send_status(f).await?;
                }
            }
            ReplicationMessage::XLogData { data, .. } => {
                self.on_change(f, pgoutput::message(data).map_err(bad)?)
            }
        }
        Ok(())
    }

    fn on_change(&mut self, f: &Freshness, m: Message<'_>) {
        match m {
            Message::Begin { .. } => self.in_transaction = true,
            Message::Relation(r) => {
                self.relations.insert(r.id, r.name.to_owned());
            }
            Message::Insert { relation, .. }
            | Message::Update { relation, .. }
            | Message::Delete { relation, .. } => self.note(relation),
            Message::Truncate { relations, .. } => {
                for r in relations {
                    self.note(r);
                }
            }
            Message::Commit { end_lsn, .. } => {
                for name in self.changed.drain(..) {
                    if name.is_empty() {
                        f.reset(BY_STREAM);
                    } else {
                        f.changed(&name, BY_STREAM);
                    }
                }
                self.in_transaction = false;
                self.read_lsn = self.read_lsn.max(end_lsn);
            }
            Message::LogicalMessage {
                prefix, content, ..
            } if prefix == MARKER => {
                let seq = std::str::from_utf8(content)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok());
                if let Some(tables) = seq.and_then(|s| self.markers.remove(&s)) {
                    for t in tables {
                        t.set_covered(true);
                    }
                }
            }
            _ => {}
        }
    }

    fn note(&mut self, relation: u32) {
        if let Some(name) = self.relations.get(&relation) {
            if !self.changed.contains(name) {
                self.changed.push(name.clone());
            }
        } else {
            // pgoutput describes a relation before its first change; a change to one it
            // did not describe cannot be placed, so nothing kept can be trusted.
            self.changed.push(String::new());
        }
    }

    /// Tells the server how far the stream was read.
    async fn send_status(&mut self, f: &Freshness) -> Result<(), StreamError> {
        self.replication.standby_status(self.read_lsn).await?;
        self.status_sent = crate::clock::now_ms();
        f.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .confirmed_lsn = self.read_lsn;
        Ok(())
    }

    /// Adds the tables wanted and not covered to the publication, and writes a marker.
    async fn cover(&mut self, f: &Freshness) -> Result<(), StreamError> {
        let pending: Vec<Arc<Table>> = self.markers.values().flatten().cloned().collect();
        let wanted: Vec<Arc<Table>> = f
            .tables()
            .into_iter()
            .filter(|t| {
                t.wanted.load(Ordering::Acquire)
                    && !t.covered()
                    && !t.refused.load(Ordering::Acquire)
                    && !pending.iter().any(|p| Arc::ptr_eq(p, t))
            })
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let catalogue = f.catalogue();
        let mut covering = Vec::new();
        for t in wanted {
            let qualified = match catalogue.relations.get(&t.name) {
                Some(Relation {
                    cacheable: true,
                    qualified,
                    ..
                }) => qualified,
                // Not a table the stream can follow.
                Some(_) => continue,
                // Made since the catalogue was read: looked at again on the next tick.
                None => {
                    f.want_catalogue();
                    continue;
                }
            };
            let mut ok = true;
            for q in qualified {
                let sql = format!("ALTER PUBLICATION {PUBLICATION} ADD TABLE {q}");
                match crate::timer::timeout(TIMEOUT, self.control.simple_query(&sql)).await {
                    Ok(Ok(())) => {}
                    // Already in it.
                    Ok(Err(ServerError::Db(e))) if e.code == "42710" => {}
                    Ok(Err(ServerError::Db(e))) => {
                        tracing::warn!(database = %f.label, table = %q, error = %e.message, "cannot add a table to the cache's publication; its results are not cached");
                        t.refused.store(true, Ordering::Release);
                        ok = false;
                        break;
                    }
                    Ok(Err(e)) => return Err(e.into()),
                    Err(_) => {
                        return Err(StreamError::Protocol("ALTER PUBLICATION timed out".into()))
                    }
                }
            }
            if ok {
                covering.push(t);
            }
        }
        if covering.is_empty() {
            return Ok(());
        }
        let seq = self.next_marker;
        self.next_marker += 1;
        let sql = "SELECT pg_logical_emit_message(false, $1, $2)::text";
        let seq_text = seq.to_string();
        crate::timer::timeout(TIMEOUT, self.control.query_row(sql, &[MARKER, &seq_text]))
            .await
            .map_err(|_| StreamError::Protocol("writing a marker timed out".into()))??;
        self.markers.insert(seq, covering);
        Ok(())
    }
}
