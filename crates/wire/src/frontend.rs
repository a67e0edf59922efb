//! Messages of the client side of the protocol: what Shoal sends to PostgreSQL, and decoders
//! for the client messages Shoal acts on.

use bytes::{BufMut, BytesMut};

use crate::backend::{put_cstr, put_message};
use crate::frame::{FrameError, Reader};
use crate::startup::PROTOCOL_3_0;

pub mod tag {
    pub const QUERY: u8 = b'Q';
    pub const PARSE: u8 = b'P';
    pub const BIND: u8 = b'B';
    pub const DESCRIBE: u8 = b'D';
    pub const EXECUTE: u8 = b'E';
    pub const CLOSE: u8 = b'C';
    pub const SYNC: u8 = b'S';
    pub const FLUSH: u8 = b'H';
    pub const FUNCTION_CALL: u8 = b'F';
    pub const COPY_DATA: u8 = b'd';
    pub const COPY_DONE: u8 = b'c';
    pub const COPY_FAIL: u8 = b'f';
    pub const TERMINATE: u8 = b'X';
    pub const PASSWORD: u8 = b'p';
}

pub fn startup(buf: &mut BytesMut, params: &[(&str, &str)]) {
    let at = buf.len();
    buf.put_i32(0);
    buf.put_i32(PROTOCOL_3_0);
    for (k, v) in params {
        put_cstr(buf, k);
        put_cstr(buf, v);
    }
    buf.put_u8(0);
    let len = (buf.len() - at) as i32;
    buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

pub fn cancel_request(buf: &mut BytesMut, process_id: i32, secret_key: i32) {
    buf.put_i32(16);
    buf.put_i32(crate::startup::CANCEL_REQUEST_CODE);
    buf.put_i32(process_id);
    buf.put_i32(secret_key);
}

/// A Sync outside any extended-protocol batch: PostgreSQL answers it with ReadyForQuery, after
/// delivering the notifications it has pending.
pub fn sync(buf: &mut BytesMut) {
    put_message(buf, tag::SYNC, |_| {});
}

pub fn query(buf: &mut BytesMut, sql: &str) {
    put_message(buf, tag::QUERY, |b| put_cstr(b, sql));
}

/// Parse (unnamed), Bind with text parameters, Execute and Sync: one round trip that runs
/// `sql` with values passed out of band, never spliced into the text.
pub fn parse_bind_execute(buf: &mut BytesMut, sql: &str, params: &[&str]) {
    parse_bind_execute_unsynced(buf, sql, params);
    sync(buf);
}

/// [`parse_bind_execute`] without the Sync, for several statements sent in one go that run
/// in one implicit transaction (up to the Sync that follows them).
pub fn parse_bind_execute_unsynced(buf: &mut BytesMut, sql: &str, params: &[&str]) {
    parse(buf, "", sql);
    bind_execute(buf, "", params);
}

/// Parse of `sql` as the prepared statement `name` (`""`: the unnamed one), its parameter
/// types left to the server.
pub fn parse(buf: &mut BytesMut, name: &str, sql: &str) {
    put_message(buf, tag::PARSE, |b| {
        put_cstr(b, name);
        put_cstr(b, sql);
        b.put_i16(0);
    });
}

/// Bind of the prepared statement `name` to text `params` (results as text), and Execute.
pub fn bind_execute(buf: &mut BytesMut, name: &str, params: &[&str]) {
    bind(buf, name, params.iter().map(|p| Some(p.as_bytes())));
    execute(buf);
}

/// Bind of the unnamed portal to the prepared statement `name`, with text parameters
/// (`None`: NULL) and text results. At most 65,535 parameters (the protocol's limit):
/// callers check first.
pub fn bind<'a>(
    buf: &mut BytesMut,
    name: &str,
    params: impl ExactSizeIterator<Item = Option<&'a [u8]>>,
) {
    put_message(buf, tag::BIND, |b| {
        put_cstr(b, "");
        put_cstr(b, name);
        b.put_i16(0);
        b.put_u16(u16::try_from(params.len()).expect("at most 65,535 parameters"));
        for p in params {
            match p {
                Some(p) => {
                    b.put_i32(p.len() as i32);
                    b.put_slice(p);
                }
                None => b.put_i32(-1),
            }
        }
        b.put_i16(0);
    });
}

