//! Pulls gated on rounds the policy completes itself: the gate of rules that finish a round
//! without everyone (backup workers, deadlines), where the host's minimum-clock release does not
//! apply because a round can be complete before every worker has pushed to it.

use alloc::vec::Vec;

use crate::abi::{Pull, Release, RequestId, WorkerId};
use crate::{Ctx, PullVerdict};

/// The pulls waiting for a round to complete. A pull before computing round `r` (its worker's
/// clock `r`) is served once rounds `0..r` are complete, else parked until the policy says
/// they are ([`completed`](Self::completed)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundGate {
    /// (pull, its worker, the round it waits for).
    waiting: Vec<(RequestId, WorkerId, u64)>,
}

impl RoundGate {
    /// The verdict on `pull` when rounds below `complete` are complete: serve, or park it.
    pub fn pull(&mut self, pull: &Pull, complete: u64) -> PullVerdict {
        if pull.clock <= complete {
            return PullVerdict::Serve;
        }
        self.waiting.push((pull.id, pull.worker, pull.clock - 1));
        PullVerdict::Defer(Release::Explicit)
    }

    /// Rounds below `complete` are now complete: releases the pulls that waited for them.
    pub fn completed(&mut self, ctx: &mut Ctx<'_>, complete: u64) {
        self.waiting.retain(|&(pull, _, wants)| {
            let ready = wants < complete;
            if ready {
                ctx.release_pull(pull);
            }
            !ready
        });
    }

    /// `worker` left: the host drops its parked pulls, so there is nothing to release.
    pub fn forget(&mut self, worker: WorkerId) {
        self.waiting.retain(|w| w.1 != worker);
    }
}
