//! What a failure means for the client: one taxonomy for every way getting or keeping a
//! server can fail. Each error has a kind (which side failed, and the label metrics will
//! count it under), the SQLSTATE the client gets, a message that is safe to show it (no
//! upstream addresses, no internals), the detail for the log, and whether trying again on
//! another server is safe (nothing of the client's reached a server yet).

use shoal_wire::sqlstate;

use crate::server::ServerError;

/// Which side failed, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The client left, or its connection failed.
    ClientGone,
    /// The client broke the protocol (malformed or unknown messages, bad startup packets).
    ClientProtocol,
    /// A limit refused the client (connections, logins, message size, memory).
    ClientLimit,
    /// Authentication failed.
    Auth,
    /// The user or database is not served here, or the address may not reach it.
    Routing,
    /// The tenant is banned.
    Banned,
    /// The client cancelled its own request (a CancelRequest, or a statement timeout).
    Canceled,
    /// The client did not log in within `client_login_timeout`.
    LoginTimeout,
    /// Shoal is shutting down.
    Shutdown,
    /// The server connection was lost under the client (its FATAL passed on).
    ServerLost,
    /// The server broke the protocol.
    ServerProtocol,
    /// No server became free within `query_wait_timeout`.
    PoolTimeout,
    /// Refused without waiting: the pool's queue makes clients wait past half of
    /// `query_wait_timeout` (load shed).
    PoolSaturated,
    /// The pool was ended: shutdown, or its tenant banned, deleted or terminated.
    PoolClosed,
    /// PostgreSQL could not be reached, or the connection broke while Shoal set it up.
    ServerUnavailable,
    /// PostgreSQL answered with an error of its own (a refused login, a rejected setting).
    ServerRefused,
    /// The server did not answer while Shoal cleaned or prepared it.
    ServerTimeout,
    /// In a cluster: the node that owns the client's pool, or the link to it, was lost.
    NodeLost,
    /// In a cluster: this node no longer owns the pool (its lease lapsed, or the pool moved).
    Fenced,
}

impl ErrorKind {
    /// Every kind, for metrics that count each.
    pub const ALL: [ErrorKind; 19] = [
        ErrorKind::ClientGone,
        ErrorKind::ClientProtocol,
        ErrorKind::ClientLimit,
        ErrorKind::Auth,
        ErrorKind::Routing,
        ErrorKind::Banned,
        ErrorKind::Canceled,
        ErrorKind::LoginTimeout,
        ErrorKind::Shutdown,
        ErrorKind::ServerLost,
        ErrorKind::ServerProtocol,
        ErrorKind::PoolTimeout,
        ErrorKind::PoolSaturated,
        ErrorKind::PoolClosed,
        ErrorKind::ServerUnavailable,
        ErrorKind::ServerRefused,
        ErrorKind::ServerTimeout,
        ErrorKind::NodeLost,
        ErrorKind::Fenced,
    ];

    /// A stable name for logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::ClientGone => "client_gone",
            ErrorKind::ClientProtocol => "client_protocol",
            ErrorKind::ClientLimit => "client_limit",
            ErrorKind::Auth => "auth",
            ErrorKind::Routing => "routing",
            ErrorKind::Banned => "banned",
            ErrorKind::Canceled => "canceled",
            ErrorKind::LoginTimeout => "login_timeout",
            ErrorKind::Shutdown => "shutdown",
            ErrorKind::ServerLost => "server_lost",
            ErrorKind::ServerProtocol => "server_protocol",
            ErrorKind::PoolTimeout => "pool_timeout",
            ErrorKind::PoolSaturated => "pool_saturated",
            ErrorKind::PoolClosed => "pool_closed",
            ErrorKind::ServerUnavailable => "server_unavailable",
            ErrorKind::ServerRefused => "server_refused",
            ErrorKind::ServerTimeout => "server_timeout",
            ErrorKind::NodeLost => "node_lost",
            ErrorKind::Fenced => "fenced",
        }
    }
}

/// An error as the client sees it and as the log records it.
#[derive(Debug)]
pub struct ClientError {
    pub kind: ErrorKind,
    pub code: &'static str,
    /// Safe to show the client.
    pub message: String,
    /// For the log only (may name hosts and carry the OS error).
    pub detail: String,
    /// Nothing of the client's reached a server: trying another server is safe.
    pub retry_safe: bool,
}

