//! The live dashboard (issue 54): `syncopate local --dashboard` serves the coordinator's page,
//! its vendored assets, the view as JSON and live as server-sent events; it follows a swap
//! asked from it, which needs the operator token, and refuses a module that fails the check
//! `policy swap` gives. (The page itself is driven in a real browser by
//! `python/tests/test_dashboard.py`.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;
use syncopate::net::tls::ClusterFile;

use crate::cluster::LocalRun;

/// One HTTP/1.0 request: the status code and the body.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connects");
    // A swap of an uploaded module waits for its check (generated cases, in a debug build on a
    // busy machine): two minutes, then the test fails instead of hanging.
    conn.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).unwrap();
    conn.write_all(body).unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).expect("an answer within 120 s");
    let answer = String::from_utf8(answer).expect("text");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("a status code");
    (code, body.to_string())
}

fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (code, body) = http(addr, "GET", path, &[], b"");
    (code, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body}")))
}

/// The first `n` views the event stream sends, within `within`.
fn stream_views(addr: SocketAddr, n: usize, within: Duration) -> Vec<Value> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connects");
    conn.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    write!(conn, "GET /api/events HTTP/1.0\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").unwrap();
    let (t, mut text, mut buf) = (Instant::now(), String::new(), [0u8; 64 << 10]);
    loop {
        let views: Vec<Value> = text
            .split("\n\n")
            .filter(|e| e.contains("event: view"))
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect();
        if views.len() >= n {
            assert!(text.contains("content-type: text/event-stream"), "{}", &text[..text.len().min(400)]);
            return views;
        }
        assert!(t.elapsed() < within, "{} views of {n} in {within:?}:\n{text}", views.len());
        match conn.read(&mut buf) {
            Ok(0) => panic!("the event stream ended:\n{text}"),
            Ok(k) => text.push_str(&String::from_utf8_lossy(&buf[..k])),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => panic!("{e}"),
        }
    }
}

