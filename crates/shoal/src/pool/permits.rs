//! The pool's permits: at most `pool_size` clients hold a server at once, and those that wait
//! are served first come, first served.
//!
//! tokio's semaphore does this too, but every release takes its waiters' lock, whether or not
//! anyone waits, and an owned permit keeps an `Arc` of the semaphore of its own. Here, while
//! nobody waits (a pool below its size: the common case), a permit is taken and given back
//! with one compare-and-swap each, and a lease gives its permit back through the pool it
//! already holds. The lock is taken only while clients queue, a shrink is owed permits, or
//! the permits are closed; a release then hands its permit straight to the first waiter, so a
//! client arriving meanwhile cannot take it ahead of the queue. (~350 instructions less per
//! transaction that waits: docs/benchmark-notes.md, "the wait for a server".)
//!
//! On the per-core data plane a permit given back goes to the first waiter *of the shard
//! giving it back*, unless that waiter came too long after the first waiter anywhere: more
//! than a [`SHARD_SHARE`]th of the clients now waiting joined the queue between the two. The
//! server that client held went back to this shard's idle list, so a waiter here takes it
//! where it is: no cross-thread wake-up of another shard, no move of the server's socket to
//! another reactor (two `epoll_ctl`). Strictly first come, first served across shards, nearly
//! every wait paid both once several shards were open. The bound scales with the queue, so
//! a waiter is passed over for at most about that share of its wait; a fixed one either gave
//! up most of the saving (1-5 ms) or let the tail grow (docs/benchmark-notes.md).
//!
//! A waiter's deadline lives in the queue too: [`Permits::expire`], called by the pool's
//! upkeep on a tick, ends the waits past theirs. A timer per wait, set and dropped again in
//! nearly every wait (the server comes first), cost ~300 instructions a wait; the price is
//! that a wait ends up to one tick after its deadline.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

/// In `Permits::state`: every change goes through the lock (clients queue, a shrink is owed
/// permits, or the permits are closed).
const SLOW: usize = 1;
/// One free permit in `Permits::state`.
const ONE: usize = 2;

/// A waiter on the releasing shard is served before the first waiter anywhere if fewer than
/// a `SHARD_SHARE`th of the clients waiting joined between the two (see the module doc).
pub(super) const SHARD_SHARE: usize = 4;

/// A counting semaphore, fair to its waiters. See the module doc.
pub(super) struct Permits {
    /// The free permits times [`ONE`], plus [`SLOW`]. Invariants, under the lock: a queue,
    /// a debt or closing sets `SLOW`; while it is set, only lock holders change the count,
    /// and the count is zero while anyone queues (a release hands its permit on).
    state: AtomicUsize,
    queue: Mutex<Queue>,
    /// [`SHARD_SHARE`] (tests choose others).
    share: usize,
}

/// The waiters, in order, and what else the lock guards.
#[derive(Default)]
struct Queue {
    /// Waiters by slot (a slot is reused once its waiter is done with it).
    slots: Vec<Waiter>,
    free: Vec<usize>,
    /// Slots of queued waiters by the shard they wait on, each line first come first.
    lines: Vec<VecDeque<usize>>,
    /// Waiters in all lines.
    queued: usize,
    /// The next waiter's place in the order of arrival, across lines.
    tickets: u64,
    /// Permits a shrink still takes back as they are given back.
    owed: usize,
    closed: bool,
}

enum Waiter {
    Vacant,
    /// Waiting in line `shard`; `deadline` in [`crate::clock::mono_us`] microseconds,
    /// `ticket` its place in the order of arrival.
    Queued {
        waker: Waker,
        deadline: u64,
        ticket: u64,
        shard: usize,
    },
    Granted,
    TimedOut,
    Closed,
}

/// Why an acquire ended without a permit.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refused {
    /// Its deadline passed first (see [`Permits::expire`]).
    TimedOut,
    /// The permits were closed (the pool ended).
    Closed,
}

/// A permit taken; given back when dropped, unless [`Permit::keep`] hands it to its holder.
#[must_use]
pub(super) struct Permit<'a>(&'a Permits);

