//! The pool's listener connection: one task (on the control runtime) that keeps a server
//! connection LISTENing to every channel the pool's clients listen to, hands notifications
//! to their mailboxes, and reconnects when the connection is lost. It ends, closing its
//! connection, once nobody listens.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::BytesMut;
use shoal_wire::backend::{self, tag};
use shoal_wire::frame::Frame;
use shoal_wire::frontend;

use super::{Barrier, Hub, Put};

use crate::pool::Pool;
use crate::server::{ServerConn, ServerError};

/// Bound on one message from the listener connection (a notification's payload is under
/// 8,000 bytes; the bound is PostgreSQL's for any message).
const MAX_MESSAGE: usize = 1 << 30;

/// How long a notifier's ReadyForQuery waits for idle listeners to have its notifications
/// on their sockets.
const SETTLE_LIMIT: Duration = Duration::from_millis(200);

/// The longest pause between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// SQLSTATE of the warning sent when notifications may have been lost (`warning`).
const WARNING: &str = "01000";

/// One request sent on the listener connection, answered by one ReadyForQuery.
struct InFlight {
    what: Request,
    /// Once answered, the connection listens to this `State::wanted` (all requests up to it
    /// are answered).
    reaches: Option<u64>,
}

enum Request {
    Listen(Box<[u8]>),
    Unlisten(Box<[u8]>),
    /// A Sync: answered after every notification committed before it was sent.
    Barrier(Vec<Barrier>),
}

/// Why a connection's service ended.
enum End {
    /// Nobody listens any more: the task is over.
    Done,
    /// The connection failed.
    Lost(ServerError),
}

