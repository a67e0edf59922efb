//! Client `SET`s in transaction mode: which ones hold for the client's session, so they can be
//! replayed on whichever server runs its next transaction.
//!
//! Shoal follows single statements (`SET [SESSION] name …`, `SET TIME ZONE …`,
//! `SET SESSION CHARACTERISTICS AS TRANSACTION …`, `SET ROLE`, `SET SESSION AUTHORIZATION`,
//! `RESET name`, `RESET ALL`, `DISCARD ALL`), sent as a simple query or as an
//! extended-protocol statement (named or unnamed, as pgJDBC and pgx send them). A `SET` takes
//! effect for the session when its transaction commits (at once outside a transaction block)
//! and is forgotten if the transaction rolls back, as in PostgreSQL. `SET LOCAL` lasts for its
//! transaction only and needs nothing. Other ways of changing settings (several statements in
//! one query, `set_config()`, inside functions) are not replayed; the server is still cleaned
//! before another client uses it.
//!
//! `LISTEN`/`UNLISTEN` follow the same rules: the channels a client listens to are session
//! state, in force once their transaction commits.

use shoal_wire::sql::ListenCommand;

/// One session-level change a client made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetOp {
    /// `SET name …`: the statement text, replayed as is.
    Set {
        name: Box<str>,
        sql: Box<str>,
    },
    Reset {
        name: Box<str>,
    },
    ResetAll,
    /// `DISCARD ALL`: `RESET ALL`, and every channel unlistened.
    DiscardAll,
    /// `LISTEN channel`, `UNLISTEN channel`, `UNLISTEN *`: carried by the pool's listening
    /// connection (see [`crate::notify`]); channels as PostgreSQL names them.
    Listen(Box<[u8]>),
    Unlisten(Box<[u8]>),
    UnlistenAll,
    /// `SAVEPOINT name`, `RELEASE [SAVEPOINT] name`, `ROLLBACK [WORK | TRANSACTION] TO
    /// [SAVEPOINT] name`: a rollback to a savepoint undoes the SETs made since, as in
    /// PostgreSQL.
    Savepoint(Box<str>),
    Release(Box<str>),
    RollbackTo(Box<str>),
    /// SQL `DEALLOCATE name` of a client's protocol-level statement (empty: `DEALLOCATE
    /// ALL`), run through the extended protocol: once it completes, the client's statement
    /// `name` is gone.
    Deallocate(Box<[u8]>),
}

impl SetOp {
    /// Whether it changes what the client listens to (`DISCARD ALL` does too).
    pub fn is_listen(&self) -> bool {
        matches!(
            self,
            SetOp::Listen(_) | SetOp::Unlisten(_) | SetOp::UnlistenAll | SetOp::DiscardAll
        )
    }

    /// Whether it is about savepoints (completes with its own tags, not `SET`).
    pub fn is_savepoint(&self) -> bool {
        matches!(
            self,
            SetOp::Savepoint(_) | SetOp::Release(_) | SetOp::RollbackTo(_)
        )
    }
}

/// A savepoint's name as PostgreSQL folds it (`None` for what is not a plain name).
fn savepoint_name(word: &str) -> Option<Box<str>> {
    if let Some(q) = word.strip_prefix('"').and_then(|w| w.strip_suffix('"')) {
        return (!q.is_empty() && !q.contains('"')).then(|| q.into());
    }
    (!word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80))
    .then(|| word.to_ascii_lowercase().into())
}

/// `SAVEPOINT`, `RELEASE` and `ROLLBACK ... TO` statements (the words after the first).
fn savepoint_op(first: &str, mut words: std::str::SplitWhitespace<'_>) -> Option<SetOp> {
    let mut next = words.next()?;
    let op = match first {
        "savepoint" => SetOp::Savepoint(savepoint_name(next)?),
        "release" => {
            if next.eq_ignore_ascii_case("savepoint") {
                next = words.next()?;
            }
            SetOp::Release(savepoint_name(next)?)
        }
        _ => {
            if next.eq_ignore_ascii_case("work") || next.eq_ignore_ascii_case("transaction") {
                next = words.next()?;
            }
            if !next.eq_ignore_ascii_case("to") {
                return None;
            }
            next = words.next()?;
            if next.eq_ignore_ascii_case("savepoint") {
                next = words.next()?;
            }
            SetOp::RollbackTo(savepoint_name(next)?)
        }
    };
    words.next().is_none().then_some(op)
}

