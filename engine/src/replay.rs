//! Replays a recorded shard's events through any policy module and sets its decisions beside the
//! recorded ones.
//!
//! The replay is open-loop: every event is delivered as it was recorded, with its time, random
//! value and clocks, whatever the replayed module decides. Through the module that made the
//! recording the decisions are the same, byte for byte (policies are deterministic functions of
//! their events); through another module the report says where the two differ and what that
//! would have meant: which pulls it would have served at once, how long the deferred ones would
//! have waited, which pushes it would have held or dropped. Its pulls deferred until a clock are
//! counted as served at the first recorded event whose clocks meet the condition (the real host
//! releases them right after the event that moved the clock, so waits are upper bounds by one
//! event). Its timers fire at their due times between recorded events; the recording's own timer
//! events go to the recorded side only. Its holds do not hold back the recorded clocks: that is
//! what open-loop means, and why a replay predicts decisions, not a different run.

use std::collections::BTreeSet;

use serde::Serialize;
use syncopate_policy_sdk::abi::{
    Decision, Envelope, Event, Handoff, InitArgs, Release, RequestId, ShardView, TimerId, WorkerClock,
    WorkerId,
};
use syncopate_policy_sdk::rules::{DecisionState, EventRules};

use crate::recording::{Entry, StartKind};
use crate::runtime::{PolicyError, PolicyInstance, PolicyModule};

/// Differences listed in a report (all are counted).
pub const MAX_LISTED: usize = 20;

/// How late after its due time a host may fire a timer (see [`replay`]'s timer rule).
pub const TIMER_SLACK_NS: u64 = 10_000_000;

/// How many of its requests a host may serve after a timer fell due before it fires it (its
/// driver waits on both at once).
pub const TIMER_OVERTAKEN: usize = 2;

/// What one side (recorded or replayed) decided over the whole recording.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Outcomes {
    /// Pulls served at once.
    pub pulls_served_at_once: u64,
    /// Pulls deferred.
    pub pulls_deferred: u64,
    /// Deferred pulls still waiting when the recording ends.
    pub pulls_never_served: u64,
    /// Total time deferred pulls waited until served, in ns.
    pub pull_wait_ns: u64,
    /// The longest such wait, in ns.
    pub pull_wait_max_ns: u64,
    /// Pushes admitted (at once or after a hold).
    pub pushes_admitted: u64,
    /// Pushes held.
    pub pushes_held: u64,
    /// Pushes dropped.
    pub pushes_dropped: u64,
    /// Rounds completed early, and groups applied.
    pub aggregates_completed: u64,
    /// Control messages sent.
    pub controls: u64,
    /// Metric values recorded.
    pub metrics: u64,
    /// Policy failures.
    pub failures: u64,
}

impl Outcomes {
    /// Mean wait of the deferred pulls that were served, in ns.
    pub fn mean_wait_ns(&self) -> u64 {
        let served = self.pulls_deferred.saturating_sub(self.pulls_never_served);
        self.pull_wait_ns.checked_div(served).unwrap_or(0)
    }
}

/// One event on which the two sides answered a request differently.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// Host time of the event, in ns.
    pub now_ns: u64,
    /// The event.
    pub event: String,
    /// The recorded answer.
    pub recorded: String,
    /// The replayed module's answer.
    pub replayed: String,
}

/// What a replay found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The shard recorded.
    pub shard: u32,
    /// The recorded policies, in order (more than one where the recording has swaps).
    pub recorded_policies: Vec<String>,
    /// The replayed module and its configuration.
    pub replayed_policy: String,
    /// Policy calls in the recording.
    pub events: u64,
    /// Events the replayed module answered: every event but the recording's timers, plus its own
    /// timers that fired when the recording's did.
    pub compared: u64,
    /// Of those, events answered with exactly the same decisions as recorded (byte for byte).
    pub identical: u64,
    /// Pushes and pulls answered differently.
    pub differing: u64,
    /// The first [`MAX_LISTED`] of them.
    pub differences: Vec<Difference>,
    /// The recorded decisions.
    pub recorded: Outcomes,
    /// The replayed module's decisions.
    pub replayed: Outcomes,
    /// Why the replay stopped early: the replayed module failed (the error and the event).
    pub stopped: Option<String>,
}

