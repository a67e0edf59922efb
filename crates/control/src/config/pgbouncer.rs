//! A path from PgBouncer: its `pgbouncer.ini` (and `userlist.txt`) read into an equivalent
//! Shoal configuration, with every setting that cannot be carried over named and why. Pure:
//! `shoal import-pgbouncer` reads the files and prints what this returns.

use std::collections::BTreeMap;

use toml::{Table, Value};

/// What an import gives: the configuration as TOML, and what was left behind.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    pub toml: String,
    /// One line per setting not carried over (or carried with a change worth knowing).
    pub notes: Vec<String>,
}

/// `pgbouncer.ini` as sections of (key, value, line), in file order.
type Ini = BTreeMap<String, Vec<(String, String, usize)>>;

/// Reads PgBouncer's ini syntax: `[section]`, `key = value`, `;` or `#` comments.
/// `%include` is not followed (noted by the caller).
fn parse_ini(text: &str, notes: &mut Vec<String>) -> Ini {
    let mut ini = Ini::new();
    let mut section = String::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with(';') || line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix("%include") {
            notes.push(format!(
                "line {}: %include {} is not followed: import that file's settings too",
                i + 1,
                rest.trim()
            ));
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().to_ascii_lowercase();
            continue;
        }
        match line.split_once('=') {
            Some((k, v)) => ini.entry(section.clone()).or_default().push((
                k.trim().to_owned(),
                v.trim().to_owned(),
                i + 1,
            )),
            None => notes.push(format!("line {}: not a setting: {line}", i + 1)),
        }
    }
    ini
}

/// A connection string's `key=value` pairs (values may be single-quoted).
fn conn_pairs(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('\'') {
            let end = q.find('\'').unwrap_or(q.len());
            (q[..end].to_owned(), q.get(end + 1..).unwrap_or(""))
        } else {
            let end = after.find(char::is_whitespace).unwrap_or(after.len());
            (after[..end].to_owned(), &after[end..])
        };
        out.push((key.trim().to_owned(), value));
        rest = next.trim_start();
    }
    out
}

/// `userlist.txt`: `"user" "password or secret"` per line.
fn parse_userlist(text: &str, notes: &mut Vec<String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with(';') || l.starts_with('#') {
            continue;
        }
        let quoted: Vec<String> = l
            .split('"')
            .enumerate()
            .filter(|(j, _)| j % 2 == 1)
            .map(|(_, s)| s.to_owned())
            .collect();
        match quoted.as_slice() {
            [user, secret, ..] => out.push((user.clone(), secret.clone())),
            _ => notes.push(format!(
                "userlist line {}: not \"user\" \"password\"",
                i + 1
            )),
        }
    }
    out
}

fn secs(v: &str) -> Option<Value> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(|s| Value::String(format!("{s}s")))
}

fn int(v: &str) -> Option<Value> {
    v.trim().parse::<i64>().ok().map(Value::Integer)
}

fn table<'a>(root: &'a mut Table, path: &[&str]) -> &'a mut Table {
    let mut here = root;
    for p in path {
        here = here
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .expect("only tables are made at these paths");
    }
    here
}

