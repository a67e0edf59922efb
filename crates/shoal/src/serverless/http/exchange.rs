//! One HTTP query's conversation with its session: the handler speaks the PostgreSQL
//! protocol for the HTTP client, over the in-memory pipe to a session on a data-plane
//! shard, so the login, routing, pools, limits, rules and cache are a TCP client's.
//! The login comes first (no server is checked out before the password is checked); the
//! statements then go in one write (Parse, Bind, Describe, Execute each, one Sync), so a
//! one-shot query holds a server for its implicit transaction only, and a batch for its
//! BEGIN … COMMIT.

use bytes::BytesMut;
use shoal_wire::backend::{self, tag, AuthRequest};
use shoal_wire::{frontend, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};

use super::request::{Login, Shape, Statement, Work};
use super::results::{error_json, Answer, AnswerError, Step};

/// Why an exchange gave no answer of rows.
#[derive(Debug)]
pub enum Failure {
    /// The login was refused: the ErrorResponse's SQLSTATE and fields (JSON).
    Login {
        code: String,
        error: Vec<u8>,
    },
    /// A statement failed: its ErrorResponse's fields (JSON).
    Statement {
        code: String,
        error: Vec<u8>,
    },
    TooLarge(usize),
    /// The session had ended before it read the request (a kept session that was closed
    /// meanwhile): nothing ran, so the request may be tried on a fresh one.
    Closed,
    /// The session ended or spoke out of turn (a bug, or Shoal shutting down).
    Session(String),
}

pub struct Exchange {
    to: WriteHalf<DuplexStream>,
    from: ReadHalf<DuplexStream>,
    buf: BytesMut,
    /// The session's cancel key, once logged in.
    pub key: Option<(i32, i32)>,
    /// Largest message read from the session.
    max_message: usize,
    pub logged_in_at: std::time::Instant,
}

impl Exchange {
    pub fn new(pipe: DuplexStream, max_message: usize) -> Exchange {
        let (from, to) = tokio::io::split(pipe);
        Exchange {
            to,
            from,
            buf: BytesMut::with_capacity(8 * 1024),
            key: None,
            max_message,
            logged_in_at: std::time::Instant::now(),
        }
    }

    async fn send(&mut self, out: &[u8]) -> Result<(), Failure> {
        self.to.write_all(out).await.map_err(|_| Failure::Closed)
    }

    /// Whether nothing arrived from the session since its last answer and it has not
    /// ended: a session waiting for its next request.
    pub fn is_quiet(&mut self) -> bool {
        use futures_util::FutureExt;
        self.buf.is_empty() && self.from.read_buf(&mut self.buf).now_or_never().is_none()
    }

    async fn next(&mut self) -> Result<Frame, Failure> {
        loop {
            match Frame::split(&mut self.buf, self.max_message) {
                Ok(Some(f)) => return Ok(f),
                Ok(None) => {}
                Err(e) => return Err(Failure::Session(e.to_string())),
            }
            match self.from.read_buf(&mut self.buf).await {
                Ok(0) | Err(_) => {
                    return Err(Failure::Session(
                        "the session ended before answering".into(),
                    ))
                }
                Ok(_) => {}
            }
        }
    }

    /// Logs in as the connection string says, up to ReadyForQuery.
    pub async fn login(&mut self, login: &Login) -> Result<(), Failure> {
        let mut out = BytesMut::with_capacity(256);
        let app_name = login
            .application_name
            .as_deref()
            .unwrap_or("shoal serverless http");
        frontend::startup(
            &mut out,
            &[
                ("user", &login.user),
                ("database", &login.database),
                ("application_name", app_name),
                // Neon's JSON is UTF-8.
                ("client_encoding", "UTF8"),
            ],
        );
        self.send(&out).await?;
        loop {
            let f = self.next().await?;
            match f.tag() {
                tag::AUTHENTICATION => match backend::parse_auth(f.body()) {
                    Ok(AuthRequest::Ok) => {}
                    Ok(AuthRequest::Cleartext) => {
                        out.clear();
                        frontend::password(&mut out, &login.password);
                        self.send(&out).await?;
                    }
                    _ => return Err(Failure::Session("an unexpected authentication".into())),
                },
                tag::BACKEND_KEY_DATA => self.key = backend::parse_backend_key_data(f.body()).ok(),
                tag::ERROR_RESPONSE => {
                    let error =
                        error_json(f.body()).map_err(|e| Failure::Session(e.to_string()))?;
                    return Err(Failure::Login {
                        code: code_of(&error),
                        error,
                    });
                }
                tag::READY_FOR_QUERY => {
                    self.logged_in_at = std::time::Instant::now();
                    return Ok(());
                }
                _ => {}
            }
        }
    }

