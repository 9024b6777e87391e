//! EPSP, elastic-parallelism synchronous parallel (Falcon; Zhou et al., ICDCS 2019).
//!
//! Two guidelines from "straggler projection": make stragglers rarer by matching each worker's
//! work to its speed, and when a fast worker (a pioneer) would block, hand it work that is
//! holding the straggler up, so no capacity idles.
//!
//! **This is our reading of the paper** (its full text and code were not available to us). The
//! choices are parameters:
//! - Gating: `mode = enforced` is BSP's barrier (serve a pull iff `min_clock >= clock[w]`, updates
//!   aggregated per iteration); `mode = slack` is SSP's bound `s` (updates applied on arrival).
//! - Tasks: every worker splits its mini-batch into `tasks` equal tasks (sample shards), set at
//!   join with `Control::SetTaskShare`.
//! - A worker's speed (`speed = observed`, the default since 2026-11-26): samples per second of
//!   the iteration time the servers observe, from the moment its pull is served (at once, or
//!   when the barrier it waited at opens) to the arrival of its push. That is the time Falcon's
//!   straggler projection is about, whatever slows the worker: slower compute, or delays between
//!   iterations (an overloaded host, a slow input pipeline, the jitter injection). `speed =
//!   An iteration whose tasks moved, to the worker or from it, is timed by its reported compute
//!   instead (its observed time then includes others' work, or waits for it). `speed =
//!   reported` is the earlier reading, the compute time the worker itself reports, which a
//!   worker slowed between iterations hides (a quarter of 32 simulated workers jittered ran at
//!   BSP's pace under it: `docs/results.md`). Such a worker is helped by a smaller batch; a
//!   task move cannot help it, since its delay comes after its computing, when no task is left
//!   to hand over.
//! - Elastic shares (`elastic = true`): every `share_ms` each worker's finish time is projected
//!   from its task completion rate (samples per second, as above) and
//!   its batch size is set to `B * v_i / sum_j v_j` (B: `global_batch`, or the sum of the batch
//!   sizes the workers started with), so projected finish times line up. Each iteration's update
//!   is weighted by its share of B.
//! - Moves (`moves = true`): when a pioneer's pull would be deferred, the slowest worker's current
//!   iteration is projected: of its `hi` tasks not yet given away, about `elapsed * rate` are
//!   done; the rest is split between the straggler and the pioneer in proportion to their rates,
//!   and the pioneer's part (the last tasks) is moved to it with `Control::MoveTasks`. The host
//!   asks the straggler first, so only tasks it has not started move; the pioneer pushes their
//!   gradients counted towards the straggler's iteration, which completes when all its tasks have
//!   arrived (the host's task accounting). One move per straggler is in flight at a time.
//! - Controls (task splits, batch sizes, moves) come from shard 0's instance only; every shard's
//!   instance gates by the same rule on its own clocks.

use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::shares::Throughput;

const SHARES: TimerId = 1;

/// Per-worker projection state.
#[derive(Clone, Copy, Debug, Default)]
struct Worker {
    live: bool,
    clock: u64,
    /// When its current iteration started (its last push, or its pull if served later), host ns.
    started_ns: u64,
    /// Its batch size, as last reported or set.
    batch: u32,
    /// The first iteration from which it splits batches into tasks (acknowledged), if any.
    split_from: Option<u64>,
    /// Tasks `0..hi` of its current iteration are still its own.
    hi: u32,
    /// The iteration `hi` is about.
    hi_iteration: u64,
    /// A move of its tasks is awaiting the host's answer.
    moving: bool,
    /// It waits on a pull and has been given tasks.
    helping: bool,
    /// The last iteration of its from which tasks moved to other workers: that iteration's
    /// report counts only the samples it kept, so it does not tell its batch size.
    gave_away: Option<u64>,
    /// Its deferred pull waits for the minimum clock to reach this.
    gate: Option<u64>,
    /// Its last iteration's time as the servers saw it: from its pull served to its push (0:
    /// not a measure of its speed, since tasks moved to or from it meanwhile).
    observed_ns: u64,
    /// Tasks moved to it, or from its iteration, since its iteration started: its push then
    /// comes when others' work is done too, or after work of others.
    moved: bool,
}

