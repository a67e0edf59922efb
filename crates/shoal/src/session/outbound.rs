//! What one relay has to write, to the server and to the client, and where those bytes lie.
//!
//! Messages passed on unchanged (most of them) are not copied: they are written from the
//! buffer they were read into, the client's for queries and the server's for replies, and
//! only counted here (`direct_to_server`, `direct`). Each direction also has an output buffer,
//! taken from the pool only when Shoal writes something of its own (a rewritten prepared
//! statement, a hidden or synthetic reply) or a message is streamed. Before anything is
//! written into a direction's buffer, the bytes passed in place before it move there first,
//! so each peer sees its messages in order; while those bytes are in place, the buffer is
//! empty.

use crate::seam::Features as _;
use crate::Plugged;
use bytes::{Buf, BytesMut};
use shoal_wire::frame::HEADER_LEN;

/// Output buffers of one relay: what goes to the server and to the client next.
pub(super) struct Outbound {
    pub(super) to_server: BytesMut,
    /// Bytes at the head of the client's buffer that go to the server as they are: whole
    /// messages passed on unchanged, written from where they lie. Only while `to_server` is
    /// empty (see [`ClientSink`]).
    pub(super) direct_to_server: usize,
    pub(super) to_client: BytesMut,
    /// Bytes still to pass through of a client message being streamed (see [`STREAM_AT`]).
    pub(super) client_rest: usize,
    /// The same for a server message.
    pub(super) server_rest: usize,
    /// Bytes still to drop of a client COPY message sent outside a COPY (which PostgreSQL
    /// ignores): it never reaches the server.
    pub(super) client_discard: usize,
    /// Bytes at the head of the server's buffer that go to the client as they are: whole
    /// replies already looked at, written from where they lie instead of being copied. Only
    /// while `to_client` is empty: before Shoal adds or hides anything, these bytes move to
    /// `to_client` ([`Outbound::spill_to_client`]), so the client's stream keeps its order.
    pub(super) direct: usize,
    /// What this transaction did, added to the pool's metrics at its end.
    pub(super) counts: crate::metrics::TxnCounts,
    /// When the transaction (or, in session mode, the current one) began ([`crate::clock::mono_us`]).
    pub(super) txn_start: u64,
    /// When the query now running was sent (for the query-duration histogram).
    pub(super) query_start: Option<u64>,
    /// When the last answered ReadyForQuery arrived: the transaction's end, when it is the
    /// last (saves reading the clock again).
    pub(super) last_ready: Option<u64>,
    /// The server's replies stopped before a ReadyForQuery that must wait for the pool's
    /// listener connection (see [`super::listening`]).
    pub(super) listener_due: Option<super::listening::ListenerDue>,
    /// Someone in the pool listens: SQL that may notify claims the server.
    pub(super) notify_active: bool,
    /// The server is a replica chosen for reads (`read_routing = "split"`): only units
    /// proven to read are passed on (see [`super::reads`]).
    pub(super) reads_only: bool,
    /// Messages of the current unit already proven (see [`super::reads`]).
    pub(super) cleared: u32,
    /// Inside a block on a replica, a unit is under way (its messages are proven one by
    /// one, and the flow is not idle between them).
    pub(super) in_block_unit: bool,
    /// A unit not proven to read waits in the client's buffer for the transaction's end.
    pub(super) held: bool,
    /// On the primary of a split pool: units are proven as they pass, to tell whether the
    /// transaction may have written (read-your-writes).
    pub(super) track_writes: bool,
    /// A unit not proven to read was passed on (see `track_writes`).
    pub(super) wrote: bool,
    /// The pool's query rules as the transaction began (client messages only: replies need
    /// none).
    pub(super) rules: Option<crate::seam::Rules>,
    /// The reply being kept for the pool's cache (see `super::cached`).
    pub(super) capture: Option<crate::seam::Capture>,
    /// For the pool's cache, on its primary: what each statement may write, made stale
    /// before the client hears its transaction ended.
    pub(super) writes: Option<crate::seam::Writes>,
}

impl Outbound {
    /// `n` bytes reached the client, from `server_buf` (when passed in place) or from
    /// `to_client`: counted, and shown to the cache's capture of the reply.
    #[inline(always)]
    pub(super) fn sent_to_client(&mut self, n: usize, server_buf: &mut BytesMut) {
        self.counts.bytes_out += n as u64;
        if let Some(c) = self.capture.as_mut() {
            Plugged::feed(
                c,
                match self.direct {
                    0 => &self.to_client[..n],
                    _ => &server_buf[..n],
                },
            );
        }
        if self.direct > 0 {
            server_buf.advance(n);
            self.direct -= n;
        } else {
            self.to_client.advance(n);
        }
    }

