//! A tenant's capture task: its subscriptions, the slot's life, covering the tables the
//! bindings name, and batches of changes authorised and delivered.
//!
//! **Covering.** A new subscription's tables are added to the publication, then a marker
//! is written to the WAL (`pg_logical_emit_message`); when the marker comes back through
//! the stream, every transaction committing from then on is streamed with the tables'
//! changes, and the join is answered. So `SUBSCRIBED` is never said early.
//!
//! **Exactly once while joined.** The slot is permanent while the tenant has subscribers
//! here: a lost connection (or a PostgreSQL restart) resumes from the end of the last
//! transaction delivered, which is what the server is told was flushed; a transaction
//! ending at or before it is not delivered again. A batch that fails half way (its
//! authorization query's connection lost) is not confirmed, so it is streamed again.
//!
//! **Batches.** Transactions that arrive together (everything the connection has
//! buffered) are authorised together: one query per table and identity per batch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use shoal_realtime::changes::Binding;
use shoal_realtime::feed::{Ready, Replay, SharedIdentity, Subscription, Target};
use shoal_realtime::hub::SocketId;

use super::stream::CaptureError;
use super::taps::Taps;
use super::{Command, FeedStats};
use crate::app::App;
use crate::server::Upstream;
use crate::wal::DbKey;

/// How long a join may wait for a capture that keeps failing before it is refused.
const JOIN_PATIENCE: Duration = Duration::from_secs(5);

/// Which channel: its socket and topic.
type SubKey = (SocketId, String);

/// A channel subscribed here (its socket is in its key).
struct Sub {
    topic: String,
    private: bool,
    writes: Arc<std::sync::atomic::AtomicBool>,
    bindings: Vec<Binding>,
    identity: SharedIdentity,
    target: Target,
    /// The join's answer, until capture covers the bindings.
    ready: Option<Ready>,
    since: Instant,
    /// The marker whose return covers the bindings.
    marker: Option<u64>,
    /// Earlier broadcasts to send it when it is answered.
    replay: Option<Replay>,
}

impl Sub {
    /// A public channel without bindings: it only may get broadcasts from the database,
    /// and is joined without them when the database cannot be streamed from.
    fn optional(&self) -> bool {
        self.bindings.is_empty() && !self.private
    }
}

/// Whom a task serves.
pub(crate) struct Serves {
    /// The Realtime tenant (none: only the database's taps).
    pub tenant: Option<String>,
    pub db: DbKey,
    /// Whether it serves the database's taps (see [`super::taps`]).
    pub taps: bool,
}

pub(crate) struct Task {
    /// The tenant's id, or (serving taps alone) the database, for logs.
    tenant: String,
    /// Whether it serves a Realtime tenant (else only its database's taps).
    has_tenant: bool,
    taps: Taps,
    /// A tenant that takes the task over (with its slot name), once the stream is stopped.
    adopt: Option<(String, String)>,
    app: Weak<App>,
    service: Weak<shoal_realtime::edge::Service>,
    /// The slot's and the publication's name.
    name: String,
    rx: tokio::sync::mpsc::UnboundedReceiver<Command>,
    stats: Arc<FeedStats>,
    /// Every channel subscribed here, by socket and topic: a join, a leave or a re-join is
    /// a look-up, not a scan over every channel of the tenant (64,000 at the seed's scale).
    subs: BTreeMap<SubKey, Sub>,
    /// The joins not answered yet (and perhaps some answered since, dropped as they are
    /// next looked at): what covering and markers go through, so neither scans every
    /// channel for each join.
    waiting: BTreeSet<SubKey>,
    /// The end of the last transaction delivered in the slot's life (see the module doc).
    delivered: u64,
    slot_made: bool,
    next_marker: u64,
    /// Private channels whose token changed, to check again.
    rechecks: Vec<(SocketId, String)>,
    /// The database last streamed from (where the slot is, if the tenant goes).
    streamed_from: Option<Upstream>,
    /// Why the database gives no broadcasts, while only channels that merely may get
    /// them are joined: new ones are joined at once without them (not one attempt per
    /// join) until the next try.
    no_broadcasts: Option<String>,
}

impl Task {
    pub(crate) fn new(
        serves: Serves,
        app: Weak<App>,
        service: Weak<shoal_realtime::edge::Service>,
        name: String,
        rx: tokio::sync::mpsc::UnboundedReceiver<Command>,
        stats: Arc<FeedStats>,
    ) -> Task {
        let Serves { tenant, db, taps } = serves;
        Task {
            has_tenant: tenant.is_some(),
            tenant: tenant.unwrap_or_else(|| format!("{}:{}/{}", db.0, db.1, db.2)),
            taps: Taps::new(db, taps, app.clone()),
            adopt: None,
            app,
            service,
            name,
            rx,
            stats,
            subs: BTreeMap::new(),
            waiting: BTreeSet::new(),
            delivered: 0,
            slot_made: false,
            next_marker: 1,
            rechecks: Vec::new(),
            streamed_from: None,
            no_broadcasts: None,
        }
    }

