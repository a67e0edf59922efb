//! Tenant changes, from the API or from another node through the shared store, applied to
//! the store and to routing: a new tenant is routable when its PUT returns, a resize keeps
//! clients, a ban or delete ends the tenant's clients, and no other tenant notices.
// Control plane: tenant syncs and checks run on the main runtime (tokio's timers work).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use super::model::{FieldErrors, Tenant};
use super::store::{Store, StoreError};
use crate::route::Registry;
use crate::route::TenantRoute;

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("invalid tenant")]
    Invalid(FieldErrors),
    #[error("tenant not found")]
    NotFound,
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn field_error(field: &str, msg: impl Into<String>) -> ServiceError {
    let mut e = FieldErrors::new();
    e.insert(field.into(), vec![msg.into()]);
    ServiceError::Invalid(e)
}

/// The tenant store and the routing it feeds.
pub struct TenantService {
    /// The routing tenants are applied to.
    pub routes: Arc<Registry>,
    pub store: Store,
    ca_dir: std::path::PathBuf,
}

impl TenantService {
    pub fn new(routes: Arc<Registry>, store: Store, data_dir: &std::path::Path) -> TenantService {
        TenantService {
            routes,
            store,
            ca_dir: data_dir.join("tenant-ca"),
        }
    }

    /// Loads every stored tenant into routing (at start, and on each resync): changed ones
    /// are applied, ones no longer stored are removed.
    pub async fn sync_all(&self) -> Result<usize, StoreError> {
        let stored = self.store.list().await?;
        let ids: std::collections::HashSet<String> =
            stored.iter().map(|t| t.external_id.clone()).collect();
        let n = stored.len();
        for t in stored {
            self.apply(t).await;
        }
        for id in self.routes.tenants.ids() {
            if !ids.contains(&id) {
                self.routes
                    .remove_tenant(&id, &format!("tenant \"{id}\" was deleted"))
                    .await;
            }
        }
        Ok(n)
    }

    /// Applies one stored tenant to routing (no-op when unchanged).
    pub async fn apply(&self, t: Tenant) {
        let id = t.external_id.clone();
        if self.routes.tenants.get(&id).is_some_and(|r| r.tenant == t) {
            return;
        }
        let banned = t.banned_at(std::time::SystemTime::now());
        let reason = t.ban_reason.clone();
        match TenantRoute::new(t, &self.ca_dir) {
            Ok(route) => self.routes.put_tenant(route).await,
            Err(e) => {
                tracing::error!(tenant = %id, error = %e, "tenant not applied");
                return;
            }
        }
        if banned {
            let why = match reason {
                Some(r) => format!("tenant \"{id}\" was banned: {r}"),
                None => format!("tenant \"{id}\" was banned"),
            };
            let n = self.routes.end_tenant_pools(&id, &why).await;
            tracing::info!(tenant = %id, clients = n, "tenant banned: its clients were disconnected");
        }
    }

    /// Applies a change another node announced: the tenant as stored now, or its removal.
    pub async fn refresh(&self, id: &str) -> Result<(), StoreError> {
        match self.store.get(id).await? {
            Some(t) => self.apply(t).await,
            None => {
                self.routes
                    .remove_tenant(id, &format!("tenant \"{id}\" was deleted"))
                    .await;
            }
        }
        Ok(())
    }

    /// Creates or replaces a tenant; true when created. With `check`, a new tenant's upstream
    /// must accept a login with the given credentials first.
    pub async fn put(&self, mut t: Tenant, id: &str, check: bool) -> Result<bool, ServiceError> {
        if !t.external_id.is_empty() && t.external_id != id {
            return Err(field_error(
                "external_id",
                format!("does not match the id in the URL (\"{id}\")"),
            ));
        }
        t.external_id = id.to_owned();
        t.validate().map_err(ServiceError::Invalid)?;
        if let Some(sni) = &t.sni_hostname {
            if let Some(other) = self.routes.tenants.by_sni(sni) {
                if other != id {
                    return Err(field_error(
                        "sni_hostname",
                        format!("is already used by tenant \"{other}\""),
                    ));
                }
            }
        }
        let exists = self.routes.tenants.get(id).is_some();
        if check && !exists {
            self.check_upstream(&t).await?;
        }
        let created = self.store.put(&t).await?;
        self.apply(t).await;
        Ok(created)
    }

    /// Logs in to the tenant's PostgreSQL as its manager (or first) user.
    async fn check_upstream(&self, t: &Tenant) -> Result<(), ServiceError> {
        let route = TenantRoute::new(t.clone(), &self.ca_dir)
            .map_err(|e| field_error("upstream_tls_ca", e))?;
        let upstream = route.manager_upstream().map_err(|e| {
            let field = if t.users.is_empty() {
                "users"
            } else {
                "upstream_tls_ca"
            };
            field_error(field, e)
        })?;
        match crate::server::ServerConn::connect(&upstream, Duration::from_secs(5)).await {
            Ok(conn) => {
                conn.close().await;
                Ok(())
            }
            Err(e) => {
                let field = match &e {
                    crate::server::ServerError::Db(f) if f.code.starts_with("28") => {
                        format!("users[{}].db_password", user_index(t, &upstream.user))
                    }
                    crate::server::ServerError::Db(f) if f.code == "3D000" => "db_database".into(),
                    _ => "db_host".into(),
                };
                Err(field_error(
                    &field,
                    format!(
                        "the upstream refused or could not be reached: {e} (add ?check=false to skip this check)"
                    ),
                ))
            }
        }
    }

