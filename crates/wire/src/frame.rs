//! Framing of tagged protocol messages: a one-byte tag, a four-byte big-endian length that
//! counts itself, then the body.
//!
//! The pooler's hot path only needs to know where each message ends and what its tag is, so
//! [`next_frame_len`] peeks at the header without copying. [`Frame`] is the owned form for the
//! few messages Shoal must look inside.

use bytes::{Buf, Bytes, BytesMut};
use thiserror::Error;

/// Header size of a tagged message: tag byte plus length word.
pub const HEADER_LEN: usize = 5;

/// Why a byte stream cannot be a valid message sequence. Each variant is a protocol violation
/// by the peer; the connection cannot continue after it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("invalid message length {len} for message type '{tag}'")]
    BadLength { tag: char, len: u32 },
    #[error("message type '{tag}' of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { tag: char, len: u32, max: usize },
    #[error("message body is malformed: {0}")]
    Malformed(&'static str),
    #[error("invalid frontend message type {}", *.0 as char)]
    UnknownType(u8),
}

/// Returns the total length (header included) of the first message in `buf` once it is fully
/// buffered, `Ok(None)` while more bytes are needed, or an error for a length that no valid
/// message can have. `max` bounds the total so a hostile peer cannot make us buffer gigabytes.
pub fn next_frame_len(buf: &[u8], max: usize) -> Result<Option<usize>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let tag = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if len < 4 {
        return Err(FrameError::BadLength {
            tag: tag as char,
            len,
        });
    }
    let total = len as usize + 1;
    if total > max {
        return Err(FrameError::TooLarge {
            tag: tag as char,
            len,
            max,
        });
    }
    Ok((buf.len() >= total).then_some(total))
}

/// One complete message, kept as the bytes it arrived in so it can be forwarded untouched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    bytes: Bytes,
}

impl Frame {
    /// Splits the first complete message off `buf`, if there is one.
    pub fn split(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, FrameError> {
        Ok(next_frame_len(buf, max)?.map(|n| Frame {
            bytes: buf.split_to(n).freeze(),
        }))
    }

    pub fn tag(&self) -> u8 {
        self.bytes[0]
    }

    /// The whole message: tag, length and body.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The message body, after tag and length.
    pub fn body(&self) -> &[u8] {
        &self.bytes[HEADER_LEN..]
    }
}

/// A cursor over a message body that never panics on short or malformed input: every read is
/// checked, so decoding untrusted bytes yields an error instead of a crash.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub fn u8(&mut self) -> Result<u8, FrameError> {
        if self.buf.is_empty() {
            return Err(FrameError::Malformed("message ends early"));
        }
        Ok(self.buf.get_u8())
    }

    /// A 16-bit count (parameters, formats, values, columns): unsigned, as PostgreSQL reads
    /// them, so up to 65,535.
    pub fn u16(&mut self) -> Result<u16, FrameError> {
        if self.buf.len() < 2 {
            return Err(FrameError::Malformed("message ends early"));
        }
        Ok(self.buf.get_u16())
    }

    pub fn i16(&mut self) -> Result<i16, FrameError> {
        if self.buf.len() < 2 {
            return Err(FrameError::Malformed("message ends early"));
        }
        Ok(self.buf.get_i16())
    }

    pub fn i32(&mut self) -> Result<i32, FrameError> {
        if self.buf.len() < 4 {
            return Err(FrameError::Malformed("message ends early"));
        }
        Ok(self.buf.get_i32())
    }

    /// A NUL-terminated string, which must be valid UTF-8 (all names Shoal inspects are).
    pub fn cstr(&mut self) -> Result<&'a str, FrameError> {
        let nul = memchr::memchr(0, self.buf)
            .ok_or(FrameError::Malformed("string is not NUL-terminated"))?;
        let s = std::str::from_utf8(&self.buf[..nul])
            .map_err(|_| FrameError::Malformed("string is not valid UTF-8"))?;
        self.buf = &self.buf[nul + 1..];
        Ok(s)
    }

    /// A NUL-terminated string as bytes: query texts and server messages may be in any
    /// encoding, and Shoal must pass them on, not judge them.
    pub fn cstr_bytes(&mut self) -> Result<&'a [u8], FrameError> {
        // Most strings of the extended protocol are empty (the unnamed statement and
        // portal): no search for those.
        let nul = if self.buf.first() == Some(&0) {
            0
        } else {
            memchr::memchr(0, self.buf)
                .ok_or(FrameError::Malformed("string is not NUL-terminated"))?
        };
        let s = &self.buf[..nul];
        self.buf = &self.buf[nul + 1..];
        Ok(s)
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.buf.len() < n {
            return Err(FrameError::Malformed("message ends early"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incomplete_header_and_body_need_more() {
        assert_eq!(next_frame_len(b"Q\0\0", 100), Ok(None));
        assert_eq!(next_frame_len(b"Q\0\0\0\x08abc", 100), Ok(None));
        assert_eq!(next_frame_len(b"Q\0\0\0\x08abcd", 100), Ok(Some(9)));
    }

    #[test]
    fn lengths_below_four_and_above_max_are_errors() {
        assert!(matches!(
            next_frame_len(b"Q\0\0\0\x03", 100),
            Err(FrameError::BadLength { .. })
        ));
        assert!(matches!(
            next_frame_len(b"Q\0\0\x10\x00", 100),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn split_leaves_the_rest() {
        let mut buf = BytesMut::from(&b"S\0\0\0\x04H\0\0\0\x04X"[..]);
        let f = Frame::split(&mut buf, 100).unwrap().unwrap();
        assert_eq!(f.tag(), b'S');
        assert!(f.body().is_empty());
        assert_eq!(&buf[..], b"H\0\0\0\x04X");
    }

    /// Strings end at their first NUL (empty ones included), and a string with no NUL is an
    /// error at any length.
    #[test]
    fn strings_of_every_length_end_at_their_nul() {
        for len in 0..40 {
            let text = vec![b'x'; len];
            let mut body = text.clone();
            body.extend_from_slice(b"\0rest\0");
            let mut r = Reader::new(&body);
            assert_eq!(r.cstr_bytes().unwrap(), &text[..], "length {len}");
            assert_eq!(r.cstr_bytes().unwrap(), b"rest");
            assert!(Reader::new(&text).cstr_bytes().is_err(), "length {len}");
        }
    }

    #[test]
    fn reader_rejects_short_input() {
        let mut r = Reader::new(b"ab");
        assert!(r.i32().is_err());
        assert!(r.cstr().is_err());
        let mut r = Reader::new(b"ab\0\x01");
        assert_eq!(r.cstr().unwrap(), "ab");
        assert_eq!(r.u8().unwrap(), 1);
        assert!(r.u8().is_err());
    }
}
