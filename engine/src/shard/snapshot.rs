//! A shard's whole state as one value: what a checkpoint writes and a restore reads back.
//!
//! [`Shard::snapshot`] takes it between events: the parameters and optimizer velocity, clocks,
//! pending requests (parked pulls, held pushes, incomplete aggregates and task parts, tasks out on
//! loan), timers, random stream, counters, and the policy's state as its own `export_state` gives
//! it. [`Shard::restore`] rebuilds the shard from it the way the supervisor restarts a failed
//! policy: a fresh instance of the same module imports the state, and every pending request is
//! handed to it again as a fresh event, so none is left waiting on a decision the old instance
//! would have made. Everything outside the policy comes back exactly; a policy that exports its
//! whole state decides as before, one that exports nothing (most built-ins keep only the clocks
//! the host hands over) re-decides its pending requests. Either way every admitted push is in
//! the parameters once (`tests` below, for every built-in policy).
//!
//! [`ShardSnapshot::encode`] frames a snapshot for storage: a magic, the format, the body's
//! length and SHA-256, then the body (postcard). [`ShardSnapshot::decode`] refuses a torn or
//! corrupt one with a [`SnapshotError`] that says what is wrong, so a reader falls back to an
//! older snapshot instead of restoring garbage.

use std::sync::Arc;

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use syncopate_policy_sdk::abi::{RequestId, Signals, TimerId, UpdateMode, WorkerClock, WorkerId};
use syncopate_policy_sdk::clocks::Clocks;

use super::elsewhere::Elsewhere;
use super::parked::ParkedPulls;
use super::supervisor::{Health, Kept, Supervisor};
use super::{
    Aggregate, Held, LocalSgd, Metric, Optimizer, Parked, Partial, PushWeight, Shard, ShardConfig, ShardSink,
    ShardStats, StartKind, TaskLedger,
};
use crate::runtime::{PolicyError, PolicyModule};

/// The snapshot format [`ShardSnapshot::encode`] writes. [`ShardSnapshot::decode`] reads it,
/// format 6 (which had no signals of held pushes: ABI v3's [`Signals`]; a format-6 snapshot's
/// held pushes restore with none), format 5 (which had no record of which workers wait on other shards: a format-5 snapshot
/// restores with none, and the shard learns them again from the workers' next requests) and
/// format 4 (which had no record of the policy's failures either: [`Health`]; a format-4
/// snapshot restores with a clean one).
pub const SNAPSHOT_FORMAT: u32 = 7;

/// The oldest format [`ShardSnapshot::decode`] reads.
pub const OLDEST_SNAPSHOT_FORMAT: u32 = 4;

const MAGIC: &[u8; 8] = b"SYNCSNAP";
/// Magic, format (u32), body length (u64), SHA-256 of the body.
const HEADER_LEN: usize = 8 + 4 + 8 + 32;

