//! Simple-protocol queries: what a statement leaves behind in the session (settings, state
//! that pins it to its server, a changed encoding), read once per query; `EXECUTE` and
//! `DEALLOCATE` of a client's protocol-level statements run against the server's copy; and
//! statements naming the pooler's reserved prepared statements refused.

use bytes::BufMut;
use shoal_wire::backend::put_message;
use shoal_wire::frame::{FrameError, Reader, HEADER_LEN};
use shoal_wire::frontend::tag as fe;
use shoal_wire::sql;

use super::{reserved_message, ToServer, Translator, RESERVED_HINT, RESERVED_PREFIX};
use crate::prepared::{set_of_with, Expect};

impl Translator<'_> {
    pub(super) fn query(&mut self, msg: &[u8], out: &mut impl ToServer) -> Result<(), FrameError> {
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
