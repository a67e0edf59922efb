//! The task's book of channels, without a database: joins, re-joins, leaves, refusals and
//! sockets that ended, as the capture loop applies them.

use std::sync::{Arc, Mutex, Weak};

use shoal_realtime::feed::{subscription, Identity, Join};
use shoal_realtime::hub::{Frame, Hub, Outbox, Subscriber};
use shoal_realtime::protocol::Vsn;
use tokio::sync::mpsc::Receiver;

use super::{Serves, Task};
use crate::realtime::changes::Command;

fn task() -> Task {
    let (_commands, rx) = tokio::sync::mpsc::unbounded_channel();
    let serves = Serves {
        tenant: Some("t".into()),
        db: ("127.0.0.1".into(), 1, "d".into()),
        taps: false,
    };
    Task::new(
        serves,
        Weak::new(),
        Weak::new(),
        "slot".into(),
        rx,
        Arc::default(),
    )
}

/// A socket's join of `topic` (public channels without bindings only may get broadcasts
/// from the database; private ones need the policies), and what the socket receives.
fn join(hub: &Arc<Hub>, socket: u64, topic: &str, private: bool) -> (Command, Receiver<Frame>) {
    let (out, rx) = Outbox::new(16);
    let subscriber = Subscriber {
        socket,
        join_ref: Some("1".into()),
        vsn: Vsn::V2,
        receive_own: false,
        presence: false,
        out,
    };
    let identity = Arc::new(Mutex::new(Identity {
        role: "anon".into(),
        claims: "{}".into(),
    }));
    let join = Join {
        topic,
        private,
        msg_ref: None,
        replication_ready: false,
        replay: None,
    };
    let (s, _handle) = subscription(hub.clone(), subscriber, join, Vec::new(), identity);
    (Command::Subscribe(Box::new(s)), rx)
}

fn text(f: Frame) -> String {
    match f {
        Frame::Text(t) => t.as_str().to_owned(),
        Frame::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
    }
}

#[test]
fn a_channel_is_found_by_its_socket_and_topic() {
    let hub = Arc::new(Hub::default());
    let mut t = task();
    let mut inboxes = Vec::new();
    for socket in 0..3 {
        for topic in ["realtime:a", "realtime:b"] {
            let (c, rx) = join(&hub, socket, topic, false);
            t.apply(c);
            inboxes.push(rx);
        }
    }
    assert_eq!(t.subs.len(), 6);
    assert_eq!(t.waiting_now().len(), 6, "every join waits for capture");
    // A re-join takes the place of the socket's earlier join of the topic.
    let (c, _rx) = join(&hub, 1, "realtime:a", false);
    t.apply(c);
    assert_eq!(t.subs.len(), 6);
    assert_eq!(t.waiting_now().len(), 6);
    t.apply(Command::Unsubscribe(2, "realtime:b".into()));
    assert_eq!(t.subs.len(), 5);
    assert!(!t.subs.contains_key(&(2, "realtime:b".to_owned())));
    assert_eq!(t.waiting_now().len(), 5, "a leave is no longer waited for");
    assert_eq!(
        t.stats
            .subscriptions
            .load(std::sync::atomic::Ordering::Relaxed),
        5
    );
    // Another socket's channel of the same topic is untouched.
    assert!(t.subs.contains_key(&(1, "realtime:b".to_owned())));
}

#[test]
fn a_refused_join_is_answered_once_and_forgotten_when_its_socket_ends() {
    let hub = Arc::new(Hub::default());
    let mut t = task();
    let (c, mut refused) = join(&hub, 7, "realtime:secret", true);
    t.apply(c);
    let (c, mut kept) = join(&hub, 8, "realtime:secret", true);
    t.apply(c);
    let key = (7, "realtime:secret".to_owned());
    t.refuse(&key, "Unauthorized: no");
    let answer = text(refused.try_recv().expect("the refusal"));
    assert!(
        answer.contains("error") && answer.contains("Unauthorized: no"),
        "{answer}"
    );
    // Answered: no longer waited for, and not answered again.
    assert_eq!(t.waiting_now(), vec![(8, "realtime:secret".to_owned())]);
    t.refuse(&key, "again");
    assert!(refused.try_recv().is_err(), "answered once");
    assert!(
        kept.try_recv().is_err(),
        "the other socket's join still waits"
    );
    // The refusal ended the channel: the sweep forgets it, and only it.
    t.sweep_ended();
    assert!(!t.subs.contains_key(&key));
    assert_eq!(t.subs.len(), 1);
}

#[test]
fn tens_of_thousands_of_channels_join_and_leave() {
    let hub = Arc::new(Hub::default());
    let mut t = task();
    let mut inboxes = Vec::new();
    for socket in 0..16_000u64 {
        for topic in ["realtime:echo", "realtime:room"] {
            let (c, rx) = join(&hub, socket, topic, false);
            t.apply(c);
            inboxes.push(rx);
        }
    }
    assert_eq!(t.subs.len(), 32_000);
    for socket in (0..16_000u64).rev() {
        t.apply(Command::Unsubscribe(socket, "realtime:room".into()));
    }
    assert_eq!(t.subs.len(), 16_000);
    assert!(t.subs.keys().all(|(_, topic)| topic == "realtime:echo"));
    assert_eq!(t.waiting_now().len(), 16_000);
}
