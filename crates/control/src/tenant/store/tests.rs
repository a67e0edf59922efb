use super::*;

/// The embedded store in `dir`, with a key made there.
async fn sqlite_store(dir: &Path) -> Store {
    let section = StoreSection {
        url: None,
        data_dir: dir.to_owned(),
        encryption_key_env: "SHOAL_TEST_NO_SUCH_KEY".into(),
        resync_interval: 30.0,
        ..StoreSection::default()
    };
    Store::open(&section).await.unwrap()
}

#[tokio::test]
async fn sqlite_store_keeps_tenants_with_passwords_sealed() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path()).await;
    let mut t: Tenant = serde_json::from_value(serde_json::json!({
        "db_host": "h", "db_database": "d", "require_user": true,
        "users": [{"db_user": "u", "db_password": "s3cret-pw"}],
        "jwt_secret": "jwt-s3cret-pw",
        "jwt_jwks": {"keys": [{"kty": "oct", "kid": "k1", "k": "s3cret-pw-oct"}]}
    }))
    .unwrap();
    t.external_id = "acme".into();
    assert!(store.put(&t).await.unwrap());
    assert!(!store.put(&t).await.unwrap(), "the second put replaces");
    assert_eq!(store.get("acme").await.unwrap().unwrap(), t);
    assert_eq!(store.list().await.unwrap().len(), 1);
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let raw = std::fs::read(f.unwrap().path()).unwrap();
        assert!(
            !raw.windows(9).any(|w| w == b"s3cret-pw"),
            "no plaintext password or JWT secret in the store's files"
        );
    }
    let key = dir.path().join("encryption.key");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(store.delete("acme").await.unwrap());
    assert!(!store.delete("acme").await.unwrap());
    assert!(store.get("acme").await.unwrap().is_none());
}

#[tokio::test]
async fn pages_come_from_the_store_by_id_with_wildcards_taken_literally() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_store(dir.path()).await;
    for id in ["b-1", "a-1", "a-2", "c-10", "c-1x"] {
        let mut t: Tenant = serde_json::from_value(serde_json::json!({
            "db_host": "h", "db_database": "d", "require_user": true,
            "users": [{"db_user": "u", "db_password": "pw"}]
        }))
        .unwrap();
        t.external_id = id.into();
        store.put(&t).await.unwrap();
    }
    let ids = |p: &(Vec<Tenant>, usize)| {
        p.0.iter()
            .map(|t| t.external_id.clone())
            .collect::<Vec<_>>()
    };
    let p = store.page("", 1, 2).await.unwrap();
    assert_eq!((ids(&p), p.1), (vec!["a-2".into(), "b-1".into()], 5));
    assert_eq!(p.0[0].users[0].db_password.as_deref(), Some("pw"));
    let p = store.page("A-", 0, 10).await.unwrap();
    assert_eq!((ids(&p), p.1), (vec!["a-1".into(), "a-2".into()], 2));
    let p = store.page("c-1", 0, 10).await.unwrap();
    assert_eq!(p.1, 2);
    assert_eq!(
        store.page("c_1", 0, 10).await.unwrap().1,
        0,
        "_ is no wildcard"
    );
    assert_eq!(
        store.page("%", 0, 10).await.unwrap().1,
        0,
        "% is no wildcard"
    );
    assert_eq!(store.page("", 10, 10).await.unwrap(), (vec![], 5));
}

/// Any backend plugs in: one in memory keeps only sealed bodies, and the store reads
/// them back as the tenants put.
#[tokio::test]
async fn a_backend_in_memory_plugs_in() {
    /// Its map is shared, so the test can look inside once the store owns the backend.
    #[derive(Default, Clone)]
    struct Memory(Arc<Mutex<std::collections::BTreeMap<String, String>>>);
    impl Backend for Memory {
        fn rows(&self) -> BoxFuture<'_, Vec<(String, String)>> {
            let m = self.0.lock().unwrap();
            let rows = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            Box::pin(async move { Ok(rows) })
        }
        fn row<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<String>> {
            let body = self.0.lock().unwrap().get(id).cloned();
            Box::pin(async move { Ok(body) })
        }
        fn upsert(&self, id: String, body: String) -> BoxFuture<'_, bool> {
            let created = self.0.lock().unwrap().insert(id, body).is_none();
            Box::pin(async move { Ok(created) })
        }
        fn remove(&self, id: String) -> BoxFuture<'_, bool> {
            let existed = self.0.lock().unwrap().remove(&id).is_some();
            Box::pin(async move { Ok(existed) })
        }
        fn name(&self) -> &'static str {
            "memory"
        }
    }
    let memory = Memory::default();
    let sealer = Sealer::from_text(&Sealer::generate_text()).unwrap();
    let store = Store::with(Box::new(memory.clone()), sealer);
    let mut t: Tenant = serde_json::from_value(serde_json::json!({
        "db_host": "h", "db_database": "d", "require_user": true,
        "users": [{"db_user": "u", "db_password": "s3cret-pw"}]
    }))
    .unwrap();
    t.external_id = "acme".into();
    assert!(store.put(&t).await.unwrap());
    assert_eq!(store.get("acme").await.unwrap().unwrap(), t);
    assert_eq!(store.list().await.unwrap(), vec![t]);
    assert!(memory
        .0
        .lock()
        .unwrap()
        .values()
        .all(|b| !b.contains("s3cret-pw")));
    assert!(store.delete("acme").await.unwrap());
    assert!(store.list().await.unwrap().is_empty());
}