/// Why a snapshot cannot be read or restored.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Not a snapshot at all, or cut short before the end of its header.
    #[error("not a shard snapshot ({0})")]
    NotASnapshot(String),
    /// Written by another format of Syncopate.
    #[error(
        "snapshot format {found}, this build reads formats {OLDEST_SNAPSHOT_FORMAT} to {SNAPSHOT_FORMAT}"
    )]
    Format {
        /// The format found.
        found: u32,
    },
    /// Shorter or longer than its header says: a torn write.
    #[error("torn snapshot: the header promises {expected} bytes of body, the file has {found}")]
    Torn {
        /// Bytes the header promises.
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// The body does not match its checksum.
    #[error("corrupt snapshot: the body's SHA-256 does not match the header's")]
    Checksum,
    /// The body does not decode.
    #[error("undecodable snapshot body: {0}")]
    Body(String),
    /// The body decodes but breaks the shard's bounds (a worker id past `max_workers`,
    /// per-worker tables of different lengths).
    #[error("inconsistent snapshot: {0}")]
    Inconsistent(String),
    /// The snapshot is of another shard, or another split of the model.
    #[error("the snapshot is of shard {found} of {found_of}, not shard {expected} of {expected_of}")]
    WrongShard {
        /// The shard being restored.
        expected: u32,
        /// Shards in the cluster being restored.
        expected_of: u32,
        /// The snapshot's shard.
        found: u32,
        /// The snapshot's shard count.
        found_of: u32,
    },
    /// The module offered for the restore is not the one whose state the snapshot holds.
    #[error("the snapshot's policy is {expected}; the module offered is {found}")]
    WrongPolicy {
        /// The snapshot's module (name and SHA-256 prefix).
        expected: String,
        /// The module offered.
        found: String,
    },
    /// The policy refused its own state.
    #[error("the policy cannot take back its state: {0}")]
    Policy(#[from] PolicyError),
}

/// One shard's whole state (see the module docs). Build it with [`Shard::snapshot`], store it
/// with [`encode`](Self::encode), and turn it back into a shard with [`Shard::restore`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardSnapshot {
    shard: u32,
    shards: u32,
    now_ns: u64,
    policy_name: String,
    policy_sha256: [u8; 32],
    policy_config: Vec<(String, String)>,
    policy_state: Vec<u8>,
    quarantined: bool,
    params: Vec<f32>,
    version: u64,
    optimizer: Optimizer,
    push_weight: PushWeight,
    workers: Vec<WorkerClock>,
    floor: u64,
    next_push: Vec<u64>,
    applied: Vec<u64>,
    waited: Vec<u64>,
    mode: UpdateMode,
    aggregates: Vec<(u64, Aggregate)>,
    /// The policy's open groups (format 2).
    groups: Vec<(u64, Aggregate)>,
    /// Local steps and the outer optimizer, its momentum included (format 3), and its delay
    /// (format 4).
    local: LocalSgd,
    /// The codec pulls are answered in (format 3).
    pull_codec: super::Codec,
    parked: Vec<Parked>,
    held: Vec<Held>,
    partials: Vec<Partial>,
    ledger: TaskLedger,
    timers: Vec<(TimerId, u64)>,
    rng_seed: [u8; 32],
    rng_stream: u64,
    rng_word_pos: u128,
    next_id: RequestId,
    stats: ShardStats,
    metrics: Vec<Metric>,
    last_failure: Option<String>,
    /// The policy's record of failures, counted across restarts (format 5).
    health: Health,
    /// The cluster's number of the swap that put the policy in, and its raise (format 5).
    swap: (u64, Vec<super::ClockRaise>),
    /// Which workers wait on other shards (format 6): a backup started from a snapshot, or a
    /// restored shard, finds a rule stalled as the shard it copies would.
    elsewhere: Elsewhere,
    /// The signals of the held pushes, in `held`'s order (format 7: a push's serialized form
    /// leaves them out, as it was before ABI v3).
    held_signals: Vec<Signals>,
}

impl ShardSnapshot {
    /// The shard.
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Shards in the model's split.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The driver's time when it was taken (a restoring driver continues its clock from here, so
    /// parked pulls' waits and timers keep their meaning).
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// The parameters.
    pub fn params(&self) -> &[f32] {
        &self.params
    }

    /// Optimizer steps applied.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// SHA-256 of the policy module whose state it holds.
    pub fn policy_sha256(&self) -> [u8; 32] {
        self.policy_sha256
    }

    /// The live workers and their clocks.
    pub fn workers(&self) -> &[WorkerClock] {
        &self.workers
    }

    /// The next iteration the shard expects from `worker`, if it is live.
    pub fn next_push(&self, worker: WorkerId) -> Option<u64> {
        let live = self.workers.iter().any(|w| w.worker == worker);
        live.then(|| self.next_push.get(worker as usize).copied()).flatten()
    }

    /// The counters.
    pub fn stats(&self) -> &ShardStats {
        &self.stats
    }

    /// The framed bytes: header (magic, format, length, SHA-256) and postcard body.
    pub fn encode(&self) -> Vec<u8> {
        let body = postcard::to_allocvec(self).expect("a snapshot always serializes");
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&SNAPSHOT_FORMAT.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&Sha256::digest(&body));
        out.extend_from_slice(&body);
        out
    }

