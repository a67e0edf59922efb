//! Channels of one tenant: which sockets are subscribed to which topic, delivering a
//! broadcast to all of them, and who is present on each (Presence: `presence_state` to a
//! joining socket, `presence_diff` with joins and leaves to every socket that wants
//! presence).
//!
//! A broadcast is encoded once per form a subscriber needs (a 1.0 text frame, a 2.0 binary
//! frame), on first need, and the same bytes are queued for every subscriber. Each socket
//! has a bounded queue: a subscriber whose queue is full is not waited for; it is marked
//! slow and its socket is closed by its own task, so one slow reader never holds up a
//! channel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::protocol::{self, UserBroadcast, Vsn};

mod presence;

pub type SocketId = u64;

/// Why every socket of a tenant is closed: the WebSocket close code and reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ending {
    pub code: u16,
    pub reason: &'static str,
}

impl Ending {
    /// The tenant was banned, deleted or its clients terminated (1008: policy violation).
    pub const TENANT: Ending = Ending {
        code: 1008,
        reason: "the tenant was disabled, deleted or its clients terminated",
    };
    /// The service is stopping or handing over to a new process (1012: service restart;
    /// the official clients reconnect).
    pub const RESTART: Ending = Ending {
        code: 1012,
        reason: "Shoal is restarting: reconnect",
    };
}

/// A frame ready to be written to a socket, shared by every socket it goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Shared, not copied: every subscriber's socket writes the same bytes.
    Text(axum::extract::ws::Utf8Bytes),
    Binary(bytes::Bytes),
}

/// A socket's bounded queue of frames to write.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: tokio::sync::mpsc::Sender<Frame>,
    slow: Arc<Slow>,
}

/// Set once a frame could not be queued; wakes the socket's task even while it is stuck
/// writing to a client that does not read.
#[derive(Debug, Default)]
struct Slow {
    set: AtomicBool,
    wake: tokio::sync::Notify,
}

impl Outbox {
    /// A queue of at most `capacity` frames, and its reading end.
    pub fn new(capacity: usize) -> (Outbox, tokio::sync::mpsc::Receiver<Frame>) {
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        (
            Outbox {
                tx,
                slow: Arc::default(),
            },
            rx,
        )
    }

    /// Queues `f` without waiting; false when the queue is full (the socket is marked slow)
    /// or its socket is gone.
    pub fn push(&self, f: Frame) -> bool {
        match self.tx.try_send(f) {
            Ok(()) => true,
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                if !self.slow.set.swap(true, Ordering::AcqRel) {
                    self.slow.wake.notify_one();
                }
                false
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// A frame could not be queued because the socket did not keep up.
    pub fn is_slow(&self) -> bool {
        self.slow.set.load(Ordering::Acquire)
    }

    /// Resolves once the socket has been found too slow.
    pub async fn slowed(&self) {
        if !self.is_slow() {
            self.slow.wake.notified().await;
        }
    }
}

/// One socket's subscription to a topic.
#[derive(Debug, Clone)]
pub struct Subscriber {
    pub socket: SocketId,
    pub join_ref: Option<String>,
    pub vsn: Vsn,
    /// `broadcast.self`: the socket gets its own broadcasts.
    pub receive_own: bool,
    /// `presence.enabled`: the socket gets presence state and diffs.
    pub presence: bool,
    pub out: Outbox,
}

#[derive(Default)]
struct Topic {
    subs: Vec<Subscriber>,
    presences: Vec<presence::Presence>,
}

impl Topic {
    /// Nothing left to keep it for: no subscriber here, no presence from anywhere.
    fn is_empty(&self) -> bool {
        self.subs.is_empty() && self.presences.is_empty()
    }
}

/// What a broadcast came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Delivery {
    pub delivered: usize,
    /// Subscribers whose queue was full.
    pub slow: Vec<SocketId>,
    /// 1.0 subscribers that cannot take a binary payload.
    pub skipped: usize,
}

/// What separates a private channel's key in the hub from its topic: a character no
/// client topic may hold (joins and HTTP messages naming one are refused), so a public
/// channel can never be a private one's.
const PRIVATE: &str = "\0private";

/// The hub's key for a channel: its topic, or for a private channel its topic marked so
/// (a private and a public channel of one name are two channels, as in Realtime).
pub fn channel_key(topic: &str, private: bool) -> std::borrow::Cow<'_, str> {
    if private {
        format!("{topic}{PRIVATE}").into()
    } else {
        topic.into()
    }
}

