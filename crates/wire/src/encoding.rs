//! The client encoding a statement is written in, as PostgreSQL reads it.
//!
//! PostgreSQL converts a client's text to the server's encoding before it scans a single
//! character, so the characters it sees depend on `client_encoding`. In most encodings that
//! changes nothing for a scanner: every byte below 0x80 is an ASCII character. In the
//! client-only encodings SJIS, SHIFT_JIS_2004, BIG5, GBK, UHC, GB18030 and JOHAB it does:
//! the second byte of a two-byte character may be `\`, `[`, a letter or (JOHAB) `;`, so a
//! scanner of bytes takes `E'\x83\x5c'` for an escaped quote where PostgreSQL sees one
//! character and the end of the string. Everything in Shoal that reads SQL asks this module
//! how long a character is and how to get the text as UTF-8; what it cannot read (an
//! encoding it has no table for, bytes that are not characters, an encoding not known yet)
//! it says so, and the reader fails closed.

use std::borrow::Cow;

/// How a session's SQL text is to be read: one of PostgreSQL's client encodings (two bytes,
/// so a session can hold it for nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ClientEncoding {
    /// UTF8 (and SQL_ASCII, whose bytes the server checks as its own encoding).
    #[default]
    Utf8,
    /// LATIN1: each byte is the code point of the same number.
    Latin1,
    /// An encoding in which every byte below 0x80 is ASCII (LATIN*, WIN*, ISO_8859_*, KOI8*,
    /// EUC_*, MULE_INTERNAL): bytes give the structure; the table gives names, where
    /// Shoal has one.
    AsciiSafe(Table),
    /// An encoding whose characters' trailing bytes may be ASCII bytes.
    Split(Split),
    /// Not known: a change of `client_encoding` may be on its way, or the name was not
    /// recognised. Only ASCII text can be read.
    Unknown,
}

/// The ASCII-safe encodings other than UTF8 and LATIN1, by the table that decodes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    Iso8859_2,
    Iso8859_3,
    Iso8859_4,
    Iso8859_5,
    Iso8859_6,
    Iso8859_7,
    Iso8859_8,
    Iso8859_10,
    Iso8859_13,
    Iso8859_14,
    Iso8859_15,
    Iso8859_16,
    Koi8R,
    Koi8U,
    Ibm866,
    Win874,
    Win1250,
    Win1251,
    Win1252,
    Win1253,
    Win1254,
    Win1255,
    Win1256,
    Win1257,
    Win1258,
    EucJp,
    EucKr,
    /// EUC_CN is GB2312, which GBK contains.
    EucCn,
    /// LATIN5 (ISO 8859-9: the WHATWG tables read it as windows-1254, which differs in
    /// 0x80-0x9F), EUC_TW, EUC_JIS_2004, MULE_INTERNAL: no table here.
    None,
}

/// The client-only encodings whose characters' trailing bytes may be ASCII bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Sjis,
    ShiftJis2004,
    Big5,
    Gbk,
    Uhc,
    Gb18030,
    Johab,
}

/// Why a text cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error("the client's encoding is not known at this point (a change of client_encoding may be on its way)")]
    UnknownEncoding,
    #[error("the text is not valid in the client's encoding")]
    Invalid,
    #[error("Shoal has no table for the client's encoding")]
    NoTable,
}

