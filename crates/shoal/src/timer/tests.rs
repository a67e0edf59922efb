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
        assert_eq!(this_thread().expect("queue").live(), 0);
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
        assert_eq!(this_thread().expect("queue").live(), 0);
    });
}

#[test]
fn dropped_timers_are_swept_and_the_one_left_still_fires() {
    shard_runtime().block_on(async {
        install().expect("install");
        let queue = this_thread().expect("queue");
        let keep = sleep(Duration::from_millis(20));
        tokio::pin!(keep);
        std::future::poll_fn(|cx| {
            assert!(keep.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        // As pool waits do: each set, then dropped when the server comes first.
        for _ in 0..1_000 {
            let r = timeout(Duration::from_secs(60), async { 1 }).await;
            assert_eq!(r, Ok(1));
            let mut t = Box::pin(sleep(Duration::from_secs(60)));
            std::future::poll_fn(|cx| {
                assert!(t.as_mut().poll(cx).is_pending());
                Poll::Ready(())
            })
            .await;
        }
        {
            let s = queue.lock();
            assert!(
                s.heap.len() <= 2 * SWEEP_MIN + 2,
                "heap kept {}",
                s.heap.len()
            );
            assert!(s.slots.len() <= 2, "slots grew to {}", s.slots.len());
        }
        keep.await;
        assert_eq!(queue.live(), 0);
    });
}

#[test]
fn a_timer_first_polled_after_its_deadline_fires() {
    shard_runtime().block_on(async {
        install().expect("install");
        let s = sleep(Duration::from_millis(1));
        std::thread::sleep(Duration::from_millis(5));
        let started = Instant::now();
        s.await;
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(this_thread().expect("queue").live(), 0);
    });
}

#[test]
fn a_slot_reused_by_a_later_timer_is_not_fired_by_the_earlier_one() {
    shard_runtime().block_on(async {
        install().expect("install");
        let queue = this_thread().expect("queue");
        // The first timer's heap entry stays behind, stale, when it is dropped; the
        // second takes its slot with a later deadline and must not fire at the first's.
        let mut first = Box::pin(sleep(Duration::from_millis(5)));
        std::future::poll_fn(|cx| {
            assert!(first.as_mut().poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        drop(first);
        let started = Instant::now();
        sleep(Duration::from_millis(40)).await;
        assert!(started.elapsed() >= Duration::from_millis(40));
        assert_eq!(queue.live(), 0);
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
