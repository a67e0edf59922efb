use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use proptest::prelude::*;

use super::{Acquire, Permits, Refused};

/// Counts its wake-ups.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// An acquire polled by hand, with a waker that counts.
struct Waiting<'a> {
    fut: Acquire<'a>,
    woken: Arc<Count>,
}

impl<'a> Waiting<'a> {
    fn new(permits: &'a Permits) -> Self {
        Self::until(permits, u64::MAX)
    }

    fn until(permits: &'a Permits, deadline: u64) -> Self {
        Self::on(permits, deadline, 0)
    }

    /// Waits in `shard`'s line.
    fn on(permits: &'a Permits, deadline: u64, shard: usize) -> Self {
        Waiting {
            fut: permits.acquire_on(deadline, shard),
            woken: Arc::default(),
        }
    }

    /// Polls once: `Some(true)` granted (the permit kept), `Some(false)` closed, `None` waiting.
    fn poll(&mut self) -> Option<bool> {
        match self.outcome() {
            Poll::Ready(Ok(())) => Some(true),
            Poll::Ready(Err(Refused::Closed)) => Some(false),
            Poll::Ready(Err(Refused::TimedOut)) => panic!("timed out"),
            Poll::Pending => None,
        }
    }

    fn outcome(&mut self) -> Poll<Result<(), Refused>> {
        let waker = Waker::from(self.woken.clone());
        Pin::new(&mut self.fut)
            .poll(&mut Context::from_waker(&waker))
            .map_ok(|p| p.keep())
    }

    fn wakes(&self) -> usize {
        self.woken.0.load(Ordering::SeqCst)
    }
}

/// One permit, held (its holder gives it back with `release`): whoever comes next waits.
fn taken_pool_of_one() -> Permits {
    let p = Permits::new(1);
    p.try_acquire().unwrap().keep();
    p
}

#[test]
fn free_permits_are_taken_and_given_back_without_queueing() {
    let p = Permits::new(2);
    let a = p.try_acquire().expect("a free permit");
    let b = p.try_acquire().expect("a second");
    assert!(p.try_acquire().is_none());
    assert_eq!(p.available(), 0);
    drop(a);
    assert_eq!(p.available(), 1);
    b.keep();
    p.release();
    assert_eq!(p.available(), 2);
}

#[test]
fn waiters_are_served_in_order_and_newcomers_cannot_jump_the_queue() {
    let p = taken_pool_of_one();
    let mut w: Vec<_> = (0..3).map(|_| Waiting::new(&p)).collect();
    for x in &mut w {
        assert_eq!(x.poll(), None);
    }
    p.release();
    assert_eq!(w[0].wakes(), 1, "the first waiter is woken");
    assert_eq!(w[1].wakes() + w[2].wakes(), 0);
    // The permit went to the first waiter, not back to the free count.
    assert!(p.try_acquire().is_none());
    assert_eq!(p.available(), 0);
    // Polled out of order: only the first one has it.
    assert_eq!(w[2].poll(), None);
    assert_eq!(w[1].poll(), None);
    assert_eq!(w[0].poll(), Some(true));
    p.release();
    assert_eq!(w[1].poll(), Some(true));
    p.release();
    assert_eq!(w[2].poll(), Some(true));
    p.release();
    assert_eq!(p.available(), 1);
    assert!(
        p.try_acquire().is_some(),
        "no queue left: the fast path again"
    );
}

#[test]
fn a_waiter_that_leaves_the_queue_is_skipped() {
    let p = taken_pool_of_one();
    let mut a = Waiting::new(&p);
    let mut b = Waiting::new(&p);
    assert_eq!(a.poll(), None);
    assert_eq!(b.poll(), None);
    drop(a);
    p.release();
    assert_eq!(b.wakes(), 1);
    assert_eq!(b.poll(), Some(true));
    p.release();
    assert_eq!(p.available(), 1);
}

