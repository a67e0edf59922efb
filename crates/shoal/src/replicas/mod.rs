//! Read replicas behind a pool: which backend a transaction's server comes from.
//!
//! A pool whose database lists replicas has a [`ReplicaSet`]: one pool per replica (same
//! user, same settings, its own `pool_size`), their health and lag as the checker last saw
//! them ([`health`]), and the proof that a transaction only reads ([`verdicts`]). The
//! session asks [`ReplicaSet::choose`] for a replica when its routing sends the transaction
//! there; everything else (checkout, relay, checkin) is the pool's, unchanged. The primary
//! pool stays the client's pool: its prepared-statement registry, metrics and fence are the
//! ones the session uses, whichever backend runs a transaction.

mod health;
pub mod status;
pub mod verdicts;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::clock;
use crate::config::replicas::{ReadRouting, ReplicaFallback, ReplicaHost, Replicas};
use crate::pool::Pool;

/// What the checker last learnt of a backend's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Not checked yet: gets no reads.
    Unknown = 0,
    /// In recovery (a standby): may get reads.
    Replica = 1,
    /// Not in recovery: a primary (a promoted replica gets no reads: it takes writes).
    Primary = 2,
    /// The last check could not reach it.
    Down = 3,
}

impl Role {
    fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Replica,
            2 => Role::Primary,
            3 => Role::Down,
            _ => Role::Unknown,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Role::Unknown => "unknown",
            Role::Replica => "replica",
            Role::Primary => "primary",
            Role::Down => "down",
        }
    }
}

/// One replica: its pool and what is known of it.
pub struct Member {
    pub pool: Arc<Pool>,
    pub host: ReplicaHost,
    role: AtomicU8,
    /// Lag past `max_replica_lag` at the last check.
    lagging: AtomicBool,
    /// No traffic until then ([`clock::now_ms`]; 0: not banned).
    banned_until: AtomicU64,
    /// WAL bytes behind the primary, and milliseconds behind, at the last check
    /// (`u64::MAX`: not known).
    pub lag_bytes: AtomicU64,
    pub lag_ms: AtomicU64,
    /// Every commit acknowledged before this moment ([`clock::now_ms`]) is visible here
    /// (0: not known). Read-your-writes compares a client's last write with it.
    pub fresh_as_of: AtomicU64,
    /// Transactions routed here.
    pub reads: AtomicU64,
    /// Times it was banned (a failed check, or a failure in real traffic).
    pub bans: AtomicU64,
}

impl Member {
    pub fn role(&self) -> Role {
        Role::from_u8(self.role.load(Ordering::Relaxed))
    }

    pub fn lagging(&self) -> bool {
        self.lagging.load(Ordering::Relaxed)
    }

    pub fn banned(&self, now_ms: u64) -> bool {
        now_ms < self.banned_until.load(Ordering::Relaxed)
    }

    fn usable(&self, now_ms: u64) -> bool {
        self.role() == Role::Replica && !self.lagging() && !self.banned(now_ms)
    }

    /// Gives the replica no traffic for `ban_ms` (its idle servers are closed: they failed,
    /// or will be stale when it comes back).
    pub fn ban(&self, ban_ms: u64, why: &str) {
        let until = clock::now_ms() + ban_ms;
        let was = self.banned_until.swap(until, Ordering::Relaxed);
        if was <= clock::now_ms() {
            self.bans.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pool = %self.pool.name, reason = why, ban_ms, "replica banned");
            let pool = self.pool.clone();
            crate::control::spawn(async move { pool.close_idle().await });
        }
    }
}

/// A pool's replicas.
pub struct ReplicaSet {
    pub config: Replicas,
    pub members: Box<[Member]>,
    /// Proofs that statement texts only read, and the functions the database knows as
    /// non-volatile.
    pub verdicts: verdicts::Verdicts,
    /// The checker runs from the first use on (a node that only relays never starts it).
    checker: OnceLock<()>,
    /// Where writes go now ([`Writer`], encoded).
    writer: AtomicUsize,
    /// The configured primary's role at the last check.
    primary_role: AtomicU8,
    /// Set once the checker has looked at every replica (before, none is known usable).
    checked: AtomicBool,
    first_check: tokio::sync::Notify,
}

/// Where writes go: the configured primary, a replica promoted in its place, or nowhere
/// (the configured primary is a standby now and no replica was promoted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Configured,
    Member(usize),
    Nowhere,
}

impl Writer {
    fn encode(self) -> usize {
        match self {
            Writer::Configured => 0,
            Writer::Member(i) => i + 1,
            Writer::Nowhere => usize::MAX,
        }
    }

    fn decode(v: usize) -> Writer {
        match v {
            0 => Writer::Configured,
            usize::MAX => Writer::Nowhere,
            i => Writer::Member(i - 1),
        }
    }
}

/// Where a transaction should run.
pub enum Target<'a> {
    Primary,
    Replica(&'a Member),
    /// Reads must not go to the primary (`replica_fallback = "error"`) and no replica is
    /// usable.
    NoReplica,
}

