//! One connection to PostgreSQL: connect, authenticate as the configured upstream user, learn
//! the server's parameters and cancel key, and run the small queries the pooler itself needs
//! (parameter application, reset, rollback).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use shoal_wire::backend::{self, tag, ErrorFields};
use shoal_wire::{frontend, Frame, FrameError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::net::Stream;

mod cancel;
mod login;
mod queries;

pub use cancel::{forward, CancelTarget};
pub use queries::PipelineResult;

/// Largest message accepted from a server during login and pooler-issued queries; real results
/// stream through the relay, which has its own bound.
const SERVER_MAX_MESSAGE: usize = 1 << 30;

/// Where and as whom to connect upstream.
#[derive(Clone)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    pub family: crate::config::IpFamily,
    pub dbname: String,
    pub user: String,
    pub password: Option<String>,
    /// TLS to the server (`None`: `sslmode = "disable"`).
    pub tls: Option<std::sync::Arc<crate::upstream_tls::UpstreamTls>>,
    /// The settings `tls` was built from (to tell whether a new configuration changes them).
    pub tls_settings: crate::config::UpstreamTlsSettings,
    /// A secret to log in with instead of `password` (auth_query users).
    pub passthrough: Option<std::sync::Arc<crate::config::Passthrough>>,
    /// Reaches the server instead of `host`/`port` (no TLS then: the stream is what it is).
    pub dial: Option<std::sync::Arc<dyn Dial>>,
}

#[cfg(test)]
impl Upstream {
    /// An upstream nothing listens on, for parts that are built but never connect.
    pub fn nowhere() -> Upstream {
        Upstream {
            host: "127.0.0.1".into(),
            port: 1,
            family: Default::default(),
            dbname: "d".into(),
            user: "u".into(),
            password: None,
            tls: None,
            tls_settings: crate::config::UpstreamTlsSettings {
                mode: Default::default(),
                rootcert: None,
                cert: None,
                key: None,
                key_password: None,
                sni: false,
            },
            passthrough: None,
            dial: None,
        }
    }
}

/// Another way to reach a server than its host and port: an in-process stream in tests,
/// later a link through another node. The stream it gives is logged in like a socket.
pub trait Dial: Send + Sync {
    fn dial<'a>(&'a self, upstream: &'a Upstream) -> DialFuture<'a>;

    /// Where CancelRequests for the servers it reaches go (none: cancels are not sent).
    fn cancel_addr(&self, _upstream: &Upstream) -> Option<SocketAddr> {
        None
    }
}

pub type DialFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<Stream>> + Send + 'a>>;

/// Asks the server for TLS (SSLRequest) and does the handshake as `sslmode` says.
async fn negotiate_tls(
    mut tcp: TcpStream,
    up: &Upstream,
    tls: &crate::upstream_tls::UpstreamTls,
) -> Result<Stream, ServerError> {
    use crate::config::SslMode;
    let mut out = BytesMut::new();
    out.extend_from_slice(&8i32.to_be_bytes());
    out.extend_from_slice(&shoal_wire::startup::SSL_REQUEST_CODE.to_be_bytes());
    tcp.write_all(&out).await?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await?;
    match answer[0] {
        b'S' => {}
        b'N' if tls.mode == SslMode::Prefer => return Ok(Stream::Tcp(tcp)),
        b'N' => {
            return Err(ServerError::Tls(format!(
                "the server does not support SSL, but sslmode is {:?}",
                tls.mode
            )))
        }
        _ => return Err(ServerError::Protocol("bad answer to SSLRequest".into())),
    }
    let name = rustls::pki_types::ServerName::try_from(up.host.clone())
        .map_err(|e| ServerError::Tls(format!("invalid server name \"{}\": {e}", up.host)))?;
    let connector = tokio_rustls::TlsConnector::from(tls.config.clone());
    let stream = connector
        .connect(name, tcp)
        .await
        .map_err(|e| ServerError::Tls(e.to_string()))?;
    Ok(Stream::TlsUpstream(Box::new(stream)))
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}@{}:{}/{}",
            self.user, self.host, self.port, self.dbname
        )
    }
}

