//! Request latency per operation, as a Prometheus histogram (`<name>{op="get"}` ...): what every
//! process serving the binary protocol exports. One histogram per opcode, made when the metric
//! is registered, so recording takes no map lookup; a connection records each request when its
//! response has been written ([`crate::conn::serve`]).

use std::time::Duration;

use dpukv_proto::OpCode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The operation label.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OpLabel {
    /// The protocol's name of the operation (docs/protocol.md §5).
    pub op: &'static str,
}

/// The buckets every dpukv latency histogram uses: 20 µs doubling to about 21 s.
pub fn buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.000_02, 2.0, 21)
}

/// A latency histogram per operation.
#[derive(Debug, Clone)]
pub struct OpLatency {
    /// Indexed by opcode (0: unused).
    by_op: Vec<Option<Histogram>>,
}

impl OpLatency {
    /// Registers `name` (seconds; `_seconds` is part of `name`) in `registry`, with a histogram
    /// for every operation, all at zero.
    pub fn register(registry: &mut Registry, name: &str, help: &str) -> OpLatency {
        let family: Family<OpLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(buckets()));
        let by_op = (0..=u8::MAX)
            .map(|b| OpCode::from_u8(b).map(|op| family.get_or_create(&OpLabel { op: op.name() }).clone()))
            .collect();
        registry.register(name, help, family);
        OpLatency { by_op }
    }

    /// Records one request of `op` that took `took`.
    pub fn observe(&self, op: OpCode, took: Duration) {
        if let Some(Some(h)) = self.by_op.get(op as usize) {
            h.observe(took.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_operation_counts_in_its_own_series() {
        let mut registry = Registry::default();
        let l = OpLatency::register(&mut registry, "test_request_duration_seconds", "test");
        l.observe(OpCode::Get, Duration::from_micros(30));
        l.observe(OpCode::Get, Duration::from_millis(3));
        l.observe(OpCode::Put, Duration::from_millis(3));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(text.contains("test_request_duration_seconds_count{op=\"get\"} 2"), "{text}");
        assert!(text.contains("test_request_duration_seconds_count{op=\"put\"} 1"), "{text}");
        // Every operation is exported from the start (at zero), so rates never start missing.
        assert!(text.contains("test_request_duration_seconds_count{op=\"scan\"} 0"), "{text}");
        // 30 µs falls in the 40 µs bucket, not the 20 µs one.
        assert!(text.contains("test_request_duration_seconds_bucket{le=\"0.00002\",op=\"get\"} 0"), "{text}");
        assert!(text.contains("test_request_duration_seconds_bucket{le=\"0.00004\",op=\"get\"} 1"), "{text}");
    }
}
