//! `robust`: a synchronous merge that rejects outliers by their norm. Each round's pushes are
//! held until every live worker's is in; then a push whose L2 norm exceeds
//! `median + k · MAD` of the round's norms is dropped (`action=drop`) or scaled down to that
//! threshold (`action=clip`), and the round is applied as one step on the mean of what remains.
//!
//! The median and the median absolute deviation (MAD) are the classic robust location and
//! scale (Hampel's identifier; Leys et al., "Detecting outliers: Do not use standard deviation
//! around the mean, use absolute deviation around the median", J. Exp. Soc. Psychol. 2013,
//! recommend `k` = 3, as here by default). Norm-based screening of workers' contributions is
//! what robust aggregators in decentralised training do (Templar scores and screens miners'
//! gradients; torchft's and Psyche's peers do not yet): our rule is the simple one, on the
//! norm the host measures of each push on this shard (ABI v3's signals), so a worker whose
//! gradient blew up, or a faulty or hostile one, cannot drag the model.
//!
//! Per shard, our reading: the norms are this shard's part of each gradient, so shards decide
//! alone and may disagree on a borderline push. With `k·MAD` = 0 (all norms equal, or fewer
//! than three pushes) nothing is rejected: a threshold needs a spread to measure.
//!
//! Mechanics: the update mode is aggregate (a round is one optimizer step, as BSP's); pulls
//! wait at BSP's barrier; every push is held (its worker waits, as under BSP it would at its
//! next pull) until its round is complete. A round with no outlier is admitted as it is (the
//! host's weights: exactly BSP's step). With `drop`, the inliers are admitted and the round
//! applied at once on their mean (`complete_aggregate`), then the outliers dropped; with
//! `clip`, every push is admitted at weight `min(1, threshold / norm) / n`, the mean of the
//! clipped gradients (whatever the cluster's push weighting). A worker leaving completes the
//! round if it was the last one missing.

use syncopate_policy_sdk::prelude::*;

/// A held push and its round.
#[derive(Clone, Copy, Debug)]
struct Held {
    id: RequestId,
    worker: WorkerId,
    /// Its round: the worker's clock, plus its pushes held before it (a held push does not
    /// move the clock until it is decided, so a worker that pushes again before its round is
    /// decided pushes for the next round at the same clock).
    round: u64,
    norm: f32,
}

/// What to do with an outlier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Drop it: the round's step is the mean of the others.
    Drop,
    /// Scale it down to the threshold's norm.
    Clip,
}

/// The robust merge.
#[derive(Debug)]
pub struct Robust {
    k: f64,
    action: Action,
    held: Vec<Held>,
    /// The round being decided, and its norms (buffers reused: no allocation per round once
    /// grown).
    round: Vec<Held>,
    norms: Vec<f64>,
    /// Scratch for the median's sorts.
    scratch: Vec<f64>,
}

/// The median of `xs` (sorted in place); 0 for none.
fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

impl Robust {
    /// The threshold `median + k · MAD` of `norms` (`None` when the MAD is 0: no spread).
    pub fn threshold(norms: &[f64], k: f64, scratch: &mut Vec<f64>) -> Option<f64> {
        scratch.clear();
        scratch.extend_from_slice(norms);
        let med = median(scratch);
        scratch.clear();
        scratch.extend(norms.iter().map(|x| (x - med).abs()));
        let mad = median(scratch);
        (mad > 0.0).then_some(med + k * mad)
    }

    /// Decides the oldest open round, and the next, and so on, while every live worker's push
    /// is in it (`leaving`: a worker is leaving, counted in the view still).
    fn decide_complete_rounds(&mut self, ctx: &mut Ctx<'_>, leaving: u32) {
        while self.decide_if_complete(ctx, leaving) {}
    }

    /// Decides the oldest open round if every live worker's push is in it; says whether it did.
    fn decide_if_complete(&mut self, ctx: &mut Ctx<'_>, leaving: u32) -> bool {
        let Some(round) = self.held.iter().map(|h| h.round).min() else { return false };
        let in_round = self.held.iter().filter(|h| h.round == round).count() as u32;
        if in_round < ctx.view().workers.saturating_sub(leaving) {
            return false;
        }
        // The round's pushes, out of the held ones, into buffers kept across rounds.
        let (held, pushes, norms) = (&mut self.held, &mut self.round, &mut self.norms);
        pushes.clear();
        held.retain(|h| {
            h.round != round || {
                pushes.push(*h);
                false
            }
        });
        norms.clear();
        norms.extend(pushes.iter().map(|h| f64::from(h.norm)));
        let threshold = Self::threshold(norms, self.k, &mut self.scratch);
        let is_outlier = |h: &Held| threshold.is_some_and(|t| f64::from(h.norm) > t);
        let rejected = pushes.iter().filter(|h| is_outlier(h)).count() as u32;
        if rejected == 0 {
            // The host's default weights: the round completes as BSP's; completed by a
            // departure, it steps on the mean of the pushes in it (the host's weights still
            // count the worker leaving).
            for h in pushes.iter() {
                ctx.admit_push(h.id);
            }
            if leaving > 0 {
                ctx.complete_aggregate(round);
            }
        } else if self.action == Action::Drop {
            // The inliers, then the round applied at once on their weighted mean, then the
            // outliers dropped (dropping them first would complete the round as a sum).
            for h in pushes.iter().filter(|h| !is_outlier(h)) {
                ctx.admit_push(h.id);
            }
            ctx.complete_aggregate(round);
            for h in pushes.iter().filter(|h| is_outlier(h)) {
                ctx.drop_push(h.id);
            }
        } else {
            // Every push at the mean's weight, an outlier's scaled down to the threshold.
            let (t, n) = (threshold.unwrap_or(f64::INFINITY), pushes.len() as f64);
            for h in pushes.iter() {
                let scale = if is_outlier(h) { t / f64::from(h.norm) } else { 1.0 };
                ctx.admit_push_weighted(h.id, (scale / n) as f32);
            }
        }
        ctx.metric("robust.rejected", f64::from(rejected));
        if let Some(t) = threshold {
            ctx.metric("robust.threshold", t);
        }
        true
    }
}

