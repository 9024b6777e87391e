//! What the dashboard shows, folded from the cluster's status readings: a pure machine (a
//! reading and its time in, views out; no clock, no I/O), so it is tested with made-up
//! clusters of any size.
//!
//! Each reading becomes one [`Point`] of the run's history (the same [`WatchPoint`] the
//! launcher's watcher and TensorBoard read, with its rates), each worker's clock, speed and
//! waiting share, and the events a person wants told (swaps, failovers, quarantines, workers
//! joining and leaving). A [`View`] is sized for a browser at any cluster size: at 1,000
//! workers it carries histograms and the ten slowest and most-waiting workers, and
//! [`Board::worker`] gives one worker's detail on demand.

use std::collections::{BTreeMap, VecDeque};

use serde::Serialize;

use crate::lab::report::{staleness_mean, WatchPoint};
use crate::net::proto::{ClusterStatus, ShardStatus};
use syncopate_policy_sdk::abi::WorkerId;

/// Points of history kept: past this, every other point is dropped and readings are kept half
/// as often, so a long run's whole history fits (at one reading a second, the first hour in
/// full).
pub const HISTORY: usize = 3600;
/// Readings of one worker kept, for its drill-down.
pub const WORKER_HISTORY: usize = 240;
/// Events kept.
pub const EVENTS: usize = 200;
/// Up to this many workers a view lists every one; past it, histograms and the top lists.
pub const LIST_ALL: usize = 64;
/// Workers in each top list (slowest, most waiting).
pub const TOP: usize = 10;
/// Bins of each histogram.
pub const BINS: usize = 10;

/// One reading of the whole cluster.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    /// Seconds since the dashboard started.
    pub t_s: f64,
    /// Iterations pushed so far (shard 0's count).
    pub iterations: u64,
    /// Iterations per second since the last reading.
    pub iterations_per_s: Option<f64>,
    /// Share of the live workers' time spent in deferred pulls since the last reading.
    pub waiting_share: Option<f64>,
    /// Pulls deferred so far, all shards.
    pub deferred_pulls: u64,
    /// Pulls deferred per second since the last reading.
    pub deferred_per_s: Option<f64>,
    /// Pulls parked now, all shards.
    pub parked: u64,
    /// Pushes held now, all shards.
    pub held: u64,
    /// The fastest worker's clock less the slowest's.
    pub clock_spread: u64,
    /// Mean staleness of the pushes admitted so far (the last bucket counted at its floor).
    pub staleness_mean: Option<f64>,
    /// Bytes the servers sent and received per second since the last reading.
    pub server_bytes_per_s: Option<f64>,
    /// The live workers' mean last reported training loss.
    pub train_loss: Option<f64>,
    /// The latest test accuracy a worker reported (training scripts score their own model).
    pub accuracy: Option<f32>,
    /// The latest test loss a worker reported.
    pub test_loss: Option<f32>,
    /// The policy on shard 0.
    pub policy: String,
}

/// One worker at one reading.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerRow {
    /// The worker.
    pub worker: WorkerId,
    /// Its clock (the lowest over the shards).
    pub clock: u64,
    /// Iterations per second since the last reading.
    pub speed: f64,
    /// Share of the time since the last reading its pulls spent deferred (the longest wait
    /// over the shards).
    pub waiting_share: f64,
    /// Its mean reported compute time per iteration since the last reading, in milliseconds.
    pub step_ms: Option<f64>,
    /// The last training loss it reported.
    pub loss: Option<f32>,
}

/// A worker's reading, for its chart.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct WorkerPoint {
    /// Seconds since the dashboard started.
    pub t_s: f64,
    /// Its clock.
    pub clock: u64,
    /// Iterations per second.
    pub speed: f64,
    /// Waiting share.
    pub waiting_share: f64,
    /// Last reported loss.
    pub loss: Option<f32>,
}

/// One worker in detail ([`Board::worker`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerDetail {
    /// Its latest row.
    pub row: WorkerRow,
    /// Whether it is live on the shards now.
    pub live: bool,
    /// Per shard: its clock there and the seconds its pulls waited there.
    pub shards: Vec<(u32, u64, f64)>,
    /// Its recent readings, oldest first.
    pub series: Vec<WorkerPoint>,
}