/// Describe of the unnamed portal: its RowDescription (or NoData) comes before its rows.
pub fn describe_portal(buf: &mut BytesMut) {
    put_message(buf, tag::DESCRIBE, |b| {
        b.put_u8(b'P');
        put_cstr(b, "");
    });
}

/// Execute of the unnamed portal, all its rows.
pub fn execute(buf: &mut BytesMut) {
    put_message(buf, tag::EXECUTE, |b| {
        put_cstr(b, "");
        b.put_i32(0);
    });
}

pub fn password(buf: &mut BytesMut, password: &str) {
    put_message(buf, tag::PASSWORD, |b| put_cstr(b, password));
}

pub fn sasl_initial_response(buf: &mut BytesMut, mechanism: &str, data: &[u8]) {
    put_message(buf, tag::PASSWORD, |b| {
        put_cstr(b, mechanism);
        b.put_i32(data.len() as i32);
        b.put_slice(data);
    });
}

pub fn sasl_response(buf: &mut BytesMut, data: &[u8]) {
    put_message(buf, tag::PASSWORD, |b| b.put_slice(data));
}

pub fn terminate(buf: &mut BytesMut) {
    put_message(buf, tag::TERMINATE, |_| {});
}

/// Decodes a SASLInitialResponse body: mechanism name and the client-first message.
pub fn parse_sasl_initial(body: &[u8]) -> Result<(&str, &[u8]), FrameError> {
    let mut r = Reader::new(body);
    let mech = r.cstr()?;
    let len = r.i32()?;
    let data = if len < 0 {
        &[][..]
    } else {
        r.bytes(len as usize)?
    };
    Ok((mech, data))
}

/// Decodes a PasswordMessage body (cleartext or MD5 hash): one NUL-terminated string.
pub fn parse_password(body: &[u8]) -> Result<&str, FrameError> {
    Reader::new(body).cstr()
}

/// Checks that a client message has the shape its type requires, before it is forwarded.
///
/// PostgreSQL answers a malformed message with an error and then discards everything up to
/// the next Sync, a state the pooler cannot see from the replies; a server in that state must
/// never be handed to another client. So Shoal refuses such a message itself and it never
/// reaches a server. Unknown types are refused too.
pub fn validate(tag: u8, body: &[u8]) -> Result<(), FrameError> {
    let mut r = Reader::new(body);
    match tag {
        tag::SYNC | tag::FLUSH | tag::TERMINATE | tag::COPY_DONE => {}
        tag::COPY_DATA => return Ok(()),
        tag::QUERY | tag::COPY_FAIL => {
            r.cstr_bytes()?;
        }
        tag::PARSE => {
            r.cstr_bytes()?;
            r.cstr_bytes()?;
            let n = r.u16()?;
            r.bytes(usize::from(n) * 4)?;
        }
        tag::BIND => {
            r.cstr_bytes()?;
            r.cstr_bytes()?;
            let formats = r.u16()?;
            r.bytes(usize::from(formats) * 2)?;
            values(&mut r)?;
            let results = r.u16()?;
            r.bytes(usize::from(results) * 2)?;
        }
        tag::DESCRIBE | tag::CLOSE => {
            if !matches!(r.u8()?, b'S' | b'P') {
                return Err(FrameError::Malformed(
                    "Describe or Close of neither S nor P",
                ));
            }
            r.cstr_bytes()?;
        }
        tag::EXECUTE => {
            r.cstr_bytes()?;
            r.i32()?;
        }
        tag::FUNCTION_CALL => {
            r.i32()?;
            let formats = r.u16()?;
            r.bytes(usize::from(formats) * 2)?;
            values(&mut r)?;
            r.i16()?;
        }
        other => return Err(FrameError::UnknownType(other)),
    }
    if r.remaining() != 0 {
        return Err(FrameError::Malformed("trailing bytes after the message"));
    }
    Ok(())
}

