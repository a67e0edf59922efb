//! Channels of one tenant: which sockets are subscribed to which topic, and delivering a
//! broadcast to all of them.
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

pub type SocketId = u64;

/// A frame ready to be written to a socket, shared by every socket it goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Text(Arc<str>),
    Binary(Arc<[u8]>),
}

/// A socket's bounded queue of frames to write.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: tokio::sync::mpsc::Sender<Frame>,
    slow: Arc<AtomicBool>,
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
                self.slow.store(true, Ordering::Release);
                false
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// A frame could not be queued because the socket did not keep up.
    pub fn is_slow(&self) -> bool {
        self.slow.load(Ordering::Acquire)
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
    pub out: Outbox,
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

#[derive(Default)]
pub struct Hub {
    topics: Mutex<HashMap<String, Vec<Subscriber>>>,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Subscriber>>> {
        self.topics.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Subscribes `sub` to `topic`, in place of the same socket's earlier subscription to
    /// it (a re-join).
    pub fn join(&self, topic: &str, sub: Subscriber) {
        let mut topics = self.lock();
        let subs = topics.entry(topic.to_owned()).or_default();
        subs.retain(|s| s.socket != sub.socket);
        subs.push(sub);
    }

    /// Ends `socket`'s subscription to `topic`; whether it had one.
    pub fn leave(&self, topic: &str, socket: SocketId) -> bool {
        let mut topics = self.lock();
        let Some(subs) = topics.get_mut(topic) else {
            return false;
        };
        let before = subs.len();
        subs.retain(|s| s.socket != socket);
        let left = subs.len() < before;
        if subs.is_empty() {
            topics.remove(topic);
        }
        left
    }

    pub fn subscribers(&self, topic: &str) -> usize {
        self.lock().get(topic).map_or(0, Vec::len)
    }

    pub fn topics(&self) -> usize {
        self.lock().len()
    }

    /// Delivers `b` to every subscriber of its topic (`from`, the sender's socket, only if
    /// it asked for its own broadcasts).
    pub fn broadcast(&self, b: &UserBroadcast, from: Option<SocketId>) -> Delivery {
        let text_v1: OnceLock<Option<Frame>> = OnceLock::new();
        let text_v2: OnceLock<Option<Frame>> = OnceLock::new();
        let binary: OnceLock<Option<Frame>> = OnceLock::new();
        let mut d = Delivery::default();
        let topics = self.lock();
        let Some(subs) = topics.get(&b.topic) else {
            return d;
        };
        for s in subs {
            if Some(s.socket) == from && !s.receive_own {
                continue;
            }
            let frame = match s.vsn {
                Vsn::V1 => text_v1.get_or_init(|| text(Vsn::V1, b)),
                // realtime-js reads user broadcasts as binary frames; a topic or event too
                // long for the frame's one-byte lengths goes as text.
                Vsn::V2 => {
                    let bin = binary.get_or_init(|| {
                        protocol::encode_user_broadcast(b).map(|f| Frame::Binary(f.into()))
                    });
                    if bin.is_some() {
                        bin
                    } else {
                        text_v2.get_or_init(|| text(Vsn::V2, b))
                    }
                }
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
        d
    }
}

fn text(vsn: Vsn, b: &UserBroadcast) -> Option<Frame> {
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
