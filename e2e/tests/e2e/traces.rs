//! Traces across processes: every process exports its spans over OTLP to a receiver speaking
//! the collector's gRPC protocol, and a request's spans form one trace — the caller's span (an
//! HTTP `traceparent`), the gateway's, the device's and, for a write, the host's, each the
//! parent of the next — carried in the binary protocol's trace block (docs/protocol.md §4.2).

use std::process::Command;
use std::time::Duration;

use dpukv_client::Client;
use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::gateway::Gateway;
use dpukv_e2e::otlp::{Collector, ReceivedSpan};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The spans of trace `trace` (hex).
fn of_trace<'a>(spans: &'a [ReceivedSpan], trace: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| hex(&s.trace_id) == trace).collect()
}

/// The chain of `names` in `trace`: each named span's parent is the one before it; the first's
/// parent is `root_parent` (hex; empty: a root span). Returns whether it is all there.
fn chain(spans: &[ReceivedSpan], trace: &str, root_parent: &str, names: &[(&str, &str)]) -> bool {
    let of = of_trace(spans, trace);
    let mut parent = root_parent.to_string();
    for (service, name) in names {
        match of.iter().find(|s| s.service == *service && s.name == *name && hex(&s.parent_span_id) == parent) {
            Some(s) => parent = hex(&s.span_id),
            None => return false,
        }
    }
    true
}

/// `curl` with headers; the response's headers and body.
fn curl(method: &str, url: &str, headers: &[&str], body: Option<&str>) -> String {
    let mut c = Command::new("curl");
    c.args(["-s", "-i", "-X", method, "--max-time", "20", url]);
    for h in headers {
        c.args(["-H", h]);
    }
    if let Some(b) = body {
        c.args(["--data-binary", b]);
    }
    String::from_utf8_lossy(&c.output().expect("curl runs").stdout).to_string()
}

#[test]
fn a_requests_spans_form_one_trace_across_gateway_device_and_host() {
    let collector = Collector::start().expect("OTLP receiver");
    // Export at once (the batch processor's delay is 5 s by default).
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "100")];
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start_with(id, "traces", &etcd.url(), &args, &[], &env).expect("node")).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 1 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2),
    ));
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw = Gateway::start_env(&seeds, &[], &env).expect("gateway");
    let logs = || format!("{}{}", nodes.iter().map(ClusterNode::logs).collect::<String>(), gw.logs());

    // HTTP with the caller's trace context: a write and a read.
    let (write_trace, read_trace, caller_span) =
        ("4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737", "00f067aa0ba902b7");
    let put = curl(
        "PUT",
        &format!("http://{}/v1/kv/traced", gw.http),
        &[&format!("traceparent: 00-{write_trace}-{caller_span}-01")],
        Some(r#"{"value": "yes"}"#),
    );
    assert!(put.starts_with("HTTP/1.1 200"), "{put}");
    // The answer names the trace and the gateway's span in it.
    assert!(put.to_lowercase().contains(&format!("traceresponse: 00-{write_trace}-")), "{put}");
    let get = curl(
        "GET",
        &format!("http://{}/v1/kv/traced", gw.http),
        &[&format!("traceparent: 00-{read_trace}-{caller_span}-01")],
        None,
    );
    assert!(get.starts_with("HTTP/1.1 200") && get.contains("\"yes\""), "{get}");
    // Not sampled by the caller: no spans anywhere.
    let unsampled = "6bf92f3577b34da6a3ce929d0e0e4738";
    let quiet = curl(
        "GET",
        &format!("http://{}/v1/kv/traced", gw.http),
        &[&format!("traceparent: 00-{unsampled}-{caller_span}-00")],
        None,
    );
    assert!(quiet.starts_with("HTTP/1.1 200"), "{quiet}");

    // The binary protocol and RESP without a caller's context: the gateway starts the trace.
    rt.block_on(async {
        let c = Client::connect(&gw.binary, 1).await.expect("connect");
        c.put(b"binary", b"1").await.expect("put");
    });
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", gw.resp_port(), "SET", "resp", "1"])
        .output()
        .expect("redis-cli runs");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");

    let want_write = [("dpukv-gateway", "gateway http put"), ("dpukv-dpu", "device put"), ("dpukv-node", "host put")];
    let want_read = [("dpukv-gateway", "gateway http get"), ("dpukv-dpu", "device get")];
    let spans = collector
        .wait_for(Duration::from_secs(30), |spans| {
            chain(spans, write_trace, caller_span, &want_write)
                && chain(spans, read_trace, caller_span, &want_read)
                && spans.iter().any(|s| s.name == "gateway put" && s.parent_span_id.is_empty())
                && spans.iter().any(|s| s.name == "gateway redis set" && s.parent_span_id.is_empty())
        })
        .unwrap_or_else(|e| panic!("{e:#}\n{}", logs()));
    // The binary and RESP traces reach the host too.
    for root in ["gateway put", "gateway redis set"] {
        let r = spans.iter().find(|s| s.name == root).expect("root");
        let trace = hex(&r.trace_id);
        let names = [("dpukv-dpu", "device put"), ("dpukv-node", "host put")];
        let ok = collector.wait_for(Duration::from_secs(30), |s| chain(s, &trace, &hex(&r.span_id), &names)).is_ok();
        assert!(ok, "the {root:?} trace has no device and host spans: {:#?}", of_trace(&collector.spans(), &trace));
    }
    // A read does not reach the host; an unsampled trace leaves nothing.
    assert!(!of_trace(&spans, read_trace).iter().any(|s| s.service == "dpukv-node"));
    std::thread::sleep(Duration::from_millis(500));
    assert!(of_trace(&collector.spans(), unsampled).is_empty(), "spans of an unsampled trace");
}
