//! The node link's framing, pure: every frame is a 9-byte header (kind, stream id, payload
//! length, big-endian) and its payload. Many clients' streams share one connection; each
//! direction of a stream may have at most its window of data unacknowledged, so one slow
//! client never stalls the others (see [`super::mux`]).

use bytes::{BufMut, BytesMut};

pub const HEADER: usize = 9;
/// Largest payload of one frame: a longer write is cut into several.
pub const MAX_PAYLOAD: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A new stream; the payload says what it is for (the pooler's business, opaque here).
    Open = 1,
    /// Bytes of a stream.
    Data = 2,
    /// The receiver consumed this many bytes (u32): the sender may send that much more.
    Credit = 3,
    /// The stream is over on the sender's side; it sends nothing more and reads nothing more.
    /// The payload, if any, says why (UTF-8).
    Close = 4,
    /// A client's cancel request for a query this node runs: process id and secret (i32 each).
    /// Stream id 0.
    Cancel = 5,
    /// Round-trip probe (8 opaque bytes, echoed by [`Kind::Pong`]). Stream id 0.
    Ping = 6,
    Pong = 7,
    /// A piece of the stream's latest state snapshot (the pooler's business, opaque here):
    /// a flags byte ([`STATE_LAST`] on the snapshot's last piece), then the piece. Outside
    /// the stream's window: snapshots are rare and bounded.
    State = 8,
}

/// Flag of a snapshot's last [`Kind::State`] piece.
pub const STATE_LAST: u8 = 1;

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Open,
            2 => Kind::Data,
            3 => Kind::Credit,
            4 => Kind::Close,
            5 => Kind::Cancel,
            6 => Kind::Ping,
            7 => Kind::Pong,
            8 => Kind::State,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub stream: u32,
    pub len: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLong(usize),
    #[error("{0:?} frame with a payload of {1} bytes")]
    BadLength(Kind, usize),
}

/// Appends a header announcing `len` payload bytes.
pub fn put_header(out: &mut BytesMut, kind: Kind, stream: u32, len: usize) {
    debug_assert!(len <= MAX_PAYLOAD);
    out.reserve(HEADER + len);
    out.put_u8(kind as u8);
    out.put_u32(stream);
    out.put_u32(len as u32);
}

/// Appends a whole frame.
pub fn put_frame(out: &mut BytesMut, kind: Kind, stream: u32, payload: &[u8]) {
    put_header(out, kind, stream, payload.len());
    out.extend_from_slice(payload);
}

/// The header at the start of `buf`, once all of it is there; checked so that a peer's bad
/// frame is an error, never an allocation of its choosing.
pub fn parse_header(buf: &[u8]) -> Result<Option<Header>, FrameError> {
    if buf.len() < HEADER {
        return Ok(None);
    }
    let kind = Kind::from_u8(buf[0]).ok_or(FrameError::UnknownKind(buf[0]))?;
    let stream = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    let len = u32::from_be_bytes([buf[5], buf[6], buf[7], buf[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLong(len));
    }
    let fixed = match kind {
        Kind::Credit => Some(4),
        Kind::Cancel => Some(8),
        Kind::Ping | Kind::Pong => Some(8),
        _ => None,
    };
    if fixed.is_some_and(|f| f != len) || (kind == Kind::State && len == 0) {
        return Err(FrameError::BadLength(kind, len));
    }
    Ok(Some(Header { kind, stream, len }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_frame_reads_back_as_written() {
        let mut b = BytesMut::new();
        put_frame(&mut b, Kind::Data, 7, b"hello");
        let h = parse_header(&b).unwrap().unwrap();
        assert_eq!(
            h,
            Header {
                kind: Kind::Data,
                stream: 7,
                len: 5
            }
        );
        assert_eq!(&b[HEADER..], b"hello");
        assert_eq!(parse_header(&b[..HEADER - 1]), Ok(None));
    }

    #[test]
    fn bad_headers_are_errors() {
        let mut b = BytesMut::new();
        put_header(&mut b, Kind::Credit, 1, 4);
        b[0] = 99;
        assert_eq!(parse_header(&b), Err(FrameError::UnknownKind(99)));
        b[0] = Kind::Data as u8;
        b[5..9].copy_from_slice(&((MAX_PAYLOAD as u32) + 1).to_be_bytes());
        assert!(matches!(parse_header(&b), Err(FrameError::TooLong(_))));
        b[0] = Kind::Credit as u8;
        b[5..9].copy_from_slice(&3u32.to_be_bytes());
        assert_eq!(
            parse_header(&b),
            Err(FrameError::BadLength(Kind::Credit, 3))
        );
    }

    proptest! {
        #[test]
        fn any_bytes_parse_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
            if let Ok(Some(h)) = parse_header(&bytes) {
                prop_assert!(h.len <= MAX_PAYLOAD);
            }
        }
    }
}
