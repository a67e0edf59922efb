//! Latency histograms (microseconds) as workers send them to the coordinator: HDR's V2
//! serialization in base64, one line of JSON each.

use base64::Engine;
use hdrhistogram::serialization::{Deserializer, Serializer, V2Serializer};
use hdrhistogram::Histogram;

pub fn encode_hist(h: &Histogram<u64>) -> String {
    let mut buf = Vec::new();
    let _ = V2Serializer::new().serialize(h, &mut buf);
    base64::engine::general_purpose::STANDARD.encode(buf)
}

pub fn decode_hist(s: &str) -> anyhow::Result<Histogram<u64>> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(s)?;
    Ok(Deserializer::new().deserialize(&mut bytes.as_slice())?)
}

/// A histogram of 1 µs to 60 s at three significant digits.
pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}
