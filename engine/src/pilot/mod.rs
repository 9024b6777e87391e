//! The cluster policy's machine: one sandboxed cluster policy module, run by the coordinator
//! (the host's, or the simulator's), on the cluster's figures at the cadence it sets.
//!
//! Pure, like the shard and the coordinator's machine: the driver asks [`Pilot::due`] when to
//! look next, gathers a [`ShardSample`] from every shard then, and hands them to
//! [`Pilot::observe`]; the machine turns them into
//! [`Figures`](syncopate_policy_sdk::cluster::Figures) ([`Sampler`]), calls the module, checks
//! its decisions and returns [`PilotAction`]s (a swap of the shard policy, to a built-in). The driver carries a swap out as an operator's would be (two-phase, every shard)
//! and reports its end with [`Pilot::swapped`]. Time comes from the driver only.
//!
//! **Misbehaviour.** A call that traps, runs out of fuel, panics or decides something invalid
//! (an unknown built-in, a second swap in one call, too many decisions) is a failure: it
//! decides nothing, is logged, and [`QUARANTINE_AFTER`] failures in a row quarantine the
//! module: it is called no more, and the cluster keeps the shard policy it runs, as if no
//! cluster policy were loaded. [`Pilot::status`] says so.
//!
//! **State.** The policy's own state ([`Pilot::export_state`]) goes into every checkpoint round
//! the coordinator takes, and a coordinator that resumes from one restores it
//! ([`Pilot::restore`]); a coordinator restarted without a checkpoint starts it afresh.
//!
//! Not done yet (issue 53): the machine is not replicated (the coordinator has no standby), its
//! calls are not recorded for replay, and the only decisions are the cadence, a swap to a
//! built-in and metrics (no parameter changes, quorums or batch sizes yet). `policy check`
//! explores cluster policies (`host/src/lab/explore_cluster.rs`).

mod figures;

use std::collections::VecDeque;

use syncopate_policy_sdk::abi::InitArgs;
use syncopate_policy_sdk::cluster::{
    self, ClusterDecision, ClusterEnvelope, ClusterEvent, DEFAULT_CADENCE_MS, MAX_CADENCE_MS,
    MAX_CLUSTER_DECISIONS, MIN_CADENCE_MS,
};

pub use figures::{Sampler, ShardSample, WorkerWork};

use crate::runtime::{PolicyError, PolicyInstance, PolicyModule};

/// Failures in a row that quarantine a cluster policy.
pub const QUARANTINE_AFTER: u32 = 3;

/// How many entries [`Pilot::status`] keeps in its log.
const LOG_KEPT: usize = 32;

/// What the driver must do for the cluster policy.
#[derive(Clone, Debug, PartialEq)]
pub enum PilotAction {
    /// Hot-swap every shard to built-in shard policy `policy` with `config`, then call
    /// [`Pilot::swapped`].
    Swap {
        /// The built-in's name (checked: [`crate::builtin::wasm`] has it).
        policy: String,
        /// Its configuration.
        config: Vec<(String, String)>,
        /// The policy's reason, for the operator.
        reason: String,
    },
}

/// One thing the cluster policy did or suffered, for `policy status` and the report.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PilotEntry {
    /// Host time.
    pub at_ns: u64,
    /// What happened, in words.
    pub what: String,
}

/// The cluster policy's state, for `policy status`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PilotStatus {
    /// How errors name the module (`cluster policy `autopilot` 0.1.0 (…)`).
    pub policy: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Its cadence.
    pub cadence_ms: u32,
    /// Whether it is quarantined.
    pub quarantined: bool,
    /// Swaps it asked for.
    pub swaps: u64,
    /// Its metrics, last values.
    pub metrics: Vec<(String, f64)>,
    /// The last things it did (swaps asked and their outcomes, failures), oldest first.
    pub log: Vec<PilotEntry>,
}

/// A cluster policy's machine.
pub struct Pilot {
    module: PolicyModule,
    config: Vec<(String, String)>,
    instance: PolicyInstance,
    sampler: Sampler,
    cadence_ms: u32,
    next_ns: u64,
    failures_in_a_row: u32,
    quarantined: bool,
    /// A swap asked for and not yet reported done.
    swapping: Option<String>,
    swaps: u64,
    metrics: Vec<(String, f64)>,
    log: VecDeque<PilotEntry>,
    calls: u64,
}

impl std::fmt::Debug for Pilot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pilot").field("module", &self.module).field("cadence_ms", &self.cadence_ms).finish()
    }
}

impl Pilot {
    /// Starts `module` (a cluster policy) with `config` on a cluster of `shards` shards at
    /// `now_ns`. Fails when the module is not a cluster policy, refuses its configuration, or
    /// fails at start-up.
    pub fn start(
        module: &PolicyModule,
        config: &[(String, String)],
        shards: u32,
        now_ns: u64,
    ) -> Result<Self, PolicyError> {
        Self::start_from(module, config, shards, now_ns, None)
    }