/// Why talking to a server failed. `Db` carries PostgreSQL's own error so it can be shown to
/// the client as is; the rest are transport problems.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("could not connect to server {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("timed out connecting to server {0}")]
    ConnectTimeout(String),
    #[error("server connection failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("server closed the connection unexpectedly")]
    Closed,
    #[error("server sent an invalid message: {0}")]
    Protocol(String),
    #[error("server asks for a password but none is configured for user \"{0}\"")]
    NoPassword(String),
    #[error("{}", .0.message)]
    Db(ErrorFields),
    #[error("TLS to the server failed: {0}")]
    Tls(String),
    #[error("cannot log in upstream without the password: {0}")]
    Passthrough(String),
    #[error("server did not answer within server_reset_timeout ({0:?}) while being prepared for a client")]
    ResetTimeout(Duration),
}

impl From<FrameError> for ServerError {
    fn from(e: FrameError) -> Self {
        ServerError::Protocol(e.to_string())
    }
}

/// Records a ParameterStatus in a server's reported parameters; returns whether the value
/// changed. (A free function so the relay can call it while it reads the server's buffer.)
pub fn set_param_bytes(params: &mut Vec<(String, String)>, name: &[u8], value: &[u8]) -> bool {
    let name = String::from_utf8_lossy(name);
    let value = String::from_utf8_lossy(value);
    match params.iter_mut().find(|(k, _)| *k == name) {
        Some(slot) if slot.1 == value => false,
        Some(slot) => {
            value.as_ref().clone_into(&mut slot.1);
            true
        }
        None => {
            params.push((name.into_owned(), value.into_owned()));
            true
        }
    }
}

static NEXT_SERVER_ID: AtomicU64 = AtomicU64::new(1);

/// A live, authenticated server connection.
pub struct ServerConn {
    pub id: u64,
    pub stream: Stream,
    /// Bytes read from the server and not yet handled.
    pub buf: BytesMut,
    /// Where cancel requests go (unspecified for a dialed stream, which takes none).
    pub addr: SocketAddr,
    pub process_id: i32,
    pub secret_key: i32,
    /// Current values of the parameters the server reports (ParameterStatus), kept up to date.
    pub params: Vec<(String, String)>,
    /// What the server's session holds for its clients (changed only through its methods).
    pub session: crate::server_session::ServerSession,
    /// [`crate::clock::now_ms`] at connect and at the last checkin.
    pub created: u64,
    pub last_used: u64,
    /// Dropped with the connection, however it ends: how its pool's list of servers (for
    /// `SHOW SERVERS`) learns that it is gone, without this module knowing pools.
    pub tracker: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// The shard whose runtime registered this socket (its idle list takes it back).
    pub shard: usize,
}

impl Drop for ServerConn {
    fn drop(&mut self) {
        // The tracker goes before the socket closes: whoever it tells may hold the socket's
        // descriptor number, which must not outlive the socket.
        self.tracker.take();
    }
}

/// Connects to the first reachable address of the upstream's host in its address family.
async fn connect_tcp(up: &Upstream, addr_text: &str) -> std::io::Result<TcpStream> {
    use crate::config::IpFamily;
    if up.family == IpFamily::Any {
        return TcpStream::connect(addr_text).await;
    }
    let mut last = None;
    for addr in tokio::net::lookup_host((up.host.as_str(), up.port)).await? {
        let wanted = match up.family {
            IpFamily::V4 => addr.is_ipv4(),
            IpFamily::V6 => addr.is_ipv6(),
            IpFamily::Any => true,
        };
        if !wanted {
            continue;
        }
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            format!("{} has no {:?} address", up.host, up.family),
        )
    }))
}

/// The stream to the server, TLS negotiated, and the address cancel requests go to.
async fn open(up: &Upstream, addr_text: &str) -> Result<(Stream, SocketAddr), ServerError> {
    if let Some(dial) = &up.dial {
        let stream = dial.dial(up).await.map_err(|source| ServerError::Connect {
            addr: addr_text.to_owned(),
            source,
        })?;
        let cancel = dial.cancel_addr(up);
        return Ok((
            stream,
            cancel.unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
        ));
    }
    let tcp = connect_tcp(up, addr_text)
        .await
        .map_err(|source| ServerError::Connect {
            addr: addr_text.to_owned(),
            source,
        })?;
    tcp.set_nodelay(true)?;
    let addr = tcp.peer_addr()?;
    let stream = match &up.tls {
        None => Stream::Tcp(tcp),
        Some(tls) => negotiate_tls(tcp, up, tls).await?,
    };
    Ok((stream, addr))
}

