//! What this node does with the streams its peers open on accepted links, chosen by what a
//! stream's opening says. The services that take streams (the pooler's relayed clients,
//! realtime's fabric) register here at start-up, so the cluster imports neither of them.

use bytes::Bytes;
use shoal_cluster::link::LinkStream;

/// Services hold what they need of the process themselves (a weak App, as a rule: the node
/// that holds them is held by the App).
type Handler = Box<dyn Fn(LinkStream, Bytes) + Send + Sync>;

pub struct Handlers {
    by_opening: Vec<(&'static [u8], Handler)>,
    otherwise: Handler,
}

impl Handlers {
    /// Streams no other handler claims go to `otherwise` (relayed clients: their opening
    /// describes the client).
    pub fn new(otherwise: impl Fn(LinkStream, Bytes) + Send + Sync + 'static) -> Self {
        Handlers {
            by_opening: Vec::new(),
            otherwise: Box::new(otherwise),
        }
    }

    /// Streams whose opening is exactly `opening` go to `handler`.
    pub fn on(
        mut self,
        opening: &'static [u8],
        handler: impl Fn(LinkStream, Bytes) + Send + Sync + 'static,
    ) -> Self {
        self.by_opening.push((opening, Box::new(handler)));
        self
    }

    /// Hands a stream to its service; called on the shard running the link.
    pub(super) fn dispatch(&self, stream: LinkStream, what: Bytes) {
        let handler = self
            .by_opening
            .iter()
            .find(|(o, _)| *o == &what[..])
            .map_or(&self.otherwise, |(_, h)| h);
        handler(stream, what);
    }
}