/// A server's SQLSTATE as a `&'static str` (so that reporting one needs no allocation): the
/// common ones from our table, any other well-formed code interned once (PostgreSQL has a few
/// hundred; the table is bounded so a hostile server cannot grow it). A malformed code, or one
/// past the bound, becomes a connection failure.
pub fn known_code(code: &str) -> &'static str {
    const COMMON: &[&str] = &[
        sqlstate::INVALID_PASSWORD,
        sqlstate::INVALID_AUTHORIZATION,
        sqlstate::INVALID_CATALOG_NAME,
        sqlstate::TOO_MANY_CONNECTIONS,
        sqlstate::CANNOT_CONNECT_NOW,
        sqlstate::ADMIN_SHUTDOWN,
        sqlstate::INVALID_PARAMETER_VALUE,
        sqlstate::FEATURE_NOT_SUPPORTED,
        sqlstate::CONNECTION_FAILURE,
    ];
    const LIMIT: usize = 1024;
    static SEEN: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    if let Some(c) = COMMON.iter().find(|c| **c == code) {
        return c;
    }
    if code.len() != 5
        || !code
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
    {
        return sqlstate::CONNECTION_FAILURE;
    }
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = seen.iter().find(|c| **c == code) {
        return c;
    }
    if seen.len() >= LIMIT {
        return sqlstate::CONNECTION_FAILURE;
    }
    let interned: &'static str = Box::leak(code.to_owned().into_boxed_str());
    seen.push(interned);
    interned
}

/// What went wrong talking to a server, in words that name no address.
fn server_cause(e: &ServerError) -> String {
    match e {
        ServerError::Connect { source, .. } => format!("cannot connect: {}", source.kind()),
        ServerError::ConnectTimeout(_) => "connection timed out".into(),
        ServerError::Io(source) => format!("connection failed: {}", source.kind()),
        ServerError::Closed => "the server closed the connection".into(),
        ServerError::Protocol(_) => "the server sent an invalid message".into(),
        ServerError::NoPassword(user) => {
            format!("the server asks for a password, but none is configured for \"{user}\"")
        }
        ServerError::Db(f) => f.message.clone(),
        // The reason (no address in it): a name mismatch, an unknown issuer, no SSL.
        ServerError::Tls(reason) => format!("TLS: {reason}"),
        ServerError::Passthrough(reason) => reason.clone(),
        ServerError::ResetTimeout(t) => format!("no answer within server_reset_timeout ({t:?})"),
    }
}

impl ClientError {
    /// A failure of server `e` in `pool` while Shoal was `doing` something with it, before
    /// any client message was sent to it.
    pub fn server(pool: &str, e: &ServerError, doing: &str) -> ClientError {
        let (kind, code, retry_safe) = match e {
            ServerError::Db(f) => (ErrorKind::ServerRefused, known_code(&f.code), false),
            ServerError::ResetTimeout(_) => {
                (ErrorKind::ServerTimeout, sqlstate::CONNECTION_FAILURE, true)
            }
            ServerError::NoPassword(_) => (
                ErrorKind::ServerRefused,
                sqlstate::CONNECTION_FAILURE,
                false,
            ),
            _ => (
                ErrorKind::ServerUnavailable,
                sqlstate::CONNECTION_FAILURE,
                true,
            ),
        };
        let refused = matches!(e, ServerError::Db(_));
        let message = if refused && doing == "connecting" {
            format!(
                "pool \"{pool}\": server refused the connection: {}",
                server_cause(e)
            )
        } else {
            format!(
                "pool \"{pool}\": server unavailable while {doing}: {}",
                server_cause(e)
            )
        };
        ClientError {
            kind,
            code,
            message,
            detail: e.to_string(),
            retry_safe,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_keep_postgres_codes_and_are_not_retried() {
        let f = shoal_wire::backend::ErrorFields {
            severity: "FATAL".into(),
            code: "28P01".into(),
            message: "password authentication failed for user \"app\"".into(),
            routine: String::new(),
        };
        let c = ClientError::server("app/app", &ServerError::Db(f), "connecting");
        assert_eq!((c.code, c.kind), ("28P01", ErrorKind::ServerRefused));
        assert!(!c.retry_safe);
        assert_eq!(c.kind.label(), "server_refused");
    }
}

#[cfg(test)]
mod code_tests {
    use super::*;

    /// A server's own FATAL codes (idle-in-transaction timeout, terminated by an
    /// administrator, ...) reach the client unchanged; garbage does not.
    #[test]
    fn server_codes_are_kept() {
        for code in ["25P03", "57P05", "57P02", "57P01", "28P01", "XX000"] {
            assert_eq!(known_code(code), code);
            assert!(
                std::ptr::eq(known_code(code), known_code(code)),
                "interned once"
            );
        }
        for bad in ["", "2", "25p03", "25P033", "25P0\n", "ÄÄÄ"] {
            assert_eq!(known_code(bad), "08006", "{bad:?}");
        }
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn labels_are_distinct() {
        let labels: std::collections::BTreeSet<_> =
            ErrorKind::ALL.iter().map(|k| k.label()).collect();
        assert_eq!(labels.len(), ErrorKind::ALL.len());
    }

    /// Routing failures declare their kind (a pool's: see `pool::failures`).
    #[test]
    fn failures_declare_their_kind() {
        use crate::route::RouteError;
        assert_eq!(
            RouteError::TenantBanned("t".into(), String::new()).kind(),
            ErrorKind::Banned
        );
        assert_eq!(
            RouteError::UnknownTenant("t".into()).kind(),
            ErrorKind::Routing
        );
    }
}
