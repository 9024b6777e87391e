//! R²SP, round-robin synchronous parallel (Chen, Wang, Li; INFOCOM 2019).
//!
//! Under BSP every worker pushes and pulls at the same moment and they contend for the servers'
//! bandwidth. R²SP lets workers synchronize one at a time, in a fixed rotation, so the syncs
//! spread evenly over the iteration.
//!
//! The paper's full text was not available to us. Code derived from the authors' (the
//! `batchsizemanager.py` that ships with TensorFlow model code citing the paper) gives the rotation
//! and its pacing; the rest is **our reading**, and the choices are parameters:
//! - **Rotation** (both): the shard keeps a turn token over its live workers in id order. A push
//!   is admitted only on its worker's turn; a push that arrives early is held (with its
//!   acknowledgement, so the worker waits), and the turn then passes to the next live worker.
//!   Pulls are served at once, and updates are applied on arrival, so in the homogeneous steady
//!   state every gradient is exactly `N - 1` updates stale and the syncs settle `T / N` apart
//!   (T: the iteration time).
//! - **Warm-up** (their code): nothing is gated until the first worker in the rotation has pushed
//!   more than `warmup` (10) times; the rotation then starts with it.
//! - **Pacing** (their code): the turn passes at most every `gap = T0 / (pace * N)` (`pace` = 1.2
//!   there), where `T0` is the first worker's mean *unblocked* iteration time: the time between its
//!   6th push and its latest, less the time its pushes were held, over the iterations between.
//!   A turn holder's push that arrives sooner is held until `gap` has passed since the last
//!   admission (a timer releases it). Their code blocks the worker's request the same way; it
//!   measures at iteration starts, where we measure at push arrivals, which is the same interval.
//!   `pace = 0` turns pacing off and `warmup = 0` the warm-up: both 0 is our earlier reading.
//! - A worker that leaves gives up its turn; a joining worker enters the rotation in id order.
//! - Heterogeneous extension (`global_batch > 0`): every `retune_ms` the policy measures each
//!   worker's throughput `v_i` (samples per second of compute, a moving average of its iteration
//!   reports) and sets its batch size `b_i = B * v_i / sum_j v_j` (with `B = global_batch`, at
//!   least `min_batch` each), so all iteration times are equal and the rotation stays even. Each
//!   update is weighted by `b_i / B` (the samples the push says it covers), so a round of N pushes
//!   moves the model by the global-batch mean gradient.
//! - Batch sizes are sent by shard 0's instance only (every shard sees the same reports, and a
//!   worker should get one instruction, not one per shard).

use syncopate_policy_sdk::prelude::*;
use syncopate_policy_sdk::shares::Throughput;

const RETUNE: TimerId = 1;
const PACE: TimerId = 2;

/// The pacing's measurement of the first worker's unblocked iteration time.
#[derive(Debug, Default)]
struct Reference {
    /// Its pushes so far.
    pushes: u64,
    /// When its 6th push arrived.
    mark_ns: Option<u64>,
    /// When its latest push arrived.
    last_ns: u64,
    /// Time its pushes since the mark spent held.
    held_ns: u64,
}

impl Reference {
    /// The mean unblocked iteration time, once there are iterations after the mark.
    fn period_ns(&self) -> Option<u64> {
        let mark = self.mark_ns?;
        let n = self.pushes.checked_sub(6).filter(|n| *n > 0)?;
        Some(self.last_ns.saturating_sub(mark).saturating_sub(self.held_ns) / n)
    }
}

/// Round-robin synchronous parallel.
#[derive(Debug)]
pub struct R2sp {
    /// Live workers, in id order.
    ring: Vec<WorkerId>,
    /// Index into `ring` of the worker whose turn it is.
    turn: usize,
    /// Held pushes: worker, request, arrival time.
    held: Vec<(WorkerId, RequestId, u64)>,
    /// Pushes the first worker makes before any gating.
    warmup: u64,
    /// The pacing factor (0: no pacing).
    pace: f64,
    /// Whether the warm-up is over.
    gating: bool,
    /// The earliest time the next push may be admitted.
    next_admit_ns: u64,
    /// What pacing measures.
    reference: Reference,
    global_batch: u32,
    min_batch: u32,
    retune_ns: u64,
    lead: bool,
    speed: Throughput,
}

