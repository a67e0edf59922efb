//! The admin console: a virtual database (`pgbouncer`, or `shoal`) that `[admin] users`
//! reach with psql or any driver, speaking PgBouncer's commands (`SHOW POOLS`, `PAUSE`,
//! `RELOAD`, …) with PgBouncer's column names, so existing tools work unchanged.
//! `[admin] stats_users` may only run `SHOW`.

pub mod command;
mod replicas;
pub mod show;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use shoal_wire::{backend, sqlstate, Frame};

use crate::app::App;
use crate::net::Stream;
use command::Command;
use show::{Kind, ResultSet};

pub use crate::route::is_console;

/// What the console lets a user do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Admin,
    Stats,
}

/// The access `[admin]` grants `user`, if any.
pub fn access(app: &App, user: &str) -> Option<Access> {
    let a = &app.routes.config().admin;
    if a.users.iter().any(|u| u == user) {
        Some(Access::Admin)
    } else if a.stats_users.iter().any(|u| u == user) {
        Some(Access::Stats)
    } else {
        None
    }
}

/// ParameterStatus values the console reports at login.
pub const PARAMS: &[(&str, &str)] = &[
    ("server_version", "16.0 (Shoal console)"),
    ("server_encoding", "UTF8"),
    ("client_encoding", "UTF8"),
    ("DateStyle", "ISO, MDY"),
    ("integer_datetimes", "on"),
    ("standard_conforming_strings", "on"),
    ("TimeZone", "UTC"),
    ("application_name", ""),
];

fn encode_result(out: &mut BytesMut, r: &ResultSet, tag: &str) {
    backend::put_message(out, b'T', |b| {
        b.put_i16(r.columns.len() as i16);
        for (name, kind) in &r.columns {
            backend::put_cstr(b, name);
            b.put_i32(0);
            b.put_i16(0);
            match kind {
                Kind::Text => {
                    b.put_i32(25);
                    b.put_i16(-1);
                }
                Kind::Int => {
                    b.put_i32(20);
                    b.put_i16(8);
                }
            }
            b.put_i32(-1);
            b.put_i16(0);
        }
    });
    for row in &r.rows {
        backend::put_message(out, b'D', |b| {
            b.put_i16(row.len() as i16);
            for v in row {
                match v {
                    Some(s) => {
                        b.put_i32(s.len() as i32);
                        b.put_slice(s.as_bytes());
                    }
                    None => b.put_i32(-1),
                }
            }
        });
    }
    command_complete(out, tag);
}

fn command_complete(out: &mut BytesMut, tag: &str) {
    backend::put_message(out, b'C', |b| backend::put_cstr(b, tag));
}

fn error(out: &mut BytesMut, code: &str, message: &str) {
    backend::error_response(out, backend::Severity::Error, code, message, None);
}

/// Serves a logged-in console user until they leave.
pub async fn serve(app: Arc<App>, stream: &mut Stream, user: String, access: Access) {
    tracing::info!(user = %crate::logsafe::Escaped(&user), ?access, "admin console login");
    let mut buf = BytesMut::with_capacity(1024);
    let mut skipping = false;
    loop {
        let frame = loop {
            match Frame::split(&mut buf, 1 << 20) {
                Ok(Some(f)) => break Some(f),
                Ok(None) => {}
                Err(_) => break None,
            }
            match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        };
        let Some(frame) = frame else {
            let mut out = BytesMut::new();
            backend::error_response(
                &mut out,
                backend::Severity::Fatal,
                sqlstate::PROTOCOL_VIOLATION,
                "invalid message framing",
                None,
            );
            let _ = stream.write_all(&out).await;
            return;
        };
        let mut out = BytesMut::new();
        match frame.tag() {
            b'X' => return,
            b'Q' => {
                let text = String::from_utf8_lossy(frame.body());
                let text = text.trim_end_matches('\0');
                for stmt in command::statements(text) {
                    if !run(&app, stmt, access, &mut out).await {
                        break;
                    }
                }
                backend::ready_for_query(&mut out, b'I');
            }
            // The extended protocol is not served: answer once, at the Sync.
            b'S' if skipping => {
                skipping = false;
                error(
                    &mut out,
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    "the admin console accepts simple queries only",
                );
                backend::ready_for_query(&mut out, b'I');
            }
            b'P' | b'B' | b'D' | b'E' | b'H' | b'C' => skipping = true,
            b'S' => backend::ready_for_query(&mut out, b'I'),
            other => {
                backend::error_response(
                    &mut out,
                    backend::Severity::Fatal,
                    sqlstate::PROTOCOL_VIOLATION,
                    &format!("unexpected message type {:?}", other as char),
                    None,
                );
                let _ = stream.write_all(&out).await;
                return;
            }
        }
        if !out.is_empty() && stream.write_all(&out).await.is_err() {
            return;
        }
    }
}

