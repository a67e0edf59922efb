//! Postgres Changes: each tenant database's changes captured from its WAL (logical
//! replication, `pgoutput`), authorised in batches and delivered to the channels whose
//! bindings they match.
//!
//! One task per tenant with subscribers, on the control runtime, owns two connections as
//! the tenant's manager user: a replication connection streaming from this node's slot,
//! and a control connection for the catalogue, the publication, markers and the
//! authorization queries. The slot and the publication exist while the tenant has
//! channels on this node (any channel may get broadcasts from the database), and are
//! dropped when the last one leaves.
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

mod authorize;
mod deliver;
mod messages;
mod migrate;
mod stream;
mod task;

/// What a socket asks of its tenant's capture task.
pub(crate) enum Command {
    Subscribe(Box<Subscription>),
    Unsubscribe(SocketId, String),
    /// A private channel's token changed.
    Recheck(SocketId, String),
}

/// Counters of one tenant's capture, for `/metrics`.
#[derive(Debug, Default)]
pub struct FeedStats {
    /// Row changes read from the WAL.
    pub changes: AtomicU64,
    /// `postgres_changes` messages queued to subscribers.
    pub delivered: AtomicU64,
    /// Authorization queries run.
    pub authorizations: AtomicU64,
    /// Subscriptions currently served.
    pub subscriptions: AtomicU64,
}

struct Tenant {
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
    stats: Arc<FeedStats>,
}

/// The service's change feed: a capture task per tenant with subscribers on this node.
pub struct Feeds {
    app: Weak<App>,
    /// Where broadcasts from the database are delivered.
    service: Weak<shoal_realtime::edge::Service>,
    /// This node's name, in its tenants' slot and publication names.
    node: String,
    tenants: Mutex<HashMap<String, Tenant>>,
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
            tenants: Mutex::default(),
            prepared: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tenant>> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, tenant: &str, command: Command) {
        let mut tenants = self.lock();
        let command = match tenants.get(tenant) {
            Some(t) => match t.commands.send(command) {
                Ok(()) => return,
                // The task ended (the runtime stopping): a new one takes over.
                Err(e) => e.0,
            },
            None => command,
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let stats = Arc::new(FeedStats::default());
        let _ = tx.send(command);
        tenants.insert(
            tenant.to_owned(),
            Tenant {
                commands: tx,
                stats: stats.clone(),
            },
        );
        crate::control::spawn(task::run(task::Task::new(
            tenant.to_owned(),
            self.app.clone(),
            self.service.clone(),
            slot_name(&format!("{}/{tenant}", self.node)),
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

    /// Each tenant's counters.
    pub fn stats(&self) -> Vec<(String, Arc<FeedStats>)> {
        self.lock()
            .iter()
            .map(|(id, t)| (id.clone(), t.stats.clone()))
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
        if let Some(t) = self.lock().get(tenant) {
            let _ = t
                .commands
                .send(Command::Unsubscribe(socket, topic.to_owned()));
        }
    }
}

/// A slot (and publication) name for `node_tenant` (a node and a tenant): lowercase
/// letters, digits and underscores, as slot names must be, and the same for the same.
fn slot_name(node_tenant: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node_tenant.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("shoal_realtime_{h:016x}")
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