impl ReplicaSet {
    /// Replica pools for `primary`'s (database, user), made with its settings and
    /// credentials.
    pub fn new(
        primary: &Pool,
        config: Replicas,
        analyses: Arc<crate::analysis::Analyses>,
        catalogue: Arc<crate::analysis::catalogue::Source>,
        member_addons: impl Fn() -> Arc<crate::pool::PoolAddOns>,
    ) -> ReplicaSet {
        let members = config
            .hosts
            .iter()
            .map(|h| {
                let mut upstream = primary.upstream.clone();
                upstream.host = h.host.clone();
                upstream.port = h.port;
                let names = crate::pool::Names {
                    name: format!("{}@{}:{}", primary.name, h.host, h.port),
                    route_key: (
                        format!("{}@{}:{}", primary.database(), h.host, h.port),
                        primary.route_key.1.clone(),
                    ),
                    tenant: primary.tenant.clone(),
                };
                let pool = Pool::new(
                    names,
                    crate::prepared::StatementRegistry::sharing(Default::default()),
                    primary.settings.clone(),
                    upstream,
                    primary.fence.lease().clone(),
                    member_addons(),
                    primary.shards(),
                );
                Member {
                    pool,
                    host: h.clone(),
                    role: AtomicU8::new(Role::Unknown as u8),
                    lagging: AtomicBool::new(false),
                    banned_until: AtomicU64::new(0),
                    lag_bytes: AtomicU64::new(u64::MAX),
                    lag_ms: AtomicU64::new(u64::MAX),
                    fresh_as_of: AtomicU64::new(0),
                    reads: AtomicU64::new(0),
                    bans: AtomicU64::new(0),
                }
            })
            .collect();
        ReplicaSet {
            config,
            members,
            verdicts: verdicts::Verdicts::new(analyses, catalogue),
            checker: OnceLock::new(),
            writer: AtomicUsize::new(0),
            primary_role: AtomicU8::new(Role::Unknown as u8),
            checked: AtomicBool::new(false),
            first_check: tokio::sync::Notify::new(),
        }
    }

    pub fn routing(&self) -> ReadRouting {
        self.config.routing
    }

    /// Starts the checker of `primary`'s replicas, once.
    pub fn start(self: &Arc<Self>, primary: &Arc<Pool>) {
        self.checker.get_or_init(|| {
            self.verdicts.catalogue().start();
            crate::control::spawn(health::run(Arc::downgrade(self), Arc::downgrade(primary)));
        });
    }

    /// Where writes go now.
    pub fn writer(&self) -> Writer {
        Writer::decode(self.writer.load(Ordering::Acquire))
    }

    /// The promoted replica's pool, when writes go to one.
    pub fn writer_pool(&self) -> Option<&Arc<Pool>> {
        match self.writer() {
            Writer::Member(i) => self.members.get(i).map(|m| &m.pool),
            _ => None,
        }
    }

    /// The configured primary's role at the last check.
    pub fn primary_role(&self) -> Role {
        Role::from_u8(self.primary_role.load(Ordering::Relaxed))
    }

    /// Decides where writes go from the roles just checked. A promoted replica stays the
    /// writer while it is a primary, even if the old primary comes back as one (its
    /// history has parted from the new primary's: writes must not go back and forth). A
    /// host in recovery never takes writes.
    fn elect(&self, configured: Role, member: impl Fn(usize) -> Role) -> Writer {
        let was = self.writer();
        let promoted = (0..self.members.len()).find(|&i| member(i) == Role::Primary);
        let now = match was {
            Writer::Member(i) if member(i) == Role::Primary => was,
            _ if configured == Role::Primary => Writer::Configured,
            _ => match promoted {
                Some(i) => Writer::Member(i),
                // Unreachable, perhaps restarting: it may come back as the primary, and
                // writes meanwhile fail on connecting.
                None if matches!(configured, Role::Down | Role::Unknown) => Writer::Configured,
                None => Writer::Nowhere,
            },
        };
        if now != was {
            self.writer.store(now.encode(), Ordering::Release);
            match now {
                Writer::Member(i) => {
                    tracing::warn!(writer = %self.members[i].pool.name, "failover: the configured primary is not one now; writes go to the promoted replica")
                }
                Writer::Configured => tracing::info!("writes go to the configured primary"),
                Writer::Nowhere => tracing::error!(
                    "no primary: the configured primary is in recovery and no replica was promoted; writes are refused"
                ),
            }
        }
        let configured_was =
            Role::from_u8(self.primary_role.swap(configured as u8, Ordering::Relaxed));
        if configured == Role::Primary
            && configured_was != Role::Primary
            && matches!(now, Writer::Member(_))
        {
            tracing::warn!("two primaries: the configured primary is one again beside the promoted replica; writes stay on the promoted replica");
        }
        now
    }

    /// Whether every replica has been checked once.
    pub fn checked(&self) -> bool {
        self.checked.load(Ordering::Acquire)
    }

