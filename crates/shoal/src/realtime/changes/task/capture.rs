//! The capture itself, while it lasts: the replication stream and the control connection
//! beside it, the publication grown to cover what is joined, and batches authorised and
//! delivered. The [`Task`] owns what outlives a connection (subscriptions, the slot's
//! position) and opens a new capture after a failure.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use shoal_realtime::changes::Binding;
use shoal_realtime::feed::{Identity, Ready};

use super::Task;
use crate::realtime::changes::deliver::{self, Listener};
use crate::realtime::changes::stream::{
    quote_ident, CaptureError, Event, Row, Stream, MARKER, SETTINGS, TIMEOUT,
};
use crate::realtime::changes::{authorize, count, messages, migrate};
use crate::server::{ServerConn, ServerError, Upstream};

/// How often the partitions of `realtime.messages` are made ahead and dropped behind.
const MAINTAIN_EVERY: Duration = Duration::from_secs(3600);
/// Rows in a batch past which it is authorised and delivered without waiting for more.
const MAX_BATCH: usize = 5000;

/// What a channel joined without broadcasts from the database is told (with
/// `replication_ready`).
pub(super) fn no_broadcasts(e: &CaptureError) -> String {
    format!("Unable to capture broadcasts from the database: {e}")
}

pub(super) struct Capture {
    control: ServerConn,
    stream: Stream,
    /// Tables in the publication.
    published: HashSet<u32>,
    batch: Vec<Row>,
    /// The end of the batch's last transaction.
    batch_end: u64,
    policies: authorize::Policies,
    /// `realtime.messages` is streamed (broadcasts from the database).
    messages: bool,
    /// The tables a binding's schema and table named when last looked up (a binding
    /// whose tables are all published needs no look-up: thousands of joins of one table
    /// cost one).
    resolved: HashMap<(String, String), Vec<(u32, String)>>,
    maintained: Instant,
}