/// PgBouncer settings Shoal has no equivalent for, and why (shown to the user).
fn left_behind(key: &str) -> Option<&'static str> {
    Some(match key {
        "logfile" | "syslog" | "syslog_ident" | "syslog_facility" => {
            "Shoal logs to stderr (structured, SHOAL_LOG sets the level); let the service manager keep it"
        }
        "pidfile" | "user" => "run Shoal under a service manager (systemd) as the user you want",
        "reserve_pool_size" | "reserve_pool_timeout" => {
            "Shoal has no reserve pool; raise pool_size, or use query_wait_timeout"
        }
        "max_db_connections" | "max_user_connections" => {
            "Shoal caps servers per pool (pool_size) and, with tenants, per tenant"
        }
        "server_check_query" | "server_check_delay" => {
            "Shoal checks an idle server's socket without a query before reuse"
        }
        "server_round_robin"
        | "dns_max_ttl"
        | "dns_nxdomain_ttl"
        | "dns_zone_check_period"
        | "resolv_conf" => "Shoal resolves each server address when it connects",
        "so_reuseport" | "pkt_buf" | "sbuf_loopcnt" | "tcp_defer_accept" | "tcp_socket_buffer"
        | "tcp_user_timeout" | "tcp_keepcnt" => "not a setting in Shoal (its defaults apply)",
        "verbose" | "log_disconnections" | "log_pooler_errors" | "log_stats" => {
            "Shoal's log level is SHOAL_LOG; log_connections covers logins and disconnections"
        }
        "application_name_add_host" | "track_extra_parameters" | "ignore_startup_parameters" => {
            "Shoal tracks and replays every session parameter a client sets"
        }
        "idle_transaction_timeout" | "query_timeout" | "query_wait_notify" => {
            "no such timeout in Shoal; max_statement_timeout bounds statements"
        }
        "suspend_timeout" | "disable_pqexec" | "peer_id" | "autodb_idle_timeout" => {
            "not a setting in Shoal"
        }
        "auth_hba_file" | "auth_ident_file" => {
            "Shoal has no hba file: per-user auth_method, and allow lists for tenants"
        }
        "unix_socket_mode" | "unix_socket_group" => {
            "Shoal's Unix socket takes the directory's permissions"
        }
        _ => return None,
    })
}

