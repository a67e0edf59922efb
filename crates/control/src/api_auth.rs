//! Who may use the management API: a bearer JWT signed with HS256 (Supavisor's scheme; `exp`
//! checked when present) or a static token. With neither configured, Shoal makes a token in
//! its data directory (mode 0600) so the API is never open by accident.

use std::path::Path;

use subtle::ConstantTimeEq;

/// The credentials the API accepts.
pub struct ApiAuth {
    jwt: Option<jsonwebtoken::DecodingKey>,
    token: Option<String>,
}

impl std::fmt::Debug for ApiAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiAuth")
            .field("jwt", &self.jwt.is_some())
            .field("token", &self.token.is_some())
            .finish()
    }
}

impl ApiAuth {
    /// From the environment variables `[api]` names; without either, a token made (once)
    /// in `data_dir/api-token`.
    pub fn from_env(
        jwt_env: &str,
        token_env: Option<&str>,
        data_dir: &Path,
    ) -> std::io::Result<ApiAuth> {
        let jwt = std::env::var(jwt_env).ok().filter(|s| !s.is_empty());
        let token = token_env
            .and_then(|e| std::env::var(e).ok())
            .filter(|s| !s.is_empty());
        let token = match (&jwt, token) {
            (None, None) => Some(token_file(data_dir)?),
            (_, t) => t,
        };
        Ok(ApiAuth {
            jwt: jwt.map(|s| jsonwebtoken::DecodingKey::from_secret(s.as_bytes())),
            token,
        })
    }

    /// Whether an `Authorization` header value grants access.
    pub fn allows(&self, header: Option<&str>) -> bool {
        let Some(bearer) = header.and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        }) else {
            return false;
        };
        let bearer = bearer.trim();
        if let Some(t) = &self.token {
            if bool::from(t.as_bytes().ct_eq(bearer.as_bytes())) {
                return true;
            }
        }
        if let Some(key) = &self.jwt {
            let mut v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
            v.required_spec_claims.clear();
            v.validate_aud = false;
            v.leeway = 0;
            return jsonwebtoken::decode::<serde_json::Value>(bearer, key, &v)
                .is_ok_and(|t| registered_claims_valid(&t.claims, unix_now()));
        }
        false
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// RFC 7519's time claims, when present, must be NumericDates (non-negative numbers): one
/// that is a string, null, a boolean, an array or negative is a malformed token, not a token
/// without that claim. `exp` must lie ahead and `nbf` behind (checked here too, whatever the
/// library parsed).
fn registered_claims_valid(claims: &serde_json::Value, now: f64) -> bool {
    let Some(map) = claims.as_object() else {
        return false;
    };
    for name in ["exp", "nbf", "iat"] {
        let Some(v) = map.get(name) else { continue };
        let Some(t) = v.as_f64().filter(|t| t.is_finite() && *t >= 0.0) else {
            return false;
        };
        let ok = match name {
            "exp" => t > now,
            "nbf" => t <= now,
            _ => true,
        };
        if !ok {
            return false;
        }
    }
    true
}

fn token_file(data_dir: &Path) -> std::io::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("api-token");
    match std::fs::read_to_string(&path) {
        Ok(t) if !t.trim().is_empty() => return Ok(t.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        Err(_) => {}
    }
    std::fs::create_dir_all(data_dir)?;
    let token: String = {
        let bytes: [u8; 24] = rand::random();
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)?;
    f.write_all(token.as_bytes())?;
    tracing::warn!(path = %path.display(), "no API secret configured: made an API token (send it as `Authorization: Bearer <token>`)");
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(secret: &str, claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    #[test]
    fn jwts_and_tokens() {
        let auth = ApiAuth {
            jwt: Some(jsonwebtoken::DecodingKey::from_secret(b"s3cret")),
            token: Some("static-token".into()),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let good = jwt("s3cret", serde_json::json!({"role": "api"}));
        let fresh = jwt("s3cret", serde_json::json!({"exp": now + 600}));
        let expired = jwt("s3cret", serde_json::json!({"exp": now - 600}));
        let forged = jwt("other", serde_json::json!({"role": "api"}));
        assert!(auth.allows(Some(&format!("Bearer {good}"))));
        assert!(auth.allows(Some(&format!("Bearer {fresh}"))));
        assert!(!auth.allows(Some(&format!("Bearer {expired}"))));
        assert!(!auth.allows(Some(&format!("Bearer {forged}"))));
        for bad in [
            serde_json::json!({"exp": -1}),
            serde_json::json!({"exp": "9999999999"}),
            serde_json::json!({"exp": null}),
            serde_json::json!({"exp": true}),
            serde_json::json!({"exp": [now + 600]}),
            serde_json::json!({"exp": {"t": now + 600}}),
            serde_json::json!({"nbf": "0"}),
            serde_json::json!({"nbf": now + 600}),
            serde_json::json!({"iat": -5}),
            serde_json::json!({"iat": false}),
        ] {
            let t = jwt("s3cret", bad.clone());
            assert!(!auth.allows(Some(&format!("Bearer {t}"))), "{bad}");
        }
        let ok = jwt(
            "s3cret",
            serde_json::json!({"exp": now + 600, "nbf": now - 5, "iat": now}),
        );
        assert!(auth.allows(Some(&format!("Bearer {ok}"))));
        assert!(auth.allows(Some("Bearer static-token")));
        assert!(!auth.allows(Some("Bearer static-tokeN")));
        assert!(!auth.allows(Some("static-token")));
        assert!(!auth.allows(None));
    }

    #[test]
    fn a_token_is_made_when_nothing_is_configured() {
        let dir = tempfile::tempdir().unwrap();
        let a = ApiAuth::from_env("SHOAL_TEST_NO_JWT", None, dir.path()).unwrap();
        let token = std::fs::read_to_string(dir.path().join("api-token")).unwrap();
        assert!(a.allows(Some(&format!("Bearer {token}"))));
        let b = ApiAuth::from_env("SHOAL_TEST_NO_JWT", None, dir.path()).unwrap();
        assert!(
            b.allows(Some(&format!("Bearer {token}"))),
            "the same token next start"
        );
    }
}
