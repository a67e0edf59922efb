//! Pipelined connect, made to fit a login that reads one message at a time. Neon's driver
//! sends its startup packet, its password and its first query at once, before any answer
//! (the password as cleartext, which the front door asks for). Shoal's login refuses bytes
//! that arrive before they are asked for (data pipelined behind an SSLRequest or a
//! password is how injection attacks on TLS negotiation work), so the front door holds the
//! client's bytes back and lets each message through when the login has asked for it:
//! the startup packet first; the password once the session asked for a cleartext
//! password; the rest once the session answered that. Pure: no I/O, unit-tested.

use bytes::BytesMut;

/// The protocol codes of the 8-byte packets answered with a single byte.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Only the next first packet may pass.
    Startup,
    /// Waiting for the session's answer to what passed.
    Awaiting(After),
    /// The session asked for a cleartext password: the next message may pass.
    Password,
    /// Logged in (or failed): everything passes.
    Open,
}

/// What the session's next answer was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// An SSLRequest or GSSENCRequest (its answer: one byte, then another first packet).
    Encryption,
    Startup,
    Password,
}

#[derive(Debug)]
pub struct Gate {
    state: State,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            state: State::Startup,
        }
    }
}

/// The length of the complete message at the head of `held`, if all of it is there (`tag`:
/// whether messages start with a type byte).
fn whole(held: &[u8], tag: bool) -> Option<usize> {
    let at = usize::from(tag);
    let len = held.get(at..at + 4)?;
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    // A length below its own four bytes is the login's to refuse: let it through.
    let total = at + len.max(4);
    (held.len() >= total).then_some(total)
}

impl Gate {
    /// Whether everything passes now (the login is over).
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// How many bytes at the head of `held` may go to the session now.
    pub fn passable(&mut self, held: &[u8]) -> usize {
        match self.state {
            State::Open => held.len(),
            State::Awaiting(_) => 0,
            State::Startup => match whole(held, false) {
                None => 0,
                Some(n) => {
                    let code = held
                        .get(4..8)
                        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    let encryption =
                        n == 8 && matches!(code, Some(SSL_REQUEST) | Some(GSSENC_REQUEST));
                    self.state = State::Awaiting(if encryption {
                        After::Encryption
                    } else {
                        After::Startup
                    });
                    n
                }
            },
            State::Password => match whole(held, true) {
                None => 0,
                Some(n) => {
                    self.state = State::Awaiting(After::Password);
                    n
                }
            },
        }
    }

    /// The session wrote `out` to the client. Returns how many held bytes to drop: a
    /// password the client pipelined that the session turned out not to ask for.
    pub fn answered(&mut self, out: &[u8], held: &[u8]) -> usize {
        let State::Awaiting(after) = self.state else {
            return 0;
        };
        self.state = match after {
            After::Encryption => State::Startup,
            After::Password => State::Open,
            After::Startup => match authentication_code(out) {
                Some(3) => State::Password,
                _ => State::Open,
            },
        };
        // Logged in without a password (a trust user): the pipelined one is not sent on.
        if after == After::Startup
            && authentication_code(out) == Some(0)
            && held.first() == Some(&b'p')
        {
            return whole(held, true).unwrap_or(0);
        }
        0
    }
}

/// The code of an Authentication message at the head of `out`.
fn authentication_code(out: &[u8]) -> Option<u32> {
    if out.first() != Some(&b'R') {
        return None;
    }
    let c = out.get(5..9)?;
    Some(u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
}

/// Moves what may pass from `held` into `to`.
pub fn release(gate: &mut Gate, held: &mut BytesMut, to: &mut BytesMut) {
    loop {
        let n = gate.passable(held);
        if n == 0 {
            return;
        }
        to.extend_from_slice(&held.split_to(n));
        if held.is_empty() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn startup() -> Vec<u8> {
        let body = b"\x00\x03\x00\x00user\x00app\x00\x00";
        let mut m = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        m.extend_from_slice(body);
        m
    }

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn auth(code: u32) -> Vec<u8> {
        message(b'R', &code.to_be_bytes())
    }

    /// Startup, password and query sent at once reach the session one step at a time.
    #[test]
    fn a_pipelined_connect_passes_each_message_when_asked() {
        let (s, p, q) = (
            startup(),
            message(b'p', b"pw\0"),
            message(b'Q', b"SELECT 1\0"),
        );
        let mut held = BytesMut::new();
        for part in [&s, &p, &q] {
            held.extend_from_slice(part);
        }
        let mut gate = Gate::default();
        let mut to = BytesMut::new();
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &s[..], "only the startup packet");
        to.clear();
        release(&mut gate, &mut held, &mut to);
        assert!(to.is_empty(), "nothing more before the session answers");
        assert_eq!(gate.answered(&auth(3), &held), 0);
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &p[..], "the password, asked for");
        to.clear();
        assert_eq!(gate.answered(&auth(0), &held), 0);
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &q[..], "then the rest");
    }

    /// A message split over several frames passes once whole.
    #[test]
    fn partial_messages_wait() {
        let s = startup();
        let mut held = BytesMut::from(&s[..3]);
        let mut gate = Gate::default();
        let mut to = BytesMut::new();
        release(&mut gate, &mut held, &mut to);
        assert!(to.is_empty());
        held.extend_from_slice(&s[3..]);
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &s[..]);
    }

    /// A trust user is logged in without a password: the pipelined one is dropped; SCRAM
    /// and errors open the gate (what follows is the login's to judge).
    #[test]
    fn answers_other_than_a_cleartext_request_open_the_gate() {
        let p = message(b'p', b"pw\0");
        let mut gate = Gate::default();
        gate.passable(&startup());
        assert_eq!(gate.answered(&auth(0), &p), p.len(), "dropped");
        assert_eq!(gate.passable(b"anything"), 8);
        for first in [auth(10), message(b'E', b"SFATAL\0\0")] {
            let mut gate = Gate::default();
            gate.passable(&startup());
            assert_eq!(gate.answered(&first, &p), 0);
            assert_eq!(gate.passable(&p), p.len());
        }
    }

    /// An SSLRequest's one-byte answer leads to another first packet.
    #[test]
    fn an_encryption_request_is_answered_before_the_startup_passes() {
        let mut ssl = 8u32.to_be_bytes().to_vec();
        ssl.extend_from_slice(&SSL_REQUEST.to_be_bytes());
        let s = startup();
        let mut held = BytesMut::new();
        held.extend_from_slice(&ssl);
        held.extend_from_slice(&s);
        let mut gate = Gate::default();
        let mut to = BytesMut::new();
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &ssl[..]);
        gate.answered(b"N", &held);
        to.clear();
        release(&mut gate, &mut held, &mut to);
        assert_eq!(&to[..], &s[..]);
    }
}