/// Counts of values in equal bins between `lo` and `hi`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Histogram {
    /// The first bin's lower edge.
    pub lo: f64,
    /// The last bin's upper edge.
    pub hi: f64,
    /// Values per bin.
    pub counts: Vec<u32>,
}

impl Histogram {
    fn of(values: impl Iterator<Item = f64> + Clone, lo: Option<f64>, hi: Option<f64>) -> Self {
        let lo = lo.unwrap_or_else(|| values.clone().fold(f64::INFINITY, f64::min));
        let hi = hi.unwrap_or_else(|| values.clone().fold(f64::NEG_INFINITY, f64::max));
        let (lo, hi) = if lo.is_finite() && hi.is_finite() { (lo, hi.max(lo)) } else { (0.0, 0.0) };
        let mut counts = vec![0u32; BINS];
        let width = (hi - lo) / BINS as f64;
        for v in values {
            let bin = if width > 0.0 { ((v - lo) / width).floor() as isize } else { 0 };
            counts[bin.clamp(0, BINS as isize - 1) as usize] += 1;
        }
        Histogram { lo, hi, counts }
    }
}

/// The workers, aggregated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkersView {
    /// Workers the coordinator knows.
    pub registered: usize,
    /// Connected to it now.
    pub connected: usize,
    /// Left cleanly.
    pub finished: usize,
    /// Live on the shards now.
    pub live: usize,
    /// Lowest, median and highest clock of the live workers.
    pub clock: [u64; 3],
    /// The live workers' median speed (iterations per second).
    pub speed_median: f64,
    /// Their mean waiting share.
    pub waiting_mean: f64,
    /// Their speeds.
    pub speed_hist: Histogram,
    /// Their waiting shares, 0 to 1.
    pub waiting_hist: Histogram,
    /// The [`TOP`] slowest.
    pub slowest: Vec<WorkerRow>,
    /// The [`TOP`] waiting most.
    pub most_waiting: Vec<WorkerRow>,
    /// Every live worker, by id, up to [`LIST_ALL`] of them (`None` past that).
    pub all: Option<Vec<WorkerRow>>,
}

/// One shard.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ShardView {
    /// The shard.
    pub shard: u32,
    /// The server holding it.
    pub primary: u32,
    /// The server holding its backup.
    pub backup: Option<u32>,
    /// Its policy (name and version).
    pub policy: String,
    /// Quarantined (fallback rules run).
    pub quarantined: bool,
    /// The last policy failure here.
    pub last_failure: Option<String>,
    /// Pulls parked now.
    pub parked: u32,
    /// Pushes held now.
    pub held: u32,
    /// Pushes admitted so far.
    pub pushes: u64,
    /// Optimizer steps so far.
    pub steps: u64,
    /// Pulls deferred so far.
    pub pulls_deferred: u64,
    /// Mean staleness of its admitted pushes.
    pub staleness_mean: Option<f64>,
}

/// One server.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerView {
    /// Its id.
    pub server: u32,
    /// Lost (its shards failed over).
    pub lost: bool,
    /// Whether it answered the last reading.
    pub answered: bool,
    /// Shards it is primary for.
    pub primaries: Vec<u32>,
    /// Shards it keeps backups of.
    pub backups: Vec<u32>,
    /// Bytes sent on its data connections.
    pub bytes_sent: u64,
    /// Bytes received on them.
    pub bytes_received: u64,
}

/// A policy that ran, from when the dashboard saw it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SwapRecord {
    /// The swap's number (0: the policy the cluster started with).
    pub swap: u64,
    /// First seen (seconds since the dashboard started).
    pub t_s: f64,
    /// The policy's label.
    pub policy: String,
    /// Its configuration, `k=v,...`.
    pub config: String,
}

/// Something a person watching wants told.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    /// Seconds since the dashboard started.
    pub t_s: f64,
    /// `swap`, `failover`, `quarantine`, `recovered`, `pilot`, `workers` or `error`.
    pub kind: &'static str,
    /// What happened.
    pub text: String,
}

/// The cluster policy and swaps.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyView {
    /// The cluster's policy label.
    pub label: String,
    /// Its module's SHA-256, hex.
    pub sha256: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Swaps done.
    pub swaps: u64,
    /// Policies running on the shards (name and version), with how many shards run each.
    pub running: Vec<(String, u32)>,
}