    pub async fn get(&self, id: &str) -> Result<Tenant, ServiceError> {
        self.store.get(id).await?.ok_or(ServiceError::NotFound)
    }

    pub async fn list(&self) -> Result<Vec<Tenant>, ServiceError> {
        Ok(self.store.list().await?)
    }

    /// One page of the tenants whose id contains `search`, by id, and how many match.
    pub async fn page(
        &self,
        search: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<Tenant>, usize), ServiceError> {
        Ok(self.store.page(search, offset, limit).await?)
    }

    /// Deletes a tenant: its clients are told and disconnected, its pools closed.
    pub async fn delete(&self, id: &str) -> Result<(), ServiceError> {
        if !self.store.delete(id).await? {
            return Err(ServiceError::NotFound);
        }
        self.routes
            .remove_tenant(id, &format!("tenant \"{id}\" was deleted"))
            .await;
        Ok(())
    }

    /// Changes some fields (a ban, an unban, a pool size…): `changes` is merged into the
    /// stored tenant, which must stay valid. `users`, when given, replaces the list; a user
    /// given without `db_password` keeps its stored one.
    pub async fn patch(
        &self,
        id: &str,
        changes: serde_json::Value,
    ) -> Result<Tenant, ServiceError> {
        let current = self.get(id).await?;
        let mut v = serde_json::to_value(&current).map_err(StoreError::from)?;
        let serde_json::Value::Object(changes) = changes else {
            return Err(field_error("tenant", "must be an object"));
        };
        let users_given = changes.contains_key("users");
        // Write-only fields are never serialized, so they are not in `v`: a patch that does
        // not name them keeps the stored ones.
        let jwt_secret_given = changes.contains_key("jwt_secret");
        let jwt_jwks_given = changes.contains_key("jwt_jwks");
        if let serde_json::Value::Object(obj) = &mut v {
            for (k, val) in changes {
                obj.insert(k, val);
            }
        }
        let mut t = match Tenant::read_json(&v) {
            (Some(t), errors) if errors.is_empty() => t,
            (_, errors) => return Err(ServiceError::Invalid(errors)),
        };
        // Passwords are never read back out: a user patched without one keeps the stored
        // user's of the same name (a new user must bring its own).
        if users_given {
            for u in &mut t.users {
                if u.db_password.is_none() {
                    u.db_password = current
                        .users
                        .iter()
                        .find(|c| c.db_user == u.db_user)
                        .and_then(|c| c.db_password.clone());
                }
            }
        } else {
            t.users = current.users.clone();
        }
        if !jwt_secret_given {
            t.jwt_secret = current.jwt_secret.clone();
        }
        if !jwt_jwks_given {
            t.jwt_jwks = current.jwt_jwks.clone();
        }
        if t.external_id != id {
            return Err(field_error("external_id", "cannot be changed"));
        }
        if !t.banned {
            t.ban_reason = None;
            t.banned_until = None;
        }
        t.validate().map_err(ServiceError::Invalid)?;
        self.store.put(&t).await?;
        self.apply(t.clone()).await;
        Ok(t)
    }

    /// Ends every client and pool of a tenant (the tenant stays).
    pub async fn terminate(&self, id: &str) -> Result<usize, ServiceError> {
        if self.routes.tenants.get(id).is_none() {
            return Err(ServiceError::NotFound);
        }
        Ok(self
            .routes
            .end_tenant_pools(
                id,
                &format!("tenant \"{id}\" was terminated by an operator"),
            )
            .await)
    }
}

fn user_index(t: &Tenant, name: &str) -> usize {
    t.users.iter().position(|u| u.db_user == name).unwrap_or(0)
}

/// Keeps a node in step with a shared store: LISTEN for changes (applied at once) and a full
/// resync every `interval`, so a missed notification heals.
pub async fn follow_shared_store(
    service: Arc<TenantService>,
    url: String,
    tls: crate::config::UpstreamTlsSettings,
    interval: Duration,
) {
    use futures_util::StreamExt;
    loop {
        let conn = super::store::pg_connect_pair(&url, &tls).await;
        let (client, mut connection) = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "tenant store: cannot listen for changes; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let driver = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(m) = messages.next().await {
                match m {
                    Ok(tokio_postgres::AsyncMessage::Notification(n)) => {
                        let _ = tx.send(n.payload().to_owned());
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        if let Err(e) = client
            .batch_execute(&format!("LISTEN {}", super::store::CHANNEL))
            .await
        {
            tracing::warn!(error = %e, "tenant store: LISTEN failed; retrying");
            driver.abort();
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        // Changes made while not listening.
        if let Err(e) = service.sync_all().await {
            tracing::warn!(error = %e, "tenant store: resync failed");
        }
        let mut tick = tokio::time::interval(interval);
        tick.tick().await;
        loop {
            tokio::select! {
                id = rx.recv() => match id {
                    Some(id) => {
                        if let Err(e) = service.refresh(&id).await {
                            tracing::warn!(tenant = %id, error = %e, "tenant store: change not applied");
                        }
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    if let Err(e) = service.sync_all().await {
                        tracing::warn!(error = %e, "tenant store: resync failed");
                    }
                }
            }
        }
        tracing::warn!("tenant store: change listener lost its connection; reconnecting");
        drop(client);
        driver.abort();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
