//! Database-wide commands that Shoal's own idle connections would block.

use shoal_wire::frame::Reader;
use shoal_wire::sql::{self, ClientEncoding};

use crate::app::App;

/// A client is about to drop or rename a database: Shoal's idle connections to it would make
/// PostgreSQL refuse (`55006 database is being accessed by other users`), so they are closed
/// first. PostgreSQL waits a few seconds for other sessions to leave, which is enough for
/// them to go.
#[inline(always)]
pub fn database_command(app: &App, query_body: &[u8], enc: ClientEncoding) {
    database_command_text(app, query_body, enc)
}

/// [`database_command`] for a Parse (its statement name comes before the text).
#[inline(always)]
pub fn database_command_parsed(app: &App, parse_body: &[u8], enc: ClientEncoding) {
    let mut r = Reader::new(parse_body);
    if r.cstr_bytes().is_ok() {
        database_command_text(app, r.rest(), enc);
    }
}

/// Inlined into the relay: most queries start with another letter, decided without a call.
#[inline(always)]
fn database_command_text(app: &App, query_body: &[u8], enc: ClientEncoding) {
    if query_body
        .first()
        .is_some_and(|&b| b.is_ascii_alphabetic() && !matches!(b | 0x20, b'd' | b'a'))
    {
        return;
    }
    database_command_named(app, query_body, enc)
}

fn database_command_named(app: &App, query_body: &[u8], enc: ClientEncoding) {
    if !sql::FirstWord::of(query_body).is_any(&[b"drop", b"alter"]) {
        return;
    }
    let text = Reader::new(query_body).cstr_bytes().unwrap_or_default();
    if let Some(cmd) = sql::database_command(text, enc) {
        let name = String::from_utf8_lossy(&cmd.database);
        for pool in app.routes.pools() {
            if pool.upstream.dbname == name {
                tracing::info!(pool = %pool.name, "closing idle servers: a client drops or renames their database");
                crate::control::spawn(async move { pool.close_idle().await });
            }
        }
    }
}