    /// Reads framed bytes back, checking the header and the checksum first.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        if bytes.len() < HEADER_LEN {
            return Err(SnapshotError::NotASnapshot(format!("{} bytes, shorter than a header", bytes.len())));
        }
        if &bytes[..8] != MAGIC {
            return Err(SnapshotError::NotASnapshot("wrong magic".into()));
        }
        let found = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if !(OLDEST_SNAPSHOT_FORMAT..=SNAPSHOT_FORMAT).contains(&found) {
            return Err(SnapshotError::Format { found });
        }
        let expected = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
        let body = &bytes[HEADER_LEN..];
        if body.len() as u64 != expected {
            return Err(SnapshotError::Torn { expected, found: body.len() as u64 });
        }
        if Sha256::digest(body).as_slice() != &bytes[20..52] {
            return Err(SnapshotError::Checksum);
        }
        let undecodable = |e: postcard::Error| SnapshotError::Body(e.to_string());
        if found < SNAPSHOT_FORMAT {
            // Formats 5 to 7 only added fields at the end (postcard is positional): a format-4
            // body followed by a clean record and swap 0 is a format-5 body, a format-5 body
            // followed by no worker waiting elsewhere is a format-6 body, and a format-6 body
            // followed by no signals is a format-7 body.
            let mut body = body.to_vec();
            if found == 4 {
                body.extend(postcard::to_allocvec(&Health::default()).expect("a record serializes"));
                let swap: (u64, Vec<super::ClockRaise>) = (0, Vec::new());
                body.extend(postcard::to_allocvec(&swap).expect("a swap serializes"));
            }
            if found <= 5 {
                body.extend(postcard::to_allocvec(&Elsewhere::default()).expect("marks serialize"));
            }
            let none: Vec<Signals> = Vec::new();
            body.extend(postcard::to_allocvec(&none).expect("no signals serialize"));
            return postcard::from_bytes(&body).map_err(undecodable).map(Self::with_signals);
        }
        postcard::from_bytes(body).map_err(undecodable).map(Self::with_signals)
    }

    /// Puts the held pushes' signals, kept beside them, back in them.
    fn with_signals(mut self) -> Self {
        for (h, signals) in self.held.iter_mut().zip(&self.held_signals) {
            h.push.signals = *signals;
        }
        self
    }
}