impl Capture {
    pub(super) async fn open(t: &mut Task) -> Result<Capture, CaptureError> {
        let up = t.upstream()?;
        t.streamed_from = Some(up.clone());
        let mut control = control_connection(&up).await?;
        let level = query_text(&mut control, "SELECT current_setting('wal_level')", &[]).await?;
        if level != "logical" {
            return Err(CaptureError::Refused(format!(
                "the database's wal_level is {level}; Postgres Changes need wal_level = logical"
            )));
        }
        if !t.slot_made {
            // A slot of the same name is one a crashed process left (with its
            // publication): its changes were for subscribers that are gone.
            drop_slot_on(&mut control, &t.name).await?;
            // The publication first: decoding from the slot's start looks it up.
            let create = format!(
                "CREATE PUBLICATION {} WITH (publish_via_partition_root = true)",
                t.name
            );
            match crate::timer::timeout(TIMEOUT, control.simple_query(&create)).await {
                Ok(Ok(())) => {}
                Ok(Err(ServerError::Db(e))) if e.code == "42710" => {}
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => return Err(CaptureError::Timeout("CREATE PUBLICATION")),
            }
            query_text(
                &mut control,
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&t.name],
            )
            .await?;
            t.slot_made = true;
            t.delivered = 0;
            tracing::info!(tenant = %t.tenant, slot = %t.name, "Postgres Changes capture started");
        }
        let published = query_text(
            &mut control,
            "SELECT coalesce(json_agg(r.prrelid::int8), '[]')::text FROM pg_publication_rel r \
             JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = $1",
            &[&t.name],
        )
        .await?;
        let mut published: HashSet<u32> =
            serde_json::from_str(&published).map_err(|e| CaptureError::Protocol(e.to_string()))?;
        let messages = t.has_tenant
            && publish_messages(&mut control, &t.name, &t.tenant, &mut published).await?;
        let stream = match Stream::start(&up, &t.name, &t.name, t.delivered).await {
            Err(CaptureError::Server(ServerError::Db(e))) if e.code == "42704" => {
                tracing::warn!(tenant = %t.tenant, slot = %t.name, "the Postgres Changes slot is gone (dropped by someone?); changes since may be lost");
                t.slot_made = false;
                return Err(ServerError::Db(e).into());
            }
            r => r?,
        };
        // Waiting joins are covered again (a marker written before may be lost).
        for key in &t.waiting {
            if let Some(s) = t.subs.get_mut(key) {
                s.marker = None;
            }
        }
        Ok(Capture {
            control,
            stream,
            published,
            batch: Vec::new(),
            batch_end: 0,
            policies: authorize::Policies::default(),
            messages,
            resolved: HashMap::new(),
            maintained: Instant::now(),
        })
    }

    /// Streams until no subscriber is left (`Ok`) or something fails.
    /// Ends a capture that followed to its end (a failed one is dropped: its connections
    /// are already broken).
    pub(super) async fn close(self) {
        self.stream.close().await;
        self.control.close().await;
    }

    pub(super) async fn follow(&mut self, t: &mut Task) -> Result<(), CaptureError> {
        let mut tick = crate::timer::interval(Duration::from_secs(1));
        let wake = t.taps.wake();
        self.cover(t).await?;
        self.recheck(t).await?;
        loop {
            if !t.active() || t.adopt.is_some() {
                return Ok(());
            }
            tokio::select! {
                biased;
                c = t.rx.recv() => {
                    let Some(c) = c else { return Ok(()) };
                    t.apply(c);
                    while let Ok(c) = t.rx.try_recv() {
                        t.apply(c);
                    }
                    self.cover(t).await?;
                    self.recheck(t).await?;
                }
                f = self.stream.read_frame() => {
                    let mut f = f?;
                    loop {
                        if let Some(e) = self.stream.on_frame(&mut self.control, &f).await? {
                            self.on_event(t, e).await?;
                        }
                        if self.batch.len() >= MAX_BATCH {
                            self.flush(t).await?;
                        }
                        match self.stream.read_frame().now_or_never() {
                            Some(next) => f = next?,
                            None => break,
                        }
                    }
                    self.flush(t).await?;
                }
                () = wake.notified() => self.cover(t).await?,
                () = tick.tick() => {
                    t.sweep_ended();
                    // A tap's table the catalogue did not know yet is tried again.
                    self.cover(t).await?;
                    if t.delivered > 0 {
                        self.stream.confirm(t.delivered).await?;
                        t.taps.confirmed(t.delivered);
                    }
                    if self.maintained.elapsed() >= MAINTAIN_EVERY {
                        self.maintained = Instant::now();
                        if self.messages {
                            migrate::maintain(&mut self.control).await?;
                        }
                    }
                }
            }
        }
    }

    async fn on_event(&mut self, t: &mut Task, e: Event) -> Result<(), CaptureError> {
        match e {
            Event::Commit {
                end_lsn,
                rows,
                truncated,
            } => {
                t.taps.committed(&rows, &truncated);
                if end_lsn <= t.delivered {
                    // Delivered before the connection was lost.
                    return Ok(());
                }
                count(&t.stats.changes, rows.len());
                self.batch.extend(rows);
                self.batch_end = end_lsn;
            }
            Event::Marker(seq) => {
                // Changes before the marker go to those already subscribed; the joins it
                // covers are answered, and get what commits after it.
                self.flush(t).await?;
                t.taps.marker(seq);
                for key in t.waiting_now() {
                    let Some(s) = t.subs.get_mut(&key) else {
                        continue;
                    };
                    if s.marker.is_none_or(|m| m > seq) {
                        continue;
                    }
                    let Some(r) = s.ready.take() else {
                        continue;
                    };
                    t.waiting.remove(&key);
                    // Read now, not before the marker: a message committed in between is
                    // replayed (and may come again live), never missed.
                    let replayed = match s.replay {
                        Some(replay) if self.messages => {
                            let identity =
                                s.identity.lock().unwrap_or_else(|e| e.into_inner()).clone();
                            authorize::replay(&mut self.control, &identity, &s.topic, replay)
                                .await
                                .unwrap_or_else(|e| {
                                    tracing::warn!(tenant = %t.tenant, topic = %s.topic, error = %e, "could not read a channel's replay");
                                    Vec::new()
                                })
                        }
                        _ => Vec::new(),
                    };
                    r.subscribed_with(&replayed);
                }
            }
            Event::Keepalive { wal_end, reply } => {
                if self.batch.is_empty() && !self.stream.in_transaction() {
                    // Everything before `wal_end` has been read and delivered.
                    t.delivered = t.delivered.max(wal_end);
                }
                if reply && t.delivered > 0 {
                    self.stream.confirm(t.delivered).await?;
                }
            }
        }
        Ok(())
    }

    /// Authorises and delivers the batch.
    async fn flush(&mut self, t: &mut Task) -> Result<(), CaptureError> {
        if self.batch.is_empty() {
            t.delivered = t.delivered.max(self.batch_end);
            return Ok(());
        }
        let rows = std::mem::take(&mut self.batch);
        let mut identities: Vec<Identity> = Vec::new();
        let listeners: Vec<Listener<'_>> = t
            .subs
            .values()
            // Channels without bindings take no changes (their broadcasts from the database
            // go through the hub): thousands of them cost a batch nothing.
            .filter(|s| s.ready.is_none() && !s.target.ended() && !s.bindings.is_empty())
            .map(|s| {
                let identity = s.identity.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let at = match identities.iter().position(|i| *i == identity) {
                    Some(at) => at,
                    None => {
                        identities.push(identity);
                        identities.len() - 1
                    }
                };
                Listener {
                    topic: &s.topic,
                    bindings: &s.bindings,
                    identity: at,
                    target: &s.target,
                }
            })
            .collect();
        if let Some(service) = t.service.upgrade().filter(|_| t.has_tenant) {
            let queued = messages::deliver(&service.hub(&t.tenant), &rows);
            count(&t.stats.delivered, queued);
        }
        let plan = deliver::plan(&rows, &listeners);
        let questions: Vec<authorize::Question<'_>> = plan
            .needs
            .iter()
            .map(|need| authorize::Question {
                rel: &need.rel,
                identity: &identities[need.identity],
                check: need.rows.iter().map(|&i| (i, &rows[i])).collect(),
            })
            .collect();
        let answers = self.policies.answer(&mut self.control, &questions).await?;
        let access: HashMap<(u32, usize), authorize::Access> = plan
            .needs
            .iter()
            .zip(answers)
            .filter_map(|(need, a)| Some(((need.rel.oid, need.identity), a?)))
            .collect();
        count(
            &t.stats.authorizations,
            std::mem::take(&mut self.policies.queries) as usize,
        );
        let queued = deliver::deliver(&plan, &rows, &listeners, &access);
        count(&t.stats.delivered, queued);
        t.delivered = t.delivered.max(self.batch_end);
        Ok(())
    }

    /// Adds the tables of the joins waiting for cover to the publication and writes a
    /// marker for them; refuses a join whose tables do not exist or cannot be published.
    async fn cover(&mut self, t: &mut Task) -> Result<(), CaptureError> {
        let mut covering = 0;
        for key in t.waiting_now() {
            let Some(s) = t.subs.get(&key) else {
                continue;
            };
            if s.marker.is_some() || s.ready.as_ref().is_some_and(Ready::abandoned) {
                continue;
            }
            if s.private {
                let identity = s.identity.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let channel = s.topic.strip_prefix("realtime:").unwrap_or(&s.topic);
                let (read, write) = if self.messages {
                    authorize::private_access(&mut self.control, &identity, channel).await?
                } else {
                    (false, false)
                };
                count(&t.stats.authorizations, 1);
                if !read {
                    let why = format!(
                        "Unauthorized: You do not have permissions to read from this Channel topic: {channel}"
                    );
                    t.refuse(&key, &why);
                    continue;
                }
                s.writes.store(write, std::sync::atomic::Ordering::Release);
            }
            match self.publish(&t.name, &s.bindings).await? {
                Ok(()) => covering += 1,
                Err(reason) => t.refuse(&key, &reason),
            }
        }
        let tapped = t.taps.cover(&mut self.control, &t.name).await?;
        if covering == 0 && tapped.is_empty() {
            return Ok(());
        }
        let seq = t.next_marker;
        t.next_marker += 1;
        // In a transaction that commits synchronously: logical decoding reads only flushed
        // WAL, and an unflushed marker would wait for the WAL writer.
        let sql = format!(
            "BEGIN; SET LOCAL synchronous_commit = on; \
             SELECT pg_logical_emit_message(true, '{MARKER}', '{seq}'); COMMIT"
        );
        crate::timer::timeout(TIMEOUT, self.control.simple_query(&sql))
            .await
            .map_err(|_| CaptureError::Timeout("writing a marker"))??;
        for key in &t.waiting {
            if let Some(s) = t.subs.get_mut(key) {
                if s.ready.is_some() && s.marker.is_none() {
                    s.marker = Some(seq);
                }
            }
        }
        t.taps.marked(seq, tapped);
        Ok(())
    }

    /// Checks again the private channels whose token changed; one that may no longer
    /// read is shut down.
    async fn recheck(&mut self, t: &mut Task) -> Result<(), CaptureError> {
        while let Some((socket, topic)) = t.rechecks.pop() {
            let key = (socket, topic);
            let Some(s) = t.subs.get(&key).filter(|s| s.private && s.ready.is_none()) else {
                continue;
            };
            let topic = &key.1;
            let identity = s.identity.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let channel = topic.strip_prefix("realtime:").unwrap_or(topic).to_owned();
            let (read, write) = if self.messages {
                authorize::private_access(&mut self.control, &identity, &channel).await?
            } else {
                (false, false)
            };
            count(&t.stats.authorizations, 1);
            s.writes.store(write, std::sync::atomic::Ordering::Release);
            if !read {
                s.target.shut_down(&format!(
                    "Unauthorized: You do not have permissions to read from this Channel topic: {channel}"
                ));
                t.subs.remove(&key);
            }
        }
        Ok(())
    }

    /// Puts the tables `bindings` name in the publication; the inner error refuses the
    /// join with a reason.
    async fn publish(
        &mut self,
        publication: &str,
        bindings: &[Binding],
    ) -> Result<Result<(), String>, CaptureError> {
        for b in bindings {
            let key = (b.schema.clone(), b.table.clone().unwrap_or_default());
            if let Some(tables) = self.resolved.get(&key) {
                if !tables.is_empty() && tables.iter().all(|(oid, _)| self.published.contains(oid))
                {
                    continue;
                }
            }
            let tables = query_text(
                &mut self.control,
                "SELECT coalesce(json_agg(json_build_array(c.oid::int8, \
                   quote_ident(n.nspname) || '.' || quote_ident(c.relname))), '[]')::text \
                 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition \
                   AND (n.nspname = $1 OR ($1 = '*' AND n.nspname NOT IN \
                     ('pg_catalog', 'information_schema', 'realtime') \
                     AND n.nspname NOT LIKE 'pg\\_%')) \
                   AND ($2 = '' OR c.relname = $2)",
                &[&b.schema, b.table.as_deref().unwrap_or("")],
            )
            .await?;
            let tables: Vec<(u32, String)> =
                serde_json::from_str(&tables).map_err(|e| CaptureError::Protocol(e.to_string()))?;
            self.resolved.insert(key, tables.clone());
            if tables.is_empty() && b.table.is_some() {
                return Ok(Err(format!(
                    "Unable to subscribe to changes with given parameters. Please check Realtime is enabled for the given connect parameters: [event: {}, schema: {}, table: {}, filters: [{}]]",
                    b.event.map_or("*", |k| k.as_str()),
                    b.schema,
                    b.table.as_deref().unwrap_or("*"),
                    b.filter_text.as_deref().unwrap_or("")
                )));
            }
            for (oid, qualified) in tables {
                if self.published.contains(&oid) {
                    continue;
                }
                let sql = format!("ALTER PUBLICATION {publication} ADD TABLE {qualified}");
                match crate::timer::timeout(TIMEOUT, self.control.simple_query(&sql)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(ServerError::Db(e))) if e.code == "42710" => {}
                    Ok(Err(ServerError::Db(e))) if !e.is_fatal() => {
                        return Ok(Err(format!(
                            "Unable to subscribe to changes of {qualified}: {}",
                            e.message
                        )));
                    }
                    Ok(Err(e)) => return Err(e.into()),
                    Err(_) => return Err(CaptureError::Timeout("ALTER PUBLICATION")),
                }
                self.published.insert(oid);
            }
        }
        Ok(Ok(()))
    }
}