#[test]
fn a_permit_given_to_a_waiter_that_left_goes_to_the_next() {
    let p = taken_pool_of_one();
    let mut a = Waiting::new(&p);
    let mut b = Waiting::new(&p);
    assert_eq!(a.poll(), None);
    assert_eq!(b.poll(), None);
    p.release();
    assert_eq!(a.wakes(), 1);
    // `a` timed out before it saw its permit: it is passed on, not lost.
    drop(a);
    assert_eq!(b.wakes(), 1);
    assert_eq!(b.poll(), Some(true));
    p.release();
    // And with nobody left to pass it to, it is free again.
    let mut c = Waiting::new(&p);
    p.try_acquire().unwrap().keep();
    assert_eq!(c.poll(), None);
    p.release();
    drop(c);
    assert_eq!(p.available(), 1);
    assert!(p.try_acquire().is_some());
}

#[test]
fn closing_ends_every_wait_and_refuses_later_ones() {
    let p = taken_pool_of_one();
    let mut a = Waiting::new(&p);
    assert_eq!(a.poll(), None);
    p.close();
    assert_eq!(a.wakes(), 1);
    assert_eq!(a.poll(), Some(false));
    assert_eq!(Waiting::new(&p).poll(), Some(false));
    // A permit held when the pool closed is still given back without harm.
    p.release();
    assert!(p.try_acquire().is_none());
    assert_eq!(Waiting::new(&p).poll(), Some(false));
}

#[test]
fn expiry_ends_the_waits_past_their_deadline_first_in_line_first() {
    let p = taken_pool_of_one();
    // Nobody waits: nothing to do.
    p.expire(u64::MAX);
    assert_eq!(p.available(), 0);
    let mut a = Waiting::until(&p, 100);
    let mut b = Waiting::until(&p, 200);
    let mut c = Waiting::until(&p, 300);
    for w in [&mut a, &mut b, &mut c] {
        assert_eq!(w.poll(), None);
    }
    p.expire(100);
    assert_eq!(a.wakes(), 0, "a deadline not yet past");
    p.expire(250);
    assert_eq!((a.wakes(), b.wakes(), c.wakes()), (1, 1, 0));
    assert_eq!(a.outcome(), Poll::Ready(Err(Refused::TimedOut)));
    assert_eq!(b.outcome(), Poll::Ready(Err(Refused::TimedOut)));
    // The permit given back goes to the one still in line, not to those that gave up.
    p.release();
    assert_eq!(c.wakes(), 1);
    assert_eq!(c.poll(), Some(true));
    p.release();
    p.expire(u64::MAX);
    assert_eq!(p.available(), 1);
    assert!(
        p.try_acquire().is_some(),
        "no queue left: the fast path again"
    );
}

#[test]
fn a_permit_given_back_on_a_shard_goes_to_its_own_waiter_if_it_came_soon_enough() {
    // Half of those waiting may have joined between the first anywhere and a shard's own.
    let p = Permits::with_share(1, 2);
    p.try_acquire().unwrap().keep();
    let mut a = Waiting::on(&p, 100, 0);
    let mut b = Waiting::on(&p, 101, 1);
    let mut c = Waiting::on(&p, 102, 1);
    for w in [&mut a, &mut b, &mut c] {
        assert_eq!(w.poll(), None);
    }
    // Given back on shard 1: its first waiter came right after `a` (1 <= 3 / 2).
    p.release_on(1);
    assert_eq!((a.wakes(), b.wakes(), c.wakes()), (0, 1, 0));
    assert_eq!(b.poll(), Some(true));
    // On a shard nobody waits on: the first anywhere.
    p.release_on(2);
    assert_eq!((a.wakes(), c.wakes()), (1, 0));
    assert_eq!(a.poll(), Some(true));
    p.release_on(0);
    assert_eq!(c.poll(), Some(true));
    p.release_on(1);
    assert_eq!(p.available(), 1);
}

