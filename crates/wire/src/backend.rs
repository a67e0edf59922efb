//! Messages of the server side of the protocol: builders for what Shoal says to clients, and
//! decoders for the few server messages Shoal acts on.

use bytes::{BufMut, BytesMut};

use crate::frame::{FrameError, Reader};

pub mod tag {
    pub const AUTHENTICATION: u8 = b'R';
    pub const BACKEND_KEY_DATA: u8 = b'K';
    pub const PARAMETER_STATUS: u8 = b'S';
    pub const READY_FOR_QUERY: u8 = b'Z';
    pub const ERROR_RESPONSE: u8 = b'E';
    pub const NOTICE_RESPONSE: u8 = b'N';
    pub const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
    pub const COPY_IN_RESPONSE: u8 = b'G';
    pub const COPY_OUT_RESPONSE: u8 = b'H';
    pub const COPY_BOTH_RESPONSE: u8 = b'W';
    pub const COMMAND_COMPLETE: u8 = b'C';
    pub const PARSE_COMPLETE: u8 = b'1';
    pub const BIND_COMPLETE: u8 = b'2';
    pub const CLOSE_COMPLETE: u8 = b'3';
    pub const NOTIFICATION_RESPONSE: u8 = b'A';
    pub const DATA_ROW: u8 = b'D';
    pub const ROW_DESCRIPTION: u8 = b'T';
    pub const NO_DATA: u8 = b'n';
    pub const EMPTY_QUERY_RESPONSE: u8 = b'I';
    pub const PORTAL_SUSPENDED: u8 = b's';
    pub const COPY_DATA: u8 = b'd';
}

/// Writes a tagged message whose body `body` writes; the length word is patched afterwards so
/// callers never compute lengths by hand.
pub fn put_message(buf: &mut BytesMut, tag: u8, body: impl FnOnce(&mut BytesMut)) {
    buf.put_u8(tag);
    let at = buf.len();
    buf.put_i32(0);
    body(buf);
    let len = (buf.len() - at) as i32;
    buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

pub fn put_cstr(buf: &mut BytesMut, s: &str) {
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
}

pub fn authentication_ok(buf: &mut BytesMut) {
    put_message(buf, tag::AUTHENTICATION, |b| b.put_i32(0));
}

pub fn authentication_cleartext_password(buf: &mut BytesMut) {
    put_message(buf, tag::AUTHENTICATION, |b| b.put_i32(3));
}

pub fn authentication_md5(buf: &mut BytesMut, salt: [u8; 4]) {
    put_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(5);
        b.put_slice(&salt);
    });
}

pub fn authentication_sasl(buf: &mut BytesMut, mechanisms: &[&str]) {
    put_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(10);
        for m in mechanisms {
            put_cstr(b, m);
        }
        b.put_u8(0);
    });
}

pub fn authentication_sasl_continue(buf: &mut BytesMut, data: &[u8]) {
    put_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(11);
        b.put_slice(data);
    });
}

pub fn authentication_sasl_final(buf: &mut BytesMut, data: &[u8]) {
    put_message(buf, tag::AUTHENTICATION, |b| {
        b.put_i32(12);
        b.put_slice(data);
    });
}

pub fn parameter_status(buf: &mut BytesMut, name: &str, value: &str) {
    put_message(buf, tag::PARAMETER_STATUS, |b| {
        put_cstr(b, name);
        put_cstr(b, value);
    });
}

pub fn backend_key_data(buf: &mut BytesMut, process_id: i32, secret_key: i32) {
    put_message(buf, tag::BACKEND_KEY_DATA, |b| {
        b.put_i32(process_id);
        b.put_i32(secret_key);
    });
}

pub fn ready_for_query(buf: &mut BytesMut, status: u8) {
    put_message(buf, tag::READY_FOR_QUERY, |b| b.put_u8(status));
}

/// Tells a client asking for a newer minor version (or `_pq_.` options) what we speak.
pub fn negotiate_protocol_version(buf: &mut BytesMut, minor: i32, unrecognized: &[&str]) {
    put_message(buf, tag::NEGOTIATE_PROTOCOL_VERSION, |b| {
        b.put_i32(minor);
        b.put_i32(unrecognized.len() as i32);
        for o in unrecognized {
            put_cstr(b, o);
        }
    });
}

/// Severity of an error Shoal reports: `Error` ends the current query, `Fatal` the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    Error,
    Fatal,
}