/// One side's pending requests and timers, kept from its own decisions.
#[derive(Default)]
struct Side {
    live: BTreeSet<WorkerId>,
    parked: Vec<(RequestId, WorkerId, Release, u64)>,
    held: Vec<(RequestId, WorkerId)>,
    timers: Vec<(TimerId, u64)>,
    out: Outcomes,
}

impl DecisionState for Side {
    fn is_live(&self, worker: WorkerId) -> bool {
        self.live.contains(&worker)
    }
    fn is_parked(&self, pull: RequestId) -> bool {
        self.parked.iter().any(|p| p.0 == pull)
    }
    fn is_held(&self, push: RequestId) -> bool {
        self.held.iter().any(|h| h.0 == push)
    }
    fn has_timer(&self, timer: TimerId) -> bool {
        self.timers.iter().any(|t| t.0 == timer)
    }
    fn timers(&self) -> usize {
        self.timers.len()
    }
}

impl Side {
    /// Membership and re-asked requests, before the event's decisions.
    fn before(&mut self, event: &Event) {
        match *event {
            Event::WorkerJoined { worker, .. } => {
                self.live.insert(worker);
            }
            Event::WorkerLeft { worker, .. } => {
                self.live.remove(&worker);
                self.parked.retain(|p| p.1 != worker);
                self.held.retain(|h| h.1 != worker);
            }
            // A request handed over again (after a swap or a restart) is asked afresh.
            Event::Pull(p) => self.parked.retain(|q| q.0 != p.id),
            Event::Push(p) => self.held.retain(|h| h.0 != p.id),
            _ => {}
        }
    }

    /// Serves the parked pulls whose condition `view` meets.
    fn release(&mut self, view: ShardView, now_ns: u64) {
        let out = &mut self.out;
        self.parked.retain(|&(_, _, until, since)| {
            let met = until.is_met(view);
            if met {
                let wait = now_ns.saturating_sub(since);
                out.pull_wait_ns += wait;
                out.pull_wait_max_ns = out.pull_wait_max_ns.max(wait);
            }
            !met
        });
    }

