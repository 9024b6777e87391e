//! Prometheus metrics (issue 54): a real local cluster serves `/metrics` on its coordinator and
//! every server, the figures move while it trains, a hot swap shows in the policy's info
//! metric, and the last scrape agrees with `report.json`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use syncopate::net::tls::ClusterFile;

use crate::cluster::{syncopate, LocalRun};

/// One scrape over plain HTTP/1.0 (the endpoint is axum's; this reads it as Prometheus would):
/// the body, after checking the status and the content type.
fn scrape(addr: SocketAddr) -> String {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connects");
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(conn, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("an answer within 10 s");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    assert!(body.ends_with("# EOF\n"), "an OpenMetrics exposition ends so:\n{body}");
    body.to_string()
}

/// The samples of `name` (with its suffix, `_total` for a counter): each one's labels and value.
fn samples(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{').unwrap_or((series, "}"));
            (metric == name).then(|| (labels.trim_end_matches('}').to_string(), value.parse().unwrap()))
        })
        .collect()
}

/// The value of `name` for the primary of `shard`, as a server's exposition has it.
fn of_primary(text: &str, name: &str, shard: u32) -> Option<f64> {
    let want = format!(r#"shard="{shard}",role="primary""#);
    samples(text, name).into_iter().find(|(l, _)| l.contains(&want)).map(|(_, v)| v)
}

#[test]
fn a_local_cluster_serves_prometheus_metrics_that_move_follow_a_swap_and_agree_with_the_report() {
    let mut run = LocalRun::start(
        "metrics",
        &["--workers", "2", "--servers", "2", "--iterations", "600", "--params", "64", "--delay-ms", "10"],
    );
    let cluster = run.cluster_file();
    let file = ClusterFile::read(&cluster).unwrap();
    let names: Vec<&str> = file.metrics.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["coordinator", "server-0", "server-1"], "cluster.json names each endpoint");
    let addr = |name: &str| file.metrics.iter().find(|(n, _)| n == name).unwrap().1;
    let servers = [addr("server-0"), addr("server-1")];
    let admitted =
        |text: &str| samples(text, "syncopate_pushes_admitted_total").iter().map(|s| s.1).sum::<f64>();

    // Training moves the counters (both servers, every primary shard).
    let t = Instant::now();
    let first = loop {
        let texts: Vec<String> = servers.iter().map(|a| scrape(*a)).collect();
        if texts.iter().all(|t| admitted(t) >= 20.0) {
            break texts;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no pushes counted:\n{}", texts.join("\n"));
        std::thread::sleep(Duration::from_millis(100));
    };
    for text in &first {
        let info = samples(text, "syncopate_shard_policy_info");
        assert!(
            !info.is_empty() && info.iter().all(|(l, v)| l.contains(r#"policy="bsp""#) && *v == 1.0),
            "{text}"
        );
        // Each worker's clock and compute time on each shard the server holds.
        let clocks = samples(text, "syncopate_worker_clock");
        assert_eq!(clocks.len(), 2 * info.len(), "two workers on each shard:\n{text}");
        let computed = samples(text, "syncopate_worker_reported_pushes_total");
        assert!(computed.iter().any(|(_, v)| *v > 0.0), "the workers report their compute time:\n{text}");
    }

    // A hot swap: the info metrics name the new policy, on the shards and the coordinator.
    let out = syncopate(&["policy", "swap", "ssp:s=2", "--watch-s", "0"], &cluster);
    assert!(out.status.success(), "swap: {}", String::from_utf8_lossy(&out.stderr));
    let t = Instant::now();
    loop {
        let texts: Vec<String> = servers.iter().map(|a| scrape(*a)).collect();
        let swapped = texts.iter().all(|text| {
            samples(text, "syncopate_shard_policy_info").iter().all(|(l, _)| l.contains(r#"policy="ssp""#))
        });
        if swapped {
            for (before, after) in first.iter().zip(&texts) {
                assert!(admitted(after) >= admitted(before), "a counter went back:\n{before}\n{after}");
            }
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the info metric did not follow the swap:\n{}",
            texts.join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let coordinator = scrape(addr("coordinator"));
    assert_eq!(samples(&coordinator, "syncopate_swaps_total"), vec![(String::new(), 1.0)], "{coordinator}");
    let info = samples(&coordinator, "syncopate_cluster_policy_info");
    assert!(info.len() == 1 && info[0].0.contains(r#"label="builtin:ssp""#), "{coordinator}");

    // The end: the launcher's last scrape (metrics/*.prom) is what report.json says.
    let (st, run) = run.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", run.output());
    let report = run.report();
    let saved = |name: &str| {
        std::fs::read_to_string(run.dir.join("metrics").join(format!("{name}.prom")))
            .unwrap_or_else(|e| panic!("metrics/{name}.prom: {e}\n{}", run.output()))
    };
    let coordinator = saved("coordinator");
    assert_eq!(samples(&coordinator, "syncopate_swaps_total")[0].1, report.swaps as f64);
    let mut checked = 0;
    for name in ["server-0", "server-1"] {
        let text = saved(name);
        let id = samples(&text, "syncopate_server_sent_bytes_total")[0].0.clone();
        let server =
            report.servers.iter().find(|s| id == format!(r#"server="{}""#, s.server)).expect("in the report");
        for shard in &server.shards {
            let k = shard.shard;
            let st = &shard.stats;
            assert_eq!(
                of_primary(&text, "syncopate_pushes_admitted_total", k),
                Some(st.pushes_admitted as f64)
            );
            assert_eq!(of_primary(&text, "syncopate_pulls_served_total", k), Some(st.pulls_served as f64));
            assert_eq!(
                of_primary(&text, "syncopate_pulls_deferred_total", k),
                Some(st.pulls_deferred as f64)
            );
            assert_eq!(of_primary(&text, "syncopate_optimizer_steps_total", k), Some(st.steps as f64));
            assert_eq!(of_primary(&text, "syncopate_shard_swaps_total", k), Some(st.swaps as f64));
            assert_eq!(st.swaps, 1, "shard {k} swapped once");
            let staleness: u64 = st.staleness.iter().sum();
            assert_eq!(of_primary(&text, "syncopate_push_staleness_count", k), Some(staleness as f64));
            // Protocol 20: the policy's calls and fuel, and when pushes arrived.
            let calls = of_primary(&text, "syncopate_policy_calls_total", k).unwrap();
            assert!(
                calls > 0.0 && calls <= shard.policy_usage.calls as f64,
                "{calls} vs {:?}",
                shard.policy_usage
            );
            assert!(of_primary(&text, "syncopate_policy_fuel_total", k).unwrap() > 0.0);
            let arrived = of_primary(&text, "syncopate_push_arrival_offset_seconds_count", k).unwrap();
            assert_eq!(arrived, shard.arrivals.counts.iter().sum::<u64>() as f64);
            assert_eq!(arrived, st.pushes_admitted as f64, "every push of this run is counted once");
            checked += 1;
        }
        // Payload bytes by codec: every push and pull is uncompressed here (4 bytes a value).
        for (family, direction) in [("pushed", "push"), ("pulled", "pull")] {
            let scraped = samples(&text, &format!("syncopate_{direction}_payload_bytes_total"));
            let none = server.payload_bytes.iter().find(|c| c.codec == "none").expect("f32 payloads");
            let want = if family == "pushed" { none.pushed } else { none.pulled };
            assert_eq!(scraped, vec![(format!(r#"server="{}",codec="none""#, server.server), want as f64)]);
            assert!(want > 0);
        }
        // The status the report is made of was asked for after the scrape: its own request
        // and answer are the only bytes between them.
        let sent = samples(&text, "syncopate_server_sent_bytes_total")[0].1 as u64;
        let received = samples(&text, "syncopate_server_received_bytes_total")[0].1 as u64;
        assert!(
            sent <= server.bytes_sent && server.bytes_sent - sent < 64 << 10,
            "{sent} vs {}",
            server.bytes_sent
        );
        assert!(
            received <= server.bytes_received && server.bytes_received - received < 64 << 10,
            "{received} vs {}",
            server.bytes_received
        );
    }
    assert_eq!(checked, 2, "every shard compared");
    // Every push of the run is in the counters: 600 iterations of 2 workers, on each shard.
    let total: f64 = ["server-0", "server-1"].iter().map(|n| admitted_primary(&saved(n))).sum();
    assert_eq!(total, 2.0 * 2.0 * 600.0);
}

fn admitted_primary(text: &str) -> f64 {
    samples(text, "syncopate_pushes_admitted_total")
        .iter()
        .filter(|(l, _)| l.contains(r#"role="primary""#))
        .map(|s| s.1)
        .sum()
}
