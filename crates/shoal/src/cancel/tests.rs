use super::*;
use std::sync::atomic::{AtomicU32, Ordering};

#[test]
fn made_process_ids_carry_the_node_slot() {
    let registry = Arc::new(CancelRegistry::default());
    let plain = registry.register(None, ClientInfo::default());
    assert!(plain.process_id() >= MADE);
    for slot in [0, 1, 77, MAX_SLOT] {
        registry.set_node_slot(slot);
        for _ in 0..100 {
            let r = registry.register(None, ClientInfo::default());
            assert!(r.process_id() > 0);
            assert_eq!(node_slot(r.process_id()), Some(slot));
        }
    }
    // A real server's process id (session mode) names no node.
    let real = registry.register(Some(4242), ClientInfo::default());
    assert_eq!(node_slot(real.process_id()), None);
}

#[test]
fn a_resumed_client_takes_over_its_own_key_from_a_session_still_ending() {
    let registry = Arc::new(CancelRegistry::default());
    let old = registry
        .register_exact(77, 1234, ClientInfo::default())
        .unwrap();
    assert!(
        registry
            .register_exact(77, 999, ClientInfo::default())
            .is_none(),
        "another secret: another client's key"
    );
    let new = registry
        .register_exact(77, 1234, ClientInfo::default())
        .expect("the same client");
    drop(old);
    let slot = registry.find(77, 1234).expect("still registered");
    assert!(Arc::ptr_eq(&slot, &new.slot), "the new session's");
}

/// Every connected client holds one slot: with its reference counts it must fit the
/// allocator's 128-byte size class (the next is 160).
#[test]
fn a_slot_fits_in_128_bytes() {
    assert!(2 * std::mem::size_of::<usize>() + std::mem::size_of::<CancelSlot>() <= 128);
}

/// A cancel that arrives while the client's server is being found is not sent to that
/// server (it would race the request there): `set` reports it, and names no server.
#[tokio::test]
async fn a_cancel_before_the_server_is_named_cancels_the_request_not_the_server() {
    let registry = Arc::new(CancelRegistry::default());
    let reg = registry.register(None, ClientInfo::default());
    let target = CancelTarget::new("127.0.0.1:9".parse().unwrap(), 7, 9);
    reg.slot.mark_busy();
    // The cancel arrives while the request has no server yet: remembered, not sent.
    registry.cancel(reg.process_id(), reg.secret_key()).await;
    assert!(!reg.slot.set(target), "the request is reported cancelled");
    assert_eq!(
        reg.slot.state(),
        "idle",
        "no server named for a cancelled request"
    );
    // A cancel after the request ended is for no request: ignored.
    registry.cancel(reg.process_id(), reg.secret_key()).await;
    // The next request is not affected by either cancel.
    reg.slot.mark_busy();
    assert!(reg.slot.set(target));
    assert_eq!(reg.slot.state(), "active");
    reg.slot.clear().await;
}

/// A cancel that ends a wait for a server which the wait nonetheless ends with (both
/// came at once) still cancels the request: it is not sent to that server.
#[tokio::test]
async fn a_cancel_that_crosses_a_server_arriving_still_cancels() {
    let registry = Arc::new(CancelRegistry::default());
    let reg = registry.register(None, ClientInfo::default());
    reg.slot.mark_busy();
    // The wait ended with a server: the signal is never looked at.
    let _unlooked = reg.slot.begin_wait();
    registry.cancel(reg.process_id(), reg.secret_key()).await;
    reg.slot.end_wait();
    let target = CancelTarget::new("127.0.0.1:9".parse().unwrap(), 7, 9);
    assert!(!reg.slot.set(target), "the request is reported cancelled");
    // A cancel that did end the wait leaves nothing behind for the next request.
    reg.slot.mark_busy();
    let cancelled = reg.slot.begin_wait();
    registry.cancel(reg.process_id(), reg.secret_key()).await;
    crate::timer::timeout(Duration::from_secs(5), cancelled)
        .await
        .expect("the wait was told");
    reg.slot.end_wait();
    reg.slot.not_busy();
    reg.slot.mark_busy();
    assert!(reg.slot.set(target), "the next request runs");
    reg.slot.clear().await;
}