    /// Nothing to write yet; both output buffers are taken when first needed, since most
    /// messages go out from the buffer they were read into.
    pub(super) fn new() -> Self {
        Outbound {
            to_server: BytesMut::new(),
            direct_to_server: 0,
            to_client: BytesMut::new(),
            client_rest: 0,
            server_rest: 0,
            client_discard: 0,
            direct: 0,
            counts: Default::default(),
            txn_start: crate::clock::mono_us(),
            query_start: None,
            last_ready: None,
            listener_due: None,
            notify_active: false,
            reads_only: false,
            cleared: 0,
            held: false,
            in_block_unit: false,
            track_writes: false,
            wrote: false,
            rules: None,
            capture: None,
            writes: None,
        }
    }

    /// Whether a message is only partly relayed: the server cannot be at a boundary, and
    /// must not serve anyone else if the relay ends now.
    pub(super) fn partial(&self) -> bool {
        self.client_rest > 0 || self.server_rest > 0
    }

    /// Whether anything waits to be written to the server.
    pub(super) fn server_pending(&self) -> bool {
        !self.to_server.is_empty() || self.direct_to_server > 0
    }

    /// Moves the client bytes passed in place into `to_server` (taken from the pool first),
    /// before anything else is written there.
    pub(super) fn spill_to_server(&mut self, cbuf: &mut BytesMut) {
        if self.to_server.capacity() == 0 {
            self.to_server = crate::bufpool::take();
        }
        if self.direct_to_server > 0 {
            self.to_server
                .extend_from_slice(&cbuf[..self.direct_to_server]);
            cbuf.advance(self.direct_to_server);
            self.direct_to_server = 0;
        }
    }

    /// Moves the server bytes passed in place (`direct`) into `to_client` (taken from the
    /// pool first), before anything else is written there.
    pub(super) fn spill_to_client(&mut self, server_buf: &mut BytesMut) {
        if self.to_client.capacity() == 0 {
            self.to_client = crate::bufpool::take();
        }
        if self.direct > 0 {
            self.to_client.extend_from_slice(&server_buf[..self.direct]);
            server_buf.advance(self.direct);
            self.direct = 0;
        }
    }

    /// Adds what was counted to the pool's metrics and starts counting afresh.
    pub(super) fn flush_counts(&mut self, pool: &crate::pool::Pool) {
        if self.counts.slowest_us > 0 {
            pool.note_query_time(self.counts.slowest_us);
        }
        let now = self.last_ready.take().unwrap_or_else(crate::clock::mono_us);
        let held = now.saturating_sub(self.txn_start);
        pool.metrics.add(&self.counts, held);
        self.counts = Default::default();
        self.txn_start = now;
    }
}

/// The translation's output for one client message (see [`crate::prepared::ToServer`]): a
/// message passed on unchanged while nothing else waits for the server stays in the client's
/// buffer; anything written moves the bytes passed in place before it (`head`, and the message
/// itself if it was passed) into `to_server` first. The message is borrowed from the client
/// buffer meanwhile, so the relay moves the buffer on afterwards ([`ClientSink::settle`]).
pub(super) struct ClientSink<'a> {
    /// The client bytes passed in place by earlier messages (`cbuf[..direct_to_server]`).
    head: &'a [u8],
    /// The message being translated (it follows `head` in the client buffer).
    msg: &'a [u8],
    to_server: &'a mut BytesMut,
    /// `msg` was passed and stays where it is.
    in_place: bool,
    /// `head` (and `msg`, if it was passed in place) went into `to_server`.
    spilled: bool,
}

impl<'a> ClientSink<'a> {
    pub(super) fn new(head: &'a [u8], msg: &'a [u8], to_server: &'a mut BytesMut) -> Self {
        ClientSink {
            head,
            msg,
            to_server,
            in_place: false,
            spilled: false,
        }
    }

    /// How the client buffer moves on after the message: (bytes to drop from its front, the
    /// new `direct_to_server`).
    pub(super) fn settle(mut self) -> (usize, usize) {
        let (d, n) = (self.head.len(), self.msg.len());
        if self.in_place {
            return (0, d + n);
        }
        if !self.spilled && d > 0 {
            // The message sends nothing: the bytes in place before it cannot stay, or its
            // own would sit between them.
            let _ = crate::prepared::ToServer::buf(&mut self);
        }
        if self.spilled {
            (d + n, 0)
        } else {
            (n, 0)
        }
    }
}

impl crate::prepared::ToServer for ClientSink<'_> {
    #[inline]
    fn pass(&mut self, msg: &[u8]) {
        debug_assert!(
            std::ptr::eq(msg, self.msg),
            "only the message being translated is passed"
        );
        if !self.spilled && !self.in_place && self.to_server.is_empty() {
            self.in_place = true;
            return;
        }
        self.buf().extend_from_slice(msg);
    }

    fn buf(&mut self) -> &mut BytesMut {
        if !self.spilled {
            if self.to_server.capacity() == 0 {
                *self.to_server = crate::bufpool::take();
            }
            self.to_server.extend_from_slice(self.head);
            if std::mem::take(&mut self.in_place) {
                self.to_server.extend_from_slice(self.msg);
            }
            self.spilled = true;
        }
        self.to_server
    }
}

