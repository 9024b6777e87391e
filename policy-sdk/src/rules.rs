//! The rules a policy's decisions must obey: the one implementation, used by the host's shards
//! and by the native [`Driver`](crate::testing::Driver) alike (as [`clocks`](crate::clocks) is
//! for the clock rules), so a policy that passes its native tests is held to the same rules on
//! a cluster.
//!
//! For each event, [`EventRules::check`] checks every decision before it takes effect, and says
//! whether it is the event's verdict on its own request or an action on an earlier one, and
//! [`EventRules::finish`] checks what the event as a whole owed:
//! - a pull or push event's request gets exactly one verdict (serve or defer; admit, hold or
//!   drop), and
//!   no decision gives a verdict on another event's request;
//! - only a parked pull can be released, only a held push admitted or dropped later (the
//!   event's own push too, once a decision of the same event held it: `on_push` holds it and
//!   `after_push` admits it);
//! - control messages go to live workers only, and moved tasks come from another live worker,
//!   within 1 to [`MAX_TASKS`] tasks; a task share is 1 to [`MAX_TASKS`];
//! - a push weight is finite and not negative; a deferral waits for a minimum clock a run can
//!   reach; a shard holds at most [`MAX_TIMERS`] timers;
//! - local steps are at most [`MAX_LOCAL_STEPS`], set for every worker or a live one; an outer
//!   optimizer's learning rate is in (0, 16] and its momentum in [0, 1), its delay 1 to
//!   [`MAX_OUTER_DELAY`] steps;
//! - codecs are within their bounds ([`Codec::check`](crate::abi::Codec::check)), and pulls are never sparse (top-k, SparseLoCo);
//! - an event asks at most [`MAX_MEASURES`] measures ([`Decision::Measure`]); a policy's
//!   start-up and the answer to a measure ask none (answers are events, and an answer that
//!   asked again could keep the host answering for ever).
//!
//! A policy that breaks a rule is treated like one that crashed.

use alloc::format;
use alloc::string::String;

use crate::abi::{Control, Decision, Event, Release, RequestId, TimerId, WorkerId};

/// The most tasks an iteration can be split into (task sets are bit masks of a `u64`).
pub const MAX_TASKS: u32 = 64;

/// The most timers one shard's policy can have set at once.
pub const MAX_TIMERS: usize = 1024;

/// The most local steps per iteration a policy may ask of a worker
/// ([`Decision::SetLocalSteps`]): DiLoCo syncs every 500 steps; this leaves room and keeps a
/// hostile module from setting a worker computing for ever.
pub const MAX_LOCAL_STEPS: u32 = 10_000;

/// Whether `steps` local steps per iteration are within bounds (at most [`MAX_LOCAL_STEPS`]);
/// the error says why not. Policies, scenarios and the command line check with this.
pub fn check_local_steps(steps: u32) -> Result<(), String> {
    if steps > MAX_LOCAL_STEPS {
        return Err(format!("{steps} local steps per iteration: at most {MAX_LOCAL_STEPS}"));
    }
    Ok(())
}

/// The longest delay of the outer momentum ([`Decision::SetOuterDelay`]), in outer steps: the
/// paper's is the number of workers.
pub const MAX_OUTER_DELAY: u32 = 4096;

/// Whether an outer momentum's delay is within bounds (1 to [`MAX_OUTER_DELAY`]).
pub fn check_outer_delay(period: u32) -> Result<(), String> {
    if !(1..=MAX_OUTER_DELAY).contains(&period) {
        return Err(format!("an outer momentum delay of {period} steps (1 to {MAX_OUTER_DELAY})"));
    }
    Ok(())
}

/// Whether an outer optimizer's learning rate (in (0, 16]) and momentum (in [0, 1)) are within
/// bounds; the error says why not.
pub fn check_outer_optimizer(lr: f32, momentum: f32) -> Result<(), String> {
    if !(lr.is_finite() && lr > 0.0 && lr <= 16.0 && (0.0..1.0).contains(&momentum)) {
        return Err(format!(
            "an outer optimizer of learning rate {lr} and momentum {momentum} \
             (0 < lr <= 16 and 0 <= momentum < 1)"
        ));
    }
    Ok(())
}

/// The most measures ([`Decision::Measure`]) one event's decisions may ask for: each costs the
/// host a pass or two over the shard's tensors.
pub const MAX_MEASURES: u32 = 16;

