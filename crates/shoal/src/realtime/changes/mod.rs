//! Postgres Changes: each tenant database's changes captured from its WAL (logical
//! replication, `pgoutput`), authorised in batches and delivered to the channels whose
//! bindings they match.
//!
//! One task per tenant with subscribers, on the control runtime, owns two connections as
//! the tenant's manager user: a replication connection streaming from this node's slot,
//! and a control connection for the catalogue, the publication, markers and the
//! authorization queries. The slot and the publication exist while the tenant has
//! channels on this node (any channel may get broadcasts from the database) or its
//! database's other consumers (the cache's invalidation, see [`crate::wal`]) need them, and
//! are dropped when the last one leaves. A database they need without a Realtime tenant
//! gets a task of its own (as the pool's user), which a tenant of that database later
//! adopts: one slot per database, whoever wants its changes.
//!
//! - [`task`]: the subscriptions, covering their tables, and the life of the slot.
//! - [`stream`]: the replication connection, decoded into committed transactions.
//! - [`authorize`]: one query per (table, role and claims) per batch of changes.
//! - [`deliver`]: which subscriber gets which change, with which columns (pure).
//! - [`messages`]: broadcasts from the database (`realtime.messages`), delivered to their
//!   channels.
//! - [`migrate`]: the `realtime` schema Shoal keeps in a tenant's database.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use shoal_realtime::feed::{ChangeFeed, Subscription};
use shoal_realtime::hub::SocketId;

use crate::app::App;
use crate::wal::DbKey;

mod authorize;
mod deliver;
mod messages;
mod migrate;
mod stream;
mod taps;
mod task;

/// What a socket (or the database's taps) asks of a capture task.
pub(crate) enum Command {
    Subscribe(Box<Subscription>),
    Unsubscribe(SocketId, String),
    /// A private channel's token changed.
    Recheck(SocketId, String),
    /// A tap of the task's database was attached: look at the taps again.
    Taps,
    /// The database's task, until now its taps' alone, serves this tenant (with this slot
    /// name) from now on.
    Adopt(String, String),
}

pub use crate::metrics::FeedStats;

/// A capture task, for a Realtime tenant (and maybe its database's taps) or for a
/// database's taps alone.
struct Running {
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
    stats: Arc<FeedStats>,
    /// It serves the taps of its database (see [`crate::wal`]): the database's first task.
    taps: bool,
}

/// A task's key: its database, and its tenant (empty: the database's taps alone).
type TaskKey = (DbKey, String);

/// The change feed: a capture task per tenant with subscribers on this node, which also
/// serves its database's other consumers (the cache), and one per database that only they
/// need. So a database has one slot, whoever wants its changes.
pub struct Feeds {
    app: Weak<App>,
    /// Where broadcasts from the database are delivered.
    service: Weak<shoal_realtime::edge::Service>,
    /// This node's name, in its slot and publication names.
    node: String,
    tasks: Mutex<HashMap<TaskKey, Running>>,
    /// Each tenant's database as last known (a deleted tenant's task is still reached).
    databases: Mutex<HashMap<String, DbKey>>,
    /// The database each tenant's schema was last installed in (see [`Feeds::prepare`]).
    prepared: Mutex<HashMap<String, String>>,
}

impl Feeds {
    /// `node` names this node stably (across restarts, so a slot a crashed process left
    /// is found and dropped by the next).
    pub fn new(
        app: &Arc<App>,
        node: &str,
        service: Weak<shoal_realtime::edge::Service>,
    ) -> Arc<Feeds> {
        Arc::new(Feeds {
            app: Arc::downgrade(app),
            service,
            node: node.to_owned(),
            tasks: Mutex::default(),
            databases: Mutex::default(),
            prepared: Mutex::default(),
        })
    }