    /// As [`start`](Self::start), the policy created from the state an earlier instance of the
    /// same module exported ([`export_state`](Self::export_state), kept in a checkpoint): a
    /// coordinator that resumes goes on where its cluster policy was.
    pub fn restore(
        module: &PolicyModule,
        config: &[(String, String)],
        shards: u32,
        now_ns: u64,
        state: &[u8],
    ) -> Result<Self, PolicyError> {
        Self::start_from(module, config, shards, now_ns, Some(state))
    }

    /// The policy's state ([`ClusterPolicy::export_state`](syncopate_policy_sdk::cluster::ClusterPolicy::export_state)).
    pub fn export_state(&mut self) -> Result<Vec<u8>, PolicyError> {
        self.instance.export_state()
    }

    fn start_from(
        module: &PolicyModule,
        config: &[(String, String)],
        shards: u32,
        now_ns: u64,
        state: Option<&[u8]>,
    ) -> Result<Self, PolicyError> {
        let args = InitArgs {
            shard: 0,
            shards,
            now_ns,
            config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
        };
        let (instance, start) = match state {
            None => PolicyInstance::new_cluster(module, &args)?,
            Some(state) => {
                let info = module.info();
                let handoff = syncopate_policy_sdk::abi::Handoff {
                    from_name: &info.name,
                    from_version: &info.version,
                    state,
                    workers: Vec::new(),
                };
                PolicyInstance::import_cluster(module, &args, &handoff)?
            }
        };
        let mut pilot = Pilot {
            module: module.clone(),
            config: config.to_vec(),
            instance,
            sampler: Sampler::new(),
            cadence_ms: DEFAULT_CADENCE_MS,
            next_ns: 0,
            failures_in_a_row: 0,
            quarantined: false,
            swapping: None,
            swaps: 0,
            metrics: Vec::new(),
            log: VecDeque::new(),
            calls: 0,
        };
        let actions = pilot.decided(now_ns, &start, "its start")?;
        if !actions.is_empty() {
            return Err(PolicyError::BadDecision {
                policy: module.display_name().to_owned(),
                event: "its start".into(),
                detail: "a cluster policy cannot swap before it has seen the cluster".into(),
            });
        }
        pilot.next_ns = now_ns + pilot.cadence_ns();
        let how = if state.is_some() { "resumed from its checkpointed state" } else { "started" };
        pilot.note(now_ns, format!("{how}, every {} ms", pilot.cadence_ms));
        Ok(pilot)
    }

    /// When the driver should next gather samples and call [`observe`](Self::observe): `None`
    /// when the policy is quarantined, or while a swap it asked for is under way.
    pub fn due(&self) -> Option<u64> {
        (!self.quarantined && self.swapping.is_none()).then_some(self.next_ns)
    }

    /// The shards' samples at `now_ns`: the policy hears the cluster's figures and decides.
    pub fn observe(&mut self, now_ns: u64, samples: Vec<ShardSample>) -> Vec<PilotAction> {
        let figures = self.sampler.figures(now_ns, samples);
        self.next_ns = now_ns + self.cadence_ns();
        if self.due().is_none() {
            return Vec::new();
        }
        self.call(now_ns, ClusterEvent::Figures(figures), "the cluster's figures")
    }

    /// A swap the policy asked for ended: `Ok` when every shard runs `policy` now, or why not.
    pub fn swapped(&mut self, now_ns: u64, policy: &str, outcome: Result<(), String>) -> Vec<PilotAction> {
        self.swapping = None;
        let (ok, detail) = match &outcome {
            Ok(()) => (true, String::new()),
            Err(e) => (false, e.clone()),
        };
        self.note(
            now_ns,
            if ok { format!("swap to {policy} done") } else { format!("swap to {policy} failed: {detail}") },
        );
        // The figures start afresh under the new rule.
        self.sampler = Sampler::new();
        self.next_ns = now_ns + self.cadence_ns();
        if self.quarantined {
            return Vec::new();
        }
        self.call(now_ns, ClusterEvent::Swapped { policy: policy.to_owned(), ok, detail }, "a swap's outcome")
    }

    /// The policy's state, for `policy status`.
    pub fn status(&self) -> PilotStatus {
        PilotStatus {
            policy: self.module.display_name().to_owned(),
            config: self.config.clone(),
            cadence_ms: self.cadence_ms,
            quarantined: self.quarantined,
            swaps: self.swaps,
            metrics: self.metrics.clone(),
            log: self.log.iter().cloned().collect(),
        }
    }

    /// Whether it is quarantined (called no more).
    pub fn is_quarantined(&self) -> bool {
        self.quarantined
    }

    /// How often it looks at the cluster, in milliseconds.
    pub fn cadence_ms(&self) -> u32 {
        self.cadence_ms
    }

    /// The shard policy of the swap it asked for, while that swap is under way.
    pub fn swapping(&self) -> Option<&str> {
        self.swapping.as_deref()
    }

