//! The relay between a client and the server it holds: a non-blocking loop that moves whole
//! messages both ways without decoding most of them, and keeps just enough protocol state to
//! know when the server can go back to the pool.
//!
//! Messages are forwarded as byte ranges of the read buffers: a read, a scan of the new
//! message headers, and one write of everything complete. Both directions are driven by
//! readiness, so neither side can stall the other (a client pipelining a large batch while
//! PostgreSQL streams results back cannot deadlock the relay).

use bytes::Buf;
use shoal_wire::backend::{self, tag as be, ErrorFields};
use shoal_wire::frame::next_frame_len;
use shoal_wire::frontend::tag as fe;

use std::pin::Pin;
use std::task::Poll;

use tokio::io::AsyncWrite;

use super::{Session, SessionError};
use crate::net::poll_read_buf;
use crate::pool::Lease;
use crate::server::ServerConn;

/// Read granularity; buffers grow beyond it only for larger messages.
pub const READ_CHUNK: usize = 8192;
/// Read into what is left of a buffer while at least this much is.
const MIN_READ_ROOM: usize = 2048;
/// Stop reading a side while this much is waiting to be written to the other.
const HIGH_WATER: usize = 256 * 1024;
/// Bound on a single message from a server.
const SERVER_MAX_MESSAGE: usize = 1 << 30;

/// What the protocol still owes on the current server connection.
#[derive(Debug, Clone)]
pub struct Flow {
    /// ReadyForQuery messages still to come (one per Query, FunctionCall and Sync sent).
    pub pending: u32,
    /// Extended-protocol messages were sent after the last Sync.
    pub unsynced: bool,
    /// The server is in COPY FROM STDIN and waits for the client's data.
    pub copy_in: bool,
    /// Syncs sent since the last Execute: the server ignores them if that Execute starts a
    /// COPY FROM STDIN, so they must not be counted as owed ReadyForQuery messages.
    syncs_after_execute: Option<u32>,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            pending: 0,
            unsynced: false,
            copy_in: false,
            syncs_after_execute: None,
            status: b'I',
        }
    }
}

impl Flow {
    /// The server has answered everything and no transaction is open.
    pub fn at_boundary(&self) -> bool {
        self.pending == 0 && !self.unsynced && !self.copy_in && self.status == b'I'
    }
}

/// Why the relay stopped.
pub enum RelayEnd {
    /// Transaction boundary reached (transaction mode only).
    Boundary,
    /// The client sent Terminate.
    Terminate,
    /// The client's connection ended.
    ClientGone,
    /// The server connection failed; carries PostgreSQL's FATAL error if it sent one.
    ServerLost(Option<ErrorFields>),
}

/// Result of scanning newly read client bytes.
enum ClientScan {
    Ok,
    Terminate,
}

fn scan_client(
    buf: &[u8],
    ready: &mut usize,
    flow: &mut Flow,
    max: usize,
) -> Result<ClientScan, SessionError> {
    while let Some(n) = next_frame_len(&buf[*ready..], max).map_err(SessionError::from_frame)? {
        match buf[*ready] {
            fe::QUERY | fe::FUNCTION_CALL => {
                flow.pending += 1;
                flow.syncs_after_execute = None;
            }
            fe::SYNC => {
                if !flow.copy_in {
                    flow.pending += 1;
                }
                flow.unsynced = false;
                if let Some(k) = flow.syncs_after_execute.as_mut() {
                    *k += 1;
                }
            }
            fe::EXECUTE => {
                flow.unsynced = true;
                flow.syncs_after_execute = Some(0);
            }
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::CLOSE => flow.unsynced = true,
            fe::FLUSH | fe::COPY_DATA => {}
            fe::COPY_DONE | fe::COPY_FAIL => flow.copy_in = false,
            fe::TERMINATE => return Ok(ClientScan::Terminate),
            other => return Err(SessionError::UnknownMessage(other)),
        }
        *ready += n;
    }
    Ok(ClientScan::Ok)
}

/// Result of scanning newly read server bytes.
enum ServerScan {
    Ok,
    /// A FATAL error at this offset: the server is going away.
    Fatal(ErrorFields),
}

fn scan_server(
    server: &mut ServerConn,
    ready: &mut usize,
    flow: &mut Flow,
) -> Result<ServerScan, SessionError> {
    loop {
        let buf = &server.buf[*ready..];
        let Some(n) =
            next_frame_len(buf, SERVER_MAX_MESSAGE).map_err(SessionError::server_protocol)?
        else {
            return Ok(ServerScan::Ok);
        };
        let body = &buf[5..n];
        match buf[0] {
            be::READY_FOR_QUERY => {
                flow.pending = flow.pending.saturating_sub(1);
                flow.status = body.first().copied().unwrap_or(b'I');
            }
            be::ERROR_RESPONSE => {
                flow.copy_in = false;
                let e = backend::parse_error(body).map_err(SessionError::server_protocol)?;
                if e.is_fatal() {
                    return Ok(ServerScan::Fatal(e));
                }
            }
            be::COPY_IN_RESPONSE => {
                flow.copy_in = true;
                if let Some(k) = flow.syncs_after_execute.take() {
                    flow.pending = flow.pending.saturating_sub(k);
                }
            }
            be::PARAMETER_STATUS => {
                let (k, v) =
                    backend::parse_parameter_status(body).map_err(SessionError::server_protocol)?;
                let (k, v) = (k.to_owned(), v.to_owned());
                server.set_param(&k, &v);
            }
            _ => {}
        }
        *ready += n;
    }
}

