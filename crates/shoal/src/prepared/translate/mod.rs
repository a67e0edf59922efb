//! The client side of the translation: what the server must receive for each client message,
//! and the replies it will owe.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use shoal_wire::backend::{put_cstr, put_message};
use shoal_wire::frame::{FrameError, Reader, HEADER_LEN};
use shoal_wire::frontend::tag as fe;
use shoal_wire::sql::{self, ClientEncoding};

use super::{
    ClientStatements, Expect, ServerStatements, StatementDef, StatementRegistry, DEALLOCATE_TARGET,
};
use crate::sets::SetOp;

mod parse;
mod query;

/// Where the translation of client messages goes. A message passed on unchanged is handed
/// over whole ([`ToServer::pass`]), so the relay can send it from where it lies; anything else
/// is written into [`ToServer::buf`], after everything handed over before.
pub trait ToServer {
    fn pass(&mut self, msg: &[u8]);
    fn buf(&mut self) -> &mut BytesMut;
}

impl ToServer for BytesMut {
    fn pass(&mut self, msg: &[u8]) {
        self.extend_from_slice(msg);
    }

    fn buf(&mut self) -> &mut BytesMut {
        self
    }
}

/// Per-attachment state of the translation.
pub struct Translator<'a> {
    pub registry: &'a StatementRegistry,
    /// The client's session parameters, hashed ([`super::params_key`]) only when a
    /// statement is interned: most messages never need it.
    pub params: &'a [(String, String)],
    /// The client's connection id: whose unnamed statement a server holds.
    pub client_id: u64,
    pub client: &'a mut Option<Box<ClientStatements>>,
    pub server: &'a mut ServerStatements,
    pub queue: &'a mut VecDeque<Expect>,
    pub max_per_server: usize,
    /// Set when a message sent leaves session state behind on the server.
    pub dirty: &'a mut bool,
    /// How the server reads the client's text now ([`ClientEncoding::Unknown`] while a
    /// change may be on its way).
    pub encoding: ClientEncoding,
    /// Set when a message sent may change that (see [`sql::may_change_encoding`]).
    pub recoding: &'a mut bool,
    /// Set when a message sent leaves state that Shoal does not follow (anything dirty but
    /// a session `SET` it replays): what the client's statements read may then depend on
    /// more than its startup parameters and held SETs.
    pub untracked: &'a mut bool,
    /// Of `untracked`, state that surely lasts past its transaction (see
    /// [`sql::Effects::keeps`]): a client that would lose it is told.
    pub keeps: &'a mut bool,
    /// The client's transaction block has failed (status `E`): PostgreSQL refuses to parse
    /// anything but a statement that ends it.
    pub aborted: bool,
}

fn parse_message(out: &mut BytesMut, name: &[u8], body: &[u8]) {
    put_message(out, fe::PARSE, |b| {
        b.put_slice(name);
        b.put_u8(0);
        b.put_slice(body);
    });
}

