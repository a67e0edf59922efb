//! Named prepared statements in transaction mode.
//!
//! A client's named statements must keep working when its next transaction runs on another
//! server connection. Shoal records each client's statements (name → Parse body), gives every
//! distinct statement one pooler-wide name (`shoal_<n>`), and remembers which statements each
//! server has prepared (bounded, least recently used evicted with a Close). Client messages
//! are rewritten on their way out: a Parse the server already has is answered by Shoal; a
//! Bind or Describe of a statement the server lacks gets the Parse put in front of it in the
//! same flight, whose ParseComplete the client never sees; a Close of a statement is answered
//! by Shoal and leaves the server's copy for other clients.
//!
//! To hide and add replies at the right place, Shoal keeps, per server attachment, the queue
//! of replies the server owes ([`Expect`]) and walks the reply stream against it. An error
//! inside an extended-protocol batch skips the queue to the batch's Sync exactly as the server
//! skips the messages, so the client sees what PostgreSQL would have sent it.
//!
//! This is pure code over byte buffers; the relay drives it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};
use shoal_wire::backend::{put_cstr, put_message, tag as be};
use shoal_wire::frame::{FrameError, Reader, HEADER_LEN};
use shoal_wire::frontend::tag as fe;

/// A distinct statement: the Parse body after the name (query text and parameter types).
#[derive(Debug)]
pub struct StatementDef {
    pub id: u64,
    pub name: Box<str>,
    pub body: Bytes,
    /// A server has accepted this Parse once: a client's later Parse of it can be answered
    /// without a server.
    pub validated: AtomicBool,
    /// PostgreSQL said its cached plan no longer fits (DDL changed the result type): clients
    /// move to a fresh statement of the same text on their next use.
    pub stale: AtomicBool,
    /// The session `SET` this statement is, if Shoal follows it (pgJDBC prepares them).
    pub set_op: Option<super::sets::SetOp>,
}

/// The session `SET` a query text is, if any (cheap for everything else).
fn set_of(text: &str) -> Option<super::sets::SetOp> {
    match text.bytes().find(|b| !b.is_ascii_whitespace()) {
        Some(b's' | b'S' | b'r' | b'R' | b'd' | b'D') => super::sets::parse(text),
        _ => None,
    }
}

/// Statements by (session parameters, body), shared by the clients of one pool. The
/// parameters are part of the key because they change what a text means (`search_path`
/// picks the tables).
#[derive(Default)]
pub struct StatementRegistry {
    by_body: Mutex<HashMap<(u64, Bytes), Arc<StatementDef>>>,
    next_id: AtomicU64,
}

/// A key for a client's session parameters, for [`StatementRegistry::intern`].
pub fn params_key(params: &[(String, String)]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    params.hash(&mut h);
    h.finish()
}

/// Distinct statements remembered per pool; past it the registry starts over (live clients
/// keep their definitions, which stay valid: names are never reused).
const REGISTRY_LIMIT: usize = 100_000;

impl StatementRegistry {
    pub fn intern(&self, params: u64, body: &[u8]) -> Arc<StatementDef> {
        let mut map = self.by_body.lock().unwrap_or_else(|e| e.into_inner());
        let key = (params, Bytes::copy_from_slice(body));
        if let Some(d) = map.get(&key) {
            if !d.stale.load(Ordering::Relaxed) {
                return d.clone();
            }
        }
        if map.len() >= REGISTRY_LIMIT {
            map.clear();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let def = Arc::new(StatementDef {
            id,
            name: format!("shoal_{id}").into(),
            body: key.1.clone(),
            validated: AtomicBool::new(false),
            stale: AtomicBool::new(false),
            set_op: Reader::new(&key.1).cstr().ok().and_then(set_of),
        });
        map.insert(key, def.clone());
        def
    }
}

/// A client's named statements.
pub type ClientStatements = HashMap<Box<str>, Arc<StatementDef>>;

/// Which statements a server connection has prepared, with least-recently-used eviction.
#[derive(Default, Debug)]
pub struct ServerStatements {
    last_use: HashMap<u64, u64>,
    clock: u64,
    /// The unnamed statement, and the unnamed portal, if they are a session `SET` (how
    /// pgJDBC and pgx send one): followed like a simple-query `SET`.
    unnamed_set: Option<super::sets::SetOp>,
    portal_set: Option<super::sets::SetOp>,
}

impl ServerStatements {
    fn touch(&mut self, id: u64) -> bool {
        self.clock += 1;
        match self.last_use.get_mut(&id) {
            Some(t) => {
                *t = self.clock;
                true
            }
            None => false,
        }
    }