/// A count, then that many length-prefixed values (length -1 is NULL).
fn values(r: &mut Reader<'_>) -> Result<(), FrameError> {
    let n = r.u16()?;
    for _ in 0..n {
        let len = r.i32()?;
        if len < -1 {
            return Err(FrameError::Malformed("invalid value length"));
        }
        if len > 0 {
            r.bytes(len as usize)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_messages_pass() {
        assert!(validate(tag::SYNC, b"").is_ok());
        assert!(validate(tag::QUERY, b"SELECT 1\0").is_ok());
        assert!(validate(tag::PARSE, b"s\0SELECT $1\0\0\x01\0\0\0\x17").is_ok());
        assert!(validate(
            tag::BIND,
            b"\0s\0\0\x01\0\x01\0\x01\0\0\0\x02ab\0\x01\0\x01"
        )
        .is_ok());
        assert!(validate(tag::BIND, b"\0\0\0\0\0\x01\xff\xff\xff\xff\0\0").is_ok());
        assert!(validate(tag::DESCRIBE, b"S\0").is_ok());
        assert!(validate(tag::EXECUTE, b"\0\0\0\0\0").is_ok());
        assert!(validate(tag::COPY_DATA, b"anything").is_ok());
    }

    #[test]
    fn malformed_messages_are_refused() {
        assert!(validate(tag::FLUSH, b"x").is_err(), "Flush has no body");
        assert!(validate(tag::SYNC, b"\0").is_err());
        assert!(validate(tag::QUERY, b"SELECT 1").is_err(), "no NUL");
        assert!(validate(tag::QUERY, b"SELECT 1\0x").is_err(), "trailing");
        assert!(validate(tag::PARSE, b"s\0SELECT\0\0\x02\0\0\0\x17").is_err());
        assert!(validate(tag::BIND, b"\0\0\0\0\0\x01\0\0\0\x09ab\0\0").is_err());
        assert!(validate(tag::DESCRIBE, b"X\0").is_err());
        assert!(validate(tag::EXECUTE, b"\0\0\0").is_err());
        assert!(validate(b'?', b"").is_err());
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// A Parse declaring `n` parameter types, and a Bind with `n` parameter formats, `n`
    /// values (of `len` bytes, or NULL) and `n` result formats.
    fn parse_and_bind(n: u16, len: i32) -> (Vec<u8>, Vec<u8>) {
        let mut parse = b"s\0SELECT 1\0".to_vec();
        parse.extend_from_slice(&n.to_be_bytes());
        for _ in 0..n {
            parse.extend_from_slice(&23u32.to_be_bytes());
        }
        let mut bind = b"\0s\0".to_vec();
        bind.extend_from_slice(&n.to_be_bytes());
        bind.extend(std::iter::repeat_n([0u8, 0], n.into()).flatten());
        bind.extend_from_slice(&n.to_be_bytes());
        for _ in 0..n {
            bind.extend_from_slice(&len.to_be_bytes());
            bind.extend(std::iter::repeat_n(b'v', len.max(0) as usize));
        }
        bind.extend_from_slice(&n.to_be_bytes());
        bind.extend(std::iter::repeat_n([0u8, 1], n.into()).flatten());
        (parse, bind)
    }

    /// The counts are unsigned 16-bit integers: PostgreSQL takes up to 65,535 parameters.
    #[test]
    fn counts_up_to_65535_pass() {
        for n in [0, 1, 255, 32767, 32768, 65535] {
            let (parse, bind) = parse_and_bind(n, -1);
            assert_eq!(validate(tag::PARSE, &parse), Ok(()), "Parse with {n}");
            assert_eq!(validate(tag::BIND, &bind), Ok(()), "Bind with {n}");
        }
    }

    proptest! {
        /// Any count and value length: the message passes whole, and fails one byte short or
        /// one byte long.
        #[test]
        fn counts_are_read_whole_at_any_size(n in prop_oneof![0u16..300, 65000u16..=65535], len in -1i32..4) {
            let (parse, bind) = parse_and_bind(n, len);
            prop_assert_eq!(validate(tag::PARSE, &parse), Ok(()));
            prop_assert_eq!(validate(tag::BIND, &bind), Ok(()));
            prop_assert!(validate(tag::PARSE, &parse[..parse.len() - 1]).is_err());
            prop_assert!(validate(tag::BIND, &bind[..bind.len() - 1]).is_err());
            let mut longer = bind.clone();
            longer.push(0);
            prop_assert!(validate(tag::BIND, &longer).is_err());
        }

        /// Any tag and body: validation answers without panicking.
        #[test]
        fn validate_accepts_any_input(tag in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = validate(tag, &body);
        }
    }
}
