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

/// A counting semaphore, fair to its waiters. See the module doc.
pub(super) struct Permits {
    /// The free permits times [`ONE`], plus [`SLOW`]. Invariants, under the lock: a queue,
    /// a debt or closing sets `SLOW`; while it is set, only lock holders change the count,
    /// and the count is zero while anyone queues (a release hands its permit on).
    state: AtomicUsize,
    queue: Mutex<Queue>,
}

/// The waiters, in order, and what else the lock guards.
#[derive(Default)]
struct Queue {
    /// Waiters by slot (a slot is reused once its waiter is done with it).
    slots: Vec<Waiter>,
    free: Vec<usize>,
    /// Slots of queued waiters, first come first.
    order: VecDeque<usize>,
    /// Permits a shrink still takes back as they are given back.
    owed: usize,
    closed: bool,
}

enum Waiter {
    Vacant,
    /// Waiting; `deadline` in [`crate::clock::mono_us`] microseconds.
    Queued {
        waker: Waker,
        deadline: u64,
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
        Permits {
            state: AtomicUsize::new(n * ONE),
            queue: Mutex::default(),
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
        Acquire {
            permits: self,
            deadline,
            slot: None,
        }
    }

    /// Ends the waits whose deadline is before `now`: they are told [`Refused::TimedOut`].
    /// Waiters queue in arrival order with deadlines a fixed time after, so only the front
    /// of the queue is looked at. Nobody queueing, this is one atomic load.
    pub(super) fn expire(&self, now: u64) {
        if self.state.load(Ordering::Acquire) & SLOW == 0 {
            return;
        }
        let mut wakers = Vec::new();
        {
            let mut q = self.lock();
            while let Some(&slot) = q.order.front() {
                match &q.slots[slot] {
                    Waiter::Queued { deadline, .. } if *deadline < now => {}
                    _ => break,
                }
                q.order.pop_front();
                if let Waiter::Queued { waker, .. } =
                    std::mem::replace(&mut q.slots[slot], Waiter::TimedOut)
                {
                    wakers.push(waker);
                }
            }
            self.settle(&q);
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Gives a permit back: to the first waiter, to a shrink that is owed one, or free.
    pub(super) fn release(&self) {
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            if s & SLOW != 0 {
                let waker = self.release_locked(&mut self.lock());
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
                wakers.extend(self.release_locked(&mut q));
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
            while let Some(slot) = q.order.pop_front() {
                if let Waiter::Queued { waker, .. } =
                    std::mem::replace(&mut q.slots[slot], Waiter::Closed)
                {
                    wakers.push(waker);
                }
            }
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The queue's state is whole between statements, so a panic elsewhere leaves it usable.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A permit given back, under the lock (`SLOW` set): the waker of the waiter it went to.
    fn release_locked(&self, q: &mut Queue) -> Option<Waker> {
        let mut woken = None;
        if q.owed > 0 {
            q.owed -= 1;
        } else if let Some(slot) = q.order.pop_front() {
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
        if q.order.is_empty() && q.owed == 0 && !q.closed {
            self.state.fetch_and(!SLOW, Ordering::AcqRel);
        }
    }
}

/// The future of [`Permits::acquire`].
pub(super) struct Acquire<'a> {
    permits: &'a Permits,
    deadline: u64,
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
            return match permits.join(&mut permits.lock(), cx.waker(), self.deadline) {
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
    fn join(&self, q: &mut Queue, waker: &Waker, deadline: u64) -> Result<Option<usize>, Refused> {
        if q.closed {
            return Err(Refused::Closed);
        }
        if q.order.is_empty() {
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
        };
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
        q.order.push_back(slot);
        Ok(Some(slot))
    }
}

impl Queue {
    fn vacate(&mut self, slot: usize) {
        self.slots[slot] = Waiter::Vacant;
        self.free.push(slot);
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
            Waiter::Queued { .. } => {
                if let Some(i) = q.order.iter().position(|&s| s == slot) {
                    q.order.remove(i);
                }
                q.vacate(slot);
                permits.settle(&q);
                None
            }
            // Given a permit it never saw (a timeout or a cancel came first): pass it on.
            Waiter::Granted => {
                q.vacate(slot);
                permits.release_locked(&mut q)
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