/// Runs one statement, writing its result; false stops the rest of the query string.
async fn run(app: &Arc<App>, text: &str, access: Access, out: &mut BytesMut) -> bool {
    let cmd = match command::parse(text) {
        Ok(c) => c,
        Err(e) => {
            error(out, "42601", &e);
            return false;
        }
    };
    if access == Access::Stats && !cmd.read_only() {
        error(
            out,
            sqlstate::INSUFFICIENT_PRIVILEGE,
            "admin.stats_users may only run SHOW commands",
        );
        return false;
    }
    match cmd {
        Command::Empty => backend::put_message(out, b'I', |_| {}),
        Command::Show(what) => match show::show(app, &what) {
            Ok(r) => encode_result(out, &r, "SHOW"),
            Err(e) => {
                error(out, sqlstate::FEATURE_NOT_SUPPORTED, &e);
                return false;
            }
        },
        Command::Reload => match app.reload() {
            Ok(what) => {
                tracing::info!(config = %what, "RELOAD: configuration reloaded");
                command_complete(out, "RELOAD");
            }
            Err(e) => {
                tracing::error!(error = %e, "RELOAD: configuration not reloaded");
                error(
                    out,
                    sqlstate::CONFIG_FILE_ERROR,
                    &format!("configuration not reloaded (the old one stays): {e}"),
                );
                return false;
            }
        },
        Command::Pause(_)
        | Command::Suspend
        | Command::Resume(_)
        | Command::Kill(_)
        | Command::WaitClose(_)
        | Command::Reconnect(_)
        | Command::Disable(_)
        | Command::Enable(_) => control_pools(app, cmd, out).await,
        Command::Set(text) => {
            error(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                &format!(
                    "\"{text}\": Shoal's settings change in its configuration file: edit it and \
                     run RELOAD (SHOW CONFIG shows what is in effect)"
                ),
            );
            return false;
        }
        Command::Shutdown => {
            tracing::info!(
                clients = app.admission.clients.load(Ordering::Relaxed),
                "SHUTDOWN requested from the admin console"
            );
            app.lifecycle.shutdown_request.notify_one();
            command_complete(out, "SHUTDOWN");
        }
    }
    true
}

/// The commands that hold, release, end or empty pools (PgBouncer's, with its tags).
async fn control_pools(app: &Arc<App>, cmd: Command, out: &mut BytesMut) {
    match cmd {
        Command::Pause(db) => {
            let pools = app.routes.pause(db.as_deref());
            tracing::info!(database = ?db, pools = pools.len(), "PAUSE: waiting for running transactions");
            // Running transactions finish; then idle servers are closed so PostgreSQL can
            // be restarted under the paused pools.
            while pools.iter().any(|p| p.in_use() > 0) {
                crate::timer::sleep(Duration::from_millis(10)).await;
            }
            for p in &pools {
                p.close_idle().await;
            }
            tracing::info!(database = ?db, "PAUSE: done");
            command_complete(out, "PAUSE");
        }
        Command::Suspend => {
            let pools = app.routes.pause(None);
            while pools.iter().any(|p| p.in_use() > 0) {
                crate::timer::sleep(Duration::from_millis(10)).await;
            }
            tracing::info!("SUSPEND: every pool paused, running transactions done");
            command_complete(out, "SUSPEND");
        }
        Command::Resume(db) => {
            app.routes.resume(db.as_deref());
            tracing::info!(database = ?db, "RESUME");
            command_complete(out, "RESUME");
        }
        Command::Kill(db) => {
            let n = app
                .routes
                .kill(
                    &db,
                    &format!("database \"{db}\" was killed by an administrator"),
                )
                .await;
            tracing::info!(database = %db, clients = n, "KILL");
            command_complete(out, "KILL");
        }
        Command::WaitClose(db) => {
            while app.routes.retired_servers(db.as_deref()) > 0 {
                crate::timer::sleep(Duration::from_millis(20)).await;
            }
            command_complete(out, "WAIT_CLOSE");
        }
        Command::Reconnect(db) => {
            let pools = app.routes.pools_of(db.as_deref());
            for p in &pools {
                p.reconnect().await;
            }
            tracing::info!(database = ?db, pools = pools.len(), "RECONNECT: servers replaced as released");
            command_complete(out, "RECONNECT");
        }
        Command::Disable(ref db) | Command::Enable(ref db) => {
            let disable = matches!(cmd, Command::Disable(_));
            app.routes.set_disabled(db, disable);
            let tag = if disable { "DISABLE" } else { "ENABLE" };
            tracing::info!(database = %db, "{tag}");
            command_complete(out, tag);
        }
        _ => {}
    }
}