/// An ErrorResponse (or NoticeResponse) Shoal composes itself.
pub fn error_response(
    buf: &mut BytesMut,
    severity: Severity,
    code: &str,
    message: &str,
    hint: Option<&str>,
) {
    let sev = match severity {
        Severity::Error => "ERROR",
        Severity::Fatal => "FATAL",
    };
    put_message(buf, tag::ERROR_RESPONSE, |b| {
        for (field, value) in [(b'S', sev), (b'V', sev), (b'C', code), (b'M', message)] {
            b.put_u8(field);
            put_cstr(b, value);
        }
        if let Some(h) = hint {
            b.put_u8(b'H');
            put_cstr(b, h);
        }
        b.put_u8(0);
    });
}

/// The fields of an ErrorResponse Shoal needs to decide what to do with a server connection.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ErrorFields {
    pub severity: String,
    pub code: String,
    pub message: String,
    /// The server function that raised it (`R`): never translated, unlike the message, so
    /// Shoal can recognise an error whatever `lc_messages` says.
    pub routine: String,
}

impl ErrorFields {
    pub fn is_fatal(&self) -> bool {
        self.severity == "FATAL" || self.severity == "PANIC"
    }
}

pub fn parse_error(body: &[u8]) -> Result<ErrorFields, FrameError> {
    let mut r = Reader::new(body);
    let mut e = ErrorFields::default();
    loop {
        let field = r.u8()?;
        if field == 0 {
            return Ok(e);
        }
        // Message texts come in the client's encoding (LATIN9, say): decode what Shoal
        // reads lossily; the bytes themselves are relayed untouched.
        let value = r.cstr_bytes()?;
        let text = || String::from_utf8_lossy(value).into_owned();
        match field {
            b'V' => e.severity = text(),
            b'S' if e.severity.is_empty() => e.severity = text(),
            b'C' => e.code = text(),
            b'M' => e.message = text(),
            b'R' => e.routine = text(),
            _ => {}
        }
    }
}

/// A NotificationResponse's fields: the notifying backend's process id, the channel and the
/// payload (bytes: both come in the client encoding).
#[derive(Debug, PartialEq, Eq)]
pub struct Notification<'a> {
    pub process_id: i32,
    pub channel: &'a [u8],
    pub payload: &'a [u8],
}

pub fn parse_notification(body: &[u8]) -> Result<Notification<'_>, FrameError> {
    let mut r = Reader::new(body);
    let n = Notification {
        process_id: r.i32()?,
        channel: r.cstr_bytes()?,
        payload: r.cstr_bytes()?,
    };
    if !r.rest().is_empty() {
        return Err(FrameError::Malformed("trailing bytes after a notification"));
    }
    Ok(n)
}

pub fn notification_response(buf: &mut BytesMut, process_id: i32, channel: &[u8], payload: &[u8]) {
    put_message(buf, tag::NOTIFICATION_RESPONSE, |b| {
        b.put_i32(process_id);
        b.put_slice(channel);
        b.put_u8(0);
        b.put_slice(payload);
        b.put_u8(0);
    });
}

/// A NoticeResponse at `WARNING` severity: something the client should know that does not
/// fail what it is doing (it may arrive at any time, as PostgreSQL's notices do).
pub fn warning_notice(buf: &mut BytesMut, code: &str, message: &str) {
    put_message(buf, tag::NOTICE_RESPONSE, |b| {
        for (field, value) in [
            (b'S', "WARNING"),
            (b'V', "WARNING"),
            (b'C', code),
            (b'M', message),
        ] {
            b.put_u8(field);
            put_cstr(b, value);
        }
        b.put_u8(0);
    });
}

pub fn parse_parameter_status(body: &[u8]) -> Result<(&str, &str), FrameError> {
    let mut r = Reader::new(body);
    Ok((r.cstr()?, r.cstr()?))
}

/// ParameterStatus as bytes (values such as `application_name` may be in any encoding).
pub fn parse_parameter_status_bytes(body: &[u8]) -> Result<(&[u8], &[u8]), FrameError> {
    let mut r = Reader::new(body);
    Ok((r.cstr_bytes()?, r.cstr_bytes()?))
}

pub fn parse_backend_key_data(body: &[u8]) -> Result<(i32, i32), FrameError> {
    let mut r = Reader::new(body);
    Ok((r.i32()?, r.i32()?))
}

/// One column of a RowDescription.
#[derive(Debug, PartialEq, Eq)]
pub struct FieldDescription<'a> {
    /// In the client encoding.
    pub name: &'a [u8],
    pub table_oid: u32,
    pub column: i16,
    pub type_oid: u32,
    pub type_size: i16,
    pub type_modifier: i32,
    /// 0: text, 1: binary.
    pub format: i16,
}