/// How far beyond a pull's clock a deferral may wait for the minimum clock (2^32 iterations:
/// a deferral beyond that can never be released).
pub const MAX_DEFERRAL: u64 = 1 << 32;

/// What the rules need to know about the state the decisions act on, as it stands when each
/// decision is checked (earlier decisions of the same event already applied).
pub trait DecisionState {
    /// Whether `worker` is a live member.
    fn is_live(&self, worker: WorkerId) -> bool;
    /// Whether pull `pull` is parked (deferred and not yet released).
    fn is_parked(&self, pull: RequestId) -> bool;
    /// Whether push `push` is held.
    fn is_held(&self, push: RequestId) -> bool;
    /// Whether timer `timer` is set.
    fn has_timer(&self, timer: TimerId) -> bool;
    /// How many timers are set.
    fn timers(&self) -> usize;
}

/// The request an event carries, and whether it has its verdict yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Request {
    None,
    Pull { id: RequestId, clock: u64, decided: bool },
    Push { id: RequestId, decided: bool },
}

/// The rules for one event's decisions; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventRules {
    request: Request,
    /// Measures asked so far; `None` where none may be (a start-up).
    measures: Option<u32>,
}

impl EventRules {
    /// The rules for the decisions answering `event`.
    pub fn new(event: &Event) -> Self {
        let request = match event {
            Event::Pull(p) => Request::Pull { id: p.id, clock: p.clock, decided: false },
            Event::Push(p) => Request::Push { id: p.id, decided: false },
            _ => Request::None,
        };
        // An answer to a measure may not ask for more: a policy could otherwise keep the host
        // answering for ever.
        let measures = if matches!(event, Event::Measured { .. }) { None } else { Some(0) };
        EventRules { request, measures }
    }

    /// The rules for decisions that answer no event (a policy's start-up, a swap).
    pub fn without_event() -> Self {
        EventRules { request: Request::None, measures: None }
    }

    /// Whether `decision` is this event's verdict on its own request (`true`: the first
    /// decision on it), or an action on an earlier request, on the event's own once a decision
    /// before held it, or on none (`false`), without checking it: for decisions checked
    /// already (a recording's). [`check`](Self::check) says the same of the decisions it passes.
    pub fn verdict(&mut self, decision: &Decision<'_>) -> bool {
        match (*decision, &mut self.request) {
            (
                Decision::ServePull { pull: r } | Decision::DeferPull { pull: r, .. },
                Request::Pull { id, decided, .. },
            )
            | (
                Decision::AdmitPush { push: r, .. }
                | Decision::HoldPush { push: r }
                | Decision::DropPush { push: r }
                | Decision::AdmitToGroup { push: r, .. },
                Request::Push { id, decided },
            ) if r == *id && !*decided => {
                *decided = true;
                true
            }
            _ => false,
        }
    }

