//! Dashboard sessions: a login with the API's token or JWT opens one, named by 32 random
//! bytes in an HttpOnly, SameSite=Strict cookie (never in a URL), ending after `ttl` or at
//! logout. At most [`MAX_SESSIONS`] are kept; the oldest goes first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The cookie a session travels in.
pub const COOKIE: &str = "shoal_ui";
/// Sessions kept at once.
pub const MAX_SESSIONS: usize = 10_000;

pub struct Sessions {
    ttl: Duration,
    open: Mutex<HashMap<String, Instant>>,
}

impl Sessions {
    pub fn new(ttl: Duration) -> Sessions {
        Sessions {
            ttl,
            open: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new session's id.
    pub fn open(&self) -> String {
        let bytes: [u8; 32] = rand::random();
        let id: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let now = Instant::now();
        let mut open = self.lock();
        open.retain(|_, until| *until > now);
        if open.len() >= MAX_SESSIONS {
            if let Some(oldest) = open.iter().min_by_key(|(_, u)| **u).map(|(k, _)| k.clone()) {
                open.remove(&oldest);
            }
        }
        open.insert(id.clone(), now + self.ttl);
        id
    }

    /// Whether `id` names a session in force.
    pub fn valid(&self, id: &str) -> bool {
        self.lock()
            .get(id)
            .is_some_and(|until| *until > Instant::now())
    }

    pub fn close(&self, id: &str) {
        self.lock().remove(id);
    }

    /// The `Set-Cookie` value for session `id` (an empty id expires the cookie); `secure`
    /// when the browser reached Shoal over HTTPS (through a proxy that says so).
    pub fn cookie(&self, id: &str, secure: bool) -> String {
        let age = if id.is_empty() { 0 } else { self.ttl.as_secs() };
        let secure = if secure { "; Secure" } else { "" };
        format!("{COOKIE}={id}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={age}{secure}")
    }
}

/// Whether a request comes from a page of this server: a browser names where a request
/// comes from (`Origin`, `Sec-Fetch-Site`); one made by another site's page is refused even
/// when the cookie (SameSite=Strict) would not travel with it anyway.
pub fn same_origin(headers: &axum::http::HeaderMap) -> bool {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    if get("sec-fetch-site") == Some("cross-site") {
        return false;
    }
    let Some(origin) = get("origin") else {
        return true;
    };
    let Some((_, authority)) = origin.split_once("://") else {
        return false;
    };
    // Behind a reverse proxy the page's host may be the one the proxy was asked for. A
    // page of another site cannot forge that header: a custom header makes the browser ask
    // first (CORS), and Shoal allows no other origin.
    [get("host"), get("x-forwarded-host")]
        .into_iter()
        .flatten()
        .any(|h| authority.eq_ignore_ascii_case(h.trim()))
}

/// Whether a request that changes something surely comes from a page of this server. A
/// browser sends `Origin` with every such `fetch`, and an `<img>` or a link sends none, so
/// here a missing `Origin` is refused; `Sec-Fetch-Site` must not name another site, nor
/// another port of the same host (`same-site`, where a `SameSite` cookie still travels).
pub fn same_origin_change(headers: &axum::http::HeaderMap) -> bool {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
    if get("sec-fetch-site").is_some_and(|s| s != "same-origin") {
        return false;
    }
    get("origin").is_some() && same_origin(headers)
}

impl crate::api::Gate for Sessions {
    fn admits(
        &self,
        headers: &axum::http::HeaderMap,
        access: crate::api::Access,
    ) -> Result<(), &'static str> {
        if !same_origin(headers) {
            return Err("the dashboard's requests must come from its own pages");
        }
        if access == crate::api::Access::Write && !same_origin_change(headers) {
            return Err(
                "a change must come from the dashboard's own page (a request with its Origin)",
            );
        }
        match from_headers(headers) {
            Some(id) if self.valid(id) => Ok(()),
            _ => Err("log in first (POST /ui/login)"),
        }
    }
}

/// Whether the browser reached Shoal over HTTPS, as a proxy in front says.
pub fn over_https(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.trim().eq_ignore_ascii_case("https"))
}

