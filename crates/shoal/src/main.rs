use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use shoal::config::Config;

/// Shoal: a PostgreSQL connection pooler.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Configuration file (TOML). Without it Shoal runs on its embedded default: one pool in
    /// front of PostgreSQL at 127.0.0.1:5432 (see `scripts/quickstart`).
    #[arg(short, long, global = true)]
    config: Option<PathBuf>,
    /// Once every listener is bound, write their addresses to this file (one per line:
    /// `tcp ADDR` or `unix PATH`), for supervisors and tests to wait on.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Zero-downtime restarts: listen for a successor on this Unix socket; started with the
    /// same flag while another Shoal runs, take its listening sockets over (it then drains and
    /// exits). See docs/operations.md.
    #[arg(long)]
    upgrade_socket: Option<PathBuf>,
    /// Log format: `text` (default) or `json` (one object per line, for log shippers).
    #[arg(long, env = "SHOAL_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Colours in text logs: `auto` (only when writing to a terminal and `NO_COLOR` is
    /// unset), `always` or `never`.
    #[arg(long, env = "SHOAL_LOG_COLOR", default_value = "auto")]
    log_color: LogColor,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogColor {
    Auto,
    Always,
    Never,
}

impl LogColor {
    /// Escape codes only where a person reads them: a file or a pipe gets plain text.
    fn enabled(self) -> bool {
        use std::io::IsTerminal;
        match self {
            LogColor::Always => true,
            LogColor::Never => false,
            LogColor::Auto => {
                std::io::stdout().is_terminal()
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
            }
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Validate a configuration file and explain any error with its line.
    CheckConfig { file: PathBuf },
    /// Print the embedded default configuration.
    DefaultConfig,
    /// Write a Shoal configuration equivalent to a PgBouncer one to stdout; what cannot be
    /// carried over is named on stderr (and in the file's comments).
    ImportPgbouncer {
        /// PgBouncer's `pgbouncer.ini`.
        ini: PathBuf,
        /// Its `auth_file` (`userlist.txt`): the users and their passwords.
        userlist: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig { file }) => {
            let c = Config::from_file(&file)?;
            shoal::tls::TlsState::load(&c.tls)?;
            println!(
                "{}: OK ({} database(s), {} user(s))",
                file.display(),
                c.databases.len(),
                c.users.len()
            );
            return Ok(());
        }
        Some(Command::DefaultConfig) => {
            print!("{}", shoal::config::EMBEDDED_DEFAULT);
            return Ok(());
        }
        Some(Command::ImportPgbouncer { ini, userlist }) => {
            return import_pgbouncer(&ini, userlist.as_deref());
        }
        None => {}
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("SHOAL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    match cli.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_target(false)
            .with_ansi(cli.log_color.enabled())
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_target(false)
            .with_current_span(false)
            .init(),
    }
    let config = match &cli.config {
        Some(path) => Config::from_file(path)?,
        None => {
            tracing::info!("no --config given: using the embedded default configuration");
            Config::embedded_default()?
        }
    };
    let rt = match config.server.runtime {
        shoal::config::Runtime::MultiThread => {
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            if config.server.worker_threads > 0 {
                rt.worker_threads(config.server.worker_threads);
            }
            rt.enable_all().build().context("starting the runtime")?
        }
        // The control plane's runtime, on this thread; `serve` starts the shard threads.
        shoal::config::Runtime::PerCore => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?,
    };
    rt.block_on(async {
        let stop = async {
            use tokio::signal::unix::{signal, SignalKind};
            let (Ok(mut int), Ok(mut term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = int.recv() => tracing::info!("SIGINT received"),
                _ = term.recv() => tracing::info!("SIGTERM received"),
            }
        };
        shoal::run::serve(
            config,
            cli.ready_file.as_deref(),
            cli.upgrade_socket.as_deref(),
            stop,
        )
        .await
    })?;
    Ok(())
}

/// `shoal import-pgbouncer`: the configuration on stdout, the notes on stderr, and the result
/// checked as `check-config` would.
fn import_pgbouncer(
    ini: &std::path::Path,
    userlist: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
    };
    let ini_text = read(ini)?;
    let users = userlist.map(read).transpose()?;
    let got = shoal::config::pgbouncer::import(&ini_text, users.as_deref());
    print!("{}", got.toml);
    for n in &got.notes {
        eprintln!("note: {n}");
    }
    if let Err(e) = Config::parse(&got.toml, "the imported configuration", &|k| {
        std::env::var(k).ok()
    }) {
        eprintln!("The imported configuration needs these changes before Shoal runs it:\n{e}");
    }
    Ok(())
}