pub(super) async fn run(pool: Weak<Pool>, hub: Arc<Hub>) {
    let mut backoff = Duration::from_millis(100);
    let mut lost = false;
    loop {
        let Some(p) = pool.upgrade() else { return };
        if hub.stop_if_unused() {
            return;
        }
        match ServerConn::connect(&p.upstream, p.settings.connect_timeout).await {
            Ok(conn) => {
                backoff = Duration::from_millis(100);
                tracing::debug!(pool = %p.name, pid = conn.process_id, "listener connection open");
                match serve(&hub, conn, lost).await {
                    End::Done => return,
                    End::Lost(e) => {
                        lost = true;
                        hub.counts.listener_lost.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(pool = %p.name, error = %crate::logsafe::Escaped(&e), "listener connection lost; notifications sent until it is back are lost");
                        hub.connection_lost();
                    }
                }
            }
            Err(e) => {
                tracing::warn!(pool = %p.name, error = %crate::logsafe::Escaped(&e), retry_in_ms = backoff.as_millis() as u64, "cannot open the listener connection");
                // Nothing can be delivered meanwhile: barriers wait for nothing.
                hub.connection_lost();
                drop(p);
                crate::timer::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Serves one listener connection until it fails or nobody listens. `after_loss`: an
/// earlier connection was lost, so listeners are warned once this one listens.
async fn serve(hub: &Hub, mut conn: ServerConn, after_loss: bool) -> End {
    hub.lock().connected = true;
    let mut c = Conn {
        listened: HashSet::new(),
        in_flight: VecDeque::new(),
        refused: HashSet::new(),
        out: BytesMut::new(),
    };
    let mut warn_when_listening = after_loss;
    loop {
        if let Some(end) = c.send_due(hub, &mut conn).await {
            if matches!(end, End::Done) {
                conn.close().await;
            }
            return end;
        }
        if warn_when_listening && c.in_flight.is_empty() {
            warn_when_listening = false;
            hub.warn_all(
                "notifications sent while Shoal's listening connection to the server was lost \
                 were not delivered; it is back, and later notifications are delivered",
            );
        }
        tokio::select! {
            frame = conn.read_frame() => match frame {
                Ok(frame) => {
                    if let Err(e) = c.received_all(hub, frame, &mut conn) {
                        return End::Lost(e);
                    }
                }
                Err(e) => return End::Lost(e),
            },
            () = hub.wake.notified() => {}
        }
    }
}

/// One listener connection's state.
struct Conn {
    /// Channels LISTENed to, or asked to be (requests are answered in order).
    listened: HashSet<Box<[u8]>>,
    in_flight: VecDeque<InFlight>,
    /// Channels the server refused to LISTEN to on this connection: not asked again.
    refused: HashSet<Box<[u8]>>,
    out: BytesMut,
}

impl Conn {
    /// Sends what the hub's state calls for: LISTEN and UNLISTEN for channels that changed,
    /// a Sync for barriers. `Some(Done)` when nobody listens and nothing is owed.
    async fn send_due(&mut self, hub: &Hub, conn: &mut ServerConn) -> Option<End> {
        self.out.clear();
        {
            let mut s = hub.lock();
            if s.subscribers.is_empty() && s.barriers.is_empty() && self.in_flight.is_empty() {
                s.running = false;
                s.connected = false;
                s.in_force = s.wanted;
                for (_, w) in s.waiters.drain(..) {
                    let _ = w.send(());
                }
                return Some(End::Done);
            }
            let wanted = s.wanted;
            let drop_now: Vec<Box<[u8]>> = self
                .listened
                .iter()
                .filter(|c| !s.subscribers.contains_key(*c))
                .cloned()
                .collect();
            for c in drop_now {
                self.listened.remove(&c);
                self.request(Request::Unlisten(c));
            }
            let add: Vec<Box<[u8]>> = s
                .subscribers
                .keys()
                .filter(|c| !self.listened.contains(*c) && !self.refused.contains(*c))
                .cloned()
                .collect();
            for c in add {
                self.listened.insert(c.clone());
                self.request(Request::Listen(c));
            }
            if s.in_force < wanted {
                match self.in_flight.back_mut() {
                    Some(last_req) => last_req.reaches = Some(wanted),
                    None => s.reached(wanted),
                }
            }
            let barriers = std::mem::take(&mut s.barriers);
            if !barriers.is_empty() {
                frontend::sync(&mut self.out);
                self.in_flight.push_back(InFlight {
                    what: Request::Barrier(barriers),
                    reaches: None,
                });
            }
        }
        if !self.out.is_empty() {
            if let Err(e) = conn.stream.write_all(&self.out).await {
                return Some(End::Lost(e.into()));
            }
        }
        None
    }

    fn request(&mut self, what: Request) {
        let (verb, channel) = match &what {
            Request::Listen(c) => ("LISTEN", c),
            Request::Unlisten(c) => ("UNLISTEN", c),
            Request::Barrier(_) => unreachable!("barriers are Syncs"),
        };
        // Channels come from the client's own LISTEN, which its server accepted: text in the
        // connection's encoding, quoted here so any name (spaces, quotes, case) stays itself.
        let name = String::from_utf8_lossy(channel).replace('"', "\"\"");
        frontend::query(&mut self.out, &format!("{verb} \"{name}\""));
        self.in_flight.push_back(InFlight {
            what,
            reaches: None,
        });
    }

    /// `first` and every other whole message read with it; the clients given notifications
    /// are woken once all of them are in their mailboxes.
    fn received_all(
        &mut self,
        hub: &Hub,
        first: Frame,
        conn: &mut ServerConn,
    ) -> Result<(), ServerError> {
        let mut woken: Vec<Arc<super::Mailbox>> = Vec::new();
        let mut next = Some(first);
        let result = loop {
            let Some(frame) = next.take() else {
                break Ok(());
            };
            if let Err(e) = self.received(hub, &frame, &mut woken) {
                break Err(e);
            }
            match Frame::split(&mut conn.buf, MAX_MESSAGE) {
                Ok(f) => next = f,
                Err(e) => break Err(e.into()),
            }
        };
        for m in woken {
            m.wake();
        }
        result
    }

    /// One message from the listener connection.
    fn received(
        &mut self,
        hub: &Hub,
        frame: &Frame,
        woken: &mut Vec<Arc<super::Mailbox>>,
    ) -> Result<(), ServerError> {
        match frame.tag() {
            tag::NOTIFICATION_RESPONSE => {
                let n = backend::parse_notification(frame.body())?;
                hub.deliver(&n, frame.as_bytes(), woken);
            }
            tag::READY_FOR_QUERY => {
                let Some(done) = self.in_flight.pop_front() else {
                    return Err(ServerError::Protocol("unexpected ReadyForQuery".into()));
                };
                if let Request::Barrier(barriers) = done.what {
                    // Everything the barriers' transactions sent is in the mailboxes; their
                    // clients go on once idle listeners have it on their sockets too.
                    let mut s = hub.lock();
                    s.claims
                        .retain(|c| !barriers.iter().any(|b| b.server_pid == c.0));
                    let mut pending: Vec<Arc<super::Mailbox>> = Vec::new();
                    for m in s.subscribers.values().flatten() {
                        if m.has_mail() && !pending.iter().any(|p| Arc::ptr_eq(p, m)) {
                            pending.push(m.clone());
                        }
                    }
                    drop(s);
                    // Woken before the wait: nothing of this batch is held back.
                    for m in woken.drain(..) {
                        m.wake();
                    }
                    tokio::spawn(async move {
                        let settled = async {
                            for m in &pending {
                                m.until_settled().await;
                            }
                        };
                        // A listener that reads nothing must not hold notifiers up for long.
                        let _ = crate::timer::timeout(SETTLE_LIMIT, settled).await;
                        for b in barriers {
                            let _ = b.done.send(());
                        }
                    });
                }
                if let Some(wanted) = done.reaches {
                    hub.lock().reached(wanted);
                }
            }
            tag::ERROR_RESPONSE => {
                let e = backend::parse_error(frame.body())?;
                if e.is_fatal() {
                    return Err(ServerError::Db(e));
                }
                if let Some(InFlight {
                    what: Request::Listen(c),
                    ..
                }) = self.in_flight.front()
                {
                    // Its clients still wait for nothing: they are told by a warning.
                    tracing::warn!(channel = %crate::logsafe::Escaped(&String::from_utf8_lossy(c)), message = %crate::logsafe::Escaped(&e.message), "listener connection refused a LISTEN");
                    let c = c.clone();
                    self.listened.remove(&c);
                    self.refused.insert(c.clone());
                    hub.warn_channel(
                        &c,
                        &format!(
                            "Shoal's listening connection could not LISTEN to this channel ({}); its notifications are not delivered",
                            e.message
                        ),
                    );
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl super::State {
    /// The listener LISTENs to what `wanted` named: the clients waiting for it go on.
    pub(super) fn reached(&mut self, wanted: u64) {
        self.in_force = self.in_force.max(wanted);
        let in_force = self.in_force;
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].0 <= in_force {
                let (_, w) = self.waiters.swap_remove(i);
                let _ = w.send(());
            } else {
                i += 1;
            }
        }
    }
}

impl Hub {
    /// Nobody listens and nothing is asked: the task ends (a later `update` starts another).
    fn stop_if_unused(&self) -> bool {
        let mut s = self.lock();
        if s.subscribers.is_empty() && s.barriers.is_empty() {
            s.running = false;
            s.in_force = s.wanted;
            for (_, w) in s.waiters.drain(..) {
                let _ = w.send(());
            }
            return true;
        }
        false
    }

    /// The connection is gone: barriers have nothing to wait for.
    fn connection_lost(&self) {
        let mut s = self.lock();
        s.connected = false;
        let barriers = std::mem::take(&mut s.barriers);
        s.claims
            .retain(|c| !barriers.iter().any(|b| b.server_pid == c.0));
        drop(s);
        for b in barriers {
            let _ = b.done.send(());
        }
    }

    /// Puts one notification (`n`, whose message is `msg`) in the mailbox of every client
    /// listening to its channel; one sent by a client's claimed server carries the client's
    /// process id.
    fn deliver(
        &self,
        n: &backend::Notification<'_>,
        msg: &[u8],
        woken: &mut Vec<Arc<super::Mailbox>>,
    ) {
        let s = self.lock();
        let Some(list) = s.subscribers.get(n.channel) else {
            return;
        };
        let mapped;
        let msg = match s.claims.iter().find(|c| c.0 == n.process_id) {
            Some(&(_, client_pid)) => {
                let mut m = BytesMut::new();
                backend::notification_response(&mut m, client_pid, n.channel, n.payload);
                mapped = m;
                &mapped[..]
            }
            None => msg,
        };
        let mut delivered = 0;
        for m in list {
            if !woken.iter().any(|w| Arc::ptr_eq(w, m)) {
                woken.push(m.clone());
            }
            match m.put_quietly(msg) {
                Put::Queued => delivered += 1,
                Put::Overflowed => {
                    self.counts.overflowed.fetch_add(1, Ordering::Relaxed);
                }
                Put::Closed => {}
            }
        }
        self.counts
            .delivered
            .fetch_add(delivered, Ordering::Relaxed);
    }

    /// A warning to every listening client.
    fn warn_all(&self, message: &str) {
        let mut msg = BytesMut::new();
        backend::warning_notice(&mut msg, WARNING, message);
        let s = self.lock();
        let mut seen: Vec<*const super::Mailbox> = Vec::new();
        for m in s.subscribers.values().flatten() {
            if !seen.contains(&Arc::as_ptr(m)) {
                seen.push(Arc::as_ptr(m));
                m.put(&msg);
            }
        }
    }

    /// A warning to the clients listening to `channel`.
    fn warn_channel(&self, channel: &[u8], message: &str) {
        let mut msg = BytesMut::new();
        backend::warning_notice(&mut msg, WARNING, message);
        if let Some(list) = self.lock().subscribers.get(channel) {
            for m in list {
                m.put(&msg);
            }
        }
    }
}
