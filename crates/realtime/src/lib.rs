//! Shoal's realtime service: clients subscribe over WebSocket to channels, send each other
//! messages (Broadcast) and see who is online (Presence), speaking Phoenix channels as
//! Supabase Realtime's official clients do.
//!
//! Module map:
//!
//! - [`protocol`]: Phoenix frames, pure and unit-tested: protocol 1.0 JSON objects, 2.0
//!   JSON arrays, and 2.0 binary frames for user broadcasts. Payloads stay the bytes they
//!   came in, so a message fanned out to many subscribers is never parsed again.

//! - [`hub`]: a tenant's channels: subscriptions per topic, and broadcasts encoded once per
//!   form and queued to every subscriber, with bounded queues per socket.

//! - [`socket`]: one socket's side of the protocol (heartbeats, joins, leaves, broadcasts
//!   and their replies), apart from its transport.

//! - [`changes`], [`render`] and [`filter`]: Postgres Changes messages, their column
//!   values as `to_jsonb` renders them, and bindings' filters (part 2's start), pure.
//!
//! - [`fabric`]: broadcasts between the nodes of a cluster: their frames, and the relay
//!   seam that Shoal's node links fill.
//!
//! - [`edge`]: the WebSocket endpoint: tenant, version and JWT checked before the upgrade,
//!   then one task per socket; [`jwt`] verifies tenants' tokens; [`limits`] meters each
//!   tenant's sockets, joins, messages and bytes; [`rest`] takes broadcasts over HTTP.
//!
//! - [`resume`]: sessions a client comes back to after losing its connection, with the
//!   frames it may not have read.

pub mod changes;
pub mod edge;
pub mod fabric;
pub mod feed;
pub mod filter;
pub mod hub;
pub mod jwt;
pub mod limits;
pub mod protocol;
pub mod render;
pub mod rest;
pub mod resume;
pub mod socket;