    /// Applies decisions (checked against the rules first where `check`); returns the answer to
    /// the event's own request, described.
    fn apply(&mut self, mut bytes: &[u8], env: &Envelope, check: bool) -> Result<Option<String>, String> {
        let mut rules = EventRules::new(&env.event);
        let mut answer = None;
        while !bytes.is_empty() {
            let (d, rest) = postcard::take_from_bytes::<Decision<'_>>(bytes)
                .map_err(|e| format!("undecodable decision: {e}"))?;
            bytes = rest;
            let mine = match check {
                true => rules.check(&d, &*self)?,
                false => rules.verdict(&d),
            };
            let now = env.now_ns;
            match d {
                Decision::ServePull { .. } => {
                    self.out.pulls_served_at_once += 1;
                    answer = Some("serve".into());
                }
                Decision::DeferPull { pull, until } => {
                    self.out.pulls_deferred += 1;
                    if let Event::Pull(p) = env.event {
                        self.parked.push((pull, p.worker, until, now));
                    }
                    answer = Some(match until {
                        Release::MinClockAtLeast(c) => format!("defer until min clock >= {c}"),
                        Release::Explicit => "defer until released".into(),
                    });
                }
                Decision::ReleasePull { pull } => {
                    if let Some(pos) = self.parked.iter().position(|p| p.0 == pull) {
                        let wait = now.saturating_sub(self.parked.swap_remove(pos).3);
                        self.out.pull_wait_ns += wait;
                        self.out.pull_wait_max_ns = self.out.pull_wait_max_ns.max(wait);
                    }
                }
                Decision::AdmitPush { push, weight } => {
                    self.held.retain(|h| h.0 != push);
                    if weight == Some(0.0) {
                        self.out.pushes_dropped += 1;
                    } else {
                        self.out.pushes_admitted += 1;
                    }
                    if mine {
                        answer = Some(match weight {
                            None => "admit".into(),
                            Some(0.0) => "drop".into(),
                            Some(w) => format!("admit with weight {w}"),
                        });
                    }
                }
                Decision::DropPush { push } => {
                    self.held.retain(|h| h.0 != push);
                    self.out.pushes_dropped += 1;
                    if mine {
                        answer = Some("drop".into());
                    }
                }
                Decision::HoldPush { push } => {
                    self.out.pushes_held += 1;
                    if let Event::Push(p) = env.event {
                        self.held.push((push, p.worker));
                    }
                    answer = Some("hold".into());
                }
                Decision::AdmitToGroup { push, group, .. } => {
                    self.held.retain(|h| h.0 != push);
                    self.out.pushes_admitted += 1;
                    if mine {
                        answer = Some(format!("admit to group {group}"));
                    }
                }
                Decision::CompleteAggregate { .. } | Decision::CompleteGroup { .. } => {
                    self.out.aggregates_completed += 1
                }
                Decision::Control { .. } => self.out.controls += 1,
                Decision::Metric { .. } => self.out.metrics += 1,
                Decision::SetTimer { timer, after_ns } => {
                    self.timers.retain(|t| t.0 != timer);
                    self.timers.push((timer, now.saturating_add(after_ns)));
                }
                Decision::CancelTimer { timer } => self.timers.retain(|t| t.0 != timer),
                Decision::SetUpdateMode(_)
                | Decision::SetLocalSteps { .. }
                | Decision::SetOuterOptimizer { .. }
                | Decision::SetOuterDelay { .. }
                | Decision::SetPullCodec { .. }
                // A replay sends the answers the recording holds: the recorded run's.
                | Decision::Measure { .. } => {}
            }
        }
        if check {
            rules.finish()?;
        }
        Ok(answer)
    }

    fn finish(&mut self) {
        self.out.pulls_never_served = self.parked.len() as u64;
    }

    /// A policy was swapped in: the host hands every pending request to it again as a fresh
    /// event (they follow in the recording), and the old policy's timers are gone.
    fn swapped(&mut self) {
        self.parked.clear();
        self.held.clear();
        self.timers.clear();
    }
}

