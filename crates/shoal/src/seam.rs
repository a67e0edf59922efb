//! What the session asks of the features at the points of a client's life where they
//! decide, as one trait the data plane defines and the features implement
//! ([`crate::features::relay`]). The implementation is chosen once, at the crate root
//! ([`crate::Plugged`]), so every call is resolved at compile time: nothing is called
//! through a pointer or boxed, and the session names no feature module.
//!
//! Behind it: the pools' rate and concurrency limits, query rules, result cache, read
//! replicas and LISTEN (whose deliveries wait in a [`crate::mailbox::Mailbox`], the data
//! plane's).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use shoal_wire::sql::ClientEncoding;

use tokio::sync::oneshot;

use crate::config::replicas::{ReadRouting, ReplicaFallback};
use crate::mailbox::Mailbox;
use crate::pool::Pool;
use crate::prepared::ClientStatements;

/// The query rules of the features the data plane runs with.
pub type Rules = <crate::Plugged as Features>::Rules;
/// A transaction's writes as a result cache follows them.
pub type Writes = <crate::Plugged as Features>::Writes;
/// A reply being kept for a result cache.
pub type Capture = <crate::Plugged as Features>::Capture;

/// The unit at the head of a client's buffer, as a result cache is asked about it.
pub struct CacheUnit<'a> {
    /// The client's buffer, the unit at its head (whole messages, already validated).
    pub buf: &'a [u8],
    pub statements: Option<&'a ClientStatements>,
    /// What every key of this client starts with: what its session holds that changes what
    /// a statement returns (startup parameters, settings).
    pub prefix: Vec<u8>,
}

/// A client's LISTEN, as the features the data plane runs with keep it.
pub type Listening = <crate::Plugged as Features>::Listening;

/// The read replicas of the features the data plane runs with.
pub type Replicas = <crate::Plugged as Features>::Replicas;

/// What a client's unit of work (a Query, or extended messages up to their Sync) comes to,
/// for a pool's read replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadUnit {
    /// Every statement only reads: `messages` messages may go to a replica.
    Reads { messages: u32 },
    /// Something in it may write (or cannot be proven not to).
    Writes,
    /// The unit is not all buffered yet: a decision now could split it.
    Incomplete,
}

/// Where a read can run.
pub enum ReadTarget {
    Primary,
    Replica(Arc<Pool>),
    /// Reads must not go to the primary (`replica_fallback = "error"`) and no replica is
    /// usable.
    NoReplica,
}

/// Where writes go now.
pub enum WriteTarget {
    /// The configured primary.
    Configured,
    /// The replica promoted in its place (its pool, while it has one).
    Promoted(Option<Arc<Pool>>),
    /// The configured primary is a standby and no replica was promoted.
    Nowhere,
}

/// What a result cache makes of a unit.
pub enum FromCache<C> {
    /// Its reply, to write in place of running the `len` bytes of the unit; the body of
    /// its unnamed Parse (a range of the buffer), which stays the client's unnamed statement.
    Hit {
        reply: bytes::Bytes,
        len: usize,
        unnamed_parse: Option<std::ops::Range<usize>>,
    },
    /// Run it, feeding its reply to this capture as it goes to the client.
    Fill(C),
    /// Run it; nothing is kept.
    Pass,
}

/// A unit of work refused before it reached a server, with what to tell the client
/// (`53400`).
#[derive(Debug)]
pub struct Refusal(pub String);

pub trait Features {
    /// What a pool's limits are for one unit of work (looked up once per unit).
    type Limits: Send + Sync;
    /// What a transaction holds while it runs (a place under a concurrency limit).
    type Running: Send;

    /// The pool's limits, `None` when it has none (then nothing is admitted: no future is
    /// made for a unit that cannot wait).
    fn limits(pool: &Pool) -> Option<Self::Limits>;

    /// A unit of work that needs a server is about to run, or be answered from a cache: it
    /// may have to wait for its turn, or be refused (a rate limit).
    fn admit_unit(limits: &Self::Limits) -> impl Future<Output = Result<(), Refusal>> + Send;

    /// A transaction is about to take a server: what it holds while it runs, after waiting
    /// its turn, or a refusal (a concurrency limit).
    fn admit_transaction(
        limits: &Self::Limits,
    ) -> impl Future<Output = Result<Self::Running, Refusal>> + Send;

    /// A transaction ended, having answered `queries` queries (rates count them all).
    fn transaction_ran(pool: &Pool, queries: u64);

    /// A pool's query rules, as a transaction holds them (a reload's apply from the next).
    type Rules: Send + Sync;

    fn rules(pool: &Pool) -> Option<Self::Rules>;