/// Recognises a single session-level `SET`/`RESET`/`DISCARD ALL` statement, in a text
/// whose bytes are its characters (the caller has checked the client's encoding).
pub fn parse(sql: &str) -> Option<SetOp> {
    let start = shoal_wire::sql::leading_comments_len(sql.as_bytes());
    let text = sql[start..].trim().trim_end_matches(';').trim_end();
    let mut words = text.split_whitespace();
    let first = words.next()?.to_ascii_lowercase();
    // A quoted channel may hold a semicolon; the lexer finds where LISTEN ends.
    if text.contains(';') && first != "listen" && first != "unlisten" {
        return None;
    }
    match first.as_str() {
        "savepoint" | "release" | "rollback" | "abort" => savepoint_op(&first, words),
        "discard" => (words.next()?.eq_ignore_ascii_case("all") && words.next().is_none())
            .then_some(SetOp::DiscardAll),
        "listen" | "unlisten" => Some(
            match shoal_wire::sql::listen_command(
                text.as_bytes(),
                shoal_wire::sql::ClientEncoding::Utf8,
            )? {
                ListenCommand::Listen(c) => SetOp::Listen(c.into()),
                ListenCommand::Unlisten(c) => SetOp::Unlisten(c.into()),
                ListenCommand::UnlistenAll => SetOp::UnlistenAll,
            },
        ),
        "reset" => {
            let name = words.next()?.to_ascii_lowercase();
            if words.next().is_some() {
                return None;
            }
            if name == "all" {
                Some(SetOp::ResetAll)
            } else {
                Some(SetOp::Reset { name: name.into() })
            }
        }
        "set" => {
            let mut name = words.next()?.to_ascii_lowercase();
            if name == "session" {
                name = words.next()?.to_ascii_lowercase();
                if name == "authorization" {
                    return Some(SetOp::Set {
                        name: "session authorization".into(),
                        sql: text.into(),
                    });
                }
                if name == "characteristics" {
                    // The session's default transaction modes: replayed like a SET.
                    return Some(SetOp::Set {
                        name: "session characteristics".into(),
                        sql: text.into(),
                    });
                }
            }
            match name.as_str() {
                "local" | "transaction" | "constraints" => return None,
                "time" => name = "timezone".into(),
                _ => {}
            }
            // `SET name=value` written without spaces.
            let name = name.split('=').next()?.to_string();
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
            {
                return None;
            }
            Some(SetOp::Set {
                name: name.into(),
                sql: text.into(),
            })
        }
        _ => None,
    }
}

/// A client's session-level settings, and those waiting for their transaction to end.
#[derive(Debug, Default)]
pub struct SessionSets {
    /// In force for the session, in order (at most one per name).
    pub held: Vec<(Box<str>, Box<str>)>,
    /// Done inside the current transaction (SETs, and the savepoints between them),
    /// effective if it commits.
    in_transaction: Vec<SetOp>,
    /// An error since the last ReadyForQuery: a transaction that ends now without a COMMIT
    /// (an implicit one: a pipeline up to Sync) rolled back.
    failed: bool,
    /// Unique to each state of `held` (process-wide), 0 when nothing is held: a server that
    /// had this state applied needs nothing more for this client.
    pub fingerprint: u64,
    /// The channels the client listens to, in force (in the order first listened).
    pub listening: Vec<Box<[u8]>>,
    /// `listening` changed since the pool's listening connection was last told.
    pub listening_changed: bool,
    /// The current transaction sent SQL that may notify while someone in the pool listens:
    /// its server is claimed (see [`crate::notify::Hub::claim`]), and what it sent reaches
    /// the pool's listeners (the client itself included) before its ReadyForQuery, as in
    /// PostgreSQL.
    pub notified: bool,
}

