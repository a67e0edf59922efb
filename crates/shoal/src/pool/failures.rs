//! How a pool's failures reach its clients: the SQLSTATE, the kind that logs and metrics
//! count, and whether trying another server is safe. Here rather than in [`crate::error`],
//! which knows nothing of pools.

use shoal_wire::sqlstate;

use super::{CheckoutError, ServerWait};
use crate::error::{ClientError, ErrorKind};

impl ClientError {
    /// A failure to get a server from `pool`.
    pub fn checkout(e: &CheckoutError) -> ClientError {
        match e {
            CheckoutError::WaitTimeout { .. } => ClientError {
                kind: ErrorKind::PoolTimeout,
                code: sqlstate::QUERY_CANCELED,
                message: e.to_string(),
                detail: e.to_string(),
                retry_safe: false,
            },
            CheckoutError::Saturated { .. } => ClientError {
                kind: ErrorKind::PoolSaturated,
                code: sqlstate::TOO_MANY_CONNECTIONS,
                message: e.to_string(),
                detail: e.to_string(),
                retry_safe: false,
            },
            CheckoutError::Closed(_) => ClientError {
                kind: ErrorKind::PoolClosed,
                code: sqlstate::ADMIN_SHUTDOWN,
                message: e.to_string(),
                detail: e.to_string(),
                retry_safe: false,
            },
            CheckoutError::Server { pool, source } => Self::server(pool, source, "connecting"),
            CheckoutError::Fenced(_) => ClientError {
                kind: ErrorKind::Fenced,
                code: sqlstate::CONNECTION_FAILURE,
                message: e.to_string(),
                detail: e.to_string(),
                retry_safe: true,
            },
        }
    }

    /// Why no prepared server could be had for a client of `pool`.
    pub fn wait(pool: &str, e: &ServerWait) -> ClientError {
        match e {
            ServerWait::Cancelled => ClientError {
                kind: ErrorKind::Canceled,
                code: sqlstate::QUERY_CANCELED,
                message: "canceling statement due to user request".into(),
                detail: "cancelled while waiting for a server".into(),
                retry_safe: false,
            },
            ServerWait::Checkout(e) => Self::checkout(e),
            ServerWait::Prepare(e) => Self::server(pool, e, "preparing it for a client"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::ServerError;

    #[test]
    fn client_messages_name_no_upstream_address() {
        let e = CheckoutError::Server {
            pool: "app/app".into(),
            source: ServerError::Connect {
                addr: "10.1.2.3:5432".into(),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            },
        };
        let c = ClientError::checkout(&e);
        assert_eq!(c.kind, ErrorKind::ServerUnavailable);
        assert_eq!(c.code, "08006");
        assert!(!c.message.contains("10.1.2.3"), "{}", c.message);
        assert!(c.message.contains("app/app"));
        assert!(c.detail.contains("10.1.2.3:5432"), "the log keeps it");
        assert!(c.retry_safe);
    }

    /// A pool's wait timeout and a user's cancel share SQLSTATE 57014 but not their kind.
    #[test]
    fn failures_declare_their_kind() {
        let timeout = CheckoutError::WaitTimeout {
            pool: "p".into(),
            waited: std::time::Duration::from_secs(1),
            size: 1,
        };
        let c = ClientError::checkout(&timeout);
        assert_eq!((c.kind, c.code), (ErrorKind::PoolTimeout, "57014"));
        let c = ClientError::wait("p", &ServerWait::Cancelled);
        assert_eq!((c.kind, c.code), (ErrorKind::Canceled, "57014"));
        let c = ClientError::checkout(&CheckoutError::Closed("p".into()));
        assert_eq!(c.kind, ErrorKind::PoolClosed);
    }
}
