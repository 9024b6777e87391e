//! `deadline`: an example of a policy a user writes against `syncopate-policy-sdk` alone, using
//! every host mechanism a policy can reach. It is not one of the seven paradigms; it exists to
//! show how the pieces fit (see `docs/writing-a-policy.md`).
//!
//! Rule:
//! - **Push admission.** Staleness is bounded MXNet-style, by holding pushes rather than pulls:
//!   a push from a worker more than `s` iterations ahead of the slowest is held, unacknowledged
//!   (so the worker waits), and admitted as soon as the slowest catches up. Pulls are always
//!   served; updates are applied on arrival.
//! - **Timers.** Every `deadline_ms` the policy looks for a straggler: the slowest worker, if its
//!   current iteration has been running for longer than `deadline_ms`.
//! - **Task accounting and moves.** Workers split their batches into `tasks` tasks (a control
//!   sent at join and acknowledged). A straggler's last half of not-yet-given tasks is moved to a
//!   worker whose push is held (it is idle anyway); the host hands over only tasks the straggler
//!   has not started and completes its iteration when they arrive.
//! - **Batch sizes.** At each check, batch sizes are set in proportion to measured throughput (of
//!   the sum of the starting batches), so the straggler gets less work from then on; the policy
//!   records each acknowledged change as a metric.
//! - **Per-shard configuration.** `s` and `deadline_ms` are read per instance, so `syncopate
//!   policy swap --shard-config 1:s=0` makes shard 1 stricter than the others. Only shard 0's
//!   instance sends controls.

use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::shares::Throughput;

const CHECK: TimerId = 7;

#[derive(Clone, Copy, Debug, Default)]
struct Worker {
    live: bool,
    /// Iterations pushed and admitted.
    clock: u64,
    /// When its current iteration started (its last admitted push), host ns.
    since_ns: u64,
    batch: u32,
    /// It acknowledged splitting its batches into tasks.
    split: bool,
    /// Tasks of its current iteration already moved away (`tasks - given` remain its own).
    given: u32,
    moving: bool,
}

/// A deadline-driven bounded-staleness policy (an example).
#[derive(Debug)]
pub struct Deadline {
    s: u64,
    deadline_ns: u64,
    tasks: u32,
    lead: bool,
    workers: Vec<Worker>,
    held: Vec<(WorkerId, RequestId, u64)>,
    speed: Throughput,
}

impl Deadline {
    fn worker(&mut self, w: WorkerId) -> &mut Worker {
        let i = w as usize;
        if self.workers.len() <= i {
            self.workers.resize(i + 1, Worker::default());
        }
        &mut self.workers[i]
    }

    fn min_clock(&self) -> u64 {
        self.workers.iter().filter(|w| w.live).map(|w| w.clock).min().unwrap_or(0)
    }

    /// Admits every held push that is now within `s` of the slowest, oldest first.
    fn admit_ready(&mut self, ctx: &mut Ctx<'_>) {
        loop {
            let min = self.min_clock();
            let Some(pos) = self.held.iter().position(|h| h.2 <= min + self.s) else { return };
            let (worker, push, _) = self.held.remove(pos);
            ctx.admit_push(push);
            self.admitted(worker, ctx.now_ns());
        }
    }

    fn admitted(&mut self, worker: WorkerId, now: u64) {
        let w = self.worker(worker);
        w.clock += 1;
        w.since_ns = now;
        w.given = 0;
    }
}

