//! Test harness: a real throwaway PostgreSQL cluster per test binary, real Shoal processes,
//! and a raw protocol client for the cases client libraries cannot express.
#![allow(dead_code)]
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

#[allow(dead_code)]
pub mod changes;
#[allow(dead_code)]
pub mod etcd;
#[allow(dead_code)]
pub mod fake_pg;
#[allow(dead_code)]
pub mod netns;
#[allow(dead_code)]
pub mod phoenix;
pub mod raw;
#[allow(dead_code)]
pub mod replication;
#[allow(dead_code)]
pub mod traffic;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Passwords of the roles the cluster is created with.
pub const APP_PASSWORD: &str = "app-secret";
pub const MD5_PASSWORD: &str = "md5-secret";
pub const PLAIN_PASSWORD: &str = "plain-secret";

pub struct Pg {
    pub port: u16,
    pub dir: PathBuf,
    bin: PathBuf,
    /// More `-c name=value` server options.
    extra_opts: String,
}

fn pg_bindir() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is installed under /usr/lib/postgresql (apt-get install postgresql)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    dirs.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    dirs.pop().expect("no PostgreSQL server binaries found")
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// A directory under /tmp that the PostgreSQL programs may write (owned by `postgres` when
/// we are root); kept after the test (the exit hook removes the clusters in it).
fn postgres_dir(prefix: &str) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .expect("temp dir")
        .keep();
    if is_root() {
        Command::new("chown")
            .args(["postgres:postgres"])
            .arg(&dir)
            .status()
            .expect("chown");
    }
    dir
}