/// Quotes a client-supplied name for an error message (it may be in any encoding).
fn shown(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
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
        parse_message(out, def.name.as_bytes(), &def.body);
    }

    /// Makes sure the server has `def` prepared before a Bind or Describe of it (and the
    /// statement its `EXECUTE` names, first); the reply to a Parse put in for that is hidden.
    fn ensure_prepared(&mut self, def: &Arc<StatementDef>, out: &mut impl ToServer) {
        if def.depends.is_some() {
            self.ensure_dependencies(def, out);
        }
        if !self.server.touch(def.id) {
            self.prepare(def, out.buf());
            self.queue.push_back(Expect::HideParse(Arc::clone(def)));
        }
    }

    /// The statements `def`'s `EXECUTE` names (and theirs), innermost first.
    #[cold]
    #[inline(never)]
    fn ensure_dependencies(&mut self, def: &StatementDef, out: &mut impl ToServer) {
        let mut chain = Vec::new();
        let mut next = def.depends.clone();
        while let Some(d) = next {
            next = d.depends.clone();
            chain.push(d);
        }
        for dep in chain.iter().rev() {
            if !self.server.touch(dep.id) {
                self.prepare(dep, out.buf());
                self.queue.push_back(Expect::HideParse(Arc::clone(dep)));
            }
        }
    }

    /// Refuses the client message with type `tag` instead of passing it on: the server is
    /// made to fail in its place (so a transaction it is in fails, and later messages up to
    /// the Sync are skipped, as PostgreSQL does for an error), and the client gets `code`
    /// and `message`. A Query or FunctionCall is answered with ReadyForQuery too.
    pub fn refuse(
        &mut self,
        tag: u8,
        code: &'static str,
        message: String,
        out: &mut impl ToServer,
    ) {
        self.fail(code, message, out.buf());
        if matches!(tag, fe::QUERY | fe::FUNCTION_CALL) {
            shoal_wire::frontend::sync(out.buf());
            self.queue.push_back(Expect::Sync);
        }
    }

    /// Makes the server fail here with `code` and `message` (see [`Expect::Fail`]).
    fn fail(&mut self, code: &'static str, message: String, out: &mut BytesMut) {
        // A syntax error: it is raised before the name is looked at, and has no effect.
        parse_message(out, b"shoal_error", b")\0\0\0");
        self.queue
            .push_back(Expect::Fail(Box::new((code, message))));
    }

    /// Makes sure the server holds this client's unnamed statement; false (and the server
    /// made to fail) when the client has none.
    fn ensure_unnamed(&mut self, out: &mut impl ToServer) -> bool {
        let Some(u) = self.client.as_ref().and_then(|c| c.unnamed.as_ref()) else {
            self.fail(
                shoal_wire::sqlstate::INVALID_SQL_STATEMENT_NAME,
                "unnamed prepared statement does not exist".into(),
                out.buf(),
            );
            return false;
        };
        let (seq, dirty, keeps, tracked) = (u.seq, u.dirty, u.keeps, u.set_op.is_some());
        if u.depends.is_some() || matches!(u.set_op, Some(SetOp::Deallocate(_))) {
            self.unnamed_prerequisites(out);
        }
        let owner = (self.client_id, seq);
        if self.server.unnamed_owner != Some(owner) {
            if let Some(u) = self.client.as_ref().and_then(|c| c.unnamed.as_ref()) {
                parse_message(out.buf(), b"", &u.body);
            }
            self.queue.push_back(Expect::HideParseUnnamed(seq));
            self.server.unnamed_owner = Some(owner);
        }
        if dirty {
            *self.untracked |= !tracked;
            *self.keeps |= keeps && !tracked;
            *self.dirty = true;
            *self.recoding = true;
        }
        true
    }

    /// What the client's unnamed statement needs on the server before it is parsed or
    /// bound, when its text was rewritten: the statement its `EXECUTE` names, or the
    /// placeholder its `DEALLOCATE` removes.
    #[cold]
    #[inline(never)]
    fn unnamed_prerequisites(&mut self, out: &mut impl ToServer) {
        let Some(u) = self.client.as_ref().and_then(|c| c.unnamed.as_ref()) else {
            return;
        };
        let (depends, target) = (
            u.depends.clone(),
            matches!(u.set_op, Some(SetOp::Deallocate(_))),
        );
        if let Some(dep) = depends {
            self.ensure_prepared(&dep, out);
        }
        if target {
            self.prepare_target(out.buf());
        }
    }

    /// Puts [`DEALLOCATE_TARGET`] on the server for a client's `DEALLOCATE` about to run
    /// through the extended protocol (closed first: an earlier one may not have run).
    #[cold]
    #[inline(never)]
    fn prepare_target(&mut self, out: &mut BytesMut) {
        put_message(out, fe::CLOSE, |b| {
            b.put_u8(b'S');
            put_cstr(b, DEALLOCATE_TARGET);
        });
        self.queue.push_back(Expect::HideTarget);
        parse_message(out, DEALLOCATE_TARGET.as_bytes(), b"SELECT\0\0\0");
        self.queue.push_back(Expect::HideTarget);
    }

    /// The client's statement of that name; a stale one is replaced by a fresh statement of
    /// the same text (prepared anew on first use), so the client's retry after a DDL works.
    fn lookup(&mut self, name: &[u8]) -> Option<Arc<StatementDef>> {
        let def = self.client.as_ref()?.named.get(name).cloned()?;
        if !def.is_stale() {
            return Some(def);
        }
        let fresh = self
            .registry
            .intern(super::params_key(self.params), &def.body, self.encoding);
        if let Some(c) = self.client.as_mut() {
            c.named.insert(name.into(), fresh.clone());
        }
        Some(fresh)
    }

    fn missing_statement(&mut self, name: &[u8], out: &mut BytesMut) {
        self.fail(
            shoal_wire::sqlstate::INVALID_SQL_STATEMENT_NAME,
            format!("prepared statement \"{}\" does not exist", shown(name)),
            out,
        );
    }

    /// Appends to `out` what the server must receive for the client message `msg` (a whole,
    /// validated frame), and queues the replies it will owe.
    pub fn client_message(
        &mut self,
        msg: &[u8],
        out: &mut impl ToServer,
    ) -> Result<(), FrameError> {
        let body = &msg[HEADER_LEN..];
        match msg[0] {
            fe::PARSE => self.parse(msg, out)?,
            fe::BIND => {
                let mut r = Reader::new(body);
                let portal = r.cstr_bytes()?;
                let stmt = r.cstr_bytes()?;
                let rest = r.rest();
                if stmt.is_empty() {
                    if !self.ensure_unnamed(out) {
                        return Ok(());
                    }
                    if portal.is_empty() {
                        self.server.portal_set = self
                            .client
                            .as_ref()
                            .and_then(|c| c.unnamed.as_ref())
                            .and_then(|u| u.set_op.clone());
                    }
                    out.pass(msg);
                    self.queue.push_back(Expect::Bind(None));
                    return Ok(());
                }
                let Some(def) = self.lookup(stmt) else {
                    self.missing_statement(stmt, out.buf());
                    return Ok(());
                };
                if portal.is_empty() {
                    self.server.portal_set = def.set_op.clone();
                }
                if def.effects.dirty {
                    *self.untracked |= def.set_op.is_none();
                    *self.keeps |= def.effects.keeps && def.set_op.is_none();
                    *self.dirty = true;
                    *self.recoding = true;
                }
                self.ensure_prepared(&def, out);
                if matches!(def.set_op, Some(SetOp::Deallocate(_))) {
                    self.prepare_target(out.buf());
                }
                put_message(out.buf(), fe::BIND, |b| {
                    b.put_slice(portal);
                    b.put_u8(0);
                    put_cstr(b, &def.name);
                    b.put_slice(rest);
                });
                self.queue.push_back(Expect::Bind(Some(def)));
            }
            fe::DESCRIBE => {
                let mut r = Reader::new(body);
                let kind = r.u8()?;
                let name = r.cstr_bytes()?;
                if kind != b'S' {
                    out.pass(msg);
                    self.queue.push_back(Expect::DescribePortal);
                } else if name.is_empty() {
                    if self.ensure_unnamed(out) {
                        out.pass(msg);
                        self.queue.push_back(Expect::DescribeStatement(None));
                    }
                } else if let Some(def) = self.lookup(name) {
                    self.ensure_prepared(&def, out);
                    put_message(out.buf(), fe::DESCRIBE, |b| {
                        b.put_u8(b'S');
                        put_cstr(b, &def.name);
                    });
                    self.queue.push_back(Expect::DescribeStatement(Some(def)));
                } else {
                    self.missing_statement(name, out.buf());
                }
            }
            fe::CLOSE => {
                let mut r = Reader::new(body);
                let kind = r.u8()?;
                let name = r.cstr_bytes()?;
                if kind == b'S' && !name.is_empty() {
                    // Other clients may share the server's copy: only this client forgets it.
                    self.queue.push_back(Expect::SyntheticClose(name.into()));
                } else {
                    if kind == b'S' {
                        if let Some(c) = self.client.as_mut() {
                            c.unnamed = None;
                        }
                        self.server.unnamed_owner = None;
                    }
                    out.pass(msg);
                    self.queue.push_back(Expect::Close);
                }
            }
            fe::EXECUTE => {
                out.pass(msg);
                let portal = Reader::new(body).cstr_bytes()?;
                let op = if portal.is_empty() {
                    self.server.portal_set.clone()
                } else {
                    None
                };
                self.queue.push_back(Expect::Execute(op));
            }
            fe::SYNC => {
                out.pass(msg);
                self.queue.push_back(Expect::Sync);
            }
            fe::QUERY => self.query(msg, out)?,
            fe::FUNCTION_CALL => {
                out.pass(msg);
                // A function may change anything in the session.
                *self.untracked = true;
                *self.dirty = true;
                *self.recoding = true;
                self.queue.push_back(Expect::Query(None));
            }
            _ => out.pass(msg),
        }
        Ok(())
    }
}

