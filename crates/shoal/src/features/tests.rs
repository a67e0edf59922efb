//! The result cache as the session meets it, in one process with paused time: every call
//! goes through the seam (`Plugged`), as the session makes it, over a pool whose catalogue
//! is fixed and whose change stream is driven by hand through [`crate::wal::Tap`], as the
//! database's capture task drives it. What a spawned Shoal and PostgreSQL test end to end
//! (tests/cache.rs), this checks step by step, without a clock or a server.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use shoal_wire::backend;
use shoal_wire::sql::ClientEncoding;

use super::relay::Plugged;
use super::{Features, PoolFeatures};
use crate::analysis::catalogue::{Catalogue, Relation, Source};
use crate::cache::freshness::Freshness;
use crate::pool::Pool;
use crate::seam::{CacheUnit, Features as _, FromCache};
use crate::server::Upstream;
use crate::wal::Tap;

/// A catalogue reading with two plain tables, `t` and `u`.
fn reading(version: &str) -> Catalogue {
    let table = |name: &str| {
        let relation = Relation {
            cacheable: true,
            plain_writes: true,
            qualified: vec![format!("public.{name}")],
        };
        (name.to_string(), relation)
    };
    Catalogue {
        loaded: true,
        version: version.into(),
        relations: [table("t"), table("u")].into_iter().collect(),
        ..Catalogue::default()
    }
}

/// A transaction-mode pool keeping every read (`cache_all_reads`), with its database's
/// freshness and catalogue.
fn pool_with_cache() -> (Arc<Pool>, Arc<Freshness>, Arc<Source>) {
    let config = crate::config::Config::parse(
        "[databases.d]\nhost = \"127.0.0.1\"\ncache = true\ncache_all_reads = true\n\
         [users.u]\npassword = \"x\"\n",
        "test",
        &|_| None,
    )
    .unwrap();
    let (db, user) = (&config.databases["d"], &config.users["u"]);
    let source = Source::fixed(reading("1"));
    let features = Features::new(source.clone());
    let names = crate::pool::Names {
        name: "d/u".into(),
        route_key: ("d".into(), "u".into()),
        tenant: None,
    };
    let pool = Pool::new(
        names,
        crate::prepared::StatementRegistry::sharing(Default::default()),
        config.pool_settings(db, user),
        Upstream::nowhere(),
        Arc::new(crate::pool::LeaseClock::new(false)),
        features.clone(),
        1,
    );
    let key = ("127.0.0.1".into(), 5432, "d".into());
    let freshness = Freshness::new(key, Upstream::nowhere(), source.clone(), &Arc::default());
    features.set_cache(Some(db.cache.clone()), || freshness.clone());
    (pool, freshness, source)
}

fn query(text: &str) -> Vec<u8> {
    let mut m = BytesMut::new();
    shoal_wire::frontend::query(&mut m, text);
    m.to_vec()
}

/// A reply to `SELECT a FROM t`: one row, `value`, up to ReadyForQuery (idle).
fn reply(value: &str) -> Vec<u8> {
    let mut m = BytesMut::new();
    backend::put_message(&mut m, b'D', |b| {
        b.put_u16(1);
        b.put_u32(value.len() as u32);
        b.put_slice(value.as_bytes());
    });
    backend::put_message(&mut m, b'C', |b| backend::put_cstr(b, "SELECT 1"));
    backend::ready_for_query(&mut m, b'I');
    m.to_vec()
}

const READ: &str = "SELECT a FROM t";

/// What the cache makes of `text` for a client with no settings of its own.
async fn ask(pool: &Pool, text: &str) -> FromCache<crate::seam::Capture> {
    let buf = query(text);
    let unit = CacheUnit {
        buf: &buf,
        statements: None,
        prefix: Vec::new(),
    };
    Plugged::from_cache(pool, unit).await
}

/// Runs `text` as the client that leads its fill would: the reply fed as it goes to the
/// client, then kept.
async fn fill(pool: &Pool, text: &str, value: &str) {
    match ask(pool, text).await {
        FromCache::Fill(mut capture) => {
            Plugged::feed(&mut capture, &reply(value));
            Plugged::captured(capture);
        }
        FromCache::Hit { .. } => panic!("{text}: a hit where a fill was due"),
        FromCache::Pass => panic!("{text}: passed where a fill was due"),
    }
}

/// The reply the cache serves for `text`, if it serves one.
async fn served(pool: &Pool, text: &str) -> Option<Bytes> {
    match ask(pool, text).await {
        FromCache::Hit { reply, len, .. } => {
            assert_eq!(len, query(text).len(), "the whole unit is answered");
            Some(reply)
        }
        // Not served: a fill that ends unkept, as a client that runs it would leave it.
        FromCache::Fill(capture) => {
            drop(capture);
            None
        }
        FromCache::Pass => None,
    }
}

/// A transaction on the pool's primary that ran `text` (and committed).
fn write(pool: &Pool, text: &str) {
    let mut writes = Plugged::writes(pool).expect("a pool with a cache follows its writes");
    Plugged::note_write(&mut writes, &query(text), None, ClientEncoding::Utf8);
    Plugged::writes_done(&mut writes);
}

