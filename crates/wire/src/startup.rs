//! The first packet of a connection, which has no tag byte: a length word, a request code,
//! then a body that depends on the code.

use crate::frame::{FrameError, Reader};

/// PostgreSQL refuses startup packets longer than this; so do we.
pub const MAX_STARTUP_LEN: usize = 10_000;

pub const SSL_REQUEST_CODE: i32 = 80_877_103;
pub const GSSENC_REQUEST_CODE: i32 = 80_877_104;
pub const CANCEL_REQUEST_CODE: i32 = 80_877_102;
/// Protocol 3.0 as a request code: major in the high 16 bits, minor in the low.
pub const PROTOCOL_3_0: i32 = 3 << 16;

/// First byte of a TLS record (handshake): a client using PostgreSQL 17's
/// `sslnegotiation=direct` sends this instead of an SSLRequest.
pub const TLS_HANDSHAKE_BYTE: u8 = 0x16;

/// A decoded first packet.
#[derive(Debug, PartialEq, Eq)]
pub enum StartupPacket {
    Ssl,
    GssEnc,
    Cancel { process_id: i32, secret_key: i32 },
    Startup(StartupMessage),
}

/// A StartupMessage: protocol version and parameters in the order the client sent them.
#[derive(Debug, PartialEq, Eq, Default)]
pub struct StartupMessage {
    pub major: u16,
    pub minor: u16,
    pub params: Vec<(String, String)>,
}

impl StartupMessage {
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a first packet was refused; each maps to a FATAL error for the client.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StartupError {
    #[error("invalid length of startup packet ({0} bytes)")]
    BadLength(usize),
    #[error("unsupported frontend protocol {major}.{minor}: server supports 3.0")]
    UnsupportedProtocol { major: u16, minor: u16 },
    #[error("invalid startup packet layout: {0}")]
    Malformed(&'static str),
}

impl From<FrameError> for StartupError {
    fn from(_: FrameError) -> Self {
        StartupError::Malformed("expected a NUL-terminated string")
    }
}

/// Length of the first packet once its length word is buffered. The length is checked so a
/// client cannot announce a huge packet and make us wait for or buffer it.
pub fn startup_len(buf: &[u8]) -> Result<Option<usize>, StartupError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(8..=MAX_STARTUP_LEN).contains(&len) {
        return Err(StartupError::BadLength(len));
    }
    Ok(Some(len))
}

/// Decodes one complete first packet (length word included).
pub fn parse_startup(packet: &[u8]) -> Result<StartupPacket, StartupError> {
    let mut r = Reader::new(packet);
    let len = r.i32()? as usize;
    if len != packet.len() {
        return Err(StartupError::BadLength(len));
    }
    let code = r.i32()?;
    match code {
        SSL_REQUEST_CODE if len == 8 => Ok(StartupPacket::Ssl),
        GSSENC_REQUEST_CODE if len == 8 => Ok(StartupPacket::GssEnc),
        CANCEL_REQUEST_CODE if len == 16 => Ok(StartupPacket::Cancel {
            process_id: r.i32()?,
            secret_key: r.i32()?,
        }),
        SSL_REQUEST_CODE | GSSENC_REQUEST_CODE | CANCEL_REQUEST_CODE => {
            Err(StartupError::BadLength(len))
        }
        _ => {
            let major = (code >> 16) as u16;
            let minor = (code & 0xffff) as u16;
            if major != 3 {
                return Err(StartupError::UnsupportedProtocol { major, minor });
            }
            let mut params = Vec::new();
            loop {
                let name = r.cstr()?;
                if name.is_empty() {
                    break;
                }
                let value = r.cstr()?;
                params.push((name.to_owned(), value.to_owned()));
            }
            if r.remaining() != 0 {
                return Err(StartupError::Malformed("bytes after the parameter list"));
            }
            Ok(StartupPacket::Startup(StartupMessage {
                major,
                minor,
                params,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend;
    use bytes::BytesMut;

    #[test]
    fn round_trips_a_startup_message() {
        let mut buf = BytesMut::new();
        frontend::startup(&mut buf, &[("user", "alice"), ("database", "db")]);
        assert_eq!(startup_len(&buf).unwrap(), Some(buf.len()));
        let StartupPacket::Startup(m) = parse_startup(&buf).unwrap() else {
            panic!("not a startup")
        };
        assert_eq!((m.major, m.minor), (3, 0));
        assert_eq!(m.param("user"), Some("alice"));
        assert_eq!(m.param("database"), Some("db"));
    }

    #[test]
    fn recognises_requests() {
        let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        assert_eq!(parse_startup(&ssl).unwrap(), StartupPacket::Ssl);
        let mut cancel = vec![0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
        cancel.extend_from_slice(&7i32.to_be_bytes());
        cancel.extend_from_slice(&9i32.to_be_bytes());
        assert_eq!(
            parse_startup(&cancel).unwrap(),
            StartupPacket::Cancel {
                process_id: 7,
                secret_key: 9
            }
        );
    }

    #[test]
    fn refuses_bad_versions_and_lengths() {
        let v2 = [0, 0, 0, 9, 0, 2, 0, 0, 0];
        assert!(matches!(
            parse_startup(&v2),
            Err(StartupError::UnsupportedProtocol { major: 2, .. })
        ));
        assert!(startup_len(&[0, 0, 0, 3]).is_err());
        assert!(startup_len(&[0, 1, 0, 0]).is_err());
        let unterminated = [0, 0, 0, 12, 0, 3, 0, 0, b'u', b's', b'e', b'r'];
        assert!(parse_startup(&unterminated).is_err());
    }

    #[test]
    fn accepts_minor_versions_for_negotiation() {
        let mut buf = BytesMut::new();
        frontend::startup(&mut buf, &[("user", "u")]);
        buf[7] = 2; // 3.2
        let StartupPacket::Startup(m) = parse_startup(&buf).unwrap() else {
            panic!()
        };
        assert_eq!(m.minor, 2);
    }
}