/// Elastic-parallelism synchronous parallel.
#[derive(Debug)]
pub struct Epsp {
    enforced: bool,
    s: u64,
    tasks: u32,
    moves: bool,
    elastic: bool,
    global_batch: u32,
    share_ns: u64,
    lead: bool,
    workers: Vec<Worker>,
    speed: Throughput,
    /// Speeds from the iteration times the servers observe (else from reported compute).
    observed: bool,
}

impl Worker {
    fn joined(clock: u64, now_ns: u64) -> Self {
        Worker { live: true, clock, started_ns: now_ns, hi_iteration: u64::MAX, ..Worker::default() }
    }
}

impl Epsp {
    fn worker(&mut self, w: WorkerId) -> &mut Worker {
        let i = w as usize;
        if self.workers.len() <= i {
            self.workers.resize(i + 1, Worker::default());
        }
        &mut self.workers[i]
    }

    fn live(&self) -> Vec<WorkerId> {
        (0..self.workers.len() as u32).filter(|w| self.workers[*w as usize].live).collect()
    }

    fn gate(&self, clock: u64, view: ShardView) -> PullVerdict {
        let s = if self.enforced { 0 } else { self.s };
        if clock <= view.min_clock.saturating_add(s) {
            PullVerdict::Serve
        } else {
            PullVerdict::Defer(Release::MinClockAtLeast(clock - s))
        }
    }

    /// The global batch: configured, or the sum of the batches workers report.
    fn global(&self) -> Option<u32> {
        if self.global_batch > 0 {
            return Some(self.global_batch);
        }
        let live = self.workers.iter().filter(|w| w.live);
        let sum: u32 = live.clone().map(|w| w.batch).sum();
        (sum > 0 && live.clone().all(|w| w.batch > 0)).then_some(sum)
    }

    /// Tasks per second worker `w` completes (1 until it has reported).
    fn task_rate(&self, w: WorkerId) -> f64 {
        let per_task = f64::from(self.workers[w as usize].batch.max(1)) / f64::from(self.tasks);
        self.speed.rate(w).map_or(1.0, |r| r / per_task)
    }

    /// The projected finish time (host ns) of worker `w`'s current iteration.
    fn projected_finish(&self, w: WorkerId) -> f64 {
        let st = &self.workers[w as usize];
        let own = if st.hi_iteration == st.clock { st.hi } else { self.tasks };
        st.started_ns as f64 + f64::from(own) / self.task_rate(w) * 1e9
    }

    /// Pioneer `p` would block: move part of the straggler's iteration to it. The straggler is
    /// the worker with the smallest clock projected to finish its iteration last.
    fn move_to(&mut self, ctx: &mut Ctx<'_>, p: WorkerId) {
        let now = ctx.now_ns();
        let live = (0..self.workers.len() as u32).filter(|w| *w != p && self.workers[*w as usize].live);
        let Some(min) = live.clone().map(|w| self.workers[w as usize].clock).min() else { return };
        let Some(s) = live
            .filter(|w| self.workers[*w as usize].clock == min)
            .max_by(|a, b| self.projected_finish(*a).total_cmp(&self.projected_finish(*b)))
        else {
            return;
        };
        let st = self.workers[s as usize];
        let Some(from) = st.split_from else { return };
        if st.moving || st.clock < from || self.workers[p as usize].helping {
            return;
        }
        let hi = if st.hi_iteration == st.clock { st.hi } else { self.tasks };
        let (r_s, r_p) = (self.task_rate(s), self.task_rate(p));
        let done = (now.saturating_sub(st.started_ns) as f64 / 1e9 * r_s).floor() as u32;
        let remaining = hi.saturating_sub(done);
        let k = (remaining as f64 * r_p / (r_s + r_p)).round() as u32;
        if k == 0 || k > remaining {
            return;
        }
        let first = hi - k;
        ctx.control(p, Control::MoveTasks { from: s, iteration: st.clock, first, count: k });
        ctx.metric("epsp.move_requested", f64::from(k));
        let w = self.worker(s);
        w.moving = true;
        w.hi = first;
        w.hi_iteration = st.clock;
        self.worker(p).helping = true;
    }
}

