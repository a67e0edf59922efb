//! The features as the session sees them: [`crate::seam::Features`] implemented
//! over each pool's [`super::Features`].

use std::sync::Arc;

use std::sync::atomic::Ordering;
use std::time::Duration;

use shoal_wire::sql::ClientEncoding;

use super::PoolFeatures;
use crate::cache::analysis::Touches;
use crate::cache::{Capture, Fill, QueryCache, Touched};
use crate::config::replicas::{ReadRouting, ReplicaFallback};
use crate::limits::{PoolLimits, Running};
use crate::mailbox::Mailbox;
use crate::notify::Subscription;
use crate::pool::Pool;
use crate::prepared::ClientStatements;
use crate::query_rules::QueryRules;
use crate::replicas::{ReplicaSet, Target, Writer};
use crate::seam::{self, CacheUnit, FromCache, ReadTarget, ReadUnit, Refusal, WriteTarget};

/// How many times a client waits for others' fills of its key before running it itself.
const WAITS: usize = 2;

/// A transaction's writes, as a pool's cache follows them.
pub struct Writes {
    cache: Arc<QueryCache>,
    touched: Touched,
}

/// The features the data plane runs with (named at the crate root as [`crate::Plugged`]).
pub struct Plugged;

impl crate::pool::Plug for Plugged {
    type AddOns = super::Features;
}

impl seam::Features for Plugged {
    type Limits = Arc<PoolLimits>;
    type Running = Option<Running>;

    #[inline]
    fn limits(pool: &Pool) -> Option<Self::Limits> {
        pool.limits()
    }

    async fn admit_unit(limits: &Self::Limits) -> Result<(), Refusal> {
        if !limits.has_rate() {
            return Ok(());
        }
        limits.admit_query().await
    }

    async fn admit_transaction(limits: &Self::Limits) -> Result<Self::Running, Refusal> {
        if !limits.has_concurrency() {
            return Ok(None);
        }
        limits.admit_transaction().await.map(Some)
    }

    #[inline]
    fn transaction_ran(pool: &Pool, queries: u64) {
        if let Some(l) = pool.limits() {
            l.charge(queries);
        }
    }

    type Rules = Arc<QueryRules>;

    #[inline]
    fn rules(pool: &Pool) -> Option<Self::Rules> {
        pool.rules()
    }

    async fn rules_ready(rules: &Self::Rules, limit: Duration) {
        rules.catalogue_read(limit).await
    }

    #[inline]
    fn refusal(
        rules: &Self::Rules,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        pool: &str,
        encoding: ClientEncoding,
    ) -> Option<(&'static str, String)> {
        rules.refusal(msg, statements, pool, encoding)
    }

    #[inline]
    fn has_cache(pool: &Pool) -> bool {
        pool.cache().is_some()
    }

    async fn from_cache(pool: &Pool, unit: CacheUnit<'_>) -> FromCache<Self::Capture> {
        let Some(cache) = pool.cache() else {
            return FromCache::Pass;
        };
        // A new pool's first statements wait for the catalogue (once, briefly) rather than
        // all pass uncached.
        cache
            .freshness
            .catalogue
            .loaded(pool.settings.connect_timeout)
            .await;
        let Some(candidate) = cache.candidate(unit.buf, unit.statements, unit.prefix) else {
            return FromCache::Pass;
        };
        for attempt in 0..=WAITS {
            if let Some(reply) = cache.lookup(&candidate.key) {
                cache.stats.hits.fetch_add(1, Ordering::Relaxed);
                return FromCache::Hit {
                    reply,
                    len: candidate.len,
                    unnamed_parse: candidate.unnamed_parse.clone(),
                };
            }
            if attempt == WAITS {
                break;
            }
            let notify = match cache.begin_fill(&candidate) {
                Fill::Lead(capture) => {
                    cache.stats.misses.fetch_add(1, Ordering::Relaxed);
                    return FromCache::Fill(capture);
                }
                Fill::Skip => {
                    cache.stats.misses.fetch_add(1, Ordering::Relaxed);
                    return FromCache::Pass;
                }
                Fill::Wait(n) => n,
            };
            cache.stats.waits.fetch_add(1, Ordering::Relaxed);
            wait_for_fill(&cache, &candidate.key, &notify).await;
        }
        cache.stats.misses.fetch_add(1, Ordering::Relaxed);
        FromCache::Pass
    }

    type Capture = Box<Capture>;

    #[inline]
    fn feed(capture: &mut Self::Capture, bytes: &[u8]) {
        capture.feed(bytes);
    }

    #[inline]
    fn captured(capture: Self::Capture) {
        capture.finish();
    }

    type Writes = Writes;

    #[inline]
    fn writes(pool: &Pool) -> Option<Writes> {
        pool.cache().map(|cache| Writes {
            cache,
            touched: Touched::default(),
        })
    }

    #[inline]
    fn note_write(
        writes: &mut Writes,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    ) {
        note_writes(writes, msg, statements, encoding);
    }

    #[inline]
    fn writes_done(writes: &mut Writes) {
        if !writes.touched.is_nothing() {
            writes.touched.apply(&writes.cache.freshness);
        }
    }