    /// Records `id`; returns the statement to close if the server holds too many.
    fn insert(&mut self, id: u64, max: usize) -> Option<u64> {
        self.clock += 1;
        let evict = if self.last_use.len() >= max.max(1) {
            let (&old, _) = self.last_use.iter().min_by_key(|(_, &t)| t)?;
            self.last_use.remove(&old);
            Some(old)
        } else {
            None
        };
        self.last_use.insert(id, self.clock);
        evict
    }

    fn remove(&mut self, id: u64) {
        self.last_use.remove(&id);
    }

    pub fn clear(&mut self) {
        self.last_use.clear();
    }

    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }
}

/// A reply (or run of replies) the server owes for a message sent to it, and what Shoal does
/// with it.
#[derive(Debug, Clone)]
pub enum Expect {
    /// A client's Parse; its statement if named (forgotten if the Parse fails).
    Parse(Option<Arc<StatementDef>>),
    /// A Parse Shoal put in front of a Bind or Describe: its ParseComplete is hidden.
    HideParse(Arc<StatementDef>),
    /// A Close Shoal sent to evict a statement: its CloseComplete is hidden.
    HideClose(u64),
    /// A Bind, with the named statement it binds (whose plan may turn out stale).
    Bind(Option<Arc<StatementDef>>),
    /// Describe of a statement: ParameterDescription, then RowDescription or NoData.
    DescribeStatement,
    /// Describe of a portal: RowDescription or NoData.
    DescribePortal,
    /// Rows (or COPY) until CommandComplete, EmptyQueryResponse or PortalSuspended; with the
    /// session `SET` it runs, if it is one Shoal follows.
    Execute(Option<super::sets::SetOp>),
    Close,
    Sync,
    /// A simple Query or FunctionCall: everything until ReadyForQuery; with the session
    /// `SET` it is, if it is one Shoal follows.
    Query(Option<super::sets::SetOp>),
    /// A ParseComplete Shoal gives itself once it is its turn.
    SyntheticParse,
    /// A CloseComplete Shoal gives itself once it is its turn; only then (not skipped by an
    /// error) does the client's statement of that name go away.
    SyntheticClose(Box<str>),
}

/// Per-attachment state of the translation.
pub struct Translator<'a> {
    pub registry: &'a StatementRegistry,
    /// [`params_key`] of the client's session parameters.
    pub params: u64,
    pub client: &'a mut Option<Box<ClientStatements>>,
    pub server: &'a mut ServerStatements,
    pub queue: &'a mut VecDeque<Expect>,
    pub max_per_server: usize,
}

fn parse_message(out: &mut BytesMut, name: &str, body: &[u8]) {
    put_message(out, fe::PARSE, |b| {
        put_cstr(b, name);
        b.put_slice(body);
    });
}

