//! What a relaying node tells a pool's owner when it opens a stream for a client: enough for
//! the owner to route the client as if it had connected there, and no more. The client was
//! authenticated by the relaying node; the link is authenticated, so the owner trusts it. A
//! passthrough secret (the SCRAM client key proven by the client, for auth_query users) goes
//! along, because the owner's servers log in with it.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, Weak};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelayOpen {
    /// The pool's cluster-wide key (its name), which the owner checks it routes to.
    pub pool: String,
    pub user: String,
    pub database: String,
    /// The client's startup parameters (lower-cased, sorted).
    pub params: Vec<(String, String)>,
    pub reference: Option<String>,
    /// `target_session_attrs`, when the client gave one.
    #[serde(default)]
    pub target: Option<crate::config::replicas::TargetSessionAttrs>,
    /// The TLS server name the client connected with (routes tenants by SNI).
    pub server_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<std::net::SocketAddr>,
    /// The SCRAM client key the client proved (passthrough users only).
    #[serde(default)]
    pub client_key: Option<[u8; 32]>,
    /// Set when the client's last owner was lost while it was idle, or when it comes back
    /// from being parked: it is logged in already, and goes on here from where it was.
    /// (Left out when unset: [`HeldOpen`] adds it to an encoding made without it.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
}

/// A relayed client's opening as its relaying node keeps it for as long as the client lives
/// (every parked client holds one): the part its pool's other clients have too, encoded once
/// and shared by all of them, and its own address and resume apart.
pub struct HeldOpen {
    /// The opening without the peer or a resume, encoded.
    base: Arc<[u8]>,
    peer: Option<std::net::SocketAddr>,
    pub resume: Option<Resume>,
}

/// Fixed parts of openings in use, each shared by the clients whose openings have it (a
/// pool's clients, mostly); held weakly, so a part goes with its last client.
static SHARED: LazyLock<Mutex<SharedParts>> = LazyLock::new(Default::default);

#[derive(Default)]
struct SharedParts {
    parts: HashMap<Box<[u8]>, Weak<[u8]>>,
    /// How many parts there were after the last sweep of those gone.
    swept: usize,
}

/// The shared copy of `bytes`.
fn share(bytes: Vec<u8>) -> Arc<[u8]> {
    let mut s = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(part) = s.parts.get(&bytes[..]).and_then(Weak::upgrade) {
        return part;
    }
    if s.parts.len() >= 2 * s.swept.max(64) {
        s.parts.retain(|_, w| w.strong_count() > 0);
        s.swept = s.parts.len();
    }
    let part: Arc<[u8]> = Arc::from(&bytes[..]);
    s.parts
        .insert(bytes.into_boxed_slice(), Arc::downgrade(&part));
    part
}

impl HeldOpen {
    pub fn new(open: &RelayOpen) -> HeldOpen {
        let mut open = open.clone();
        let resume = open.resume.take();
        let peer = open.peer.take();
        HeldOpen {
            base: share(open.encode()),
            peer,
            resume,
        }
    }

    /// The opening as it goes over the link (what [`RelayOpen::encode`] would make).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.base.len() + 160);
        // The base is a JSON object with fields: its closing brace makes room for more.
        out.extend_from_slice(&self.base[..self.base.len() - 1]);
        if let Some(peer) = &self.peer {
            out.extend_from_slice(b",\"peer\":");
            serde_json::to_writer(&mut out, peer).expect("plain data serialises");
        }
        if let Some(resume) = &self.resume {
            out.extend_from_slice(b",\"resume\":");
            serde_json::to_writer(&mut out, resume).expect("plain data serialises");
        }
        out.push(b'}');
        out
    }
}

/// A relayed client moving to a new owner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resume {
    /// The cancel key the client holds.
    pub cancel_key: (i32, i32),
    /// Its session's last state snapshot, if the old owner sent one (see [`Snapshot`]).
    pub snapshot: Option<Box<[u8]>>,
    /// The client was parked (idle, its session let go), not moved after a loss.
    #[serde(default)]
    pub parked: bool,
}