    /// Waits (up to `limit`) for the first check of every replica, so that the first reads
    /// after a start are routed by what is known rather than all sent to the primary.
    pub async fn first_check(&self, limit: std::time::Duration) {
        let wait = async {
            loop {
                let notified = self.first_check.notified();
                if self.checked() {
                    return;
                }
                notified.await;
            }
        };
        let _ = crate::timer::timeout(limit, wait).await;
    }

    fn note_checked(&self) {
        if !self.checked.swap(true, Ordering::AcqRel) {
            self.first_check.notify_waiters();
        }
    }

    /// The replica a read should go to: the usable one with the fewest transactions
    /// running per unit of weight, preferring `prefer_zone`; `NoReplica` or `Primary`
    /// (by `fallback`) when none is usable. A client that committed a write at
    /// `wrote_at` ([`clock::now_ms`]; 0: never) reads only where that commit is visible,
    /// else on the primary.
    pub fn choose(&self, primary: &Pool, wrote_at: u64, fallback: ReplicaFallback) -> Target<'_> {
        let now = clock::now_ms();
        let mut stale = false;
        // (outside `prefer_zone`, transactions running per unit of weight), for a replica
        // that may take the read.
        let key = |m: &Member, stale: &mut bool| -> Option<(bool, u64)> {
            if !m.usable(now) {
                return None;
            }
            if wrote_at != 0 && m.fresh_as_of.load(Ordering::Relaxed) <= wrote_at {
                *stale = true;
                return None;
            }
            if !m.pool.fence.may_open() {
                // A cluster node uses a pool's replicas where it owns the pool.
                if primary.fence.owned() {
                    m.pool.fence.own();
                }
                if !m.pool.fence.may_open() {
                    return None;
                }
            }
            let away = self
                .config
                .zone
                .as_ref()
                .is_some_and(|z| m.host.zone.as_ref() != Some(z));
            Some((
                away,
                m.pool.in_use() as u64 * 1_000_000 / m.host.weight as u64,
            ))
        };
        // On the stack for any usual number of replicas: this runs for every read.
        let n = self.members.len();
        let mut small = [None; 16];
        let mut large = Vec::new();
        let keys: &mut [Option<(bool, u64)>] = if n <= small.len() {
            &mut small[..n]
        } else {
            large.resize(n, None);
            &mut large
        };
        for (k, m) in keys.iter_mut().zip(self.members.iter()) {
            *k = key(m, &mut stale);
        }
        let chosen = pick(keys, |i| self.members[i].host.weight, rand::random::<u64>());
        match chosen {
            Some(i) => {
                let m = &self.members[i];
                m.reads.fetch_add(1, Ordering::Relaxed);
                Target::Replica(m)
            }
            // Replicas are up but have not shown the client's last write yet: the primary
            // has it.
            None if stale => Target::Primary,
            None if fallback == ReplicaFallback::Error => Target::NoReplica,
            None => Target::Primary,
        }
    }

    /// The ban a failure earns.
    pub fn ban_ms(&self) -> u64 {
        self.config.ban_time.as_millis() as u64
    }

    /// The primary pool stopped being owned here (cluster): its replicas' servers go too.
    pub async fn fence(&self) {
        for m in self.members.iter() {
            m.pool.fence.close();
            m.pool.server_fds.shut_reads();
            m.pool.close_idle().await;
        }
    }
}

/// Of candidates keyed `(outside the preferred zone, load per unit of weight)` (`None`: not
/// a candidate), one of the lowest key, drawn in proportion to `weight` with the random
/// number `r`: equally loaded replicas share reads by weight, and a busier one gets fewer.
fn pick(keys: &[Option<(bool, u64)>], weight: impl Fn(usize) -> u32, r: u64) -> Option<usize> {
    let best = keys.iter().flatten().min()?;
    let tied = || {
        keys.iter()
            .enumerate()
            .filter(move |(_, k)| k.as_ref() == Some(best))
            .map(|(i, _)| i)
    };
    let total: u64 = tied().map(|i| u64::from(weight(i))).sum();
    let mut at = r % total.max(1);
    for i in tied() {
        let w = u64::from(weight(i));
        if at < w {
            return Some(i);
        }
        at -= w;
    }
    tied().next()
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn reads_go_to_the_least_loaded_and_share_by_weight() {
        let weights = [1u32, 3, 1];
        let w = |i: usize| weights[i];
        // All idle: shared 1:3:1 over the draws.
        let mut counts = [0; 3];
        for r in 0..500 {
            counts[pick(
                &[Some((false, 0)), Some((false, 0)), Some((false, 0))],
                w,
                r,
            )
            .unwrap()] += 1;
        }
        assert_eq!(counts, [100, 300, 100]);
        // The busier one is left out while another is less loaded.
        for r in 0..50 {
            assert_eq!(
                pick(
                    &[Some((false, 2)), Some((false, 5)), Some((false, 1))],
                    w,
                    r
                ),
                Some(2)
            );
        }
        // The preferred zone first, however loaded.
        assert_eq!(
            pick(&[Some((true, 0)), Some((false, 9)), None], w, 7),
            Some(1)
        );
        assert_eq!(pick(&[None, None, None], w, 1), None);
    }
}