    /// Starts the capture tasks the database's taps need (see [`crate::wal`]), with or
    /// without the Realtime service: the runner of `app`'s captures.
    pub fn serve_taps(self: &Arc<Self>, app: &App) {
        let feeds = Arc::downgrade(self);
        app.routes.captures.set_runner(move |db| {
            if let Some(f) = feeds.upgrade() {
                f.ensure_tapped(db);
            }
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TaskKey, Running>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The database tenant `id` is in (as last known: a deleted tenant's task is still
    /// reached; an unknown tenant gets a task of its own that says it is unknown).
    fn database_of(&self, id: &str) -> DbKey {
        let mut known = self.databases.lock().unwrap_or_else(|e| e.into_inner());
        let now = self
            .app
            .upgrade()
            .and_then(|app| app.routes.tenants.get(id))
            .and_then(|route| route.manager_upstream().ok())
            .map(|up| (up.host, up.port, up.dbname));
        match now {
            Some(db) => {
                known.insert(id.to_owned(), db.clone());
                db
            }
            None => known
                .get(id)
                .cloned()
                .unwrap_or_else(|| (String::new(), 0, id.to_owned())),
        }
    }

    fn send(&self, tenant: &str, command: Command) {
        let db = self.database_of(tenant);
        let key = (db.clone(), tenant.to_owned());
        let mut tasks = self.lock();
        let mut command = match tasks.get(&key) {
            Some(t) => match t.commands.send(command) {
                Ok(()) => return,
                // The task ended (the runtime stopping): a new one takes over.
                Err(e) => e.0,
            },
            None => command,
        };
        let name = slot_name(&format!("{}/{tenant}", self.node));
        if let Some(alone) = tasks.remove(&(db.clone(), String::new())) {
            // The database's taps had a task of their own: it serves the tenant too.
            let adopted = alone
                .commands
                .send(Command::Adopt(tenant.to_owned(), name.clone()));
            if adopted.is_ok() {
                match alone.commands.send(command) {
                    Ok(()) => {
                        tasks.insert(key, alone);
                        return;
                    }
                    Err(e) => command = e.0,
                }
            }
        }
        let taps = !tasks.keys().any(|(d, _)| *d == db);
        self.spawn(&mut tasks, key, Some(name), taps, command);
    }

    /// Makes sure the taps of `db` have a task serving them, and that it looks at them.
    fn ensure_tapped(&self, db: &DbKey) {
        let mut tasks = self.lock();
        if let Some(t) = tasks.iter().find(|((d, _), t)| d == db && t.taps) {
            if t.1.commands.send(Command::Taps).is_ok() {
                return;
            }
        }
        tasks.retain(|(d, _), t| !(d == db && t.taps));
        self.spawn(
            &mut tasks,
            (db.clone(), String::new()),
            None,
            true,
            Command::Taps,
        );
    }

    /// Starts a task for `key` (with a tenant's slot `name`, or none: the database's taps
    /// alone) and gives it `first`.
    fn spawn(
        &self,
        tasks: &mut HashMap<TaskKey, Running>,
        key: TaskKey,
        name: Option<String>,
        taps: bool,
        first: Command,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let stats = Arc::new(FeedStats::default());
        let _ = tx.send(first);
        let (db, tenant) = key.clone();
        let name = name.unwrap_or_else(|| {
            tapped_slot_name(&format!("{}/{}:{}/{}", self.node, db.0, db.1, db.2))
        });
        tasks.insert(
            key,
            Running {
                commands: tx,
                stats: stats.clone(),
                taps,
            },
        );
        crate::control::spawn(task::run(task::Task::new(
            task::Serves {
                tenant: (!tenant.is_empty()).then_some(tenant),
                db,
                taps,
            },
            self.app.clone(),
            self.service.clone(),
            name,
            rx,
            stats,
        )));
    }

    /// Installs (or updates) Shoal's `realtime` schema in tenant `id`'s database, so that
    /// `realtime.send` and policies on `realtime.messages` can be written before any client
    /// connects. In the background; a failure is logged (capture tries again).
    pub fn prepare(&self, id: &str) {
        let Some(app) = self.app.upgrade() else {
            return;
        };
        let Some(route) = app.routes.tenants.get(id) else {
            return;
        };
        let Ok(up) = route.manager_upstream() else {
            return;
        };
        // Once per database and login: a tenant stored again unchanged costs nothing.
        let target = format!("{}:{}/{}/{}", up.host, up.port, up.dbname, up.user);
        {
            let mut prepared = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
            if prepared.get(id) == Some(&target) {
                return;
            }
            prepared.insert(id.to_owned(), target);
        }
        let tenant = id.to_owned();
        crate::control::spawn(async move {
            let result = async {
                let mut c = crate::server::ServerConn::connect(&up, stream::TIMEOUT).await?;
                migrate::run(&mut c).await?;
                c.close().await;
                Ok::<(), stream::CaptureError>(())
            }
            .await;
            if let Err(e) = result {
                tracing::warn!(%tenant, error = %e, "could not install Shoal's realtime schema in the tenant's database");
            }
        });
    }
}

impl crate::metrics::FeedCounters for Feeds {
    fn per_tenant(&self) -> Vec<(String, Arc<FeedStats>)> {
        self.lock()
            .iter()
            .filter(|((_, id), _)| !id.is_empty())
            .map(|((_, id), t)| (id.clone(), t.stats.clone()))
            .collect()
    }
}

impl ChangeFeed for Feeds {
    fn subscribe(&self, tenant: &str, sub: Subscription) {
        self.send(tenant, Command::Subscribe(Box::new(sub)));
    }

    fn may_write(
        &self,
        tenant: &str,
        identity: shoal_realtime::feed::Identity,
        topic: String,
        reply: tokio::sync::oneshot::Sender<bool>,
    ) {
        let up = self
            .app
            .upgrade()
            .and_then(|app| app.routes.tenants.get(tenant))
            .and_then(|route| route.manager_upstream().ok());
        let Some(up) = up else {
            return;
        };
        let tenant = tenant.to_owned();
        // Its own short connection: HTTP messages to private channels are rare, and the
        // capture's connection exists only while the tenant has channels here.
        crate::control::spawn(async move {
            let answer = async {
                let mut c = task::control_connection(&up).await?;
                let (_, write) = authorize::private_access(&mut c, &identity, &topic).await?;
                c.close().await;
                Ok::<bool, stream::CaptureError>(write)
            }
            .await;
            match answer {
                Ok(write) => {
                    let _ = reply.send(write);
                }
                Err(e) => {
                    tracing::warn!(%tenant, error = %e, "could not ask the tenant's database whether a message may be sent");
                }
            }
        });
    }

    fn recheck(&self, tenant: &str, socket: SocketId, topic: &str) {
        self.send(tenant, Command::Recheck(socket, topic.to_owned()));
    }

    fn unsubscribe(&self, tenant: &str, socket: SocketId, topic: &str) {
        // A tenant without a task has nothing to end.
        let key = (self.database_of(tenant), tenant.to_owned());
        if let Some(t) = self.lock().get(&key) {
            let _ = t
                .commands
                .send(Command::Unsubscribe(socket, topic.to_owned()));
        }
    }
}

/// A slot (and publication) name for `node_tenant` (a node and a tenant): lowercase
/// letters, digits and underscores, as slot names must be, and the same for the same.
fn slot_name(node_tenant: &str) -> String {
    format!("shoal_realtime_{:016x}", fnv(node_tenant))
}

/// The slot (and publication) name of a database's task that serves only its taps (the
/// cache), for `node_db` (a node and a database).
fn tapped_slot_name(node_db: &str) -> String {
    format!("shoal_changes_{:016x}", fnv(node_db))
}

fn fnv(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Adds to a counter.
fn count(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    #[test]
    fn slot_names_are_stable_and_valid() {
        let a = super::slot_name("host:4000");
        assert_eq!(a, super::slot_name("host:4000"));
        assert_ne!(a, super::slot_name("host:4001"));
        assert!(a.len() <= 63);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
    }
}
