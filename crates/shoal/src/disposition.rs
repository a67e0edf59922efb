//! What becomes of a server connection when its client is done with it, decided in one pure
//! function: back to the pool as it is, cleaned first, or closed — and why. Every path that
//! ends a client's hold on a server (a transaction-mode boundary, a client leaving or
//! failing, a check-in) asks here, so the rules live in one place and are unit-tested.

/// What is known about a server as its client lets go of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerState {
    /// The server failed (an I/O error, a FATAL, a timeout while cleaning).
    pub lost: bool,
    /// A client message is only partly written to it.
    pub partial_message: bool,
    /// It owes replies (a query may still run), a batch is unsynced, or a COPY is open.
    pub busy: bool,
    /// It sent bytes nobody asked for, or Shoal still expects replies it never got.
    pub unread: bool,
    /// A transaction block is open.
    pub in_transaction: bool,
    /// Session mode's reset query is to run before another client gets it.
    pub reset: bool,
    /// Past `server_lifetime`.
    pub expired: bool,
    /// Its pool was ended (tenant banned, deleted, terminated; pool retired).
    pub pool_ended: bool,
}

/// Why a server is closed rather than reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    Lost,
    /// Its byte stream cannot be trusted to start at a message boundary.
    PartialMessage,
    /// A query may still run: it is cancelled, and closed.
    Busy,
    Unread,
    Expired,
    PoolEnded,
}

impl CloseReason {
    /// For logs and metrics.
    pub fn label(self) -> &'static str {
        match self {
            CloseReason::Lost => "lost",
            CloseReason::PartialMessage => "partial_message",
            CloseReason::Busy => "busy",
            CloseReason::Unread => "unread",
            CloseReason::Expired => "expired",
            CloseReason::PoolEnded => "pool_ended",
        }
    }

    /// A request may still run on the server: it is sent a CancelRequest before closing.
    pub fn cancel_first(self) -> bool {
        self == CloseReason::Busy
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Back to the pool as it is.
    CheckIn,
    /// Cleaned (a ROLLBACK, the reset query), then back if that succeeds.
    Clean {
        rollback: bool,
        reset: bool,
    },
    Close(CloseReason),
}

/// The one rule: a server whose stream or state is in doubt is closed; one that only needs
/// its transaction ended or its session reset is cleaned; anything else goes back.
pub fn decide(s: &ServerState) -> Disposition {
    let close = if s.lost {
        Some(CloseReason::Lost)
    } else if s.partial_message {
        Some(CloseReason::PartialMessage)
    } else if s.busy {
        Some(CloseReason::Busy)
    } else if s.unread {
        Some(CloseReason::Unread)
    } else if s.pool_ended {
        Some(CloseReason::PoolEnded)
    } else if s.expired {
        Some(CloseReason::Expired)
    } else {
        None
    };
    match close {
        Some(r) => Disposition::Close(r),
        None if s.in_transaction || s.reset => Disposition::Clean {
            rollback: s.in_transaction,
            reset: s.reset,
        },
        None => Disposition::CheckIn,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_usual_cases() {
        assert_eq!(decide(&ServerState::default()), Disposition::CheckIn);
        let open = ServerState {
            in_transaction: true,
            ..Default::default()
        };
        assert_eq!(
            decide(&open),
            Disposition::Clean {
                rollback: true,
                reset: false
            }
        );
        let session = ServerState {
            reset: true,
            ..Default::default()
        };
        assert_eq!(
            decide(&session),
            Disposition::Clean {
                rollback: false,
                reset: true
            }
        );
        let running = ServerState {
            busy: true,
            in_transaction: true,
            ..Default::default()
        };
        assert_eq!(decide(&running), Disposition::Close(CloseReason::Busy));
        assert!(CloseReason::Busy.cancel_first());
        let half = ServerState {
            partial_message: true,
            busy: true,
            ..Default::default()
        };
        assert_eq!(
            decide(&half),
            Disposition::Close(CloseReason::PartialMessage)
        );
    }

    fn state() -> impl Strategy<Value = ServerState> {
        proptest::collection::vec(any::<bool>(), 8).prop_map(|b| ServerState {
            lost: b[0],
            partial_message: b[1],
            busy: b[2],
            unread: b[3],
            in_transaction: b[4],
            reset: b[5],
            expired: b[6],
            pool_ended: b[7],
        })
    }

    proptest! {
        /// A server goes back to the pool (cleaned or not) only when nothing about its
        /// stream or state is in doubt; it is cleaned exactly when a transaction is open or
        /// a reset is due; it goes back untouched only when neither is.
        #[test]
        fn reuse_only_when_safe(s in state()) {
            let doubtful = s.lost || s.partial_message || s.busy || s.unread || s.expired || s.pool_ended;
            match decide(&s) {
                Disposition::Close(_) => prop_assert!(doubtful),
                Disposition::Clean { rollback, reset } => {
                    prop_assert!(!doubtful);
                    prop_assert_eq!(rollback, s.in_transaction);
                    prop_assert_eq!(reset, s.reset);
                    prop_assert!(rollback || reset);
                }
                Disposition::CheckIn => {
                    prop_assert!(!doubtful && !s.in_transaction && !s.reset);
                }
            }
        }
    }
}
