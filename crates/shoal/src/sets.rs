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
}

/// Recognises a single session-level `SET`/`RESET`/`DISCARD ALL` statement.
pub fn parse(sql: &str) -> Option<SetOp> {
    let start = shoal_wire::sql::leading_comments_len(sql.as_bytes());
    let text = sql[start..].trim().trim_end_matches(';').trim_end();
    if text.is_empty() || text.contains(';') {
        return None;
    }
    let mut words = text.split_whitespace();
    let first = words.next()?.to_ascii_lowercase();
    match first.as_str() {
        "discard" => (words.next()?.eq_ignore_ascii_case("all") && words.next().is_none())
            .then_some(SetOp::ResetAll),
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
    /// Done inside the current transaction, effective if it commits.
    in_transaction: Vec<SetOp>,
    /// The last transaction end seen: true for COMMIT, false for ROLLBACK.
    ended: Option<bool>,
    /// Unique to each state of `held` (process-wide), 0 when nothing is held: a server that
    /// had this state applied needs nothing more for this client.
    pub fingerprint: u64,
}

static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl SessionSets {
    /// A tracked statement completed.
    pub fn executed(&mut self, op: SetOp) {
        self.in_transaction.push(op);
    }

    /// A COMMIT or ROLLBACK completed.
    pub fn transaction_end(&mut self, committed: bool) {
        self.ended = Some(committed);
    }

    /// ReadyForQuery: at status `I` the transaction is over; its changes hold unless it rolled
    /// back.
    pub fn ready(&mut self, status: u8) {
        if status != b'I' {
            return;
        }
        let ops = std::mem::take(&mut self.in_transaction);
        let committed = self.ended.take().unwrap_or(true);
        if !committed || ops.is_empty() {
            return;
        }
        for op in ops {
            match op {
                SetOp::Set { name, sql } => {
                    self.held.retain(|(n, _)| *n != name);
                    self.held.push((name, sql));
                }
                SetOp::Reset { name } => self.held.retain(|(n, _)| *n != name),
                SetOp::ResetAll => self.held.clear(),
            }
        }
        self.fingerprint = if self.held.is_empty() {
            0
        } else {
            GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        };
    }

    /// The statements that recreate the held settings.
    pub fn replay_sql(&self) -> String {
        self.held
            .iter()
            .map(|(_, sql)| sql.as_ref())
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_session_sets() {
        assert_eq!(
            parse("SET search_path = a, b;"),
            Some(SetOp::Set {
                name: "search_path".into(),
                sql: "SET search_path = a, b".into()
            })
        );
        assert!(
            matches!(parse("set session TimeZone to 'UTC'"), Some(SetOp::Set { name, .. }) if &*name == "timezone")
        );
        assert!(
            matches!(parse("SET TIME ZONE 'UTC'"), Some(SetOp::Set { name, .. }) if &*name == "timezone")
        );
        assert!(matches!(parse("SET x.y=1"), Some(SetOp::Set { name, .. }) if &*name == "x.y"));
        assert!(matches!(
            parse("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
            Some(SetOp::Set { name, .. }) if &*name == "session characteristics"
        ));
        assert!(matches!(parse("SET ROLE x"), Some(SetOp::Set { name, .. }) if &*name == "role"));
        assert!(
            matches!(parse("SET SESSION AUTHORIZATION x"), Some(SetOp::Set { name, .. }) if &*name == "session authorization")
        );
        assert!(
            matches!(parse("/* c */ -- d\n SET a.b = 1"), Some(SetOp::Set { sql, .. }) if &*sql == "SET a.b = 1")
        );
        assert_eq!(parse("RESET ALL"), Some(SetOp::ResetAll));
        assert_eq!(parse("discard all"), Some(SetOp::ResetAll));
        assert_eq!(
            parse("RESET work_mem"),
            Some(SetOp::Reset {
                name: "work_mem".into()
            })
        );
        for no in [
            "SET LOCAL work_mem = 1",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "SET a = 1; SELECT 1",
            "SELECT 1",
            "DISCARD PLANS",
        ] {
            assert_eq!(parse(no), None, "{no}");
        }
    }

    #[test]
    fn sets_hold_on_commit_and_vanish_on_rollback() {
        let mut s = SessionSets::default();
        s.executed(parse("SET work_mem = '8MB'").unwrap());
        s.ready(b'I');
        assert_eq!(s.replay_sql(), "SET work_mem = '8MB'");
        let fp = s.fingerprint;
        assert_ne!(fp, 0);
        s.executed(parse("SET work_mem = '16MB'").unwrap());
        s.ready(b'T');
        s.transaction_end(false);
        s.ready(b'I');
        assert_eq!(s.replay_sql(), "SET work_mem = '8MB'", "rolled back");
        s.executed(parse("SET statement_timeout = 5").unwrap());
        s.ready(b'T');
        s.transaction_end(true);
        s.ready(b'I');
        assert_eq!(
            s.replay_sql(),
            "SET work_mem = '8MB'; SET statement_timeout = 5"
        );
        s.executed(parse("RESET ALL").unwrap());
        s.ready(b'I');
        assert_eq!(s.fingerprint, 0);
    }
}