/// What the page shows at one reading.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct View {
    /// Seconds since the dashboard started.
    pub t_s: f64,
    /// The dashboard's start, Unix milliseconds.
    pub started_unix_ms: u64,
    /// The policy.
    pub policy: PolicyView,
    /// The cluster policy (the autopilot, say), if one runs.
    pub pilot: Option<syncopate_engine::pilot::PilotStatus>,
    /// Servers.
    pub servers: Vec<ServerView>,
    /// Shards (primaries).
    pub shards: Vec<ShardView>,
    /// Workers.
    pub workers: WorkersView,
    /// This reading.
    pub point: Point,
    /// The policies that ran, oldest first.
    pub swaps: Vec<SwapRecord>,
    /// The latest events, oldest first.
    pub events: Vec<Event>,
}

/// What the board keeps of one worker.
#[derive(Debug, Default)]
struct Track {
    live: bool,
    clock: u64,
    /// Its mean reported compute time per iteration in the last window, nanoseconds (0: none).
    step_ns: u64,
    loss: Option<f32>,
    speed: f64,
    waiting_share: f64,
    shards: Vec<(u32, u64, f64)>,
    series: VecDeque<WorkerPoint>,
}

impl Track {
    fn row(&self, worker: WorkerId) -> WorkerRow {
        WorkerRow {
            worker,
            clock: self.clock,
            speed: self.speed,
            waiting_share: self.waiting_share,
            step_ms: (self.step_ns > 0).then(|| self.step_ns as f64 / 1e6),
            loss: self.loss,
        }
    }
}

/// The dashboard's state: readings in ([`observe`](Self::observe)), views out.
#[derive(Debug)]
pub struct Board {
    started_unix_ms: u64,
    history: Vec<Point>,
    /// Readings between kept points (doubles each time the history fills).
    stride: u64,
    readings: u64,
    last: Option<WatchPoint>,
    workers: BTreeMap<WorkerId, Track>,
    events: VecDeque<Event>,
    swaps: Vec<SwapRecord>,
    lost: Vec<u32>,
    quarantined: Vec<u32>,
    pilot_swaps: u64,
    /// The workers live at the last reading, by id.
    live_before: Vec<WorkerId>,
    /// Per-worker figures over each window between readings (the cluster policy's sampler).
    sampler: syncopate_engine::pilot::Sampler,
    view: Option<View>,
}

fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

impl Board {
    /// A board for a dashboard started at `started_unix_ms`.
    pub fn new(started_unix_ms: u64) -> Self {
        Board {
            started_unix_ms,
            history: Vec::new(),
            stride: 1,
            readings: 0,
            last: None,
            workers: BTreeMap::new(),
            events: VecDeque::new(),
            swaps: Vec::new(),
            lost: Vec::new(),
            quarantined: Vec::new(),
            pilot_swaps: 0,
            live_before: Vec::new(),
            sampler: Default::default(),
            view: None,
        }
    }

    fn tell(&mut self, t_s: f64, kind: &'static str, text: String) {
        if self.events.len() == EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(Event { t_s, kind, text });
    }

    /// Records that a reading at `t_s` failed (a server did not answer, say): the last view
    /// stands, with the failure among its events.
    pub fn failed(&mut self, t_s: f64, why: &str) {
        let text = format!("no reading: {why}");
        if self.events.back().is_none_or(|e| e.text != text) {
            self.tell(t_s, "error", text);
        }
        let events = self.latest_events();
        if let Some(v) = &mut self.view {
            v.events = events;
        }
    }

    /// The events a view carries: the latest 50, oldest first.
    fn latest_events(&self) -> Vec<Event> {
        self.events.iter().skip(self.events.len().saturating_sub(50)).cloned().collect()
    }

