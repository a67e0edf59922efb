//! The PostgreSQL wire protocol (version 3.0) as pure code, free of I/O.
//!
//! Everything here works on byte buffers so that it can be unit-tested and fuzzed without
//! sockets. Module map:
//!
//! - [`frame`]: splitting a byte stream into typed messages (`tag`, `len`, body) with bounded
//!   lengths; the pooler forwards frames without decoding them.
//! - [`startup`]: the untagged first packet of a connection: StartupMessage, SSLRequest,
//!   GSSENCRequest, CancelRequest.
//! - [`backend`]: messages the server side sends (built by Shoal towards clients, or parsed
//!   where Shoal must act on what PostgreSQL said).
//! - [`frontend`]: messages the client side sends (built by Shoal towards PostgreSQL).
//! - [`sqlstate`]: the error codes Shoal uses.
//! - [`scram`]: server-side SCRAM-SHA-256 (RFC 5802 / 7677) and verifier parsing.
//! - [`md5`]: PostgreSQL's MD5 password scheme.
//! - [`facts`]: what SQL runs and calls (every node of its parse tree), for query rules.
//! - [`readonly`]: whether SQL only reads (parsed by PostgreSQL's grammar), for replicas.
//! - [`statement`]: both of the above from one parse: the analysis every feature reads.
//! - [`pgoutput`]: logical replication's stream and the `pgoutput` plugin's messages.
//! - [`sql`]: a SQL lexer and classifier: what a query leaves behind in its session.
//! - [`encoding`]: how a client's `client_encoding` makes bytes into characters.

pub mod backend;
pub mod encoding;
pub mod facts;
pub mod frame;
pub mod frontend;
pub mod md5;
pub mod pgoutput;
pub mod readonly;
pub mod scram;
pub mod sql;
pub mod sqlstate;
pub mod startup;
pub mod statement;

pub use frame::{Frame, FrameError};