#[test]
fn an_older_waiter_elsewhere_is_served_first_when_too_many_came_between() {
    let p = Permits::with_share(1, 2);
    p.try_acquire().unwrap().keep();
    let mut a = Waiting::on(&p, 100, 0);
    let mut x = Waiting::on(&p, 101, 0);
    let mut b = Waiting::on(&p, 111, 1);
    for w in [&mut a, &mut x, &mut b] {
        assert_eq!(w.poll(), None);
    }
    p.release_on(1);
    assert_eq!(
        (a.wakes(), b.wakes()),
        (1, 0),
        "two came before b: more than 3 / 2"
    );
    assert_eq!(a.poll(), Some(true));
    drop(x);
    // Growing the pool is no shard's give-back: first come, first served.
    let mut c = Waiting::on(&p, 112, 0);
    assert_eq!(c.poll(), None);
    p.add(1);
    assert_eq!((b.wakes(), c.wakes()), (1, 0));
    assert_eq!(b.poll(), Some(true));
    // Expiry looks at every line.
    p.expire(200);
    assert_eq!(c.outcome(), Poll::Ready(Err(Refused::TimedOut)));
}

#[test]
fn a_shrink_takes_free_permits_at_once_and_the_rest_as_they_come_back() {
    let p = Permits::new(3);
    let held: Vec<_> = (0..2).map(|_| p.try_acquire().unwrap()).collect();
    // From 3 to 1 with 2 held: the free one goes now, one more when given back.
    p.shrink(2);
    assert_eq!(p.available(), 0);
    let mut w = Waiting::new(&p);
    assert_eq!(w.poll(), None);
    drop(held);
    // The first permit back paid the shrink; the second went to the waiter.
    assert_eq!(w.poll(), Some(true));
    assert_eq!(p.available(), 0);
    p.release();
    assert_eq!(p.available(), 1);
    assert!(p.try_acquire().is_some());
}

#[test]
fn growing_pays_a_shrink_first_then_the_waiters_then_the_free_count() {
    let p = Permits::new(2);
    p.try_acquire().unwrap().keep();
    p.try_acquire().unwrap().keep();
    p.shrink(1);
    let mut a = Waiting::new(&p);
    let mut b = Waiting::new(&p);
    assert_eq!(a.poll(), None);
    assert_eq!(b.poll(), None);
    p.add(4);
    assert_eq!(a.poll(), Some(true));
    assert_eq!(b.poll(), Some(true));
    assert_eq!(p.available(), 1);
}