impl ClientEncoding {
    /// The encoding PostgreSQL calls `name` (its canonical names, as ParameterStatus
    /// reports them, and the aliases clients send; case and punctuation ignored).
    pub fn from_name(name: &str) -> ClientEncoding {
        let key: String = name
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .map(|c| c.to_ascii_lowercase())
            .collect();
        use ClientEncoding::{AsciiSafe as A, Split as S};
        match key.as_str() {
            "utf8" | "unicode" | "sqlascii" => ClientEncoding::Utf8,
            "latin1" | "iso88591" => ClientEncoding::Latin1,
            "sjis" | "shiftjis" | "mskanji" | "win932" | "windows932" => S(Split::Sjis),
            "shiftjis2004" => S(Split::ShiftJis2004),
            "big5" | "win950" | "windows950" => S(Split::Big5),
            "gbk" | "win936" | "windows936" => S(Split::Gbk),
            "uhc" | "win949" | "windows949" => S(Split::Uhc),
            "gb18030" => S(Split::Gb18030),
            "johab" => S(Split::Johab),
            "latin2" | "iso88592" => A(Table::Iso8859_2),
            "latin3" | "iso88593" => A(Table::Iso8859_3),
            "latin4" | "iso88594" => A(Table::Iso8859_4),
            "latin6" | "iso885910" => A(Table::Iso8859_10),
            "latin7" | "iso885913" => A(Table::Iso8859_13),
            "latin8" | "iso885914" => A(Table::Iso8859_14),
            "latin9" | "iso885915" => A(Table::Iso8859_15),
            "latin10" | "iso885916" => A(Table::Iso8859_16),
            "iso88595" => A(Table::Iso8859_5),
            "iso88596" => A(Table::Iso8859_6),
            "iso88597" => A(Table::Iso8859_7),
            "iso88598" => A(Table::Iso8859_8),
            "koi8r" | "koi8" => A(Table::Koi8R),
            "koi8u" => A(Table::Koi8U),
            "win866" | "alt" => A(Table::Ibm866),
            "win874" => A(Table::Win874),
            "win1250" => A(Table::Win1250),
            "win1251" | "win" => A(Table::Win1251),
            "win1252" => A(Table::Win1252),
            "win1253" => A(Table::Win1253),
            "win1254" => A(Table::Win1254),
            "win1255" => A(Table::Win1255),
            "win1256" => A(Table::Win1256),
            "win1257" => A(Table::Win1257),
            "win1258" => A(Table::Win1258),
            "eucjp" => A(Table::EucJp),
            "euckr" => A(Table::EucKr),
            "euccn" => A(Table::EucCn),
            "latin5" | "iso88599" | "euctw" | "eucjis2004" | "muleinternal" => A(Table::None),
            _ => ClientEncoding::Unknown,
        }
    }

    /// How a session on a server reads text: the server reads bytes as they come when its
    /// database is SQL_ASCII, whatever `client_encoding` says.
    pub fn of_session(client_encoding: Option<&str>, server_encoding: Option<&str>) -> Self {
        if server_encoding.is_some_and(|s| s.eq_ignore_ascii_case("SQL_ASCII")) {
            return ClientEncoding::Utf8;
        }
        client_encoding.map_or(ClientEncoding::Utf8, ClientEncoding::from_name)
    }

    /// Whether a byte below 0x80 is always an ASCII character in this encoding.
    pub fn ascii_safe(self) -> bool {
        !matches!(self, ClientEncoding::Split(_) | ClientEncoding::Unknown)
    }

    /// The length in bytes of the character starting with `lead` (followed by `next`), as
    /// PostgreSQL's `pg_encoding_mblen` counts it. Always at least 1.
    #[inline]
    pub fn char_len(self, lead: u8, next: Option<u8>) -> usize {
        if lead < 0x80 {
            return 1;
        }
        match self {
            ClientEncoding::Split(s) => s.char_len(lead, next),
            _ => 1,
        }
    }

    /// Whether a scanner of bytes reads `text` as PostgreSQL reads it: true for any ASCII
    /// text, and for any text in an ASCII-safe encoding.
    pub fn bytes_are_characters(self, text: &[u8]) -> bool {
        self.ascii_safe() || text.is_ascii()
    }

