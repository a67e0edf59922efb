use super::*;

fn config(pool_size: usize) -> Config {
    Config::parse(
        &format!(
            "[pool]\npool_size = {pool_size}\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n"
        ),
        "test",
        &|_| None,
    )
    .unwrap()
}

fn req<'a>(user: &'a str, database: &'a str) -> RouteRequest<'a> {
    RouteRequest {
        user,
        database,
        server_name: None,
        reference: None,
        addr: None,
    }
}

fn user_of(r: &Registry, user: &str, db: &str) -> (Routed, User) {
    let routed = r.resolve(&req(user, db)).unwrap();
    let u = routed.configured_user().unwrap().clone();
    (routed, u)
}

/// DDL through one database's pools makes its statements be prepared afresh, and no
/// other database's.
#[tokio::test]
async fn schema_changes_stay_within_their_database() {
    let c = Config::parse(
        "[databases.d]\nport = 1\n[databases.e]\nport = 1\n[databases.d2]\nport = 1\ndbname = \"d\"\n\
         [users.u]\npassword = \"p\"\n[users.v]\npassword = \"p\"\n",
        "test",
        &|_| None,
    )
    .unwrap();
    let r = Registry::new(c);
    let pool = |user: &str, db: &str| {
        let (routed, u) = user_of(&r, user, db);
        r.pool(&routed, &u).unwrap()
    };
    let (du, dv, d2, e) = (
        pool("u", "d"),
        pool("v", "d"),
        pool("u", "d2"),
        pool("u", "e"),
    );
    let body = b"SELECT 1\0\0\0";
    let before: Vec<_> = [&du, &dv, &d2, &e]
        .iter()
        .map(|p| {
            p.statements
                .intern(0, body, shoal_wire::sql::ClientEncoding::Utf8)
        })
        .collect();
    du.statements.schema_changed();
    let after: Vec<_> = [&du, &dv, &d2, &e]
        .iter()
        .map(|p| {
            p.statements
                .intern(0, body, shoal_wire::sql::ClientEncoding::Utf8)
        })
        .collect();
    let fresh: Vec<bool> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| b.id != a.id)
        .collect();
    // d, as u and as v, and d2 (the same database on the same server) re-prepare; e keeps.
    assert_eq!(fresh, vec![true, true, true, false]);
}

#[tokio::test]
async fn routes_known_names_and_refuses_others() {
    let r = Registry::new(config(3));
    let (routed, u) = user_of(&r, "u", "d");
    assert!(r
        .resolve(&req("nobody", "d"))
        .unwrap()
        .configured_user()
        .is_none());
    let p = r.pool(&routed, &u).unwrap();
    assert_eq!(p.name, "d/u");
    assert!(Arc::ptr_eq(&p, &r.pool(&routed, &u).unwrap()));
    let (nodb, u) = user_of(&r, "u", "nodb");
    assert_eq!(
        r.pool(&nodb, &u).err(),
        Some(RouteError::UnknownDatabase("nodb".into()))
    );
}

#[tokio::test]
async fn pools_change_with_the_config_at_run_time() {
    let r = Registry::new(config(3));
    let (routed, u) = user_of(&r, "u", "d");
    let before = r.pool(&routed, &u).unwrap();
    // The same settings: the pool stays.
    r.replace_config(config(3));
    let (routed, u) = user_of(&r, "u", "d");
    assert!(Arc::ptr_eq(&before, &r.pool(&routed, &u).unwrap()));
    // A new pool size: the pool is resized in place.
    r.replace_config(config(5));
    let (routed, u) = user_of(&r, "u", "d");
    let after = r.pool(&routed, &u).unwrap();
    assert!(Arc::ptr_eq(&before, &after));
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(after.size(), 5);
    // Another setting: new logins get a new pool; the old one lives on for its clients.
    r.replace_config(
        Config::parse(
            "[pool]\npool_size = 5\npool_mode = \"session\"\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n",
            "test",
            &|_| None,
        )
        .unwrap(),
    );
    let (routed, u) = user_of(&r, "u", "d");
    let third = r.pool(&routed, &u).unwrap();
    assert!(!Arc::ptr_eq(&before, &third));
    assert!(r.remove_pool("d", "u").is_some());
    assert!(r.pools().is_empty());
}