/// The configuration equivalent to `ini` (and `userlist`, PgBouncer's auth_file).
pub fn import(ini_text: &str, userlist: Option<&str>) -> Imported {
    let mut notes = Vec::new();
    let ini = parse_ini(ini_text, &mut notes);
    let mut root = Table::new();
    let empty = Vec::new();
    let pgb = ini.get("pgbouncer").unwrap_or(&empty);
    let mut listen_addr = "127.0.0.1".to_owned();
    let mut listen_port = "6432".to_owned();
    let mut auth_type = "md5".to_owned();
    let mut global_auth: (Option<String>, Option<String>) = (None, None);
    let mut server_tls: Vec<(&str, Value)> = Vec::new();
    let mut unreadable = Vec::new();
    for (key, value, line) in pgb {
        let v = value.as_str();
        let at = |what: &str| format!("[pgbouncer] {key} (line {line}): {what}");
        let mut put = |path: &[&str], k: &str, val: Option<Value>| match val {
            Some(val) => {
                table(&mut root, path).insert(k.to_owned(), val);
            }
            None => unreadable.push(at(&format!("\"{v}\" is not a value Shoal reads here"))),
        };
        match key.as_str() {
            "listen_addr" => listen_addr = v.to_owned(),
            "listen_port" => listen_port = v.to_owned(),
            "unix_socket_dir" if v.is_empty() => {}
            "unix_socket_dir" => put(&["server"], "unix_socket_dir", Some(v.into())),
            "listen_backlog" => put(&["server"], "listen_backlog", int(v)),
            "max_client_conn" => put(&["server"], "max_client_conn", int(v)),
            "client_login_timeout" => put(&["server"], "client_login_timeout", secs(v)),
            "tcp_keepalive" => put(&["server"], "tcp_keepalive", Some((v == "1").into())),
            "tcp_keepidle" => put(&["server"], "tcp_keepalive_idle", secs(v)),
            "tcp_keepintvl" => put(&["server"], "tcp_keepalive_interval", secs(v)),
            "log_connections" => put(&["server"], "log_connections", Some((v == "1").into())),
            "max_packet_size" => put(&["server"], "max_packet_size", int(v)),
            "pool_mode" if v == "statement" => notes.push(at(
                "statement pooling is not in Shoal; transaction pooling is used",
            )),
            "pool_mode" => put(&["pool"], "pool_mode", Some(v.into())),
            "default_pool_size" => put(&["pool"], "pool_size", int(v)),
            "min_pool_size" => put(&["pool"], "min_pool_size", int(v)),
            "server_reset_query" if v.is_empty() => {
                put(&["pool"], "server_reset_query", Some("".into()))
            }
            "server_reset_query" => put(&["pool"], "server_reset_query", Some(v.into())),
            "server_reset_query_always" if v == "1" => {
                put(&["pool"], "server_reset", Some("always".into()))
            }
            "server_reset_query_always" => {}
            "server_idle_timeout" => put(&["pool"], "server_idle_timeout", secs(v)),
            "server_lifetime" => put(&["pool"], "server_lifetime", secs(v)),
            "server_connect_timeout" => put(&["pool"], "server_connect_timeout", secs(v)),
            "query_wait_timeout" => put(&["pool"], "query_wait_timeout", secs(v)),
            "client_idle_timeout" => put(&["pool"], "client_idle_timeout", secs(v)),
            "stats_period" => put(&["pool"], "stats_period", secs(v)),
            "max_prepared_statements" => put(&["pool"], "max_prepared_statements", int(v)),
            "admin_users" | "stats_users" => {
                let names: Vec<Value> = v
                    .split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(Value::from)
                    .collect();
                let k = if key == "admin_users" {
                    "users"
                } else {
                    "stats_users"
                };
                put(&["admin"], k, Some(Value::Array(names)));
            }
            "auth_type" => auth_type = v.to_owned(),
            "auth_file" => {
                if userlist.is_none() {
                    notes.push(at(&format!(
                        "give {v} as the second argument to import its users"
                    )))
                }
            }
            "auth_user" => global_auth.0 = Some(v.to_owned()),
            "auth_query" => global_auth.1 = Some(v.to_owned()),
            "client_tls_sslmode" => {
                let mode = match v {
                    "disable" | "allow" | "prefer" | "require" => v,
                    "verify-ca" | "verify-full" => "require",
                    _ => "",
                };
                if v.starts_with("verify") {
                    notes.push(at(
                        "client certificates are checked per user in Shoal (auth_method = \"cert\")",
                    ));
                }
                put(
                    &["tls"],
                    "client_tls",
                    (!mode.is_empty()).then(|| mode.into()),
                );
            }
            "client_tls_cert_file" => put(&["tls"], "cert_file", Some(v.into())),
            "client_tls_key_file" => put(&["tls"], "key_file", Some(v.into())),
            "client_tls_ca_file" => put(&["tls"], "ca_file", Some(v.into())),
            "client_tls_protocols"
            | "client_tls_ciphers"
            | "client_tls_ecdhcurve"
            | "client_tls_dheparams"
            | "server_tls_protocols"
            | "server_tls_ciphers" => notes.push(at(
                "Shoal uses rustls' safe defaults (TLS 1.2 and 1.3, modern ciphers)",
            )),
            "server_tls_sslmode" => server_tls.push(("sslmode", v.into())),
            "server_tls_ca_file" => server_tls.push(("sslrootcert", v.into())),
            "server_tls_cert_file" => server_tls.push(("sslcert", v.into())),
            "server_tls_key_file" => server_tls.push(("sslkey", v.into())),
            k => match left_behind(k) {
                Some(why) => notes.push(at(&format!("not carried over: {why}"))),
                None => notes.push(at("not a PgBouncer setting Shoal knows; not carried over")),
            },
        }
    }
    notes.extend(unreadable);
    let listen: Vec<Value> = listen_addr
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| {
            let host = match a {
                "*" => "0.0.0.0",
                a if a.contains(':') => return Value::from(format!("[{a}]:{listen_port}")),
                a => a,
            };
            Value::from(format!("{host}:{listen_port}"))
        })
        .collect();
    table(&mut root, &["server"]).insert("listen".into(), Value::Array(listen));

    import_databases(&ini, &mut root, &global_auth, &server_tls, &mut notes);
    import_users(&ini, userlist, &auth_type, &mut root, &mut notes);
    let mut text = String::from(
        "# Made by `shoal import-pgbouncer`. Check it with `shoal check-config FILE`.\n",
    );
    for n in &notes {
        text.push_str(&format!("# note: {n}\n"));
    }
    text.push('\n');
    text.push_str(&toml::to_string(&root).unwrap_or_default());
    Imported { toml: text, notes }
}