/// Runs a PostgreSQL program, as the `postgres` user when we are root.
fn pg_command(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// A port free now, for a process under test to listen on, chosen below the kernel's
/// ephemeral range. A port from that range, once released here, can be handed straight back
/// to a `bind(…:0)` of the process under test (a Shoal listening on port 0 for SQL once took
/// the realtime port a test had picked) or become the local end of an outgoing connection.
/// Below the range only this function hands ports out, each once per test process.
pub fn free_port() -> u16 {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    const LOWEST: usize = 12_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or(32_768);
    let span = ephemeral.saturating_sub(LOWEST);
    if span < 1_000 {
        return TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
    }
    // Test processes of one run start from different places, so two of them running at
    // once rarely try the same ports; within a process the counter never repeats one.
    let start = std::process::id() as usize * 7_919;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOWEST + (start + n) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below the ephemeral range from {LOWEST}");
}

static CLUSTERS: Mutex<Vec<(PathBuf, PathBuf)>> = Mutex::new(Vec::new());

/// Shoal processes still running (a `Shoal` kept in a static is never dropped): killed at exit.
static SHOALS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Stops, at process exit, whatever the tests started and did not stop.
fn stop_at_exit() {
    static REGISTER: OnceLock<()> = OnceLock::new();
    REGISTER.get_or_init(|| {
        // SAFETY: registering a plain extern "C" function with atexit.
        #[allow(unsafe_code)]
        unsafe {
            libc::atexit(stop_clusters)
        };
    });
}

extern "C" fn stop_clusters() {
    for pid in SHOALS.lock().map(|s| s.clone()).unwrap_or_default() {
        // SAFETY: kill(2) on a child process we started and have not reaped.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL)
        };
    }
    let clusters = CLUSTERS.lock().map(|c| c.clone()).unwrap_or_default();
    for (bin, dir) in clusters {
        let _ = pg_command(&bin.join("pg_ctl"))
            .args(["-D"])
            .arg(dir.join("db"))
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

impl Pg {
    /// Creates and starts a cluster on `port` with SCRAM authentication and the test roles.
    pub fn start_on(port: u16) -> Pg {
        Self::start_with(port, &[], "")
    }

    /// As [`Pg::start_on`], with `files` (name, content) written into the data directory
    /// (owned by postgres, mode 0600: certificates and keys) and `extra_opts` added to the
    /// server's options.
    pub fn start_with(port: u16, files: &[(&str, &str)], extra_opts: &str) -> Pg {
        let bin = pg_bindir();
        let dir = postgres_dir("shoal-test-pg");
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, "postgres\n").unwrap();
        if is_root() {
            Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&pwfile)
                .status()
                .unwrap();
        }
        let out = pg_command(&bin.join("initdb"))
            .arg("-D")
            .arg(dir.join("db"))
            .args(["-U", "postgres", "-A", "scram-sha-256", "--no-sync"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .expect("initdb runs");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let hba = "host all md5user 127.0.0.1/32 md5\n\
                   host all plainuser 127.0.0.1/32 password\n\
                   host all all 127.0.0.1/32 scram-sha-256\n\
                   host replication postgres 127.0.0.1/32 scram-sha-256\n";
        std::fs::write(dir.join("db/pg_hba.conf"), hba).unwrap();
        CLUSTERS.lock().unwrap().push((bin.clone(), dir.clone()));
        stop_at_exit();
        for (name, content) in files {
            let path = dir.join("db").join(name);
            std::fs::write(&path, content).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            if is_root() {
                Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(&path)
                    .status()
                    .unwrap();
            }
        }
        let pg = Pg {
            port,
            dir,
            bin,
            extra_opts: extra_opts.to_owned(),
        };
        pg.pg_ctl_start();
        pg.psql_admin(&format!(
            "CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}' SUPERUSER;
             SET password_encryption = 'md5';
             CREATE ROLE md5user LOGIN PASSWORD '{MD5_PASSWORD}';
             CREATE ROLE plainuser LOGIN PASSWORD '{PLAIN_PASSWORD}';
             RESET password_encryption;"
        ));
        pg.psql_admin("CREATE DATABASE app OWNER app");
        pg
    }

    pub fn pg_ctl_start(&self) {
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories={} -c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off {}",
            self.port,
            self.dir.display(),
            self.extra_opts
        );
        let out = pg_command(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("db"))
            .args(["-o", &opts, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "start"])
            .output()
            .expect("pg_ctl runs");
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn stop(&self) {
        let _ = pg_command(&self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("db"))
            .args(["-m", "fast", "-w", "stop"])
            .output();
    }

    /// Runs SQL as the superuser through psql.
    pub fn psql_admin(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .env("PGPASSWORD", "postgres")
            .args([
                "-X",
                "-q",
                "-At",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
            ])
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-c")
            .arg(sql)
            .output()
            .expect("psql runs");
        assert!(
            out.status.success(),
            "psql failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A fresh database owned by `app`, so tests can count their own server connections.
    pub fn create_database(&self, name: &str) {
        self.psql_admin(&format!("CREATE DATABASE {name} OWNER app"));
    }

    /// Number of server backends connected to `db`.
    pub fn backends(&self, db: &str) -> usize {
        self.psql_admin(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND backend_type = 'client backend'"
        ))
        .parse()
        .unwrap()
    }

    /// Of [`Pg::backends`], the servers of pools: not the owner's fence session a cluster
    /// node holds per pool it owns (`application_name` "shoal fence").
    pub fn servers(&self, db: &str) -> usize {
        self.psql_admin(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND backend_type = 'client backend' AND application_name IS DISTINCT FROM 'shoal fence'"
        ))
        .parse()
        .unwrap()
    }

    pub fn bin(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }
}

/// The cluster shared by all tests of one test binary.
pub fn pg() -> &'static Pg {
    static PG: OnceLock<Pg> = OnceLock::new();
    PG.get_or_init(|| Pg::start_on(free_port()))
}

static DB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A unique database name for one test.
pub fn unique_db(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        DB_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A running Shoal process, killed on drop.
pub struct Shoal {
    child: Child,
    pub addr: SocketAddr,
    /// The management API's address, when `[api]` is configured.
    pub api: Option<SocketAddr>,
    /// The `[metrics] listen` address, when configured.
    pub metrics: Option<SocketAddr>,
    /// The `[realtime] listen` address, when configured.
    pub realtime: Option<SocketAddr>,
    pub log: Arc<Mutex<Vec<String>>>,
    pub config_dir: tempfile::TempDir,
}

/// Config text with a `[databases.NAME]` pointing at the test cluster, a trust user `raw`
/// (upstream as `app`) for raw-protocol tests, and the SCRAM user `app`. `extra` is appended.
pub fn base_config(pg: &Pg, dbs: &[&str], extra: &str) -> String {
    let mut c = String::from("[server]\nlisten = [\"127.0.0.1:0\"]\n");
    // The whole suite can run on either data plane.
    if let Ok(rt) = std::env::var("SHOAL_TEST_RUNTIME") {
        c.push_str(&format!("runtime = \"{rt}\"\n"));
    }
    if !extra.contains("[pool]") {
        c.push_str("[pool]\nquery_wait_timeout = 10\n");
    }
    c.push_str(extra);
    c.push('\n');
    for db in dbs {
        c.push_str(&format!(
            "[databases.{db}]\nhost = \"127.0.0.1\"\nport = {}\n",
            pg.port
        ));
    }
    if !extra.contains("[users.app]") {
        c.push_str(&format!("[users.app]\npassword = \"{APP_PASSWORD}\"\n"));
    }
    if !extra.contains("[users.raw]") {
        c.push_str(&format!(
            "[users.raw]\nauth_method = \"trust\"\nserver_user = \"app\"\nserver_password = \"{APP_PASSWORD}\"\n"
        ));
    }
    c
}

/// Adds `[server]` keys to a config made by [`base_config`].
pub fn with_server_keys(config: &str, keys: &str) -> String {
    config.replacen(
        "listen = [\"127.0.0.1:0\"]\n",
        &format!("listen = [\"127.0.0.1:0\"]\n{keys}\n"),
        1,
    )
}

impl Shoal {
    pub fn start(config: &str) -> Shoal {
        Self::start_with_env(config, &[])
    }

    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> Shoal {
        Self::start_with_args(config, env, &[])
    }

    /// As [`Shoal::start_with_env`], with more command-line arguments.
    pub fn start_with_args(config: &str, env: &[(&str, &str)], args: &[&str]) -> Shoal {
        Self::start_in(None, config, env, args)
    }

    /// As [`Shoal::start_with_args`], in network namespace `netns` if given (see
    /// [`netns`]).
    pub fn start_in(
        netns: Option<&str>,
        config: &str,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> Shoal {
        let config_dir = tempfile::tempdir().unwrap();
        let path = config_dir.path().join("shoal.toml");
        std::fs::write(&path, config).unwrap();
        let ready = config_dir.path().join("ready");
        let exe = env!("CARGO_BIN_EXE_shoal");
        // `ip netns exec` runs the program in place of itself: the child is Shoal.
        let mut cmd = match netns {
            None => Command::new(exe),
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, exe]);
                c
            }
        };
        cmd.arg("--config")
            .arg(&path)
            .arg("--ready-file")
            .arg(&ready)
            .args(args)
            .env("SHOAL_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("shoal starts");
        SHOALS.lock().unwrap().push(child.id());
        stop_at_exit();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        for stream in [
            Box::new(stdout) as Box<dyn std::io::Read + Send>,
            Box::new(stderr),
        ] {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    log.lock().unwrap().push(strip_ansi(&line));
                }
            });
        }
        // Shoal writes the ready file once every listener is bound.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        type Addrs = (
            SocketAddr,
            Option<SocketAddr>,
            Option<SocketAddr>,
            Option<SocketAddr>,
        );
        let (addr, api, metrics, realtime): Addrs = loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let tcp = text.lines().find_map(|l| l.strip_prefix("tcp "));
                let find = |prefix: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(prefix))
                        .and_then(|a| a.parse().ok())
                };
                break (
                    tcp.and_then(|a| a.parse().ok()).expect("a TCP listener"),
                    find("api "),
                    find("metrics "),
                    find("realtime "),
                );
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("shoal exited ({status}): {:?}", log.lock().unwrap());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "shoal did not start: {:?}",
                log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        Shoal {
            child,
            addr,
            api,
            metrics,
            realtime,
            log,
            config_dir,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The address the ready file gives for `what` ("serverless", "api", ...).
    pub fn ready_addr(&self, what: &str) -> Option<SocketAddr> {
        let text = std::fs::read_to_string(self.config_dir.path().join("ready")).ok()?;
        let prefix = format!("{what} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|a| a.parse().ok())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// libpq-style connection string for `user`/`db` through this Shoal.
    pub fn conninfo(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host={} port={} user={user} password={password} dbname={db}",
            self.addr.ip(),
            self.port()
        )
    }

    pub async fn connect(&self, db: &str) -> tokio_postgres::Client {
        self.connect_as("app", APP_PASSWORD, db).await
    }

    pub async fn connect_as(&self, user: &str, password: &str, db: &str) -> tokio_postgres::Client {
        self.try_connect(&self.conninfo(user, password, db))
            .await
            .unwrap_or_else(|e| panic!("connect through shoal: {e:?}"))
    }

    pub async fn try_connect(
        &self,
        conninfo: &str,
    ) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        Ok(client)
    }

    /// Sends `sig`; a SIGSTOP returns once every thread has stopped. (`kill` returns before
    /// a thread running on another core has taken the stop: bytes a test sends right after
    /// could still be served by the "paused" process.)
    pub fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child process.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(self.child.id() as i32, sig)
        };
        if sig == libc::SIGSTOP {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !all_threads_stopped(self.child.id()) {
                assert!(std::time::Instant::now() < deadline, "SIGSTOP not taken");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Waits for the process to exit, returning whether it exited successfully.
    pub fn wait(&mut self, timeout: Duration) -> Option<bool> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.success());
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log_count(needle) > 0
    }

    /// Its last `n` log lines, for a failure's message.
    #[allow(dead_code)]
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().unwrap();
        log[log.len().saturating_sub(n)..].join("\n")
    }

    /// Log lines containing `needle`: waits on events that happen more than once.
    #[allow(dead_code)]
    pub fn log_count(&self, needle: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }
}