    /// The module it runs.
    pub fn module(&self) -> &PolicyModule {
        &self.module
    }

    fn cadence_ns(&self) -> u64 {
        u64::from(self.cadence_ms) * 1_000_000
    }

    fn call(&mut self, now_ns: u64, event: ClusterEvent, what: &str) -> Vec<PilotAction> {
        self.calls += 1;
        let env = ClusterEnvelope { now_ns, random: self.calls, event };
        let bytes = syncopate_policy_sdk::guest::encode(&env);
        let result =
            self.instance.on_cluster_event(&bytes, what).and_then(|reply| self.decided(now_ns, &reply, what));
        match result {
            Ok(actions) => {
                self.failures_in_a_row = 0;
                actions
            }
            Err(e) => {
                self.failures_in_a_row += 1;
                tracing::warn!(failures = self.failures_in_a_row, "cluster policy failed: {e}");
                self.note(now_ns, format!("failed: {e}"));
                if self.failures_in_a_row >= QUARANTINE_AFTER {
                    self.quarantined = true;
                    self.note(
                        now_ns,
                        format!("quarantined after {QUARANTINE_AFTER} failures in a row; the cluster keeps its policy"),
                    );
                    tracing::error!("cluster policy quarantined after {QUARANTINE_AFTER} failures in a row");
                }
                Vec::new()
            }
        }
    }

    /// Checks and applies the decisions in `reply`; the swaps become actions. Nothing applies
    /// when any decision is invalid.
    fn decided(&mut self, now_ns: u64, reply: &[u8], what: &str) -> Result<Vec<PilotAction>, PolicyError> {
        let bad = |detail: String| PolicyError::BadDecision {
            policy: self.module.display_name().to_owned(),
            event: what.to_owned(),
            detail,
        };
        // Decoded one at a time, so a module that answers with a flood is refused at the first
        // decision past the bound, not after all of them were decoded.
        let mut decisions = Vec::new();
        for d in cluster::decisions(reply) {
            if decisions.len() == MAX_CLUSTER_DECISIONS {
                return Err(bad(format!("more than {MAX_CLUSTER_DECISIONS} decisions in one call")));
            }
            decisions.push(d.map_err(|e| bad(format!("undecodable decisions: {e}")))?);
        }
        let mut cadence = None;
        let mut swap = None;
        let mut metrics = Vec::new();
        for d in decisions {
            match d {
                ClusterDecision::SetCadence { ms } => {
                    if !(MIN_CADENCE_MS..=MAX_CADENCE_MS).contains(&ms) {
                        return Err(bad(format!(
                            "a cadence of {ms} ms (from {MIN_CADENCE_MS} to {MAX_CADENCE_MS})"
                        )));
                    }
                    cadence = Some(ms);
                }
                ClusterDecision::Swap { policy, config, reason } => {
                    if swap.is_some() {
                        return Err(bad("two swaps in one call".into()));
                    }
                    if crate::builtin::wasm(&policy).is_none() {
                        let known: Vec<_> = crate::builtin::names().collect();
                        return Err(bad(format!(
                            "a swap to `{}`, which is not a built-in shard policy (known: {})",
                            policy.chars().take(64).collect::<String>(),
                            known.join(", ")
                        )));
                    }
                    if config.len() > 64
                        || config.iter().any(|(k, v)| k.len() + v.len() > 1024)
                        || reason.len() > 4096
                    {
                        return Err(bad("a swap with an oversized configuration or reason".into()));
                    }
                    swap = Some(PilotAction::Swap { policy, config, reason });
                }
                ClusterDecision::Metric { name, value } => {
                    if name.len() > 128 {
                        return Err(bad("a metric name over 128 bytes".into()));
                    }
                    metrics.push((name, value));
                }
            }
        }
        if let Some(ms) = cadence {
            self.cadence_ms = ms;
        }
        for (name, value) in metrics {
            match self.metrics.iter().position(|m| m.0 == name) {
                Some(i) => self.metrics[i].1 = value,
                None if self.metrics.len() < 64 => self.metrics.push((name, value)),
                None => {}
            }
        }
        if let Some(PilotAction::Swap { policy, config, reason }) = &swap {
            self.swaps += 1;
            self.swapping = Some(policy.clone());
            let cfg: Vec<String> = config.iter().map(|(k, v)| format!("{k}={v}")).collect();
            self.note(
                now_ns,
                format!(
                    "swap to {policy}{}{}: {reason}",
                    if cfg.is_empty() { "" } else { ":" },
                    cfg.join(",")
                ),
            );
        }
        Ok(swap.into_iter().collect())
    }

    fn note(&mut self, at_ns: u64, what: String) {
        tracing::info!(t_ns = at_ns, "cluster policy: {what}");
        if self.log.len() == LOG_KEPT {
            self.log.pop_front();
        }
        self.log.push_back(PilotEntry { at_ns, what });
    }
}

#[cfg(test)]
mod tests;
