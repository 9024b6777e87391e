//! Keeps a shard's policy instance alive: periodic state checkpoints, restart from the last
//! checkpoint after a failure, quarantine after repeated failures, and hot swaps.
//!
//! Recovery and swap are one mechanism: a new instance is created with
//! [`PolicyInstance::import`] from a [`Handoff`] (the old instance's state for a swap, the last
//! checkpoint for a recovery), and the shard then hands every pending request to it again as a
//! fresh event. A module that keeps failing (`max_consecutive_failures` in a row on one kind of
//! event) is quarantined: the shard stops calling it and applies its fallback rules until an
//! operator swaps in another.
//!
//! Failures are counted per kind of event (pushes, pulls, timers, ...), and only a success on a
//! fresh event of the same kind clears a kind's count: a module that fails on every push is
//! quarantined after `max_consecutive_failures` pushes however many pulls it answers in between.

use syncopate_policy_sdk::abi::{Envelope, Handoff, InitArgs, WorkerClock};
use syncopate_policy_sdk::clocks::Clocks;

use crate::runtime::{PolicyError, PolicyInstance, PolicyModule};

/// How a shard supervises its policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// Events between state checkpoints.
    pub checkpoint_every: u32,
    /// Whether the interval stretches to the number of live workers when there are more. A
    /// checkpoint copies every worker's clock (and a policy's state usually grows with the
    /// workers too), so a fixed interval costs O(workers) per event on a large cluster; stretched,
    /// the cost per event stays O(1). Recovery then replays from further back, which changes
    /// nothing for the requests (all pending ones are handed over again) and loses only policy
    /// bookkeeping since the checkpoint, as it always could. On by default.
    pub checkpoint_scales: bool,
    /// Failures in a row on one kind of event after which the module is quarantined.
    pub max_consecutive_failures: u32,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig { checkpoint_every: 256, checkpoint_scales: true, max_consecutive_failures: 3 }
    }
}

/// What happened after a failure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Recovery {
    /// A fresh instance runs from the last checkpoint.
    Restarted,
    /// The module failed too often (or cannot even restart): no more calls until a swap.
    Quarantined(Option<PolicyError>),
}

pub(crate) struct Supervisor {
    cfg: SupervisorConfig,
    shard: u32,
    shards: u32,
    module: PolicyModule,
    config: Vec<(String, String)>,
    instance: Option<PolicyInstance>,
    checkpoint: Vec<u8>,
    checkpoint_workers: Vec<WorkerClock>,
    since_checkpoint: u32,
    /// Per event kind ([`EventKind`]): failures since the last fresh success of that kind.
    failures_in_a_row: [u32; EventKind::COUNT],
}

/// What a policy call was about, for counting failures by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    Joined,
    Left,
    Push,
    Pull,
    Finished,
    Timer,
    ControlApplied,
    /// Start-up decisions (after a swap).
    Start,
}

impl EventKind {
    const COUNT: usize = 8;

    pub(crate) fn of(event: &syncopate_policy_sdk::abi::Event) -> Self {
        use syncopate_policy_sdk::abi::Event;
        match event {
            Event::WorkerJoined { .. } => EventKind::Joined,
            Event::WorkerLeft { .. } => EventKind::Left,
            Event::Push(_) => EventKind::Push,
            Event::Pull(_) => EventKind::Pull,
            Event::IterationFinished(_) => EventKind::Finished,
            Event::Timer { .. } => EventKind::Timer,
            Event::ControlApplied(_) => EventKind::ControlApplied,
        }
    }
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("module", &self.module)
            .field("quarantined", &self.instance.is_none())
            .finish_non_exhaustive()
    }
}

fn init_args<'a>(shard: u32, shards: u32, now_ns: u64, config: &'a [(String, String)]) -> InitArgs<'a> {
    InitArgs { shard, shards, now_ns, config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect() }
}

impl Supervisor {
    /// Creates the first instance. Returns the supervisor and the start-up decisions.
    pub(crate) fn start(
        cfg: SupervisorConfig,
        shard: u32,
        shards: u32,
        module: &PolicyModule,
        config: &[(String, String)],
    ) -> Result<(Self, Vec<u8>), PolicyError> {
        let (mut instance, start) = PolicyInstance::new(module, &init_args(shard, shards, 0, config))?;
        let checkpoint = instance.export_state()?;
        let sup = Supervisor {
            cfg,
            shard,
            shards,
            module: module.clone(),
            config: config.to_vec(),
            instance: Some(instance),
            checkpoint,
            checkpoint_workers: Vec::new(),
            since_checkpoint: 0,
            failures_in_a_row: [0; EventKind::COUNT],
        };
        Ok((sup, start))
    }

    /// The running instance's state as of now (the last checkpoint when quarantined), and
    /// whether the module is quarantined: what a shard snapshot keeps of its policy.
    pub(crate) fn snapshot(&mut self) -> Result<(Vec<u8>, bool), PolicyError> {
        match self.instance.as_mut() {
            Some(instance) => Ok((instance.export_state()?, false)),
            None => Ok((self.checkpoint.clone(), true)),
        }
    }