    /// Folds in the cluster's status read at `t_s` (seconds since the dashboard started).
    pub fn observe(&mut self, t_s: f64, status: &ClusterStatus) {
        let primaries: Vec<&ShardStatus> = status.servers.iter().flat_map(|s| &s.shards).collect();
        let mut reading = WatchPoint::of_shards(t_s, &primaries);
        reading.lost_servers = status.lost_servers.clone();
        reading.server_bytes = status.servers.iter().map(|s| s.bytes_sent + s.bytes_received).sum();
        let rates = self.last.as_ref().and_then(|prev| reading.rates_since(prev));
        let dt = self.last.as_ref().map(|p| t_s - p.t_s).filter(|dt| *dt > 0.0);

        // Workers: each one's clock (its lowest over the shards), its longest wait, its
        // reported compute and loss, from the shards' samples.
        for t in self.workers.values_mut() {
            t.live = false;
            t.shards.clear();
        }
        for shard in &primaries {
            for w in &shard.sample.work {
                let track = self.workers.entry(w.worker).or_default();
                track.shards.push((shard.shard, w.clock, w.waited_ns as f64 / 1e9));
            }
        }
        // Each worker over the window since the last reading, as the cluster policy sees it: the
        // autopilot's sampler, so the page and the policy agree.
        let samples = primaries.iter().map(|s| s.sample.clone()).collect();
        let figures = self.sampler.figures((t_s * 1e9) as u64, samples);
        let window_s = figures.window_ns as f64 / 1e9;
        for f in &figures.workers {
            let t = self.workers.entry(f.worker).or_default();
            if dt.is_some() && window_s > 0.0 {
                t.speed = f.iterations as f64 / window_s;
                t.waiting_share = (f.waited_ns as f64 / 1e9 / window_s).clamp(0.0, 1.0);
            }
            (t.live, t.clock, t.step_ns, t.loss) = (true, f.clock, f.step_ns, f.loss);
            if t.series.len() == WORKER_HISTORY {
                t.series.pop_front();
            }
            let (speed, waiting_share) = (t.speed, t.waiting_share);
            t.series.push_back(WorkerPoint { t_s, clock: f.clock, speed, waiting_share, loss: f.loss });
        }
        let live: Vec<WorkerId> = figures.workers.iter().map(|f| f.worker).collect();

        let losses: Vec<f64> = figures.workers.iter().filter_map(|f| f.loss).map(f64::from).collect();
        // The launcher's evaluation of the model, or else the latest a training script reported.
        let scored = status.evaluated.or(status.score.map(|s| s.score));
        let point = Point {
            t_s,
            iterations: reading.iterations,
            iterations_per_s: rates.map(|r| r.iterations_per_s),
            waiting_share: rates.map(|r| r.waiting_share),
            deferred_pulls: reading.pulls_deferred,
            deferred_per_s: self
                .last
                .as_ref()
                .zip(dt)
                .map(|(p, dt)| reading.pulls_deferred.saturating_sub(p.pulls_deferred) as f64 / dt),
            parked: primaries.iter().map(|s| u64::from(s.parked)).sum(),
            held: reading.held_now,
            clock_spread: reading.max_clock.saturating_sub(reading.min_clock),
            staleness_mean: reading.staleness_mean,
            server_bytes_per_s: rates.map(|r| r.server_bytes_per_s),
            train_loss: (!losses.is_empty()).then(|| losses.iter().sum::<f64>() / losses.len() as f64),
            accuracy: scored.map(|s| s.accuracy),
            test_loss: scored.and_then(|s| s.loss),
            policy: reading.policy.clone(),
        };
        self.events_of(t_s, status, &primaries, &live);
        self.readings += 1;
        if self.readings % self.stride == 1 || self.stride == 1 {
            if self.history.len() == HISTORY {
                let mut i = 0;
                self.history.retain(|_| {
                    i += 1;
                    i % 2 == 1
                });
                self.stride *= 2;
            }
            self.history.push(point.clone());
        }
        self.last = Some(reading);
        self.view = Some(self.make_view(t_s, status, &primaries, point));
    }