    /// Checks `decision` before it takes effect on `state`. On `Ok`, the caller applies it:
    /// `Ok(true)` says it is the event's verdict on its own request (the first decision on it),
    /// `Ok(false)` that it acts on an earlier request (a parked pull, a held push: the event's
    /// own too, once a decision before held it), or on none.
    pub fn check(&mut self, decision: &Decision<'_>, state: &impl DecisionState) -> Result<bool, String> {
        match *decision {
            Decision::ServePull { pull } => return self.verdict_on_pull(pull, "serve"),
            Decision::DeferPull { pull, until } => {
                if let (Release::MinClockAtLeast(c), Request::Pull { id, clock, .. }) = (until, self.request)
                {
                    if id == pull && c > clock.saturating_add(MAX_DEFERRAL) {
                        return Err(format!(
                            "deferred pull #{pull} until min clock {c}, which no run reaches"
                        ));
                    }
                }
                return self.verdict_on_pull(pull, "defer");
            }
            Decision::ReleasePull { pull } => {
                if !state.is_parked(pull) {
                    return Err(format!("released pull #{pull}, which is not parked"));
                }
            }
            Decision::AdmitPush { push, weight } | Decision::AdmitToGroup { push, weight, .. } => {
                if let Some(w) = weight {
                    if !w.is_finite() || w < 0.0 {
                        return Err(format!("admitted push #{push} with weight {w}"));
                    }
                }
                match self.request {
                    Request::Push { id, ref mut decided } if id == push && !*decided => {
                        *decided = true;
                        return Ok(true);
                    }
                    _ if state.is_held(push) => {}
                    _ => {
                        return Err(format!(
                            "admitted push #{push}, which is neither this event's push nor held"
                        ))
                    }
                }
            }
            Decision::DropPush { push } => match self.request {
                Request::Push { id, ref mut decided } if id == push && !*decided => {
                    *decided = true;
                    return Ok(true);
                }
                _ if state.is_held(push) => {}
                _ => {
                    return Err(format!("dropped push #{push}, which is neither this event's push nor held"))
                }
            },
            Decision::HoldPush { push } => match self.request {
                Request::Push { id, ref mut decided } if id == push && !*decided => {
                    *decided = true;
                    return Ok(true);
                }
                _ => return Err(not_this("hold", push)),
            },
            Decision::Control { worker, control } => {
                if !state.is_live(worker) {
                    return Err(format!("sent a control message to worker {worker}, which is not live"));
                }
                match control {
                    Control::MoveTasks { from, first, count, .. } => {
                        if !state.is_live(from) {
                            return Err(format!("moved tasks of worker {from}, which is not live"));
                        }
                        if from == worker {
                            return Err(format!("moved tasks of worker {from} to itself"));
                        }
                        if first.saturating_add(count) > MAX_TASKS || count == 0 {
                            let end = first.saturating_add(count);
                            return Err(format!(
                                "moved tasks {first}..{end}, not within 1 to {MAX_TASKS} tasks"
                            ));
                        }
                    }
                    Control::SetTaskShare { tasks } if !(1..=MAX_TASKS).contains(&tasks) => {
                        return Err(format!(
                            "split iterations into {tasks} tasks (1 to {MAX_TASKS} allowed)"
                        ));
                    }
                    Control::SetPushCodec { codec } => {
                        codec.check().map_err(|e| format!("set a push codec of {e}"))?;
                    }
                    _ => {}
                }
            }
            Decision::SetTimer { timer, .. } => {
                if !state.has_timer(timer) && state.timers() >= MAX_TIMERS {
                    return Err(format!("set more than {MAX_TIMERS} timers"));
                }
            }
            Decision::SetLocalSteps { worker, steps } => {
                check_local_steps(steps).map_err(|e| format!("set {e}"))?;
                if let Some(w) = worker {
                    if !state.is_live(w) {
                        return Err(format!("set local steps of worker {w}, which is not live"));
                    }
                }
            }
            Decision::SetOuterOptimizer { lr, momentum, .. } => {
                check_outer_optimizer(lr, momentum).map_err(|e| format!("set {e}"))?;
            }
            Decision::SetOuterDelay { period } => {
                check_outer_delay(period).map_err(|e| format!("set {e}"))?;
            }
            Decision::SetPullCodec { codec } => {
                codec.check().map_err(|e| format!("set a pull codec of {e}"))?;
                if codec.is_sparse() {
                    return Err(format!(
                        "set {codec} as the pull codec: pulls carry parameters, not updates"
                    ));
                }
            }
            Decision::Measure { .. } => match self.measures.as_mut() {
                None => {
                    return Err("asked for a measure at start-up or while hearing one \
                                (ask every measure an event needs at once)"
                        .into())
                }
                Some(n) if *n >= MAX_MEASURES => {
                    return Err(format!("asked for more than {MAX_MEASURES} measures in one event"))
                }
                Some(n) => *n += 1,
            },
            Decision::SetUpdateMode(_)
            | Decision::CancelTimer { .. }
            | Decision::Metric { .. }
            | Decision::CompleteAggregate { .. }
            | Decision::CompleteGroup { .. } => {}
        }
        Ok(false)
    }

    /// Checks, after the event's last decision, that its request got a verdict.
    pub fn finish(&self) -> Result<(), String> {
        match self.request {
            Request::Pull { decided: false, .. } => Err("the pull got no verdict".into()),
            Request::Push { decided: false, .. } => Err("the push got no verdict".into()),
            _ => Ok(()),
        }
    }

    fn verdict_on_pull(&mut self, pull: RequestId, kind: &str) -> Result<bool, String> {
        match self.request {
            Request::Pull { id, ref mut decided, .. } if id == pull && !*decided => {
                *decided = true;
                Ok(true)
            }
            _ => Err(not_this(kind, pull)),
        }
    }
}

fn not_this(kind: &str, id: RequestId) -> String {
    format!("{kind} for request #{id}, which is not this event's (undecided) request")
}

