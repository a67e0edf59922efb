//! Tenant passwords at rest: AES-256-GCM with a random nonce per value, so a copy of the
//! store (a backup, a replica of the metadata database) holds no usable password.

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;

const PREFIX: &str = "enc:v1:";

#[derive(Debug, thiserror::Error)]
pub enum CryptoError {
    #[error("the encryption key must be 32 bytes, as 64 hex digits or base64")]
    BadKey,
    #[error("a stored password cannot be decrypted: wrong encryption key, or a damaged store")]
    Decrypt,
}

/// The key that seals tenant passwords.
#[derive(Clone)]
pub struct Sealer {
    cipher: Aes256Gcm,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A key from text: 64 hex digits, or base64 of 32 bytes.
    pub fn from_text(text: &str) -> Result<Sealer, CryptoError> {
        let t = text.trim();
        let bytes = if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
            (0..32)
                .map(|i| u8::from_str_radix(&t[2 * i..2 * i + 2], 16))
                .collect::<Result<Vec<u8>, _>>()
                .map_err(|_| CryptoError::BadKey)?
        } else {
            base64::engine::general_purpose::STANDARD
                .decode(t)
                .map_err(|_| CryptoError::BadKey)?
        };
        let key: [u8; 32] = bytes.try_into().map_err(|_| CryptoError::BadKey)?;
        Ok(Sealer {
            cipher: Aes256Gcm::new(&key.into()),
        })
    }

    /// A new random key, as text for a key file.
    pub fn generate_text() -> String {
        let mut key = [0u8; 32];
        rand::fill(&mut key[..]);
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    pub fn seal(&self, plain: &str) -> String {
        let mut nonce = [0u8; 12];
        rand::fill(&mut nonce[..]);
        // Encryption with a valid key and nonce cannot fail for inputs this small.
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), plain.as_bytes())
            .unwrap_or_default();
        let mut all = nonce.to_vec();
        all.extend_from_slice(&sealed);
        format!(
            "{PREFIX}{}",
            base64::engine::general_purpose::STANDARD.encode(all)
        )
    }

    pub fn open(&self, sealed: &str) -> Result<String, CryptoError> {
        let b64 = sealed.strip_prefix(PREFIX).ok_or(CryptoError::Decrypt)?;
        let all = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| CryptoError::Decrypt)?;
        if all.len() < 12 + 16 {
            return Err(CryptoError::Decrypt);
        }
        let (nonce, body) = all.split_at(12);
        let plain = self
            .cipher
            .decrypt(Nonce::from_slice(nonce), body)
            .map_err(|_| CryptoError::Decrypt)?;
        String::from_utf8(plain).map_err(|_| CryptoError::Decrypt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seals_and_opens_and_refuses_the_wrong_key() {
        let s = Sealer::from_text(&Sealer::generate_text()).unwrap();
        let a = s.seal("hunter2");
        let b = s.seal("hunter2");
        assert_ne!(a, b, "a fresh nonce each time");
        assert!(!a.contains("hunter2"));
        assert_eq!(s.open(&a).unwrap(), "hunter2");
        let other = Sealer::from_text(&"ab".repeat(32)).unwrap();
        assert!(other.open(&a).is_err());
        assert!(s.open("enc:v1:AAAA").is_err());
        assert!(s.open("plain").is_err());
        assert!(Sealer::from_text("short").is_err());
    }
}