    /// `text` as the UTF-8 bytes the server's scanner will see: the text itself when it is
    /// UTF-8 already or ASCII (no copy), else decoded. What a memo of texts is keyed by, so
    /// that the same bytes in two encodings are never taken for one statement.
    pub fn as_utf8(self, text: &[u8]) -> Result<Cow<'_, [u8]>, Unreadable> {
        if self == ClientEncoding::Utf8 || text.is_ascii() {
            return Ok(Cow::Borrowed(text));
        }
        Ok(match self.decode(text)? {
            Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
            Cow::Owned(s) => Cow::Owned(s.into_bytes()),
        })
    }

    /// `text` as UTF-8, as the server's scanner will see it (for a parser that needs
    /// `str`), or why it cannot be had.
    pub fn decode(self, text: &[u8]) -> Result<Cow<'_, str>, Unreadable> {
        if let Ok(ascii) = std::str::from_utf8(text) {
            if text.is_ascii() || self == ClientEncoding::Utf8 {
                // ASCII is ASCII in every encoding PostgreSQL knows.
                return Ok(Cow::Borrowed(ascii));
            }
        }
        let table = match self {
            // Bytes that are not UTF-8 are refused by the server before it parses anything;
            // replacing them keeps the structure it would have seen.
            ClientEncoding::Utf8 => return Ok(String::from_utf8_lossy(text)),
            ClientEncoding::Latin1 => {
                return Ok(Cow::Owned(text.iter().map(|&b| b as char).collect()))
            }
            ClientEncoding::Unknown => return Err(Unreadable::UnknownEncoding),
            ClientEncoding::AsciiSafe(t) => t.table(),
            ClientEncoding::Split(s) => s.table(),
        };
        table
            .ok_or(Unreadable::NoTable)?
            .decode_without_bom_handling_and_without_replacement(text)
            .ok_or(Unreadable::Invalid)
    }
}

impl Table {
    fn table(self) -> Option<&'static encoding_rs::Encoding> {
        use encoding_rs as e;
        Some(match self {
            Table::Iso8859_2 => e::ISO_8859_2,
            Table::Iso8859_3 => e::ISO_8859_3,
            Table::Iso8859_4 => e::ISO_8859_4,
            Table::Iso8859_5 => e::ISO_8859_5,
            Table::Iso8859_6 => e::ISO_8859_6,
            Table::Iso8859_7 => e::ISO_8859_7,
            Table::Iso8859_8 => e::ISO_8859_8,
            Table::Iso8859_10 => e::ISO_8859_10,
            Table::Iso8859_13 => e::ISO_8859_13,
            Table::Iso8859_14 => e::ISO_8859_14,
            Table::Iso8859_15 => e::ISO_8859_15,
            Table::Iso8859_16 => e::ISO_8859_16,
            Table::Koi8R => e::KOI8_R,
            Table::Koi8U => e::KOI8_U,
            Table::Ibm866 => e::IBM866,
            Table::Win874 => e::WINDOWS_874,
            Table::Win1250 => e::WINDOWS_1250,
            Table::Win1251 => e::WINDOWS_1251,
            Table::Win1252 => e::WINDOWS_1252,
            Table::Win1253 => e::WINDOWS_1253,
            Table::Win1254 => e::WINDOWS_1254,
            Table::Win1255 => e::WINDOWS_1255,
            Table::Win1256 => e::WINDOWS_1256,
            Table::Win1257 => e::WINDOWS_1257,
            Table::Win1258 => e::WINDOWS_1258,
            Table::EucJp => e::EUC_JP,
            Table::EucKr => e::EUC_KR,
            Table::EucCn => e::GBK,
            Table::None => return None,
        })
    }
}

impl Split {
    #[inline]
    fn char_len(self, lead: u8, next: Option<u8>) -> usize {
        match self {
            // Half-width katakana are one byte.
            Split::Sjis | Split::ShiftJis2004 if (0xa1..=0xdf).contains(&lead) => 1,
            Split::Gb18030 if next.is_some_and(|b| b.is_ascii_digit()) => 4,
            // JOHAB counts as EUC does: SS3 starts three bytes.
            Split::Johab if lead == 0x8f => 3,
            _ => 2,
        }
    }