    /// A supervisor whose instance continues from `state`, exported by the same module from a
    /// shard whose live workers were `workers` (a snapshot being restored). The module's
    /// start-up decisions are not returned: the shard's mode and timers come from the snapshot.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn restore(
        cfg: SupervisorConfig,
        shard: u32,
        shards: u32,
        module: &PolicyModule,
        config: &[(String, String)],
        state: Vec<u8>,
        workers: Vec<WorkerClock>,
        quarantined: bool,
        now_ns: u64,
    ) -> Result<Self, PolicyError> {
        let mut sup = Supervisor {
            cfg,
            shard,
            shards,
            module: module.clone(),
            config: config.to_vec(),
            instance: None,
            checkpoint: state,
            checkpoint_workers: workers,
            since_checkpoint: 0,
            failures_in_a_row: [0; EventKind::COUNT],
        };
        if !quarantined {
            sup.instance = Some(sup.restart(now_ns)?);
        }
        Ok(sup)
    }

    /// A fresh instance of the module, importing its own last checkpoint: a recovery's and a
    /// restore's. Its start-up decisions are dropped: the shard's mode and timers are still in
    /// force.
    fn restart(&self, now_ns: u64) -> Result<PolicyInstance, PolicyError> {
        let info = self.module.info();
        let handoff = Handoff {
            from_name: &info.name,
            from_version: &info.version,
            state: &self.checkpoint,
            workers: self.checkpoint_workers.clone(),
        };
        let args = init_args(self.shard, self.shards, now_ns, &self.config);
        PolicyInstance::import(&self.module, &args, &handoff).map(|(instance, _start)| instance)
    }

    pub(crate) fn module(&self) -> &PolicyModule {
        &self.module
    }

    pub(crate) fn shards(&self) -> u32 {
        self.shards
    }

    pub(crate) fn config(&self) -> &[(String, String)] {
        &self.config
    }

    pub(crate) fn is_quarantined(&self) -> bool {
        self.instance.is_none()
    }

    /// Calls the instance; `None` when quarantined.
    pub(crate) fn call(&mut self, env: &Envelope) -> Option<Result<&[u8], PolicyError>> {
        Some(self.instance.as_mut()?.on_event(env))
    }

    /// Records a successful event of `kind`; checkpoints every `checkpoint_every` events (or
    /// every `clocks.view().workers`, if more and [`SupervisorConfig::checkpoint_scales`]). Only
    /// a `fresh` event (not one handed over again after a recovery) clears its kind's failure
    /// count: otherwise a module that fails every few events could restart forever on its own
    /// re-deliveries.
    pub(crate) fn succeeded(
        &mut self,
        kind: EventKind,
        fresh: bool,
        clocks: &Clocks,
    ) -> Result<(), PolicyError> {
        if fresh {
            self.failures_in_a_row[kind as usize] = 0;
        }
        self.since_checkpoint += 1;
        let every = match self.cfg.checkpoint_scales {
            true => self.cfg.checkpoint_every.max(clocks.view().workers),
            false => self.cfg.checkpoint_every,
        };
        if self.since_checkpoint >= every {
            self.since_checkpoint = 0;
            if let Some(instance) = self.instance.as_mut() {
                self.checkpoint = instance.export_state()?;
                self.checkpoint_workers.clear();
                self.checkpoint_workers.extend(clocks.workers());
            }
        }
        Ok(())
    }

    /// After a failure on an event of `kind`: restart from the last checkpoint, or quarantine.
    pub(crate) fn failed(&mut self, kind: EventKind, now_ns: u64) -> Recovery {
        let count = &mut self.failures_in_a_row[kind as usize];
        *count += 1;
        let count = *count;
        self.instance = None;
        if count >= self.cfg.max_consecutive_failures {
            return Recovery::Quarantined(None);
        }
        match self.restart(now_ns) {
            Ok(instance) => {
                self.instance = Some(instance);
                self.since_checkpoint = 0;
                Recovery::Restarted
            }
            Err(e) => Recovery::Quarantined(Some(e)),
        }
    }

    /// Replaces the running policy with `module`. On error nothing changes.
    pub(crate) fn swap(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
        now_ns: u64,
    ) -> Result<Vec<u8>, PolicyError> {
        let state = match self.instance.as_mut() {
            Some(old) => old.export_state().unwrap_or_else(|_| self.checkpoint.clone()),
            None => self.checkpoint.clone(),
        };
        let old = self.module.info();
        let handoff = Handoff {
            from_name: &old.name,
            from_version: &old.version,
            state: &state,
            workers: workers.clone(),
        };
        let (mut instance, start) =
            PolicyInstance::import(module, &init_args(self.shard, self.shards, now_ns, config), &handoff)?;
        self.checkpoint = instance.export_state()?;
        self.checkpoint_workers = workers;
        self.instance = Some(instance);
        self.module = module.clone();
        self.config = config.to_vec();
        self.since_checkpoint = 0;
        self.failures_in_a_row = [0; EventKind::COUNT];
        Ok(start)
    }
}