impl R2sp {
    fn has_turn(&self, w: WorkerId) -> bool {
        self.ring.get(self.turn) == Some(&w)
    }

    fn pass_turn(&mut self) {
        if !self.ring.is_empty() {
            self.turn = (self.turn + 1) % self.ring.len();
        }
    }

    fn weight(&self, samples: u32) -> Option<f32> {
        (self.global_batch > 0).then(|| samples as f32 / self.global_batch as f32)
    }

    /// The pacing gap: `T0 / (pace * N)`, or 0 without pacing or before `T0` is known.
    fn gap_ns(&self) -> u64 {
        match self.reference.period_ns() {
            Some(t0) if self.pace > 0.0 => (t0 as f64 / (self.pace * self.ring.len().max(1) as f64)) as u64,
            _ => 0,
        }
    }

    /// Records that `worker`'s push, which arrived at `since`, is admitted now, and passes the turn.
    fn admitted(&mut self, ctx: &Ctx<'_>, worker: WorkerId, since: u64) {
        let now = ctx.now_ns();
        if self.ring.first() == Some(&worker) && self.reference.mark_ns.is_some_and(|m| since >= m) {
            self.reference.held_ns += now - since;
        }
        self.next_admit_ns = now + self.gap_ns();
        self.pass_turn();
    }

    /// Admits held pushes for as long as the turn holder has one waiting and the pacing allows;
    /// when the pacing holds one back, a timer brings it in.
    fn admit_waiting(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(&w) = self.ring.get(self.turn) {
            let Some(pos) = self.held.iter().position(|h| h.0 == w) else { break };
            let now = ctx.now_ns();
            if now < self.next_admit_ns {
                ctx.set_timer(PACE, self.next_admit_ns - now);
                break;
            }
            let (_, push, since) = self.held.remove(pos);
            ctx.admit_push(push);
            self.admitted(ctx, w, since);
        }
    }
}