/// What an owner tells the relaying node of a relayed client's session, as a stream state
/// snapshot, each time it changes while the client is idle (and once after a resume).
pub enum Snapshot<'a> {
    /// Nothing beyond what the login had: a new owner can take the client as it is.
    Plain,
    /// The session's state (JSON of a [`crate::handoff::SessionImage`]).
    Image(&'a [u8]),
    /// State a new owner cannot take up (LISTEN, session mode, statements naming this node's
    /// server statements): if this owner is lost, the client is told and closed.
    Stays,
    /// The owner is shutting down and asks for the client back (with its state): the
    /// relaying node stops sending, says so ([`HELD`]), and the owner, having answered all it
    /// got, closes the stream ([`MOVED`]).
    HandBack(Box<Snapshot<'a>>),
}

/// What the relaying node answers a [`Snapshot::HandBack`] with (its side's state): it sends
/// nothing more on the stream.
pub const HELD: &[u8] = b"R";

impl<'a> Snapshot<'a> {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Snapshot::Plain => b"A".to_vec(),
            Snapshot::Stays => b"N".to_vec(),
            Snapshot::Image(j) => [&b"I"[..], j].concat(),
            Snapshot::HandBack(inner) => [&b"H"[..], &inner.encode()].concat(),
        }
    }

    pub fn decode(b: &'a [u8]) -> Option<Snapshot<'a>> {
        match b.split_first()? {
            (b'A', _) => Some(Snapshot::Plain),
            (b'N', _) => Some(Snapshot::Stays),
            (b'I', j) => Some(Snapshot::Image(j)),
            (b'H', inner) => Some(Snapshot::HandBack(Box::new(Snapshot::decode(inner)?))),
            _ => None,
        }
    }
}

impl RelayOpen {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain data serialises")
    }

    pub fn decode(b: &[u8]) -> Result<RelayOpen, serde_json::Error> {
        serde_json::from_slice(b)
    }
}

/// The Close reason an owner gives when another node owns the pool: `owner:<node id>`.
pub const REDIRECT: &str = "owner:";
/// The Close reason of an owner shutting down, for a client handed back (see
/// [`Snapshot::HandBack`]): take it to the pool's next owner.
pub const MOVED: &str = "moved";
/// The Close reason of an owner shutting down, for a new stream: ask the next owner.
pub const LEAVING: &str = "leaving";

impl Snapshot<'_> {
    /// The state a new owner takes up: a hand-back's inner snapshot, else this one.
    pub fn state(self) -> Self {
        match self {
            Snapshot::HandBack(inner) => inner.state(),
            s => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HeldOpen, RelayOpen, Resume, Snapshot};

    /// Every relayed client holds one in a box for as long as it lives, parked or not:
    /// jemalloc's classes step by 16 bytes here, and 80 is the one it takes now.
    #[test]
    fn a_held_opening_fits_80_bytes() {
        assert!(std::mem::size_of::<HeldOpen>() <= 80, "HeldOpen grew");
    }

    #[test]
    fn a_held_opening_encodes_as_the_opening_does() {
        let open = RelayOpen {
            pool: "app/db \"x\"".into(),
            user: "u".into(),
            database: "db".into(),
            params: vec![("application_name".into(), "é}".into())],
            reference: None,
            target: None,
            server_name: Some("t.example".into()),
            peer: "127.0.0.1:5".parse().ok(),
            client_key: Some([7; 32]),
            resume: None,
        };
        let mut held = HeldOpen::new(&open);
        for resume in [
            None,
            Some(Resume {
                cancel_key: (-3, 9),
                snapshot: Some(Box::from(&b"I{\"a\":1}"[..])),
                parked: true,
            }),
            Some(Resume {
                cancel_key: (1, 2),
                snapshot: None,
                parked: false,
            }),
        ] {
            held.resume = resume.clone();
            let back = RelayOpen::decode(&held.encode()).expect("decodes");
            let want = RelayOpen {
                resume,
                ..open.clone()
            };
            assert_eq!(
                serde_json::to_value(&back).unwrap(),
                serde_json::to_value(&want).unwrap()
            );
        }
        // Another client of the pool, from elsewhere, shares the fixed part.
        let other = HeldOpen::new(&RelayOpen {
            peer: "10.0.0.9:7".parse().ok(),
            ..open.clone()
        });
        assert!(std::sync::Arc::ptr_eq(&held.base, &other.base));
        let mut no_peer = open.clone();
        no_peer.peer = None;
        let back = RelayOpen::decode(&HeldOpen::new(&no_peer).encode()).expect("decodes");
        assert!(back.peer.is_none());
    }

    #[test]
    fn snapshots_read_back_and_a_hand_back_carries_the_state() {
        for s in [
            Snapshot::Plain,
            Snapshot::Stays,
            Snapshot::Image(b"{}"),
            Snapshot::HandBack(Box::new(Snapshot::Image(b"{\"a\":1}"))),
        ] {
            let bytes = s.encode();
            let back = Snapshot::decode(&bytes).expect("decodes").encode();
            assert_eq!(back, bytes);
        }
        let h = Snapshot::HandBack(Box::new(Snapshot::Stays)).encode();
        assert!(matches!(
            Snapshot::decode(&h).map(Snapshot::state),
            Some(Snapshot::Stays)
        ));
        assert!(Snapshot::decode(b"").is_none());
        assert!(Snapshot::decode(b"X").is_none());
        assert!(
            Snapshot::decode(b"H").is_none(),
            "a hand-back without its state"
        );
    }
}
