//! The dashboard's page, script and style, compiled into the binary: nothing is installed
//! beside Shoal and nothing is fetched from elsewhere at run time. The page itself holds no
//! data: it asks for it with the session cookie, and shows the login form without one.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("assets/index.html");

/// (name, content type, content)
const FILES: &[(&str, &str, &str)] = &[
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/app.js"),
    ),
    (
        "dom.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/dom.js"),
    ),
    (
        "charts.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/charts.js"),
    ),
    (
        "tenants.js",
        "text/javascript; charset=utf-8",
        include_str!("assets/tenants.js"),
    ),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("assets/app.css"),
    ),
    ("icon.svg", "image/svg+xml", include_str!("assets/icon.svg")),
];

/// Only this server's own scripts and styles run; the page may not be framed.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                      connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

fn hardened(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}

/// `GET /ui`: the page.
pub async fn page() -> Response {
    hardened(
        (
            [
                (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            INDEX,
        )
            .into_response(),
    )
}

/// `GET /ui/assets/{file}`.
pub async fn file(Path(name): Path<String>) -> Response {
    match FILES.iter().find(|(n, _, _)| *n == name) {
        Some((_, kind, body)) => hardened(
            (
                [
                    (header::CONTENT_TYPE, *kind),
                    (header::CACHE_CONTROL, "no-cache"),
                ],
                *body,
            )
                .into_response(),
        ),
        None => (StatusCode::NOT_FOUND, "no such file").into_response(),
    }
}