impl Policy for R2sp {
    const INFO: PolicyInfo = PolicyInfo::new(
        "r2sp",
        env!("CARGO_PKG_VERSION"),
        "Round-robin synchronous parallel: workers sync one at a time in rotation (a reading).",
        &[
            ParamSpec::new(
                "global_batch",
                ParamKind::Uint,
                "0",
                "heterogeneous extension: split this global batch by throughput (0: off)",
            ),
            ParamSpec::new("min_batch", ParamKind::Uint, "8", "the smallest batch a worker is given"),
            ParamSpec::new("retune_ms", ParamKind::Uint, "2000", "how often batch sizes are re-tuned"),
            ParamSpec::new(
                "warmup",
                ParamKind::Uint,
                "10",
                "pushes of the first worker before any gating (the authors' code: 10)",
            ),
            ParamSpec::new(
                "pace",
                ParamKind::Float,
                "1.2",
                "the turn passes at most every T0/(pace*N) (the authors' code: 1.2; 0: no pacing)",
            ),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let global_batch = init.config.get("global_batch")?;
        let min_batch: u32 = init.config.get("min_batch")?;
        let retune_ms: u64 = init.config.get("retune_ms")?;
        if min_batch == 0 || retune_ms == 0 {
            return Err("min_batch and retune_ms must be positive".into());
        }
        let warmup: u64 = init.config.get("warmup")?;
        let pace: f64 = init.config.get("pace")?;
        if !(pace >= 0.0 && pace.is_finite()) {
            return Err(format!("pace = {pace} must be a finite number, at least 0"));
        }
        Ok(R2sp {
            ring: Vec::new(),
            turn: 0,
            held: Vec::new(),
            warmup,
            pace,
            gating: warmup == 0,
            next_admit_ns: 0,
            reference: Reference::default(),
            global_batch,
            min_batch,
            retune_ns: retune_ms * 1_000_000,
            lead: init.shard == 0,
            speed: Throughput::new(0.3),
        })
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut p = Self::new(init)?;
        p.ring = handoff.workers.iter().map(|w| w.worker).collect();
        p.ring.sort_unstable();
        Ok(p)
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::OnArrival);
        if self.global_batch > 0 && self.lead {
            ctx.set_timer(RETUNE, self.retune_ns);
        }
    }

    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, worker: WorkerId, _clock: u64) {
        let holder = self.ring.get(self.turn).copied();
        let at = self.ring.partition_point(|w| *w < worker);
        self.ring.insert(at, worker);
        if at == 0 {
            // The pacing measures the first worker; a new first worker starts a new measurement.
            self.reference = Reference::default();
        }
        if let Some(h) = holder {
            self.turn = self.ring.iter().position(|w| *w == h).unwrap_or(0);
        }
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.held.retain(|h| h.0 != worker);
        if self.ring.first() == Some(&worker) {
            // The pacing measures the first worker; a new first worker starts a new measurement.
            self.reference = Reference::default();
        }
        self.speed.forget(worker);
        if let Some(pos) = self.ring.iter().position(|w| *w == worker) {
            self.ring.remove(pos);
            if pos < self.turn {
                self.turn -= 1;
            }
            if self.turn >= self.ring.len() {
                self.turn = 0;
            }
        }
        self.admit_waiting(ctx);
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        let now = ctx.now_ns();
        if self.ring.first() == Some(&push.worker) {
            let r = &mut self.reference;
            r.pushes += 1;
            r.last_ns = now;
            if r.pushes == 6 {
                r.mark_ns = Some(now);
            }
            if !self.gating && r.pushes > self.warmup {
                self.gating = true;
                self.turn = 0;
            }
        }
        let verdict = match self.weight(push.samples) {
            Some(w) => PushVerdict::AdmitWeighted(w),
            None => PushVerdict::Admit,
        };
        if !self.gating {
            return verdict;
        }
        if !self.has_turn(push.worker) || now < self.next_admit_ns {
            if self.has_turn(push.worker) {
                ctx.set_timer(PACE, self.next_admit_ns - now);
            }
            self.held.push((push.worker, push.id, now));
            return PushVerdict::Hold;
        }
        self.admitted(ctx, push.worker, now);
        verdict
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, verdict: PushVerdict) {
        // The pushes this one unblocks are admitted after it, in rotation.
        if verdict != PushVerdict::Hold {
            self.admit_waiting(ctx);
        }
    }

    fn on_pull(&mut self, _ctx: &mut Ctx<'_>, _pull: &Pull) -> PullVerdict {
        PullVerdict::Serve
    }

    fn on_iteration_finished(&mut self, _ctx: &mut Ctx<'_>, report: &IterationReport) {
        self.speed.record(report);
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, timer: TimerId) {
        if timer == PACE {
            self.admit_waiting(ctx);
            return;
        }
        if timer != RETUNE {
            return;
        }
        ctx.set_timer(RETUNE, self.retune_ns);
        if let Some(shares) = self.speed.shares(&self.ring, self.global_batch, self.min_batch) {
            for (worker, samples) in shares {
                ctx.control(worker, Control::SetBatchSize { samples });
            }
        }
    }
}

