//! Parse messages: a named statement prepared once per server and re-prepared where it is
//! missing, the unnamed one, statements whose text is rewritten, and names the pooler
//! reserves.

use std::sync::Arc;

use shoal_wire::frame::{FrameError, Reader, HEADER_LEN};
use shoal_wire::sql;

use super::{
    ends_transaction, parse_message, reserved_message, shown, ToServer, Translator, RESERVED_PREFIX,
};
use crate::prepared::{
    parse_text, set_of_with, Derived, Expect, StatementDef, StatementRegistry, Unnamed,
    DEALLOCATE_TARGET,
};
use crate::sets::SetOp;

impl Translator<'_> {
    pub(super) fn parse(&mut self, msg: &[u8], out: &mut impl ToServer) -> Result<(), FrameError> {
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
        let def = intern(self.registry, crate::prepared::params_key(self.params));
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
}