/// Many threads taking, giving back and abandoning waits, in three shards' lines and giving
/// back on any of them: never more holders than permits, and every permit back at the end.
#[test]
fn permits_hold_under_contention_with_abandoned_waits() {
    const PERMITS: usize = 3;
    const SHARDS: usize = 3;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let p = Arc::new(Permits::with_share(PERMITS, 2));
    let holding = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let sweeper = {
        let (p, done) = (p.clone(), done.clone());
        std::thread::spawn(move || {
            while done.load(Ordering::SeqCst) == 0 {
                p.expire(crate::clock::mono_us());
                std::thread::yield_now();
            }
        })
    };
    rt.block_on(async {
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (p, holding) = (p.clone(), holding.clone());
                tokio::spawn(async move {
                    let line = t as usize % SHARDS;
                    for i in 0..2_000u32 {
                        let permit = if (i + t) % 7 == 0 {
                            // Abandoned now and then, granted or not.
                            match crate::timer::timeout(
                                std::time::Duration::from_micros(1),
                                p.acquire_on(u64::MAX, line),
                            )
                            .await
                            {
                                Ok(r) => r.unwrap(),
                                Err(_) => continue,
                            }
                        } else if i % 5 == 0 {
                            // Given up on by the sweep, now and then.
                            match p.acquire_on(crate::clock::mono_us(), line).await {
                                Ok(permit) => permit,
                                Err(Refused::TimedOut) => continue,
                                Err(Refused::Closed) => unreachable!("never closed"),
                            }
                        } else {
                            p.acquire_on(u64::MAX, line).await.unwrap()
                        };
                        let now = holding.fetch_add(1, Ordering::SeqCst) + 1;
                        assert!(now <= PERMITS, "{now} holders of {PERMITS} permits");
                        tokio::task::yield_now().await;
                        holding.fetch_sub(1, Ordering::SeqCst);
                        permit.keep();
                        p.release_on((t + i) as usize % SHARDS);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    done.store(1, Ordering::SeqCst);
    sweeper.join().unwrap();
    assert_eq!(p.available(), PERMITS);
}

#[derive(Debug, Clone)]
enum Op {
    TryAcquire,
    /// Queue on this shard.
    Join(usize),
    Poll(usize),
    Leave(usize),
    /// Give back on this shard.
    Release(usize),
    Shrink(usize),
    Add(usize),
    Close,
    /// Expire the waits with a deadline before this (a waiter's deadline is its join's
    /// number).
    Expire(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::TryAcquire),
        4 => (0..3usize).prop_map(Op::Join),
        3 => (0..8usize).prop_map(Op::Poll),
        2 => (0..8usize).prop_map(Op::Leave),
        4 => (0..3usize).prop_map(Op::Release),
        1 => (0..3usize).prop_map(Op::Shrink),
        1 => (0..3usize).prop_map(Op::Add),
        1 => Just(Op::Close),
        1 => (0..40usize).prop_map(Op::Expire),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Seen {
    Queued,
    Granted,
    Closed,
    TimedOut,
}

/// A waiter the model follows: its future (gone once done with), what the model says of it,
/// and the wake-ups it is owed.
struct Followed<'a> {
    w: Option<Waiting<'a>>,
    joined: u64,
    ticket: u64,
    shard: usize,
    seen: Seen,
    wakes: usize,
}

/// What the permits should do, written as plainly as possible.
#[derive(Default)]
struct Model {
    /// Waiters queued so far (a waiter's ticket is their count when it queued).
    tickets: u64,
    free: usize,
    owed: usize,
    closed: bool,
    held: usize,
    /// Every queued waiter, in order of arrival.
    queue: VecDeque<usize>,
    share: usize,
}

impl Model {
    /// A permit given back on `shard` (`None`: by no client): to the first waiter of that
    /// shard if at most a `share`th of those waiting queued between it and the first of
    /// all, else to the first of all.
    fn give_back(&mut self, shard: Option<usize>, waiters: &mut [Followed<'_>]) {
        let first = self.queue.front().map(|&i| waiters[i].ticket);
        let local = shard.and_then(|s| self.queue.iter().position(|&i| waiters[i].shard == s));
        let window = (self.queue.len() / self.share) as u64;
        let pick = match (first, local) {
            (Some(f), Some(at)) if waiters[self.queue[at]].ticket - f <= window => Some(at),
            (Some(_), _) => Some(0),
            (None, _) => None,
        };
        if self.owed > 0 {
            self.owed -= 1;
        } else if let Some(i) = pick.and_then(|at| self.queue.remove(at)) {
            waiters[i].seen = Seen::Granted;
            waiters[i].wakes += 1;
        } else {
            self.free += 1;
        }
    }
}

proptest! {
    /// Any sequence of takes, waits, abandoned waits, give-backs, shrinks, growths and a
    /// close: the permits do what a plain FIFO model does, wake exactly the waiters the
    /// model serves, and never lose or make up a permit.
    #[test]
    fn permits_follow_a_plain_model(
        start in 0..4usize,
        share in 1..5usize,
        ops in proptest::collection::vec(op(), 0..80),
    ) {
        let p = Permits::with_share(start, share);
        let mut m = Model { free: start, share, ..Model::default() };
        let mut waiters: Vec<Followed<'_>> = Vec::new();
        let mut joins = 0u64;
        for op in ops {
            match op {
                Op::TryAcquire => {
                    let can = !m.closed && m.queue.is_empty() && m.owed == 0 && m.free > 0;
                    prop_assert_eq!(p.try_acquire().map(|x| x.keep()).is_some(), can);
                    if can {
                        m.free -= 1;
                        m.held += 1;
                    }
                }
                Op::Join(shard) => {
                    let mut w = Waiting::on(&p, joins, shard);
                    joins += 1;
                    let got = w.poll();
                    if m.closed {
                        prop_assert_eq!(got, Some(false));
                    } else if m.queue.is_empty() && m.owed == 0 && m.free > 0 {
                        prop_assert_eq!(got, Some(true));
                        m.free -= 1;
                        m.held += 1;
                    } else {
                        prop_assert_eq!(got, None);
                        m.queue.push_back(waiters.len());
                        m.tickets += 1;
                        waiters.push(Followed {
                            w: Some(w),
                            joined: joins - 1,
                            ticket: m.tickets,
                            shard,
                            seen: Seen::Queued,
                            wakes: 0,
                        });
                    }
                }
                Op::Poll(i) => {
                    let Some(f) = waiters.get_mut(i) else { continue };
                    let Some(w) = f.w.as_mut() else { continue };
                    let got = w.outcome();
                    match f.seen {
                        Seen::Queued => prop_assert_eq!(&got, &Poll::Pending),
                        Seen::Granted => {
                            prop_assert_eq!(&got, &Poll::Ready(Ok(())));
                            m.held += 1;
                        }
                        Seen::Closed => prop_assert_eq!(&got, &Poll::Ready(Err(Refused::Closed))),
                        Seen::TimedOut => {
                            prop_assert_eq!(&got, &Poll::Ready(Err(Refused::TimedOut)))
                        }
                    }
                    if got.is_ready() {
                        f.w = None;
                    }
                }
                Op::Leave(i) => {
                    let Some(f) = waiters.get_mut(i) else { continue };
                    if f.w.take().is_none() {
                        continue;
                    }
                    match f.seen {
                        Seen::Queued => m.queue.retain(|&q| q != i),
                        // Passed on as if given back where the waiter was.
                        Seen::Granted => {
                            let shard = waiters[i].shard;
                            m.give_back(Some(shard), &mut waiters)
                        }
                        Seen::Closed | Seen::TimedOut => {}
                    }
                }
                Op::Release(shard) => {
                    if m.held > 0 {
                        m.held -= 1;
                        p.release_on(shard);
                        m.give_back(Some(shard), &mut waiters);
                    }
                }
                Op::Shrink(n) => {
                    p.shrink(n);
                    let take = m.free.min(n);
                    m.free -= take;
                    m.owed += n - take;
                }
                Op::Add(n) => {
                    p.add(n);
                    for _ in 0..n {
                        m.give_back(None, &mut waiters);
                    }
                }
                Op::Expire(now) => {
                    p.expire(now as u64);
                    // A waiter's deadline is its join's number.
                    for &i in &m.queue {
                        if waiters[i].joined < now as u64 {
                            waiters[i].seen = Seen::TimedOut;
                            waiters[i].wakes += 1;
                        }
                    }
                    m.queue.retain(|&i| waiters[i].joined >= now as u64);
                }
                Op::Close => {
                    p.close();
                    m.closed = true;
                    for i in m.queue.drain(..) {
                        waiters[i].seen = Seen::Closed;
                        waiters[i].wakes += 1;
                    }
                }
            }
            prop_assert_eq!(p.available(), m.free);
            for f in &waiters {
                if let Some(w) = &f.w {
                    prop_assert_eq!(w.wakes(), f.wakes);
                }
            }
        }
    }
}