    fn apply(&mut self, c: Command) {
        match c {
            Command::Subscribe(s) => {
                let Subscription {
                    socket,
                    topic,
                    private,
                    writes,
                    bindings,
                    identity,
                    target,
                    ready,
                    replay,
                } = *s;
                let key = (socket, topic.clone());
                let mut sub = Sub {
                    topic,
                    private,
                    writes,
                    bindings,
                    identity,
                    target,
                    ready: Some(ready),
                    since: Instant::now(),
                    marker: None,
                    replay,
                };
                if let Some(why) = self.no_broadcasts.as_ref().filter(|_| sub.optional()) {
                    if let Some(r) = sub.ready.take() {
                        r.failed(why);
                    }
                }
                if sub.ready.is_some() {
                    self.waiting.insert(key.clone());
                }
                // In place of the socket's earlier join of the topic, if any.
                self.subs.insert(key, sub);
            }
            Command::Unsubscribe(socket, topic) => {
                self.subs.remove(&(socket, topic));
            }
            Command::Recheck(socket, topic) => self.rechecks.push((socket, topic)),
            Command::Taps => {}
            Command::Adopt(tenant, name) => self.adopt = Some((tenant, name)),
        }
        self.stats
            .subscriptions
            .store(self.subs.len() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// The joins still waiting; those answered since leave the set.
    fn waiting_now(&mut self) -> Vec<SubKey> {
        let subs = &self.subs;
        self.waiting
            .retain(|k| subs.get(k).is_some_and(|s| s.ready.is_some()));
        self.waiting.iter().cloned().collect()
    }

    /// Answers a waiting join with a refusal.
    fn refuse(&mut self, key: &SubKey, why: &str) {
        self.waiting.remove(key);
        if let Some(r) = self.subs.get_mut(key).and_then(|s| s.ready.take()) {
            r.failed(why);
        }
    }

    /// Forgets the channels of sockets that ended without a leave (a refused join's, a
    /// dropped connection's). Once a second, not per join: it looks at every channel.
    fn sweep_ended(&mut self) {
        self.subs
            .retain(|_, s| s.ready.is_some() || !s.target.ended());
    }

    /// Refuses the joins that cannot be served: all waiting ones when `e` lasts, else
    /// those that have waited too long.
    fn refuse_waiting(&mut self, e: &CaptureError) {
        let lasting = e.is_lasting();
        self.subs.retain(|_, s| {
            if s.ready.is_none() || !(lasting || s.since.elapsed() >= JOIN_PATIENCE) {
                return true;
            }
            if s.optional() {
                // Joined all the same, without broadcasts from the database (for now).
                if let Some(r) = s.ready.take() {
                    r.failed(&no_broadcasts(e));
                }
                return true;
            }
            let reason = if s.bindings.is_empty() {
                // Only a private channel's policies were to be asked.
                let channel = s.topic.strip_prefix("realtime:").unwrap_or(&s.topic);
                format!("Unauthorized: You do not have permissions to read from this Channel topic: {channel} (the database cannot be asked: {e})")
            } else {
                format!("Unable to subscribe to changes: {e}")
            };
            if let Some(r) = s.ready.take() {
                r.failed(&reason);
            }
            false
        });
    }

    fn upstream(&self) -> Result<Upstream, CaptureError> {
        if !self.has_tenant {
            return self.taps.upstream().ok_or_else(|| {
                CaptureError::Refused("no pool caches the database any more".into())
            });
        }
        let app = self
            .app
            .upgrade()
            .ok_or_else(|| CaptureError::Refused("Shoal is stopping".into()))?;
        let route = app
            .routes
            .tenants
            .get(&self.tenant)
            .ok_or_else(|| CaptureError::Refused("the tenant no longer exists".into()))?;
        route.manager_upstream().map_err(CaptureError::Refused)
    }

    /// Drops the slot and the publication (no subscriber left); false if that failed.
    async fn drop_slot(&mut self) -> bool {
        let result = async {
            // The database the slot is in, even when the tenant was deleted since.
            let up = match (self.upstream(), &self.streamed_from) {
                (Ok(up), _) => up,
                (Err(_), Some(up)) => up.clone(),
                (Err(e), None) => return Err(e),
            };
            let mut c = control_connection(&up).await?;
            drop_slot_on(&mut c, &self.name).await
        }
        .await;
        match result {
            Ok(()) => {
                self.slot_made = false;
                self.delivered = 0;
                tracing::info!(tenant = %self.tenant, slot = %self.name, "Postgres Changes capture stopped: no subscriber left");
                true
            }
            Err(e) => {
                tracing::warn!(tenant = %self.tenant, error = %e, "could not drop the Postgres Changes slot; retrying");
                false
            }
        }
    }

    /// Whether anything here needs the database's stream.
    fn active(&self) -> bool {
        !self.subs.is_empty() || !self.taps.live().is_empty()
    }

    /// A tenant takes over a task that served its database's taps alone: the taps' slot
    /// goes (the tenant's user may not own its publication), and the tenant's is made.
    async fn adopted(&mut self) {
        let Some((tenant, name)) = self.adopt.take() else {
            return;
        };
        if self.slot_made && !self.drop_slot().await {
            tracing::warn!(slot = %self.name, "the slot of a database's cache was left behind");
        }
        tracing::info!(%tenant, database = %self.tenant, "a Realtime tenant's capture takes over its database's change stream");
        self.tenant = tenant;
        self.name = name;
        self.has_tenant = true;
        self.slot_made = false;
        self.delivered = 0;
    }

    /// Hears commands until `d` has passed, or (with `early`) a join needs an answer;
    /// false when the feed is gone.
    async fn wait(&mut self, d: Duration, early: bool) -> bool {
        let until = crate::timer::sleep(d);
        tokio::pin!(until);
        loop {
            tokio::select! {
                () = &mut until => return true,
                c = self.rx.recv() => match c {
                    Some(c) => {
                        // Joins answered at once (see `no_broadcasts`) need no early try.
                        let join = matches!(&c, Command::Subscribe(s)
                            if !(self.no_broadcasts.is_some() && s.bindings.is_empty() && !s.private));
                        self.apply(c);
                        if early && join {
                            return true;
                        }
                    }
                    None => return false,
                },
            }
        }
    }
}

/// The task: captures while the tenant has subscribers here.
pub(crate) async fn run(mut t: Task) {
    let mut backoff = Duration::from_millis(100);
    loop {
        while !t.active() {
            if t.slot_made && !t.drop_slot().await {
                if !t.wait(Duration::from_secs(5), false).await {
                    return;
                }
                continue;
            }
            match t.rx.recv().await {
                Some(c) => t.apply(c),
                None => return,
            }
        }
        // A tenant that adopted the task while it waited streams from its own slot.
        t.adopted().await;
        let error = match Capture::open(&mut t).await {
            Ok(mut c) => {
                backoff = Duration::from_millis(100);
                t.no_broadcasts = None;
                t.taps.started(&t.name);
                let followed = c.follow(&mut t).await;
                if followed.is_ok() {
                    c.close().await;
                }
                t.taps
                    .lost(followed.as_ref().err().map(|e| e.to_string()).as_deref());
                match followed {
                    Ok(()) => continue,
                    Err(e) => e,
                }
            }
            Err(e) => {
                t.taps.lost(Some(&e.to_string()));
                e
            }
        };
        t.refuse_waiting(&error);
        // Only broadcasts from the database are wanted, and the database cannot give them
        // (or never could be reached): tried again in a minute, quietly. A stream that was
        // running is resumed at once.
        let only_broadcasts = t.has_tenant
            && t.taps.live().is_empty()
            && t.subs.values().all(Sub::optional)
            && (error.is_lasting() || !t.slot_made);
        t.no_broadcasts = only_broadcasts.then(|| no_broadcasts(&error));
        if let Some(why) = &t.no_broadcasts {
            // Joins still waiting (the error may pass, so they were not refused) are
            // answered now, not after the next try a minute from now.
            for s in t.subs.values_mut().filter(|s| s.optional()) {
                if let Some(r) = s.ready.take() {
                    r.failed(why);
                }
            }
        }
        let wait = if only_broadcasts {
            tracing::info!(tenant = %t.tenant, error = %error, "no broadcasts from the database for this tenant; trying again in a minute");
            Duration::from_secs(60)
        } else {
            tracing::warn!(tenant = %t.tenant, error = %error, "the database's change stream failed; retrying");
            // A database only the cache streams from is tried less often: its results are
            // simply not kept meanwhile.
            let most = if t.has_tenant { 5 } else { 30 };
            backoff = (backoff * 2).min(Duration::from_secs(most));
            backoff
        };
        // A join waiting for an answer gets one (the error, as it lasts) without delay.
        if !t.wait(wait, only_broadcasts).await {
            return;
        }
    }
}

mod capture;

pub(super) use capture::control_connection;
use capture::{drop_slot_on, no_broadcasts, Capture};

#[cfg(test)]
mod tests;
