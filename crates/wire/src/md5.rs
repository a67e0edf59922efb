//! PostgreSQL's MD5 password scheme: the stored secret is `"md5" + md5(password + user)`, and
//! on the wire the client sends `"md5" + md5(hex(stored) + salt)`.

use md5::{Digest, Md5};

fn hex_md5(parts: &[&[u8]]) -> String {
    let mut h = Md5::new();
    for p in parts {
        h.update(p);
    }
    let digest = h.finalize();
    let mut out = String::with_capacity(32);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The stored form of a password: `md5` followed by 32 hex digits.
pub fn stored_secret(user: &str, password: &str) -> String {
    format!("md5{}", hex_md5(&[password.as_bytes(), user.as_bytes()]))
}

/// What a client answers to AuthenticationMD5Password, given the stored secret.
pub fn salted_response(stored: &str, salt: [u8; 4]) -> String {
    let inner = stored.strip_prefix("md5").unwrap_or(stored);
    format!("md5{}", hex_md5(&[inner.as_bytes(), &salt]))
}

/// Whether a string has the shape of a stored MD5 secret.
pub fn is_stored_secret(s: &str) -> bool {
    s.len() == 35 && s.starts_with("md5") && s[3..].bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_postgres() {
        // md5("secret" + "alice"), as PostgreSQL computes it
        assert_eq!(
            stored_secret("alice", "secret"),
            "md54a0a68b43b6cd5cf266fa02f196e2371"
        );
        assert!(is_stored_secret(&stored_secret("a", "b")));
        let r = salted_response(&stored_secret("alice", "secret"), [1, 2, 3, 4]);
        assert_eq!(r.len(), 35);
    }
}