    /// Turns what changed since the last reading into events.
    fn events_of(&mut self, t_s: f64, status: &ClusterStatus, primaries: &[&ShardStatus], live: &[WorkerId]) {
        let config = status.config.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
        match self.swaps.last() {
            None => {
                self.swaps.push(SwapRecord {
                    swap: status.swaps,
                    t_s,
                    policy: status.policy.clone(),
                    config,
                });
                self.tell(t_s, "swap", format!("running {}", status.policy));
            }
            Some(last) if last.swap != status.swaps => {
                let text = format!("swap {}: {} now runs", status.swaps, status.policy);
                self.swaps.push(SwapRecord {
                    swap: status.swaps,
                    t_s,
                    policy: status.policy.clone(),
                    config,
                });
                if self.swaps.len() > EVENTS {
                    self.swaps.remove(1);
                }
                self.tell(t_s, "swap", text);
            }
            Some(_) => {}
        }
        for &server in &status.lost_servers {
            if !self.lost.contains(&server) {
                self.lost.push(server);
                self.tell(
                    t_s,
                    "failover",
                    format!("server {server} lost: its shards failed over to their backups"),
                );
            }
        }
        let quarantined: Vec<u32> = primaries.iter().filter(|s| s.quarantined).map(|s| s.shard).collect();
        for s in primaries {
            let was = self.quarantined.contains(&s.shard);
            if s.quarantined && !was {
                let why = s.last_failure.clone().unwrap_or_default();
                self.tell(t_s, "quarantine", format!("shard {} quarantined {}: {why}", s.shard, s.policy));
            } else if !s.quarantined && was {
                self.tell(t_s, "recovered", format!("shard {} runs {} again", s.shard, s.policy));
            }
        }
        self.quarantined = quarantined;
        if let Some(p) = &status.pilot {
            if p.swaps > self.pilot_swaps {
                self.tell(t_s, "pilot", format!("{} asked for swap {}", p.policy, p.swaps));
                self.pilot_swaps = p.swaps;
            }
        }
        let joined = live.iter().filter(|w| self.live_before.binary_search(w).is_err()).count();
        let left = self.live_before.iter().filter(|w| live.binary_search(w).is_err()).count();
        if joined > 0 || left > 0 {
            let text = match (joined, left) {
                (j, 0) => format!("{j} worker{} joined", if j == 1 { "" } else { "s" }),
                (0, l) => format!("{l} worker{} left", if l == 1 { "" } else { "s" }),
                (j, l) => format!("{j} joined, {l} left"),
            };
            self.tell(t_s, "workers", text);
        }
        self.live_before = live.to_vec();
    }

    fn make_view(&self, t_s: f64, status: &ClusterStatus, primaries: &[&ShardStatus], point: Point) -> View {
        let mut running: Vec<(String, u32)> = Vec::new();
        for s in primaries {
            match running.iter_mut().find(|r| r.0 == s.policy) {
                Some(r) => r.1 += 1,
                None => running.push((s.policy.clone(), 1)),
            }
        }
        let answered: Vec<u32> = status.servers.iter().map(|s| s.server).collect();
        let servers_known = status
            .placement
            .iter()
            .flat_map(|&(_, p, b)| std::iter::once(p).chain(b))
            .chain(answered.iter().copied())
            .chain(status.lost_servers.iter().copied())
            .max()
            .map_or(0, |m| m + 1);
        let servers = (0..servers_known)
            .map(|server| {
                let sv = status.servers.iter().find(|s| s.server == server);
                ServerView {
                    server,
                    lost: status.lost_servers.contains(&server),
                    answered: sv.is_some(),
                    primaries: status.placement.iter().filter(|p| p.1 == server).map(|p| p.0).collect(),
                    backups: status.placement.iter().filter(|p| p.2 == Some(server)).map(|p| p.0).collect(),
                    bytes_sent: sv.map_or(0, |s| s.bytes_sent),
                    bytes_received: sv.map_or(0, |s| s.bytes_received),
                }
            })
            .collect();
        let mut shards: Vec<ShardView> = primaries
            .iter()
            .map(|s| {
                let place = status.placement.iter().find(|p| p.0 == s.shard);
                ShardView {
                    shard: s.shard,
                    primary: place.map_or(0, |p| p.1),
                    backup: place.and_then(|p| p.2),
                    policy: s.policy.clone(),
                    quarantined: s.quarantined,
                    last_failure: s.last_failure.clone(),
                    parked: s.parked,
                    held: s.held,
                    pushes: s.stats.pushes_admitted,
                    steps: s.stats.steps,
                    pulls_deferred: s.stats.pulls_deferred,
                    staleness_mean: staleness_mean(std::iter::once(*s)),
                }
            })
            .collect();
        shards.sort_by_key(|s| s.shard);
        View {
            t_s,
            started_unix_ms: self.started_unix_ms,
            policy: PolicyView {
                label: status.policy.clone(),
                sha256: status.sha256.clone(),
                config: status.config.clone(),
                swaps: status.swaps,
                running,
            },
            pilot: status.pilot.clone(),
            servers,
            shards,
            workers: self.workers_view(status),
            point,
            swaps: self.swaps.clone(),
            events: self.latest_events(),
        }
    }

