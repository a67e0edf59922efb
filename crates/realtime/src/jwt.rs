//! A tenant's JWTs: signed with its secret (HS256, HS384 or HS512) or with a key of its
//! JWKS picked by the token's `kid` (RS*, PS*, ES256/384, EdDSA; an `oct` key for HS*),
//! unexpired, and carrying `role` and `exp`.
//!
//! The errors carry Supabase Realtime's texts, since clients and operators match on them.

use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum JwtError {
    #[error("The token provided is not a valid JWT")]
    Malformed,
    #[error("Failed to validate JWT signature")]
    Signature,
    #[error("Token has expired {0} seconds ago")]
    Expired(i64),
    #[error("Fields `role` and `exp` are required in JWT")]
    MissingClaims,
    #[error("Failed to generate JWT signer for key ID (kid) {0:?}, check your JWT secret or JWKS configuration")]
    NoKey(String),
    #[error("Failed to generate JWT signer, check your JWT secret or JWKS configuration")]
    NoSigner,
}

/// What a verified token says.
#[derive(Debug, Clone)]
pub struct Claims {
    pub role: String,
    /// Seconds since the epoch after which the token is refused.
    pub exp: i64,
    pub all: serde_json::Value,
}

/// A tenant's means of checking tokens: its secret, its JWKS, or both.
#[derive(Default)]
pub struct Verifier {
    secret: Option<Vec<u8>>,
    keys: Vec<Jwk>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("keys", &self.keys.len())
            .finish()
    }
}

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl Verifier {
    /// Keys that do not parse as JWKs are left out (the API refuses a JWKS without keys).
    pub fn new(secret: Option<&str>, jwks: Option<&serde_json::Value>) -> Verifier {
        let keys = jwks
            .and_then(|j| j.get("keys"))
            .and_then(|k| k.as_array())
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| serde_json::from_value::<Jwk>(k.clone()).ok())
                    .collect()
            })
            .unwrap_or_default();
        Verifier {
            secret: secret.map(|s| s.as_bytes().to_vec()),
            keys,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.secret.is_none() && self.keys.is_empty()
    }

    /// The claims of `token`, when one of the tenant's keys signed it and it is in force
    /// at `now` (seconds since the epoch; no leeway, as Realtime).
    pub fn verify(&self, token: &str, now: i64) -> Result<Claims, JwtError> {
        let token = token.trim();
        let header = jsonwebtoken::decode_header(token).map_err(|_| JwtError::Malformed)?;
        let key = self.key_for(header.alg, header.kid.as_deref())?;
        let mut v = Validation::new(header.alg);
        // Expiry is checked below, to say by how much, as Realtime does.
        v.validate_exp = false;
        v.required_spec_claims.clear();
        v.validate_aud = false;
        let data = jsonwebtoken::decode::<serde_json::Value>(token, &key, &v).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind as K;
            match e.kind() {
                K::InvalidSignature | K::InvalidAlgorithm | K::InvalidKeyFormat => {
                    JwtError::Signature
                }
                _ => JwtError::Malformed,
            }
        })?;
        let claims = data.claims;
        let role = claims.get("role").and_then(|r| r.as_str());
        let exp = claims.get("exp").and_then(|e| e.as_f64());
        let (Some(role), Some(exp)) = (role, exp) else {
            return Err(JwtError::MissingClaims);
        };
        let exp = exp.round() as i64;
        if exp <= now {
            return Err(JwtError::Expired(now - exp));
        }
        Ok(Claims {
            role: role.to_owned(),
            exp,
            all: claims,
        })
    }

    fn key_for(&self, alg: Algorithm, kid: Option<&str>) -> Result<DecodingKey, JwtError> {
        use Algorithm as A;
        let hmac = matches!(alg, A::HS256 | A::HS384 | A::HS512);
        let jwk = kid.and_then(|kid| {
            self.keys.iter().find(|k| {
                k.common.key_id.as_deref() == Some(kid)
                    && match (&k.algorithm, alg) {
                        (AlgorithmParameters::RSA(_), A::RS256 | A::RS384 | A::RS512)
                        | (AlgorithmParameters::RSA(_), A::PS256 | A::PS384 | A::PS512)
                        | (AlgorithmParameters::EllipticCurve(_), A::ES256 | A::ES384)
                        | (AlgorithmParameters::OctetKeyPair(_), A::EdDSA) => true,
                        (AlgorithmParameters::OctetKey(_), _) => hmac,
                        _ => false,
                    }
            })
        });
        if let Some(jwk) = jwk {
            return DecodingKey::from_jwk(jwk)
                .map_err(|_| JwtError::NoKey(kid.unwrap_or_default().to_owned()));
        }
        match (hmac, &self.secret, kid) {
            // Supabase Auth's HS256 tokens carry a `kid` with no JWK for it: the secret.
            (true, Some(secret), _) => Ok(DecodingKey::from_secret(secret)),
            (false, _, Some(kid)) => Err(JwtError::NoKey(kid.to_owned())),
            _ => Err(JwtError::NoSigner),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};

    const JWKS: &str = include_str!("../testdata/jwks.json");

    fn token(
        alg: Algorithm,
        kid: Option<&str>,
        key: &EncodingKey,
        claims: serde_json::Value,
    ) -> String {
        let mut h = Header::new(alg);
        h.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&h, &claims, key).unwrap()
    }

    fn good() -> serde_json::Value {
        serde_json::json!({"role": "authenticated", "exp": now() + 3600})
    }

    #[test]
    fn secrets_sign_hs_tokens_checked_for_expiry_and_claims() {
        let v = Verifier::new(Some("s3cret"), None);
        let key = EncodingKey::from_secret(b"s3cret");
        for alg in [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512] {
            let c = v.verify(&token(alg, None, &key, good()), now()).unwrap();
            assert_eq!(c.role, "authenticated");
        }
        // Supabase Auth's tokens name a kid that has no JWK: the secret verifies them.
        assert!(v
            .verify(&token(Algorithm::HS256, Some("x"), &key, good()), now())
            .is_ok());
        let other = EncodingKey::from_secret(b"other");
        assert_eq!(
            v.verify(&token(Algorithm::HS256, None, &other, good()), now())
                .unwrap_err(),
            JwtError::Signature
        );
        let old = serde_json::json!({"role": "anon", "exp": 1000});
        let t = token(Algorithm::HS256, None, &key, old);
        assert_eq!(v.verify(&t, 1010).unwrap_err(), JwtError::Expired(10));
        assert_eq!(
            v.verify(&t, 1010).unwrap_err().to_string(),
            "Token has expired 10 seconds ago"
        );
        for claims in [
            serde_json::json!({"exp": now() + 60}),
            serde_json::json!({"role": "anon"}),
        ] {
            let t = token(Algorithm::HS256, None, &key, claims);
            assert_eq!(v.verify(&t, now()).unwrap_err(), JwtError::MissingClaims);
        }
        assert_eq!(
            v.verify("not.a.jwt", now()).unwrap_err(),
            JwtError::Malformed
        );
        assert_eq!(v.verify("", now()).unwrap_err(), JwtError::Malformed);
    }

    #[test]
    fn jwks_keys_are_picked_by_kid_and_family() {
        let jwks: serde_json::Value = serde_json::from_str(JWKS).unwrap();
        let v = Verifier::new(None, Some(&jwks));
        let ec =
            EncodingKey::from_ec_pem(include_bytes!("../testdata/es256-test-key.pem")).unwrap();
        let ed =
            EncodingKey::from_ed_pem(include_bytes!("../testdata/ed25519-test-key.pem")).unwrap();
        let rsa =
            EncodingKey::from_rsa_pem(include_bytes!("../testdata/rs256-test-key.pem")).unwrap();
        let oct = EncodingKey::from_secret(b"oct-key-secret-for-tests");
        for (alg, kid, key) in [
            (Algorithm::ES256, "ec-1", &ec),
            (Algorithm::EdDSA, "ed-1", &ed),
            (Algorithm::RS256, "rsa-1", &rsa),
            (Algorithm::RS512, "rsa-1", &rsa),
            (Algorithm::PS256, "rsa-1", &rsa),
            (Algorithm::HS256, "hs-1", &oct),
        ] {
            let t = token(alg, Some(kid), key, good());
            assert!(v.verify(&t, now()).is_ok(), "{alg:?} {kid}");
        }
        // An unknown kid, a key of another family, and no kid at all.
        let t = token(Algorithm::ES256, Some("nope"), &ec, good());
        assert_eq!(
            v.verify(&t, now()).unwrap_err(),
            JwtError::NoKey("nope".into())
        );
        let t = token(Algorithm::ES256, Some("rsa-1"), &ec, good());
        assert_eq!(
            v.verify(&t, now()).unwrap_err(),
            JwtError::NoKey("rsa-1".into())
        );
        let t = token(Algorithm::ES256, None, &ec, good());
        assert_eq!(v.verify(&t, now()).unwrap_err(), JwtError::NoSigner);
        // Signed by another key under a known kid.
        let t = token(
            Algorithm::HS256,
            Some("hs-1"),
            &EncodingKey::from_secret(b"x"),
            good(),
        );
        assert_eq!(v.verify(&t, now()).unwrap_err(), JwtError::Signature);
        // No secret: HS tokens without a JWK are refused.
        let t = token(Algorithm::HS256, None, &oct, good());
        assert_eq!(v.verify(&t, now()).unwrap_err(), JwtError::NoSigner);
    }
}
