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

pub fn query(buf: &mut BytesMut, sql: &str) {
    put_message(buf, tag::QUERY, |b| put_cstr(b, sql));
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

/// The text of a simple Query message.
pub fn parse_query(body: &[u8]) -> Result<&str, FrameError> {
    Reader::new(body).cstr()
}
