//! Just enough SQL to tell what a client's query does to its session: a lexer that knows
//! comments, quoting and dollar quotes, and a classifier over its words.
//!
//! A pooler in transaction mode hands one server's session to many clients, so it must know
//! when a client left state behind (a `SET ROLE`, a temporary table, a `set_config()` call, a
//! `WITH HOLD` cursor) that the next client would inherit. The command tag cannot say it
//! (`SELECT set_config(...)` completes as `SELECT 1`), so Shoal reads the statement itself.
//! The classifier errs on the side of "dirty": a false alarm costs one `DISCARD ALL`, a miss
//! would leak one client's state into another's session. What no lexer can see (state changed
//! inside a function the query calls) is documented in `docs/transaction-mode.md`.
//!
//! Works on bytes, not `str`: a client may send text in any `client_encoding`. Each function
//! is told the encoding ([`ClientEncoding`]), and steps over a character's bytes as
//! PostgreSQL counts them: in SJIS, BIG5, GBK, UHC, GB18030 and JOHAB a character's second
//! byte may be a `\\` or a letter, which a scanner of bytes would take for an escape or a
//! word. A text an encoding cannot say for sure how to read (not known yet) is dirty.

pub use crate::encoding::ClientEncoding;

/// What a query (one or several statements) does beyond its own transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Effects {
    /// Leaves session state behind that Shoal does not replay: the server must be cleaned
    /// before another client gets it.
    pub dirty: bool,
    /// Of `dirty`, what surely lasts past its transaction (a temporary table, a setting, a
    /// `WITH HOLD` cursor, a session advisory lock, an SQL `PREPARE`, a `LOAD`), rather than
    /// what only might (a `DO` block, a `CALL`, a statement not known here): a client that
    /// would lose it is told.
    pub keeps: bool,
    /// Changes the schema (CREATE/ALTER/DROP...): prepared statements planned before may
    /// describe the old one.
    pub ddl: bool,
    /// Drops every prepared statement of the session (`DISCARD ALL`, `DEALLOCATE ALL`).
    pub drops_statements: bool,
    /// More than one statement.
    pub multi: bool,
    /// A string with a backslash was seen while `standard_conforming_strings` is unknown:
    /// the lexer may have split the text wrongly, so the query counts as dirty.
    pub ambiguous: bool,
}

/// Names a query may reach a whole database by (`DROP DATABASE x`, `ALTER DATABASE x RENAME`):
/// a pooler's idle connections to that database would block it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseCommand {
    pub database: Vec<u8>,
}

mod classify;
mod commands;
#[cfg(test)]
mod fuzz;
mod lexer;
mod shortcut;
#[cfg(test)]
mod tests;

pub use classify::{classify, classify_with};
pub use commands::{
    database_command, leading_comments_len, listen_command, named_statement_command, prepare_name,
    prepared_name_with_prefix, ListenCommand, NamedStatementCommand,
};
pub use lexer::{decode_unicode, Lexer, Token};
pub use shortcut::{is_plain, may_change_encoding, FirstWord};

use lexer::is_word_char;
#[cfg(test)]
use {classify::classify_lexed, shortcut::needs_lexing};
