//! Client session parameters: what a client asked for in its startup packet (including
//! `options = '-c name=value ...'`), and the SQL that makes a server connection match them.

use std::sync::Arc;

use shoal_wire::startup::StartupMessage;

/// Session parameters as (name, value) pairs.
pub type Params = Vec<(String, String)>;
/// Parameters shared between many clients without copying.
pub type SharedParams = Arc<[(String, String)]>;

/// What a startup packet asked for, split into routing keys and parameters to apply.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StartupRequest {
    pub user: String,
    pub database: String,
    /// Parameters to hold on whichever server runs the client's queries: lower-cased names,
    /// sorted, last value wins.
    pub params: Vec<(String, String)>,
    /// `_pq_.` protocol options we do not know, to list in NegotiateProtocolVersion.
    pub unrecognized: Vec<String>,
    /// The tenant named in `options` as `reference=<tenant>` (Supavisor's way); taken out of
    /// the options, never sent to a server.
    pub reference: Option<String>,
    /// `target_session_attrs` (a parameter, or `-c target_session_attrs=` in `options`):
    /// where this client's transactions run; never sent to a server.
    pub target: Option<crate::config::replicas::TargetSessionAttrs>,
}

/// A startup packet Shoal cannot serve, as a message for the client.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParamError {
    #[error("no PostgreSQL user name specified in startup packet")]
    NoUser,
    #[error("replication connections are not supported by Shoal")]
    Replication,
    #[error("invalid parameter name \"{0}\"")]
    BadName(String),
    #[error("unsupported command-line option \"{0}\" in options: only -c name=value and --name=value are accepted")]
    BadOption(String),
    #[error("invalid value for target_session_attrs: \"{0}\" (any, read-write, primary, read-only, standby or prefer-standby)")]
    BadTarget(String),
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
}

/// Splits an `options` value the way PostgreSQL does: whitespace separates arguments and a
/// backslash makes the next character literal.
fn split_options(options: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = options.chars();
    let mut in_word = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
                in_word = true;
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

fn parse_options(
    options: &str,
    params: &mut Vec<(String, String)>,
    reference: &mut Option<String>,
) -> Result<(), ParamError> {
    let args = split_options(options);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if let Some(tenant) = arg.strip_prefix("reference=") {
            *reference = Some(tenant.to_owned());
            continue;
        }
        let setting = if arg == "-c" {
            it.next()
                .ok_or_else(|| ParamError::BadOption(arg.clone()))?
                .as_str()
        } else if let Some(s) = arg.strip_prefix("-c") {
            s
        } else if let Some(s) = arg.strip_prefix("--") {
            s
        } else {
            return Err(ParamError::BadOption(arg.clone()));
        };
        let (name, value) = setting
            .split_once('=')
            .ok_or_else(|| ParamError::BadOption(arg.clone()))?;
        params.push((name.replace('-', "_"), value.to_owned()));
    }
    Ok(())
}

impl StartupRequest {
    /// Takes the message apart: its strings move into the request instead of being copied.
    pub fn from_startup(m: StartupMessage) -> Result<StartupRequest, ParamError> {
        let mut req = StartupRequest::default();
        let mut params = Vec::new();
        for (k, v) in m.params {
            match k.as_str() {
                "user" => req.user = v,
                "database" => req.database = v,
                "replication" if !matches!(v.as_str(), "false" | "off" | "no" | "0") => {
                    return Err(ParamError::Replication)
                }
                "replication" => {}
                "options" => parse_options(&v, &mut params, &mut req.reference)?,
                name if name.starts_with("_pq_.") => req.unrecognized.push(k),
                _ => params.push((k, v)),
            }
        }
        if req.user.is_empty() {
            return Err(ParamError::NoUser);
        }
        if req.database.is_empty() {
            req.database = req.user.clone();
        }
        for (mut name, value) in params {
            if !valid_name(&name) {
                return Err(ParamError::BadName(name));
            }
            name.make_ascii_lowercase();
            if name == "target_session_attrs" {
                req.target = Some(
                    crate::config::replicas::TargetSessionAttrs::parse(&value)
                        .ok_or(ParamError::BadTarget(value))?,
                );
                continue;
            }
            req.params.retain(|(n, _)| *n != name);
            req.params.push((name, value));
        }
        req.params.sort();
        Ok(req)
    }
}

/// Undoes everything a client may leave on a transaction-mode server (settings including
/// `SET ROLE` and `SET SESSION AUTHORIZATION`, temporary tables, SQL and protocol prepared
/// statements, `WITH HOLD` cursors, LISTEN registrations, session advisory locks) before
/// another client gets it.
pub const CLEAN_SESSION_SQL: &str = "DISCARD ALL";

/// Whether a CommandComplete tag says the client changed session state that would outlive
/// its transaction on a pooled server (a `LISTEN` is carried instead: see [`crate::notify`]).
pub fn changes_session_state(tag: &[u8]) -> bool {
    [&b"SET\0"[..], b"RESET\0", b"DISCARD"]
        .iter()
        .any(|p| tag.starts_with(p))
}

/// Whether a CommandComplete tag says the schema changed (prepared statements planned before
/// may describe the old one).
pub fn changes_schema(tag: &[u8]) -> bool {
    [&b"CREATE "[..], b"ALTER ", b"DROP ", b"COMMENT\0"]
        .iter()
        .any(|p| tag.starts_with(p))
}

