use super::*;

fn supavisor_json() -> serde_json::Value {
    // A body as Supavisor's documentation shows it.
    serde_json::json!({
        "tenant": {
            "db_host": "localhost",
            "db_port": 6432,
            "db_database": "postgres",
            "ip_version": "auto",
            "enforce_ssl": false,
            "require_user": false,
            "auth_query": "SELECT rolname, rolpassword FROM pg_authid WHERE rolname=$1;",
            "users": [{
                "db_user": "postgres",
                "db_password": "postgres",
                "pool_size": 20,
                "mode_type": "transaction",
                "is_manager": true
            }]
        }
    })
}

#[test]
fn jwks_and_realtime_limits_are_validated_by_field() {
    let good = serde_json::json!({"keys": [
        {"kty": "oct", "kid": "hs-1", "k": "b2N0LWtleQ"},
        {"kty": "OKP", "kid": "ed-1", "crv": "Ed25519", "x": "Ng01_0fvoL2H-CNiW8rphGP5gZ5egUQL841i_x1kGvE"}
    ]});
    check_jwks(&good).unwrap();
    for bad in [
        serde_json::json!([]),
        serde_json::json!({"keys": []}),
        serde_json::json!({"keys": [{"kty": "EC"}]}),
        serde_json::json!({"keys": [{"kty": "oct", "k": "YQ"}]}),
    ] {
        assert!(check_jwks(&bad).is_err(), "{bad}");
    }
    let mut t: Tenant = serde_json::from_value(supavisor_json()["tenant"].clone()).unwrap();
    t.external_id = "acme".into();
    t.jwt_jwks = Some(serde_json::json!({"keys": []}));
    t.max_events_per_second = Some(0);
    let errors = t.validate().unwrap_err();
    assert!(errors.contains_key("jwt_jwks") && errors.contains_key("max_events_per_second"));
    let out = serde_json::to_value(&t).unwrap();
    assert!(out.get("jwt_jwks").is_none(), "write-only: {out}");
}

#[test]
fn supavisor_bodies_are_accepted_and_passwords_never_written_out() {
    let mut t: Tenant = serde_json::from_value(supavisor_json()["tenant"].clone()).unwrap();
    t.external_id = "acme".into();
    t.validate().unwrap();
    assert_eq!(t.db_port, 6432);
    assert_eq!(t.allow_list, default_allow_list());
    assert_eq!(t.manager().unwrap().db_user, "postgres");
    let out = serde_json::to_string(&t).unwrap();
    assert!(!out.contains("db_password"), "{out}");
    assert!(!format!("{t:?}").contains("\"postgres\", db_password"));
}

#[test]
fn errors_name_the_fields() {
    let mut t: Tenant = serde_json::from_value(supavisor_json()["tenant"].clone()).unwrap();
    t.external_id = "Bad_Id".into();
    t.db_host.clear();
    t.users[0].db_password = None;
    t.users[0].is_manager = false;
    t.allow_list = vec!["10.0.0.0/33".into()];
    t.banned_until = Some("tomorrow".into());
    let e = t.validate().unwrap_err();
    for f in [
        "external_id",
        "db_host",
        "users[0].db_password",
        "users",
        "allow_list[0]",
        "banned_until",
    ] {
        assert!(e.contains_key(f), "{f} in {e:?}");
    }
}

#[test]
fn bans_end_when_they_say() {
    let mut t: Tenant = serde_json::from_value(supavisor_json()["tenant"].clone()).unwrap();
    let now = std::time::SystemTime::now();
    assert!(!t.banned_at(now));
    t.banned = true;
    assert!(t.banned_at(now));
    t.banned_until = Some("2000-01-01T00:00:00Z".into());
    assert!(!t.banned_at(now));
    t.banned_until = Some("2999-01-01T00:00:00Z".into());
    assert!(t.banned_at(now));
}

#[test]
fn external_ids_are_dns_labels() {
    for ok in ["acme", "a", "tenant-42", &"x".repeat(63)] {
        assert!(valid_external_id(ok), "{ok}");
    }
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"x".repeat(64), "é"] {
        assert!(!valid_external_id(bad), "{bad}");
    }
}