pub fn parse_row_description(body: &[u8]) -> Result<Vec<FieldDescription<'_>>, FrameError> {
    let mut r = Reader::new(body);
    let n = r.i16()?;
    let mut fields = Vec::with_capacity(n.max(0) as usize);
    for _ in 0..n {
        fields.push(FieldDescription {
            name: r.cstr_bytes()?,
            table_oid: r.i32()? as u32,
            column: r.i16()?,
            type_oid: r.i32()? as u32,
            type_size: r.i16()?,
            type_modifier: r.i32()?,
            format: r.i16()?,
        });
    }
    Ok(fields)
}

/// Calls `each` with every value of a DataRow in order (`None`: NULL).
pub fn for_each_value<'a>(
    body: &'a [u8],
    mut each: impl FnMut(Option<&'a [u8]>),
) -> Result<(), FrameError> {
    let mut r = Reader::new(body);
    let n = r.i16()?;
    for _ in 0..n {
        match r.i32()? {
            -1 => each(None),
            len if len < 0 => return Err(FrameError::Malformed("negative value length")),
            len => each(Some(r.bytes(len as usize)?)),
        }
    }
    Ok(())
}

/// Every field of an ErrorResponse or NoticeResponse, as (field type, value) in the order
/// sent (values in the client encoding).
pub fn error_fields(body: &[u8]) -> Result<Vec<(u8, &[u8])>, FrameError> {
    let mut r = Reader::new(body);
    let mut fields = Vec::new();
    loop {
        match r.u8()? {
            0 => return Ok(fields),
            field => fields.push((field, r.cstr_bytes()?)),
        }
    }
}

/// What an Authentication message asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum AuthRequest<'a> {
    Ok,
    Cleartext,
    Md5 { salt: [u8; 4] },
    Sasl { mechanisms: Vec<&'a str> },
    SaslContinue(&'a [u8]),
    SaslFinal(&'a [u8]),
    Other(i32),
}

pub fn parse_auth(body: &[u8]) -> Result<AuthRequest<'_>, FrameError> {
    let mut r = Reader::new(body);
    Ok(match r.i32()? {
        0 => AuthRequest::Ok,
        3 => AuthRequest::Cleartext,
        5 => {
            let s = r.bytes(4)?;
            AuthRequest::Md5 {
                salt: [s[0], s[1], s[2], s[3]],
            }
        }
        10 => {
            let mut mechanisms = Vec::new();
            loop {
                let m = r.cstr()?;
                if m.is_empty() {
                    break;
                }
                mechanisms.push(m);
            }
            AuthRequest::Sasl { mechanisms }
        }
        11 => AuthRequest::SaslContinue(r.rest()),
        12 => AuthRequest::SaslFinal(r.rest()),
        other => AuthRequest::Other(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::Frame;

    #[test]
    fn error_round_trip() {
        let mut buf = BytesMut::new();
        error_response(&mut buf, Severity::Fatal, "28P01", "bad password", None);
        let f = Frame::split(&mut buf, 1024).unwrap().unwrap();
        assert_eq!(f.tag(), b'E');
        let e = parse_error(f.body()).unwrap();
        assert_eq!(e.code, "28P01");
        assert_eq!(e.message, "bad password");
        assert!(e.is_fatal());
    }

    #[test]
    fn error_text_in_another_encoding_is_read_lossily() {
        let body = b"SERROR\0C22P02\0Mvaleur invalide \xe9\0\0";
        let e = parse_error(body).unwrap();
        assert_eq!(e.code, "22P02");
        assert!(e.message.starts_with("valeur invalide"));
    }

    #[test]
    fn auth_requests_decode() {
        let mut buf = BytesMut::new();
        authentication_sasl(&mut buf, &["SCRAM-SHA-256"]);
        let f = Frame::split(&mut buf, 1024).unwrap().unwrap();
        assert_eq!(
            parse_auth(f.body()).unwrap(),
            AuthRequest::Sasl {
                mechanisms: vec!["SCRAM-SHA-256"]
            }
        );
        assert!(parse_auth(&[0, 0]).is_err());
    }

    #[test]
    fn ready_for_query_is_six_bytes() {
        let mut buf = BytesMut::new();
        ready_for_query(&mut buf, b'I');
        assert_eq!(&buf[..], b"Z\0\0\0\x05I");
    }
}
