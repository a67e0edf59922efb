//! One listening client's notifications on their way to its socket.
//!
//! The pool's listening connection puts each notification for a client in its mailbox, and
//! the client's session writes from there: while the client is idle, at once; while it runs
//! a transaction, in front of the ReadyForQuery that ends it (when PostgreSQL would deliver
//! them). The mailbox's buffer is the only place they wait, so a client that reads nothing
//! holds at most [`MAX_PENDING`] bytes before Shoal closes it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};

use bytes::{Buf, BytesMut};

/// Bytes of notifications a client may leave unread before it is disconnected.
pub const MAX_PENDING: usize = 1 << 20;

#[derive(Default)]
struct Queue {
    bytes: BytesMut,
    /// The session waiting for mail, if it waits.
    waker: Option<Waker>,
    /// More than [`MAX_PENDING`] was due: the client is to be closed.
    overflowed: bool,
}

/// A listening client's pending notifications (and notices about them).
#[derive(Default)]
pub struct Mailbox {
    queue: Mutex<Queue>,
    /// Something is queued (or the mailbox overflowed): read without the lock on every
    /// ReadyForQuery of the client's transactions.
    has_mail: AtomicBool,
    /// The session waits idle, writing mail as it comes (not inside a transaction, where
    /// mail waits for its ReadyForQuery).
    idle: AtomicBool,
    /// Told each time the mailbox is emptied onto the client's socket.
    emptied: tokio::sync::Notify,
}

/// What became of a message put in a mailbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Put {
    Queued,
    /// It would have taken the client past [`MAX_PENDING`]: the client is to be closed.
    Overflowed,
    /// The mailbox overflowed before: nothing more is queued.
    Closed,
}

/// What a session found in its mailbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Mail {
    Empty,
    Overflowed,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues one whole message, unless the client has [`MAX_PENDING`] bytes unread.
    pub fn put(&self, msg: &[u8]) -> Put {
        let put = self.put_quietly(msg);
        self.wake();
        put
    }

    /// [`Mailbox::put`] without waking the session: messages read together from the server
    /// reach the client together (a transaction's notifications are one batch, as on a
    /// direct connection); [`Mailbox::wake`] follows.
    pub fn put_quietly(&self, msg: &[u8]) -> Put {
        let mut q = self.lock();
        if q.overflowed {
            return Put::Closed;
        }
        let put = if q.bytes.len() + msg.len() > MAX_PENDING {
            q.overflowed = true;
            q.bytes = BytesMut::new();
            Put::Overflowed
        } else {
            q.bytes.extend_from_slice(msg);
            Put::Queued
        };
        self.has_mail.store(true, Ordering::Release);
        put
    }

    /// Wakes the session if it waits for mail.
    pub fn wake(&self) {
        let waker = self.lock().waker.take();
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub fn has_mail(&self) -> bool {
        self.has_mail.load(Ordering::Acquire)
    }

    /// Moves everything queued to the end of `out` (the relay's output to the client).
    pub fn take_into(&self, out: &mut BytesMut) -> Mail {
        let mut q = self.lock();
        if q.overflowed {
            return Mail::Overflowed;
        }
        out.extend_from_slice(&q.bytes);
        q.bytes.clear();
        self.has_mail.store(false, Ordering::Release);
        drop(q);
        self.emptied.notify_waiters();
        Mail::Empty
    }

    /// The session leaves its idle wait to serve the client.
    pub fn busy(&self) {
        self.idle.store(false, Ordering::Relaxed);
    }

    /// Whether nothing will reach the client soon: the mailbox is empty (its mail is on the
    /// socket), or the session is busy (mail waits for its ReadyForQuery), or it overflowed.
    fn settled(&self) -> bool {
        !self.has_mail() || !self.idle.load(Ordering::Relaxed) || self.lock().overflowed
    }

    /// Waits until [`Mailbox::settled`] (a notifier's ReadyForQuery waits for it, so that what
    /// it sent is on idle listeners' sockets when it goes on, as with PostgreSQL).
    pub async fn until_settled(&self) {
        loop {
            let emptied = self.emptied.notified();
            if self.settled() {
                return;
            }
            emptied.await;
        }
    }

    /// Writes queued mail to the idle client through `write` (a non-blocking write that
    /// returns how much it took). Ready when the mailbox is empty again or overflowed, or
    /// with the write's error; pending (waker registered) while mail waits for the socket
    /// or no mail is there.
    pub fn poll_deliver(
        &self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&mut Context<'_>, &[u8]) -> Poll<std::io::Result<usize>>,
    ) -> Poll<std::io::Result<Mail>> {
        self.idle.store(true, Ordering::Relaxed);
        let mut q = self.lock();
        loop {
            if q.overflowed {
                return Poll::Ready(Ok(Mail::Overflowed));
            }
            if q.bytes.is_empty() {
                if self.has_mail.swap(false, Ordering::Release) {
                    self.emptied.notify_waiters();
                }
                // Woken by the next `put`.
                q.waker = Some(cx.waker().clone());
                if q.bytes.capacity() > 0 {
                    q.bytes = BytesMut::new();
                }
                return Poll::Pending;
            }
            match write(cx, &q.bytes) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => q.bytes.advance(n),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    #[cfg(test)]
    fn pending(&self) -> usize {
        self.lock().bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_that_reads_nothing_overflows_once_and_gets_nothing_more() {
        let m = Mailbox::default();
        let msg = vec![b'A'; 1000];
        let mut n = 0;
        while m.put(&msg) == Put::Queued {
            n += 1;
        }
        assert_eq!(n, MAX_PENDING / 1000);
        assert_eq!(m.put(&msg), Put::Closed);
        let mut out = BytesMut::new();
        assert_eq!(m.take_into(&mut out), Mail::Overflowed);
        assert!(out.is_empty());
    }

    #[test]
    fn delivery_writes_what_the_socket_takes_and_waits_for_more() {
        let m = Mailbox::default();
        m.put(b"abc");
        m.put(b"def");
        assert!(m.has_mail());
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut written = Vec::new();
        // The socket takes two bytes, then is full.
        let mut room = 2;
        let r = m.poll_deliver(&mut cx, |_, b| {
            if room == 0 {
                return Poll::Pending;
            }
            let n = b.len().min(room);
            room -= n;
            written.extend_from_slice(&b[..n]);
            Poll::Ready(Ok(n))
        });
        assert!(r.is_pending());
        assert_eq!(written, b"ab");
        assert_eq!(m.pending(), 4);
        let r = m.poll_deliver(&mut cx, |_, b| {
            written.extend_from_slice(b);
            Poll::Ready(Ok(b.len()))
        });
        assert!(r.is_pending(), "empty: waits for the next notification");
        assert_eq!(written, b"abcdef");
        assert!(!m.has_mail());
    }
}