/// Messages Shoal never looks inside (COPY data both ways, rows from the server) are streamed
/// through once larger than this, instead of being buffered whole: memory per client stays
/// bounded however large a row or a COPY chunk is.
const STREAM_AT: usize = 64 * 1024;

/// Starts streaming the message at the head of `buf` if it is one to stream and is not all
/// there yet; returns its total length.
pub(super) fn stream_start(buf: &[u8], tags: &[u8]) -> Option<usize> {
    if buf.len() < HEADER_LEN || !tags.contains(&buf[0]) {
        return None;
    }
    let total = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize + 1;
    (total > STREAM_AT && buf.len() < total).then_some(total)
}

/// Moves up to `rest` bytes of a streamed message from `from` to `to`.
pub(super) fn stream_some(from: &mut BytesMut, to: &mut BytesMut, rest: &mut usize) {
    let n = (*rest).min(from.len());
    to.extend_from_slice(&from[..n]);
    from.advance(n);
    *rest -= n;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepared::ToServer;

    /// Runs one message through a sink over `cbuf = head ++ msg ++ rest`; returns what went
    /// into `to_server`, and what the relay would then write in all (from the buffer first
    /// when bytes stay in place), and the client buffer left after settling.
    fn through(
        head: &[u8],
        msg: &[u8],
        earlier: &[u8],
        act: impl FnOnce(&mut ClientSink<'_>, &[u8]),
    ) -> (Vec<u8>, Vec<u8>) {
        let mut cbuf = BytesMut::new();
        cbuf.extend_from_slice(head);
        cbuf.extend_from_slice(msg);
        cbuf.extend_from_slice(b"rest");
        let mut to_server = BytesMut::from(earlier);
        let (consumed, direct) = {
            let (h, tail) = cbuf.split_at(head.len());
            let m = &tail[..msg.len()];
            let mut sink = ClientSink::new(h, m, &mut to_server);
            act(&mut sink, m);
            sink.settle()
        };
        cbuf.advance(consumed);
        let mut sent = cbuf[..direct].to_vec();
        sent.extend_from_slice(&to_server);
        assert!(
            direct == 0 || to_server.is_empty(),
            "bytes in place and buffered bytes never wait together"
        );
        cbuf.advance(direct);
        assert_eq!(&cbuf[..], b"rest", "the unread rest stays");
        (sent, to_server.to_vec())
    }

    #[test]
    fn passed_messages_stay_in_place_after_earlier_ones() {
        let (sent, buffered) = through(b"", b"M1", b"", |s, m| s.pass(m));
        assert_eq!(sent, b"M1");
        assert!(buffered.is_empty(), "nothing copied");
        let (sent, buffered) = through(b"H0", b"M1", b"", |s, m| s.pass(m));
        assert_eq!(sent, b"H0M1");
        assert!(buffered.is_empty());
    }

    #[test]
    fn writes_keep_the_order_of_what_was_passed() {
        // Something put in before the message (a Parse for the unnamed statement).
        let (sent, _) = through(b"H0", b"M1", b"", |s, m| {
            s.buf().extend_from_slice(b"P");
            s.pass(m);
        });
        assert_eq!(sent, b"H0PM1");
        // Something after it.
        let (sent, _) = through(b"H0", b"M1", b"", |s, m| {
            s.pass(m);
            s.buf().extend_from_slice(b"S");
        });
        assert_eq!(sent, b"H0M1S");
        // The message rewritten.
        let (sent, _) = through(b"H0", b"M1", b"", |s, _| {
            s.buf().extend_from_slice(b"R1");
        });
        assert_eq!(sent, b"H0R1");
    }

    #[test]
    fn a_message_that_sends_nothing_leaves_no_gap() {
        let (sent, _) = through(b"H0", b"M1", b"", |_, _| {});
        assert_eq!(sent, b"H0");
        let (sent, _) = through(b"", b"M1", b"", |_, _| {});
        assert!(sent.is_empty());
    }

    #[test]
    fn after_buffered_bytes_a_passed_message_is_copied_behind_them() {
        let (sent, buffered) = through(b"", b"M1", b"E0", |s, m| s.pass(m));
        assert_eq!(sent, b"E0M1");
        assert_eq!(buffered, b"E0M1");
    }

    #[test]
    fn server_bytes_in_place_move_to_the_client_buffer_before_anything_else() {
        let mut out = Outbound::new();
        out.direct = 4;
        let mut server_buf = BytesMut::from(&b"T1D2next"[..]);
        out.spill_to_client(&mut server_buf);
        assert_eq!(&out.to_client[..], b"T1D2");
        assert_eq!(&server_buf[..], b"next");
        assert_eq!(out.direct, 0);
        let mut cbuf = BytesMut::from(&b"Q1more"[..]);
        out.direct_to_server = 2;
        out.spill_to_server(&mut cbuf);
        assert_eq!(&out.to_server[..], b"Q1");
        assert_eq!(&cbuf[..], b"more");
        assert_eq!(out.direct_to_server, 0);
        assert!(
            out.server_pending(),
            "the moved bytes still wait for the server"
        );
    }
}