impl Drop for Shoal {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let id = self.child.id();
        if let Ok(mut s) = SHOALS.lock() {
            s.retain(|&p| p != id);
        }
    }
}

/// Whether every thread of process `pid` is stopped (state `T` in its `stat`; the state
/// follows the command name's closing parenthesis).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['T', 't']))
        })
    })
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for n in chars.by_ref() {
                if n.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Direct connection to the test cluster as `app`.
pub async fn direct(db: &str) -> tokio_postgres::Client {
    direct_on(pg(), db).await
}

/// Direct connection to `pg` as `app`.
pub async fn direct_on(pg: &Pg, db: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port={} user=app password={APP_PASSWORD} dbname={db}",
            pg.port
        ),
        tokio_postgres::NoTls,
    )
    .await
    .expect("direct connection");
    tokio::spawn(conn);
    client
}

/// A tenant's API body: database `db` on `pg`, user `app` (pool size 2), and the fields of
/// `extra` (an object).
pub fn tenant_body(pg: &Pg, db: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut t = serde_json::json!({
        "db_host": "127.0.0.1",
        "db_port": pg.port,
        "db_database": db,
        "require_user": true,
        "users": [{"db_user": "app", "db_password": APP_PASSWORD, "pool_size": 2}],
    });
    if let (Some(t), Some(extra)) = (t.as_object_mut(), extra.as_object()) {
        t.extend(extra.clone());
    }
    serde_json::json!({ "tenant": t })
}