/// Brings the tenant's `realtime` schema up to date and puts `realtime.messages` in the
/// publication; whether broadcasts from the database are streamed. A database that will
/// not have them (privileges) still streams Postgres Changes.
async fn publish_messages(
    c: &mut ServerConn,
    publication: &str,
    tenant: &str,
    published: &mut HashSet<u32>,
) -> Result<bool, CaptureError> {
    let refused =
        |e: &CaptureError| matches!(e, CaptureError::Server(ServerError::Db(f)) if !f.is_fatal());
    match migrate::run(c).await {
        Ok(()) => {}
        Err(e) if refused(&e) => {
            tracing::warn!(%tenant, error = %e, "cannot set up realtime.messages: no broadcasts from the database");
            return Ok(false);
        }
        Err(e) => return Err(e),
    }
    let oid = query_text(c, "SELECT 'realtime.messages'::regclass::oid::text", &[]).await?;
    let oid: u32 = oid
        .parse()
        .map_err(|_| CaptureError::Protocol("realtime.messages has no oid".into()))?;
    if !published.contains(&oid) {
        let sql = format!(
            "ALTER PUBLICATION {publication} ADD TABLE {}.{}",
            quote_ident("realtime"),
            quote_ident("messages")
        );
        match crate::timer::timeout(TIMEOUT, c.simple_query(&sql)).await {
            Ok(Ok(())) => {}
            Ok(Err(ServerError::Db(e))) if e.code == "42710" => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(CaptureError::Timeout("ALTER PUBLICATION")),
        }
        published.insert(oid);
    }
    Ok(true)
}

