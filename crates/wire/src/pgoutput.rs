//! Logical replication as PostgreSQL's `pgoutput` plugin streams it: the replication
//! protocol's CopyData payloads (WAL data, keepalives, the standby's status updates) and the
//! plugin's messages inside them (protocol version 1). Pure decoding over byte slices, so it
//! can be unit-tested and fuzzed; the connection that carries it lives elsewhere.
//!
//! Every length and count comes from the network and is checked against what is there: a
//! short or malformed message is an error, never a panic or an allocation sized by the peer.

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
pub const PG_EPOCH_OFFSET_US: i64 = 946_684_800_000_000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PgOutputError {
    #[error("replication message cut short")]
    Short,
    #[error("unknown replication message kind {0:?}")]
    UnknownKind(char),
    #[error("unknown tuple column kind {0:?}")]
    UnknownColumn(char),
    #[error("a name in a replication message is not UTF-8")]
    NotUtf8,
}

/// One CopyData payload of the server's replication stream.
#[derive(Debug, PartialEq, Eq)]
pub enum ReplicationMessage<'a> {
    /// WAL data: a `pgoutput` message that starts at `start`.
    XLogData {
        start: u64,
        wal_end: u64,
        sent_at: i64,
        data: &'a [u8],
    },
    /// The server's position, and whether it wants a status update now.
    Keepalive {
        wal_end: u64,
        sent_at: i64,
        reply_requested: bool,
    },
}

/// Decodes one CopyData payload from the server.
pub fn replication_message(b: &[u8]) -> Result<ReplicationMessage<'_>, PgOutputError> {
    let mut r = Reader(b);
    match r.u8()? {
        b'w' => Ok(ReplicationMessage::XLogData {
            start: r.u64()?,
            wal_end: r.u64()?,
            sent_at: r.i64()?,
            data: r.rest(),
        }),
        b'k' => Ok(ReplicationMessage::Keepalive {
            wal_end: r.u64()?,
            sent_at: r.i64()?,
            reply_requested: r.u8()? != 0,
        }),
        k => Err(PgOutputError::UnknownKind(k as char)),
    }
}

/// A standby status update (the CopyData payload): WAL up to `lsn` is received, flushed
/// and applied; `now_us` is the client's clock in PostgreSQL's epoch.
pub fn status_update(out: &mut Vec<u8>, lsn: u64, now_us: i64, reply: bool) {
    out.push(b'r');
    for _ in 0..3 {
        out.extend_from_slice(&lsn.to_be_bytes());
    }
    out.extend_from_slice(&now_us.to_be_bytes());
    out.push(reply as u8);
}