impl Policy for Deadline {
    const INFO: PolicyInfo = PolicyInfo::new(
        "deadline",
        env!("CARGO_PKG_VERSION"),
        "Example: SSP by held pushes; a deadline timer moves a straggler's tasks to held workers.",
        &[
            ParamSpec::new("s", ParamKind::Uint, "2", "iterations a worker may push ahead of the slowest"),
            ParamSpec::new("deadline_ms", ParamKind::Uint, "200", "an iteration running longer is helped"),
            ParamSpec::new("tasks", ParamKind::Uint, "8", "tasks each batch is split into (2-64)"),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let tasks: u32 = init.config.get("tasks")?;
        if !(2..=64).contains(&tasks) {
            return Err(format!("tasks = {tasks}: between 2 and 64"));
        }
        let deadline_ms: u64 = init.config.get("deadline_ms")?;
        if deadline_ms == 0 {
            return Err("deadline_ms must be positive".into());
        }
        Ok(Deadline {
            s: init.config.get("s")?,
            deadline_ns: deadline_ms * 1_000_000,
            tasks,
            lead: init.shard == 0,
            workers: Vec::new(),
            held: Vec::new(),
            speed: Throughput::new(0.5),
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
        if self.lead {
            ctx.set_timer(CHECK, self.deadline_ns);
        }
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut p = Self::new(init)?;
        for w in &handoff.workers {
            *p.worker(w.worker) = Worker { live: true, clock: w.clock, ..Worker::default() };
        }
        Ok(p)
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, clock: u64) {
        let now = ctx.now_ns();
        *self.worker(worker) = Worker { live: true, clock, since_ns: now, ..Worker::default() };
        if self.lead {
            ctx.control(worker, Control::SetTaskShare { tasks: self.tasks });
        }
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.worker(worker).live = false;
        self.held.retain(|h| h.0 != worker);
        self.speed.forget(worker);
        self.admit_ready(ctx);
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if push.clock > self.min_clock() + self.s {
            self.held.push((push.worker, push.id, push.clock));
            return PushVerdict::Hold;
        }
        self.admitted(push.worker, ctx.now_ns());
        PushVerdict::Admit
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, verdict: PushVerdict) {
        if verdict != PushVerdict::Hold {
            self.admit_ready(ctx);
        }
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
        PullVerdict::Serve
    }

    fn on_iteration_finished(&mut self, _ctx: &mut Ctx<'_>, report: &IterationReport) {
        self.speed.record(report);
        let w = self.worker(report.worker);
        if w.batch == 0 {
            w.batch = report.samples;
        }
    }

    fn on_control_applied(&mut self, ctx: &mut Ctx<'_>, applied: &Applied) {
        match applied.control {
            Control::SetTaskShare { .. } => self.worker(applied.worker).split = true,
            Control::SetBatchSize { samples } => {
                self.worker(applied.worker).batch = samples;
                ctx.metric("deadline.batch", f64::from(samples));
            }
            Control::MoveTasks { from, count, .. } => {
                let w = self.worker(from);
                w.moving = false;
                w.given += count;
                ctx.metric("deadline.moved", f64::from(count));
            }
            _ => {}
        }
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer != CHECK {
            return;
        }
        ctx.set_timer(CHECK, self.deadline_ns);
        let now = ctx.now_ns();
        let live: Vec<WorkerId> =
            (0..self.workers.len() as u32).filter(|w| self.workers[*w as usize].live).collect();
        // Batch sizes in proportion to speed, out of the batches the workers started with.
        let total: u32 = live.iter().map(|w| self.workers[*w as usize].batch).sum();
        if total > 0 {
            if let Some(shares) = self.speed.shares(&live, total, self.tasks) {
                for (worker, samples) in shares {
                    if samples != self.workers[worker as usize].batch {
                        ctx.control(worker, Control::SetBatchSize { samples });
                    }
                }
            }
        }
        // A straggler past its deadline gives half its remaining tasks to an idle worker.
        let Some(&slow) = live.iter().min_by_key(|w| self.workers[**w as usize].clock) else { return };
        let st = self.workers[slow as usize];
        if !st.split || st.moving || now.saturating_sub(st.since_ns) < self.deadline_ns {
            return;
        }
        let Some(&(helper, _, _)) = self.held.iter().find(|h| h.0 != slow) else { return };
        let remaining = self.tasks.saturating_sub(st.given);
        let count = remaining / 2;
        if count == 0 {
            return;
        }
        let first = remaining - count;
        ctx.control(helper, Control::MoveTasks { from: slow, iteration: st.clock, first, count });
        self.worker(slow).moving = true;
    }
}

syncopate_policy_sdk::export_policy!(Deadline);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn holds_pushes_beyond_s_and_admits_them_when_the_slowest_catches_up() {
        let mut d = Driver::<Deadline>::new(&[("s", "1")]).unwrap();
        d.join(0);
        d.join(1);
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
        assert_eq!(d.push(0).unwrap(), PushVerdict::Hold, "2 ahead of the slowest, s = 1");
        assert_eq!(d.clock(0), Some(2));
        d.push(1).unwrap();
        assert_eq!(d.clock(0), Some(3), "the held push was admitted after worker 1's");
    }

    #[test]
    fn a_straggler_past_its_deadline_gives_tasks_to_a_held_worker() {
        let mut d = Driver::<Deadline>::new(&[("s", "0"), ("deadline_ms", "10"), ("tasks", "8")]).unwrap();
        d.join(0);
        d.join(1);
        for w in 0..2 {
            d.control_applied(w, Control::SetTaskShare { tasks: 8 }, 0).unwrap();
        }
        d.push(0).unwrap();
        assert_eq!(d.push(0).unwrap(), PushVerdict::Hold);
        d.advance_ns(20_000_000);
        d.fire_timer(CHECK).unwrap();
        let moved: Vec<_> = d
            .log
            .iter()
            .filter_map(|r| match r {
                Recorded::Control(to, Control::MoveTasks { from, first, count, .. }) => {
                    Some((*to, *from, *first, *count))
                }
                _ => None,
            })
            .collect();
        assert_eq!(moved, vec![(0, 1, 4, 4)]);
    }
}
