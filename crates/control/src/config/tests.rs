use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

#[test]
fn embedded_default_is_valid() {
    let c = Config::parse(EMBEDDED_DEFAULT, "default", &no_env).unwrap();
    assert!(!c.databases.is_empty());
    assert!(!c.users.is_empty());
    // A newcomer's first `psql ... dbname=pgbouncer` works as the quickstart's user.
    assert!(c.users.contains_key("shoal"));
    assert_eq!(c.admin.users, vec!["shoal".to_string()]);
}

/// A user who writes `lease_ttl = "3s"` where the docs once wrote `lease_ttl = 3`, or
/// `cache_ttl = 30`, means what they wrote.
#[test]
fn durations_are_written_either_way() {
    let text = "[pool]\nserver_idle_timeout = \"10m\"\nquery_wait_timeout = 90\n\
                    [databases.app]\ncache = true\ncache_ttl = 30\nreplica_ban_time = \"1500ms\"\n";
    let c = Config::parse(text, "f.toml", &no_env).unwrap();
    assert_eq!(c.pool.server_idle_timeout, 600.0);
    assert_eq!(c.pool.query_wait_timeout, 90.0);
    let text = "[pool]\nserver_lifetime = \"an hour\"\n";
    let err = Config::parse(text, "f.toml", &no_env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("a duration such as"), "{err}");
}

/// A file with several mistakes is told all of them, each at its line, in words.
#[test]
fn every_problem_is_told_in_one_run() {
    let text = "[server]\nlisten = [\"127.0.0.1:6432\"]\nshutdown_timeout = \"soon\"\n\n\
                    [pool]\npool_sise = 4\npool_size = 0\n\n\
                    [databases.app]\nport = \"five\"\n\n\
                    [databases.other]\ncache_ttl = \"3 parsecs\"\n\n\
                    [users.bob]\nauth_method = \"md5\"\n";
    let err = Config::parse(text, "f.toml", &no_env)
        .unwrap_err()
        .to_string();
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 6, "{err}");
    for (line, says) in [
        (
            3,
            "server.shutdown_timeout: \"soon\" is not a duration such as",
        ),
        (5, "pool.pool_size must be at least 1"),
        (
            6,
            "pool.pool_sise: `pool_sise` is not a key here; did you mean `pool_size`?",
        ),
        (
            10,
            "databases.app.port: a port between 1 and 65535, not \"five\"",
        ),
        (
            13,
            "databases.other.cache_ttl: \"3 parsecs\" is not a duration such as",
        ),
        (15, "users.bob: no password"),
    ] {
        let prefix = format!("f.toml:{line}: {says}");
        assert!(
            lines.iter().any(|l| l.starts_with(&prefix)),
            "{prefix}\n{err}"
        );
    }
}

/// The rules that look across sections (TLS against what users and databases ask of
/// it, an `auth_user` against the users) and the realtime windows.
#[test]
fn rules_across_sections_are_told() {
    let text = "[tls]\ncert_file = \"c.pem\"\n\n[databases.app]\nauth_user = \"nobody\"\n\n\
                    [users.bob]\nauth_method = \"cert\"\n\n[realtime]\nresume_window = 7200\n";
    let err = Config::parse(text, "f.toml", &no_env)
        .unwrap_err()
        .to_string();
    for says in [
        "f.toml:1: tls.cert_file and tls.key_file go together",
        "f.toml:4: databases.app.auth_user: \"nobody\" is not a configured user",
        "f.toml:7: users.bob: auth_method = \"cert\" needs tls.ca_file",
        "f.toml:10: realtime.resume_window must be between 0 and 3600 seconds",
    ] {
        assert!(err.lines().any(|l| l.starts_with(says)), "{says}\n{err}");
    }
}

#[test]
fn syntax_errors_carry_line_and_column() {
    let err = Config::parse("[server]\nlisten = [\"nope\"]\n", "f.toml", &no_env).unwrap_err();
    let s = err.to_string();
    assert!(s.starts_with("f.toml:2:"), "{s}");
    let err = Config::parse("[pool]\nbogus = 1\n", "f.toml", &no_env).unwrap_err();
    assert!(err.to_string().contains("bogus"), "{err}");
}

#[test]
fn semantic_errors_point_at_the_section() {
    let text = "[databases.app]\n\n[users.bob]\nauth_method = \"md5\"\n";
    let err = Config::parse(text, "f.toml", &no_env)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("f.toml:3:"), "{err}");
    assert!(err.contains("no password"), "{err}");
}

#[test]
fn passwords_from_environment() {
    let text = "[users.bob]\npassword_env = \"BOB_PW\"\n";
    let env = |k: &str| (k == "BOB_PW").then(|| "pw".to_string());
    let c = Config::parse(text, "f", &env).unwrap();
    assert_eq!(c.users["bob"].server_password.as_deref(), Some("pw"));
    assert!(Config::parse(text, "f", &no_env).is_err());
}

#[test]
fn overrides_layer() {
    let text = "[pool]\npool_size = 7\n[databases.a]\npool_mode = \"session\"\n[users.u]\nauth_method = \"trust\"\npool_size = 3\n";
    let c = Config::parse(text, "f", &no_env).unwrap();
    let s = c.pool_settings(&c.databases["a"], &c.users["u"]);
    assert_eq!(s.mode, PoolMode::Session);
    assert_eq!(s.size, 3);
    assert_eq!(c.databases["a"].dbname, "a");
}