syncopate_policy_sdk::export_policy!(R2sp);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::testing::Recorded;

    #[test]
    fn admits_pushes_in_rotation() {
        let mut d = Driver::<R2sp>::new(&[("warmup", "0"), ("pace", "0")]).unwrap();
        for w in 0..3 {
            d.join(w);
        }
        assert_eq!(d.push(1).unwrap(), PushVerdict::Hold);
        assert_eq!(d.push(2).unwrap(), PushVerdict::Hold);
        assert_eq!(d.clock(1), Some(0));
        // Worker 0's turn: its push is admitted, then 1's and 2's in order.
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
        assert_eq!((d.clock(0), d.clock(1), d.clock(2)), (Some(1), Some(1), Some(1)));
        assert_eq!(d.push(2).unwrap(), PushVerdict::Hold);
    }

    #[test]
    fn a_leaving_turn_holder_passes_the_turn() {
        let mut d = Driver::<R2sp>::new(&[("warmup", "0")]).unwrap();
        d.join(0);
        d.join(1);
        assert_eq!(d.push(1).unwrap(), PushVerdict::Hold);
        d.leave(0, LeaveReason::Failed);
        assert_eq!(d.clock(1), Some(1));
    }

    #[test]
    fn gates_nothing_during_the_warm_up_then_rotates_from_the_first_worker() {
        let mut d = Driver::<R2sp>::new(&[("warmup", "3"), ("pace", "0")]).unwrap();
        d.join(0);
        d.join(1);
        for _ in 0..3 {
            assert_eq!(d.push(1).unwrap(), PushVerdict::Admit, "warm-up: no gating");
            assert_eq!(d.push(0).unwrap(), PushVerdict::Admit, "warm-up: no gating");
        }
        // Worker 0's 4th push ends the warm-up and is the rotation's first.
        assert_eq!(d.push(1).unwrap(), PushVerdict::Admit, "still warming up: worker 0 has 3");
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit, "the first turn is worker 0's");
        assert_eq!(d.push(0).unwrap(), PushVerdict::Hold, "now it is worker 1's turn");
    }

    /// The pacing on a hand-checked sequence: two workers, no warm-up (so the rotation runs
    /// throughout), both pushing every 100 ns, worker 0 first.
    #[test]
    fn paces_the_turn_at_t0_over_pace_times_n() {
        let mut d = Driver::<R2sp>::new(&[("warmup", "0"), ("pace", "1.25")]).unwrap();
        d.join(0);
        d.join(1);
        for i in 0..6u64 {
            // Until worker 0's 7th push there is no T0: no pacing.
            assert_eq!(d.push(0).unwrap(), PushVerdict::Admit, "t = {}", 100 * i);
            assert_eq!(d.push(1).unwrap(), PushVerdict::Admit, "t = {}", 100 * i);
            d.advance_ns(100);
        }
        // t = 600: worker 0's 7th push; its 6th came at 500 and none was held: T0 = 100 ns, and
        // the gap is 100 / (1.25 * 2) = 40 ns after this admission.
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
        assert_eq!(d.push(1).unwrap(), PushVerdict::Hold, "its turn, but only 0 ns after the last");
        let timers = |d: &Driver<R2sp>| -> Vec<u64> {
            d.log
                .iter()
                .filter_map(|r| match r {
                    Recorded::Timer(PACE, ns) => Some(*ns),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(timers(&d), [40]);
        d.advance_ns(20);
        d.fire_timer(PACE).unwrap();
        assert_eq!(d.clock(1), Some(6), "20 ns is not yet the gap");
        assert_eq!(timers(&d), [40, 20], "re-armed for the rest");
        d.advance_ns(20);
        d.fire_timer(PACE).unwrap();
        assert_eq!(d.clock(1), Some(7), "admitted 40 ns after worker 0");
        // t = 700: worker 0 again, 60 ns after worker 1's admission: on time.
        d.advance_ns(60);
        assert_eq!(d.push(0).unwrap(), PushVerdict::Admit);
    }

    #[test]
    fn retunes_batch_sizes_in_proportion_to_throughput() {
        let mut d = Driver::<R2sp>::new(&[("global_batch", "128"), ("retune_ms", "1")]).unwrap();
        d.join(0);
        d.join(1);
        d.iteration_finished(0, 1_000_000).unwrap();
        d.iteration_finished(1, 3_000_000).unwrap();
        d.fire_timer(RETUNE).unwrap();
        let sizes: Vec<_> = d
            .log
            .iter()
            .filter_map(|r| match r {
                Recorded::Control(w, Control::SetBatchSize { samples }) => Some((*w, *samples)),
                _ => None,
            })
            .collect();
        assert_eq!(sizes.len(), 2);
        assert!(sizes[0].1 > 2 * sizes[1].1, "{sizes:?}");
        assert_eq!(sizes[0].1 + sizes[1].1, 128);
    }
}
