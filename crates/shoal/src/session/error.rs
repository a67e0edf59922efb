//! How a session ends abnormally, and what of it the client is told.

use shoal_wire::{sqlstate, FrameError};

use crate::error::ErrorKind;

/// Why a session ended abnormally. `Fatal` is reported to the client before closing.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("client closed the connection")]
    ClientGone,
    #[error("client I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Boxed: a session's futures carry a `SessionError` slot, and every idle client is
    /// one of those futures.
    #[error("{}", .0.message)]
    Fatal(Box<Fatal>),
    /// Ends the connection without a word to the client (it does not speak the protocol).
    #[error("{0}")]
    Quiet(String),
    #[error("invalid frontend message type {}", *.0 as char)]
    UnknownMessage(u8),
    #[error("server protocol error: {0}")]
    ServerProtocol(String),
}

/// A FATAL for the client: its SQLSTATE, message and kind.
#[derive(Debug)]
pub struct Fatal {
    pub code: &'static str,
    pub message: String,
    pub kind: ErrorKind,
}

impl SessionError {
    /// A FATAL: what failed (`kind`, the label logs and metrics use), and what the client is
    /// told (`code`, `message`). The kind is stated where the failure is known, never read
    /// back from the SQLSTATE (one code can mean several kinds: a login timeout and a bad
    /// message are both `08P01`).
    pub fn fatal(kind: ErrorKind, code: &'static str, message: impl Into<String>) -> Self {
        SessionError::Fatal(Box::new(Fatal {
            code,
            message: message.into(),
            kind,
        }))
    }

    pub(super) fn from_frame(e: FrameError) -> Self {
        let (kind, code) = match e {
            FrameError::TooLarge { .. } => {
                (ErrorKind::ClientLimit, sqlstate::PROGRAM_LIMIT_EXCEEDED)
            }
            _ => (ErrorKind::ClientProtocol, sqlstate::PROTOCOL_VIOLATION),
        };
        SessionError::fatal(kind, code, e.to_string())
    }

    pub(super) fn server_protocol(e: FrameError) -> Self {
        SessionError::ServerProtocol(e.to_string())
    }

    /// The SQLSTATE the client is told, if any.
    pub fn code(&self) -> Option<&'static str> {
        self.client_message().map(|(c, _)| c)
    }

    /// Its kind, in the one taxonomy of [`crate::error`] (the label logs and metrics use).
    pub fn kind(&self) -> ErrorKind {
        match self {
            SessionError::ClientGone | SessionError::Io(_) => ErrorKind::ClientGone,
            SessionError::Quiet(_) | SessionError::UnknownMessage(_) => ErrorKind::ClientProtocol,
            SessionError::ServerProtocol(_) => ErrorKind::ServerProtocol,
            SessionError::Fatal(f) => f.kind,
        }
    }

    /// The error to show the client, if it should get one.
    pub(super) fn client_message(&self) -> Option<(&'static str, String)> {
        match self {
            SessionError::Fatal(f) => Some((f.code, f.message.clone())),
            SessionError::UnknownMessage(_) => {
                Some((sqlstate::PROTOCOL_VIOLATION, self.to_string()))
            }
            SessionError::ServerProtocol(_) => {
                Some((sqlstate::CONNECTION_FAILURE, self.to_string()))
            }
            _ => None,
        }
    }
}
