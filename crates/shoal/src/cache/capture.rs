//! A fill: the reply one client gets for a unit the cache missed, copied as it is written to
//! the client (after everything Shoal adds or hides), up to the unit's ReadyForQuery. It is
//! kept only when it is a clean answer: nothing but the messages a query's reply has, no
//! error or notice, idle at its end, and not larger than the pool's limit for one entry.
//! Dropping a capture (kept or not) lets clients waiting for the same key go on.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shoal_wire::frame::HEADER_LEN;

use super::freshness::Snapshot;
use super::QueryCache;

#[derive(Debug, PartialEq, Eq)]
enum State {
    Open,
    /// Ended with its ReadyForQuery, clean.
    Complete,
    /// Not to be kept.
    Abandoned,
}

pub struct Capture {
    cache: Arc<QueryCache>,
    key: Box<[u8]>,
    snapshot: Option<Snapshot>,
    ttl: Duration,
    buf: Vec<u8>,
    /// Bytes of `buf` already looked at (whole messages).
    scanned: usize,
    state: State,
}

impl Capture {
    pub(super) fn new(
        cache: Arc<QueryCache>,
        key: Box<[u8]>,
        snapshot: Snapshot,
        ttl: Duration,
    ) -> Capture {
        Capture {
            cache,
            key,
            snapshot: Some(snapshot),
            ttl,
            buf: Vec::new(),
            scanned: 0,
            state: State::Open,
        }
    }

    /// Bytes just written to the client.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.state != State::Open {
            return;
        }
        if self.buf.len() + bytes.len() > self.cache.max_entry {
            self.abandon();
            return;
        }
        self.buf.extend_from_slice(bytes);
        while let Some(head) = self.buf.get(self.scanned..self.scanned + HEADER_LEN) {
            let tag = head[0];
            let n = 1 + u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if self.buf.len() < self.scanned + n {
                return;
            }
            match tag {
                // What a query's reply is made of.
                b'1' | b'2' | b't' | b'T' | b'n' | b'D' | b'C' | b'I' => {}
                b'Z' => {
                    let idle = self.buf.get(self.scanned + HEADER_LEN) == Some(&b'I');
                    self.scanned += n;
                    self.buf.truncate(self.scanned);
                    if idle {
                        self.state = State::Complete;
                    } else {
                        self.abandon();
                    }
                    return;
                }
                // An error, a notice, a setting's new value, a notification, a suspended
                // portal: an answer of the moment, never kept.
                _ => {
                    self.abandon();
                    return;
                }
            }
            self.scanned += n;
        }
    }

    fn abandon(&mut self) {
        self.state = State::Abandoned;
        self.buf = Vec::new();
        self.cache
            .stats
            .unkept_replies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The relay is done with the unit: keeps the reply if it is whole and clean.
    pub fn finish(mut self) {
        if self.state == State::Complete {
            if let Some(snapshot) = self.snapshot.take() {
                let reply = Bytes::from(std::mem::take(&mut self.buf));
                self.cache.keep(self.key.clone(), reply, snapshot, self.ttl);
            }
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.cache.fill_ended(&self.key);
    }
}
