//! Timers for the data plane's shard threads, whose runtimes run without tokio's time driver.
//!
//! tokio's time driver does its work at every park of a runtime, whether or not a timer is
//! due: it reads the clock, walks its timer wheel and processes it, about 600 instructions a
//! park. A shard parks once or twice per transaction at low concurrency and about once per
//! statement in a busy TPC-B-like transaction, so the driver alone was 4-13 % of Shoal's
//! user-space work per transaction (docs/benchmarks.md). The data plane's timers are few and
//! coarse (login, connect and reset timeouts, the idle-client limit, a pool wait, the pools'
//! reapers): on a shard thread they live here instead, in a per-thread queue ordered by
//! deadline, with one `timerfd` armed for the earliest that epoll watches along with the
//! sockets. A park then costs nothing for timers, and a timer costs its insertion and removal
//! (a system call only when it becomes the earliest).
//!
//! Anywhere else (the control thread, the multi-threaded runtime, tests' runtimes) the same
//! calls are tokio's own timers, so code using them runs on either kind of thread.
// Off the shards these are tokio's own timers (see the module doc).
#![allow(clippy::disallowed_methods)]

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// One shard thread's timers.
struct Queue {
    state: Mutex<State>,
    fd: TimerFd,
}

/// Waiting timers: a min-heap of deadlines over a slab of slots. Most timers never fire (a
/// pool wait or a login ends first, and its timer is dropped), so a removal only frees the
/// slot and leaves its heap entry behind, stale, to be skipped when it comes to the top or
/// swept out once stale entries outnumber live ones. Timers of one duration are created in
/// deadline order, so an insertion usually stops at its first comparison. (An ordered map
/// cost ~560 instructions for each timer set and dropped, node allocations and rebalancing
/// included; this costs ~230: docs/benchmark-notes.md, "the wait for a server".)
struct State {
    heap: BinaryHeap<Reverse<Entry>>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Heap entries whose timer is gone.
    stale: usize,
    /// The deadline the timerfd is set for. Timers removed early leave it as it is: a wake-up
    /// for nothing only re-arms it.
    armed: Option<Instant>,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    deadline: Instant,
    slot: u32,
    generation: u32,
}

/// A timer's place in the queue; `generation` tells its timer from the slot's later ones.
#[derive(Default)]
struct Slot {
    waker: Option<Waker>,
    generation: u32,
    fired: bool,
}

/// Which slot a registered timer holds.
#[derive(Clone, Copy)]
struct Key {
    slot: u32,
    generation: u32,
}

/// Below this many, stale entries are not worth a sweep.
const SWEEP_MIN: usize = 64;

thread_local! {
    static QUEUE: std::cell::RefCell<Option<Arc<Queue>>> = const { std::cell::RefCell::new(None) };
}

/// Gives this thread its own timers; called once, inside the thread's runtime (a shard's,
/// built without tokio's time driver), whose reactor then watches the timerfd.
pub fn install() -> std::io::Result<()> {
    let fd = TimerFd::new(
        ClockId::CLOCK_MONOTONIC,
        TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
    )?;
    let queue = Arc::new(Queue {
        state: Mutex::new(State {
            heap: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            stale: 0,
            armed: None,
        }),
        fd,
    });
    // Deprecated in favour of an `unsafe` twin, because the reactor cannot know that an
    // arbitrary `AsRawFd` keeps its descriptor open. `QueueFd` does: it owns the timerfd
    // (through the queue) for as long as the reactor holds it.
    #[allow(deprecated)]
    let watched = AsyncFd::with_interest(QueueFd(queue.clone()), Interest::READABLE)?;
    QUEUE.with(|q| *q.borrow_mut() = Some(queue));
    tokio::spawn(drive(watched));
    Ok(())
}

fn this_thread() -> Option<Arc<Queue>> {
    QUEUE.with(|q| q.borrow().clone())
}

/// The timerfd of a queue, for the reactor.
struct QueueFd(Arc<Queue>);

impl AsRawFd for QueueFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.fd.as_fd().as_raw_fd()
    }
}