fn short(name: &str, sha: &[u8; 32]) -> String {
    let hex: String = sha[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("`{name}` ({hex})")
}

impl Shard {
    /// The shard's whole state, taken between events at driver time `now_ns`. Asks the policy for
    /// its state (one `export_state` call); a quarantined policy's last checkpoint is kept.
    pub fn snapshot(&mut self, now_ns: u64) -> Result<ShardSnapshot, PolicyError> {
        debug_assert!(self.queue.is_empty() && self.incoming.is_none() && self.undecided_pull.is_none());
        let (policy_state, quarantined, health) = self.supervisor.snapshot()?;
        let module = self.supervisor.module();
        Ok(ShardSnapshot {
            shard: self.shard,
            shards: self.supervisor.shards(),
            now_ns,
            policy_name: module.info().name.clone(),
            policy_sha256: module.sha256(),
            policy_config: self.supervisor.config().to_vec(),
            policy_state,
            quarantined,
            params: self.params.as_ref().clone(),
            version: self.version,
            optimizer: self.optimizer.clone(),
            push_weight: self.push_weight,
            workers: self.clocks.workers().collect(),
            floor: self.floor,
            next_push: self.next_push.clone(),
            applied: self.applied.clone(),
            waited: self.waited.clone(),
            mode: self.mode,
            aggregates: self.aggregates.iter().map(|(k, a)| (*k, a.clone())).collect(),
            groups: self.groups.iter().map(|(k, a)| (*k, a.clone())).collect(),
            local: self.local.clone(),
            pull_codec: self.pull_codec,
            parked: self.parked.as_slice().to_vec(),
            held: self.held.clone(),
            held_signals: self.held.iter().map(|h| h.push.signals).collect(),
            partials: self.partials.clone(),
            ledger: self.ledger.clone(),
            timers: self.timers.clone(),
            rng_seed: self.rng.get_seed(),
            rng_stream: self.rng.get_stream(),
            rng_word_pos: self.rng.get_word_pos(),
            next_id: self.next_id,
            stats: self.stats,
            metrics: self.metrics.clone(),
            last_failure: self.last_failure.clone(),
            health,
            swap: self.swap.clone(),
            elsewhere: self.elsewhere.clone(),
        })
    }

    /// The shard a snapshot describes, run by `module` (which must be the module whose state the
    /// snapshot holds), continuing at driver time `snap.now_ns()`. `cfg` gives the shard's place
    /// and supervision; the optimizer, push weight, policy configuration and random stream come
    /// from the snapshot, as they were when it was taken. The pending requests are handed to the
    /// policy again (see the module docs); what that decides goes to `sink`.
    pub fn restore(
        cfg: ShardConfig,
        snap: ShardSnapshot,
        module: &PolicyModule,
        sink: &mut dyn ShardSink,
    ) -> Result<Shard, SnapshotError> {
        let now_ns = snap.now_ns;
        if snap.shard != cfg.shard || snap.shards != cfg.shards {
            return Err(SnapshotError::WrongShard {
                expected: cfg.shard,
                expected_of: cfg.shards,
                found: snap.shard,
                found_of: snap.shards,
            });
        }
        if module.sha256() != snap.policy_sha256 {
            return Err(SnapshotError::WrongPolicy {
                expected: short(&snap.policy_name, &snap.policy_sha256),
                found: short(&module.info().name, &module.sha256()),
            });
        }
        check_bounds(&snap, cfg.max_workers)?;
        let kept = Kept {
            state: snap.policy_state,
            workers: snap.workers.clone(),
            quarantined: snap.quarantined,
            health: snap.health,
            now_ns: snap.now_ns,
        };
        let supervisor =
            Supervisor::restore(cfg.supervisor, (cfg.shard, cfg.shards), module, &snap.policy_config, kept)?;
        let mut clocks = Clocks::new();
        for w in &snap.workers {
            clocks.join(w.worker, w.clock);
        }
        let mut parked = ParkedPulls::new();
        for p in snap.parked {
            parked.push(p);
        }
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::from_seed(snap.rng_seed);
        rng.set_stream(snap.rng_stream);
        rng.set_word_pos(snap.rng_word_pos);
        let mut shard = Shard {
            shard: snap.shard,
            arrivals: Default::default(),
            held_ns: 0,
            params: Arc::new(snap.params),
            optimizer: snap.optimizer,
            push_weight: snap.push_weight,
            max_workers: cfg.max_workers,
            clocks,
            floor: snap.floor,
            next_push: snap.next_push,
            applied: snap.applied,
            applied_min: None,
            worked: vec![(0, 0, None); snap.waited.len()],
            waited: snap.waited,
            version: snap.version,
            mode: snap.mode,
            aggregates: snap.aggregates.into_iter().collect(),
            groups: snap.groups.into_iter().collect(),
            local: snap.local,
            pull_codec: snap.pull_codec,
            spare_sums: Vec::new(),
            parked,
            held_at: snap.held.iter().map(|h| (h.push.id, snap.now_ns)).collect(),
            held: snap.held,
            partials: snap.partials,
            ledger: snap.ledger,
            incoming: None,
            answers: Default::default(),
            undecided_pull: None,
            timers: snap.timers,
            supervisor,
            rng,
            next_id: snap.next_id,
            scratch: Vec::with_capacity(256),
            queue: Default::default(),
            stats: snap.stats,
            metrics: snap.metrics,
            last_failure: snap.last_failure,
            stall_check_at: None,
            leaving: None,
            elsewhere: snap.elsewhere,
            now_ns,
            swap: snap.swap,
        };
        shard.recount_departed();
        shard.policy_started(StartKind::Restart, now_ns, &[], &[], sink);
        shard.requeue_pending(now_ns);
        shard.drain(now_ns, sink);
        Ok(shard)
    }

    /// A live worker that reconnects (after the shard was restored, say) rejoins without its
    /// policy hearing anything: it is already a member. Returns the next iteration the shard
    /// expects from it; earlier iterations it pushes again are duplicates.
    pub fn rejoin(&self, worker: WorkerId) -> Result<u64, super::ShardError> {
        match self.clocks.is_live(worker) {
            true => Ok(self.next_push[worker as usize]),
            false => Err(super::ShardError::UnknownWorker(worker, self.shard)),
        }
    }

    /// The iteration this shard expects next from `worker`, in the numbering of its last
    /// membership here: a member's next push, or where one that left stopped; 0 for a worker
    /// that never joined.
    pub fn resumes_at(&self, worker: WorkerId) -> u64 {
        self.next_push.get(worker as usize).copied().unwrap_or(0)
    }

    /// Whether `worker` is a live member.
    pub fn is_member(&self, worker: WorkerId) -> bool {
        self.clocks.is_live(worker)
    }

    /// Whether `worker`'s push for `iteration` is held, undecided, by the policy.
    pub fn is_push_held(&self, worker: WorkerId, iteration: u64) -> bool {
        self.held.iter().any(|h| h.push.worker == worker && h.push.iteration == iteration)
    }
}

/// Checks what the restore indexes by worker id before it sizes or indexes anything: a
/// snapshot comes from disk or from another server, so it is input like any other.
fn check_bounds(snap: &ShardSnapshot, max_workers: u32) -> Result<(), SnapshotError> {
    let bad = |what: String| Err(SnapshotError::Inconsistent(what));
    let max = max_workers as usize;
    let n = snap.next_push.len();
    if n > max || snap.applied.len() != n || snap.waited.len() != n {
        return bad(format!(
            "per-worker tables of {n}, {} and {} entries (at most {max}, all equal)",
            snap.applied.len(),
            snap.waited.len()
        ));
    }
    if let Some(w) = snap.workers.iter().find(|w| w.worker as usize >= n) {
        return bad(format!("member {} lies outside the per-worker tables ({n} entries)", w.worker));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::{OptimizerConfig, PullReply, PullRequest, PushRequest, ShardSink};
    use crate::tasks::ControlMessage;

    /// What a shard told its driver, in order, for comparing two shards.
    #[derive(Debug, Default, PartialEq)]
    struct Log(Vec<String>);

    impl ShardSink for Log {
        fn pull_served(&mut self, r: PullReply<'_>) {
            let bits: Vec<u32> = r.values.iter().map(|v| v.to_bits()).collect();
            self.0
                .push(format!("pull {} {} v{} w{} {bits:?}", r.worker, r.iteration, r.version, r.waited_ns));
        }
        fn push_acked(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
            self.0.push(format!("ack {id} {worker} {iteration}"));
        }
        fn push_dropped(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
            self.0.push(format!("drop {id} {worker} {iteration}"));
        }
        fn control(&mut self, worker: WorkerId, msg: ControlMessage) {
            self.0.push(format!("control {worker} {msg:?}"));
        }
        fn left(&mut self, worker: WorkerId) {
            self.0.push(format!("left {worker}"));
        }
    }

    impl crate::shard::Observer for Log {
        fn metric(&mut self, name: &str, value: f64) {
            self.0.push(format!("metric {name} {value}"));
        }
        fn policy_failed(&mut self, error: &PolicyError) {
            self.0.push(format!("failed {error}"));
        }
    }

    const WORKERS: u32 = 3;
    /// Iterations each worker computes.
    const ITERATIONS: u64 = 24;

    /// A small deterministic workload on one shard: at step `k`, worker `k % 3` (worker 2 at a
    /// third of the others' pace) pushes the iteration it was served, reports it, and pulls the
    /// next. Gradients are dyadic and pushes summed at lr 1 without momentum, so the parameters
    /// are exactly 1 minus the sum of every applied gradient, in any order.
    #[derive(Clone)]
    struct Run {
        /// Per worker: the iteration it pulled and whether the pull was served.
        at: [(u64, bool); WORKERS as usize],
        step: u64,
        /// How many lines of the log this run has read.
        read: usize,
        /// Every (worker, iteration) acknowledged.
        acked: Vec<(u32, u64)>,
    }

    fn grad(w: u32, iteration: u64) -> f32 {
        0.25 * (w + 1) as f32 + iteration as f32 / 64.0
    }

    impl Run {
        fn start(shard: &mut Shard, log: &mut Log) -> Self {
            for w in 0..WORKERS {
                shard.join(w, 0, log).unwrap();
                shard.pull(PullRequest { worker: w, iteration: 0 }, 0, log).unwrap();
            }
            let mut run = Run { at: [(0, false); WORKERS as usize], step: 0, read: 0, acked: Vec::new() };
            run.read(log);
            run
        }

        /// Takes in what the shard said since the last look.
        fn read(&mut self, log: &Log) {
            for line in &log.0[self.read..] {
                let mut f = line.split(' ');
                match f.next() {
                    Some("pull") => {
                        let (w, i): (usize, u64) =
                            (f.next().unwrap().parse().unwrap(), f.next().unwrap().parse().unwrap());
                        if self.at[w].0 == i {
                            self.at[w].1 = true;
                        }
                    }
                    Some("ack" | "drop") => {
                        f.next();
                        self.acked
                            .push((f.next().unwrap().parse().unwrap(), f.next().unwrap().parse().unwrap()));
                    }
                    _ => {}
                }
            }
            self.read = log.0.len();
        }

        fn done(&self) -> bool {
            self.at.iter().all(|a| a.0 == ITERATIONS)
        }

        fn step(&mut self, shard: &mut Shard, log: &mut Log) {
            let now = self.step * 1_000_000;
            let w = (self.step % WORKERS as u64) as u32;
            self.step += 1;
            shard.advance(now, log);
            self.read(log);
            let (iteration, served) = self.at[w as usize];
            if served && iteration < ITERATIONS && (w != 2 || self.step.is_multiple_of(9)) {
                let g = vec![grad(w, iteration); shard.values().len()];
                let req = PushRequest {
                    worker: w,
                    iteration,
                    samples: 4,
                    grad: g,
                    based_on: None,
                    tasks: None,
                    local_steps: 0,
                    signals: Default::default(),
                };
                shard.push(req, now, log).unwrap();
                let report = syncopate_policy_sdk::abi::IterationReport {
                    worker: w,
                    iteration,
                    samples: 4,
                    compute_ns: 1_000_000 * u64::from(w + 1),
                };
                shard.iteration_finished(report, now, log).unwrap();
                if iteration + 1 < ITERATIONS {
                    shard.pull(PullRequest { worker: w, iteration: iteration + 1 }, now, log).unwrap();
                }
                self.at[w as usize] = (iteration + 1, iteration + 1 == ITERATIONS);
            }
            self.read(log);
        }

        /// Steps until every worker has pushed every iteration, then says goodbye for all.
        fn finish(&mut self, shard: &mut Shard, log: &mut Log) {
            while !self.done() {
                if self.step >= 10_000 {
                    let tail: Vec<&String> = log.0.iter().rev().take(12).collect();
                    panic!("the run is stuck at {:?}: {tail:#?}", self.at);
                }
                self.step(shard, log);
            }
            let now = self.step * 1_000_000;
            for w in 0..WORKERS {
                shard.goodbye(w, now, log).unwrap();
            }
            self.read(log);
        }
    }

    /// Every built-in policy: a shard snapshotted mid-run (pulls parked, pushes held), encoded,
    /// decoded and restored finishes the run with every push acknowledged exactly once and the
    /// very parameters of the run that was never interrupted.
    #[test]
    fn a_restored_shard_finishes_the_run_with_every_push_applied_once_under_every_builtin_policy() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let optimizer = OptimizerConfig { lr: 1.0, momentum: 0.0, weight_decay: 0.0, nesterov: false };
        let cfg = ShardConfig {
            shard: 1,
            shards: 2,
            seed: 7,
            optimizer,
            push_weight: PushWeight::Sum,
            ..ShardConfig::default()
        };
        let expected: f32 =
            1.0 - (0..WORKERS).flat_map(|w| (0..ITERATIONS).map(move |i| grad(w, i))).sum::<f32>();
        let (mut held_at_some_point, mut parked_at_some_point) = (false, false);
        for name in crate::builtin::names() {
            let module = rt.compile(name, crate::builtin::wasm(name).unwrap()).unwrap();
            for at in [7, 20, 41] {
                let mut log = Log::default();
                let mut original = Shard::new(cfg.clone(), vec![1.0; 5], &module, &[], &mut log).unwrap();
                let mut run = Run::start(&mut original, &mut log);
                for _ in 0..at {
                    run.step(&mut original, &mut log);
                }
                let snap = original.snapshot(run.step * 1_000_000).unwrap();
                let decoded = ShardSnapshot::decode(&snap.encode()).unwrap();
                assert_eq!(decoded, snap, "{name}: the encoding round-trips");

                let mut log2 = Log(log.0.clone());
                let mut run2 = run.clone();
                let mut restored = Shard::restore(cfg.clone(), decoded, &module, &mut log2).unwrap();
                if snap.held.is_empty() {
                    // Nothing for the restarted policy to decide again: the state is as it was.
                    assert_eq!(restored.values(), original.values(), "{name}");
                    assert_eq!(restored.version(), original.version(), "{name}");
                }
                assert_eq!(restored.workers().len(), original.workers().len(), "{name}");
                held_at_some_point |= !snap.held.is_empty();
                parked_at_some_point |= !snap.parked.is_empty();
                run2.read(&log2);
                run.finish(&mut original, &mut log);
                run2.finish(&mut restored, &mut log2);
                for (r, who) in [(&run, "original"), (&run2, "restored")] {
                    let mut acked = r.acked.clone();
                    acked.sort_unstable();
                    let all: Vec<_> =
                        (0..WORKERS).flat_map(|w| (0..ITERATIONS).map(move |i| (w, i))).collect();
                    assert_eq!(
                        acked, all,
                        "{name} at step {at}, {who}: every push acknowledged exactly once"
                    );
                }
                // EPSP weighs each round's aggregate itself (the mean of the contributions present
                // when it completes the round early), and it exports no state: restarted, it
                // times its rounds afresh, so its weights, unlike the pushes applied, may differ.
                // The adaptive deadline drops late pushes, and the robust merge outliers: their
                // models are not the sum of all. Decoupled DiLoCo steps on weighted means of
                // whichever learners are in, and restarted it no longer knows who is in the open
                // step (the shard keeps the step, the policy its number): its steps, unlike the
                // pushes applied, may close at other times.
                if name == "adaptive-deadline" || name == "robust" {
                    assert_eq!(restored.values(), original.values(), "{name} restored at step {at}");
                } else if name != "epsp" && name != "decoupled-diloco" {
                    assert_eq!(original.values(), [expected; 5], "{name}: the uninterrupted run");
                    assert_eq!(restored.values(), original.values(), "{name} restored at step {at}");
                }
            }
        }
        assert!(held_at_some_point && parked_at_some_point, "snapshots were taken with requests pending");
    }

    #[test]
    fn a_format_4_snapshot_still_decodes_with_a_clean_record() {
        // Written by the build before format 5 (commit b77bbc1): an SSP shard (s = 1) of 8
        // parameters at 0.5, workers 0, 1, 2, after pushes of 0.25 from worker 0 (iterations 0-2)
        // and worker 1 (iteration 0), with worker 0's pull for iteration 3 parked, at 6 µs.
        let bytes = include_bytes!("testdata/snapshot-format4.bin");
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 4);
        let snap = ShardSnapshot::decode(bytes).expect("format 4 is still read");
        assert_eq!((snap.shard(), snap.shards(), snap.now_ns()), (0, 1, 6_000));
        assert_eq!(snap.workers().len(), 3);
        assert_eq!(snap.next_push(0), Some(3));
        assert_eq!(snap.stats().pushes_admitted, 4);
        assert_eq!(snap.parked.len(), 1);
        assert_eq!(snap.policy_config, vec![("s".to_string(), "1".to_string())]);
        assert_eq!(snap.health, Health::default());
        // Written again, it is format 5 and reads back the same.
        let again = snap.encode();
        assert_eq!(u32::from_le_bytes(again[8..12].try_into().unwrap()), SNAPSHOT_FORMAT);
        assert_eq!(ShardSnapshot::decode(&again).unwrap(), snap);
    }

    #[test]
    fn a_format_5_snapshot_still_decodes_with_no_worker_waiting_elsewhere() {
        // Written before format 6, by a throwaway test on snapshot code as of commit b5d8925,
        // which built the shard of the format-4 test (SSP, s = 1; 8 parameters at 0.5; workers
        // 0, 1, 2; pushes of 0.25 from worker 0, iterations 0-2, and worker 1, iteration 0;
        // worker 0's pull for iteration 3 parked; at 6 µs).
        let bytes = include_bytes!("testdata/snapshot-format5.bin");
        assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 5);
        let snap = ShardSnapshot::decode(bytes).expect("format 5 is still read");
        assert_eq!((snap.shard(), snap.workers().len(), snap.now_ns()), (0, 3, 6_000));
        assert_eq!((snap.next_push(0), snap.next_push(1)), (Some(3), Some(1)));
        assert_eq!(snap.parked.len(), 1);
        assert_eq!(snap.swap, (0, Vec::new()));
        assert!((0..3).all(|w| snap.elsewhere.since(w).is_none()));
        let again = snap.encode();
        assert_eq!(u32::from_le_bytes(again[8..12].try_into().unwrap()), SNAPSHOT_FORMAT);
        assert_eq!(ShardSnapshot::decode(&again).unwrap(), snap);
    }

    /// The marks of workers waiting on other shards travel with the snapshot: a backup
    /// started from it counts them as its primary does.
    #[test]
    fn a_snapshot_keeps_who_waits_on_other_shards() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let module = rt.compile("bsp", crate::builtin::wasm("bsp").unwrap()).unwrap();
        let mut log = Log::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 4], &module, &[], &mut log).unwrap();
        for w in 0..2 {
            shard.join(w, 0, &mut log).unwrap();
        }
        let push = PushRequest {
            worker: 0,
            iteration: 0,
            samples: 1,
            grad: vec![1.0; 4],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Default::default(),
        };
        shard.push(push, 1_000, &mut log).unwrap();
        shard.pull_waiting(1, 0, true, 2_000).unwrap();
        let snap = ShardSnapshot::decode(&shard.snapshot(3_000).unwrap().encode()).unwrap();
        assert_eq!((snap.elsewhere.since(0), snap.elsewhere.since(1)), (Some(1_000), Some(2_000)));
        let back = Shard::restore(ShardConfig::default(), snap, &module, &mut log).unwrap();
        assert_eq!((back.elsewhere.since(0), back.elsewhere.since(1)), (Some(1_000), Some(2_000)));
    }

    /// A held push keeps its signals through a snapshot (format 7); a format-6 snapshot (the
    /// same body without them) restores its held pushes with none.
    #[test]
    fn held_pushes_keep_their_signals_and_a_format_6_snapshot_restores_them_without() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let module = rt.compile("robust", crate::builtin::wasm("robust").unwrap()).unwrap();
        let mut log = Log::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 4], &module, &[], &mut log).unwrap();
        for w in 0..2 {
            shard.join(w, 0, &mut log).unwrap();
        }
        let reported = Signals { loss: Some(1.5), norm: None, tokens: 7, step_ns: 3 };
        let push = PushRequest {
            worker: 0,
            iteration: 0,
            samples: 1,
            grad: vec![1.0; 4],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: reported,
        };
        shard.push(push, 1_000, &mut log).unwrap();
        let mut snap = shard.snapshot(2_000).unwrap();
        assert_eq!(snap.held.len(), 1, "robust holds the round's pushes");
        let kept = Signals { norm: Some(2.0), ..reported };
        let back = ShardSnapshot::decode(&snap.encode()).unwrap();
        assert_eq!(back.held[0].push.signals, kept);
        let restored = Shard::restore(ShardConfig::default(), back, &module, &mut log).unwrap();
        assert_eq!(restored.held[0].push.signals, kept);

        // Format 6: the body as it was, without the signals (an empty list is one zero byte).
        snap.held_signals.clear();
        let seven = snap.encode();
        let body = &seven[HEADER_LEN..seven.len() - 1];
        let mut six = Vec::from(&MAGIC[..]);
        six.extend_from_slice(&6u32.to_le_bytes());
        six.extend_from_slice(&(body.len() as u64).to_le_bytes());
        six.extend_from_slice(&Sha256::digest(body));
        six.extend_from_slice(body);
        let old = ShardSnapshot::decode(&six).expect("format 6 is still read");
        assert_eq!(old.held.len(), 1);
        let mut restored = Shard::restore(ShardConfig::default(), old, &module, &mut log).unwrap();
        assert_eq!(restored.held[0].push.signals, Signals::default());
        // The round goes on: worker 1's push completes it.
        let push = PushRequest {
            worker: 1,
            iteration: 0,
            samples: 1,
            grad: vec![1.0; 4],
            based_on: None,
            tasks: None,
            local_steps: 0,
            signals: Signals::default(),
        };
        restored.push(push, 3_000, &mut log).unwrap();
        assert_eq!(restored.version(), 1);
    }

    #[test]
    fn a_torn_or_corrupt_snapshot_is_refused_with_the_reason() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let module = rt.compile("bsp", crate::builtin::wasm("bsp").unwrap()).unwrap();
        let mut log = Log::default();
        let mut shard = Shard::new(ShardConfig::default(), vec![2.0; 16], &module, &[], &mut log).unwrap();
        shard.join(0, 0, &mut log).unwrap();
        let bytes = shard.snapshot(0).unwrap().encode();
        let torn = ShardSnapshot::decode(&bytes[..bytes.len() - 3]).unwrap_err();
        assert!(matches!(torn, SnapshotError::Torn { .. }), "{torn}");
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(ShardSnapshot::decode(&flipped), Err(SnapshotError::Checksum)));
        assert!(matches!(ShardSnapshot::decode(b"short"), Err(SnapshotError::NotASnapshot(_))));
        let mut future = bytes.clone();
        future[8] = 9;
        assert!(matches!(ShardSnapshot::decode(&future), Err(SnapshotError::Format { found: 9 })));
        // Another module, another shard: refused before anything is built.
        let asp = rt.compile("asp", crate::builtin::wasm("asp").unwrap()).unwrap();
        let snap = ShardSnapshot::decode(&bytes).unwrap();
        let e = Shard::restore(ShardConfig::default(), snap.clone(), &asp, &mut log).unwrap_err();
        assert!(e.to_string().contains("`bsp`"), "{e}");
        let other = ShardConfig { shard: 1, shards: 2, ..ShardConfig::default() };
        assert!(matches!(
            Shard::restore(other, snap.clone(), &module, &mut log),
            Err(SnapshotError::WrongShard { .. })
        ));
        let back = Shard::restore(ShardConfig::default(), snap, &module, &mut log).unwrap();
        assert_eq!(back.values(), [2.0; 16]);
        assert_eq!(back.rejoin(0), Ok(0));
        assert!(back.rejoin(1).is_err());
    }
}