    /// Runs the request's statements and builds the answer.
    pub async fn run(
        &mut self,
        work: &Work,
        preamble: Option<&Statement>,
        shape: Shape,
        max_response: usize,
    ) -> Result<Vec<u8>, Failure> {
        let mut out = BytesMut::with_capacity(1024);
        // The preamble (a token's claims, set transaction-local) runs in the statements'
        // transaction: a batch's, after its BEGIN, or the implicit one that lasts until Sync.
        let hidden = |out: &mut BytesMut| {
            if let Some(p) = preamble {
                statement(out, p, false);
            }
        };
        let answer = match work {
            Work::One(s) => {
                hidden(&mut out);
                statement(&mut out, s, true);
                Answer::new(shape, max_response, false, 1 + preamble.is_some() as usize)
            }
            Work::Batch { begin, statements } => {
                let bare = |text: &str| Statement {
                    text: text.to_owned(),
                    params: Vec::new(),
                };
                statement(&mut out, &bare(begin), false);
                hidden(&mut out);
                for s in statements {
                    statement(&mut out, s, true);
                }
                statement(&mut out, &bare("COMMIT"), false);
                let n = statements.len() + 2 + preamble.is_some() as usize;
                Answer::new(shape, max_response, true, n)
            }
        };
        let mut answer = match preamble {
            Some(_) => answer.after_preamble(),
            None => answer,
        };
        frontend::sync(&mut out);
        self.send(&out).await?;
        let status = loop {
            let f = self.next().await?;
            match answer.take(f.tag(), f.body()) {
                Ok(Step::More) => {}
                Ok(Step::Ready(status)) => break status,
                Ok(Step::CopyIn) => {
                    out.clear();
                    backend::put_message(&mut out, frontend::tag::COPY_FAIL, |b| {
                        backend::put_cstr(b, "COPY FROM STDIN cannot be fed over HTTP")
                    });
                    self.send(&out).await?;
                }
                Err(AnswerError::TooLarge(n)) => return Err(Failure::TooLarge(n)),
                Err(e) => return Err(Failure::Session(e.to_string())),
            }
        };
        if status != b'I' {
            // A failed batch (or a statement that left a transaction open): end it here
            // rather than leave it to the session's end.
            out.clear();
            frontend::query(&mut out, "ROLLBACK");
            self.send(&out).await?;
            while self.next().await?.tag() != tag::READY_FOR_QUERY {}
        }
        if self.buf.capacity() > 64 * 1024 {
            // A large answer passed: a session kept for the next query holds little.
            self.buf = BytesMut::with_capacity(8 * 1024);
        }
        if let Some(error) = answer.error() {
            return Err(Failure::Statement {
                code: code_of(error),
                error: error.to_vec(),
            });
        }
        answer.finish().map_err(|e| Failure::Session(e.to_string()))
    }

    /// Says goodbye, so the session ends as a client's that left politely.
    pub async fn terminate(mut self) {
        let mut out = BytesMut::with_capacity(8);
        frontend::terminate(&mut out);
        let _ = self.to.write_all(&out).await;
        let _ = self.to.shutdown().await;
    }
}

/// Parse, Bind, Describe (when the answer shows it), Execute.
fn statement(out: &mut BytesMut, s: &Statement, describe: bool) {
    frontend::parse(out, "", &s.text);
    frontend::bind(
        out,
        "",
        s.params.iter().map(|p| p.as_deref().map(str::as_bytes)),
    );
    if describe {
        frontend::describe_portal(out);
    }
    frontend::execute(out);
}

/// The SQLSTATE of an error already in JSON.
fn code_of(json: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(json)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_owned))
        .unwrap_or_default()
}
