//! The operators' commands on pools (pause, resume, kill, end a tenant's pools, close unused
//! ones), for the admin console and the API.

use std::sync::Arc;

use super::{PoolKey, Registry, TenantEvent, DB_PREFIX};
use crate::pool::Pool;

impl Registry {
    /// Pools of `database` (all when `None`), as the admin console names databases.
    pub fn pools_of(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.lock_pools()
            .iter()
            .filter(|((d, _), _)| database.is_none_or(|want| d == want))
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// `PAUSE [db]`: the pools (and pools made later) hold new transactions.
    pub fn pause(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(database.unwrap_or("*").to_owned());
        let mut pools = self.pools_of(database);
        // Pools taken out of routing still serve their clients: they pause too.
        pools.extend(self.retired_pools(database));
        for p in &pools {
            p.pause();
        }
        pools
    }

    fn retired_pools(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|w| w.upgrade())
            .filter(|p| database.is_none_or(|d| p.database() == d))
            .collect()
    }

    /// `RESUME [db]`.
    pub fn resume(&self, database: Option<&str>) {
        let still = {
            let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
            match database {
                Some(d) => {
                    paused.remove(d);
                }
                None => paused.clear(),
            }
            paused.clone()
        };
        for ((db, _), p) in self.lock_pools().iter() {
            if !still.contains("*") && !still.contains(db) {
                p.resume();
            }
        }
        for p in self.retired_pools(None) {
            let db = p.database().to_owned();
            if !still.contains("*") && !still.contains(&db) {
                p.resume();
            }
        }
    }

    /// Servers still open in pools taken out of routing (of `database`, or all).
    pub fn retired_servers(&self, database: Option<&str>) -> usize {
        let r = self.retired.lock().unwrap_or_else(|e| e.into_inner());
        r.iter()
            .filter_map(|w| w.upgrade())
            .filter(|p| database.is_none_or(|d| p.database() == d))
            .map(|p| p.stats.servers.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// `KILL db`: ends every client and pool of a database.
    pub async fn kill(&self, database: &str, reason: &str) -> usize {
        let mut n = 0;
        for pool in self.pools_of(Some(database)) {
            n += self.end_pool(&pool, reason).await;
        }
        n
    }

    /// Removes a tenant: its clients are told why and disconnected, its pools closed.
    pub async fn remove_tenant(&self, id: &str, reason: &str) -> Option<usize> {
        let old = self.tenants.remove(id)?;
        drop(old);
        self.tenant_event(&TenantEvent::Changed(id.to_owned()));
        Some(self.end_tenant_pools(id, reason).await)
    }

    /// Ends every pool of a tenant (ban, terminate); returns how many clients were told.
    pub async fn end_tenant_pools(&self, id: &str, reason: &str) -> usize {
        self.tenant_event(&TenantEvent::Ended(id.to_owned()));
        let mut n = 0;
        for pool in self.tenant_pools(id) {
            n += self.end_pool(&pool, reason).await;
        }
        n
    }

    pub async fn end_pool(&self, pool: &Arc<Pool>, reason: &str) -> usize {
        {
            let mut pools = self.lock_pools();
            pools.retain(|_, p| !Arc::ptr_eq(p, pool));
        }
        pool.end(reason.to_owned()).await
    }

    /// Closes tenant pools no client has used for `idle`: a tenant costs nothing again
    /// until its next login.
    pub fn close_unused_tenant_pools(&self, idle: std::time::Duration) -> usize {
        let now = crate::clock::now_ms();
        let idle_ms = idle.as_millis() as u64;
        let unused: Vec<PoolKey> = self
            .lock_pools()
            .iter()
            .filter(|((db, _), p)| {
                db.starts_with(DB_PREFIX)
                    && p.stats.clients.load(std::sync::atomic::Ordering::Relaxed) == 0
                    && now.saturating_sub(p.unused_since.load(std::sync::atomic::Ordering::Relaxed))
                        >= idle_ms
            })
            .map(|(k, _)| k.clone())
            .collect();
        for (db, user) in &unused {
            self.remove_pool(db, user);
        }
        unused.len()
    }
}
