//! The node-to-node link: a few long-lived, authenticated connections between each pair of
//! nodes, each carrying many relayed clients' streams with per-stream flow control.
//!
//! - [`frame`]: the framing, pure.
//! - [`handshake`]: the mutual proof of the cluster secret that starts every link.
//! - [`mux`]: streams over one connection, and the task that drives it.
//! - [`stream`]: one stream's reads, writes and state.

pub mod frame;
pub mod handshake;
pub mod mux;
pub mod stream;

pub use handshake::HandshakeError;
pub use mux::{drive, Incoming, Link, LinkStream, Side};

#[cfg(test)]
mod tests;
