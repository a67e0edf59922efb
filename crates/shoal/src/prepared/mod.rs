//! Prepared statements in transaction mode: a client's statements, named and unnamed, must
//! keep working when its next transaction runs on another server connection, and no client
//! may ever reach a statement another client prepared.
//!
//! Shoal records each client's named statements (name → Parse body), gives every distinct
//! statement one pooler-wide name (`shoal_<n>`), and remembers which statements each server
//! has prepared (bounded, least recently used evicted with a Close). Client messages are
//! rewritten on their way out ([`translate`]): a Parse the server already has is answered by
//! Shoal; a Bind or Describe of a statement the server lacks gets the Parse put in front of it
//! in the same flight, whose ParseComplete the client never sees; a Close of a statement is
//! answered by Shoal and leaves the server's copy for other clients.
//!
//! The unnamed statement is the client's too: Shoal keeps a copy of the client's last unnamed
//! Parse and each server remembers whose unnamed statement it holds, so a Bind of the unnamed
//! statement in a later transaction re-parses it first on a server that holds someone else's.
//! A Bind or Describe naming a statement the client does not have never reaches the server's
//! namespace: Shoal makes the server fail the message instead (see [`Expect::Fail`]), so the
//! client gets PostgreSQL's error and the server skips to Sync exactly as it would have.
//!
//! To hide and add replies at the right place, Shoal keeps, per server attachment, the queue of
//! replies the server owes ([`Expect`]) and walks the reply stream against it ([`replies`]).
//!
//! This is pure code over byte buffers; the relay drives it.

mod replies;
#[cfg(test)]
mod tests;
mod translate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use shoal_wire::frame::{Reader, HEADER_LEN};
use shoal_wire::sql::{self, ClientEncoding, Effects};

use crate::sets::SetOp;

pub use replies::{emit_due, pass_reply, server_reply, synthetic_due};
pub use translate::{ToServer, Translator};

/// A distinct statement: the Parse body after the name (query text and parameter types).
#[derive(Debug)]
pub struct StatementDef {
    pub id: u64,
    pub name: Box<str>,
    pub body: Bytes,
    /// A server has accepted this Parse once: a client's later Parse of it can be answered
    /// without a server.
    pub validated: AtomicBool,
    /// PostgreSQL said its plan no longer fits the schema (DDL changed a result type, or a
    /// type it used is gone): clients move to a fresh statement of the same text on their
    /// next use.
    pub stale: AtomicBool,
    /// The registry's schema counter when it was made; a Parse after DDL gets a fresh one.
    epoch: u64,
    /// The session `SET` this statement is, if Shoal follows it (pgJDBC prepares them).
    pub set_op: Option<SetOp>,
    /// What running it leaves in the session.
    pub effects: Effects,
    /// The client statement an SQL `EXECUTE` of it names (see [`crate::prepared`]'s
    /// translation of `EXECUTE` through Parse): prepared on a server before this one, and
    /// again before each use of this one.
    pub depends: Option<Arc<StatementDef>>,
}

impl StatementDef {
    fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }
}

/// The session `SET` a query text is, if any (cheap for everything else).
pub fn set_of(text: &[u8], enc: ClientEncoding) -> Option<SetOp> {
    set_of_with(sql::FirstWord::of(text), text, enc)
}

/// [`set_of`] with the text's first word already read.
pub fn set_of_with(first: sql::FirstWord, text: &[u8], enc: ClientEncoding) -> Option<SetOp> {
    // A match, not a list search: the compiler tests the length first, so the common
    // statements (six-letter `select`, `insert`, ...) cost no comparison call.
    match first.as_bytes() {
        b"set" | b"reset" | b"discard" | b"savepoint" | b"release" | b"rollback" | b"abort"
        | b"listen" | b"unlisten" => {}
        _ => return None,
    }
    if !enc.bytes_are_characters(text) {
        // Not followed: its completion marks the server as holding state instead.
        return None;
    }
    let text = &text[sql::leading_comments_len(text)..];
    std::str::from_utf8(text).ok().and_then(crate::sets::parse)
}

/// The query text of a Parse body after its name (up to the NUL).
fn parse_text(rest: &[u8]) -> &[u8] {
    Reader::new(rest).cstr_bytes().unwrap_or(rest)
}

/// Statements by (session parameters, body), shared by the clients of one pool. The
/// parameters are part of the key because they change what a text means (`search_path`
/// picks the tables).
#[derive(Default)]
pub struct StatementRegistry {
    by_body: Mutex<HashMap<(u64, Bytes), Arc<StatementDef>>>,
    next_id: AtomicU64,
    /// Grows whenever a client changes its database's schema (through any pool of that
    /// database: the pools of its users share this counter, other databases and tenants have
    /// their own): statements interned before are not handed to new Parses, as their plans
    /// and parameter types describe the old schema. DDL is rare; re-preparing after it is
    /// cheap.
    schema: Arc<AtomicU64>,
}