/// The statement that applies `n` startup parameters, passed as `$1, $2, ...` pairs of name
/// and value: values are never spliced into SQL (with `standard_conforming_strings = off` a
/// quoted literal could be escaped out of), and `set_config` takes them verbatim, as a
/// startup packet does (`search_path = 'a, b'` stays two schemas).
pub fn apply_statement(n: usize) -> String {
    let mut sql = String::from("SELECT ");
    for i in 0..n {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str(&format!(
            "pg_catalog.set_config(${}, ${}, false)",
            2 * i + 1,
            2 * i + 2
        ));
    }
    sql
}

/// The parameters of [`apply_statement`], in order.
pub fn apply_values(params: &[(String, String)]) -> Vec<&str> {
    params
        .iter()
        .flat_map(|(k, v)| [k.as_str(), v.as_str()])
        .collect()
}

/// A PostgreSQL time setting's value in milliseconds (`"5s"`, `"250"`, `"1min"`); 0 means
/// no limit, as for `statement_timeout`.
pub fn pg_duration_ms(value: &str) -> Option<f64> {
    let v = value.trim().trim_matches('\'');
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: f64 = num.parse().ok()?;
    let scale = match unit.trim() {
        "" | "ms" => 1.0,
        "us" => 0.001,
        "s" => 1000.0,
        "min" => 60_000.0,
        "h" => 3_600_000.0,
        "d" => 86_400_000.0,
        _ => return None,
    };
    Some(n * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_durations_read_as_milliseconds() {
        assert_eq!(pg_duration_ms("250"), Some(250.0));
        assert_eq!(pg_duration_ms("'5s'"), Some(5000.0));
        assert_eq!(pg_duration_ms("2min"), Some(120_000.0));
        assert_eq!(pg_duration_ms("0"), Some(0.0));
        assert_eq!(pg_duration_ms("soon"), None);
    }

    fn msg(params: &[(&str, &str)]) -> StartupMessage {
        StartupMessage {
            major: 3,
            minor: 0,
            params: params
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    #[test]
    fn options_and_params_merge() {
        let m = msg(&[
            ("user", "u"),
            ("application_name", "app"),
            (
                "options",
                "-c search_path=a,\\ b --statement-timeout=5s -cDateStyle=ISO",
            ),
            ("_pq_.compression", "on"),
        ]);
        let r = StartupRequest::from_startup(m).unwrap();
        assert_eq!(r.database, "u");
        assert_eq!(
            r.params,
            vec![
                ("application_name".into(), "app".into()),
                ("datestyle".into(), "ISO".into()),
                ("search_path".into(), "a, b".into()),
                ("statement_timeout".into(), "5s".into()),
            ]
        );
        assert_eq!(r.unrecognized, vec!["_pq_.compression".to_string()]);
    }

    #[test]
    fn target_session_attrs_is_taken_out_and_checked() {
        use crate::config::replicas::TargetSessionAttrs;
        let r = StartupRequest::from_startup(msg(&[
            ("user", "u"),
            (
                "options",
                "-c target_session_attrs=prefer-standby -c search_path=x",
            ),
        ]))
        .unwrap();
        assert_eq!(r.target, Some(TargetSessionAttrs::PreferStandby));
        assert_eq!(r.params, vec![("search_path".into(), "x".into())]);
        let r = StartupRequest::from_startup(msg(&[
            ("user", "u"),
            ("target_session_attrs", "standby"),
        ]))
        .unwrap();
        assert_eq!(r.target, Some(TargetSessionAttrs::Standby));
        assert!(r.params.is_empty());
        assert_eq!(
            StartupRequest::from_startup(msg(&[
                ("user", "u"),
                ("target_session_attrs", "replica")
            ])),
            Err(ParamError::BadTarget("replica".into()))
        );
    }

    #[test]
    fn reference_names_a_tenant_and_is_not_a_setting() {
        let m = msg(&[
            ("user", "u"),
            ("options", "reference=acme -c search_path=x"),
        ]);
        let r = StartupRequest::from_startup(m).unwrap();
        assert_eq!(r.reference.as_deref(), Some("acme"));
        assert_eq!(r.params, vec![("search_path".into(), "x".into())]);
    }

    #[test]
    fn refuses_what_cannot_be_served() {
        assert_eq!(
            StartupRequest::from_startup(msg(&[("database", "d")])),
            Err(ParamError::NoUser)
        );
        assert_eq!(
            StartupRequest::from_startup(msg(&[("user", "u"), ("replication", "database")])),
            Err(ParamError::Replication)
        );
        assert!(matches!(
            StartupRequest::from_startup(msg(&[("user", "u"), ("options", "-x")])),
            Err(ParamError::BadOption(_))
        ));
        assert!(matches!(
            StartupRequest::from_startup(msg(&[("user", "u"), ("bad;name", "1")])),
            Err(ParamError::BadName(_))
        ));
    }

    #[test]
    fn parameters_are_passed_out_of_band() {
        assert_eq!(
            apply_statement(2),
            "SELECT pg_catalog.set_config($1, $2, false), pg_catalog.set_config($3, $4, false)"
        );
        let p = vec![("application_name".to_string(), "x\\'; DROP".to_string())];
        assert_eq!(apply_values(&p), vec!["application_name", "x\\'; DROP"]);
        assert!(changes_schema(b"ALTER TABLE\0"));
        assert!(!changes_schema(b"SELECT 1\0"));
    }
}