/// One `pgoutput` message.
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    Begin {
        final_lsn: u64,
        commit_time: i64,
        xid: u32,
    },
    Commit {
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
    },
    Origin {
        lsn: u64,
        name: &'a str,
    },
    /// A relation's description, sent before the first change to it in a session and again
    /// when it changes.
    Relation(Relation<'a>),
    Type {
        oid: u32,
        schema: &'a str,
        name: &'a str,
    },
    Insert {
        relation: u32,
        new: Tuple<'a>,
    },
    /// `old` is the old key (`K`) or the whole old row (`O`, with `REPLICA IDENTITY FULL`),
    /// when the update changed it.
    Update {
        relation: u32,
        old: Option<(OldKind, Tuple<'a>)>,
        new: Tuple<'a>,
    },
    Delete {
        relation: u32,
        old: (OldKind, Tuple<'a>),
    },
    Truncate {
        cascade: bool,
        restart_identity: bool,
        relations: Vec<u32>,
    },
    /// A `pg_logical_emit_message` (with `messages 'true'`).
    LogicalMessage {
        transactional: bool,
        lsn: u64,
        prefix: &'a str,
        content: &'a [u8],
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldKind {
    Key,
    Row,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Relation<'a> {
    pub id: u32,
    pub schema: &'a str,
    pub name: &'a str,
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn<'a>>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct RelationColumn<'a> {
    /// Part of the replica identity (the key).
    pub key: bool,
    pub name: &'a str,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// A row's columns, in the relation's order.
#[derive(Debug, PartialEq, Eq)]
pub struct Tuple<'a>(pub Vec<Column<'a>>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column<'a> {
    Null,
    /// A TOASTed value the change left as it was: not sent.
    Unchanged,
    Text(&'a [u8]),
    Binary(&'a [u8]),
}

/// Decodes one `pgoutput` message (the `data` of [`ReplicationMessage::XLogData`]).
pub fn message(b: &[u8]) -> Result<Message<'_>, PgOutputError> {
    let mut r = Reader(b);
    let m = match r.u8()? {
        b'B' => Message::Begin {
            final_lsn: r.u64()?,
            commit_time: r.i64()?,
            xid: r.u32()?,
        },
        b'C' => {
            r.u8()?;
            Message::Commit {
                commit_lsn: r.u64()?,
                end_lsn: r.u64()?,
                commit_time: r.i64()?,
            }
        }
        b'O' => Message::Origin {
            lsn: r.u64()?,
            name: r.str()?,
        },
        b'R' => {
            let id = r.u32()?;
            let schema = r.str()?;
            let name = r.str()?;
            let replica_identity = r.u8()?;
            let n = r.u16()? as usize;
            // Each column takes at least 10 bytes: a count past that is a lie.
            let mut columns = Vec::with_capacity(n.min(r.0.len() / 10));
            for _ in 0..n {
                columns.push(RelationColumn {
                    key: r.u8()? & 1 == 1,
                    name: r.str()?,
                    type_oid: r.u32()?,
                    type_modifier: r.u32()? as i32,
                });
            }
            Message::Relation(Relation {
                id,
                schema,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => Message::Type {
            oid: r.u32()?,
            schema: r.str()?,
            name: r.str()?,
        },
        b'I' => {
            let relation = r.u32()?;
            r.expect(b'N')?;
            Message::Insert {
                relation,
                new: r.tuple()?,
            }
        }
        b'U' => {
            let relation = r.u32()?;
            let old = match r.u8()? {
                b'N' => None,
                k @ (b'K' | b'O') => {
                    let old = (old_kind(k), r.tuple()?);
                    r.expect(b'N')?;
                    Some(old)
                }
                k => return Err(PgOutputError::UnknownKind(k as char)),
            };
            Message::Update {
                relation,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            let relation = r.u32()?;
            let kind = match r.u8()? {
                k @ (b'K' | b'O') => old_kind(k),
                k => return Err(PgOutputError::UnknownKind(k as char)),
            };
            Message::Delete {
                relation,
                old: (kind, r.tuple()?),
            }
        }
        b'T' => {
            let n = r.u32()? as usize;
            let options = r.u8()?;
            let mut relations = Vec::with_capacity(n.min(r.0.len() / 4));
            for _ in 0..n {
                relations.push(r.u32()?);
            }
            Message::Truncate {
                cascade: options & 1 != 0,
                restart_identity: options & 2 != 0,
                relations,
            }
        }
        b'M' => {
            let transactional = r.u8()? & 1 == 1;
            let lsn = r.u64()?;
            let prefix = r.str()?;
            let len = r.u32()? as usize;
            Message::LogicalMessage {
                transactional,
                lsn,
                prefix,
                content: r.take(len)?,
            }
        }
        k => return Err(PgOutputError::UnknownKind(k as char)),
    };
    Ok(m)
}

fn old_kind(k: u8) -> OldKind {
    if k == b'K' {
        OldKind::Key
    } else {
        OldKind::Row
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PgOutputError> {
        if self.0.len() < n {
            return Err(PgOutputError::Short);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PgOutputError> {
        Ok(self.take(N)?.try_into().expect("taken N bytes"))
    }

    fn u8(&mut self) -> Result<u8, PgOutputError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, PgOutputError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, PgOutputError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, PgOutputError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn i64(&mut self) -> Result<i64, PgOutputError> {
        Ok(i64::from_be_bytes(self.array()?))
    }

    fn expect(&mut self, kind: u8) -> Result<(), PgOutputError> {
        match self.u8()? {
            k if k == kind => Ok(()),
            k => Err(PgOutputError::UnknownKind(k as char)),
        }
    }

    /// A NUL-terminated UTF-8 string.
    fn str(&mut self) -> Result<&'a str, PgOutputError> {
        let end = self
            .0
            .iter()
            .position(|&c| c == 0)
            .ok_or(PgOutputError::Short)?;
        let s = std::str::from_utf8(&self.0[..end]).map_err(|_| PgOutputError::NotUtf8)?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }

    fn tuple(&mut self) -> Result<Tuple<'a>, PgOutputError> {
        let n = self.u16()? as usize;
        let mut columns = Vec::with_capacity(n.min(self.0.len()));
        for _ in 0..n {
            columns.push(match self.u8()? {
                b'n' => Column::Null,
                b'u' => Column::Unchanged,
                b't' => {
                    let len = self.u32()? as usize;
                    Column::Text(self.take(len)?)
                }
                b'b' => {
                    let len = self.u32()? as usize;
                    Column::Binary(self.take(len)?)
                }
                k => return Err(PgOutputError::UnknownColumn(k as char)),
            });
        }
        Ok(Tuple(columns))
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tuple(cols: &[Option<&str>]) -> Vec<u8> {
        let mut b = (cols.len() as u16).to_be_bytes().to_vec();
        for c in cols {
            match c {
                None => b.push(b'n'),
                Some(v) => {
                    b.push(b't');
                    b.extend_from_slice(&(v.len() as u32).to_be_bytes());
                    b.extend_from_slice(v.as_bytes());
                }
            }
        }
        b
    }

    #[test]
    fn wal_data_and_keepalives_are_told_apart() {
        let mut w = vec![b'w'];
        w.extend_from_slice(&16u64.to_be_bytes());
        w.extend_from_slice(&32u64.to_be_bytes());
        w.extend_from_slice(&7i64.to_be_bytes());
        w.extend_from_slice(b"Bxyz");
        assert_eq!(
            replication_message(&w),
            Ok(ReplicationMessage::XLogData {
                start: 16,
                wal_end: 32,
                sent_at: 7,
                data: b"Bxyz"
            })
        );
        let mut k = vec![b'k'];
        k.extend_from_slice(&99u64.to_be_bytes());
        k.extend_from_slice(&1i64.to_be_bytes());
        k.push(1);
        assert_eq!(
            replication_message(&k),
            Ok(ReplicationMessage::Keepalive {
                wal_end: 99,
                sent_at: 1,
                reply_requested: true
            })
        );
        assert_eq!(replication_message(&k[..10]), Err(PgOutputError::Short));
        let mut s = Vec::new();
        status_update(&mut s, 5, 6, false);
        assert_eq!(s.len(), 34);
        assert_eq!(&s[1..9], &5u64.to_be_bytes());
    }

    #[test]
    fn changes_decode_with_their_rows() {
        let mut rel = vec![b'R'];
        rel.extend_from_slice(&16384u32.to_be_bytes());
        rel.extend_from_slice(b"public\0items\0d");
        rel.extend_from_slice(&2u16.to_be_bytes());
        rel.extend_from_slice(b"\x01id\0");
        rel.extend_from_slice(&23u32.to_be_bytes());
        rel.extend_from_slice(&(-1i32).to_be_bytes());
        rel.extend_from_slice(b"\x00name\0");
        rel.extend_from_slice(&25u32.to_be_bytes());
        rel.extend_from_slice(&(-1i32).to_be_bytes());
        let Message::Relation(r) = message(&rel).unwrap() else {
            panic!("a relation")
        };
        assert_eq!((r.id, r.schema, r.name), (16384, "public", "items"));
        assert_eq!(r.columns.len(), 2);
        assert!(r.columns[0].key && !r.columns[1].key);
        assert_eq!(r.columns[1].type_oid, 25);

        let mut ins = vec![b'I'];
        ins.extend_from_slice(&16384u32.to_be_bytes());
        ins.push(b'N');
        ins.extend_from_slice(&tuple(&[Some("1"), None]));
        assert_eq!(
            message(&ins),
            Ok(Message::Insert {
                relation: 16384,
                new: Tuple(vec![Column::Text(b"1"), Column::Null])
            })
        );

        let mut upd = vec![b'U'];
        upd.extend_from_slice(&16384u32.to_be_bytes());
        upd.push(b'K');
        upd.extend_from_slice(&tuple(&[Some("1")]));
        upd.push(b'N');
        upd.extend_from_slice(&tuple(&[Some("2"), Some("x")]));
        let Message::Update { old, new, .. } = message(&upd).unwrap() else {
            panic!("an update")
        };
        assert_eq!(old.unwrap().0, OldKind::Key);
        assert_eq!(new.0.len(), 2);

        let mut del = vec![b'D'];
        del.extend_from_slice(&16384u32.to_be_bytes());
        del.push(b'O');
        del.extend_from_slice(&tuple(&[Some("2"), Some("x")]));
        assert!(matches!(
            message(&del),
            Ok(Message::Delete {
                old: (OldKind::Row, _),
                ..
            })
        ));

        let mut tr = vec![b'T'];
        tr.extend_from_slice(&2u32.to_be_bytes());
        tr.push(1);
        tr.extend_from_slice(&1u32.to_be_bytes());
        tr.extend_from_slice(&2u32.to_be_bytes());
        assert_eq!(
            message(&tr),
            Ok(Message::Truncate {
                cascade: true,
                restart_identity: false,
                relations: vec![1, 2]
            })
        );
        let mut commit = vec![b'C', 0];
        for v in [10u64, 20, 30] {
            commit.extend_from_slice(&v.to_be_bytes());
        }
        assert_eq!(
            message(&commit),
            Ok(Message::Commit {
                commit_lsn: 10,
                end_lsn: 20,
                commit_time: 30
            })
        );
    }

    #[test]
    fn lies_about_sizes_are_errors() {
        // A truncate announcing four billion relations in a few bytes.
        let mut tr = vec![b'T'];
        tr.extend_from_slice(&u32::MAX.to_be_bytes());
        tr.push(0);
        assert_eq!(message(&tr), Err(PgOutputError::Short));
        let mut ins = vec![b'I'];
        ins.extend_from_slice(&1u32.to_be_bytes());
        ins.extend_from_slice(b"N\x00\x01t\xff\xff\xff\xff");
        assert_eq!(message(&ins), Err(PgOutputError::Short));
        assert_eq!(message(b"Z"), Err(PgOutputError::UnknownKind('Z')));
        assert_eq!(message(b""), Err(PgOutputError::Short));
    }

    proptest::proptest! {
        /// Whatever the network sends, decoding returns (an error at worst).
        #[test]
        fn any_bytes_decode_or_fail_cleanly(b in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = message(&b);
            let _ = replication_message(&b);
            for kind in b"BCORYIUDTM" {
                let mut m = vec![*kind];
                m.extend_from_slice(&b);
                let _ = message(&m);
            }
        }
    }
}
