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

use std::collections::BTreeMap;
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

struct State {
    /// Waiting timers by deadline (the id tells apart timers with the same deadline).
    waiting: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
    /// The deadline the timerfd is set for. Timers removed early leave it as it is: a wake-up
    /// for nothing only re-arms it.
    armed: Option<Instant>,
}

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
            waiting: BTreeMap::new(),
            next_id: 0,
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

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock is held leaves the queue consistent (every change is one
        // map operation): carry on with it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, deadline: Instant, waker: Waker) -> u64 {
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        s.waiting.insert((deadline, id), waker);
        if s.armed.is_none_or(|a| deadline < a) {
            self.arm(&mut s, deadline);
        }
        id
    }

    fn remove(&self, deadline: Instant, id: u64) {
        self.lock().waiting.remove(&(deadline, id));
    }

    fn update(&self, deadline: Instant, id: u64, waker: &Waker) {
        if let Some(w) = self.lock().waiting.get_mut(&(deadline, id)) {
            if !w.will_wake(waker) {
                w.clone_from(waker);
            }
        }
    }

    fn fire(&self) {
        let now = Instant::now();
        let mut due = Vec::new();
        {
            let mut s = self.lock();
            while let Some(entry) = s.waiting.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            s.armed = None;
            if let Some(&(next, _)) = s.waiting.first_key_value().map(|(k, _)| k) {
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
    id: Option<u64>,
}

impl OwnTimer {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            if let Some(id) = self.id.take() {
                self.queue.remove(self.deadline, id);
            }
            return Poll::Ready(());
        }
        match self.id {
            Some(id) => self.queue.update(self.deadline, id, cx.waker()),
            None => self.id = Some(self.queue.insert(self.deadline, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl Drop for OwnTimer {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.queue.remove(self.deadline, id);
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
                id: None,
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
mod tests {
    use super::*;

    /// A runtime like a shard's: I/O only, with this module's timers.
    fn shard_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime")
    }

    #[test]
    fn own_timers_fire_in_deadline_order_without_a_time_driver() {
        shard_runtime().block_on(async {
            install().expect("install");
            let order = Arc::new(Mutex::new(Vec::new()));
            let mut tasks = Vec::new();
            for (i, ms) in [(0u32, 60u64), (1, 20), (2, 40)] {
                let order = order.clone();
                // Deadlines taken here, microseconds apart, however late the tasks start.
                let s = sleep(Duration::from_millis(ms));
                assert!(matches!(s, Sleep::Own { .. }));
                tasks.push(tokio::spawn(async move {
                    s.await;
                    order.lock().expect("lock").push(i);
                }));
            }
            for t in tasks {
                t.await.expect("task");
            }
            assert_eq!(*order.lock().expect("lock"), vec![1, 2, 0]);
        });
    }

    #[test]
    fn a_timeout_ends_a_future_that_does_not_finish_and_spares_one_that_does() {
        shard_runtime().block_on(async {
            install().expect("install");
            let started = Instant::now();
            let r = timeout(Duration::from_millis(30), std::future::pending::<()>()).await;
            assert_eq!(r, Err(Elapsed));
            assert!(started.elapsed() >= Duration::from_millis(30));
            let r = timeout(Duration::from_secs(60), async { 7 }).await;
            assert_eq!(r, Ok(7));
            // The finished timeout's timer left the queue with it.
            let queue = this_thread().expect("queue");
            assert!(queue.lock().waiting.is_empty());
        });
    }

    #[test]
    fn a_dropped_earliest_timer_does_not_hold_back_the_next() {
        shard_runtime().block_on(async {
            install().expect("install");
            let early = timeout(Duration::from_millis(10), std::future::pending::<()>());
            let late = sleep(Duration::from_millis(40));
            tokio::pin!(late);
            // Registers both, then drops the earliest before it fires.
            let mut early = Box::pin(early);
            std::future::poll_fn(|cx| {
                let _ = early.as_mut().poll(cx);
                let _ = late.as_mut().poll(cx);
                Poll::Ready(())
            })
            .await;
            drop(early);
            late.await;
            assert!(this_thread().expect("queue").lock().waiting.is_empty());
        });
    }

    #[test]
    fn an_interval_ticks_once_per_period() {
        shard_runtime().block_on(async {
            install().expect("install");
            let started = Instant::now();
            let mut i = interval(Duration::from_millis(15));
            for _ in 0..3 {
                i.tick().await;
            }
            assert!(started.elapsed() >= Duration::from_millis(45));
        });
    }

    #[tokio::test]
    async fn without_a_queue_the_timers_are_tokios() {
        assert!(matches!(
            sleep(Duration::from_millis(1)),
            Sleep::Tokio { .. }
        ));
        let r = timeout(Duration::from_millis(5), std::future::pending::<()>()).await;
        assert_eq!(r, Err(Elapsed));
    }
}
