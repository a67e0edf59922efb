//! One client's stream over a link (see [`super::mux`]): reads from its inbox, writes within
//! the peer's window, and a state snapshot beside the bytes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::frame::{self, Kind, MAX_PAYLOAD};
use super::mux::{lost, park, wake, Link, CREDIT_BATCH, KEEP_INBOX, MAX_STATE};

/// One client's stream over a link.
pub struct LinkStream {
    link: Link,
    id: u32,
}

impl LinkStream {
    pub(super) fn new(link: Link, id: u32) -> LinkStream {
        LinkStream { link, id }
    }

    /// The node at the other end.
    pub fn peer(&self) -> &str {
        self.link.peer()
    }

    /// Ready when a read would not wait: bytes are there, or the stream or link ended; also,
    /// once, when a new state snapshot arrived (a read may then find nothing).
    pub fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.link.lock();
        let dead = s.dead.is_some();
        let Some(slot) = s.streams.get_mut(&self.id) else {
            return Poll::Ready(Ok(()));
        };
        if std::mem::take(&mut slot.state_fresh)
            || !slot.inbox.is_empty()
            || slot.peer_closed.is_some()
            || dead
        {
            return Poll::Ready(Ok(()));
        }
        park(&mut slot.reader, cx);
        Poll::Pending
    }

    /// Moves what arrived into `buf` (at most its spare capacity, if it has any).
    /// `Ready(Ok(0))`: the peer closed the stream.
    pub fn poll_read_buf(
        &self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        let room = buf.capacity() - buf.len();
        let max = if room == 0 { usize::MAX } else { room };
        self.poll_take(cx, max, &mut |d| buf.extend_from_slice(d))
    }

    /// Hands at most `max` bytes that arrived to `sink`, returning credit to the peer.
    fn poll_take(
        &self,
        cx: &mut Context<'_>,
        max: usize,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Poll<io::Result<usize>> {
        let mut guard = self.link.lock();
        let s = &mut *guard;
        let Some(slot) = s.streams.get_mut(&self.id) else {
            return Poll::Ready(Ok(0));
        };
        if !slot.inbox.is_empty() {
            let n = slot.inbox.len().min(max);
            sink(&slot.inbox[..n]);
            slot.inbox.advance(n);
            if slot.inbox.is_empty() && slot.inbox.capacity() > KEEP_INBOX {
                slot.inbox = BytesMut::new();
            }
            slot.consumed += n;
            if slot.consumed >= CREDIT_BATCH && slot.peer_closed.is_none() && s.dead.is_none() {
                let c = (std::mem::take(&mut slot.consumed) as u32).to_be_bytes();
                s.queue(Kind::Credit, self.id, &c);
            }
            return Poll::Ready(Ok(n));
        }
        if slot.peer_closed.is_some() {
            return Poll::Ready(Ok(0));
        }
        if let Some(r) = &s.dead {
            return Poll::Ready(Err(lost(r)));
        }
        park(&mut slot.reader, cx);
        Poll::Pending
    }

    /// Queues as much of `data` as the peer's window allows (at least one byte, or waits).
    pub fn poll_write_data(&self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let mut guard = self.link.lock();
        let s = &mut *guard;
        if let Some(r) = &s.dead {
            return Poll::Ready(Err(lost(r)));
        }
        let Some(slot) = s.streams.get_mut(&self.id) else {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        };
        if slot.peer_closed.is_some() || slot.local_closed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the stream was closed",
            )));
        }
        if data.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if slot.send_credit == 0 {
            park(&mut slot.writer, cx);
            return Poll::Pending;
        }
        let n = data.len().min(slot.send_credit).min(MAX_PAYLOAD);
        slot.send_credit -= n;
        s.queue(Kind::Data, self.id, &data[..n]);
        Poll::Ready(Ok(n))
    }

    /// Ends this side of the stream, telling the peer why (shown to no client: for logs).
    pub fn close(&self, why: &str) {
        let mut guard = self.link.lock();
        let s = &mut *guard;
        let Some(slot) = s.streams.get_mut(&self.id) else {
            return;
        };
        if slot.local_closed {
            return;
        }
        slot.local_closed = true;
        if s.dead.is_none() {
            let why = &why.as_bytes()[..why.len().min(1024)];
            s.queue(Kind::Close, self.id, why);
        }
    }

    /// Sends the peer a state snapshot of this stream (replacing the one it had).
    pub fn send_state(&self, snapshot: &[u8]) -> io::Result<()> {
        if snapshot.len() > MAX_STATE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "state too large",
            ));
        }
        let mut guard = self.link.lock();
        let s = &mut *guard;
        if let Some(r) = &s.dead {
            return Err(lost(r));
        }
        let mut pieces = snapshot.chunks(MAX_PAYLOAD - 1).peekable();
        if pieces.peek().is_none() {
            frame::put_frame(&mut s.out, Kind::State, self.id, &[frame::STATE_LAST]);
        }
        while let Some(piece) = pieces.next() {
            let flags = if pieces.peek().is_none() {
                frame::STATE_LAST
            } else {
                0
            };
            frame::put_header(&mut s.out, Kind::State, self.id, piece.len() + 1);
            s.out.extend_from_slice(&[flags]);
            s.out.extend_from_slice(piece);
        }
        wake(&mut s.writer);
        Ok(())
    }

    /// Whether bytes arrived that were not read yet.
    pub fn has_data(&self) -> bool {
        let s = self.link.lock();
        s.streams
            .get(&self.id)
            .is_some_and(|slot| !slot.inbox.is_empty())
    }

    /// The last complete state snapshot the peer sent for this stream.
    pub fn state(&self) -> Option<Bytes> {
        let s = self.link.lock();
        s.streams.get(&self.id).and_then(|slot| slot.state.clone())
    }

    /// Why the peer closed the stream, if it did and said.
    pub fn peer_closed(&self) -> Option<String> {
        let s = self.link.lock();
        s.streams
            .get(&self.id)
            .and_then(|slot| slot.peer_closed.as_deref().map(str::to_owned))
    }
}

impl Drop for LinkStream {
    fn drop(&mut self) {
        self.close("");
        crate::tables::remove(&mut self.link.lock().streams, &self.id);
    }
}

impl AsyncRead for LinkStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let max = buf.remaining();
        self.poll_take(cx, max, &mut |d| buf.put_slice(d))
            .map_ok(|_| ())
    }
}

impl AsyncWrite for LinkStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_data(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Queued frames are the driver's to write.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.close("");
        Poll::Ready(Ok(()))
    }
}
