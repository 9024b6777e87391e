//! `policy check` for cluster policies: generated clusters, run through the coordinator's own
//! pilot machine ([`Pilot`]), with the real module.
//!
//! Each case draws a cluster (1 to 16 workers, 1 to 4 shards) and a run of windows in which
//! conditions change: every worker alike, one straggler, many slow workers, workers that report
//! no compute time, workers joining and leaving, a shard quarantined. The running shard policy
//! follows the swaps the module asks for; one swap in five fails (as a refused swap does). The
//! rule a cluster policy must keep: no call fails (trap, fuel, panic, an invalid decision such
//! as a swap to a policy that is not built in or two in one call), so the machine is never
//! quarantined. The first case that breaks it is the error, with its seed.

use syncopate_engine::pilot::{Pilot, PilotAction, ShardSample, WorkerWork};

use super::explore::Rng;
use crate::runtime::PolicyModule;

/// What the generated cases did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ClusterExplored {
    /// Cases run.
    pub cases: u32,
    /// Windows handed to the module.
    pub windows: u64,
    /// Swaps it asked for.
    pub swaps: u64,
}

/// A case that broke the rule.
#[derive(Debug, thiserror::Error)]
#[error("case {seed} ({workers} workers, {shards} shards), window {window}: {why}")]
pub struct ClusterBroken {
    /// The case's seed (`policy check --seed`).
    pub seed: u64,
    /// Its workers.
    pub workers: u32,
    /// Its shards.
    pub shards: u32,
    /// The window it broke in.
    pub window: u64,
    /// What went wrong: the pilot's log of the failure.
    pub why: String,
}

/// Runs `cases` generated clusters through `module` with `config`, from `seed`.
pub fn explore_cluster(
    module: &PolicyModule,
    config: &[(String, String)],
    seed: u64,
    cases: u32,
) -> Result<ClusterExplored, Box<ClusterBroken>> {
    let mut out = ClusterExplored::default();
    for k in 0..cases {
        let case_seed = seed.wrapping_add(u64::from(k));
        let (windows, swaps) = run_case(module, config, case_seed)?;
        out.cases += 1;
        out.windows += windows;
        out.swaps += swaps;
    }
    Ok(out)
}

/// A worker as the case models it: its speed now and its counters so far.
#[derive(Clone, Copy)]
struct Member {
    worker: u32,
    present: bool,
    step_ns: u64,
    clock: u64,
    worked_ns: u64,
    pushes: u64,
    waited_ns: u64,
}

const BUILTINS: [&str; 4] = ["bsp", "ssp", "adaptive-deadline", "asp"];

fn run_case(
    module: &PolicyModule,
    config: &[(String, String)],
    seed: u64,
) -> Result<(u64, u64), Box<ClusterBroken>> {
    let mut rng = Rng(seed);
    let workers = 1 + rng.below(16) as u32;
    let shards = 1 + rng.below(4) as u32;
    let windows = 20 + rng.below(41);
    let broken = |window: u64, why: String| Box::new(ClusterBroken { seed, workers, shards, window, why });
    let mut pilot = Pilot::start(module, config, shards, 0).map_err(|e| broken(0, e.to_string()))?;
    let mut members: Vec<Member> = (0..workers)
        .map(|worker| Member {
            worker,
            present: true,
            step_ns: 100_000_000,
            clock: 0,
            worked_ns: 0,
            pushes: 0,
            waited_ns: 0,
        })
        .collect();
    let mut running = BUILTINS[rng.below(BUILTINS.len() as u64) as usize].to_string();
    let mut now = 0u64;
    let mut swaps = 0;
    for window in 0..windows {
        // Conditions change now and then.
        if window == 0 || rng.below(5) == 0 {
            let base = 20_000_000 + rng.below(200_000_000);
            let regime = rng.below(5);
            for (i, m) in members.iter_mut().enumerate() {
                m.step_ns = match regime {
                    0 => base,
                    1 if i == 0 => base * (2 + rng.below(8)),
                    2 if i % 2 == 0 => base * (2 + rng.below(4)),
                    3 => base + rng.below(base),
                    4 if rng.below(3) == 0 => 0,
                    _ => base,
                };
            }
        }
        if workers > 1 && rng.below(8) == 0 {
            let m = &mut members[rng.below(u64::from(workers)) as usize];
            m.present = !m.present;
            if m.present {
                (m.clock, m.worked_ns, m.pushes, m.waited_ns) = (0, 0, 0, 0);
            }
        }
        let Some(due) = pilot.due() else {
            return Err(broken(window, format!("the pilot stopped: {:?}", pilot.status().log)));
        };
        let elapsed = due.saturating_sub(now).max(1);
        now = due;
        let slowest = members.iter().filter(|m| m.present).map(|m| m.step_ns).max().unwrap_or(1).max(1);
        for m in members.iter_mut().filter(|m| m.present) {
            let iterations = elapsed / m.step_ns.max(1).max(slowest / 4);
            m.clock += iterations;
            if m.step_ns > 0 {
                m.worked_ns += iterations * m.step_ns;
                m.pushes += iterations;
            }
            m.waited_ns += rng.below(elapsed / 2 + 1);
        }
        let quarantined = rng.below(20) == 0;
        let samples: Vec<ShardSample> = (0..shards)
            .map(|shard| ShardSample {
                shard,
                policy: running.clone(),
                config: Vec::new(),
                work: members
                    .iter()
                    .filter(|m| m.present)
                    .map(|m| WorkerWork {
                        worker: m.worker,
                        clock: m.clock,
                        step_ns: m.worked_ns,
                        pushes: m.pushes,
                        loss: Some(2.0 / (1.0 + m.clock as f32)),
                        waited_ns: m.waited_ns,
                    })
                    .collect(),
                parked: rng.below(u64::from(workers)) as u32,
                held: rng.below(u64::from(workers)) as u32,
                pushes: members.iter().map(|m| m.pushes).sum(),
                failures: u64::from(quarantined),
                quarantined: quarantined && shard == 0,
                metrics: Vec::new(),
            })
            .collect();
        for action in pilot.observe(now, samples) {
            let PilotAction::Swap { policy, .. } = action;
            swaps += 1;
            now += 1_000_000;
            let outcome = if rng.below(5) == 0 { Err("refused by a server".to_string()) } else { Ok(()) };
            if outcome.is_ok() {
                running = policy.clone();
            }
            pilot.swapped(now, &policy, outcome);
        }
        let st = pilot.status();
        if let Some(failed) = st.log.iter().find(|e| e.what.starts_with("failed")) {
            return Err(broken(window, failed.what.clone()));
        }
    }
    Ok((windows, swaps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_autopilot_keeps_the_rules_and_swaps_in_generated_clusters() {
        let rt = crate::runtime::PolicyRuntime::new().unwrap();
        let m =
            rt.compile("autopilot", syncopate_engine::builtin::cluster_wasm("autopilot").unwrap()).unwrap();
        let out = explore_cluster(&m, &[("confirm".into(), "1".into())], 7, 24).unwrap();
        assert_eq!(out.cases, 24);
        assert!(out.swaps > 10, "conditions changed and it followed them: {out:?}");
    }
}
