//! Shoal, a PostgreSQL connection pooler. Module map:
//!
//! - [`config`], [`control`], [`logsafe`], [`upstream_tls`], and `tenant`'s model, crypto
//!   and store: the control plane, from the `shoal-control` crate (shared with the realtime
//!   service).
//! - [`error`]: what a failure to get or keep a server means for the client: kind, SQLSTATE,
//!   client-safe message, log detail, whether a retry is safe.
//! - [`listener`]: TCP and Unix listening sockets and the accept loops.
//! - [`net`]: the transport seam for both sides (TCP, Unix, TLS either way, in-process
//!   streams).
//! - [`seam`]: what the session asks of the features, as one trait the features implement
//!   (named at the crate root as [`Plugged`], resolved at compile time).
//! - [`session`]: one client from handshake to close: authentication, login, and the
//!   transaction-mode and session-mode loops around the relay.
//! - [`tls`]: client-facing TLS: certificates by SNI, the handshake after SSLRequest or direct.
//! - [`params`]: client session parameters and how they are applied to servers.
//! - [`prepared`]: prepared statements in transaction mode, as pure code: each client's
//!   statements, pooler-wide names, what each server holds, the replies it owes.
//! - [`sets`]: session `SET`s a transaction-mode client holds, replayed on its next server.
//! - [`notify`]: LISTEN/NOTIFY in transaction mode: a listener connection per pool, filling
//!   each listening client's [`mailbox`] (the data plane's, which the session writes from).
//! - [`tenant`]: tenants ready for routing, and the service applying store changes to it.
//! - [`cluster`]: this process as a node of a cluster (`[cluster]`): who owns a pool,
//!   node links, relaying a client to its pool's owner.
//! - [`route`]: from a client's startup packet (later its TLS server name) to its user and
//!   pool, over a registry of pools that can change at run time.
//! - [`pool`]: server connection pools per (database, user): FIFO checkout, growth, reaping.
//! - [`features`]: what each pool carries for the features (analyses, catalogue, rules,
//!   cache, limits, replicas, LISTEN hub), kept as the pool's opaque add-on.
//! - [`disposition`]: what becomes of a server when its client lets go (reuse, clean,
//!   close and why), as one pure, unit-tested function.
//! - [`server`]: one upstream connection: connect (or dial), authenticate, pooler-issued
//!   queries, cancel requests.
//! - [`server_session`]: what a pooled server's session holds for its clients (parameters,
//!   SETs, dirt and its owner, statements, replies owed), with one owner.
//! - [`cancel`]: cancel keys and the safe forwarding of CancelRequests.
//! - [`auth_query`]: users looked up in PostgreSQL (auth_query), for SCRAM/MD5 passthrough.
//! - [`app`]: state shared by all sessions, as handles (routes, admission, lifecycle, ...).
//! - [`clock`], [`bufpool`]: a coarse clock and recycled buffers for the per-transaction path.
//! - [`metrics`], [`scrape`]: counters kept where the work happens, and their Prometheus
//!   exposition read at scrape time.
//! - [`run`]: wiring it all together, with graceful shutdown.
//! - [`upgrade`], [`handoff`], [`fdpass`]: zero-downtime upgrades: listening sockets, then
//!   idle clients with their session state, handed to the new process.
//! - [`reuseport`]: steering new connections to the open shards' listening sockets.
//! - [`memory`]: the allocator (jemalloc) and giving freed heap back after connect storms.
//! - [`login_failures`]: failed logins per (address, user): growing delays, then a ban.
//! - [`analysis`]: each statement text of a pool analysed once, as the server reads it in
//!   the client's encoding: what query rules, the result cache and the replica split
//!   decide on.

/// The features the data plane runs with, named once here so the session calls them through
/// [`seam::Features`], resolved at compile time, without naming a feature module.
pub type Plugged = features::relay::Plugged;

// The control plane's modules, under the names the pooler has always used for them.
pub use shoal_control::runtime as control;
pub use shoal_control::{config, logsafe, upstream_tls};

pub mod admin;
pub mod admission;
pub mod analysis;
pub mod api;
pub mod app;
pub mod auth_query;
pub mod bufpool;
pub mod cache;
pub mod cancel;
pub mod clock;
pub mod cluster;
pub mod disposition;
pub mod error;
pub mod fdpass;
pub mod features;
pub mod handoff;
pub mod limits;
pub mod listener;
pub mod login_failures;
pub mod mailbox;
pub mod memory;
pub mod metrics;
pub mod net;
pub mod notify;
pub mod params;
pub mod passwords;
pub mod pool;
pub mod prepared;
pub mod query_rules;
pub mod realtime;
pub mod replicas;
pub mod reuseport;
pub mod route;
pub mod run;
pub mod scrape;
pub mod seam;
pub mod server;
pub mod server_session;
pub mod serverless;
pub mod session;
pub mod sets;
pub mod shard;
pub mod tenant;
pub mod timer;
pub mod tls;
pub mod ui;
pub mod upgrade;
pub mod wal;
