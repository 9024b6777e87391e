//! A network partition on real links: server B runs in its own network namespace, joined by a
//! veth pair to a second namespace that holds the rest of the cluster (coordinator, server A,
//! three workers), as `docs/bandwidth.md` sets links up. Both namespaces are the test's own,
//! so no process of it listens on the machine's own interfaces. Mid-run B's end of the link goes down: B can reach nobody
//! and nobody can reach B. Its lease lapses, so it stops taking pushes; its shard fails over to
//! its backup on A. When the link comes back, B learns it was failed over and stops: it never
//! serves as a second primary. The `counter` workload then ends with every parameter at exactly
//! minus the sum of every push, read from the final checkpoint.
//!
//! Network namespaces and veth pairs need root (`CAP_NET_ADMIN`) and the veth driver; where the
//! test cannot set them up it says so and does nothing else.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use syncopate_suite::{OutputWithin, COMMAND_LIMIT};

use crate::cli::syncopate_bin;
use crate::cluster::wait_file;

/// The two namespaces (`a`: the cluster; `b`: server B), the veth pair between them and the
/// processes, removed on drop.
struct Net {
    a: String,
    b: String,
    veth: String,
    procs: Vec<(String, Child)>,
    dir: PathBuf,
}

impl Drop for Net {
    fn drop(&mut self) {
        for (_, p) in &mut self.procs {
            let _ = p.kill();
            let _ = p.wait();
        }
        // Deleting a namespace deletes its end of the pair, and with it the other end (the
        // pair's own deletion is for a set-up that failed before moving it).
        let _ = Command::new("ip")
            .args(["link", "del", &format!("{}a", self.veth)])
            .stderr(Stdio::null())
            .status();
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Net {
    /// The namespaces and the link, or `None` without the privileges.
    fn up(dir: &Path, subnet: &str) -> Option<Net> {
        let id = std::process::id() % 100_000;
        let (ns_a, ns_b, veth) = (format!("syncp{id}a"), format!("syncp{id}b"), format!("vsp{id}"));
        if !ip(&["netns", "add", &ns_a]) {
            return None;
        }
        let net = Net {
            a: ns_a.clone(),
            b: ns_b.clone(),
            veth: veth.clone(),
            procs: Vec::new(),
            dir: dir.to_path_buf(),
        };
        if !ip(&["netns", "add", &ns_b]) {
            return None; // `net`'s drop removes A
        }
        let (a, b) = (format!("{veth}a"), format!("{veth}b"));
        for args in [
            vec!["link", "add", &a, "type", "veth", "peer", "name", &b],
            vec!["link", "set", &a, "netns", &ns_a],
            vec!["link", "set", &b, "netns", &ns_b],
            vec!["-n", &ns_a, "addr", "add", &format!("{subnet}.1/24"), "dev", &a],
            vec!["-n", &ns_b, "addr", "add", &format!("{subnet}.2/24"), "dev", &b],
            vec!["-n", &ns_a, "link", "set", &a, "up"],
            vec!["-n", &ns_b, "link", "set", &b, "up"],
            vec!["-n", &ns_a, "link", "set", "lo", "up"],
            vec!["-n", &ns_b, "link", "set", "lo", "up"],
        ] {
            if !ip(&args) {
                // No veth here (a container without the module, say): nothing to test on.
                eprintln!("skipped: `ip {}` failed", args.join(" "));
                return None;
            }
        }
        Some(net)
    }

    /// B's end of the link up or down.
    fn link(&self, up: bool) {
        let b = format!("{}b", self.veth);
        assert!(ip(&["-n", &self.b, "link", "set", &b, if up { "up" } else { "down" }]));
    }

    /// `syncopate ARGS` in B's namespace if `in_b`, else in the cluster's.
    fn command(&self, in_b: bool, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", if in_b { &self.b } else { &self.a }]).arg(syncopate_bin()).args(args);
        c
    }

    /// Starts `syncopate ARGS` (in B's namespace if `in_b`), logging to `NAME.log`.
    fn spawn(&mut self, name: &str, in_b: bool, args: &[&str], token: &str) {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = self.command(in_b, args);
        cmd.env("SYNCOPATE_TOKEN", token)
            .env("SYNCOPATE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.procs.push((name.to_string(), cmd.spawn().expect("syncopate starts")));
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Waits for the named processes to exit; returns whether each succeeded.
    fn wait(&mut self, names: &[&str], within: Duration) -> Vec<bool> {
        let t = Instant::now();
        let mut out = Vec::new();
        for name in names {
            let (_, child) = self.procs.iter_mut().find(|(n, _)| n == name).expect("started");
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    out.push(status.success());
                    break;
                }
                assert!(t.elapsed() < within, "{name} did not finish within {within:?}:\n{}", self.log(name));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        out
    }
}

#[test]
fn a_partitioned_server_does_not_serve_as_a_second_primary() {
    let dir = crate::cluster::run_dir("partition");
    std::fs::create_dir_all(&dir).unwrap();
    let subnet = format!("10.231.{}", std::process::id() % 250);
    let Some(mut net) = Net::up(&dir, &subnet) else {
        eprintln!("skipped: cannot create a network namespace here (needs root)");
        return;
    };
    let tls = dir.join("tls");
    let bin = syncopate_bin();
    assert!(Command::new(&bin).arg("certs").arg(&tls).status().unwrap().success());
    let (tls, ckpt) = (tls.display().to_string(), dir.join("ckpt").display().to_string());
    let ready = dir.join("coordinator.addr");
    let token = "partition-test-token";
    let listen = format!("{subnet}.1:0");
    net.spawn(
        "coordinator",
        false,
        &[
            "coordinator",
            "--listen",
            &listen,
            "--servers",
            "2",
            "--workers",
            "3",
            "--shards",
            "3",
            "--replicas",
            "1",
            "--policy",
            "ssp:s=2",
            "--lr",
            "1",
            "--momentum",
            "0",
            "--push-weight",
            "sum",
            "--checkpoint-dir",
            &ckpt,
            "--checkpoint-every-s",
            "0",
            "--tls-dir",
            &tls,
            "--ready-file",
            ready.to_str().unwrap(),
        ],
        token,
    );
    let t = Instant::now();
    let coordinator = wait_file(&ready, Duration::from_secs(30), || net.log("coordinator"));
    // Server A first, so it is server 0; B, in the namespace, is server 1 and holds shard 1
    // (its backup on A) and the backups of shards 0 and 2.
    net.spawn(
        "server-a",
        false,
        &["server", "--coordinator", &coordinator, "--listen", &listen, "--tls-dir", &tls],
        token,
    );
    while !net.log("coordinator").contains("server registered") {
        assert!(t.elapsed() < Duration::from_secs(30), "{}", net.log("server-a"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let inside = format!("{subnet}.2:0");
    net.spawn(
        "server-b",
        true,
        &["server", "--coordinator", &coordinator, "--listen", &inside, "--tls-dir", &tls],
        token,
    );
    let ca = format!("{tls}/cert.pem");
    for w in 0..3 {
        let id = w.to_string();
        let args = [
            "worker",
            "--coordinator",
            &coordinator,
            "--ca",
            &ca,
            "--id",
            &id,
            "--workload",
            "counter",
            "--params",
            "64",
            "--iterations",
            "400",
            "--delay-ms",
            "20",
        ];
        net.spawn(&format!("worker-{w}"), false, &args, token);
    }
    // Let them train a while, then cut B off for 3 s: past its lease and the failover (1.3 s),
    // short of the QUIC idle timeout (10 s), so its connections are still there when it is back.
    std::thread::sleep(Duration::from_secs(3));
    net.link(false);
    std::thread::sleep(Duration::from_secs(3));
    net.link(true);
    let done = net.wait(&["worker-0", "worker-1", "worker-2"], Duration::from_secs(120));
    assert!(done.iter().all(|ok| *ok), "every worker finished:\n{}", net.log("worker-0"));
    let coord_log = net.log("coordinator");
    assert!(coord_log.contains("failover: backup promoted to primary"), "{coord_log}");
    net.wait(&["server-b"], Duration::from_secs(30));
    let b = net.log("server-b");
    // Told at its next lease renewal, or when it rejoins the coordinator after giving up on
    // its connection (a whole lease without an answer).
    assert!(b.contains("this server was failed over"), "B stopped once back:\n{b}");
    let shutdown = net
        .command(false, &["shutdown", "--coordinator", &coordinator, "--ca", &ca])
        .env("SYNCOPATE_TOKEN", token)
        .output_within(COMMAND_LIMIT)
        .unwrap();
    assert!(shutdown.status.success(), "{}", String::from_utf8_lossy(&shutdown.stderr));
    net.wait(&["coordinator", "server-a"], Duration::from_secs(30));
    let round = syncopate::checkpoint::latest(Path::new(&ckpt)).expect("the final checkpoint");
    for shard in 0..3 {
        let snap =
            syncopate::checkpoint::read_snapshot(&syncopate::checkpoint::shard_file(&round.dir, shard))
                .unwrap();
        for v in snap.params() {
            assert_eq!(*v, -(1.0 + 2.0 + 3.0) * 400.0, "shard {shard}: every push once, none lost");
        }
    }
}