/// SQLSTATE of a tokio-postgres error, or a description if it has none.
pub fn code(e: &tokio_postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| format!("no sqlstate: {e}"))
}

/// Waits for `cond` to hold, polling; panics with `what` after `timeout`. For conditions in
/// another process (PostgreSQL's view of connections) that offer nothing to await.
pub async fn eventually(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A fresh database on the test cluster and a Shoal in front of it with `extra` config.
pub fn shoal_for(db: &str, extra: &str) -> Shoal {
    pg().create_database(db);
    Shoal::start(&base_config(pg(), &[db], extra))
}

/// The first column of each row a simple query returns.
pub async fn simple_rows(c: &tokio_postgres::Client, sql: &str) -> Vec<String> {
    c.simple_query(sql)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// Waits until PostgreSQL runs `query` (exactly, or as a prefix) in database `db`.
pub async fn wait_until_running(db: &str, query: &str) {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND state = 'active' AND query LIKE '{}%'",
        query.replace('\'', "''")
    );
    eventually(
        &format!("{query} running"),
        std::time::Duration::from_secs(10),
        || pg().psql_admin(&sql) == "1",
    )
    .await;
}

/// Runs `SELECT pg_sleep(30)` on `c`, cancels it with the client's cancel key once it runs
/// in `db`, and checks it ends with `57014`; gives the client back.
#[allow(dead_code)]
pub async fn cancel_a_sleep(c: tokio_postgres::Client, db: &str) -> tokio_postgres::Client {
    let token = c.cancel_token();
    let running = tokio::spawn(async move {
        let r = c.simple_query("SELECT pg_sleep(30)").await;
        (r.map(|_| ()), c)
    });
    wait_until_running(db, "SELECT pg_sleep(30)").await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let (r, c) = tokio::time::timeout(std::time::Duration::from_secs(10), running)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(code(&r.unwrap_err()), "57014");
    c
}

/// A CA made now and a server certificate it signs for `localhost` (PEM: CA, certificate,
/// key): no private key is checked in.
#[allow(dead_code)]
pub fn ca_and_server_cert() -> (String, String, String) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

/// A console query's rows through `s` as the console user `admin` (password
/// `admin-secret`): (column names, rows as text).
pub async fn console_rows(s: &Shoal, q: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let c = s.connect_as("admin", "admin-secret", "pgbouncer").await;
    let mut cols = Vec::new();
    let mut rows = Vec::new();
    for m in c.simple_query(q).await.unwrap() {
        match m {
            tokio_postgres::SimpleQueryMessage::RowDescription(d) => {
                cols = d.iter().map(|c| c.name().to_owned()).collect()
            }
            tokio_postgres::SimpleQueryMessage::Row(r) => rows.push(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or("").to_owned())
                    .collect(),
            ),
            _ => {}
        }
    }
    (cols, rows)
}