impl Policy for Epsp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "epsp",
        env!("CARGO_PKG_VERSION"),
        "Elastic-parallelism SP (Falcon): speed-matched batches, stragglers' tasks moved to idle pioneers (a reading).",
        &[
            ParamSpec::new("mode", ParamKind::Text, "enforced", "`enforced` (BSP barrier) or `slack` (SSP bound s)"),
            ParamSpec::new("s", ParamKind::Uint, "3", "staleness bound in slack mode"),
            ParamSpec::new("tasks", ParamKind::Uint, "8", "tasks each mini-batch is split into (1-64)"),
            ParamSpec::new("moves", ParamKind::Bool, "true", "move a straggler's tasks to a blocked pioneer"),
            ParamSpec::new("elastic", ParamKind::Bool, "true", "set batch sizes in proportion to speed"),
            ParamSpec::new("global_batch", ParamKind::Uint, "0", "batch shared out by speed (0: the starting sum)"),
            ParamSpec::new("share_ms", ParamKind::Uint, "2000", "how often batch sizes are re-projected"),
            ParamSpec::new(
                "speed",
                ParamKind::Text,
                "observed",
                "a worker's speed: `observed` iteration times, or its `reported` compute",
            ),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let enforced = match init.config.text("mode").unwrap_or("enforced") {
            "enforced" => true,
            "slack" => false,
            other => return Err(format!("mode `{other}` is neither `enforced` nor `slack`")),
        };
        let tasks: u32 = init.config.get("tasks")?;
        if !(1..=64).contains(&tasks) {
            return Err(format!("tasks = {tasks}: between 1 and 64"));
        }
        let observed = match init.config.text("speed").unwrap_or("observed") {
            "observed" => true,
            "reported" => false,
            other => return Err(format!("speed `{other}` is neither `observed` nor `reported`")),
        };
        let share_ms: u64 = init.config.get("share_ms")?;
        if share_ms == 0 {
            return Err("share_ms must be positive".into());
        }
        Ok(Epsp {
            enforced,
            s: init.config.get("s")?,
            tasks,
            moves: init.config.get("moves")?,
            elastic: init.config.get("elastic")?,
            global_batch: init.config.get("global_batch")?,
            share_ns: share_ms * 1_000_000,
            lead: init.shard == 0,
            workers: Vec::new(),
            speed: Throughput::new(0.3),
            observed,
        })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut p = Self::new(init)?;
        for w in &handoff.workers {
            *p.worker(w.worker) = Worker::joined(w.clock, 0);
        }
        Ok(p)
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(if self.enforced { UpdateMode::Aggregate } else { UpdateMode::OnArrival });
        if self.lead {
            if self.elastic {
                ctx.set_timer(SHARES, self.share_ns);
            }
            if self.tasks > 1 {
                for w in self.live() {
                    ctx.control(w, Control::SetTaskShare { tasks: self.tasks });
                }
            }
        }
    }

    fn on_worker_joined(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, clock: u64) {
        let now = ctx.now_ns();
        *self.worker(worker) = Worker::joined(clock, now);
        if self.lead && self.tasks > 1 {
            ctx.control(worker, Control::SetTaskShare { tasks: self.tasks });
        }
    }

    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.worker(worker).live = false;
        self.speed.forget(worker);
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        let now = ctx.now_ns();
        let w = self.worker(push.worker);
        w.clock = push.clock + 1;
        w.observed_ns = if w.moved { 0 } else { now.saturating_sub(w.started_ns) };
        w.moved = false;
        w.started_ns = now;
        w.hi = 0;
        w.hi_iteration = u64::MAX;
        // The barrier this push completes opens for the pulls that waited at it: their
        // iterations start now.
        let min = self.workers.iter().filter(|w| w.live).map(|w| w.clock).min().unwrap_or(0);
        for w in self.workers.iter_mut().filter(|w| w.live && w.gate.is_some_and(|g| g <= min)) {
            w.gate = None;
            w.started_ns = now;
        }
        match self.global() {
            Some(b) if self.elastic || self.global_batch > 0 => {
                PushVerdict::AdmitWeighted(push.samples as f32 / b as f32)
            }
            _ => PushVerdict::Admit,
        }
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        self.worker(pull.worker).helping = false;
        let verdict = self.gate(pull.clock, ctx.view());
        match verdict {
            // Served at once: its next iteration starts computing now.
            PullVerdict::Serve => self.worker(pull.worker).started_ns = ctx.now_ns(),
            PullVerdict::Defer(Release::MinClockAtLeast(g)) => self.worker(pull.worker).gate = Some(g),
            PullVerdict::Defer(Release::Explicit) => {}
        }
        if verdict != PullVerdict::Serve && self.moves && self.lead {
            self.move_to(ctx, pull.worker);
        }
        verdict
    }

    fn on_iteration_finished(&mut self, _ctx: &mut Ctx<'_>, report: &IterationReport) {
        let observed = self.worker(report.worker).observed_ns;
        match self.observed && observed > 0 {
            true => self.speed.record(&IterationReport { compute_ns: observed, ..*report }),
            false => self.speed.record(report),
        }
        let w = self.worker(report.worker);
        // A report covers the worker's own tasks only: its batch is learnt from an iteration
        // none of whose tasks moved away.
        if w.batch == 0 && w.gave_away != Some(report.iteration) {
            w.batch = report.samples;
        }
    }

    fn on_control_applied(&mut self, _ctx: &mut Ctx<'_>, applied: &Applied) {
        match applied.control {
            Control::SetTaskShare { tasks } if tasks > 1 => {
                self.worker(applied.worker).split_from = Some(applied.iteration);
            }
            Control::SetBatchSize { samples } => self.worker(applied.worker).batch = samples,
            Control::MoveTasks { from, iteration, first, count } => {
                let tasks = self.tasks;
                if count > 0 {
                    // Both iterations' times now include the other's work.
                    self.worker(applied.worker).moved = true;
                }
                let w = self.worker(from);
                w.moving = false;
                if count > 0 {
                    w.gave_away = Some(iteration);
                    w.moved = true;
                }
                if w.hi_iteration == iteration {
                    // Tasks the owner had started stay with it.
                    w.hi = if count > 0 { first } else { tasks.min(w.hi.max(first + count)) };
                }
            }
            _ => {}
        }
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer != SHARES {
            return;
        }
        ctx.set_timer(SHARES, self.share_ns);
        let Some(total) = self.global() else { return };
        let live = self.live();
        if let Some(shares) = self.speed.shares(&live, total, self.tasks) {
            for (worker, samples) in shares {
                ctx.control(worker, Control::SetBatchSize { samples });
            }
        }
    }
}