    fn table(self) -> Option<&'static encoding_rs::Encoding> {
        Some(match self {
            Split::Sjis => encoding_rs::SHIFT_JIS,
            Split::Big5 => encoding_rs::BIG5,
            Split::Gbk => encoding_rs::GBK,
            // Unified Hangul Code is what the WHATWG tables call EUC-KR (windows-949).
            Split::Uhc => encoding_rs::EUC_KR,
            Split::Gb18030 => encoding_rs::GB18030,
            Split::ShiftJis2004 | Split::Johab => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_postgresql_spells_them() {
        assert_eq!(ClientEncoding::from_name("UTF8"), ClientEncoding::Utf8);
        assert_eq!(ClientEncoding::from_name("utf-8"), ClientEncoding::Utf8);
        assert_eq!(
            ClientEncoding::from_name("SJIS"),
            ClientEncoding::Split(Split::Sjis)
        );
        assert_eq!(
            ClientEncoding::from_name("Shift_JIS"),
            ClientEncoding::Split(Split::Sjis)
        );
        assert_eq!(
            ClientEncoding::from_name("BIG5"),
            ClientEncoding::Split(Split::Big5)
        );
        assert_eq!(
            ClientEncoding::from_name("GB18030"),
            ClientEncoding::Split(Split::Gb18030)
        );
        assert_eq!(ClientEncoding::from_name("LATIN1"), ClientEncoding::Latin1);
        assert_eq!(
            ClientEncoding::from_name("WIN1252"),
            ClientEncoding::AsciiSafe(Table::Win1252)
        );
        assert_eq!(
            ClientEncoding::from_name("EUC_JP"),
            ClientEncoding::AsciiSafe(Table::EucJp)
        );
        assert!(std::mem::size_of::<ClientEncoding>() <= 2);
        assert_eq!(
            ClientEncoding::from_name("KLINGON"),
            ClientEncoding::Unknown
        );
        assert_eq!(
            ClientEncoding::of_session(Some("SJIS"), Some("SQL_ASCII")),
            ClientEncoding::Utf8,
            "a SQL_ASCII database reads bytes"
        );
    }

    #[test]
    fn characters_are_as_long_as_postgresql_counts_them() {
        let sjis = ClientEncoding::Split(Split::Sjis);
        assert_eq!(sjis.char_len(0x83, Some(0x5c)), 2);
        assert_eq!(sjis.char_len(0xb1, Some(0x5c)), 1, "half-width katakana");
        assert_eq!(sjis.char_len(b'\\', None), 1);
        let gb = ClientEncoding::Split(Split::Gb18030);
        assert_eq!(gb.char_len(0x81, Some(0x30)), 4);
        assert_eq!(gb.char_len(0x81, Some(0x40)), 2);
        assert_eq!(ClientEncoding::Utf8.char_len(0xe3, Some(0x81)), 1);
    }

    #[test]
    fn text_decodes_or_says_why_not() {
        let sjis = ClientEncoding::Split(Split::Sjis);
        // "ソ" is 0x83 0x5C in Shift JIS: one character, no backslash.
        assert_eq!(sjis.decode(b"E'\x83\x5c'").unwrap(), "E'ソ'");
        assert_eq!(
            sjis.decode(b"\x83"),
            Err(Unreadable::Invalid),
            "a lone lead byte"
        );
        assert_eq!(ClientEncoding::Latin1.decode(b"caf\xe9").unwrap(), "café");
        assert_eq!(
            ClientEncoding::Unknown.decode(b"SELECT 1").unwrap(),
            "SELECT 1"
        );
        assert_eq!(
            ClientEncoding::Unknown.decode(b"SELECT '\xe9'"),
            Err(Unreadable::UnknownEncoding)
        );
        assert_eq!(
            ClientEncoding::Split(Split::Johab).decode(b"\x88\x61"),
            Err(Unreadable::NoTable)
        );
    }
}