/// The API token of [`api`]'s requests.
pub const API_TEST_TOKEN: &str = "shoal-test-api-token";

/// `curl` to Shoal's API with the static token [`API_TEST_TOKEN`] (a Shoal started with it
/// in `SHOAL_API_TOKEN` and `token_env = "SHOAL_API_TOKEN"`); (status, JSON body).
pub fn api(
    s: &Shoal,
    method: &str,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", method])
        .arg(format!("http://{}{path}", s.api.expect("the API listens")))
        .args(["-H", &format!("Authorization: Bearer {API_TEST_TOKEN}")])
        .args([
            "-H",
            "Content-Type: application/json",
            "-d",
            &body.to_string(),
        ])
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        code.trim().parse().unwrap_or(0),
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

/// Shoal in front of `pg` with no databases of its own, its API taking [`API_TEST_TOKEN`]
/// (see [`api`]) and an embedded tenant store in the returned directory (keep it alive).
pub fn shoal_with_token_api(pg: &Pg) -> (Shoal, tempfile::TempDir) {
    shoal_with_token_api_and(pg, "")
}

/// [`shoal_with_token_api`] with `extra` configuration (whole sections).
pub fn shoal_with_token_api_and(pg: &Pg, extra: &str) -> (Shoal, tempfile::TempDir) {
    let data = tempfile::tempdir().unwrap();
    let config = base_config(
        pg,
        &[],
        &format!(
            "[api]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"SHOAL_API_TOKEN\"\n[store]\ndata_dir = \"{}\"\n{extra}",
            data.path().display()
        ),
    );
    let s = Shoal::start_with_env(
        &config,
        &[
            ("SHOAL_API_TOKEN", API_TEST_TOKEN),
            ("API_JWT_SECRET", "unused-secret-0123456789"),
        ],
    );
    (s, data)
}
