//! R²SP, round-robin synchronous parallel (Chen, Wang, Li; INFOCOM 2019).
//!
//! Under BSP every worker pushes and pulls at the same moment and they contend for the servers'
//! bandwidth. R²SP lets workers synchronize one at a time, in a fixed rotation, so the syncs
//! spread evenly over the iteration.
//!
//! **This is our reading of the paper** (its full text and code were not available to us); the
//! choices are configurable where they are choices:
//! - The shard keeps a turn token over its live workers in id order. A push is admitted only on
//!   its worker's turn; a push that arrives early is held (with its acknowledgement, so the
//!   worker waits), and the turn then passes to the next live worker. Pulls are served at once,
//!   and updates are applied on arrival, so in the homogeneous steady state every gradient is
//!   exactly `N - 1` updates stale and the syncs settle `T / N` apart (T: the iteration time).
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

/// Round-robin synchronous parallel.
#[derive(Debug)]
pub struct R2sp {
    /// Live workers, in id order.
    ring: Vec<WorkerId>,
    /// Index into `ring` of the worker whose turn it is.
    turn: usize,
    /// Held pushes, by worker.
    held: Vec<(WorkerId, RequestId)>,
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

    /// Admits held pushes for as long as the turn holder has one waiting.
    fn admit_waiting(&mut self, ctx: &mut Ctx<'_>) {
        while let Some(&w) = self.ring.get(self.turn) {
            let Some(pos) = self.held.iter().position(|h| h.0 == w) else { break };
            let (_, push) = self.held.remove(pos);
            ctx.admit_push(push);
            self.pass_turn();
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
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let global_batch = init.config.get("global_batch")?;
        let min_batch: u32 = init.config.get("min_batch")?;
        let retune_ms: u64 = init.config.get("retune_ms")?;
        if min_batch == 0 || retune_ms == 0 {
            return Err("min_batch and retune_ms must be positive".into());
        }
        Ok(R2sp {
            ring: Vec::new(),
            turn: 0,
            held: Vec::new(),
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
        if let Some(h) = holder {
            self.turn = self.ring.iter().position(|w| *w == h).unwrap_or(0);
        }
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        self.held.retain(|h| h.0 != worker);
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

    fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if !self.has_turn(push.worker) {
            self.held.push((push.worker, push.id));
            return PushVerdict::Hold;
        }
        self.pass_turn();
        match self.weight(push.samples) {
            Some(w) => PushVerdict::AdmitWeighted(w),
            None => PushVerdict::Admit,
        }
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
        let mut d = Driver::<R2sp>::new(&[]).unwrap();
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
        let mut d = Driver::<R2sp>::new(&[]).unwrap();
        d.join(0);
        d.join(1);
        assert_eq!(d.push(1).unwrap(), PushVerdict::Hold);
        d.leave(0, LeaveReason::Failed);
        assert_eq!(d.clock(1), Some(1));
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
