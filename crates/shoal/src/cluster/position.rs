//! Where a relayed client stands in the protocol, as the relaying node sees the bytes go by:
//! pure, fed each chunk as it passes in either direction. It answers the one question the
//! relaying node has when the owner is lost: was the client idle — nothing sent that the
//! owner had not fully answered, outside a transaction block — so that it can go on at a new
//! owner without a word? Anything else (a statement in flight, an open transaction) could
//! have been applied or not, and the client must be told.
//!
//! It also picks out the BackendKeyData the owner gave the client, so the relaying node can
//! send the client's cancels to whichever node serves it now.

/// One direction's message boundaries (tag and 4-byte length, then the body), across chunks.
#[derive(Debug, Default)]
struct Scanner {
    header: [u8; 5],
    have: usize,
    /// Body bytes of the current message still to come.
    left: usize,
    tag: u8,
    /// The start of the body, for the messages whose content matters here.
    body: [u8; 8],
    body_have: usize,
    want: usize,
    /// A length that cannot be: the stream is not followed any more.
    lost: bool,
}

impl Scanner {
    /// Feeds `data`, calling `done` with each message completed (its tag and the start of
    /// its body, up to `want(tag)` bytes).
    fn feed(&mut self, mut data: &[u8], want: fn(u8) -> usize, done: &mut dyn FnMut(u8, &[u8])) {
        while !data.is_empty() && !self.lost {
            if self.have < 5 {
                let n = (5 - self.have).min(data.len());
                self.header[self.have..self.have + n].copy_from_slice(&data[..n]);
                self.have += n;
                data = &data[n..];
                if self.have < 5 {
                    return;
                }
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                if len < 4 {
                    self.lost = true;
                    return;
                }
                self.tag = self.header[0];
                self.left = len - 4;
                self.want = want(self.tag).min(self.left);
                self.body_have = 0;
            }
            let n = self.left.min(data.len());
            if self.body_have < self.want {
                let k = (self.want - self.body_have).min(n);
                self.body[self.body_have..self.body_have + k].copy_from_slice(&data[..k]);
                self.body_have += k;
            }
            self.left -= n;
            data = &data[n..];
            if self.left == 0 {
                done(self.tag, &self.body[..self.body_have]);
                self.have = 0;
            }
        }
    }

    /// Between messages.
    fn at_boundary(&self) -> bool {
        self.have == 0 && !self.lost
    }
}

#[derive(Debug, Default)]
pub struct Position {
    from_client: Scanner,
    from_owner: Scanner,
    /// Requests sent that owe a ReadyForQuery (Query, Sync, FunctionCall).
    owed: u64,
    /// Extended-protocol messages sent since the last Sync.
    unsynced: bool,
    /// The status of the last ReadyForQuery (none yet: not idle until the owner's login
    /// reply ends with one).
    status: u8,
}

fn nothing(_: u8) -> usize {
    0
}

fn owner_wants(tag: u8) -> usize {
    match tag {
        b'Z' => 1,
        b'K' => 8,
        _ => 0,
    }
}

impl Position {
    /// Bytes the client sent towards the owner.
    pub fn client_sent(&mut self, data: &[u8]) {
        let (owed, unsynced) = (&mut self.owed, &mut self.unsynced);
        self.from_client
            .feed(data, nothing, &mut |tag, _| match tag {
                b'Q' | b'F' => {
                    *owed += 1;
                }
                b'S' => {
                    *owed += 1;
                    *unsynced = false;
                }
                // Terminate, and COPY data: part of a request already counted.
                b'X' | b'd' | b'c' | b'f' => {}
                // Parse, Bind, Describe, Execute, Close, Flush.
                _ => *unsynced = true,
            });
    }

    /// Bytes the owner sent towards the client; returns the cancel key if they carried one.
    pub fn owner_sent(&mut self, data: &[u8]) -> Option<(i32, i32)> {
        let mut key = None;
        let (owed, status) = (&mut self.owed, &mut self.status);
        self.from_owner
            .feed(data, owner_wants, &mut |tag, body| match tag {
                b'Z' if body.len() == 1 => {
                    // The login reply's ReadyForQuery answers no request.
                    *owed = owed.saturating_sub(1);
                    *status = body[0];
                }
                b'K' if body.len() == 8 => {
                    let pid = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                    let secret = i32::from_be_bytes([body[4], body[5], body[6], body[7]]);
                    key = Some((pid, secret));
                }
                _ => {}
            });
        key
    }

