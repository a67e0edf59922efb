//! What the load generators share: sockets bound over many loopback source addresses, and
//! latency histograms passed from worker processes to their coordinator.

pub mod hist;
pub mod net;
pub mod workers;