syncopate_policy_sdk::export_policy!(Epsp);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    fn moves(d: &Driver<Epsp>) -> Vec<(WorkerId, Control)> {
        d.log
            .iter()
            .filter_map(|r| match r {
                Recorded::Control(w, c @ Control::MoveTasks { .. }) => Some((*w, *c)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_blocked_pioneer_gets_the_stragglers_last_tasks() {
        let mut d = Driver::<Epsp>::new(&[("tasks", "8"), ("elastic", "false")]).unwrap();
        d.join(0);
        d.join(1);
        for w in 0..2 {
            d.control_applied(w, Control::SetTaskShare { tasks: 8 }, 0).unwrap();
            d.iteration_finished(w, 1_000_000).unwrap();
        }
        d.push(0).unwrap();
        assert!(matches!(d.pull(0).unwrap(), PullVerdict::Defer(_)), "the barrier holds");
        let m = moves(&d);
        assert_eq!(m.len(), 1, "{:?}", d.log);
        let (to, Control::MoveTasks { from, iteration, first, count }) = m[0] else { unreachable!() };
        assert_eq!((to, from, iteration), (0, 1, 0));
        assert_eq!(first + count, 8, "the last tasks move");
        assert!((1..8).contains(&count));
        // The owner had started some of them: only the rest moved.
        d.control_applied(
            0,
            Control::MoveTasks { from: 1, iteration: 0, first: first + 1, count: count - 1 },
            0,
        )
        .unwrap();
        d.push(1).unwrap();
        assert_eq!(d.take_released().len(), 1);
    }

    #[test]
    fn no_moves_before_the_split_is_acknowledged_and_bad_settings_are_refused() {
        let mut d = Driver::<Epsp>::new(&[]).unwrap();
        d.join(0);
        d.join(1);
        d.push(0).unwrap();
        let _ = d.pull(0).unwrap();
        assert!(moves(&d).is_empty());
        assert!(Driver::<Epsp>::new(&[("tasks", "65")]).unwrap_err().contains("64"));
        assert!(Driver::<Epsp>::new(&[("mode", "lax")]).unwrap_err().contains("lax"));
    }
}
