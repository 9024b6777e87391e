//! What a server and the coordinator expose to Prometheus, made at scrape time from the status
//! they already keep: nothing is counted on the push path for it.
//!
//! The names, types and labels are the stable interface `docs/observability.md` documents; the test
//! at the bottom pins them. Counters are cumulative since the process (or, for a shard, its
//! state: a promoted backup carries its primary's counters), so `rate()` and `increase()` in
//! PromQL give rates; nothing here computes one. Encoded by the official
//! [`prometheus_client`] crate in the OpenMetrics text format, which Prometheus scrapes.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::net::proto::{ClusterStatus, ServerStatus, ShardStatus};

/// The content type of [`server`]'s and [`coordinator`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels, in the order written.
type Labels = Vec<(&'static str, String)>;

/// One family: its name, help, type, and each labelled sample.
#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    samples: Vec<(Labels, Value)>,
}

#[derive(Debug)]
enum Value {
    Counter(u64),
    CounterF(f64),
    Gauge(f64),
    /// Buckets (upper bound, count in that bucket alone: the encoder makes them cumulative),
    /// the sum and the count.
    Histogram {
        buckets: Vec<(f64, u64)>,
        sum: f64,
        count: u64,
    },
    Info,
}

impl Value {
    fn metric_type(&self) -> MetricType {
        match self {
            Value::Counter(_) | Value::CounterF(_) => MetricType::Counter,
            Value::Gauge(_) => MetricType::Gauge,
            Value::Histogram { .. } => MetricType::Histogram,
            Value::Info => MetricType::Info,
        }
    }

    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        match self {
            Value::Counter(v) => ConstCounter::new(*v).encode(encoder),
            Value::CounterF(v) => ConstCounter::new(*v).encode(encoder),
            Value::Gauge(v) => ConstGauge::new(*v).encode(encoder),
            Value::Histogram { buckets, sum, count } => {
                encoder.encode_histogram::<NoLabelSet>(*sum, *count, buckets, None)
            }
            Value::Info => encoder.encode_info(&Vec::<(&str, &str)>::new()),
        }
    }
}

/// The families of one scrape, encoded in the order they were added.
#[derive(Debug, Default)]
struct Exposition {
    families: Vec<Family>,
}

impl Exposition {
    fn add(&mut self, name: &'static str, help: &'static str, labels: Labels, value: Value) {
        match self.families.iter_mut().find(|f| f.name == name) {
            Some(f) => f.samples.push((labels, value)),
            None => self.families.push(Family { name, help, samples: vec![(labels, value)] }),
        }
    }

    fn text(self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String");
        out
    }
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for f in &self.families {
            let Some((_, first)) = f.samples.first() else { continue };
            let mut family = encoder.encode_descriptor(f.name, f.help, None, first.metric_type())?;
            for (labels, value) in &f.samples {
                value.encode(family.encode_family(labels)?)?;
            }
        }
        Ok(())
    }
}

/// A policy's label (`bsp 0.1.0`) as its name and version.
fn name_and_version(label: &str) -> (String, String) {
    match label.rsplit_once(' ') {
        Some((name, version)) => (name.to_string(), version.to_string()),
        None => (label.to_string(), String::new()),
    }
}

/// A module's display name (`cluster policy `autopilot` 0.1.0 (sha…)`) as its name and version.
fn pilot_name_and_version(display: &str) -> (String, String) {
    let mut parts = display.split('`');
    let name = parts.nth(1).unwrap_or(display).to_string();
    let version = parts.next().and_then(|rest| rest.split_whitespace().next()).unwrap_or_default();
    (name, version.to_string())
}