#[cfg(test)]
mod tests {
    use alloc::vec;
    use alloc::vec::Vec;

    use super::*;
    use crate::abi::Codec;
    use crate::abi::{Pull, Push};

    #[derive(Default)]
    struct State {
        live: Vec<WorkerId>,
        parked: Vec<RequestId>,
        held: Vec<RequestId>,
        timers: usize,
    }

    impl DecisionState for State {
        fn is_live(&self, worker: WorkerId) -> bool {
            self.live.contains(&worker)
        }
        fn is_parked(&self, pull: RequestId) -> bool {
            self.parked.contains(&pull)
        }
        fn is_held(&self, push: RequestId) -> bool {
            self.held.contains(&push)
        }
        fn has_timer(&self, timer: TimerId) -> bool {
            timer < self.timers as u64
        }
        fn timers(&self) -> usize {
            self.timers
        }
    }

    fn pull(id: RequestId) -> Event {
        Event::Pull(Pull { id, worker: 0, iteration: 3, clock: 3, version: 0 })
    }

    #[test]
    fn a_request_gets_exactly_one_verdict() {
        let s = State::default();
        let mut r = EventRules::new(&pull(7));
        assert_eq!(r.finish(), Err("the pull got no verdict".into()));
        assert!(r.check(&Decision::ServePull { pull: 8 }, &s).is_err(), "another request");
        assert_eq!(r.check(&Decision::ServePull { pull: 7 }, &s), Ok(true));
        assert!(r.check(&Decision::DeferPull { pull: 7, until: Release::Explicit }, &s).is_err(), "twice");
        r.finish().unwrap();
        let mut r = EventRules::new(&Event::Push(Push {
            id: 2,
            worker: 0,
            iteration: 0,
            clock: 0,
            samples: 1,
            staleness: 0,
            version: 0,
            signals: Default::default(),
        }));
        assert!(r.check(&Decision::AdmitPush { push: 2, weight: Some(f32::NAN) }, &s).is_err());
        assert_eq!(r.check(&Decision::HoldPush { push: 2 }, &s), Ok(true));
        assert!(
            r.check(&Decision::AdmitPush { push: 2, weight: None }, &s).is_err(),
            "not held (the caller did not apply the hold): not decided twice"
        );
    }

    /// `on_push` holds its push and `after_push` admits it (the guide's pattern): the admission
    /// acts on the held push, not as a second verdict (it once took the event's verdict slot,
    /// which was empty by then, and left the push held forever).
    #[test]
    fn a_push_held_and_then_admitted_in_one_event_is_admitted_as_held() {
        let push = Event::Push(Push {
            id: 2,
            worker: 0,
            iteration: 0,
            clock: 0,
            samples: 1,
            staleness: 0,
            version: 0,
            signals: Default::default(),
        });
        let (hold, admit) = (Decision::HoldPush { push: 2 }, Decision::AdmitPush { push: 2, weight: None });
        let mut s = State::default();
        let mut r = EventRules::new(&push);
        assert_eq!(r.check(&hold, &s), Ok(true));
        s.held.push(2);
        assert_eq!(r.check(&admit, &s), Ok(false), "an action on the held push");
        r.finish().unwrap();
        let mut r = EventRules::new(&push);
        assert!(r.verdict(&hold) && !r.verdict(&admit), "unchecked, the same");
    }

    #[test]
    fn only_parked_pulls_and_held_pushes_are_released_and_admitted_later() {
        let s = State { parked: vec![4], held: vec![5], ..State::default() };
        let mut r = EventRules::without_event();
        r.check(&Decision::ReleasePull { pull: 4 }, &s).unwrap();
        r.check(&Decision::AdmitPush { push: 5, weight: Some(0.5) }, &s).unwrap();
        assert!(r.check(&Decision::ReleasePull { pull: 5 }, &s).is_err());
        assert!(r.check(&Decision::AdmitPush { push: 4, weight: None }, &s).is_err());
        let far = Decision::DeferPull { pull: 1, until: Release::MinClockAtLeast(3 + MAX_DEFERRAL + 1) };
        assert!(EventRules::new(&pull(1)).check(&far, &s).is_err(), "a deferral no run can release");
    }