/// The registry key of a client's session parameters read in `enc`: the same bytes may
/// be another statement in another encoding.
fn with_encoding(params: u64, enc: ClientEncoding) -> u64 {
    if enc == ClientEncoding::Utf8 {
        return params;
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (params, enc).hash(&mut h);
    h.finish()
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
    /// A registry whose schema counter is `schema`, shared with the other pools of the
    /// same database.
    pub fn sharing(schema: Arc<AtomicU64>) -> StatementRegistry {
        StatementRegistry {
            schema,
            ..StatementRegistry::default()
        }
    }

    pub fn intern(&self, params: u64, body: &[u8], enc: ClientEncoding) -> Arc<StatementDef> {
        self.intern_with(with_encoding(params, enc), body, |text| Derived {
            set_op: set_of(text, enc),
            effects: sql::classify(text, enc),
            depends: None,
        })
    }

    /// A statement whose text Shoal rewrote (an SQL command naming a client's statement):
    /// what it does is given, not read from the text.
    pub fn intern_rewritten(
        &self,
        params: u64,
        body: &[u8],
        d: Derived,
        enc: ClientEncoding,
    ) -> Arc<StatementDef> {
        self.intern_with(with_encoding(params, enc), body, move |_| d)
    }

    fn intern_with(
        &self,
        params: u64,
        body: &[u8],
        derive: impl FnOnce(&[u8]) -> Derived,
    ) -> Arc<StatementDef> {
        let epoch = self.schema.load(Ordering::Relaxed);
        let mut map = self.by_body.lock().unwrap_or_else(|e| e.into_inner());
        let key = (params, Bytes::copy_from_slice(body));
        if let Some(d) = map.get(&key) {
            if !d.is_stale() && d.epoch == epoch {
                return d.clone();
            }
        }
        if map.len() >= REGISTRY_LIMIT {
            map.clear();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let d = derive(parse_text(&key.1));
        let def = Arc::new(StatementDef {
            id,
            name: format!("shoal_{id}").into(),
            body: key.1.clone(),
            validated: AtomicBool::new(false),
            stale: AtomicBool::new(false),
            epoch,
            set_op: d.set_op,
            effects: d.effects,
            depends: d.depends,
        });
        map.insert(key, def.clone());
        def
    }

    /// A client changed the schema: later Parses get statements planned afresh.
    pub fn schema_changed(&self) {
        self.schema.fetch_add(1, Ordering::Relaxed);
    }
}

/// What a statement does, when Shoal knows it better than its text says.
#[derive(Debug, Clone, Default)]
pub struct Derived {
    pub set_op: Option<SetOp>,
    pub effects: Effects,
    pub depends: Option<Arc<StatementDef>>,
}

/// The client's last unnamed statement, kept so it can be parsed again on another server.
#[derive(Debug, Default)]
pub struct Unnamed {
    /// Which of the client's unnamed Parses this is (see [`ServerStatements::unnamed_owner`]).
    seq: u64,
    /// The Parse body after the (empty) name; the buffer is reused from Parse to Parse.
    body: Vec<u8>,
    set_op: Option<SetOp>,
    dirty: bool,
    /// Of `dirty`, what surely lasts (see [`sql::Effects::keeps`]).
    keeps: bool,
    /// The client statement its SQL `EXECUTE` names (see [`StatementDef::depends`]).
    depends: Option<Arc<StatementDef>>,
}

/// Statements as (name, Parse body after the name) pairs.
pub type NamedBodies = Vec<(Vec<u8>, Vec<u8>)>;

/// A client's prepared statements.
#[derive(Debug, Default)]
pub struct ClientStatements {
    named: HashMap<Box<[u8]>, Arc<StatementDef>>,
    unnamed: Option<Unnamed>,
    unnamed_seq: u64,
    /// Statements the client made with SQL `PREPARE`: name → the text that made it, so a
    /// later `EXECUTE` is held to the query rules in force then (a rule added after the
    /// `PREPARE` applies to it too).
    sql_prepared: HashMap<Box<[u8]>, Box<[u8]>>,
}

impl ClientStatements {
    pub fn len(&self) -> usize {
        self.named.len()
    }

    pub fn is_empty(&self) -> bool {
        self.named.is_empty()
    }

    pub fn contains(&self, name: &[u8]) -> bool {
        self.named.contains_key(name)
    }

    /// The client's `DEALLOCATE name` (`""`: `DEALLOCATE ALL`) completed: the name is free
    /// (the server's copy stays).
    pub fn deallocated(&mut self, name: &[u8]) {
        if name.is_empty() {
            // The unnamed statement is not a prepared statement to `DEALLOCATE ALL`.
            self.named.clear();
        } else {
            self.named.remove(name);
        }
    }

    /// A statement made by SQL `PREPARE name` in `text`.
    pub fn sql_prepared(&mut self, name: &[u8], text: &[u8]) {
        self.sql_prepared.insert(name.into(), text.into());
    }

    /// The text that made the client's SQL-prepared statement `name`.
    pub fn sql_prepared_text(&self, name: &[u8]) -> Option<&[u8]> {
        self.sql_prepared.get(name).map(|t| &t[..])
    }

    /// The SQL text of the client's statement `name` (`""`: its unnamed one).
    pub fn text_of(&self, name: &[u8]) -> Option<&[u8]> {
        if name.is_empty() {
            return self.unnamed.as_ref().map(|u| parse_text(&u.body));
        }
        self.named.get(name).map(|d| parse_text(&d.body))
    }

    /// The Parse body (after the name: text and parameter types) of the client's statement
    /// `name` (`""`: its unnamed one).
    pub fn body_of(&self, name: &[u8]) -> Option<&[u8]> {
        if name.is_empty() {
            return self.unnamed.as_ref().map(|u| u.body.as_slice());
        }
        self.named.get(name).map(|d| &d.body[..])
    }

    /// An unnamed Parse the client's unit carried was answered without a server (a reply
    /// from the result cache): its text is the client's unnamed statement now, parsed on
    /// whichever server runs the client's next use of it.
    pub fn unnamed_parsed_without_server(&mut self, body: &[u8], enc: ClientEncoding) {
        self.unnamed_seq += 1;
        let text = parse_text(body);
        let effects = sql::classify(text, enc);
        self.unnamed = Some(Unnamed {
            seq: self.unnamed_seq,
            set_op: set_of(text, enc),
            dirty: effects.dirty,
            keeps: effects.keeps,
            depends: None,
            body: body.to_vec(),
        });
    }

    /// `DISCARD ALL` / `DEALLOCATE ALL`: PostgreSQL drops every statement of the session.
    pub fn forget_all(&mut self) {
        self.named.clear();
        self.unnamed = None;
    }

    /// The client's statements as (name, Parse body) pairs, and its unnamed statement's
    /// body: what another process needs to go on serving the client (see
    /// [`ClientStatements::import`]).
    pub fn export(&self) -> (NamedBodies, Option<Vec<u8>>) {
        let named = self
            .named
            .iter()
            .map(|(k, d)| (k.to_vec(), d.body.to_vec()))
            .collect();
        (named, self.unnamed.as_ref().map(|u| u.body.clone()))
    }

    /// The statements [`ClientStatements::export`] gave, interned in `registry` (a client
    /// session parameters' `params` key) as if the client had parsed them here.
    pub fn import(
        registry: &StatementRegistry,
        params: u64,
        named: NamedBodies,
        unnamed: Option<Vec<u8>>,
        enc: ClientEncoding,
    ) -> ClientStatements {
        let mut c = ClientStatements::default();
        for (name, body) in named {
            c.named
                .insert(name.into_boxed_slice(), registry.intern(params, &body, enc));
        }
        if let Some(body) = unnamed {
            let text = parse_text(&body);
            let effects = sql::classify(text, enc);
            c.unnamed_seq = 1;
            c.unnamed = Some(Unnamed {
                seq: 1,
                set_op: set_of(text, enc),
                dirty: effects.dirty,
                keeps: effects.keeps,
                depends: None,
                body,
            });
        }
        c
    }

    /// A number that changes whenever a named statement is added, removed or replaced (each
    /// definition has an id of its own): whether a relayed client's state must be sent again.
    pub fn signature(&self) -> u64 {
        self.named.values().fold(self.named.len() as u64, |acc, d| {
            acc.wrapping_add(d.id.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        })
    }

    /// Whether a statement's text was rewritten to name a server statement (an SQL
    /// `EXECUTE`/`DEALLOCATE` of another statement): such texts mean nothing to another
    /// process, whose server statements have other names.
    pub fn has_rewritten(&self) -> bool {
        self.named
            .values()
            .any(|d| d.depends.is_some() || matches!(d.set_op, Some(SetOp::Deallocate(_))))
            || self.unnamed.as_ref().is_some_and(|u| {
                u.depends.is_some() || matches!(u.set_op, Some(SetOp::Deallocate(_)))
            })
    }
}

/// The statement a client's `DEALLOCATE` of one of its protocol-level statements is made to
/// deallocate when it runs through the extended protocol: Shoal prepares it (`SELECT`) just
/// before, so the command completes as PostgreSQL's would while the server's copy of the
/// client's statement stays for other clients.
pub const DEALLOCATE_TARGET: &str = "shoal_deallocated";

/// Which statements a server connection has prepared, with least-recently-used eviction, and
/// whose unnamed statement it holds.
#[derive(Default, Debug)]
pub struct ServerStatements {
    last_use: HashMap<u64, u64>,
    clock: u64,
    /// The unnamed portal, if it runs a session `SET` (how pgJDBC and pgx send one): followed
    /// like a simple-query `SET`.
    portal_set: Option<SetOp>,
    /// (client connection id, that client's unnamed Parse number) of the unnamed statement
    /// this server holds; `None` when unknown or gone.
    unnamed_owner: Option<(u64, u64)>,
    /// Shoal's record of this server's statements may be wrong (an injected Parse or Close
    /// failed, or a client deallocated one by SQL): clean the session before reuse.
    pub needs_clean: bool,
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

    /// The server's session was reset (`DISCARD ALL`) or its state is unknown: it holds no
    /// statements.
    pub fn clear(&mut self) {
        self.last_use.clear();
        self.unnamed_owner = None;
        self.portal_set = None;
        self.needs_clean = false;
    }

    /// A simple query ran: PostgreSQL drops the unnamed statement.
    pub fn unnamed_dropped(&mut self) {
        self.unnamed_owner = None;
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
    /// A client's named Parse: its statement, and the client's name for it (both forgotten
    /// if the Parse fails or is skipped after an earlier error).
    Parse(Arc<StatementDef>, Box<[u8]>),
    /// A client's unnamed Parse, with its number (see [`ServerStatements::unnamed_owner`]).
    ParseUnnamed(u64),
    /// A Parse Shoal put in front of a Bind or Describe: its ParseComplete is hidden.
    HideParse(Arc<StatementDef>),
    /// The client's unnamed statement, parsed again by Shoal on this server: hidden.
    HideParseUnnamed(u64),
    /// A Close Shoal sent to evict a statement: its CloseComplete is hidden.
    HideClose(u64),
    /// The Close or Parse of [`DEALLOCATE_TARGET`], put in front of a client's `DEALLOCATE`
    /// run through the extended protocol: its reply is hidden.
    HideTarget,
    /// A Sync Shoal sent after a hidden Parse in front of a simple query: its ReadyForQuery
    /// is hidden.
    HideSync,
    /// A message Shoal made the server fail (a Parse of an invalid text, which has no effect
    /// but the error): the server's error is replaced by this one, and the server skips to
    /// Sync exactly as it would have for the client's own message.
    Fail(Box<(&'static str, String)>),
    /// A Bind, with the named statement it binds (whose plan may turn out stale).
    Bind(Option<Arc<StatementDef>>),
    /// Describe of a statement: ParameterDescription, then RowDescription or NoData.
    DescribeStatement(Option<Arc<StatementDef>>),
    /// Describe of a portal: RowDescription or NoData.
    DescribePortal,
    /// Rows (or COPY) until CommandComplete, EmptyQueryResponse or PortalSuspended; with the
    /// session `SET` it runs, if it is one Shoal follows.
    Execute(Option<SetOp>),
    Close,
    Sync,
    /// A simple Query or FunctionCall: everything until ReadyForQuery; with the session
    /// `SET` it is, if it is one Shoal follows.
    Query(Option<SetOp>),
    /// A ParseComplete Shoal gives itself once it is its turn.
    SyntheticParse(Box<[u8]>),
    /// A CloseComplete Shoal gives itself once it is its turn; only then (not skipped by an
    /// error) does the client's statement of that name go away.
    SyntheticClose(Box<[u8]>),
    /// SQL `DEALLOCATE name` of one of the client's protocol-level statements, answered by
    /// Shoal (CommandComplete and ReadyForQuery) once it is its turn.
    SyntheticDeallocate(Box<[u8]>),
}

/// A client's named Parse that can be answered without a server: the same statement was
/// accepted by a server before. Records it for the client and returns true.
pub fn parse_without_server(
    registry: &StatementRegistry,
    params: &[(String, String)],
    client: &mut Option<Box<ClientStatements>>,
    msg: &[u8],
    enc: ClientEncoding,
) -> bool {
    let mut r = Reader::new(&msg[HEADER_LEN..]);
    let Ok(name) = r.cstr_bytes() else {
        return false;
    };
    if name.is_empty() || client.as_ref().is_some_and(|c| c.contains(name)) {
        // A duplicate name must reach the relay, which reports it as PostgreSQL does.
        return false;
    }
    let def = registry.intern(params_key(params), r.rest(), enc);
    if !def.validated.load(Ordering::Relaxed) {
        return false;
    }
    client
        .get_or_insert_with(Default::default)
        .named
        .insert(name.into(), def);
    true
}
