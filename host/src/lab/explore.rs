//! What `syncopate policy check` (and `policy build`) does with a module: drives it on a real
//! shard through generated event sequences, and reports the first that breaks a rule, shrunk.
//!
//! Each case is drawn from a seed: 1 to 4 workers, 1 to 12 iterations each, and a schedule in
//! which, at each step, a worker that is not waiting acts (it pulls, pushes once its pull is
//! served, and reports its iteration once its push is acknowledged, as a worker does: a held
//! push holds its worker), or time advances (timers fire), or now and then a worker joins
//! late, one leaves between iterations, or a hot swap hands the policy's state to a fresh
//! instance of itself (as a recovery does) or to another policy, which hands it back at the next
//! swap. The rules:
//! - the policy never fails (a trap, a spin past its fuel, a decision the rules refuse);
//! - every push is acknowledged at most once, and every request is answered: once every
//!   worker that has not finished waits, time passing (a minute of it, timers firing) must
//!   release one, or the case is stuck, and the report says who waits for what (a push held
//!   forever, a pull parked while the others keep pushing).
//!
//! A failing case is shrunk: the same seed with fewer iterations, then fewer workers, as long as
//! it still fails, and the events of the smallest are printed. A case is a pure function of the
//! module, its configuration and the seed.
//!
//! Short cases find most broken rules; some need many events on one instance (a counter that
//! overflows, a bug every few hundred events) or many hand-overs of its state. [`explore_long`]
//! runs long cases: 2 to 8 workers, 100 to 400 iterations each (thousands of events), none
//! leaving early, one half on a single instance throughout, the other handing its state to a
//! fresh instance of itself every 20 to 100 events.

use syncopate_policy_sdk::abi::{IterationReport, LeaveReason, RequestId, Signals, WorkerId};

use crate::runtime::{PolicyError, PolicyModule};
use crate::shard::{PullReply, PullRequest, PushRequest, Shard, ShardConfig, ShardSink};

/// How many cases `policy check` runs unless told (`--cases`).
pub const DEFAULT_CASES: u32 = 64;

/// What a passing exploration exercised.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Explored {
    /// Cases run.
    pub cases: u32,
    /// Events (pulls, pushes, reports, time steps, joins, leaves, hand-overs) over all cases.
    pub events: u64,
    /// Pulls the policy deferred, and pushes it held or dropped, over all cases.
    pub deferred: u64,
    /// Pushes held.
    pub held: u64,
    /// Pushes dropped.
    pub dropped: u64,
    /// State hand-overs to a fresh instance.
    pub handovers: u64,
}

/// A case that broke a rule, shrunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Broken {
    /// Its seed.
    pub seed: u64,
    /// Whether it is a long case ([`explore_long`]).
    pub long: bool,
    /// Its workers and iterations, once shrunk.
    pub workers: u32,
    /// Iterations per worker.
    pub iterations: u64,
    /// The rule it broke, and how.
    pub why: String,
    /// Its events, in order.
    pub events: Vec<String>,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} {} ({} workers, {} iterations each): {}",
            if self.long { "long case" } else { "case" },
            self.seed,
            self.workers,
            self.iterations,
            self.why
        )?;
        // Runs of the same event (time passing while all wait) are shown once, counted.
        let mut runs: Vec<(usize, &str, usize)> = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            match runs.last_mut() {
                Some(last) if last.1 == e => last.2 += 1,
                _ => runs.push((i + 1, e, 1)),
            }
        }
        let skip = runs.len().saturating_sub(40);
        if skip > 0 {
            writeln!(f, "  ... {} events before these", runs[skip].0 - 1)?;
        }
        for (i, e, n) in runs.iter().skip(skip) {
            match n {
                1 => writeln!(f, "  {i:>4}  {e}")?,
                n => writeln!(f, "  {i:>4}  {e} (x{n})")?,
            }
        }
        Ok(())
    }
}

/// How many long cases `policy check` runs unless told (`--long-cases`).
pub const DEFAULT_LONG_CASES: u32 = 4;

/// Runs `cases` cases from seed `first` on; `Err` is the first broken one, shrunk.
pub fn explore(
    module: &PolicyModule,
    config: &[(String, String)],
    others: &[PolicyModule],
    first: u64,
    cases: u32,
) -> Result<Explored, Box<Broken>> {
    run_cases(module, config, others, first, cases, false)
}

/// Runs `cases` long cases (module docs) from seed `first` on; `Err` is the first broken one,
/// shrunk.
pub fn explore_long(
    module: &PolicyModule,
    config: &[(String, String)],
    first: u64,
    cases: u32,
) -> Result<Explored, Box<Broken>> {
    run_cases(module, config, &[], first, cases, true)
}