impl ServerConn {
    pub async fn connect(up: &Upstream, timeout: Duration) -> Result<ServerConn, ServerError> {
        Self::connect_with(up, timeout, &[]).await
    }

    /// [`ServerConn::connect`] with more startup parameters (`replication`, for the cache's
    /// change stream).
    pub async fn connect_with(
        up: &Upstream,
        timeout: Duration,
        extra: &[(&str, &str)],
    ) -> Result<ServerConn, ServerError> {
        let addr_text = format!("{}:{}", up.host, up.port);
        let (stream, addr) = match crate::timer::timeout(timeout, open(up, &addr_text)).await {
            Err(_) => return Err(ServerError::ConnectTimeout(addr_text)),
            Ok(r) => r?,
        };
        let now = crate::clock::now_ms();
        let mut conn = ServerConn {
            id: NEXT_SERVER_ID.fetch_add(1, Ordering::Relaxed),
            stream,
            buf: BytesMut::with_capacity(8192),
            addr,
            process_id: 0,
            secret_key: 0,
            params: Vec::new(),
            session: Default::default(),
            created: now,
            last_used: now,
            tracker: None,
            shard: crate::shard::reactor(),
        };
        match crate::timer::timeout(timeout, conn.login(up, extra)).await {
            Err(_) => Err(ServerError::ConnectTimeout(addr_text)),
            Ok(r) => r.map(|_| conn),
        }
    }