/// The session id a request's `Cookie` header carries.
pub fn from_headers(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_open_end_and_expire() {
        let s = Sessions::new(Duration::from_secs(60));
        let a = s.open();
        assert_eq!(a.len(), 64);
        assert!(s.valid(&a));
        assert!(!s.valid("nope"));
        s.close(&a);
        assert!(!s.valid(&a));
        let short = Sessions::new(Duration::ZERO);
        assert!(
            !short.valid(&short.open()),
            "an expired session is no session"
        );
        let c = s.cookie("abc", false);
        assert!(!c.contains("Secure"));
        assert!(s.cookie("abc", true).ends_with("; Secure"));
        assert!(
            c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.contains("Max-Age=60")
        );
        assert!(s.cookie("", false).contains("Max-Age=0"));
    }

    #[test]
    fn requests_from_other_sites_are_refused() {
        use crate::api::{Access::Read, Gate};
        let s = Sessions::new(Duration::from_secs(60));
        let id = s.open();
        let mut h = axum::http::HeaderMap::new();
        h.insert("host", "127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.admits(&h, Read), Err("log in first (POST /ui/login)"));
        h.insert("cookie", format!("shoal_ui={id}").parse().unwrap());
        assert_eq!(
            s.admits(&h, Read),
            Ok(()),
            "no Origin: not a browser's cross-site request"
        );
        h.insert("origin", "http://127.0.0.1:8080".parse().unwrap());
        assert_eq!(s.admits(&h, Read), Ok(()));
        h.insert("origin", "https://evil.example".parse().unwrap());
        assert!(s.admits(&h, Read).is_err());
        h.insert("origin", "https://shoal.example.com".parse().unwrap());
        h.insert("x-forwarded-host", "shoal.example.com".parse().unwrap());
        assert_eq!(s.admits(&h, Read), Ok(()), "the host a proxy was asked for");
        h.remove("x-forwarded-host");
        h.insert("origin", "http://127.0.0.1:8080".parse().unwrap());
        h.insert("sec-fetch-site", "cross-site".parse().unwrap());
        assert!(s.admits(&h, Read).is_err());
    }

    #[test]
    fn changes_need_the_pages_own_origin() {
        use crate::api::{Access, Gate};
        let s = Sessions::new(Duration::from_secs(60));
        let id = s.open();
        let mut h = axum::http::HeaderMap::new();
        h.insert("host", "127.0.0.1:4000".parse().unwrap());
        h.insert("cookie", format!("shoal_ui={id}").parse().unwrap());
        assert_eq!(s.admits(&h, Access::Read), Ok(()));
        assert!(
            s.admits(&h, Access::Write).is_err(),
            "no Origin: an <img> or a link, not the dashboard's fetch"
        );
        h.insert("sec-fetch-site", "same-site".parse().unwrap());
        assert!(
            s.admits(&h, Access::Write).is_err(),
            "another port of the same host"
        );
        h.insert("sec-fetch-site", "same-origin".parse().unwrap());
        h.insert("origin", "http://127.0.0.1:4000".parse().unwrap());
        assert_eq!(s.admits(&h, Access::Write), Ok(()));
        h.insert("origin", "http://127.0.0.1:8080".parse().unwrap());
        assert!(s.admits(&h, Access::Write).is_err());
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut h = axum::http::HeaderMap::new();
        h.insert("cookie", "a=1; shoal_ui=xyz; b=2".parse().unwrap());
        assert_eq!(from_headers(&h), Some("xyz"));
        h.insert("cookie", "shoal_uix=1".parse().unwrap());
        assert_eq!(from_headers(&h), None);
    }
}