/// A connection for the catalogue and authorization, with the capture's settings.
pub(in crate::realtime::changes) async fn control_connection(
    up: &Upstream,
) -> Result<ServerConn, CaptureError> {
    Ok(ServerConn::connect_with(up, TIMEOUT, &SETTINGS).await?)
}

/// Runs `sql` and returns its first column of its first row as text.
async fn query_text(
    c: &mut ServerConn,
    sql: &str,
    params: &[&str],
) -> Result<String, CaptureError> {
    let row = crate::timer::timeout(TIMEOUT, c.query_row(sql, params))
        .await
        .map_err(|_| CaptureError::Timeout("a catalogue query"))??;
    Ok(row
        .and_then(|r| r.into_iter().next().flatten())
        .unwrap_or_default())
}

/// Drops the publication and slot `name`, waiting (a little) for a walsender that still
/// holds the slot to let it go.
pub(super) async fn drop_slot_on(c: &mut ServerConn, name: &str) -> Result<(), CaptureError> {
    let sql = format!("DROP PUBLICATION IF EXISTS {name}");
    crate::timer::timeout(TIMEOUT, c.simple_query(&sql))
        .await
        .map_err(|_| CaptureError::Timeout("DROP PUBLICATION"))??;
    let drop = "SELECT count(pg_drop_replication_slot(slot_name))::text \
                FROM pg_replication_slots WHERE slot_name = $1";
    let mut tries = 0;
    loop {
        match query_text(c, drop, &[name]).await {
            Ok(_) => return Ok(()),
            // The slot is still active: its walsender has not noticed the end yet.
            Err(CaptureError::Server(ServerError::Db(e))) if e.code == "55006" && tries < 50 => {
                tries += 1;
                crate::timer::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