/// Wakes the timers that are due each time the timerfd expires, and arms it for the next.
async fn drive(watched: AsyncFd<QueueFd>) {
    loop {
        let Ok(mut guard) = watched.readable().await else {
            tracing::error!("timer queue: the reactor dropped its timerfd; timers stop");
            return;
        };
        // Reading the expiration count re-arms the descriptor; "would block" (a stale
        // wake-up) clears readiness. Either way firing is safe: it wakes only what is due.
        let _ = guard.try_io(|fd| fd.get_ref().0.fd.wait().map_err(std::io::Error::from));
        watched.get_ref().0.fire();
    }
}

/// Whether a heap entry's timer still waits (its slot not freed or reused, not fired).
fn is_live(slots: &[Slot], e: &Entry) -> bool {
    let s = &slots[e.slot as usize];
    s.generation == e.generation && !s.fired
}

impl State {
    /// The earliest live deadline, stale entries above it dropped on the way.
    fn next(&mut self) -> Option<Instant> {
        while let Some(Reverse(top)) = self.heap.peek() {
            if is_live(&self.slots, top) {
                return Some(top.deadline);
            }
            self.heap.pop();
            self.stale -= 1;
        }
        None
    }

    /// Frees a timer's slot; its heap entry, if still there, turns stale.
    fn release(&mut self, key: Key) {
        let slot = &mut self.slots[key.slot as usize];
        if slot.generation != key.generation {
            return;
        }
        if !slot.fired {
            self.stale += 1;
        }
        slot.generation = slot.generation.wrapping_add(1);
        slot.fired = false;
        slot.waker = None;
        self.free.push(key.slot);
        if self.stale > SWEEP_MIN && self.stale > self.heap.len() / 2 {
            let slots = &self.slots;
            self.heap.retain(|Reverse(e)| is_live(slots, e));
            self.stale = 0;
        }
    }
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held leaves the queue consistent enough to go on (at
        // worst a timer fires late or a slot is lost): carry on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, deadline: Instant, waker: Waker) -> Key {
        let mut s = self.lock();
        let slot = match s.free.pop() {
            Some(i) => i,
            None => {
                s.slots.push(Slot::default());
                (s.slots.len() - 1) as u32
            }
        };
        let generation = {
            let entry = &mut s.slots[slot as usize];
            entry.waker = Some(waker);
            entry.generation
        };
        s.heap.push(Reverse(Entry {
            deadline,
            slot,
            generation,
        }));
        if s.armed.is_none_or(|a| deadline < a) {
            self.arm(&mut s, deadline);
        }
        Key { slot, generation }
    }

    fn remove(&self, key: Key) {
        self.lock().release(key);
    }

    /// Whether the timer fired (its slot is then freed); if not, `waker` is the one it wakes.
    fn fired_or_update(&self, key: Key, waker: &Waker) -> bool {
        let mut s = self.lock();
        let slot = &mut s.slots[key.slot as usize];
        if slot.generation != key.generation {
            return true;
        }
        if slot.fired {
            s.release(key);
            return true;
        }
        match &mut slot.waker {
            Some(w) if w.will_wake(waker) => {}
            w => *w = Some(waker.clone()),
        }
        false
    }

    /// Timers in the queue (set, not yet fired or dropped).
    #[cfg(test)]
    fn live(&self) -> usize {
        let s = self.lock();
        s.slots.len() - s.free.len()
    }

    fn fire(&self) {
        let now = Instant::now();
        let mut due = Vec::new();
        {
            let mut s = self.lock();
            while let Some(Reverse(top)) = s.heap.peek() {
                if top.deadline > now {
                    break;
                }
                let Some(Reverse(e)) = s.heap.pop() else {
                    break;
                };
                if is_live(&s.slots, &e) {
                    let slot = &mut s.slots[e.slot as usize];
                    slot.fired = true;
                    due.extend(slot.waker.take());
                } else {
                    s.stale -= 1;
                }
            }
            s.armed = None;
            if let Some(next) = s.next() {
                self.arm(&mut s, next);
            }
        }
        for w in due {
            w.wake();
        }
    }

