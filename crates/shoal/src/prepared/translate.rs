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
    parse_text, set_of_with, ClientStatements, Derived, Expect, ServerStatements, StatementDef,
    StatementRegistry, Unnamed, DEALLOCATE_TARGET,
};
use crate::sets::SetOp;

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

    /// SQL `EXECUTE name`, `EXPLAIN EXECUTE name` or `DEALLOCATE name` in a Parse, naming one
    /// of the client's protocol-level statements: the Parse body to send instead (the name
    /// replaced by the server's, or by [`DEALLOCATE_TARGET`] so the client's statement stays
    /// on the server for others) and what the rewritten statement does.
    #[cold]
    #[inline(never)]
    fn rewrite_parse(&mut self, text: &[u8], rest: &[u8]) -> Option<(Vec<u8>, Derived)> {
        let Some(cmd) = sql::named_statement_command(text, self.encoding) else {
            // `DEALLOCATE ALL`: the client's statements go, the server's copies stay.
            let fx = sql::classify(text, self.encoding);
            if !(sql::FirstWord::of(text).is(b"deallocate") && fx.drops_statements && !fx.multi) {
                return None;
            }
            let mut body = format!("DEALLOCATE {DEALLOCATE_TARGET}").into_bytes();
            body.extend_from_slice(&rest[text.len()..]);
            let d = Derived {
                set_op: Some(SetOp::Deallocate(Box::default())),
                ..Derived::default()
            };
            return Some((body, d));
        };
        if self.client.as_ref().is_none_or(|c| !c.contains(&cmd.name)) {
            return None;
        }
        let def = self.lookup(&cmd.name)?;
        let (name, derived) = if cmd.execute {
            let d = Derived {
                set_op: def.set_op.clone(),
                effects: def.effects,
                depends: Some(def.clone()),
            };
            (def.name.as_bytes(), d)
        } else {
            let d = Derived {
                set_op: Some(SetOp::Deallocate(cmd.name.clone().into())),
                ..Derived::default()
            };
            (DEALLOCATE_TARGET.as_bytes(), d)
        };
        let mut body = Vec::with_capacity(rest.len() + name.len());
        body.extend_from_slice(&text[..cmd.name_at.start]);
        body.extend_from_slice(name);
        body.extend_from_slice(&text[cmd.name_at.end..]);
        // The NUL ending the text, and the parameter types after it.
        body.extend_from_slice(&rest[text.len()..]);
        Some((body, derived))
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

    fn parse(&mut self, msg: &[u8], out: &mut impl ToServer) -> Result<(), FrameError> {
        let mut r = Reader::new(&msg[HEADER_LEN..]);
        let name = r.cstr_bytes()?;
        let rest = r.rest();
        // The text of an unnamed Parse repeating the last one was looked at then.
        let repeated = name.is_empty()
            && self
                .client
                .as_ref()
                .and_then(|c| c.unnamed.as_ref())
                .is_some_and(|u| !u.body.is_empty() && u.body == rest);
        let text = parse_text(rest);
        // A new text is read once: its first word and whether it is plain serve both the
        // reserved-name check and (unnamed) its classification below.
        let read = (!repeated).then(|| {
            let first = sql::FirstWord::of(text);
            (first, sql::is_plain(first, text))
        });
        if read.is_some_and(|(f, _)| f.is(b"prepare")) {
            if let Some(sql_name) = sql::prepare_name(text, self.encoding) {
                self.client
                    .get_or_insert_with(Default::default)
                    .sql_prepared(&sql_name, text);
            }
        }
        let reserved = match read {
            Some((_, false)) => {
                if sql::may_change_encoding(text) {
                    *self.recoding = true;
                }
                sql::prepared_name_with_prefix(text, RESERVED_PREFIX, self.encoding)
            }
            _ => None,
        };
        if let Some(reserved) = reserved {
            // As in a simple query: the pooler's statements are no client's to name. The
            // client's unnamed statement is gone, as after any failed Parse of one.
            if name.is_empty() {
                if let Some(c) = self.client.as_mut() {
                    c.unnamed = None;
                }
            }
            self.fail(
                shoal_wire::sqlstate::INVALID_SQL_STATEMENT_NAME,
                reserved_message(&reserved),
                out.buf(),
            );
            return Ok(());
        }
        let rewritten = match read {
            Some((first, false)) if first.is_any(&[b"execute", b"deallocate", b"explain"]) => {
                self.rewrite_parse(text, rest)
            }
            _ => None,
        };
        if let Some((body, derived)) = rewritten {
            return self.parse_rewritten(name, body, derived, out);
        }
        if name.is_empty() {
            let c = self.client.get_or_insert_with(Default::default);
            c.unnamed_seq += 1;
            let u = c.unnamed.get_or_insert_with(Unnamed::default);
            u.seq = c.unnamed_seq;
            // Drivers without named statements parse the same text again and again: what it
            // does was read from it last time.
            if let Some((first, plain)) = read {
                let fx = if plain {
                    sql::Effects::default()
                } else {
                    sql::classify_with(first, text, self.encoding)
                };
                u.dirty = fx.dirty;
                u.keeps = fx.keeps;
                u.set_op = set_of_with(first, text, self.encoding);
                u.body.clear();
                u.body.extend_from_slice(rest);
            }
            self.server.unnamed_owner = Some((self.client_id, u.seq));
            out.pass(msg);
            self.queue.push_back(Expect::ParseUnnamed(u.seq));
            return Ok(());
        }
        let ends = ends_transaction(text);
        let enc = self.encoding;
        self.parse_named(name, ends, out, |registry, params| {
            registry.intern(params, rest, enc)
        });
        Ok(())
    }

    /// A named Parse: refused as PostgreSQL refuses it (inside a failed transaction block
    /// unless it `ends_transaction`, or under a name the client already uses), else the
    /// statement `intern` makes is the client's, sent unless the server has it (after any
    /// statement it depends on).
    fn parse_named(
        &mut self,
        name: &[u8],
        ends_transaction: bool,
        out: &mut impl ToServer,
        intern: impl FnOnce(&StatementRegistry, u64) -> Arc<StatementDef>,
    ) {
        if self.aborted && !ends_transaction {
            // As PostgreSQL: refused before the name is looked at, and no statement is made
            // (a server that already has this text must not answer for it).
            self.fail(
                shoal_wire::sqlstate::IN_FAILED_SQL_TRANSACTION,
                "current transaction is aborted, commands ignored until end of transaction block"
                    .into(),
                out.buf(),
            );
            return;
        }
        if self.client.as_ref().is_some_and(|c| c.contains(name)) {
            self.fail(
                shoal_wire::sqlstate::DUPLICATE_PREPARED_STATEMENT,
                format!("prepared statement \"{}\" already exists", shown(name)),
                out.buf(),
            );
            return;
        }
        let def = intern(self.registry, super::params_key(self.params));
        self.client
            .get_or_insert_with(Default::default)
            .named
            .insert(name.into(), def.clone());
        if def.depends.is_some() {
            self.ensure_dependencies(&def, out);
        }
        if self.server.touch(def.id) {
            self.queue.push_back(Expect::SyntheticParse(name.into()));
        } else {
            self.prepare(&def, out.buf());
            self.queue.push_back(Expect::Parse(def, name.into()));
        }
    }

    /// A Parse whose text [`Translator::rewrite_parse`] rewrote: as any Parse, with the new
    /// body, after the statement it names.
    #[cold]
    #[inline(never)]
    fn parse_rewritten(
        &mut self,
        name: &[u8],
        body: Vec<u8>,
        derived: Derived,
        out: &mut impl ToServer,
    ) -> Result<(), FrameError> {
        if name.is_empty() {
            if let Some(dep) = &derived.depends {
                self.ensure_prepared(dep, out);
            }
            let c = self.client.get_or_insert_with(Default::default);
            c.unnamed_seq += 1;
            let u = c.unnamed.get_or_insert_with(Unnamed::default);
            u.seq = c.unnamed_seq;
            u.dirty = derived.effects.dirty;
            u.keeps = derived.effects.keeps;
            u.set_op = derived.set_op;
            u.depends = derived.depends;
            u.body.clear();
            u.body.extend_from_slice(&body);
            self.server.unnamed_owner = Some((self.client_id, u.seq));
            let seq = u.seq;
            parse_message(out.buf(), b"", &body);
            self.queue.push_back(Expect::ParseUnnamed(seq));
            return Ok(());
        }
        let enc = self.encoding;
        self.parse_named(name, false, out, move |registry, params| {
            registry.intern_rewritten(params, &body, derived, enc)
        });
        Ok(())
    }

    fn query(&mut self, msg: &[u8], out: &mut impl ToServer) -> Result<(), FrameError> {
        let text = Reader::new(&msg[HEADER_LEN..]).cstr_bytes()?;
        // A simple query drops the unnamed statement, in PostgreSQL and so here.
        self.server.unnamed_dropped();
        if let Some(c) = self.client.as_mut() {
            c.unnamed = None;
        }
        // The statement kind, read once for the checks below. A plain statement (the common
        // case, decided in one pass) can neither name a prepared statement nor change the session.
        let first = sql::FirstWord::of(text);
        let plain = sql::is_plain(first, text);
        if !plain {
            if sql::may_change_encoding(text) {
                *self.recoding = true;
            }
            if let Some(name) = sql::prepared_name_with_prefix(text, RESERVED_PREFIX, self.encoding)
            {
                // The pooler's statements belong to no client: refuse by SQL, on the server (so
                // a transaction block fails as it would for any error).
                let sql = format!(
                    "DO $shoal$BEGIN RAISE EXCEPTION USING ERRCODE = '26000', MESSAGE = '{}', HINT = '{RESERVED_HINT}'; END$shoal$",
                    reserved_message(&name),
                );
                shoal_wire::frontend::query(out.buf(), &sql);
                self.queue.push_back(Expect::Query(None));
                return Ok(());
            }
        }
        let fx = if plain {
            sql::Effects::default()
        } else {
            sql::classify_with(first, text, self.encoding)
        };
        if fx.dirty {
            let untracked = set_of_with(first, text, self.encoding).is_none();
            *self.untracked |= untracked;
            *self.keeps |= fx.keeps && untracked;
            *self.dirty = true;
            *self.recoding = true;
        }
        if fx.drops_statements {
            self.server.clear();
            if let Some(c) = self.client.as_mut() {
                c.forget_all();
            }
        }
        if first.is_any(&[b"execute", b"deallocate", b"explain"]) {
            if let Some(cmd) = sql::named_statement_command(text, self.encoding) {
                let def = self
                    .client
                    .as_ref()
                    .and_then(|c| c.named.get(&cmd.name[..]).cloned());
                if let Some(def) = def {
                    if !cmd.execute {
                        // The client's own statement: only its name goes away.
                        if let Some(c) = self.client.as_mut() {
                            c.named.remove(&cmd.name[..]);
                        }
                        self.queue
                            .push_back(Expect::SyntheticDeallocate(cmd.name.into()));
                        return Ok(());
                    }
                    // EXECUTE of a protocol-level statement: run the server's copy. A hidden
                    // Sync follows an injected Parse so that a failure cannot make the
                    // server ignore the query.
                    if !self.server.touch(def.id) {
                        self.prepare(&def, out.buf());
                        self.queue.push_back(Expect::HideParse(def.clone()));
                        put_message(out.buf(), fe::SYNC, |_| {});
                        self.queue.push_back(Expect::HideSync);
                    }
                    if def.effects.dirty {
                        *self.untracked |= def.set_op.is_none();
                        *self.keeps |= def.effects.keeps && def.set_op.is_none();
                        *self.dirty = true;
                        *self.recoding = true;
                    }
                    put_message(out.buf(), fe::QUERY, |b| {
                        b.put_slice(&text[..cmd.name_at.start]);
                        b.put_slice(def.name.as_bytes());
                        b.put_slice(&text[cmd.name_at.end..]);
                        b.put_u8(0);
                    });
                    self.queue.push_back(Expect::Query(None));
                    return Ok(());
                }
            }
        }
        if first.is(b"prepare") {
            if let Some(name) = sql::prepare_name(text, self.encoding) {
                self.client
                    .get_or_insert_with(Default::default)
                    .sql_prepared(&name, text);
            }
        }
        out.pass(msg);
        self.queue
            .push_back(Expect::Query(set_of_with(first, text, self.encoding)));
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
