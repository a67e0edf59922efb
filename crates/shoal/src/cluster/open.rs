//! What a relaying node tells a pool's owner when it opens a stream for a client: enough for
//! the owner to route the client as if it had connected there, and no more. The client was
//! authenticated by the relaying node; the link is authenticated, so the owner trusts it. A
//! passthrough secret (the SCRAM client key proven by the client, for auth_query users) goes
//! along, because the owner's servers log in with it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RelayOpen {
    /// The pool's cluster-wide key (its name), which the owner checks it routes to.
    pub pool: String,
    pub user: String,
    pub database: String,
    /// The client's startup parameters (lower-cased, sorted).
    pub params: Vec<(String, String)>,
    pub reference: Option<String>,
    /// The TLS server name the client connected with (routes tenants by SNI).
    pub server_name: Option<String>,
    pub peer: Option<std::net::SocketAddr>,
    /// The SCRAM client key the client proved (passthrough users only).
    #[serde(default)]
    pub client_key: Option<[u8; 32]>,
}

impl RelayOpen {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain data serialises")
    }

    pub fn decode(b: &[u8]) -> Result<RelayOpen, serde_json::Error> {
        serde_json::from_slice(b)
    }
}

/// The Close reason an owner gives when another node owns the pool: `owner:<node id>`.
pub const REDIRECT: &str = "owner:";
