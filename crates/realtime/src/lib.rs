//! Shoal's realtime service: clients subscribe over WebSocket to channels, send each other
//! messages (Broadcast) and see who is online (Presence), speaking Phoenix channels as
//! Supabase Realtime's official clients do.
//!
//! Module map:
//!
//! - [`protocol`]: Phoenix frames, pure and unit-tested: protocol 1.0 JSON objects, 2.0
//!   JSON arrays, and 2.0 binary frames for user broadcasts. Payloads stay the bytes they
//!   came in, so a message fanned out to many subscribers is never parsed again.

pub mod protocol;