fn import_databases(
    ini: &Ini,
    root: &mut Table,
    global_auth: &(Option<String>, Option<String>),
    server_tls: &[(&str, Value)],
    notes: &mut Vec<String>,
) {
    for (name, value, line) in ini.get("databases").into_iter().flatten() {
        let db = table(root, &["databases", name]);
        for (k, val) in server_tls {
            db.insert(k.to_string(), val.clone());
        }
        if let Some(u) = &global_auth.0 {
            db.insert("auth_user".into(), u.as_str().into());
        }
        if let Some(q) = &global_auth.1 {
            db.insert("auth_query".into(), q.as_str().into());
        }
        for (k, v) in conn_pairs(value) {
            let at = format!("[databases] {name} (line {line}): {k}");
            match k.as_str() {
                "host" if v.starts_with('/') => notes.push(format!(
                    "{at}={v}: Shoal reaches PostgreSQL over TCP; give its address"
                )),
                "host" => {
                    db.insert("host".into(), v.into());
                }
                "port" => match v.parse::<i64>() {
                    Ok(p) => {
                        db.insert("port".into(), p.into());
                    }
                    Err(_) => notes.push(format!("{at}: \"{v}\" is not a port")),
                },
                "dbname" => {
                    db.insert("dbname".into(), v.into());
                }
                "pool_size" | "min_pool_size" => match v.parse::<i64>() {
                    Ok(n) => {
                        db.insert(k.clone(), n.into());
                    }
                    Err(_) => notes.push(format!("{at}: \"{v}\" is not a number")),
                },
                "pool_mode" if v != "statement" => {
                    db.insert("pool_mode".into(), v.into());
                }
                "auth_user" => {
                    db.insert("auth_user".into(), v.into());
                }
                "auth_query" => {
                    db.insert("auth_query".into(), v.into());
                }
                "user" | "password" => notes.push(format!(
                    "{at}: a database's forced login is set per user in Shoal \
                     (users.NAME server_user / server_password)"
                )),
                _ => notes.push(format!("{at}: not carried over")),
            }
        }
    }
}