/// The topic clients know a channel by, from its key.
pub fn client_topic(key: &str) -> &str {
    key.strip_suffix(PRIVATE).unwrap_or(key)
}

/// Whether a topic from a client may name a channel.
pub fn valid_topic(topic: &str) -> bool {
    !topic.contains('\0')
}

/// The service's relay to other nodes, once it has one.
pub type RelaySlot = Arc<OnceLock<Arc<dyn crate::fabric::Relay>>>;

#[derive(Default)]
pub struct Hub {
    topics: Mutex<HashMap<String, Topic>>,
    meter: crate::limits::Meter,
    /// Set when the tenant's sockets must all end (banned, deleted, terminated, or the
    /// service stopping): the close code and reason they end with.
    ended: tokio::sync::watch::Sender<Option<Ending>>,
    /// Presence refs handed out.
    next_ref: std::sync::atomic::AtomicU64,
    /// Frames queued to subscribers by broadcasts, and subscribers found too slow.
    pub delivered: std::sync::atomic::AtomicU64,
    pub slow: std::sync::atomic::AtomicU64,
    /// The tenant, and where its broadcasts go to reach other nodes (in a cluster).
    relay: Option<(String, RelaySlot)>,
    /// Where the tenant's `postgres_changes` subscriptions go, once there is a feed.
    feed: Option<crate::feed::FeedSlot>,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Topic>> {
        self.topics.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends every socket of the tenant (each closes itself on hearing of it).
    pub fn end_sockets(&self, why: Ending) {
        self.ended.send_replace(Some(why));
    }

    /// Hears of [`Hub::end_sockets`] calls made from now on.
    pub fn ended(&self) -> tokio::sync::watch::Receiver<Option<Ending>> {
        self.ended.subscribe()
    }

    /// The tenant's limits and the meters against them.
    pub fn meter(&self) -> &crate::limits::Meter {
        &self.meter
    }

    /// Subscribes `sub` to `topic`, in place of the same socket's earlier subscription to
    /// it (a re-join). A socket that wants presence is sent the topic's presence state.
    pub fn join(&self, topic: &str, sub: Subscriber) {
        Self::join_locked(&mut self.lock(), topic, sub);
    }

    fn join_locked(topics: &mut HashMap<String, Topic>, topic: &str, sub: Subscriber) {
        let t = topics.entry(topic.to_owned()).or_default();
        t.subs.retain(|s| s.socket != sub.socket);
        if sub.presence {
            let state = presence::map(t.presences.iter());
            if let Some(f) = presence::frame(sub.vsn, topic, "presence_state", state) {
                sub.out.push(f);
            }
        }
        t.subs.push(sub);
    }

    /// Ends `socket`'s subscription to `topic` (and its presence there); whether it had one.
    pub fn leave(&self, topic: &str, socket: SocketId) -> bool {
        let (left, untracked) = {
            let mut topics = self.lock();
            let Some(t) = topics.get_mut(topic) else {
                return false;
            };
            let untracked = presence::untrack_in(t, topic, None, socket);
            let before = t.subs.len();
            t.subs.retain(|s| s.socket != socket);
            let left = t.subs.len() < before;
            if t.is_empty() {
                topics.remove(topic);
            }
            (left, untracked)
        };
        if untracked {
            self.relay_untrack(topic, socket);
        }
        left
    }

    /// Whether `socket` is subscribed to `topic` (a join waiting for capture is not yet).
    pub fn has_subscriber(&self, topic: &str, socket: SocketId) -> bool {
        self.lock()
            .get(topic)
            .is_some_and(|t| t.subs.iter().any(|s| s.socket == socket))
    }

    pub fn subscribers(&self, topic: &str) -> usize {
        self.lock().get(topic).map_or(0, |t| t.subs.len())
    }

    pub fn present(&self, topic: &str) -> usize {
        self.lock().get(topic).map_or(0, |t| t.presences.len())
    }

    pub fn topics(&self) -> usize {
        self.lock().len()
    }

    /// Tenant `tenant`'s channels, whose broadcasts also go to `relay`'s nodes.
    pub fn relayed(tenant: &str, relay: RelaySlot, feed: crate::feed::FeedSlot) -> Hub {
        Hub {
            relay: Some((tenant.to_owned(), relay)),
            feed: Some(feed),
            ..Hub::default()
        }
    }

    /// The tenant's id and its change feed, when the service has one.
    pub fn feed(&self) -> Option<(&str, &Arc<dyn crate::feed::ChangeFeed>)> {
        let tenant = self.relay.as_ref().map(|(t, _)| t.as_str())?;
        Some((tenant, self.feed.as_ref()?.get()?))
    }

    /// [`Hub::join`], unless `ended` is set (checked under the hub's lock, so a socket
    /// that sets it before leaving never stays subscribed); whether it joined.
    pub fn join_unless(&self, topic: &str, sub: Subscriber, ended: &AtomicBool) -> bool {
        let mut topics = self.lock();
        if ended.load(Ordering::Acquire) {
            return false;
        }
        Self::join_locked(&mut topics, topic, sub);
        true
    }

    /// A broadcast from a client of this node: delivered here (see [`Hub::deliver`]) and
    /// relayed to the other nodes.
    pub fn broadcast(&self, b: &UserBroadcast, from: Option<SocketId>) -> Delivery {
        let d = self.deliver(b, from);
        if let Some((tenant, slot)) = &self.relay {
            if let Some(relay) = slot.get() {
                relay.publish(tenant, b);
            }
        }
        d
    }

    /// Delivers `b` to every subscriber of its topic on this node (`from`, the sender's
    /// socket, only if it asked for its own broadcasts).
    pub fn deliver(&self, b: &UserBroadcast, from: Option<SocketId>) -> Delivery {
        // A private channel's key is not what its clients call it.
        let shown;
        let (key, b) = match client_topic(&b.topic) {
            t if t.len() == b.topic.len() => (&b.topic, b),
            t => {
                shown = UserBroadcast {
                    topic: t.to_owned(),
                    ..b.clone()
                };
                (&b.topic, &shown)
            }
        };
        let v1: OnceLock<Option<Frame>> = OnceLock::new();
        let v2: OnceLock<Option<Frame>> = OnceLock::new();
        let mut d = Delivery::default();
        let topics = self.lock();
        let Some(t) = topics.get(key.as_str()) else {
            return d;
        };
        for s in &t.subs {
            if Some(s.socket) == from && !s.receive_own {
                continue;
            }
            let frame = match s.vsn {
                Vsn::V1 => v1.get_or_init(|| broadcast_frame(Vsn::V1, b)),
                Vsn::V2 => v2.get_or_init(|| broadcast_frame(Vsn::V2, b)),
            };
            let Some(frame) = frame else {
                d.skipped += 1;
                continue;
            };
            if s.out.push(frame.clone()) {
                d.delivered += 1;
            } else if s.out.is_slow() {
                d.slow.push(s.socket);
            }
        }
        self.delivered
            .fetch_add(d.delivered as u64, std::sync::atomic::Ordering::Relaxed);
        self.slow
            .fetch_add(d.slow.len() as u64, std::sync::atomic::Ordering::Relaxed);
        d
    }
}

/// A user broadcast as a socket speaking `vsn` reads it (`b.topic` as its client calls the
/// channel): realtime-js reads user broadcasts as binary frames, and a topic or event too
/// long for the frame's one-byte lengths goes as text. `None`: a binary payload for a
/// protocol 1.0 socket, which has no frame for it.
pub fn broadcast_frame(vsn: Vsn, b: &UserBroadcast) -> Option<Frame> {
    if vsn == Vsn::V2 {
        if let Some(f) = protocol::encode_user_broadcast(b) {
            return Some(Frame::Binary(f.into()));
        }
    }
    let m = protocol::broadcast_message(b)?;
    protocol::encode_text(vsn, &m).map(|t| Frame::Text(t.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Payload;
    use bytes::Bytes;

    fn sub(
        socket: SocketId,
        vsn: Vsn,
        receive_own: bool,
        cap: usize,
    ) -> (Subscriber, tokio::sync::mpsc::Receiver<Frame>) {
        let (out, rx) = Outbox::new(cap);
        (
            Subscriber {
                socket,
                join_ref: Some("1".into()),
                vsn,
                receive_own,
                presence: false,
                out,
            },
            rx,
        )
    }

    fn ping(payload: Payload) -> UserBroadcast {
        UserBroadcast {
            join_ref: None,
            msg_ref: None,
            topic: "realtime:room".into(),
            event: "ping".into(),
            meta: None,
            payload,
        }
    }

    #[test]
    fn a_broadcast_reaches_every_subscriber_in_its_form_once_encoded() {
        let hub = Hub::default();
        let (a, mut ra) = sub(1, Vsn::V2, false, 8);
        let (b, mut rb) = sub(2, Vsn::V2, true, 8);
        let (c, mut rc) = sub(3, Vsn::V1, true, 8);
        let (d, mut rd) = sub(4, Vsn::V2, true, 8);
        for s in [a, b, c] {
            hub.join("realtime:room", s);
        }
        hub.join("realtime:other", d);
        let m = ping(Payload::json(Bytes::from_static(br#"{"n":1}"#)).unwrap());
        let got = hub.broadcast(&m, Some(1));
        assert_eq!(got.delivered, 2, "the sender did not ask for its own");
        assert!(ra.try_recv().is_err());
        let Frame::Binary(fb) = rb.try_recv().unwrap() else {
            panic!("binary for 2.0")
        };
        assert_eq!(fb[0], 4);
        let Frame::Text(fc) = rc.try_recv().unwrap() else {
            panic!("text for 1.0")
        };
        assert!(fc.contains(r#""event":"broadcast""#), "{fc}");
        assert!(rd.try_recv().is_err(), "another topic");
        // The sender with `self` gets its own; a binary payload skips 1.0 sockets.
        let bin = ping(Payload::Binary(Bytes::from_static(b"\x01")));
        let got = hub.broadcast(&bin, Some(2));
        assert_eq!((got.delivered, got.skipped), (2, 1));
    }

    #[test]
    fn a_full_queue_marks_its_socket_slow_and_holds_up_no_one() {
        let hub = Hub::default();
        let (slow, _keep) = sub(1, Vsn::V2, false, 1);
        let (fast, mut rf) = sub(2, Vsn::V2, false, 8);
        let slow_out = slow.out.clone();
        hub.join("t", slow);
        hub.join("t", fast);
        let mut m = ping(Payload::json(Bytes::from_static(b"1")).unwrap());
        m.topic = "t".into();
        assert_eq!(hub.broadcast(&m, None).delivered, 2);
        let d = hub.broadcast(&m, None);
        assert_eq!(d.delivered, 1);
        assert_eq!(d.slow, vec![1]);
        assert!(slow_out.is_slow());
        assert_eq!(rf.try_recv().ok().map(|_| ()), Some(()));
        assert_eq!(rf.try_recv().ok().map(|_| ()), Some(()));
    }

    #[test]
    fn presence_state_on_join_and_diffs_on_track_and_leave() {
        let hub = Hub::default();
        let (mut a, mut ra) = sub(1, Vsn::V2, false, 8);
        let (mut b, mut rb) = sub(2, Vsn::V1, false, 8);
        a.presence = true;
        b.presence = true;
        hub.join("t", a);
        let first = ra.try_recv().unwrap();
        assert_eq!(
            first,
            Frame::Text(r#"[null,null,"t","presence_state",{}]"#.into())
        );
        let meta = |v: serde_json::Value| v.as_object().unwrap().clone();
        hub.track("t", 1, "alice", meta(serde_json::json!({"online_at": 1})));
        let Frame::Text(diff) = ra.try_recv().unwrap() else {
            panic!()
        };
        assert!(
            diff.contains(r#""presence_diff""#) && diff.contains(r#""alice":{"metas":[{"#),
            "{diff}"
        );
        hub.join("t", b);
        let Frame::Text(state) = rb.try_recv().unwrap() else {
            panic!()
        };
        assert!(
            state.contains(r#""event":"presence_state""#) && state.contains("alice"),
            "{state}"
        );
        // A second track replaces the first: one join, one leave.
        hub.track("t", 1, "alice", meta(serde_json::json!({"online_at": 2})));
        let Frame::Text(diff) = rb.try_recv().unwrap() else {
            panic!()
        };
        assert!(
            diff.contains(r#""leaves":{"alice""#) && diff.contains(r#""online_at":2"#),
            "{diff}"
        );
        assert_eq!(hub.present("t"), 1);
        // Leaving takes the presence with it.
        assert!(hub.leave("t", 1));
        let Frame::Text(diff) = rb.try_recv().unwrap() else {
            panic!()
        };
        assert!(
            diff.contains(r#""joins":{}"#) && diff.contains(r#""leaves":{"alice""#),
            "{diff}"
        );
        assert_eq!(hub.present("t"), 0);
    }

    #[test]
    fn presences_of_other_nodes_join_leave_and_go_with_their_node() {
        use crate::fabric::PresenceChange;
        let hub = Hub::default();
        let meta = |name: &str| {
            serde_json::json!({ "name": name })
                .as_object()
                .unwrap()
                .clone()
        };
        // Another node's presence arrives before anyone here watches the topic.
        hub.presence_relayed(
            "n2",
            PresenceChange::Track {
                topic: "t".into(),
                socket: 1,
                key: "ann".into(),
                meta: meta("Ann"),
            },
        );
        let (mut w, mut rw) = sub(1, Vsn::V1, false, 8);
        w.presence = true;
        hub.join("t", w);
        let Frame::Text(state) = rw.try_recv().unwrap() else {
            panic!()
        };
        assert!(
            state.contains(r#""ann":{"metas":[{"name":"Ann"}]}"#),
            "{state}"
        );
        // The same socket id from another node, and this node's own socket 1, are others.
        hub.track("t", 1, "me", meta("Me"));
        hub.presence_relayed(
            "n3",
            PresenceChange::Track {
                topic: "t".into(),
                socket: 1,
                key: "bob".into(),
                meta: meta("Bob"),
            },
        );
        assert_eq!(hub.present("t"), 3);
        assert_eq!(hub.local_presences().len(), 1, "only this node's own");
        while rw.try_recv().is_ok() {}
        hub.drop_origin("n2");
        let Frame::Text(diff) = rw.try_recv().unwrap() else {
            panic!()
        };
        assert!(diff.contains(r#""leaves":{"ann""#), "{diff}");
        hub.presence_relayed(
            "n3",
            PresenceChange::Untrack {
                topic: "t".into(),
                socket: 1,
            },
        );
        assert_eq!(hub.present("t"), 1);
    }

    #[test]
    fn a_rejoin_replaces_and_a_leave_removes() {
        let hub = Hub::default();
        let (a, _ra) = sub(1, Vsn::V2, false, 1);
        let (again, _rb) = sub(1, Vsn::V1, false, 1);
        hub.join("t", a);
        hub.join("t", again);
        assert_eq!(hub.subscribers("t"), 1);
        assert!(hub.leave("t", 1));
        assert!(!hub.leave("t", 1));
        assert_eq!(hub.topics(), 0);
    }
}