impl Translator<'_> {
    /// Puts the Parse of `def` into `out` (after a Close evicting the least recently used
    /// statement if the server is full) and records the server as having it.
    fn prepare(&mut self, def: &Arc<StatementDef>, out: &mut BytesMut) {
        if let Some(old) = self.server.insert(def.id, self.max_per_server) {
            put_message(out, fe::CLOSE, |b| {
                b.put_u8(b'S');
                put_cstr(b, &format!("shoal_{old}"));
            });
            self.queue.push_back(Expect::HideClose(old));
        }
        parse_message(out, &def.name, &def.body);
    }

    /// Makes sure the server has `def` prepared before a Bind or Describe of it; the reply to
    /// a Parse put in for that is hidden.
    fn ensure_prepared(&mut self, def: &Arc<StatementDef>, out: &mut BytesMut) {
        if !self.server.touch(def.id) {
            self.prepare(def, out);
            self.queue.push_back(Expect::HideParse(Arc::clone(def)));
        }
    }

    /// The client's statement of that name; a stale one is replaced by a fresh statement of
    /// the same text (prepared anew on first use), so the client's retry after a DDL works.
    fn lookup(&mut self, name: &str) -> Option<Arc<StatementDef>> {
        let def = self.client.as_ref()?.get(name).cloned()?;
        if !def.stale.load(Ordering::Relaxed) {
            return Some(def);
        }
        let fresh = self.registry.intern(self.params, &def.body);
        if let Some(c) = self.client.as_mut() {
            c.insert(name.into(), fresh.clone());
        }
        Some(fresh)
    }

    /// Appends to `out` what the server must receive for the client message `msg` (a whole
    /// frame), and queues the replies it will owe.
    pub fn client_message(&mut self, msg: &[u8], out: &mut BytesMut) -> Result<(), FrameError> {
        let body = &msg[HEADER_LEN..];
        match msg[0] {
            fe::PARSE => {
                let mut r = Reader::new(body);
                let name = r.cstr()?;
                if name.is_empty() {
                    let text = r.cstr().unwrap_or("");
                    self.server.unnamed_set = match text.bytes().find(|b| !b.is_ascii_whitespace())
                    {
                        Some(b's' | b'S' | b'r' | b'R' | b'd' | b'D') => super::sets::parse(text),
                        _ => None,
                    };
                    out.extend_from_slice(msg);
                    self.queue.push_back(Expect::Parse(None));
                    return Ok(());
                }
                let def = self.registry.intern(self.params, r.rest());
                self.client
                    .get_or_insert_with(Default::default)
                    .insert(name.into(), def.clone());
                if self.server.touch(def.id) {
                    self.queue.push_back(Expect::SyntheticParse);
                } else {
                    self.prepare(&def, out);
                    self.queue.push_back(Expect::Parse(Some(def)));
                }
            }
            fe::BIND => {
                let mut r = Reader::new(body);
                let portal = r.cstr()?;
                let stmt = r.cstr()?;
                let def = if stmt.is_empty() {
                    None
                } else {
                    self.lookup(stmt)
                };
                if portal.is_empty() {
                    self.server.portal_set = match &def {
                        None if stmt.is_empty() => self.server.unnamed_set.clone(),
                        Some(d) => d.set_op.clone(),
                        None => None,
                    };
                }
                match &def {
                    Some(def) => {
                        self.ensure_prepared(def, out);
                        let rest = r.rest();
                        put_message(out, fe::BIND, |b| {
                            put_cstr(b, portal);
                            put_cstr(b, &def.name);
                            b.put_slice(rest);
                        });
                    }
                    // Unnamed, or unknown to Shoal: PostgreSQL answers for itself.
                    None => out.extend_from_slice(msg),
                }
                self.queue.push_back(Expect::Bind(def));
            }
            fe::DESCRIBE => {
                let mut r = Reader::new(body);
                let kind = r.u8()?;
                let name = r.cstr()?;
                if kind == b'S' {
                    let def = if name.is_empty() {
                        None
                    } else {
                        self.lookup(name)
                    };
                    match def {
                        Some(def) => {
                            self.ensure_prepared(&def, out);
                            put_message(out, fe::DESCRIBE, |b| {
                                b.put_u8(b'S');
                                put_cstr(b, &def.name);
                            });
                        }
                        None => out.extend_from_slice(msg),
                    }
                    self.queue.push_back(Expect::DescribeStatement);
                } else {
                    out.extend_from_slice(msg);
                    self.queue.push_back(Expect::DescribePortal);
                }
            }
            fe::CLOSE => {
                let mut r = Reader::new(body);
                let kind = r.u8()?;
                let name = r.cstr()?;
                if kind == b'S' && !name.is_empty() {
                    // Other clients may share the server's copy: only this client forgets it.
                    self.queue.push_back(Expect::SyntheticClose(name.into()));
                } else {
                    out.extend_from_slice(msg);
                    self.queue.push_back(Expect::Close);
                }
            }
            fe::EXECUTE => {
                out.extend_from_slice(msg);
                let portal = Reader::new(body).cstr()?;
                let op = if portal.is_empty() {
                    self.server.portal_set.clone()
                } else {
                    None
                };
                self.queue.push_back(Expect::Execute(op));
            }
            fe::SYNC => {
                out.extend_from_slice(msg);
                self.queue.push_back(Expect::Sync);
            }
            fe::QUERY => {
                out.extend_from_slice(msg);
                let op = match body.iter().find(|b| !b.is_ascii_whitespace()) {
                    Some(b's' | b'S' | b'r' | b'R' | b'd' | b'D') => {
                        Reader::new(body).cstr().ok().and_then(super::sets::parse)
                    }
                    _ => None,
                };
                self.queue.push_back(Expect::Query(op));
            }
            fe::FUNCTION_CALL => {
                out.extend_from_slice(msg);
                self.queue.push_back(Expect::Query(None));
            }
            _ => out.extend_from_slice(msg),
        }
        Ok(())
    }
}

