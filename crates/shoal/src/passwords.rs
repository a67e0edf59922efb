//! Passwords checked lately, remembered so that a client that logs in again and again
//! (a serverless function's every HTTP query) does not pay PBKDF2 each time; and the keyed
//! digest that keys credentials here and in the serverless front door's kept sessions.

use crate::config::ClientAuth;

/// Passwords checked in cleartext lately, by a keyed digest of user, secret and password:
/// a serverless function logs in for every HTTP query, and checking a SCRAM verifier costs
/// PBKDF2 (about a millisecond of a core, by design), which would be most of the query's
/// time. Only successes are kept, for a few minutes; a changed secret changes the key, so
/// an old password stops working at once. The digest's key is random per process, so the
/// table says nothing about the passwords.
pub struct PasswordMemo {
    salt: [u8; 32],
    checked: moka::sync::Cache<[u8; 32], Option<[u8; 32]>>,
}

impl Default for PasswordMemo {
    fn default() -> Self {
        let mut salt = [0u8; 32];
        rand::fill(&mut salt[..]);
        PasswordMemo {
            salt,
            checked: moka::sync::Cache::builder()
                .max_capacity(10_000)
                .time_to_live(std::time::Duration::from_secs(300))
                .build(),
        }
    }
}

impl PasswordMemo {
    pub fn key(&self, user: &str, auth: &ClientAuth, password: &str) -> [u8; 32] {
        let iterations;
        let secret: Vec<&[u8]> = match auth {
            ClientAuth::Scram(v) => {
                iterations = v.iterations.to_be_bytes();
                vec![b"scram", &iterations, &v.salt, &v.stored_key, &v.server_key]
            }
            ClientAuth::Md5(stored) => vec![b"md5", stored.as_bytes()],
            ClientAuth::Trust | ClientAuth::Cert => vec![b"none"],
        };
        let mut fields = vec![&self.salt[..], user.as_bytes()];
        fields.extend(secret);
        fields.push(password.as_bytes());
        keyed_digest(&fields)
    }

    /// The ClientKey remembered for `key` (`Some(None)`: checked, no SCRAM verifier).
    pub fn get(&self, key: &[u8; 32]) -> Option<Option<[u8; 32]>> {
        self.checked.get(key)
    }

    /// Remembers a password checked with success.
    pub fn insert(&self, key: [u8; 32], client_key: Option<[u8; 32]>) {
        self.checked.insert(key, client_key);
    }
}

/// SHA-256 of `fields`, each preceded by its length so no two lists of fields share a
/// digest: a lookup key for credentials (the first field a random per-process key).
pub fn keyed_digest(fields: &[&[u8]]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for f in fields {
        h.update((f.len() as u64).to_be_bytes());
        h.update(f);
    }
    h.finalize().into()
}