impl Session {
    /// Relays until the transaction boundary (when `release` is set), the client leaves, or
    /// the server fails. Leftover client bytes (a partial message) stay in `self.cbuf`; when
    /// the server fails, client messages already counted against it are dropped with it (the
    /// client gets an error for them instead of seeing them run twice).
    pub(super) async fn relay(
        &mut self,
        lease: &mut Lease,
        flow: &mut Flow,
        release: bool,
    ) -> Result<RelayEnd, SessionError> {
        let mut c_ready = 0usize;
        let end = self.relay_loop(lease, flow, release, &mut c_ready).await;
        if let Ok(RelayEnd::ServerLost(_)) = end {
            self.cbuf.advance(c_ready);
        }
        end
    }

    async fn relay_loop(
        &mut self,
        lease: &mut Lease,
        flow: &mut Flow,
        release: bool,
        c_ready: &mut usize,
    ) -> Result<RelayEnd, SessionError> {
        let max = self.app.config.server.max_packet_size;
        let mut s_ready = 0usize;
        let mut terminate = matches!(
            scan_client(&self.cbuf, c_ready, flow, max)?,
            ClientScan::Terminate
        );
        let mut fatal: Option<ErrorFields> = None;
        let server: &mut ServerConn = lease;
        loop {
            if s_ready == 0 {
                if let Some(e) = fatal.take() {
                    return Ok(RelayEnd::ServerLost(Some(e)));
                }
            }
            if *c_ready == 0 && s_ready == 0 {
                if terminate {
                    return Ok(RelayEnd::Terminate);
                }
                if release && flow.at_boundary() {
                    return Ok(RelayEnd::Boundary);
                }
            }
            let read_server = s_ready < HIGH_WATER && fatal.is_none();
            let read_client = *c_ready < HIGH_WATER && !terminate;
            // One step: the first operation that can make progress, in an order that drains
            // before it fills. Pending operations leave their wakers registered.
            let step = std::future::poll_fn(|cx| {
                if *c_ready > 0 {
                    if let Poll::Ready(r) =
                        Pin::new(&mut server.stream).poll_write(cx, &self.cbuf[..*c_ready])
                    {
                        return Poll::Ready(Step::ToServer(r));
                    }
                }
                if s_ready > 0 {
                    if let Poll::Ready(r) = self.stream.poll_write(cx, &server.buf[..s_ready]) {
                        return Poll::Ready(Step::ToClient(r));
                    }
                }
                if read_server {
                    reserve_for_next(&mut server.buf, s_ready);
                    if let Poll::Ready(r) = poll_read_buf(&mut server.stream, cx, &mut server.buf) {
                        return Poll::Ready(Step::FromServer(r));
                    }
                }
                if read_client {
                    reserve_for_next(&mut self.cbuf, *c_ready);
                    if let Poll::Ready(r) = self.stream.poll_read_buf(cx, &mut self.cbuf) {
                        return Poll::Ready(Step::FromClient(r));
                    }
                }
                Poll::Pending
            })
            .await;
            match step {
                Step::ToServer(Ok(n)) => {
                    self.cbuf.advance(n);
                    *c_ready -= n;
                }
                Step::ToServer(Err(_)) => return Ok(RelayEnd::ServerLost(fatal)),
                Step::ToClient(Ok(n)) => {
                    server.buf.advance(n);
                    s_ready -= n;
                }
                Step::ToClient(Err(_)) => return Ok(RelayEnd::ClientGone),
                Step::FromServer(Ok(0)) | Step::FromServer(Err(_)) => {
                    return Ok(RelayEnd::ServerLost(None))
                }
                Step::FromServer(Ok(_)) => {
                    if let ServerScan::Fatal(e) = scan_server(server, &mut s_ready, flow)? {
                        if !release {
                            // Session mode: pass the FATAL on, as PostgreSQL would.
                            // Transaction mode keeps the client and reports an ERROR once
                            // the replies before it are out.
                            if let Ok(Some(n)) =
                                next_frame_len(&server.buf[s_ready..], SERVER_MAX_MESSAGE)
                            {
                                s_ready += n;
                            }
                        }
                        fatal = Some(e);
                    }
                }
                Step::FromClient(Ok(0)) | Step::FromClient(Err(_)) => {
                    return Ok(RelayEnd::ClientGone)
                }
                Step::FromClient(Ok(_)) => {
                    if let ClientScan::Terminate = scan_client(&self.cbuf, c_ready, flow, max)? {
                        terminate = true;
                    }
                }
            }
        }
    }
}

/// What one poll of the relay achieved.
enum Step {
    ToServer(std::io::Result<usize>),
    ToClient(std::io::Result<usize>),
    FromServer(std::io::Result<usize>),
    FromClient(std::io::Result<usize>),
}

/// Makes room for the next read: at least [`MIN_READ_ROOM`] bytes (a fresh chunk when less is
/// left), or the rest of a large message whose header is already buffered.
pub fn reserve_for_next(buf: &mut bytes::BytesMut, ready: usize) {
    if buf.capacity() == 0 {
        *buf = crate::bufpool::take();
    }
    let pending = &buf[ready..];
    let mut want = MIN_READ_ROOM;
    if pending.len() >= 5 {
        let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize + 1;
        // Grow towards a large message in steps, so a peer announcing a huge message and
        // sending it slowly cannot make us allocate it all up front.
        want = want.max(len.saturating_sub(pending.len()).min(1 << 20));
    }
    if buf.capacity() - buf.len() < want {
        buf.reserve(want.max(READ_CHUNK));
    }
}