/// Where a replay that follows the recording's hot swaps finds each module swapped in: from the
/// recorded source (`builtin:ssp`, a file path) and SHA-256, the module, or why not. (The
/// engine reads no files: the caller's resolver does.)
pub type Resolve<'a> = &'a dyn Fn(&str, &[u8; 32]) -> Result<PolicyModule, String>;

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The recording does not begin with a policy start (it is empty or not a shard's).
    #[error("the recording does not begin with a policy start")]
    NoStart,
    /// The module could not start.
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// Replays `entries` (a recording, see [`crate::recording::read`]) through `module` with
/// `config`. With `follow`, it follows the recording's hot swaps: at each, the replayed policy
/// hands its state over to the module swapped in (with the recorded configuration and the
/// workers the host handed over), as the host did, so a replay through the recorded modules is
/// exact; without, every event goes to `module`. `Err` if the module cannot start or the
/// recording has no start.
pub fn replay(
    entries: &[Entry<'_>],
    module: &PolicyModule,
    config: &[(String, String)],
    follow: Option<Resolve<'_>>,
) -> Result<Report, ReplayError> {
    let mut report = Report::default();
    let Some(Entry::Started { shard, shards, now_ns, .. }) = entries.first() else {
        return Err(ReplayError::NoStart);
    };
    report.shard = *shard;
    let pairs: Vec<(&str, &str)> = config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    report.replayed_policy = describe_policy(module.display_name(), &pairs);
    let init = InitArgs { shard: *shard, shards: *shards, now_ns: *now_ns, config: pairs };
    let (mut instance, start) = PolicyInstance::new(module, &init)?;
    let (mut rec, mut rep) = (Side::default(), Side::default());
    let start_env = Envelope {
        now_ns: *now_ns,
        random: 0,
        view: ShardView { min_clock: 0, max_clock: 0, workers: 0 },
        event: Event::Timer { timer: u64::MAX },
    };
    if let Err(e) = rep.apply(&start, &start_env, false) {
        report.stopped = Some(format!("its start-up decisions: {e}"));
    }
    let mut last_view = start_env.view;
    let mut current = module.clone();
    let mut handed: Vec<WorkerClock> = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        match entry {
            Entry::Handoff { workers } => handed.clone_from(workers),
            Entry::Started { kind, source, policy, sha256, config, decisions, now_ns, .. } => {
                if *kind == StartKind::Restart {
                    continue;
                }
                report.recorded_policies.push(describe_policy(policy, config));
                let env = Envelope { now_ns: *now_ns, ..start_env };
                if *kind == StartKind::Swap {
                    rec.swapped();
                }
                let _ = rec.apply(decisions, &env, false);
                let (Some(resolve), StartKind::Swap, None) = (follow, kind, &report.stopped) else {
                    continue;
                };
                // The replayed policy hands over to the module swapped in, as the host's did.
                let swapped = resolve(source, sha256).and_then(|m| {
                    let state = instance.export_state().map_err(|e| e.to_string())?;
                    let info = current.info();
                    let handoff = Handoff {
                        from_name: &info.name,
                        from_version: &info.version,
                        state: &state,
                        workers: std::mem::take(&mut handed),
                    };
                    let init =
                        InitArgs { shard: *shard, shards: *shards, now_ns: *now_ns, config: config.clone() };
                    let (next, start) =
                        PolicyInstance::import(&m, &init, &handoff).map_err(|e| e.to_string())?;
                    Ok((m, next, start))
                });
                match swapped {
                    Ok((m, next, start)) => {
                        report.replayed_policy +=
                            &format!(", then {}", describe_policy(m.display_name(), config));
                        (current, instance) = (m, next);
                        rep.swapped();
                        if let Err(e) = rep.apply(&start, &env, false) {
                            report.stopped = Some(format!("the start-up decisions of {policy}: {e}"));
                        }
                    }
                    Err(e) => report.stopped = Some(format!("cannot follow the swap to {source}: {e}")),
                }
            }
            Entry::Called { answer, .. } => {
                let Some(env) = entry.envelope() else { continue };
                report.events += 1;
                // The replayed module's own timers that fall due before this event fire first.
                if report.stopped.is_none() {
                    fire_timers(&mut instance, &mut rep, &entries[i..], last_view, &mut report);
                }
                last_view = env.view;
                rec.release(env.view, env.now_ns);
                rep.release(env.view, env.now_ns);
                rec.before(&env.event);
                rep.before(&env.event);
                // The recording's timers fire on its side; the replayed module's fire above.
                if let Event::Timer { timer } = env.event {
                    rec.timers.retain(|t| t.0 != timer);
                }
                let recorded = match answer {
                    Ok(bytes) => rec.apply(bytes, &env, false).unwrap_or(None),
                    Err(_) => {
                        rec.out.failures += 1;
                        Some("policy failure".into())
                    }
                };
                if report.stopped.is_some() || matches!(env.event, Event::Timer { .. }) {
                    continue;
                }
                report.compared += 1;
                let replayed = match instance.on_event(&env) {
                    Ok(bytes) => {
                        if answer.as_ref().is_ok_and(|a| *a == bytes) {
                            report.identical += 1;
                        }
                        let bytes = bytes.to_vec();
                        match rep.apply(&bytes, &env, true) {
                            Ok(a) => a,
                            Err(e) => {
                                stop(&mut report, &mut rep, &env, &e);
                                continue;
                            }
                        }
                    }
                    Err(e) => {
                        stop(&mut report, &mut rep, &env, &e.to_string());
                        continue;
                    }
                };
                if matches!(env.event, Event::Pull(_) | Event::Push(_)) && recorded != replayed {
                    report.differing += 1;
                    if report.differences.len() < MAX_LISTED {
                        let none = || "no answer".to_string();
                        report.differences.push(Difference {
                            now_ns: env.now_ns,
                            event: crate::runtime::describe_event(&env),
                            recorded: recorded.unwrap_or_else(none),
                            replayed: replayed.unwrap_or_else(none),
                        });
                    }
                }
            }
        }
    }
    rec.finish();
    rep.finish();
    report.recorded = rec.out;
    report.replayed = rep.out;
    Ok(report)
}

fn stop(report: &mut Report, rep: &mut Side, env: &Envelope, error: &str) {
    rep.out.failures += 1;
    report.stopped = Some(format!("on {}: {error}", crate::runtime::describe_event(env)));
}

/// Fires the replayed module's timers due by the time of `rest[0]` (an event), earliest first.
///
/// A host fires a timer when its driver wakes after the due time, before or among the first
/// requests that arrive after it. So where the recording's next firing of the same timer comes
/// after its due time and within [`TIMER_SLACK_NS`] of it, or with at most [`TIMER_OVERTAKEN`]
/// other requests in between, the replayed timer fires there, with the recorded envelope (the
/// module that made the recording sees exactly what it saw), and waits until `rest[0]` is that
/// event. Otherwise it fires at its due time, with the last clocks and a random value derived
/// from the time.
fn fire_timers(
    instance: &mut PolicyInstance,
    rep: &mut Side,
    rest: &[Entry<'_>],
    view: ShardView,
    report: &mut Report,
) {
    let Some(now) = rest.first().and_then(Entry::envelope).map(|e| e.now_ns) else { return };
    let mut skip: Vec<TimerId> = Vec::new();
    loop {
        let due = rep.timers.iter().filter(|t| t.1 <= now && !skip.contains(&t.0)).min_by_key(|t| (t.1, t.0));
        let Some(&(timer, due)) = due else { return };
        // Where the recording fired this timer, if it did so on time.
        let mut overtaken = 0;
        let mut fired = None;
        for (j, e) in rest.iter().enumerate() {
            let Some(env) = e.envelope() else { break };
            if env.event == (Event::Timer { timer }) {
                fired = (env.now_ns >= due).then_some((j, env, e));
                break;
            }
            if env.now_ns > due && !matches!(env.event, Event::Timer { .. }) {
                overtaken += 1;
                if overtaken > TIMER_OVERTAKEN && env.now_ns > due.saturating_add(TIMER_SLACK_NS) {
                    break;
                }
            }
        }
        let (env, recorded) = match fired {
            Some((0, env, Entry::Called { answer, .. })) => (env, Some(*answer)),
            Some(_) => {
                skip.push(timer); // fires at its recorded place, later
                continue;
            }
            None => {
                let random = (due ^ timer.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (Envelope { now_ns: due, random, view, event: Event::Timer { timer } }, None)
            }
        };
        rep.timers.retain(|t| t.0 != timer);
        let result = match instance.on_event(&env) {
            Ok(bytes) => {
                if let Some(answer) = recorded {
                    report.compared += 1;
                    report.identical += u64::from(answer.is_ok_and(|a| a == bytes));
                }
                let bytes = bytes.to_vec();
                rep.apply(&bytes, &env, true).map(|_| ())
            }
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = result {
            stop(report, rep, &env, &e);
            return;
        }
    }
}

fn describe_policy<K: AsRef<str>, V: AsRef<str>>(name: &str, config: &[(K, V)]) -> String {
    if config.is_empty() {
        return name.to_string();
    }
    let pairs: Vec<String> = config.iter().map(|(k, v)| format!("{}={}", k.as_ref(), v.as_ref())).collect();
    format!("{name} ({})", pairs.join(", "))
}