#[tokio::test(start_paused = true)]
async fn kept_replies_go_stale_on_every_change_they_could_miss() {
    let (pool, freshness, source) = pool_with_cache();
    let stats = &pool.cache().unwrap().stats;

    // Until the change stream covers `t`, its reads run and nothing is kept; the stream is
    // asked to cover it.
    assert!(matches!(ask(&pool, READ).await, FromCache::Pass));
    let covers = freshness.to_cover(&[]);
    assert_eq!(covers.len(), 1, "the stream is asked for `t`");
    assert_eq!(covers[0].name, "t");
    freshness.covered("t");

    fill(&pool, READ, "one").await;
    assert_eq!(
        served(&pool, READ).await.as_deref(),
        Some(&reply("one")[..])
    );
    assert_eq!(stats.hits.load(Ordering::Relaxed), 1);

    // A write through Shoal to another table leaves it; to `t`, makes it stale.
    write(&pool, "UPDATE u SET a = 1");
    assert!(served(&pool, READ).await.is_some(), "`u` changed, not `t`");
    write(&pool, "UPDATE t SET a = 'two'");
    assert_eq!(served(&pool, READ).await, None, "a write through Shoal");
    assert_eq!(stats.stale.load(Ordering::Relaxed), 1);

    // Named with its schema and quoted, it is the same table.
    fill(&pool, READ, "two").await;
    write(&pool, "UPDATE \"public\".\"t\" SET a = 'three'");
    assert_eq!(
        served(&pool, READ).await,
        None,
        "a schema-qualified, quoted name"
    );

    // A commit from anywhere else, seen on the stream.
    fill(&pool, READ, "two").await;
    assert_eq!(
        served(&pool, READ).await.as_deref(),
        Some(&reply("two")[..])
    );
    freshness.committed(&["u"]);
    assert!(
        served(&pool, READ).await.is_some(),
        "the stream saw `u` only"
    );
    freshness.committed(&["t"]);
    assert_eq!(served(&pool, READ).await, None, "a commit on the stream");

    // A change seen while a fill runs makes it useless, though it ends after.
    let FromCache::Fill(mut capture) = ask(&pool, READ).await else {
        panic!("a fill was due");
    };
    freshness.committed(&["t"]);
    Plugged::feed(&mut capture, &reply("old"));
    Plugged::captured(capture);
    assert_eq!(served(&pool, READ).await, None, "filled across a change");

    // What cannot be read as the server reads it may write anything.
    fill(&pool, READ, "three").await;
    write(&pool, "DO $$ BEGIN PERFORM 1; END $$");
    assert_eq!(
        served(&pool, READ).await,
        None,
        "a statement that may write anything"
    );

    // The catalogue read again and found changed: what was decided on the old one goes.
    fill(&pool, READ, "four").await;
    source.set(reading("2"));
    assert_eq!(served(&pool, READ).await, None, "a new catalogue");

    // The stream lost: nothing kept is served, and nothing is kept until it covers `t`
    // again.
    fill(&pool, READ, "five").await;
    freshness.lost(Some("connection reset"));
    assert_eq!(served(&pool, READ).await, None, "the stream was lost");
    assert!(matches!(ask(&pool, READ).await, FromCache::Pass));
    freshness.covered("t");
    fill(&pool, READ, "six").await;
    assert_eq!(
        served(&pool, READ).await.as_deref(),
        Some(&reply("six")[..])
    );
}

#[tokio::test(start_paused = true)]
async fn clients_asking_for_a_key_being_filled_wait_for_it_or_run_it_themselves() {
    let (pool, freshness, _source) = pool_with_cache();
    assert!(matches!(ask(&pool, READ).await, FromCache::Pass));
    freshness.covered("t");

    // One client fills; another, asking meanwhile, gets the reply it kept.
    let FromCache::Fill(mut capture) = ask(&pool, READ).await else {
        panic!("a fill was due");
    };
    let waiter = tokio::spawn({
        let pool = pool.clone();
        async move { served(&pool, READ).await }
    });
    tokio::task::yield_now().await;
    assert!(
        !waiter.is_finished(),
        "the second client waits for the fill"
    );
    Plugged::feed(&mut capture, &reply("kept"));
    Plugged::captured(capture);
    assert_eq!(waiter.await.unwrap().as_deref(), Some(&reply("kept")[..]));

    // A fill that never ends (its client stuck) holds the others only so long: each waits
    // its turn twice, then runs the statement itself, keeping nothing.
    freshness.committed(&["t"]);
    let FromCache::Fill(stuck) = ask(&pool, READ).await else {
        panic!("a fill was due");
    };
    let started = tokio::time::Instant::now();
    assert!(matches!(ask(&pool, READ).await, FromCache::Pass));
    let waited = started.elapsed();
    assert_eq!(
        waited,
        2 * crate::cache::FILL_WAIT,
        "two waits of FILL_WAIT"
    );
    let stats = &pool.cache().unwrap().stats;
    assert_eq!(stats.waits.load(Ordering::Relaxed), 3);
    drop(stuck);

    // A fill whose client went away (its reply not kept) wakes the waiters at once; the
    // next of them fills.
    let FromCache::Fill(gone) = ask(&pool, READ).await else {
        panic!("a fill was due");
    };
    let next = tokio::spawn({
        let pool = pool.clone();
        async move { matches!(ask(&pool, READ).await, FromCache::Fill(_)) }
    });
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    drop(gone);
    assert!(next.await.unwrap(), "the next client fills");
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "woken at once, not by a timer"
    );
}