static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl SessionSets {
    /// A tracked statement completed.
    pub fn executed(&mut self, op: SetOp) {
        let mark = |ops: &[SetOp], name: &str| {
            ops.iter()
                .rposition(|o| matches!(o, SetOp::Savepoint(n) if **n == *name))
        };
        match op {
            SetOp::Release(name) => {
                // The savepoint and those made after it are gone; their SETs stay.
                if let Some(at) = mark(&self.in_transaction, &name) {
                    let mut i = 0;
                    self.in_transaction.retain(|o| {
                        let keep = i < at || !matches!(o, SetOp::Savepoint(_));
                        i += 1;
                        keep
                    });
                }
            }
            SetOp::RollbackTo(name) => match mark(&self.in_transaction, &name) {
                // The savepoint stays; what came after it is undone.
                Some(at) => self.in_transaction.truncate(at + 1),
                // Made before Shoal followed this client's SETs: all of them came after it.
                None => self.in_transaction.clear(),
            },
            op => self.in_transaction.push(op),
        }
    }

    /// A COMMIT or ROLLBACK completed (also `... AND CHAIN`, which opens the next
    /// transaction at once).
    pub fn transaction_end(&mut self, committed: bool) {
        let ops = std::mem::take(&mut self.in_transaction);
        if committed {
            self.apply(ops);
        }
    }

    /// An ErrorResponse.
    pub fn error(&mut self) {
        self.failed = true;
    }

    /// ReadyForQuery: at status `I` the transaction is over; what is left of it was outside a
    /// transaction block, and holds unless an error rolled it back.
    pub fn ready(&mut self, status: u8) {
        let failed = std::mem::take(&mut self.failed);
        if status != b'I' {
            return;
        }
        self.notified = false;
        let ops = std::mem::take(&mut self.in_transaction);
        if !failed {
            self.apply(ops);
        }
    }

    /// Whether the pool's listening connection must hear from this client before a
    /// ReadyForQuery with status `I` reaches it: a change to what it listens to takes effect
    /// (or its own NOTIFY is delivered to it) by then.
    pub fn listener_due_before_ready(&self) -> bool {
        self.listening_changed
            || (!self.failed && self.in_transaction.iter().any(SetOp::is_listen))
            || self.notified
    }

    fn apply(&mut self, ops: Vec<SetOp>) {
        if !ops.iter().any(|o| !o.is_savepoint()) {
            return;
        }
        let mut held_changed = false;
        for op in ops {
            held_changed |= matches!(
                op,
                SetOp::Set { .. } | SetOp::Reset { .. } | SetOp::ResetAll | SetOp::DiscardAll
            );
            match op {
                SetOp::Set { name, sql } => {
                    self.held.retain(|(n, _)| *n != name);
                    self.held.push((name, sql));
                }
                SetOp::Reset { name } => self.held.retain(|(n, _)| *n != name),
                SetOp::ResetAll => self.held.clear(),
                SetOp::DiscardAll => {
                    self.held.clear();
                    self.unlisten_all();
                }
                SetOp::Listen(c) => {
                    if !self.listening.contains(&c) {
                        self.listening.push(c);
                        self.listening_changed = true;
                    }
                }
                SetOp::Unlisten(c) => {
                    if let Some(i) = self.listening.iter().position(|l| *l == c) {
                        self.listening.remove(i);
                        self.listening_changed = true;
                    }
                }
                SetOp::UnlistenAll => self.unlisten_all(),
                SetOp::Savepoint(_)
                | SetOp::Release(_)
                | SetOp::RollbackTo(_)
                | SetOp::Deallocate(_) => {}
            }
        }
        if !held_changed {
            return;
        }
        self.fingerprint = if self.held.is_empty() {
            0
        } else {
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        };
    }

    fn unlisten_all(&mut self) {
        if !self.listening.is_empty() {
            self.listening.clear();
            self.listening_changed = true;
        }
    }

    /// Settings held by a client that another process served until now.
    pub fn restored(held: Vec<(Box<str>, Box<str>)>) -> SessionSets {
        let fingerprint = if held.is_empty() {
            0
        } else {
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        };
        SessionSets {
            held,
            fingerprint,
            ..SessionSets::default()
        }
    }

    /// The statements that recreate the held settings. Each ends on a line of its own: a
    /// `--` comment a client ended its SET with cannot swallow the next one.
    pub fn replay_sql(&self) -> String {
        self.held
            .iter()
            .map(|(_, sql)| sql.as_ref())
            .collect::<Vec<_>>()
            .join("\n;")
    }
}

#[cfg(test)]
mod tests;