    async fn login(&mut self, up: &Upstream, extra: &[(&str, &str)]) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        let mut params = vec![("user", up.user.as_str()), ("database", up.dbname.as_str())];
        params.extend_from_slice(extra);
        frontend::startup(&mut out, &params);
        self.stream.write_all(&out).await?;
        let mut auth = login::Answerer::new(up);
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                tag::AUTHENTICATION => {
                    out.clear();
                    if auth.answer(backend::parse_auth(frame.body())?, &mut out)? {
                        self.stream.write_all(&out).await?;
                    }
                }
                tag::BACKEND_KEY_DATA => {
                    (self.process_id, self.secret_key) =
                        backend::parse_backend_key_data(frame.body())?;
                }
                tag::READY_FOR_QUERY => return Ok(()),
                _ => self.observe(&frame)?,
            }
        }
    }

    /// Reads one whole message, for the pooler's own exchanges (not the relay).
    pub async fn read_frame(&mut self) -> Result<Frame, ServerError> {
        loop {
            if let Some(f) = Frame::split(&mut self.buf, SERVER_MAX_MESSAGE)? {
                return Ok(f);
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(ServerError::Closed);
            }
        }
    }

    /// Handles messages that may arrive at any time: parameter changes and errors.
    pub fn observe(&mut self, frame: &Frame) -> Result<(), ServerError> {
        match frame.tag() {
            tag::PARAMETER_STATUS => {
                let (name, value) = backend::parse_parameter_status(frame.body())?;
                self.set_param(name, value);
                Ok(())
            }
            tag::ERROR_RESPONSE => Err(ServerError::Db(backend::parse_error(frame.body())?)),
            _ => Ok(()),
        }
    }

    pub fn set_param(&mut self, name: &str, value: &str) {
        match self.params.iter_mut().find(|(k, _)| k == name) {
            Some(slot) => value.clone_into(&mut slot.1),
            None => self.params.push((name.to_owned(), value.to_owned())),
        }
    }

    /// Runs a simple query whose results the pooler does not need, and fails on the first
    /// ErrorResponse (after draining to ReadyForQuery so the connection stays usable).
    pub async fn simple_query(&mut self, sql: &str) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        frontend::query(&mut out, sql);
        self.session.unnamed_dropped();
        self.stream.write_all(&out).await?;
        self.read_until_ready().await
    }

    /// Makes the session what `client` expects: nothing a previous client left, its startup
    /// `params`, its held `sets`. Costs nothing when the server already matches; otherwise
    /// one write and one wait, bounded by `timeout` (the caller drops a server that fails).
    pub async fn prepare_for(
        &mut self,
        client: u64,
        params: &[(String, String)],
        sets: Option<&crate::sets::SessionSets>,
        settings: &crate::config::PoolSettings,
    ) -> Result<(), ServerError> {
        let always = settings.server_reset == crate::config::ServerReset::Always;
        let timeout = settings.reset_timeout;
        let plan = self
            .session
            .plan(client, params, sets.map_or(0, |s| s.fingerprint), always);
        if plan.is_empty() {
            return Ok(());
        }
        // Boxed: this future is part of every transaction's, and the usual case needs nothing.
        Box::pin(self.apply_plan(plan, params, sets, timeout)).await
    }

    /// Runs what [`ServerConn::prepare_for`] found missing, in one round trip.
    async fn apply_plan(
        &mut self,
        plan: crate::server_session::Plan,
        params: &[(String, String)],
        sets: Option<&crate::sets::SessionSets>,
        timeout: Duration,
    ) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        let mut replies = 0;
        if plan.clean {
            frontend::query(&mut out, crate::params::CLEAN_SESSION_SQL);
            replies += 1;
        }
        if plan.reset_params {
            frontend::query(&mut out, "RESET ALL");
            replies += 1;
        }
        if plan.apply_params {
            frontend::parse_bind_execute(
                &mut out,
                &crate::params::apply_statement(params.len()),
                &crate::params::apply_values(params),
            );
            replies += 1;
        }
        if let Some(s) = sets.filter(|_| plan.replay_sets) {
            frontend::query(&mut out, &s.replay_sql());
            replies += 1;
        }
        match crate::timer::timeout(timeout, self.run_batch(&out, replies)).await {
            Ok(r) => r,
            Err(_) => Err(ServerError::ResetTimeout(timeout)),
        }
    }

    /// Runs a reset query (session mode's `server_reset_query`): afterwards nothing of any
    /// client is left.
    pub async fn reset_session(&mut self, query: &str) -> Result<(), ServerError> {
        self.session.reset();
        self.simple_query(query).await
    }

    /// Reads replies to a pooler-issued request up to ReadyForQuery; fails with the first
    /// ErrorResponse once the server is ready again.
    async fn read_until_ready(&mut self) -> Result<(), ServerError> {
        let mut first_error = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                tag::READY_FOR_QUERY => {
                    return match first_error {
                        Some(e) => Err(ServerError::Db(e)),
                        None => Ok(()),
                    }
                }
                tag::ERROR_RESPONSE => {
                    let e = backend::parse_error(frame.body())?;
                    if e.is_fatal() {
                        return Err(ServerError::Db(e));
                    }
                    first_error.get_or_insert(e);
                }
                _ => {
                    // Notices and row data of pooler queries are not for any client.
                    if frame.tag() == tag::PARAMETER_STATUS {
                        self.observe(&frame)?;
                    }
                }
            }
        }
    }

    /// Re-registers the socket with this thread's shard, so its wake-ups stay on the thread
    /// of the client using it (per-core data plane). TLS connections stay where they are.
    pub fn follow_to_this_shard(mut self: Box<Self>) -> std::io::Result<Box<Self>> {
        let here = crate::shard::reactor();
        if self.shard == here || here == crate::shard::NO_SHARD {
            return Ok(self);
        }
        match std::mem::replace(&mut self.stream, Stream::Upgrading) {
            Stream::Tcp(tcp) => {
                // Leaves the other shard's reactor and joins this one's: two epoll_ctl calls,
                // the descriptor unchanged.
                let std = tcp.into_std()?;
                self.stream = Stream::Tcp(TcpStream::from_std(std)?);
                self.shard = here;
                Ok(self)
            }
            tls => {
                self.stream = tls;
                Ok(self)
            }
        }
    }

    /// True when the server has closed the connection or sent something unsolicited (such as
    /// a FATAL before terminating) while it sat idle in the pool: it must not be reused.
    ///
    /// Costs no system call in the usual case: reads drain the socket through `poll_read`,
    /// which clears its readiness, so readiness here means something did arrive.
    pub fn is_stale(&mut self) -> bool {
        !self.buf.is_empty() || self.stream.peer_spoke()
    }

    /// Where a CancelRequest for this server's running query goes.
    pub fn cancel_target(&self) -> CancelTarget {
        CancelTarget::new(self.addr, self.process_id, self.secret_key)
    }

    /// Sends Terminate and closes; errors are irrelevant at this point.
    pub async fn close(mut self) {
        let mut out = BytesMut::new();
        frontend::terminate(&mut out);
        let _ = crate::timer::timeout(Duration::from_secs(1), self.stream.write_all(&out)).await;
    }
}