    #[inline]
    fn schema_changed(pool: &Pool) {
        pool.catalogue().changed();
    }
    type Replicas = Arc<ReplicaSet>;

    #[inline]
    fn replicas(pool: &Pool) -> Option<&Self::Replicas> {
        pool.replicas()
    }

    fn replica_routing(set: &Self::Replicas) -> (ReadRouting, ReplicaFallback) {
        (set.routing(), set.config.fallback)
    }

    fn start_replicas(set: &Self::Replicas, primary: &Arc<Pool>) {
        set.start(primary);
    }

    async fn replicas_checked(set: &Self::Replicas, primary: &Arc<Pool>, limit: Duration) {
        if !set.checked() {
            set.start(primary);
            set.first_check(limit).await;
        }
    }

    fn read_unit(
        set: &Self::Replicas,
        buf: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    ) -> ReadUnit {
        set.verdicts.unit(buf, encoding, |name| {
            statements.and_then(|s| s.text_of(name))
        })
    }

    fn message_reads(
        set: &Self::Replicas,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        encoding: ClientEncoding,
    ) -> bool {
        set.verdicts.message_reads(msg, encoding, |name| {
            statements.and_then(|s| s.text_of(name))
        })
    }

    fn choose_read(
        set: &Self::Replicas,
        primary: &Pool,
        wrote_at: u64,
        fallback: ReplicaFallback,
    ) -> ReadTarget {
        match set.choose(primary, wrote_at, fallback) {
            Target::Primary => ReadTarget::Primary,
            Target::Replica(m) => ReadTarget::Replica(m.pool.clone()),
            Target::NoReplica => ReadTarget::NoReplica,
        }
    }

    fn write_target(set: &Self::Replicas) -> WriteTarget {
        match set.writer() {
            Writer::Configured => WriteTarget::Configured,
            Writer::Member(_) => WriteTarget::Promoted(set.writer_pool().cloned()),
            Writer::Nowhere => WriteTarget::Nowhere,
        }
    }

    fn ban_replica(set: &Self::Replicas, pool: &Arc<Pool>) {
        if let Some(m) = set.members.iter().find(|m| Arc::ptr_eq(&m.pool, pool)) {
            m.ban(set.ban_ms(), "unavailable to a client");
        }
    }

    type Listening = Subscription;

    #[inline]
    fn listeners_active(pool: &Pool) -> bool {
        pool.notify().active()
    }

    fn claim(pool: &Pool, server_pid: i32, client_pid: i32) {
        pool.notify().claim(server_pid, client_pid);
    }

    fn unclaim(pool: &Pool, server_pid: i32) {
        pool.notify().unclaim(server_pid);
    }

    fn barrier(pool: &Pool, server_pid: i32) -> Option<tokio::sync::oneshot::Receiver<()>> {
        Some(pool.notify().barrier(&pool.weak(), server_pid))
    }

    fn listen(pool: &Pool) -> Option<Subscription> {
        Some(Subscription::new(pool, pool.notify()))
    }

    fn listen_to(
        listening: &mut Subscription,
        channels: &[Box<[u8]>],
    ) -> Option<tokio::sync::oneshot::Receiver<()>> {
        listening.update(channels)
    }

    #[inline]
    fn mailbox(listening: &Subscription) -> &Mailbox {
        &listening.mailbox
    }
}

/// Waits until the client filling `key` is done (or [`crate::cache::FILL_WAIT`] passes).
async fn wait_for_fill(cache: &QueryCache, key: &[u8], notify: &tokio::sync::Notify) {
    let notified = notify.notified();
    let mut notified = std::pin::pin!(notified);
    // Registered before looking: a fill ending after the look wakes this wait.
    notified.as_mut().enable();
    if !cache.filling(key) {
        return;
    }
    let _ = crate::timer::timeout(crate::cache::FILL_WAIT, notified).await;
}

/// Notes what the client message `msg` (about to go to the pool's primary) may write:
/// a Query's text, the statement a Bind runs, or anything for a FunctionCall.
fn note_writes(
    writes: &mut Writes,
    msg: &[u8],
    statements: Option<&ClientStatements>,
    enc: ClientEncoding,
) {
    use shoal_wire::frontend::tag as fe;
    let body = &msg[shoal_wire::frame::HEADER_LEN..];
    let cstr = |b: &[u8]| -> usize { b.iter().position(|&c| c == 0).unwrap_or(b.len()) };
    let text = match msg[0] {
        fe::QUERY => &body[..cstr(body)],
        fe::BIND => {
            let rest = &body[(cstr(body) + 1).min(body.len())..];
            let name = &rest[..cstr(rest)];
            match statements.and_then(|s| s.text_of(name)) {
                Some(t) => t,
                None => {
                    writes.touched.add(Touches::Everything);
                    return;
                }
            }
        }
        fe::FUNCTION_CALL => {
            writes.touched.add(Touches::Everything);
            return;
        }
        _ => return,
    };
    let touches = writes.cache.touches(text, enc);
    writes.touched.add(touches);
}