/// Waits until the view satisfies `ok`.
fn wait_view(addr: SocketAddr, within: Duration, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let (code, view) = get_json(addr, "/api/view");
        if code == 200 && ok(&view) {
            return view;
        }
        assert!(t.elapsed() < within, "{what} not seen in {within:?}: {view}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_local_cluster_serves_a_live_dashboard_that_swaps_only_with_the_operator_token() {
    let mut run = LocalRun::start(
        "dashboard",
        // `--dashboard` alone: loopback, a free port.
        &[
            "--workers",
            "3",
            "--servers",
            "2",
            "--iterations",
            "1500",
            "--params",
            "64",
            "--delay-ms",
            "10",
            "--dashboard",
        ],
    );
    let cluster = run.cluster_file();
    let file = ClusterFile::read(&cluster).unwrap();
    let addr =
        file.dashboard.unwrap_or_else(|| panic!("cluster.json names the dashboard:\n{}", run.output()));
    assert!(addr.ip().is_loopback(), "{addr}");
    assert!(run.output().contains(&format!("dashboard: http://{addr}/#token=")), "{}", run.output());

    // The page and its assets, all served by the coordinator (nothing from a CDN).
    let (code, page) = http(addr, "GET", "/", &[], b"");
    assert_eq!(code, 200);
    assert!(page.contains(r#"src="/assets/uPlot.iife.min.js""#) && !page.contains("https://cdn"), "{page}");
    for asset in ["dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot-LICENSE.txt"]
    {
        let (code, body) = http(addr, "GET", &format!("/assets/{asset}"), &[], b"");
        assert!(code == 200 && body.len() > 500, "{asset}: {code}");
    }
    assert_eq!(http(addr, "GET", "/assets/secrets", &[], b"").0, 404);

    // Live: three workers training on two servers' shards, the counters moving between views.
    let view = wait_view(addr, Duration::from_secs(60), "three live workers pushing", |v| {
        v["workers"]["live"] == 3 && v["point"]["iterations"].as_u64().unwrap_or(0) > 20
    });
    assert_eq!(view["policy"]["label"], "builtin:bsp");
    assert_eq!(view["servers"].as_array().unwrap().len(), 2, "{view}");
    assert_eq!(view["workers"]["all"].as_array().unwrap().len(), 3, "few workers: every one listed");
    let views = stream_views(addr, 3, Duration::from_secs(30));
    let (first, last) = (&views[0], &views[views.len() - 1]);
    assert!(last["t_s"].as_f64() > first["t_s"].as_f64(), "a new reading each time");
    assert!(last["point"]["iterations"].as_u64() > first["point"]["iterations"].as_u64(), "{first}\n{last}");
    let (code, history) = get_json(addr, "/api/history");
    let history = history.as_array().unwrap();
    assert!(code == 200 && history.len() >= 3, "{history:?}");
    assert!(history.windows(2).all(|w| w[0]["t_s"].as_f64() < w[1]["t_s"].as_f64()));

    // One worker in detail; ids that are not workers are refused clearly.
    let (code, worker) = get_json(addr, "/api/worker/1");
    assert_eq!(code, 200, "{worker}");
    assert!(worker["live"] == true && worker["row"]["clock"].as_u64() > Some(0), "{worker}");
    assert_eq!(worker["shards"].as_array().unwrap().len(), 2, "both shards: {worker}");
    assert_eq!(get_json(addr, "/api/worker/999").0, 404);
    assert_eq!(get_json(addr, "/api/worker/x").0, 400);

    // A swap needs the operator token: none, or a wrong one, is refused and swaps nothing.
    let swap = |token: Option<&str>, policy: &str, body: &[u8]| {
        let auth = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
        let (code, body) = http(addr, "POST", &format!("/api/swap?policy={policy}"), &headers, body);
        (code, serde_json::from_str::<Value>(&body).unwrap_or_else(|_| panic!("{body}")))
    };
    let (code, answer) = swap(None, "ssp:s%3D2", b"");
    assert_eq!(code, 401, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("operator token"), "{answer}");
    assert_eq!(swap(Some("not-the-token"), "ssp:s%3D2", b"").0, 401);
    assert_eq!(swap(Some(&file.token), "no-such-rule", b"").0, 400);
    // A module that breaks the rules in a generated case is refused before it reaches a shard.
    let hostile = syncopate_suite::hostile_wasm();
    let (code, answer) = swap(Some(&file.token), "hostile.wasm:mode%3Dpush:panic", &hostile);
    assert_eq!(code, 400, "{answer}");
    assert!(answer["error"].as_str().unwrap().contains("breaks a rule"), "{answer}");
    assert_eq!(get_json(addr, "/api/view").1["policy"]["swaps"], 0, "nothing swapped yet");

    // With the token: SSP on every shard, told on the page.
    let (code, answer) = swap(Some(&file.token), "ssp:s%3D2", b"");
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["outcome"], "done", "{answer}");
    assert_eq!(answer["swap"], 1);
    let view = wait_view(addr, Duration::from_secs(30), "the swap", |v| {
        v["policy"]["swaps"] == 1
            && v["shards"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["policy"].as_str().unwrap().starts_with("ssp"))
    });
    assert_eq!(view["policy"]["label"], "builtin:ssp");
    let swaps = view["swaps"].as_array().unwrap();
    assert_eq!(swaps.len(), 2, "the start and one swap: {view}");
    assert_eq!((swaps[1]["swap"].clone(), swaps[1]["config"].clone()), (1.into(), "s=2".into()));
    let events: Vec<&str> =
        view["events"].as_array().unwrap().iter().map(|e| e["text"].as_str().unwrap()).collect();
    assert!(events.iter().any(|e| e.contains("swap 1: builtin:ssp now runs")), "{events:?}");
    // The workers may join across readings ("2 workers joined", then "1 worker joined").
    let joined: u32 = events
        .iter()
        .filter_map(|e| e.strip_suffix(" workers joined").or_else(|| e.strip_suffix(" worker joined")))
        .map(|n| n.parse::<u32>().unwrap())
        .sum();
    assert_eq!(joined, 3, "{events:?}");

    // An uploaded module that passes the check goes in as a built-in does.
    let example = std::fs::read(env!("SYNCOPATE_EXAMPLE_WASM")).unwrap();
    let (code, answer) = swap(Some(&file.token), "example.wasm", &example);
    assert_eq!((code, answer["outcome"].as_str()), (200, Some("done")), "{answer}");
    wait_view(addr, Duration::from_secs(30), "the uploaded module", |v| {
        v["policy"]["label"] == "example.wasm"
    });

    let (st, run) = run.finish(Duration::from_secs(180));
    assert!(st.success(), "{}", run.output());
    assert_eq!(run.report().swaps, 2, "both swaps are in the report");
}