fn run_cases(
    module: &PolicyModule,
    config: &[(String, String)],
    others: &[PolicyModule],
    first: u64,
    cases: u32,
    long: bool,
) -> Result<Explored, Box<Broken>> {
    let mut out = Explored::default();
    for seed in first..first + u64::from(cases) {
        let (workers, iterations, swaps) = if long { draw_long(seed) } else { draw(seed) };
        let case = Case { module, config, others, seed, workers, iterations, swaps };
        match case.run() {
            Ok(ran) => {
                out.cases += 1;
                out.events += ran.events;
                out.deferred += ran.deferred;
                out.held += ran.held;
                out.dropped += ran.dropped;
                out.handovers += ran.handovers;
            }
            Err((why, events)) => return Err(Box::new(shrink(case, why, events))),
        }
    }
    Ok(out)
}

/// The size a seed draws.
fn draw(seed: u64) -> (u32, u64, Swaps) {
    let mut rng = Rng(seed ^ 0x5eed_c4ec_0000_0037);
    (1 + rng.below(4) as u32, 1 + rng.below(12), Swaps::Mixed)
}

/// The size of a long case, and its hand-overs.
fn draw_long(seed: u64) -> (u32, u64, Swaps) {
    let mut rng = Rng(seed ^ 0x10c4_c4ec_0000_0400);
    let swaps = match seed % 2 {
        0 => Swaps::None,
        _ => Swaps::SelfEvery(20 + rng.below(81)),
    };
    (2 + rng.below(7) as u32, 100 + rng.below(301), swaps)
}

/// Which hot swaps a case makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Swaps {
    /// Now and then, to a fresh instance of itself or out to another policy and back.
    Mixed,
    /// None: one instance throughout.
    None,
    /// To a fresh instance of itself every this many events.
    SelfEvery(u64),
}

/// Fewer iterations, then fewer workers, while the case still breaks a rule.
fn shrink(mut case: Case<'_>, mut why: String, mut events: Vec<String>) -> Broken {
    let mut smaller = true;
    while smaller {
        smaller = false;
        for (workers, iterations) in [
            (case.workers, case.iterations / 2),
            (case.workers, case.iterations - 1),
            (case.workers / 2, case.iterations),
            (case.workers - 1, case.iterations),
        ] {
            if (workers, iterations) == (case.workers, case.iterations) {
                continue;
            }
            if workers == 0 || iterations == 0 {
                continue;
            }
            let tried = Case { workers, iterations, ..case };
            if let Err((w, e)) = tried.run() {
                (case, why, events, smaller) = (tried, w, e, true);
                break;
            }
        }
    }
    let long = case.swaps != Swaps::Mixed;
    Broken { seed: case.seed, long, workers: case.workers, iterations: case.iterations, why, events }
}

/// splitmix64: the cases' own randomness.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Clone, Copy)]
struct Case<'a> {
    module: &'a PolicyModule,
    config: &'a [(String, String)],
    /// Policies the module is swapped out to, and back from.
    others: &'a [PolicyModule],
    seed: u64,
    workers: u32,
    iterations: u64,
    swaps: Swaps,
}

/// What a passing case did.
struct Ran {
    events: u64,
    deferred: u64,
    held: u64,
    dropped: u64,
    handovers: u64,
}

/// Where a worker of the case is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Not joined yet (a late joiner).
    Absent,
    /// About to pull `iteration`.
    Pull,
    /// Its pull waits.
    Pulling(RequestId),
    /// Pulled: about to push.
    Push,
    /// Its push waits for its acknowledgement.
    Pushing(RequestId),
    /// Done, or left.
    Gone,
}

#[derive(Default)]
struct Sink {
    served: std::collections::BTreeSet<RequestId>,
    acked: std::collections::BTreeSet<RequestId>,
    /// (worker, iteration) of every acknowledged push.
    acked_iterations: std::collections::BTreeSet<(WorkerId, u64)>,
    /// The first push acknowledged twice: its id, worker and iteration.
    twice: Option<(RequestId, WorkerId, u64)>,
    failure: Option<String>,
}

impl ShardSink for Sink {
    fn pull_served(&mut self, r: PullReply<'_>) {
        self.served.insert(r.id);
    }
    fn push_acked(&mut self, id: RequestId, worker: WorkerId, iteration: u64) {
        self.acked.insert(id);
        if !self.acked_iterations.insert((worker, iteration)) {
            self.twice.get_or_insert((id, worker, iteration));
        }
    }
}

