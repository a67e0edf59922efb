//! Cancel keys: the BackendKeyData Shoal gives each client, and the routing of a client's
//! CancelRequest to the server connection running that client's query — only while it runs.
//!
//! Each client owns a [`CancelSlot`] naming its current server, if any. The session fills the
//! slot at checkout and empties it before returning the server to the pool. Forwarding a
//! cancel counts itself in the slot as in flight until PostgreSQL has closed the cancel
//! connection (it has then signalled the backend), and emptying the slot waits for in-flight
//! cancels. So a cancel can never be delivered to a server after that server moved on to
//! another client, while the common case (no cancel) costs one uncontended lock.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use rand::Rng;
use subtle::ConstantTimeEq;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The server a cancel should go to.
#[derive(Clone, Copy, Debug)]
pub struct CancelTarget {
    pub addr: SocketAddr,
    pub process_id: i32,
    pub secret_key: i32,
}

#[derive(Default)]
struct SlotState {
    target: Option<CancelTarget>,
    in_flight: u32,
}

#[derive(Default)]
pub struct CancelSlot {
    state: Mutex<SlotState>,
    done: tokio::sync::Notify,
}

impl CancelSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Names the server now running this client's queries.
    pub fn set(&self, target: CancelTarget) {
        self.lock().target = Some(target);
    }

    /// Forgets the server; returns once no cancel for it can still arrive.
    pub async fn clear(&self) {
        loop {
            let notified = self.done.notified();
            {
                let mut s = self.lock();
                s.target = None;
                if s.in_flight == 0 {
                    return;
                }
            }
            notified.await;
        }
    }

    fn begin(&self) -> Option<CancelTarget> {
        let mut s = self.lock();
        let t = s.target?;
        s.in_flight += 1;
        Some(t)
    }

    fn end(&self) {
        let mut s = self.lock();
        s.in_flight -= 1;
        if s.in_flight == 0 {
            self.done.notify_waiters();
        }
    }
}

struct Entry {
    secret: i32,
    slot: Arc<CancelSlot>,
}

/// All live clients' cancel keys.
#[derive(Default)]
pub struct CancelRegistry {
    by_pid: Mutex<HashMap<i32, Vec<Entry>>>,
}

/// Removes the client's key when the session ends.
pub struct Registration {
    registry: Arc<CancelRegistry>,
    pub process_id: i32,
    pub secret_key: i32,
    pub slot: Arc<CancelSlot>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = self.registry.lock();
        if let Some(v) = map.get_mut(&self.process_id) {
            v.retain(|e| !Arc::ptr_eq(&e.slot, &self.slot));
            if v.is_empty() {
                map.remove(&self.process_id);
            }
        }
    }
}

impl CancelRegistry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Vec<Entry>>> {
        self.by_pid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a client. `process_id` is the real server's in session mode (so the client's
    /// `pg_backend_pid()` matches); otherwise Shoal picks one outside the range of real pids.
    pub fn register(self: &Arc<Self>, process_id: Option<i32>) -> Registration {
        let mut rng = rand::thread_rng();
        let process_id = process_id.unwrap_or_else(|| rng.gen_range(1 << 30..i32::MAX));
        let secret_key = rng.gen();
        let slot = Arc::new(CancelSlot::default());
        self.lock().entry(process_id).or_default().push(Entry {
            secret: secret_key,
            slot: slot.clone(),
        });
        Registration {
            registry: self.clone(),
            process_id,
            secret_key,
            slot,
        }
    }

    fn find(&self, process_id: i32, secret_key: i32) -> Option<Arc<CancelSlot>> {
        let map = self.lock();
        let mut found = None;
        for e in map.get(&process_id)? {
            // Constant-time: the secret is a credential.
            if bool::from(e.secret.to_be_bytes().ct_eq(&secret_key.to_be_bytes())) {
                found = Some(e.slot.clone());
            }
        }
        found
    }

    /// Handles a CancelRequest: forwards it if the key is known and its client has a query
    /// running; otherwise does nothing, as PostgreSQL does for unknown keys.
    pub async fn cancel(&self, process_id: i32, secret_key: i32) {
        let Some(slot) = self.find(process_id, secret_key) else {
            tracing::debug!("cancel request with unknown key ignored");
            return;
        };
        let Some(target) = slot.begin() else {
            tracing::debug!("cancel request for an idle client ignored");
            return;
        };
        forward(target).await;
        slot.end();
    }
}

/// Sends a CancelRequest to a server and waits until PostgreSQL has acted on it.
pub async fn forward(target: CancelTarget) {
    if let Err(e) = send_cancel(target).await {
        tracing::warn!(server = %target.addr, error = %e, "forwarding cancel request failed");
    }
}

async fn send_cancel(target: CancelTarget) -> std::io::Result<()> {
    let mut buf = BytesMut::new();
    shoal_wire::frontend::cancel_request(&mut buf, target.process_id, target.secret_key);
    let send = async {
        let mut s = TcpStream::connect(target.addr).await?;
        s.write_all(&buf).await?;
        // PostgreSQL closes the connection once it has signalled the backend.
        let mut sink = [0u8; 16];
        while s.read(&mut sink).await? > 0 {}
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(5), send)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("cancel timed out")))
}