    /// Waits (up to `limit`) until the rules can judge every statement (a rule naming a
    /// function reads the catalogue first).
    fn rules_ready(rules: &Self::Rules, limit: Duration) -> impl Future<Output = ()> + Send;

    /// The SQLSTATE and message of the error that refuses `msg` (a whole client message,
    /// its text in `encoding`), or `None` when it may pass. `pool` names the pool in logs.
    fn refusal(
        rules: &Self::Rules,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        pool: &str,
        encoding: ClientEncoding,
    ) -> Option<(&'static str, String)>;

    /// Whether the pool has a result cache to ask.
    fn has_cache(pool: &Pool) -> bool;

    /// Asks the pool's result cache about a unit (waiting, briefly, for another client
    /// filling the same key). Only for a client whose session holds nothing the key does
    /// not say, between transactions, in UTF8.
    fn from_cache(
        pool: &Pool,
        unit: CacheUnit<'_>,
    ) -> impl Future<Output = FromCache<Self::Capture>> + Send;

    /// A reply being kept: fed the bytes the client is sent, then done.
    type Capture: Send;
    fn feed(capture: &mut Self::Capture, bytes: &[u8]);
    fn captured(capture: Self::Capture);

    /// What a transaction on a pool's primary may write, noted for its result cache.
    type Writes: Send;
    fn writes(pool: &Pool) -> Option<Self::Writes>;
    fn note_write(
        writes: &mut Self::Writes,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    );
    /// What was noted is made stale (the transaction ended, or may have committed), before
    /// the client hears of it.
    fn writes_done(writes: &mut Self::Writes);

    /// DDL committed on the pool: the catalogue the features judge by is read again.
    fn schema_changed(pool: &Pool);

    /// A pool's read replicas (`[databases.*.replicas]`).
    type Replicas: Send + Sync;
    fn replicas(pool: &Pool) -> Option<&Self::Replicas>;
    /// The pool's `read_routing` and `replica_fallback`.
    fn replica_routing(replicas: &Self::Replicas) -> (ReadRouting, ReplicaFallback);
    /// Starts following the replicas, at their first use.
    fn start_replicas(replicas: &Self::Replicas, primary: &Arc<Pool>);
    /// Starts following the replicas and waits (up to `limit`) for their first check, when
    /// it has not been made yet.
    fn replicas_checked(
        replicas: &Self::Replicas,
        primary: &Arc<Pool>,
        limit: Duration,
    ) -> impl Future<Output = ()> + Send;
    /// What the unit at the head of `buf` comes to.
    fn read_unit(
        replicas: &Self::Replicas,
        buf: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    ) -> ReadUnit;
    /// Whether the one message `msg` is proven to read.
    fn message_reads(
        replicas: &Self::Replicas,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    ) -> bool;
    /// Where a read of a client that last wrote at `wrote_at` ([`crate::clock::now_ms`]) runs.
    fn choose_read(
        replicas: &Self::Replicas,
        primary: &Pool,
        wrote_at: u64,
        fallback: ReplicaFallback,
    ) -> ReadTarget;
    fn write_target(replicas: &Self::Replicas) -> WriteTarget;
    /// The replica `pool` failed in real traffic: it gets none for a while.
    fn ban_replica(replicas: &Self::Replicas, pool: &Arc<Pool>);

    /// A transaction-mode client's LISTEN through the pool's listening connection: the
    /// channels it listens to, and its mailbox.
    type Listening: Send + Sync;
    /// Whether anyone listens through the pool now (only then are notifying transactions
    /// followed; read once per transaction).
    fn listeners_active(pool: &Pool) -> bool;
    /// A client about to send SQL that may notify, on server `server_pid`: notifications
    /// from that server are the client's until the barrier for it completes.
    fn claim(pool: &Pool, server_pid: i32, client_pid: i32);
    /// Gives up a claim without waiting (the transaction ended without a ReadyForQuery the
    /// client waits for).
    fn unclaim(pool: &Pool, server_pid: i32);
    /// What completes once every notification committed so far (those of the claim on
    /// `server_pid` included) has been delivered; `None` when the pool has no listener.
    fn barrier(pool: &Pool, server_pid: i32) -> Option<oneshot::Receiver<()>>;
    /// A client starts listening (`None`: the pool has no listener to listen through).
    fn listen(pool: &Pool) -> Option<Self::Listening>;
    /// The client listens to `channels` now: what completes once the listening connection
    /// does too.
    fn listen_to(
        listening: &mut Self::Listening,
        channels: &[Box<[u8]>],
    ) -> Option<oneshot::Receiver<()>>;
    fn mailbox(listening: &Self::Listening) -> &Mailbox;
}