impl crate::shard::Observer for Sink {
    fn policy_failed(&mut self, e: &PolicyError) {
        self.failure.get_or_insert_with(|| e.to_string());
    }
}

/// How long the case lets time pass, all waiting, before it calls itself stuck: a minute.
const PATIENCE_NS: u64 = 60_000_000_000;

impl Case<'_> {
    fn run(&self) -> Result<Ran, (String, Vec<String>)> {
        let mut log = Vec::new();
        match self.steps(&mut log) {
            Ok(ran) => Ok(ran),
            Err(why) => Err((why, log)),
        }
    }

    fn steps(&self, log: &mut Vec<String>) -> Result<Ran, String> {
        let mut rng = Rng(self.seed);
        let mut sink = Sink::default();
        let cfg = ShardConfig { max_workers: 8, ..ShardConfig::default() };
        let mut shard = Shard::new(cfg, vec![0.0; 4], self.module, self.config, &mut sink)
            .map_err(|e| format!("the policy does not start: {e}"))?;
        let n = self.workers as usize;
        let mut step = vec![Step::Pull; n];
        let mut next = vec![0u64; n];
        // The last worker of three or more may join late.
        if n >= 3 && rng.below(2) == 0 {
            step[n - 1] = Step::Absent;
        }
        let mut now = 0u64;
        for w in (0..n).filter(|&w| step[w] != Step::Absent) {
            shard.join(w as WorkerId, now, &mut sink).map_err(|e| e.to_string())?;
            log.push(format!("worker {w} joins"));
        }
        let (mut events, mut handovers, mut idle_ns) = (0u64, 0u64, 0u64);
        // Swapped out to another policy (the next swap goes back).
        let mut away = false;
        loop {
            check(&sink, &shard)?;
            // Requests answered since the last step.
            for w in 0..n {
                match step[w] {
                    Step::Pulling(id) if sink.served.contains(&id) => {
                        log.push(format!("  worker {w}'s pull for {} is served", next[w]));
                        step[w] = Step::Push;
                    }
                    Step::Pushing(id) if sink.acked.contains(&id) => {
                        log.push(format!("  worker {w}'s push for {} is acknowledged", next[w]));
                        let report = IterationReport {
                            worker: w as WorkerId,
                            iteration: next[w],
                            compute_ns: 1_000_000,
                            samples: 32,
                        };
                        shard.iteration_finished(report, now, &mut sink).map_err(|e| e.to_string())?;
                        next[w] += 1;
                        step[w] = if next[w] == self.iterations { Step::Gone } else { Step::Pull };
                        if step[w] == Step::Gone {
                            shard
                                .leave(w as WorkerId, LeaveReason::Finished, now, &mut sink)
                                .map_err(|e| e.to_string())?;
                            log.push(format!("worker {w} is done and leaves"));
                        }
                    }
                    _ => {}
                }
            }
            check(&sink, &shard)?;
            if step.iter().all(|s| *s == Step::Gone) {
                break;
            }
            let ready: Vec<usize> =
                (0..n).filter(|&w| matches!(step[w], Step::Pull | Step::Push | Step::Absent)).collect();
            events += 1;
            let roll = rng.below(100);
            if ready.is_empty() || roll < 15 {
                // Time passes: timers fire.
                let dt = if ready.is_empty() { 1_000_000_000 } else { 1_000_000 * (1 + rng.below(50)) };
                now += dt;
                shard.advance(now, &mut sink);
                log.push(format!("time +{} ms", dt / 1_000_000));
                if ready.is_empty() {
                    idle_ns += dt;
                    if idle_ns > PATIENCE_NS {
                        return Err(stuck(&step, &next, &shard));
                    }
                }
                continue;
            }
            idle_ns = 0;
            let swap_now = match self.swaps {
                Swaps::Mixed => roll < 18,
                Swaps::None => false,
                Swaps::SelfEvery(n) => events % n == 0,
            };
            if swap_now {
                // A hot swap: out to another policy (then, at the next, back), or the policy's
                // state to a fresh instance of itself (as a recovery does).
                let raise = shard.levelling();
                let out = match (away, self.others.is_empty()) {
                    (false, false) if self.swaps == Swaps::Mixed && rng.below(2) == 0 => {
                        Some(&self.others[rng.below(self.others.len() as u64) as usize])
                    }
                    _ => None,
                };
                let (to, config): (&PolicyModule, &[(String, String)]) = match out {
                    Some(other) => (other, &[]),
                    None => (self.module, self.config),
                };
                shard.swap_policy(to, config, &raise, now, &mut sink).map_err(|e| match away {
                    true => format!(
                        "the policy refused the state {} handed it: {e}",
                        shard.policy().display_name()
                    ),
                    false => format!("the policy refused its own state: {e}"),
                })?;
                handovers += 1;
                log.push(match (out, away) {
                    (Some(other), _) => format!("hot swap to {}", other.display_name()),
                    (None, true) => "hot swap back to the policy".into(),
                    (None, false) => "the policy hands its state to a fresh instance".into(),
                });
                away = out.is_some();
                continue;
            }
            let w = ready[rng.below(ready.len() as u64) as usize];
            let id = w as WorkerId;
            match step[w] {
                Step::Absent => {
                    let clock = shard.join(id, now, &mut sink).map_err(|e| e.to_string())?;
                    next[w] = clock.min(self.iterations);
                    step[w] = if next[w] == self.iterations { Step::Gone } else { Step::Pull };
                    log.push(format!("worker {w} joins late, at clock {clock}"));
                    if step[w] == Step::Gone {
                        shard.leave(id, LeaveReason::Finished, now, &mut sink).map_err(|e| e.to_string())?;
                    }
                }
                Step::Pull if roll < 21 && n > 1 && self.swaps == Swaps::Mixed => {
                    shard.leave(id, LeaveReason::Finished, now, &mut sink).map_err(|e| e.to_string())?;
                    step[w] = Step::Gone;
                    log.push(format!("worker {w} leaves before iteration {}", next[w]));
                }
                Step::Pull => {
                    let req = PullRequest { worker: id, iteration: next[w] };
                    let pull = shard.pull(req, now, &mut sink).map_err(|e| e.to_string())?;
                    log.push(format!("worker {w} pulls for iteration {} (request #{pull})", next[w]));
                    step[w] = Step::Pulling(pull);
                }
                Step::Push => {
                    // Gradients of varied size (now and then an outlier) and a falling loss,
                    // sometimes unreported, for rules that read the training signals.
                    let scale = if roll >= 95 { 10.0 } else { 0.01 * (1 + roll % 10) as f32 };
                    let grad = vec![scale; 4];
                    let loss =
                        (!roll.is_multiple_of(5)).then(|| 4.0 / (1 + next[w]) as f32 + roll as f32 / 100.0);
                    let signals =
                        Signals { loss, norm: None, tokens: 32 * 64, step_ns: 1_000_000 * (1 + roll) };
                    let req = PushRequest {
                        worker: id,
                        iteration: next[w],
                        samples: 32,
                        grad,
                        based_on: None,
                        tasks: None,
                        local_steps: 0,
                        signals,
                    };
                    let push = shard.push(req, now, &mut sink).map_err(|e| e.to_string())?;
                    log.push(format!("worker {w} pushes iteration {} (request #{push})", next[w]));
                    step[w] = Step::Pushing(push);
                }
                _ => {}
            }
        }
        let s = shard.stats();
        Ok(Ran {
            events,
            deferred: s.pulls_deferred,
            held: s.pushes_held,
            dropped: s.pushes_dropped,
            handovers,
        })
    }
}