    fn workers_view(&self, status: &ClusterStatus) -> WorkersView {
        let live: Vec<WorkerRow> =
            self.workers.iter().filter(|(_, t)| t.live).map(|(&w, t)| t.row(w)).collect();
        let mut clocks: Vec<u64> = live.iter().map(|r| r.clock).collect();
        clocks.sort_unstable();
        let mut speeds: Vec<f64> = live.iter().map(|r| r.speed).collect();
        speeds.sort_by(f64::total_cmp);
        let top = |key: &dyn Fn(&WorkerRow) -> f64| {
            let mut rows: Vec<&WorkerRow> = live.iter().collect();
            rows.sort_by(|a, b| key(a).total_cmp(&key(b)).then(a.worker.cmp(&b.worker)));
            rows.into_iter().take(TOP).cloned().collect::<Vec<_>>()
        };
        WorkersView {
            registered: status.workers.len(),
            connected: status.workers.iter().filter(|w| w.connected).count(),
            finished: status.workers.iter().filter(|w| w.finished).count(),
            live: live.len(),
            clock: match clocks.len() {
                0 => [0; 3],
                n => [clocks[0], clocks[n / 2], clocks[n - 1]],
            },
            speed_median: median(&speeds),
            waiting_mean: match live.len() {
                0 => 0.0,
                n => live.iter().map(|r| r.waiting_share).sum::<f64>() / n as f64,
            },
            speed_hist: Histogram::of(live.iter().map(|r| r.speed), Some(0.0), None),
            waiting_hist: Histogram::of(live.iter().map(|r| r.waiting_share), Some(0.0), Some(1.0)),
            slowest: top(&|r| r.speed),
            most_waiting: top(&|r| -r.waiting_share),
            all: (live.len() <= LIST_ALL).then(|| live.clone()),
        }
    }

    /// The view of the last reading, if there was one.
    pub fn view(&self) -> Option<&View> {
        self.view.as_ref()
    }

    /// The run's history, oldest first ([`HISTORY`] points at most).
    pub fn history(&self) -> &[Point] {
        &self.history
    }

    /// One worker in detail, if the board has seen it.
    pub fn worker(&self, worker: WorkerId) -> Option<WorkerDetail> {
        let t = self.workers.get(&worker)?;
        Some(WorkerDetail {
            row: t.row(worker),
            live: t.live,
            shards: t.shards.clone(),
            series: t.series.iter().copied().collect(),
        })
    }
}

/// Made-up clusters of any size, for the board's tests and its benchmark
/// (`benches/dashboard.rs`).
pub mod made_up {
    use super::*;
    use crate::net::proto::{ServerStatus, WorkerStatus};
    use syncopate_engine::pilot::{ShardSample, WorkerWork};
    use syncopate_policy_sdk::abi::WorkerClock;

    /// A worker on every shard: its id, its clock (its pushes too), the nanoseconds its pulls
    /// waited there, and its last loss.
    pub type W = (WorkerId, u64, u64, f32);

    fn shard(id: u32, policy: &str, workers: &[W], staleness: &[(usize, u64)]) -> ShardStatus {
        let mut stats = crate::shard::ShardStats {
            pushes_admitted: workers.iter().map(|w| w.1).sum(),
            pulls_deferred: workers.len() as u64,
            ..Default::default()
        };
        for &(k, n) in staleness {
            stats.staleness[k] = n;
        }
        ShardStatus {
            shard: id,
            policy: policy.into(),
            sha256: "00".into(),
            config: Vec::new(),
            quarantined: false,
            workers: workers.iter().map(|w| WorkerClock { worker: w.0, clock: w.1 }).collect(),
            len: 10,
            stats,
            parked: 1,
            held: 0,
            waited_ns: workers.iter().map(|w| (w.0, w.2)).collect(),
            metrics: Vec::new(),
            last_failure: None,
            replication: None,
            held_longest: None,
            parked_longest: None,
            policy_failures_now: 0,
            backoff_ms: None,
            sample: ShardSample {
                shard: id,
                work: workers
                    .iter()
                    .map(|w| WorkerWork {
                        worker: w.0,
                        clock: w.1,
                        step_ns: w.1 * 2_000_000,
                        pushes: w.1,
                        loss: Some(w.3),
                        waited_ns: w.2,
                    })
                    .collect(),
                ..Default::default()
            },
            arrivals: Default::default(),
            policy_usage: Default::default(),
            policy_restarts: 0,
            held_ns: 0,
        }
    }