    /// Whether the client may go on at another owner without being told: everything it sent
    /// was answered, with the last ReadyForQuery saying idle, and no message half-way.
    pub fn idle(&self) -> bool {
        self.owed == 0
            && !self.unsynced
            && self.status == b'I'
            && self.from_client.at_boundary()
            && self.from_owner.at_boundary()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    fn login_reply() -> Vec<u8> {
        let mut v = msg(b'S', b"server_version\x0017\x00");
        let mut key = 1234i32.to_be_bytes().to_vec();
        key.extend_from_slice(&(-7i32).to_be_bytes());
        v.extend(msg(b'K', &key));
        v.extend(msg(b'Z', b"I"));
        v
    }

    #[test]
    fn idle_only_between_answered_requests_outside_a_transaction() {
        let mut p = Position::default();
        assert!(!p.idle(), "not before the login reply");
        assert_eq!(p.owner_sent(&login_reply()), Some((1234, -7)));
        assert!(p.idle());
        p.client_sent(&msg(b'Q', b"BEGIN\0"));
        assert!(!p.idle(), "a query in flight");
        p.owner_sent(&msg(b'C', b"BEGIN\0"));
        p.owner_sent(&msg(b'Z', b"T"));
        assert!(!p.idle(), "inside a transaction block");
        p.client_sent(&msg(b'Q', b"COMMIT\0"));
        p.owner_sent(&[msg(b'C', b"COMMIT\0"), msg(b'Z', b"I")].concat());
        assert!(p.idle());
        // Extended protocol: unsynced messages, then a Sync.
        p.client_sent(&msg(b'P', b"\0SELECT 1\0\0\0"));
        assert!(!p.idle());
        p.client_sent(&msg(b'S', b""));
        assert!(!p.idle(), "the Sync is owed its ReadyForQuery");
        p.owner_sent(&[msg(b'1', b""), msg(b'Z', b"I")].concat());
        assert!(p.idle());
        // Pipelined: two syncs, one answered.
        p.client_sent(&[msg(b'S', b""), msg(b'S', b"")].concat());
        p.owner_sent(&msg(b'Z', b"I"));
        assert!(!p.idle());
        p.owner_sent(&msg(b'Z', b"I"));
        assert!(p.idle());
    }

    #[test]
    fn a_message_cut_anywhere_is_not_idle_until_whole() {
        let mut p = Position::default();
        p.owner_sent(&login_reply());
        let q = msg(b'Q', b"SELECT 1\0");
        p.client_sent(&q[..3]);
        assert!(!p.idle());
        p.client_sent(&q[3..]);
        let reply = [msg(b'C', b"SELECT 1\0"), msg(b'Z', b"I")].concat();
        p.owner_sent(&reply[..reply.len() - 1]);
        assert!(!p.idle());
        p.owner_sent(&reply[reply.len() - 1..]);
        assert!(p.idle());
    }

    #[test]
    fn an_impossible_length_is_never_idle_again() {
        let mut p = Position::default();
        p.owner_sent(&login_reply());
        p.client_sent(&[b'Q', 0, 0, 0, 2]);
        p.owner_sent(&msg(b'Z', b"I"));
        assert!(!p.idle());
    }

    proptest! {
        /// However the bytes are cut into chunks, the position is the same.
        #[test]
        fn chunking_does_not_matter(cuts in proptest::collection::vec(1usize..7, 1..40)) {
            let stream = [login_reply(), msg(b'Z', b"T"), msg(b'D', b"xyz"), msg(b'Z', b"I")].concat();
            let mut whole = Position::default();
            let key = whole.owner_sent(&stream);
            let mut parts = Position::default();
            let (mut at, mut found) = (0, None);
            for c in cuts.iter().cycle() {
                if at >= stream.len() {
                    break;
                }
                let end = (at + c).min(stream.len());
                found = found.or(parts.owner_sent(&stream[at..end]));
                at = end;
            }
            prop_assert_eq!(key, found);
            prop_assert_eq!(whole.idle(), parts.idle());
            prop_assert_eq!(whole.status, parts.status);
        }
    }
}