impl Policy for Robust {
    const INFO: PolicyInfo = PolicyInfo::new(
        "robust",
        env!("CARGO_PKG_VERSION"),
        "Synchronous rounds that drop or clip pushes whose norm exceeds median + k·MAD of the round's.",
        &[
            ParamSpec::new("k", ParamKind::Float, "3", "how many MADs above the median a norm may be (> 0)"),
            ParamSpec::new("action", ParamKind::Text, "drop", "what happens to an outlier: `drop` or `clip`"),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        let k: f64 = init.config.get("k")?;
        if !(k > 0.0 && k.is_finite()) {
            return Err(format!("k: {k} (a positive number of MADs)"));
        }
        let action = match init.config.text("action") {
            Some("drop") => Action::Drop,
            Some("clip") => Action::Clip,
            other => return Err(format!("action: `{}` (drop or clip)", other.unwrap_or(""))),
        };
        Ok(Robust { k, action, held: Vec::new(), round: Vec::new(), norms: Vec::new(), scratch: Vec::new() })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        PullVerdict::at_barrier(pull.clock, ctx.view())
    }

    fn on_push(&mut self, _ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        // A push the host measured no norm of (one held across an upgrade) counts as typical.
        let norm = push.signals.norm.unwrap_or(0.0);
        let before = self.held.iter().filter(|h| h.worker == push.worker).count() as u64;
        self.held.push(Held { id: push.id, worker: push.worker, round: push.clock + before, norm });
        PushVerdict::Hold
    }

    fn after_push(&mut self, ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {
        self.decide_complete_rounds(ctx, 0);
    }

    fn on_worker_left(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId, _reason: LeaveReason) {
        // The event's view still counts it. Its held push is in its round still: the round
        // may be decided now, with it. If not, the host applies it as the worker leaves (a
        // valid gradient), so it is no longer ours to decide.
        self.decide_complete_rounds(ctx, 1);
        self.held.retain(|h| h.worker != worker);
    }
}

syncopate_policy_sdk::export_policy!(Robust);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::optimizer::OptimizerConfig;
    use syncopate_policy_sdk::testing::Recorded;

    fn sgd() -> OptimizerConfig {
        OptimizerConfig { lr: 1.0, momentum: 0.0, ..OptimizerConfig::default() }
    }

    #[test]
    fn the_threshold_is_the_median_plus_k_mads() {
        let mut s = Vec::new();
        // Median 2, deviations 1, 0, 1, 98: MAD 1.
        assert_eq!(Robust::threshold(&[1.0, 2.0, 3.0, 100.0], 3.0, &mut s), Some(2.5 + 3.0 * 1.0));
        assert_eq!(Robust::threshold(&[1.0, 1.0, 1.0], 3.0, &mut s), None);
    }

    #[test]
    fn drops_an_outlier_and_steps_on_the_mean_of_the_rest() {
        let mut d = Driver::<Robust>::new(&[]).unwrap().with_optimizer(sgd(), vec![0.0; 2]);
        for w in 0..4 {
            d.join(w);
        }
        let grads = [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [400.0, 0.0]];
        for (w, g) in grads.iter().enumerate() {
            assert_eq!(d.push_gradient(w as u32, 0, g).unwrap(), PushVerdict::Hold);
        }
        assert!(d.log.contains(&Recorded::Dropped(4)));
        // One step on the mean of 1, 2 and 3, at learning rate 1.
        assert_eq!(d.params(), &[-2.0, 0.0]);
        assert_eq!(d.steps(), 1);
    }

    #[test]
    fn clips_an_outlier_to_the_threshold() {
        let mut d = Driver::<Robust>::new(&[("action", "clip")]).unwrap().with_optimizer(sgd(), vec![0.0; 1]);
        for w in 0..4 {
            d.join(w);
        }
        for (w, g) in [1.0f32, 2.0, 3.0, 400.0].iter().enumerate() {
            d.push_gradient(w as u32, 0, &[*g]).unwrap();
        }
        // Median 2.5, MAD 1: threshold 5.5; the step is the mean of 1, 2, 3 and 5.5.
        let p = d.params()[0];
        assert!((p + 11.5 / 4.0).abs() < 1e-5, "{p}");
    }

    #[test]
    fn a_round_completed_by_a_departure_is_decided() {
        let mut d = Driver::<Robust>::new(&[]).unwrap().with_optimizer(sgd(), vec![0.0; 1]);
        for w in 0..3 {
            d.join(w);
        }
        d.push_gradient(0, 0, &[1.0]).unwrap();
        d.push_gradient(1, 0, &[3.0]).unwrap();
        d.leave(2, LeaveReason::Failed);
        assert_eq!(d.params(), &[-2.0]);
        // A worker leaving with its push held: the round goes on without waiting for it.
        d.push_gradient(0, 1, &[1.0]).unwrap();
        d.leave(1, LeaveReason::Failed);
        assert_eq!(d.steps(), 2);
        assert!(Driver::<Robust>::new(&[("action", "keep")]).is_err());
        assert!(Driver::<Robust>::new(&[("k", "0")]).is_err());
    }
}
