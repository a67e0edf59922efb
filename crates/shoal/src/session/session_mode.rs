//! Session mode: the client keeps one server from login to its end, reset before the server
//! goes back to the pool.

use shoal_wire::sqlstate;

use super::ending::end_session;
use super::flow::Flow;
use super::relay::{Policy, RelayEnd};
use super::{leaving, Session, SessionError};
use crate::error::ErrorKind;
use crate::pool::Lease;

/// The session-mode client from login to its end (boxed: session mode holds a server anyway).
pub(super) async fn serve_session_mode(mut session: Session, lease: Lease) {
    let result = session.run_session_mode(lease).await;
    end_session(&mut session, result).await;
}

impl Session {
    pub(super) async fn run_session_mode(&mut self, mut lease: Lease) -> Result<(), SessionError> {
        // Session mode marks no request busy, so no cancel can be pending here.
        let _named = self.cancel.slot.set(lease.cancel_target());
        self.set_active(true);
        let mut flow = Flow::default();
        let end = self
            .relay(&mut lease, &mut flow, Policy::Session, 0, None)
            .await;
        self.cancel.slot.clear().await;
        match end {
            Ok(RelayEnd::Boundary) | Ok(RelayEnd::Terminate) => {
                lease.release(leaving(&flow, true)).await;
                Ok(())
            }
            Ok(RelayEnd::ClientGone) => {
                lease.release(leaving(&flow, true)).await;
                self.gone_or_shut_down()
            }
            Ok(RelayEnd::ServerLost(fatal)) => {
                drop(lease);
                match fatal {
                    // Already passed on to the client by the relay.
                    Some(_) => Err(SessionError::ClientGone),
                    None => Err(SessionError::fatal(
                        ErrorKind::ServerLost,
                        sqlstate::CONNECTION_FAILURE,
                        "server closed the connection unexpectedly",
                    )),
                }
            }
            Err(e) => {
                lease.release(leaving(&flow, true)).await;
                Err(e)
            }
        }
    }
}
