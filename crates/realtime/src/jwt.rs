//! A tenant's JWTs: signed with its secret (HS256, HS384 or HS512), unexpired, naming a
//! `role`.

use jsonwebtoken::{Algorithm, DecodingKey, Validation};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    #[error("Invalid JWT: {0}")]
    Invalid(String),
    #[error("Token has expired")]
    Expired,
    #[error("Invalid JWT: the token has no role claim")]
    NoRole,
}

/// The claims of `token`, when `secret` signed it and it is in force.
pub fn verify(token: &str, secret: &str) -> Result<serde_json::Value, JwtError> {
    let header =
        jsonwebtoken::decode_header(token).map_err(|e| JwtError::Invalid(e.to_string()))?;
    if !matches!(
        header.alg,
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512
    ) {
        return Err(JwtError::Invalid(format!(
            "{:?} is not an algorithm this tenant signs with",
            header.alg
        )));
    }
    let mut v = Validation::new(header.alg);
    v.set_required_spec_claims(&["exp"]);
    v.validate_aud = false;
    // An expired token is refused when it expires, as Realtime does.
    v.leeway = 0;
    let data = jsonwebtoken::decode::<serde_json::Value>(
        token,
        &DecodingKey::from_secret(secret.as_bytes()),
        &v,
    )
    .map_err(|e| match e.kind() {
        jsonwebtoken::errors::ErrorKind::ExpiredSignature => JwtError::Expired,
        _ => JwtError::Invalid(e.to_string()),
    })?;
    if !data.claims.get("role").is_some_and(|r| r.is_string()) {
        return Err(JwtError::NoRole);
    }
    Ok(data.claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(alg: Algorithm, secret: &str, claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(alg),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    #[test]
    fn tokens_are_checked_for_signature_expiry_and_role() {
        let later = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 3600;
        let good = serde_json::json!({"role": "authenticated", "exp": later});
        for alg in [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512] {
            assert!(verify(&token(alg, "s3cret", good.clone()), "s3cret").is_ok());
        }
        assert!(matches!(
            verify(&token(Algorithm::HS256, "other", good.clone()), "s3cret"),
            Err(JwtError::Invalid(_))
        ));
        let old = serde_json::json!({"role": "anon", "exp": 1000});
        assert_eq!(
            verify(&token(Algorithm::HS256, "s3cret", old), "s3cret"),
            Err(JwtError::Expired)
        );
        let no_role = serde_json::json!({"exp": later});
        assert_eq!(
            verify(&token(Algorithm::HS256, "s3cret", no_role), "s3cret"),
            Err(JwtError::NoRole)
        );
        let no_exp = serde_json::json!({"role": "anon"});
        assert!(verify(&token(Algorithm::HS256, "s3cret", no_exp), "s3cret").is_err());
        assert!(verify("not.a.jwt", "s3cret").is_err());
    }
}