fn tenant(id: &str, sni: Option<&str>) -> TenantRoute {
    let mut t: crate::tenant::model::Tenant = serde_json::from_value(serde_json::json!({
        "db_host": "127.0.0.1", "db_database": "x", "require_user": true,
        "users": [{"db_user": "app", "db_password": "pw"}],
        "sni_hostname": sni,
        "allow_list": ["10.0.0.0/8"]
    }))
    .unwrap();
    t.external_id = id.into();
    TenantRoute::new(t, std::path::Path::new("/nonexistent")).unwrap()
}

fn with_store() -> Config {
    Config::parse(
        "[store]\nurl = \"sqlite::memory:\"\n[tenants]\nsni_base_domain = \"db.example.com\"\n[databases.d]\nport = 1\n[users.u]\npassword = \"p\"\n[users.\"first.last\"]\npassword = \"p\"\n",
        "test",
        &|_| None,
    )
    .unwrap()
}

#[tokio::test]
async fn tenants_are_named_by_user_sni_or_reference_and_must_agree() {
    let r = Registry::new(with_store());
    r.put_tenant(tenant("acme", Some("pg.acme.test"))).await;
    r.put_tenant(tenant("other", None)).await;
    let ip: Option<IpAddr> = Some("10.1.2.3".parse().unwrap());
    let at = |user: &'static str, sni: Option<&'static str>, reference: Option<&'static str>| {
        r.resolve(&RouteRequest {
            user,
            database: "d",
            server_name: sni,
            reference,
            addr: ip,
        })
    };
    let id = |x: Result<Routed, RouteError>| {
        let x = x.unwrap();
        (x.tenant().map(|t| t.id().to_owned()), x.user)
    };
    assert_eq!(
        id(at("app.acme", None, None)),
        (Some("acme".into()), "app".into())
    );
    assert_eq!(
        id(at("app", Some("pg.acme.test"), None)),
        (Some("acme".into()), "app".into())
    );
    assert_eq!(
        id(at("app", Some("other.db.example.com"), None)),
        (Some("other".into()), "app".into())
    );
    assert_eq!(
        id(at("app", None, Some("other"))),
        (Some("other".into()), "app".into())
    );
    assert_eq!(
        id(at("app.acme", Some("pg.acme.test"), Some("acme"))),
        (Some("acme".into()), "app".into())
    );
    // Config-file users, dotted or not, stay in the config file.
    assert_eq!(id(at("u", None, None)), (None, "u".into()));
    assert_eq!(
        id(at("first.last", None, None)),
        (None, "first.last".into())
    );
    // Disagreements and unknown tenants are refused.
    assert!(matches!(
        at("app.other", Some("pg.acme.test"), None),
        Err(RouteError::TenantConflict(..))
    ));
    assert!(matches!(
        at("app", Some("pg.acme.test"), Some("other")),
        Err(RouteError::TenantConflict(..))
    ));
    assert!(matches!(
        at("app.nosuch", None, None),
        Err(RouteError::UnknownTenant(_))
    ));
    assert!(matches!(
        at("app", None, Some("nosuch")),
        Err(RouteError::UnknownTenant(_))
    ));
    // The allow list.
    let outside = r.resolve(&RouteRequest {
        user: "app.acme",
        database: "d",
        server_name: None,
        reference: None,
        addr: Some("192.168.1.1".parse().unwrap()),
    });
    assert_eq!(
        outside.unwrap_err(),
        RouteError::AddressNotAllowed("acme".into())
    );
}