/// One server's exposition: its traffic, and each shard it holds (primaries with
/// `role="primary"`, backups with `role="backup"`).
pub fn server(status: &ServerStatus) -> String {
    let mut x = Exposition::default();
    let server = status.server.to_string();
    x.add(
        "syncopate_server_sent_bytes",
        "Bytes this server sent on its data connections (UDP payloads: QUIC and TLS included).",
        vec![("server", server.clone())],
        Value::Counter(status.bytes_sent),
    );
    x.add(
        "syncopate_server_received_bytes",
        "Bytes this server received on its data connections.",
        vec![("server", server.clone())],
        Value::Counter(status.bytes_received),
    );
    for c in &status.payload_bytes {
        let labels = || vec![("server", server.clone()), ("codec", c.codec.clone())];
        x.add(
            "syncopate_push_payload_bytes",
            "Tensor payload bytes received in pushes, as encoded, by codec family.",
            labels(),
            Value::Counter(c.pushed),
        );
        x.add(
            "syncopate_pull_payload_bytes",
            "Tensor payload bytes sent in pulls, as encoded, by codec family.",
            labels(),
            Value::Counter(c.pulled),
        );
    }
    let held =
        status.shards.iter().map(|s| (s, "primary")).chain(status.backups.iter().map(|s| (s, "backup")));
    for (shard, role) in held {
        shard_families(&mut x, &server, role, shard);
    }
    x.text()
}