/// A wait already asleep (its waker in the slot) is woken by the cancel, from another
/// task, and the slot keeps no waker once the wait ends.
#[tokio::test]
async fn a_cancel_wakes_a_sleeping_wait_for_a_server() {
    let registry = Arc::new(CancelRegistry::default());
    let reg = registry.register(None, ClientInfo::default());
    reg.slot.mark_busy();
    let slot = reg.slot.clone();
    let (asleep_tx, asleep) = tokio::sync::oneshot::channel();
    let waiter = tokio::spawn(async move {
        let mut wait = Box::pin(slot.begin_wait());
        let mut asleep_tx = Some(asleep_tx);
        std::future::poll_fn(|cx| {
            let r = std::future::Future::poll(wait.as_mut(), cx);
            if let Some(tx) = asleep_tx.take() {
                assert!(r.is_pending(), "no cancel yet");
                let _ = tx.send(());
            }
            r
        })
        .await;
        slot.end_wait();
    });
    asleep.await.expect("the wait was polled");
    assert_eq!(reg.slot.state(), "waiting");
    // A cancel with the wrong secret (someone guessing keys) ends nothing.
    let wrong = reg.secret_key().wrapping_add(1);
    assert!(!registry.cancel(reg.process_id(), wrong).await);
    assert_eq!(reg.slot.state(), "waiting");
    assert!(!waiter.is_finished());
    registry.cancel(reg.process_id(), reg.secret_key()).await;
    crate::timer::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the cancel woke the wait")
        .expect("waiter");
    assert!(reg.slot.lock().waker.is_none());
    assert_eq!(reg.slot.state(), "idle");
}

/// A stand-in server that counts the cancel requests it gets (each: read, then closed).
async fn counting_server() -> (CancelTarget, Arc<AtomicU32>, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicU32::new(0));
    let counted = count.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            let mut req = [0u8; 16];
            if c.read_exact(&mut req).await.is_ok() {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let target = CancelTarget::new(addr, 7, 9);
    (target, count, task)
}

/// A cancel PostgreSQL ignored (its backend was between messages, before the request
/// arrived) is sent again while the request runs unanswered, and only then.
#[tokio::test]
async fn a_cancel_is_sent_again_while_its_request_runs_unanswered() {
    let (target, count, server) = counting_server().await;
    let registry = Arc::new(CancelRegistry::default());
    let reg = registry.register(None, ClientInfo::default());
    let turn_now = || {
        let (_, turn, guard) = reg.slot.begin().unwrap();
        drop(guard);
        turn
    };
    assert!(reg.slot.set(target));
    // Nothing answered: every recheck cancels again.
    let turn = turn_now();
    let sent = follow_up(reg.slot.clone(), turn).await;
    assert_eq!(sent, RECHECK.len() as u32);
    assert_eq!(count.load(Ordering::SeqCst), sent);
    // The request was answered after the cancel: not cancelled again.
    reg.slot.note_answered();
    assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
    // The client's next unit (a server named again) is never cancelled by an old cancel.
    let turn = turn_now();
    reg.slot.clear().await;
    reg.slot.mark_busy();
    assert!(reg.slot.set(target));
    assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
    // Nor is anything once the server is given back.
    let turn = turn_now();
    reg.slot.clear().await;
    assert_eq!(follow_up(reg.slot.clone(), turn).await, 0);
    assert_eq!(count.load(Ordering::SeqCst), RECHECK.len() as u32);
    server.abort();
}

/// A cancel whose forwarding is abandoned midway (its connection's login timed out) must
/// not leave the client unable to give its server back.
#[tokio::test]
async fn an_abandoned_forward_does_not_block_clear() {
    // A "server" that accepts the cancel connection and never closes it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let registry = Arc::new(CancelRegistry::default());
    let reg = registry.register(None, ClientInfo::default());
    assert!(reg.slot.set(CancelTarget::new(addr, 1, 2)));
    let abandoned = crate::timer::timeout(
        Duration::from_millis(100),
        registry.cancel(reg.process_id(), reg.secret_key()),
    )
    .await;
    assert!(abandoned.is_err(), "the forward was still waiting");
    crate::timer::timeout(Duration::from_secs(2), reg.slot.clear())
        .await
        .expect("clear returns once the abandoned forward is gone");
    hold.abort();
}