/// Emits the replies Shoal owes itself that are now due (at the head of the queue).
pub fn emit_due(
    queue: &mut VecDeque<Expect>,
    client: &mut Option<Box<ClientStatements>>,
    out: &mut BytesMut,
) {
    loop {
        match queue.front() {
            Some(Expect::SyntheticParse) => put_message(out, be::PARSE_COMPLETE, |_| {}),
            Some(Expect::SyntheticClose(name)) => {
                if let Some(c) = client.as_mut() {
                    c.remove(name);
                }
                put_message(out, be::CLOSE_COMPLETE, |_| {});
            }
            _ => return,
        }
        queue.pop_front();
    }
}

/// Walks one server reply (by tag) against the queue: emits synthetic replies due before it
/// into `out` and returns whether the reply itself goes to the client. The caller appends
/// the reply, then calls [`emit_due`] for the synthetic replies that follow it.
/// Marks the statement bound by the Bind at the head of the queue as stale, for an error
/// saying its cached plan no longer fits (`0A000`, after DDL).
pub fn plan_went_stale(queue: &VecDeque<Expect>) {
    if let Some(Expect::Bind(Some(def))) = queue.front() {
        def.stale.store(true, Ordering::Relaxed);
    }
}

pub fn server_reply(
    queue: &mut VecDeque<Expect>,
    server: &mut ServerStatements,
    client: &mut Option<Box<ClientStatements>>,
    tag: u8,
    out: &mut BytesMut,
) -> bool {
    // Replies that can come at any time and belong to no request.
    if matches!(
        tag,
        be::NOTICE_RESPONSE | be::PARAMETER_STATUS | be::NOTIFICATION_RESPONSE
    ) {
        return true;
    }
    emit_due(queue, client, out);
    let Some(head) = queue.front() else {
        return true;
    };
    if tag == be::ERROR_RESPONSE {
        match head {
            // A simple query goes on to its ReadyForQuery.
            Expect::Query(_) => return true,
            Expect::Sync => return true,
            _ => {}
        }
        // The server skips to the next Sync; so do we. Statements whose Parse was skipped
        // (or failed) do not exist on the server; a skipped Close leaves its statement there.
        while let Some(e) = queue.front() {
            match e {
                Expect::Sync | Expect::Query(_) => break,
                Expect::Parse(Some(def)) | Expect::HideParse(def) => server.remove(def.id),
                Expect::HideClose(id) => {
                    server.insert(*id, usize::MAX);
                }
                _ => {}
            }
            queue.pop_front();
        }
        return true;
    }
    if tag == be::COPY_IN_RESPONSE && matches!(head, Expect::Execute(_)) {
        // The server ignores Syncs that reach it during COPY FROM STDIN: those already sent
        // after this Execute will never be answered.
        let mut i = 1;
        while i < queue.len() {
            if matches!(queue[i], Expect::Sync) {
                queue.remove(i);
            } else {
                i += 1;
            }
        }
        return true;
    }
    let (done, forward) = match (head, tag) {
        (Expect::Parse(def), be::PARSE_COMPLETE) => {
            if let Some(def) = def {
                def.validated.store(true, Ordering::Relaxed);
            }
            (true, true)
        }
        (Expect::HideParse(def), be::PARSE_COMPLETE) => {
            def.validated.store(true, Ordering::Relaxed);
            (true, false)
        }
        (Expect::HideClose(_), be::CLOSE_COMPLETE) => (true, false),
        (Expect::Bind(_), be::BIND_COMPLETE) => (true, true),
        (Expect::DescribeStatement, b't') => (false, true),
        (Expect::DescribeStatement | Expect::DescribePortal, b'T' | b'n') => (true, true),
        (Expect::Execute(_), be::COMMAND_COMPLETE | b'I' | b's') => (true, true),
        (Expect::Execute(_), _) => (false, true),
        (Expect::Close, be::CLOSE_COMPLETE) => (true, true),
        (Expect::Sync | Expect::Query(_), be::READY_FOR_QUERY) => (true, true),
        (Expect::Query(_), _) => (false, true),
        // Anything else is passed on untouched; the queue stays as it is.
        _ => (false, true),
    };
    if done {
        queue.pop_front();
    }
    forward
}

