//! State shared by every session: the configuration, the routes and their pools, the cancel
//! keys, the client counts and the shutdown signal.

mod lifecycle;

use std::sync::Arc;

use tokio::sync::watch;

pub use lifecycle::Lifecycle;

use crate::admission::Admission;
use crate::cancel::CancelRegistry;
use crate::config::Config;

pub struct App {
    /// The configuration Shoal started with (listeners and process-wide settings).
    pub config: Config,
    /// Users, databases and their pools: where each login goes. Shared with the tenant
    /// service, which needs nothing else of the App.
    pub routes: Arc<crate::route::Registry>,
    pub cancels: Arc<CancelRegistry>,
    /// Who gets in: login and client counts, failed logins.
    pub admission: Arc<Admission>,
    /// Shutdown and upgrades as clients see them.
    pub lifecycle: Lifecycle,
    /// Client-facing TLS.
    pub tls: crate::tls::TlsState,
    /// Process-wide counters (connections, TLS, authentication).
    pub metrics: crate::metrics::ProcessMetrics,
    /// Secrets found by auth_query.
    pub secrets: crate::auth_query::SecretCache,
    /// Passwords the serverless front door checked in cleartext lately.
    pub passwords: crate::passwords::PasswordMemo,
    /// This node's cluster, once joined (never, without `[cluster]`).
    pub cluster: std::sync::OnceLock<Arc<crate::cluster::Node>>,
    /// The realtime service, once started (never, without `[realtime]`).
    pub realtime: std::sync::OnceLock<Arc<shoal_realtime::edge::Service>>,
    /// Postgres Changes capture, with the realtime service.
    pub feeds: std::sync::OnceLock<Arc<dyn crate::metrics::FeedCounters>>,
    /// The per-core data plane's shard threads (none: everything on one runtime).
    pub shards: Arc<crate::shard::Shards>,
    /// KiB of large client messages buffered whole now, by all clients together
    /// (bounded by `server.max_large_message_memory`).
    pub large_message_kib: std::sync::atomic::AtomicUsize,
}

impl App {
    /// An App whose sessions run on the caller's runtime, without shard threads. Fails when a
    /// TLS certificate or key cannot be loaded (naming the file).
    pub fn new(
        config: Config,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Arc<App>, crate::tls::TlsError> {
        App::on_shards(config, shutdown, crate::shard::Shards::none())
    }

    /// An App whose clients live on `shards`.
    pub fn on_shards(
        config: Config,
        shutdown: watch::Receiver<bool>,
        shards: Arc<crate::shard::Shards>,
    ) -> Result<Arc<App>, crate::tls::TlsError> {
        let tls = crate::tls::TlsState::load(&config.tls)?;
        Ok(Arc::new(App {
            tls,
            admission: Arc::new(Admission::new(&config.server)),
            lifecycle: Lifecycle::new(shutdown),
            secrets: Default::default(),
            passwords: Default::default(),
            metrics: Default::default(),
            routes: Arc::new(crate::route::Registry::with_shards(
                config.clone(),
                shards.count(),
            )),
            shards,
            config,
            cancels: Arc::new(CancelRegistry::default()),
            cluster: Default::default(),
            realtime: Default::default(),
            feeds: Default::default(),
            large_message_kib: Default::default(),
        }))
    }

    /// Re-reads the configuration file: pools, users, databases and timeouts change for new
    /// logins (pool sizes in place), TLS certificates are re-read; clients stay connected. An
    /// invalid file changes nothing. `[server]` settings (listeners, process limits) need a
    /// restart.
    pub fn reload(&self) -> Result<String, String> {
        let Some(path) = self.routes.config().source.clone() else {
            self.tls
                .reload(&self.config.tls)
                .map_err(|e| e.to_string())?;
            return Ok("no configuration file (embedded default): TLS certificates re-read".into());
        };
        let fresh = Config::from_file(&path).map_err(|e| e.to_string())?;
        crate::tls::TlsState::load(&fresh.tls).map_err(|e| e.to_string())?;
        self.tls.reload(&fresh.tls).map_err(|e| e.to_string())?;
        let summary = format!(
            "{}: {} database(s), {} user(s)",
            path.display(),
            fresh.databases.len(),
            fresh.users.len()
        );
        self.routes.replace_config(fresh);
        Ok(summary)
    }
}