fn shard_families(x: &mut Exposition, server: &str, role: &'static str, s: &ShardStatus) {
    let (policy, version) = name_and_version(&s.policy);
    let labels = || -> Labels {
        vec![("server", server.to_string()), ("shard", s.shard.to_string()), ("role", role.to_string())]
    };
    let mut info = labels();
    info.extend([("policy", policy.clone()), ("version", version), ("sha256", s.sha256.clone())]);
    x.add("syncopate_shard_policy", "The policy a shard runs.", info, Value::Info);
    let st = &s.stats;
    let counters: [(&'static str, &'static str, u64); 15] = [
        ("syncopate_pushes_admitted", "Pushes admitted (applied or aggregated).", st.pushes_admitted),
        (
            "syncopate_pushes_dropped",
            "Pushes the policy dropped (acknowledged, not applied).",
            st.pushes_dropped,
        ),
        ("syncopate_pushes_held", "Pushes the policy held before deciding them.", st.pushes_held),
        ("syncopate_local_pushes", "Admitted pushes of local steps (pseudo-gradients).", st.local_pushes),
        ("syncopate_pulls_served", "Pulls answered.", st.pulls_served),
        ("syncopate_pulls_deferred", "Pulls the policy deferred.", st.pulls_deferred),
        ("syncopate_optimizer_steps", "Optimizer steps taken.", st.steps),
        (
            "syncopate_aggregates_completed_early",
            "Rounds the policy closed early.",
            st.aggregates_completed_early,
        ),
        ("syncopate_shard_swaps", "Hot swaps this shard carried out.", st.swaps),
        (
            "syncopate_policy_failures",
            "Policy calls that failed (trap, fuel, panic, bad decision).",
            st.policy_failures,
        ),
        ("syncopate_clocks_rebased", "Worker clocks raised at hot swaps.", st.clocks_rebased),
        (
            "syncopate_iterations_skipped",
            "Iterations workers skipped on a policy's word.",
            st.iterations_skipped,
        ),
        (
            "syncopate_policy_calls",
            "Events the shard's policy was called on (failed calls too).",
            s.policy_usage.calls,
        ),
        (
            "syncopate_policy_restarts",
            "Times the policy was restarted after a failure (from its last checkpoint).",
            s.policy_restarts,
        ),
        (
            "syncopate_policy_fuel",
            "Fuel the policy's event calls burned (about one unit per wasm instruction).",
            s.policy_usage.fuel,
        ),
    ];
    for (name, help, v) in counters {
        x.add(name, help, labels(), Value::Counter(v));
    }
    x.add(
        "syncopate_pull_deferred_seconds",
        "Time pulls spent deferred by the policy, summed over pulls.",
        labels(),
        Value::CounterF(st.deferred_ns as f64 / 1e9),
    );
    x.add(
        "syncopate_push_held_seconds",
        "Time pushes were held by the policy, summed over the holds that ended.",
        labels(),
        Value::CounterF(s.held_ns as f64 / 1e9),
    );
    // Staleness bucket i counts pushes of staleness i; the last, that many or more. The sum
    // counts the last bucket at its lower bound. (The encoder makes the counts cumulative.)
    let last = st.staleness.len().saturating_sub(1);
    let buckets: Vec<(f64, u64)> = st
        .staleness
        .iter()
        .enumerate()
        .map(|(i, &n)| (if i == last { f64::INFINITY } else { i as f64 }, n))
        .collect();
    let sum = st.staleness.iter().enumerate().map(|(i, &n)| i as f64 * n as f64).sum();
    let count = st.staleness.iter().sum();
    x.add(
        "syncopate_push_staleness",
        "Admitted pushes by staleness: optimizer steps between the pull a gradient was computed on and its admission.",
        labels(),
        Value::Histogram { buckets, sum, count },
    );
    // Arrival offsets: bucket k counts offsets below 2^k ms (the last, the rest).
    let a = &s.arrivals;
    let buckets: Vec<(f64, u64)> = a
        .counts
        .iter()
        .enumerate()
        .map(|(k, &n)| (crate::shard::ArrivalCounts::upper_s(k).unwrap_or(f64::INFINITY), n))
        .collect();
    x.add(
        "syncopate_push_arrival_offset_seconds",
        "Pushes by how long after the first push of their iteration they arrived at the shard.",
        labels(),
        Value::Histogram { buckets, sum: a.sum_ns as f64 / 1e9, count: a.counts.iter().sum() },
    );
    let gauges: [(&'static str, &'static str, f64); 4] = [
        ("syncopate_pulls_parked", "Pulls the policy keeps parked now.", f64::from(s.parked)),
        ("syncopate_pushes_holding", "Pushes the policy holds now.", f64::from(s.held)),
        ("syncopate_shard_workers", "Live workers on the shard.", s.workers.len() as f64),
        (
            "syncopate_shard_quarantined",
            "1 while the shard's policy is quarantined.",
            f64::from(u8::from(s.quarantined)),
        ),
    ];
    for (name, help, v) in gauges {
        x.add(name, help, labels(), Value::Gauge(v));
    }
    // Per live worker: one series per worker and shard (a worker that leaves, its series
    // ends), from what the shard keeps of each (the cluster policy's sample of it).
    for w in &s.sample.work {
        let worker = || {
            let mut l = labels();
            l.push(("worker", w.worker.to_string()));
            l
        };
        x.add(
            "syncopate_worker_clock",
            "A live worker's clock on the shard: the iterations it has pushed there.",
            worker(),
            Value::Gauge(w.clock as f64),
        );
        x.add(
            "syncopate_worker_pull_deferred_seconds",
            "Time a live worker's pulls spent deferred by the shard's policy.",
            worker(),
            Value::CounterF(w.waited_ns as f64 / 1e9),
        );
        x.add(
            "syncopate_worker_compute_seconds",
            "The compute time a live worker's pushes to the shard reported, summed.",
            worker(),
            Value::CounterF(w.step_ns as f64 / 1e9),
        );
        x.add(
            "syncopate_worker_reported_pushes",
            "A live worker's pushes to the shard that reported their compute time.",
            worker(),
            Value::Counter(w.pushes),
        );
        if let Some(loss) = w.loss {
            x.add(
                "syncopate_worker_loss",
                "The training loss a live worker last reported with a push.",
                worker(),
                Value::Gauge(f64::from(loss)),
            );
        }
    }
    for m in &s.metrics {
        let mut l = labels();
        l.extend([("policy", policy.clone()), ("name", m.name.clone())]);
        x.add(
            "syncopate_policy_metric",
            "The last value a policy recorded (ctx.metric).",
            l,
            Value::Gauge(m.last),
        );
    }
}

/// What only the coordinator knows, beside its cluster's status (whose servers it does not
/// ask: each server is scraped itself).
#[derive(Clone, Copy, Debug, Default)]
pub struct CoordinatorFigures {
    /// Servers failed over.
    pub failovers: u64,
}