/// A client's named Parse that can be answered without a server: the same statement was
/// accepted by a server before. Records it for the client and returns true.
pub fn parse_without_server(
    registry: &StatementRegistry,
    params: u64,
    client: &mut Option<Box<ClientStatements>>,
    msg: &[u8],
) -> bool {
    let mut r = Reader::new(&msg[HEADER_LEN..]);
    let Ok(name) = r.cstr() else { return false };
    if name.is_empty() {
        return false;
    }
    let def = registry.intern(params, r.rest());
    if !def.validated.load(Ordering::Relaxed) {
        return false;
    }
    client
        .get_or_insert_with(Default::default)
        .insert(name.into(), def);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_wire::Frame;

    fn frames(buf: &BytesMut) -> Vec<(char, Vec<u8>)> {
        let mut b = buf.clone();
        let mut v = Vec::new();
        while let Some(f) = Frame::split(&mut b, 1 << 20).unwrap() {
            v.push((f.tag() as char, f.body().to_vec()));
        }
        v
    }

    fn msg(tag: u8, body: &[u8]) -> BytesMut {
        let mut b = BytesMut::new();
        put_message(&mut b, tag, |m| m.put_slice(body));
        b
    }

    struct Fixture {
        registry: StatementRegistry,
        client: Option<Box<ClientStatements>>,
        server: ServerStatements,
        queue: VecDeque<Expect>,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                registry: StatementRegistry::default(),
                client: None,
                server: ServerStatements::default(),
                queue: VecDeque::new(),
            }
        }
        fn send(&mut self, m: &BytesMut) -> BytesMut {
            let mut out = BytesMut::new();
            Translator {
                registry: &self.registry,
                params: 0,
                client: &mut self.client,
                server: &mut self.server,
                queue: &mut self.queue,
                max_per_server: 2,
            }
            .client_message(m, &mut out)
            .unwrap();
            out
        }
        fn reply(&mut self, tag: u8) -> (bool, BytesMut) {
            let mut out = BytesMut::new();
            let fwd = server_reply(
                &mut self.queue,
                &mut self.server,
                &mut self.client,
                tag,
                &mut out,
            );
            if fwd {
                put_message(&mut out, tag, |_| {});
            }
            emit_due(&mut self.queue, &mut self.client, &mut out);
            (fwd, out)
        }
    }

    #[test]
    fn parse_is_renamed_and_second_parse_is_answered_by_shoal() {
        let mut f = Fixture::new();
        let out = f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
        let fr = frames(&out);
        assert_eq!(fr[0].0, 'P');
        assert!(fr[0].1.starts_with(b"shoal_1\0SELECT 1\0"));
        assert!(f.reply(b'1').0);
        // Same statement under another client name: the server has it already.
        let out = f.send(&msg(b'P', b"other\0SELECT 1\0\0\0"));
        assert!(out.is_empty());
        let out = f.send(&msg(b'S', b""));
        assert_eq!(frames(&out)[0].0, 'S');
        let (fwd, out) = f.reply(b'Z');
        assert!(fwd);
        assert_eq!(frames(&out), vec![('1', vec![]), ('Z', vec![])]);
    }

    #[test]
    fn bind_on_a_server_without_the_statement_injects_a_hidden_parse() {
        let mut f = Fixture::new();
        f.send(&msg(b'P', b"s1\0SELECT $1\0\0\0"));
        f.reply(b'1');
        // A new server knows nothing.
        f.server.clear();
        f.queue.clear();
        let out = f.send(&msg(b'B', b"\0s1\0\0\0\0\0\0\0"));
        let fr = frames(&out);
        assert_eq!(fr.iter().map(|x| x.0).collect::<String>(), "PB");
        assert!(fr[1].1.starts_with(b"\0shoal_1\0"));
        assert!(!f.reply(b'1').0, "injected ParseComplete is hidden");
        assert!(f.reply(b'2').0);
    }

    #[test]
    fn close_is_answered_by_shoal_after_earlier_replies() {
        let mut f = Fixture::new();
        f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
        let out = f.send(&msg(b'C', b"Ss1\0"));
        assert!(out.is_empty(), "the server keeps its copy");
        let (fwd, out) = f.reply(b'1');
        assert!(fwd);
        assert_eq!(
            frames(&out),
            vec![('1', vec![]), ('3', vec![])],
            "CloseComplete follows the ParseComplete"
        );
        assert!(
            f.client.as_ref().unwrap().is_empty(),
            "forgotten once answered"
        );
    }

    #[test]
    fn error_skips_to_sync_and_forgets_failed_parses() {
        let mut f = Fixture::new();
        f.send(&msg(b'P', b"bad\0SELEC nonsense\0\0\0"));
        f.send(&msg(b'P', b"good\0SELECT 2\0\0\0"));
        f.send(&msg(b'C', b"Sgood\0"));
        f.send(&msg(b'S', b""));
        assert_eq!(f.server.len(), 2);
        let (fwd, out) = f.reply(b'E');
        assert!(fwd);
        assert_eq!(
            frames(&out),
            vec![('E', vec![])],
            "no CloseComplete after an error"
        );
        assert!(
            f.server.is_empty(),
            "neither statement exists on the server"
        );
        assert!(
            f.client.as_ref().unwrap().contains_key("good"),
            "the skipped Close leaves the client's statement"
        );
        assert!(f.reply(b'Z').0);
        assert!(f.queue.is_empty());
    }

    #[test]
    fn eviction_closes_the_least_recently_used_statement() {
        let mut f = Fixture::new();
        for (i, q) in ["SELECT 1", "SELECT 2", "SELECT 3"].iter().enumerate() {
            let body = format!("s{i}\0{q}\0\0\0");
            let out = f.send(&msg(b'P', body.as_bytes()));
            if i == 2 {
                let tags: String = frames(&out).iter().map(|x| x.0).collect();
                assert_eq!(tags, "CP", "max 2 per server: the oldest is closed first");
            }
        }
        assert!(f.reply(b'1').0);
        assert!(f.reply(b'1').0);
        assert!(!f.reply(b'3').0, "eviction CloseComplete hidden");
        assert!(f.reply(b'1').0);
        assert_eq!(f.server.len(), 2);
    }

    #[test]
    fn synthetic_replies_after_a_sync_follow_its_ready_for_query() {
        let mut f = Fixture::new();
        f.send(&msg(b'P', b"s0\0SELECT 1\0\0\0"));
        f.send(&msg(b'S', b""));
        f.reply(b'1');
        f.reply(b'Z');
        // Close of the old name, then a re-Parse of the same text, in one flight.
        f.send(&msg(b'C', b"Ss0\0"));
        f.send(&msg(b'S', b""));
        f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
        f.send(&msg(b'S', b""));
        let mut out = BytesMut::new();
        emit_due(&mut f.queue, &mut f.client, &mut out);
        assert_eq!(frames(&out), vec![('3', vec![])]);
        let (_, out) = f.reply(b'Z');
        assert_eq!(frames(&out), vec![('Z', vec![]), ('1', vec![])]);
        let (_, out) = f.reply(b'Z');
        assert_eq!(frames(&out), vec![('Z', vec![])]);
    }

    #[test]
    fn syncs_sent_before_copy_data_are_not_owed() {
        let mut f = Fixture::new();
        f.send(&msg(b'B', b"\0\0\0\0\0\0\0\0"));
        f.send(&msg(b'E', b"\0\0\0\0\0"));
        f.send(&msg(b'S', b""));
        assert!(f.reply(b'2').0);
        assert!(f.reply(b'G').0);
        f.send(&msg(b'd', b"1\n"));
        f.send(&msg(b'c', b""));
        f.send(&msg(b'S', b""));
        assert!(f.reply(b'C').0);
        assert!(f.reply(b'Z').0);
        assert!(f.queue.is_empty(), "{:?}", f.queue);
    }

    #[test]
    fn describe_statement_and_execute_rows() {
        let mut f = Fixture::new();
        f.send(&msg(b'P', b"s\0SELECT 1\0\0\0"));
        f.send(&msg(b'D', b"Ss\0"));
        f.send(&msg(b'B', b"\0s\0\0\0\0\0\0\0"));
        f.send(&msg(b'E', b"\0\0\0\0\0"));
        f.send(&msg(b'S', b""));
        for t in [b'1', b't', b'T', b'2', b'D', b'D', b'C', b'Z'] {
            assert!(f.reply(t).0, "{}", t as char);
        }
        assert!(f.queue.is_empty());
    }
}