/// The start of the names Shoal gives statements on its servers: a client's SQL may not name
/// them (`EXECUTE`, `DEALLOCATE`, `PREPARE`, `EXPLAIN EXECUTE`, ..., through either protocol).
const RESERVED_PREFIX: &[u8] = b"shoal_";
const RESERVED_HINT: &str = "names starting with shoal_ are reserved by the Shoal pooler";

/// Statements PostgreSQL parses inside a failed transaction block: those that end it
/// (`COMMIT`, `ROLLBACK [TO SAVEPOINT]`, `PREPARE TRANSACTION`, and their synonyms).
fn ends_transaction(text: &[u8]) -> bool {
    sql::FirstWord::of(text).is_any(&[b"commit", b"end", b"rollback", b"abort", b"prepare"])
}

/// PostgreSQL's message for a statement that does not exist, naming it in characters safe to
/// put inside SQL quotes.
fn reserved_message(name: &[u8]) -> String {
    let shown: String = String::from_utf8_lossy(name)
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    format!("prepared statement \"{shown}\" does not exist")
}

/// Whether an error says a statement must be retired: its cached plan's result type changed
/// (`0A000` from the plan cache's revalidation), or a type it was planned with is gone (an
/// internal `XX000 cache lookup failed`, which PostgreSQL never translates). Recognised by
/// SQLSTATE and routine, not by message text, so any `lc_messages` works.
pub fn plan_error(e: &shoal_wire::backend::ErrorFields) -> bool {
    (e.code == "0A000" && e.routine == "RevalidateCachedQuery")
        || (e.code == "XX000" && e.message.starts_with("cache lookup failed for type"))
}

/// Marks a statement stale for every client.
pub fn retire(def: &StatementDef) {
    def.stale.store(true, Ordering::Relaxed);
}