    #[test]
    fn control_messages_go_to_live_workers_and_moves_stay_within_the_task_limit() {
        let s = State { live: vec![0, 1], timers: MAX_TIMERS, ..State::default() };
        let mut r = EventRules::without_event();
        let to = |worker, control| Decision::Control { worker, control };
        r.check(&to(1, Control::SetBatchSize { samples: 8 }), &s).unwrap();
        assert!(r.check(&to(2, Control::Resume), &s).is_err(), "worker 2 is not live");
        let mv = |from, first, count| Control::MoveTasks { from, iteration: 0, first, count };
        r.check(&to(1, mv(0, 60, 4)), &s).unwrap();
        for bad in [mv(2, 0, 1), mv(1, 0, 1), mv(0, 61, 4), mv(0, 0, 0)] {
            assert!(r.check(&to(1, bad), &s).is_err(), "{bad:?}");
        }
        assert!(r.check(&to(1, Control::SetTaskShare { tasks: MAX_TASKS + 1 }), &s).is_err());
        r.check(&Decision::SetTimer { timer: 3, after_ns: 1 }, &s).unwrap();
        let new_timer = Decision::SetTimer { timer: MAX_TIMERS as u64, after_ns: 1 };
        assert!(r.check(&new_timer, &s).is_err(), "one timer too many");
    }

    /// Local steps, the outer optimizer and codecs stay within their bounds, and pulls are
    /// never top-k.
    #[test]
    fn measures_are_bounded_per_event_and_refused_at_start_up() {
        let s = State::default();
        let m =
            Decision::Measure { query: 1, measure: crate::abi::Measure::Norm(crate::abi::Tensor::Params) };
        let mut r = EventRules::new(&Event::Timer { timer: 1 });
        for _ in 0..MAX_MEASURES {
            assert_eq!(r.check(&m, &s), Ok(false));
        }
        assert!(r.check(&m, &s).unwrap_err().contains("more than 16 measures"));
        assert!(EventRules::without_event().check(&m, &s).unwrap_err().contains("start-up"));
        let answer = Event::Measured { query: 1, value: 0.5 };
        assert!(EventRules::new(&answer).check(&m, &s).unwrap_err().contains("while hearing one"));
    }

    #[test]
    fn local_steps_outer_optimizers_and_codecs_are_bounded() {
        let s = State { live: vec![0], ..State::default() };
        let mut r = EventRules::without_event();
        let ok = [
            Decision::SetLocalSteps { worker: None, steps: 0 },
            Decision::SetLocalSteps { worker: Some(0), steps: MAX_LOCAL_STEPS },
            Decision::SetOuterOptimizer { lr: 0.7, momentum: 0.9, nesterov: true },
            Decision::SetOuterDelay { period: 1 },
            Decision::SetOuterDelay { period: MAX_OUTER_DELAY },
            Decision::SetPullCodec { codec: Codec::Int8 { block: 256 } },
            Decision::Control {
                worker: 0,
                control: Control::SetPushCodec { codec: Codec::TopK { ppm: 10_000 } },
            },
        ];
        for d in ok {
            assert_eq!(r.check(&d, &s), Ok(false), "{d:?}");
        }
        let bad = [
            Decision::SetLocalSteps { worker: None, steps: MAX_LOCAL_STEPS + 1 },
            Decision::SetLocalSteps { worker: Some(1), steps: 4 },
            Decision::SetOuterOptimizer { lr: 0.0, momentum: 0.9, nesterov: true },
            Decision::SetOuterOptimizer { lr: f32::NAN, momentum: 0.0, nesterov: false },
            Decision::SetOuterOptimizer { lr: 1.0, momentum: 1.0, nesterov: false },
            Decision::SetOuterDelay { period: 0 },
            Decision::SetOuterDelay { period: MAX_OUTER_DELAY + 1 },
            Decision::SetPullCodec { codec: Codec::TopK { ppm: 10_000 } },
            Decision::SetPullCodec { codec: Codec::SparseLoCo { ppm: 10_000, beta_milli: 950 } },
            Decision::SetPullCodec { codec: Codec::Int8 { block: 1 } },
            Decision::Control {
                worker: 0,
                control: Control::SetPushCodec { codec: Codec::SparseLoCo { ppm: 10_000, beta_milli: 1001 } },
            },
            Decision::Control { worker: 0, control: Control::SetPushCodec { codec: Codec::TopK { ppm: 0 } } },
        ];
        for d in bad {
            assert!(r.check(&d, &s).is_err(), "{d:?}");
        }
    }
}