    fn arm(&self, s: &mut State, deadline: Instant) {
        // A zero expiration would disarm the timer: at least a microsecond.
        let after = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_micros(1));
        match self.fd.set(
            Expiration::OneShot(TimeSpec::from(after)),
            TimerSetTimeFlags::empty(),
        ) {
            Ok(()) => s.armed = Some(deadline),
            Err(e) => tracing::error!(error = %e, "timer queue: cannot arm the timerfd"),
        }
    }
}

/// A timer in a shard's queue, removed from it when dropped.
struct OwnTimer {
    deadline: Instant,
    queue: Arc<Queue>,
    state: TimerState,
}

#[derive(Clone, Copy)]
enum TimerState {
    /// Not polled yet: not in the queue.
    New,
    Waiting(Key),
    Fired,
}

impl OwnTimer {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // No clock is read here: a timer that is due fires through the timerfd (at once if
        // its deadline passed before it was first polled), and its slot says so.
        match self.state {
            TimerState::New => {
                let key = self.queue.insert(self.deadline, cx.waker().clone());
                self.state = TimerState::Waiting(key);
                Poll::Pending
            }
            TimerState::Waiting(key) => {
                if self.queue.fired_or_update(key, cx.waker()) {
                    self.state = TimerState::Fired;
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }
            TimerState::Fired => Poll::Ready(()),
        }
    }
}

impl Drop for OwnTimer {
    fn drop(&mut self) {
        if let TimerState::Waiting(key) = self.state {
            self.queue.remove(key);
        }
    }
}

pin_project_lite::pin_project! {
    /// A future that completes after a duration (see [`sleep`]).
    #[project = SleepProj]
    pub enum Sleep {
        Own { timer: OwnTimer },
        Tokio { #[pin] sleep: tokio::time::Sleep },
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project() {
            SleepProj::Own { timer } => timer.poll(cx),
            SleepProj::Tokio { sleep } => sleep.poll(cx),
        }
    }
}

/// Completes after `d`: on this thread's own queue when it has one, else as tokio's sleep.
pub fn sleep(d: Duration) -> Sleep {
    match this_thread() {
        Some(queue) => Sleep::Own {
            timer: OwnTimer {
                deadline: Instant::now() + d,
                queue,
                state: TimerState::New,
            },
        },
        None => Sleep::Tokio {
            sleep: tokio::time::sleep(d),
        },
    }
}

/// The future given to [`timeout`] did not finish in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

impl std::fmt::Display for Elapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("deadline has elapsed")
    }
}

impl std::error::Error for Elapsed {}

pin_project_lite::pin_project! {
    /// A future bounded in time (see [`timeout`]).
    pub struct Timeout<F> {
        #[pin]
        future: F,
        #[pin]
        sleep: Sleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(v) = this.future.poll(cx) {
            return Poll::Ready(Ok(v));
        }
        this.sleep.poll(cx).map(|()| Err(Elapsed))
    }
}

/// Runs `future` for at most `d` (as tokio's `timeout`, on whichever timers this thread has).
pub fn timeout<F: std::future::IntoFuture>(d: Duration, future: F) -> Timeout<F::IntoFuture> {
    Timeout {
        future: future.into_future(),
        sleep: sleep(d),
    }
}

/// Ticks every `period`, the first time after `period`; a late tick delays the ones after it
/// (tokio's `MissedTickBehavior::Delay`).
pub struct Interval {
    period: Duration,
    inner: IntervalInner,
}

enum IntervalInner {
    Own { next: Instant },
    Tokio(tokio::time::Interval),
}

pub fn interval(period: Duration) -> Interval {
    let inner = if this_thread().is_some() {
        IntervalInner::Own {
            next: Instant::now() + period,
        }
    } else {
        let mut i = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        IntervalInner::Tokio(i)
    };
    Interval { period, inner }
}

impl Interval {
    pub async fn tick(&mut self) {
        match &mut self.inner {
            IntervalInner::Own { next } => {
                let wait = next.saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    sleep(wait).await;
                }
                *next = Instant::now() + self.period;
            }
            IntervalInner::Tokio(i) => {
                i.tick().await;
            }
        }
    }
}

#[cfg(test)]
mod tests;