/// The rules checked after every step.
fn check(sink: &Sink, shard: &Shard) -> Result<(), String> {
    if let Some(f) = &sink.failure {
        return Err(format!("the policy failed: {f}"));
    }
    if let Some(twice) = sink.twice {
        return Err(format!(
            "worker {}'s push for iteration {} was acknowledged twice (push #{}; {} steps so far)",
            twice.1,
            twice.2,
            twice.0,
            shard.stats().steps
        ));
    }
    Ok(())
}

/// Every worker that has not finished waits, and a minute of time (timers firing) released
/// none: who waits for what.
fn stuck(step: &[Step], next: &[u64], shard: &Shard) -> String {
    let waits: Vec<String> = step
        .iter()
        .enumerate()
        .filter_map(|(w, s)| match s {
            Step::Pulling(id) => {
                Some(format!("worker {w}'s pull for iteration {} (#{id}) is parked", next[w]))
            }
            Step::Pushing(id) => Some(format!(
                "worker {w}'s push for iteration {} (#{id}) is {}",
                next[w],
                if shard.is_push_held(w as WorkerId, next[w]) { "held" } else { "not acknowledged" }
            )),
            _ => None,
        })
        .collect();
    format!(
        "stuck: a minute passed with every worker waiting and nothing released ({}; {} pulls parked, {} pushes held)",
        waits.join(", "),
        shard.parked_pulls(),
        shard.held_pushes()
    )
}