impl Permit<'_> {
    /// The permit is the holder's from now on, to give back with [`Permits::release`].
    pub(super) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Permits {
    pub(super) fn new(n: usize) -> Self {
        Self::with_share(n, SHARD_SHARE)
    }

    /// `n` permits, a waiter of the releasing shard served first when fewer than a
    /// `share`th of those waiting joined between it and the first waiter anywhere.
    pub(super) fn with_share(n: usize, share: usize) -> Self {
        Permits {
            state: AtomicUsize::new(n * ONE),
            queue: Mutex::default(),
            share: share.max(1),
        }
    }

    /// Free permits now.
    pub(super) fn available(&self) -> usize {
        self.state.load(Ordering::Relaxed) / ONE
    }

    /// A permit if one is free and nobody queues for one.
    pub(super) fn try_acquire(&self) -> Option<Permit<'_>> {
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            if s & SLOW != 0 || s < ONE {
                return None;
            }
            match self
                .state
                .compare_exchange_weak(s, s - ONE, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Some(Permit(self)),
                Err(now) => s = now,
            }
        }
    }

    /// Waits in line for a permit until `deadline` ([`crate::clock::mono_us`]; enforced by
    /// [`Permits::expire`]). Dropping the future leaves the line (or passes on a permit it
    /// was given and did not see).
    pub(super) fn acquire(&self, deadline: u64) -> Acquire<'_> {
        self.acquire_on(deadline, crate::shard::current())
    }

    /// [`Permits::acquire`] for a waiter on `shard`.
    pub(super) fn acquire_on(&self, deadline: u64, shard: usize) -> Acquire<'_> {
        Acquire {
            permits: self,
            deadline,
            shard,
            slot: None,
        }
    }

    /// Ends the waits whose deadline is before `now`: they are told [`Refused::TimedOut`].
    /// Each line holds its waiters in arrival order with deadlines a fixed time after, so
    /// only the fronts are looked at. Nobody queueing, this is one atomic load.
    pub(super) fn expire(&self, now: u64) {
        if self.state.load(Ordering::Acquire) & SLOW == 0 {
            return;
        }
        let mut wakers = Vec::new();
        {
            let mut guard = self.lock();
            let q = &mut *guard;
            for line in q.lines.iter_mut() {
                while let Some(&slot) = line.front() {
                    match &q.slots[slot] {
                        Waiter::Queued { deadline, .. } if *deadline < now => {}
                        _ => break,
                    }
                    line.pop_front();
                    q.queued -= 1;
                    if let Waiter::Queued { waker, .. } =
                        std::mem::replace(&mut q.slots[slot], Waiter::TimedOut)
                    {
                        wakers.push(waker);
                    }
                }
            }
            self.settle(q);
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Gives a permit back: to a waiter (see the module doc for which), to a shrink that is
    /// owed one, or free.
    pub(super) fn release(&self) {
        self.release_on(crate::shard::current())
    }

    /// [`Permits::release`] on `shard`.
    pub(super) fn release_on(&self, shard: usize) {
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            if s & SLOW != 0 {
                let waker = self.release_locked(&mut self.lock(), Some(shard));
                if let Some(w) = waker {
                    w.wake();
                }
                return;
            }
            match self
                .state
                .compare_exchange_weak(s, s + ONE, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => s = now,
            }
        }
    }

    /// `n` more permits (a pool grown): first what a shrink is still owed, then to the
    /// waiters in order, the rest free.
    pub(super) fn add(&self, n: usize) {
        let mut wakers = Vec::new();
        {
            let mut q = self.lock();
            // Every change goes through the lock meanwhile, so the count read below holds.
            self.state.fetch_or(SLOW, Ordering::AcqRel);
            for _ in 0..n {
                wakers.extend(self.release_locked(&mut q, None));
            }
            self.settle(&q);
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    /// `n` permits fewer (a pool shrunk): free ones at once, the rest as they are given back.
    pub(super) fn shrink(&self, n: usize) {
        let mut q = self.lock();
        let s = self.state.fetch_or(SLOW, Ordering::AcqRel);
        let take = (s / ONE).min(n);
        self.state.fetch_sub(take * ONE, Ordering::AcqRel);
        q.owed += n - take;
        self.settle(&q);
    }

    /// No more permits for anyone: waiters are told [`Refused::Closed`] at once, and so is
    /// every later acquire. Permits held now are given back as usual.
    pub(super) fn close(&self) {
        let mut wakers = Vec::new();
        {
            let mut q = self.lock();
            q.closed = true;
            self.state.fetch_or(SLOW, Ordering::AcqRel);
            let lines = std::mem::take(&mut q.lines);
            for slot in lines.into_iter().flatten() {
                if let Waiter::Queued { waker, .. } =
                    std::mem::replace(&mut q.slots[slot], Waiter::Closed)
                {
                    wakers.push(waker);
                }
            }
            q.queued = 0;
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The queue's state is whole between statements, so a panic elsewhere leaves it usable.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A permit given back on `shard` (`None`: by no client, the first waiter anywhere gets
    /// it), under the lock (`SLOW` set): the waker of the waiter it went to.
    fn release_locked(&self, q: &mut Queue, shard: Option<usize>) -> Option<Waker> {
        let mut woken = None;
        if q.owed > 0 {
            q.owed -= 1;
        } else if let Some(slot) = q.next(shard, self.share) {
            if let Waiter::Queued { waker, .. } =
                std::mem::replace(&mut q.slots[slot], Waiter::Granted)
            {
                woken = Some(waker);
            }
        } else {
            self.state.fetch_add(ONE, Ordering::AcqRel);
        }
        self.settle(q);
        woken
    }

    /// Clears `SLOW` once nothing needs the lock any more.
    fn settle(&self, q: &Queue) {
        if q.queued == 0 && q.owed == 0 && !q.closed {
            self.state.fetch_and(!SLOW, Ordering::AcqRel);
        }
    }
}

/// The future of [`Permits::acquire`].
pub(super) struct Acquire<'a> {
    permits: &'a Permits,
    deadline: u64,
    /// The line it waits in.
    shard: usize,
    /// Its place in the queue, once it queues.
    slot: Option<usize>,
}

impl<'a> Future for Acquire<'a> {
    type Output = Result<Permit<'a>, Refused>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let permits = self.permits;
        let Some(slot) = self.slot else {
            if let Some(p) = permits.try_acquire() {
                return Poll::Ready(Ok(p));
            }
            return match permits.join(&mut permits.lock(), cx.waker(), self.deadline, self.shard) {
                Ok(None) => Poll::Ready(Ok(Permit(permits))),
                Ok(Some(slot)) => {
                    self.slot = Some(slot);
                    Poll::Pending
                }
                Err(refused) => Poll::Ready(Err(refused)),
            };
        };
        let mut q = permits.lock();
        let outcome = match &mut q.slots[slot] {
            Waiter::Queued { waker, .. } => {
                if !waker.will_wake(cx.waker()) {
                    waker.clone_from(cx.waker());
                }
                return Poll::Pending;
            }
            Waiter::Granted => Ok(Permit(permits)),
            Waiter::TimedOut => Err(Refused::TimedOut),
            Waiter::Closed => Err(Refused::Closed),
            Waiter::Vacant => unreachable!("a waiter's slot is vacated only by the waiter"),
        };
        q.vacate(slot);
        drop(q);
        self.slot = None;
        Poll::Ready(outcome)
    }
}

impl Permits {
    /// The first poll of an acquire, under the lock: a free permit if nobody queues, else a
    /// place at the end of the queue.
    fn join(
        &self,
        q: &mut Queue,
        waker: &Waker,
        deadline: u64,
        shard: usize,
    ) -> Result<Option<usize>, Refused> {
        if q.closed {
            return Err(Refused::Closed);
        }
        if q.queued == 0 {
            // Nobody queues, so `SLOW` is clear (or set only for a debt, with no free
            // permits): take a free permit, or set `SLOW` seeing none, in one step, so a
            // release cannot slip in between unseen.
            let mut s = self.state.load(Ordering::Relaxed);
            loop {
                let next = if s & SLOW == 0 && s >= ONE {
                    s - ONE
                } else {
                    s | SLOW
                };
                match self
                    .state
                    .compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Relaxed)
                {
                    Ok(_) if next < s => return Ok(None),
                    Ok(_) => break,
                    Err(now) => s = now,
                }
            }
        }
        let entry = Waiter::Queued {
            waker: waker.clone(),
            deadline,
            ticket: q.tickets,
            shard,
        };
        q.tickets += 1;
        let slot = match q.free.pop() {
            Some(slot) => {
                q.slots[slot] = entry;
                slot
            }
            None => {
                q.slots.push(entry);
                q.slots.len() - 1
            }
        };
        if q.lines.len() <= shard {
            q.lines.resize_with(shard + 1, VecDeque::new);
        }
        q.lines[shard].push_back(slot);
        q.queued += 1;
        Ok(Some(slot))
    }
}

impl Queue {
    fn vacate(&mut self, slot: usize) {
        self.slots[slot] = Waiter::Vacant;
        self.free.push(slot);
    }

    /// Takes out of its line the waiter a permit given back on `shard` goes to: the first
    /// of that shard's line if fewer than a `share`th of those waiting joined between it
    /// and the first waiter anywhere, else the first anywhere.
    fn next(&mut self, shard: Option<usize>, share: usize) -> Option<usize> {
        if self.queued == 0 {
            return None;
        }
        let (mut first, mut first_ticket) = (0, u64::MAX);
        for (i, line) in self.lines.iter().enumerate() {
            if let Some(&slot) = line.front() {
                let ticket = self.slots[slot].ticket();
                if ticket < first_ticket {
                    (first, first_ticket) = (i, ticket);
                }
            }
        }
        let window = (self.queued / share) as u64;
        let line = match shard.and_then(|s| Some((s, *self.lines.get(s)?.front()?))) {
            Some((s, slot)) if self.slots[slot].ticket() - first_ticket <= window => s,
            _ => first,
        };
        self.queued -= 1;
        self.lines[line].pop_front()
    }
}

impl Waiter {
    /// A queued waiter's place in the order of arrival.
    fn ticket(&self) -> u64 {
        match self {
            Waiter::Queued { ticket, .. } => *ticket,
            _ => unreachable!("only queued waiters stand in a line"),
        }
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let Some(slot) = self.slot else {
            return;
        };
        let permits = self.permits;
        let mut q = permits.lock();
        let waker = match q.slots[slot] {
            Waiter::Queued { shard, .. } => {
                let line = &mut q.lines[shard];
                if let Some(i) = line.iter().position(|&s| s == slot) {
                    line.remove(i);
                    q.queued -= 1;
                }
                q.vacate(slot);
                permits.settle(&q);
                None
            }
            // Given a permit it never saw (a timeout or a cancel came first): pass it on.
            Waiter::Granted => {
                q.vacate(slot);
                permits.release_locked(&mut q, Some(self.shard))
            }
            Waiter::TimedOut | Waiter::Closed | Waiter::Vacant => {
                q.vacate(slot);
                None
            }
        };
        drop(q);
        if let Some(w) = waker {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests;