fn import_users(
    ini: &Ini,
    userlist: Option<&str>,
    auth_type: &str,
    root: &mut Table,
    notes: &mut Vec<String>,
) {
    let method = match auth_type {
        "md5" => Some("md5"),
        "scram-sha-256" => Some("scram-sha-256"),
        "trust" | "any" => Some("trust"),
        "cert" => Some("cert"),
        "plain" => Some("scram-sha-256"),
        _ => None,
    };
    if method.is_none() || auth_type == "plain" {
        notes.push(format!(
            "[pgbouncer] auth_type = {auth_type}: Shoal's users take scram-sha-256 (default), \
             md5, trust or cert each"
        ));
    }
    let entries = userlist
        .map(|u| parse_userlist(u, notes))
        .unwrap_or_default();
    for (user, secret) in entries {
        let u = table(root, &["users", &user]);
        if let Some(m) = method {
            if m != "scram-sha-256" {
                u.insert("auth_method".into(), m.into());
            }
        }
        if secret.starts_with("SCRAM-SHA-256$") || (secret.starts_with("md5") && secret.len() == 35)
        {
            u.insert("secret".into(), secret.into());
            notes.push(format!(
                "users.{user}: userlist.txt holds a hash, so Shoal cannot log in to PostgreSQL \
                 with it: set users.{user}.server_password (PgBouncer passed SCRAM keys through)"
            ));
        } else if method != Some("trust") && method != Some("cert") {
            u.insert("password".into(), secret.into());
        }
    }
    for (user, value, line) in ini.get("users").into_iter().flatten() {
        let u = table(root, &["users", user]);
        for (k, v) in conn_pairs(value) {
            match k.as_str() {
                "pool_mode" if v != "statement" => {
                    u.insert("pool_mode".into(), v.into());
                }
                "pool_size" => match v.parse::<i64>() {
                    Ok(n) => {
                        u.insert("pool_size".into(), n.into());
                    }
                    Err(_) => {
                        notes.push(format!("[users] {user} (line {line}): pool_size \"{v}\""))
                    }
                },
                _ => notes.push(format!(
                    "[users] {user} (line {line}): {k} is not carried over"
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INI: &str = "\
;; a typical pgbouncer.ini
[databases]
app = host=10.0.0.5 port=5433 dbname=app_prod pool_size=30
reports = host=/var/run/postgresql dbname=reports user=rep password=x
* = host=10.0.0.5

[users]
batch = pool_mode=session

[pgbouncer]
listen_addr = *
listen_port = 6543
unix_socket_dir = /var/run/postgresql
auth_type = scram-sha-256
auth_file = /etc/pgbouncer/userlist.txt
pool_mode = transaction
default_pool_size = 25
max_client_conn = 5000
server_idle_timeout = 120
query_wait_timeout = 60
reserve_pool_size = 5
admin_users = admin, ops
stats_users = monitor
logfile = /var/log/pgbouncer/pgbouncer.log
made_up_setting = 1
";

    const USERS: &str = "\
\"app\" \"plain-password\"
\"admin\" \"admin-pw\"
\"batch\" \"SCRAM-SHA-256$4096:c2FsdA==$c3RvcmVk:c2VydmVy\"
";

    #[test]
    fn a_typical_file_becomes_a_configuration_with_notes() {
        let got = import(INI, Some(USERS));
        let t: Table = toml::from_str(&got.toml).unwrap();
        assert_eq!(
            t["server"]["listen"],
            Value::Array(vec!["0.0.0.0:6543".into()])
        );
        assert_eq!(t["server"]["unix_socket_dir"], "/var/run/postgresql".into());
        assert_eq!(t["server"]["max_client_conn"], 5000.into());
        assert_eq!(t["pool"]["pool_size"], 25.into());
        assert_eq!(t["pool"]["query_wait_timeout"], "60s".into());
        assert_eq!(t["databases"]["app"]["port"], 5433.into());
        assert_eq!(t["databases"]["app"]["dbname"], "app_prod".into());
        assert_eq!(t["databases"]["app"]["pool_size"], 30.into());
        assert_eq!(t["databases"]["*"]["host"], "10.0.0.5".into());
        assert_eq!(t["users"]["app"]["password"], "plain-password".into());
        assert_eq!(t["users"]["batch"]["pool_mode"], "session".into());
        assert!(t["users"]["batch"].get("secret").is_some());
        assert_eq!(
            t["admin"]["users"],
            Value::Array(vec!["admin".into(), "ops".into()])
        );
        for says in [
            "reserve_pool_size (line 21): not carried over: Shoal has no reserve pool",
            "logfile",
            "made_up_setting (line 25): not a PgBouncer setting Shoal knows",
            "reports (line 4): host=/var/run/postgresql",
            "reports (line 4): user: a database's forced login",
            "users.batch: userlist.txt holds a hash",
        ] {
            assert!(
                got.notes.iter().any(|n| n.contains(says)),
                "{says}: {:#?}",
                got.notes
            );
        }
        assert!(got.toml.contains("# note: [pgbouncer] logfile"));
    }

    #[test]
    fn connection_strings_take_quoted_values() {
        assert_eq!(
            conn_pairs("host=h  dbname='my db' port=1"),
            vec![
                ("host".to_owned(), "h".to_owned()),
                ("dbname".to_owned(), "my db".to_owned()),
                ("port".to_owned(), "1".to_owned())
            ]
        );
    }
}