/// The coordinator's exposition: the cluster's policy, swaps, membership, failovers, and the
/// cluster policy (`--pilot`) if one runs.
pub fn coordinator(status: &ClusterStatus, figures: CoordinatorFigures) -> String {
    let mut x = Exposition::default();
    x.add(
        "syncopate_cluster_policy",
        "The policy the cluster runs (the last swap committed), as the operator named it.",
        vec![("label", status.policy.clone()), ("sha256", status.sha256.clone())],
        Value::Info,
    );
    x.add("syncopate_swaps", "Hot swaps committed on the cluster.", Vec::new(), Value::Counter(status.swaps));
    x.add("syncopate_failovers", "Servers failed over.", Vec::new(), Value::Counter(figures.failovers));
    let connected = status.workers.iter().filter(|w| w.connected).count();
    let finished = status.workers.iter().filter(|w| w.finished).count();
    x.add(
        "syncopate_workers_connected",
        "Workers connected now.",
        Vec::new(),
        Value::Gauge(connected as f64),
    );
    x.add(
        "syncopate_workers_finished",
        "Workers that left cleanly.",
        Vec::new(),
        Value::Gauge(finished as f64),
    );
    x.add(
        "syncopate_servers_lost",
        "Servers lost (failed over, not taken back).",
        Vec::new(),
        Value::Gauge(status.lost_servers.len() as f64),
    );
    if let Some(p) = &status.pilot {
        let (name, version) = pilot_name_and_version(&p.policy);
        x.add(
            "syncopate_pilot_policy",
            "The cluster policy (--pilot) that runs.",
            vec![("policy", name.clone()), ("version", version)],
            Value::Info,
        );
        x.add(
            "syncopate_pilot_swaps",
            "Swaps the cluster policy asked for.",
            Vec::new(),
            Value::Counter(p.swaps),
        );
        x.add(
            "syncopate_pilot_quarantined",
            "1 once the cluster policy is quarantined.",
            Vec::new(),
            Value::Gauge(f64::from(u8::from(p.quarantined))),
        );
        for (metric, v) in &p.metrics {
            x.add(
                "syncopate_pilot_metric",
                "The last value the cluster policy recorded.",
                vec![("policy", name.clone()), ("name", metric.clone())],
                Value::Gauge(*v),
            );
        }
    }
    x.text()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{Metric, ShardStats};
    use syncopate_engine::pilot::WorkerWork;
    use syncopate_policy_sdk::abi::WorkerClock;

    fn shard(shard: u32, policy: &str) -> ShardStatus {
        let mut staleness = [0u64; crate::shard::STALENESS_BUCKETS];
        (staleness[0], staleness[2], staleness[crate::shard::STALENESS_BUCKETS - 1]) = (5, 3, 2);
        ShardStatus {
            shard,
            policy: policy.into(),
            sha256: "ab".repeat(32),
            config: Vec::new(),
            quarantined: false,
            workers: vec![WorkerClock { worker: 0, clock: 7 }, WorkerClock { worker: 1, clock: 6 }],
            len: 10,
            stats: ShardStats {
                pushes_admitted: 10,
                pulls_served: 12,
                pulls_deferred: 4,
                deferred_ns: 1_500_000_000,
                steps: 9,
                staleness,
                ..ShardStats::default()
            },
            parked: 1,
            held: 0,
            waited_ns: Vec::new(),
            metrics: vec![Metric { name: "ssp.s".into(), last: 3.0, count: 1, sum: 3.0 }],
            last_failure: None,
            replication: None,
            held_longest: None,
            parked_longest: None,
            policy_failures_now: 0,
            backoff_ms: None,
            sample: syncopate_engine::pilot::ShardSample {
                work: vec![
                    WorkerWork {
                        worker: 0,
                        clock: 7,
                        step_ns: 700_000_000,
                        pushes: 7,
                        loss: Some(0.5),
                        waited_ns: 250_000_000,
                    },
                    WorkerWork { worker: 1, clock: 6, step_ns: 0, pushes: 0, loss: None, waited_ns: 0 },
                ],
                ..Default::default()
            },
            arrivals: crate::shard::ArrivalCounts {
                counts: {
                    let mut c = [0u64; crate::shard::ARRIVAL_BUCKETS];
                    (c[0], c[3]) = (6, 2);
                    c
                },
                sum_ns: 10_000_000,
            },
            policy_usage: crate::runtime::PolicyUsage { calls: 40, fuel: 123_456 },
            policy_restarts: 2,
            held_ns: 2_500_000_000,
        }
    }

    fn a_server() -> ServerStatus {
        ServerStatus {
            server: 3,
            addr: "127.0.0.1:9".parse().unwrap(),
            shards: vec![shard(1, "ssp 0.1.0")],
            backups: vec![shard(0, "ssp 0.1.0")],
            bytes_sent: 1000,
            bytes_received: 2000,
            payload_bytes: vec![crate::net::proto::CodecBytes {
                codec: "int8".into(),
                pushed: 300,
                pulled: 0,
            }],
        }
    }

    fn a_cluster() -> ClusterStatus {
        ClusterStatus {
            policy: "builtin:ssp".into(),
            sha256: "cd".repeat(32),
            config: Vec::new(),
            swaps: 2,
            servers: Vec::new(),
            workers: Vec::new(),
            score: None,
            evaluated: None,
            placement: Vec::new(),
            lost_servers: vec![1],
            checkpoint_error: None,
            pilot: Some(syncopate_engine::pilot::PilotStatus {
                policy: "cluster policy `autopilot` 0.1.0 (0123456789ab)".into(),
                config: Vec::new(),
                cadence_ms: 1000,
                quarantined: false,
                swaps: 1,
                metrics: vec![("autopilot.ratio".into(), 2.5)],
                log: Vec::new(),
            }),
        }
    }

    /// The names, types and labels are an interface (docs/observability.md): this pins them, and the
    /// values the status carries.
    #[test]
    fn a_servers_exposition_names_every_figure_of_its_shards() {
        let text = server(&a_server());
        let p = r#"server="3",shard="1",role="primary""#;
        for line in [
            "# TYPE syncopate_pushes_admitted counter".to_string(),
            r#"syncopate_server_sent_bytes_total{server="3"} 1000"#.into(),
            r#"syncopate_server_received_bytes_total{server="3"} 2000"#.into(),
            format!(
                r#"syncopate_shard_policy_info{{{p},policy="ssp",version="0.1.0",sha256="{}"}} 1"#,
                "ab".repeat(32)
            ),
            format!("syncopate_pushes_admitted_total{{{p}}} 10"),
            format!("syncopate_pulls_served_total{{{p}}} 12"),
            format!("syncopate_pulls_deferred_total{{{p}}} 4"),
            format!("syncopate_pull_deferred_seconds_total{{{p}}} 1.5"),
            format!("syncopate_optimizer_steps_total{{{p}}} 9"),
            format!("syncopate_pulls_parked{{{p}}} 1.0"),
            format!("syncopate_shard_workers{{{p}}} 2.0"),
            format!(r#"syncopate_policy_metric{{{p},policy="ssp",name="ssp.s"}} 3.0"#),
            format!(r#"syncopate_worker_clock{{{p},worker="0"}} 7.0"#),
            format!(r#"syncopate_worker_clock{{{p},worker="1"}} 6.0"#),
            format!(r#"syncopate_worker_pull_deferred_seconds_total{{{p},worker="0"}} 0.25"#),
            format!(r#"syncopate_worker_compute_seconds_total{{{p},worker="0"}} 0.7"#),
            format!(r#"syncopate_worker_reported_pushes_total{{{p},worker="0"}} 7"#),
            format!(r#"syncopate_worker_loss{{{p},worker="0"}} 0.5"#),
            "# TYPE syncopate_push_staleness histogram".into(),
            format!(r#"syncopate_push_staleness_bucket{{le="0.0",{p}}} 5"#),
            format!(r#"syncopate_push_staleness_bucket{{le="1.0",{p}}} 5"#),
            format!(r#"syncopate_push_staleness_bucket{{le="2.0",{p}}} 8"#),
            format!(r#"syncopate_push_staleness_bucket{{le="+Inf",{p}}} 10"#),
            format!("syncopate_push_staleness_count{{{p}}} 10"),
            format!("syncopate_push_staleness_sum{{{p}}} {:.1}", 2.0 * 3.0 + 15.0 * 2.0),
            r#"syncopate_push_payload_bytes_total{server="3",codec="int8"} 300"#.into(),
            r#"syncopate_pull_payload_bytes_total{server="3",codec="int8"} 0"#.into(),
            format!("syncopate_policy_calls_total{{{p}}} 40"),
            format!("syncopate_policy_fuel_total{{{p}}} 123456"),
            format!("syncopate_policy_restarts_total{{{p}}} 2"),
            format!("syncopate_push_held_seconds_total{{{p}}} 2.5"),
            "# TYPE syncopate_push_arrival_offset_seconds histogram".into(),
            format!(r#"syncopate_push_arrival_offset_seconds_bucket{{le="0.001",{p}}} 6"#),
            format!(r#"syncopate_push_arrival_offset_seconds_bucket{{le="0.004",{p}}} 6"#),
            format!(r#"syncopate_push_arrival_offset_seconds_bucket{{le="0.008",{p}}} 8"#),
            format!(r#"syncopate_push_arrival_offset_seconds_bucket{{le="+Inf",{p}}} 8"#),
            format!("syncopate_push_arrival_offset_seconds_sum{{{p}}} 0.01"),
            format!("syncopate_push_arrival_offset_seconds_count{{{p}}} 8"),
            r#"syncopate_pushes_admitted_total{server="3",shard="0",role="backup"} 10"#.into(),
            "# EOF".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "no line `{line}` in:\n{text}");
        }
        // Each family is declared once, with every shard's sample under it.
        assert_eq!(text.matches("# TYPE syncopate_pushes_admitted counter").count(), 1);
    }

    #[test]
    fn the_coordinators_exposition_has_the_policy_swaps_failovers_and_the_pilot() {
        let status = a_cluster();
        let text = coordinator(&status, CoordinatorFigures { failovers: 1 });
        for line in [
            format!(r#"syncopate_cluster_policy_info{{label="builtin:ssp",sha256="{}"}} 1"#, "cd".repeat(32)),
            "syncopate_swaps_total 2".into(),
            "syncopate_failovers_total 1".into(),
            "syncopate_servers_lost 1.0".into(),
            r#"syncopate_pilot_policy_info{policy="autopilot",version="0.1.0"} 1"#.into(),
            "syncopate_pilot_swaps_total 1".into(),
            r#"syncopate_pilot_metric{policy="autopilot",name="autopilot.ratio"} 2.5"#.into(),
        ] {
            assert!(text.lines().any(|l| l == line), "no line `{line}` in:\n{text}");
        }
    }

    /// docs/observability.md lists every family exposed, and nothing else.
    #[test]
    fn the_docs_list_every_family_and_only_those() {
        let docs = include_str!("../../../docs/observability.md");
        let texts = [server(&a_server()), coordinator(&a_cluster(), CoordinatorFigures { failovers: 1 })];
        let exposed: std::collections::BTreeSet<(String, String)> = texts
            .iter()
            .flat_map(|t| t.lines())
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').unwrap();
                (name.to_string(), kind.to_string())
            })
            .collect();
        let documented: std::collections::BTreeSet<(String, String)> = docs
            .lines()
            .filter_map(|l| l.strip_prefix("| `syncopate_"))
            .map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                (format!("syncopate_{}", cells[0].trim_end_matches('`')), cells[1].to_string())
            })
            .collect();
        assert_eq!(exposed, documented);
    }
}