    /// A cluster of `shards` shards on `servers` servers (shard k on server k % servers),
    /// every worker the same on each shard.
    pub fn cluster(servers: u32, shards: u32, policy: &str, swaps: u64, workers: &[W]) -> ClusterStatus {
        ClusterStatus {
            policy: format!("builtin:{policy}"),
            sha256: "ab".into(),
            config: Vec::new(),
            swaps,
            servers: (0..servers)
                .map(|s| ServerStatus {
                    server: s,
                    addr: "127.0.0.1:1".parse().unwrap(),
                    shards: (0..shards)
                        .filter(|k| k % servers == s)
                        .map(|k| shard(k, &format!("{policy} 0.1.0"), workers, &[(0, 3), (2, 1)]))
                        .collect(),
                    backups: Vec::new(),
                    bytes_sent: 100,
                    bytes_received: 50,
                    payload_bytes: Vec::new(),
                })
                .collect(),
            workers: workers
                .iter()
                .map(|w| WorkerStatus { worker: w.0, connected: true, finished: false })
                .collect(),
            score: None,
            evaluated: None,
            placement: (0..shards).map(|k| (k, k % servers, Some((k + 1) % servers))).collect(),
            lost_servers: Vec::new(),
            checkpoint_error: None,
            pilot: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::made_up::{cluster, W};
    use super::*;

    #[test]
    fn two_readings_make_rates_speeds_and_waiting_shares() {
        let mut b = Board::new(0);
        b.observe(1.0, &cluster(2, 2, "bsp", 0, &[(0, 10, 0, 2.0), (1, 10, 0, 1.0)]));
        assert_eq!(b.view().unwrap().point.iterations_per_s, None, "one reading has no rate");
        // Two seconds on: worker 0 did 20 iterations, worker 1 10, and waited a second.
        b.observe(3.0, &cluster(2, 2, "bsp", 0, &[(0, 30, 0, 1.0), (1, 20, 1_000_000_000, 0.5)]));
        let v = b.view().unwrap();
        assert_eq!(v.point.iterations, 50);
        assert_eq!(v.point.iterations_per_s, Some(15.0));
        assert_eq!(v.point.waiting_share, Some(0.25), "one of two workers waited half the time");
        assert_eq!(v.point.train_loss, Some(0.75));
        assert_eq!(v.point.staleness_mean, Some(0.5), "3 at 0 and 1 at 2, on each shard");
        assert_eq!(v.point.parked, 2);
        let rows = v.workers.all.as_ref().unwrap();
        assert_eq!((rows[0].speed, rows[0].waiting_share), (10.0, 0.0));
        assert_eq!((rows[1].speed, rows[1].waiting_share), (5.0, 0.5));
        assert_eq!(rows[1].step_ms, Some(2.0));
        assert_eq!(v.workers.slowest[0].worker, 1);
        assert_eq!(v.workers.most_waiting[0].worker, 1);
        assert_eq!(v.workers.clock, [20, 30, 30]);
        let d = b.worker(1).unwrap();
        assert_eq!(d.shards, vec![(0, 20, 1.0), (1, 20, 1.0)]);
        assert_eq!(d.series.len(), 2);
        assert!(b.worker(7).is_none());
        assert_eq!(v.servers.len(), 2);
        assert_eq!((v.servers[0].primaries.clone(), v.servers[0].backups.clone()), (vec![0], vec![1]));
    }

    #[test]
    fn a_thousand_workers_make_a_view_a_browser_takes_in_one_bite() {
        let workers = |t: u64| -> Vec<W> {
            (0..1000u32)
                .map(|w| (w, t * (1 + u64::from(w % 50)), t * u64::from(w) * 1_000_000, 1.0))
                .collect()
        };
        let mut b = Board::new(0);
        b.observe(1.0, &cluster(8, 32, "ssp", 0, &workers(1)));
        b.observe(2.0, &cluster(8, 32, "ssp", 0, &workers(2)));
        let v = b.view().unwrap();
        assert_eq!(v.workers.live, 1000);
        assert!(v.workers.all.is_none(), "past {LIST_ALL}, no list of every worker");
        assert_eq!(v.workers.slowest.len(), TOP);
        assert!(
            v.workers.slowest.iter().all(|r| r.speed == 1.0 && r.worker % 50 == 0),
            "{:?}",
            v.workers.slowest
        );
        assert_eq!(v.workers.most_waiting[0].worker, 999, "the one that waited most");
        assert_eq!(v.workers.speed_hist.counts.iter().sum::<u32>(), 1000);
        assert_eq!(v.workers.waiting_hist.counts.iter().sum::<u32>(), 1000);
        let json = serde_json::to_string(v).unwrap();
        assert!(json.len() < 32 << 10, "{} bytes per view at 1,000 workers", json.len());
        // Each worker is still there to drill into.
        assert_eq!(b.worker(999).unwrap().shards.len(), 32);
    }

    #[test]
    fn swaps_failovers_quarantines_and_joins_are_told_once() {
        let w: Vec<W> = vec![(0, 1, 0, 1.0), (1, 1, 0, 1.0)];
        let mut b = Board::new(0);
        b.observe(0.0, &cluster(2, 2, "bsp", 0, &w));
        b.observe(1.0, &cluster(2, 2, "bsp", 0, &w));
        let mut c = cluster(2, 2, "ssp", 1, &w[..1]);
        // Server 1 lost: the coordinator no longer asks it.
        c.lost_servers = vec![1];
        c.servers.truncate(1);
        c.servers[0].shards[0].quarantined = true;
        c.servers[0].shards[0].last_failure = Some("trapped".into());
        b.observe(2.0, &c);
        b.observe(3.0, &c);
        let texts: Vec<&str> = b.view().unwrap().events.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "running builtin:bsp",
                "2 workers joined",
                "swap 1: builtin:ssp now runs",
                "server 1 lost: its shards failed over to their backups",
                "shard 0 quarantined ssp 0.1.0: trapped",
                "1 worker left",
            ]
        );
        let v = b.view().unwrap();
        assert_eq!(
            v.swaps.iter().map(|s| (s.swap, s.policy.as_str())).collect::<Vec<_>>(),
            [(0, "builtin:bsp"), (1, "builtin:ssp")]
        );
        assert!(v.servers[1].lost && !v.servers[1].answered);
        b.failed(4.0, "server 0 did not answer");
        b.failed(5.0, "server 0 did not answer");
        assert_eq!(
            b.events.iter().filter(|e| e.kind == "error").count(),
            1,
            "a repeated failure is told once"
        );
        // The page sees it at once: the last view stands, with the failure among its events.
        let last = b.view().unwrap().events.last().unwrap();
        assert_eq!((last.kind, last.text.as_str()), ("error", "no reading: server 0 did not answer"));
        assert_eq!(b.view().unwrap().t_s, 3.0);
    }

    #[test]
    fn a_long_run_keeps_a_bounded_history_from_its_start() {
        let w: Vec<W> = vec![(0, 1, 0, 1.0)];
        let mut b = Board::new(0);
        for i in 0..(3 * HISTORY as u64) {
            b.observe(i as f64, &cluster(1, 1, "asp", 0, &w));
        }
        let h = b.history();
        assert!(h.len() <= HISTORY && h.len() > HISTORY / 2, "{}", h.len());
        assert_eq!(h[0].t_s, 0.0, "the start is kept");
        assert!(h.windows(2).all(|p| p[0].t_s < p[1].t_s));
        assert!(h.last().unwrap().t_s > 3.0 * HISTORY as f64 - 10.0, "and the latest");
        assert_eq!(b.worker(0).unwrap().series.len(), WORKER_HISTORY);
    }
}
