//! Keeps a shard's policy instance alive: periodic state checkpoints, restart from the last
//! checkpoint after a failure, backoff and quarantine when failures repeat, and hot swaps.
//!
//! Recovery and swap are one mechanism: a new instance is created with
//! [`PolicyInstance::import`] from a [`Handoff`] (the old instance's state for a swap, the last
//! checkpoint for a recovery), and the shard then hands every pending request to it again as a
//! fresh event.
//!
//! When a module is given up on (quarantined: the shard stops calling it and applies its
//! fallback rules until an operator swaps in another) is decided by three rules, each counted
//! across restarts:
//! - **failures in a row on one kind of event** (pushes, pulls, timers, ...): only a success on
//!   a fresh event of the same kind clears a kind's count, so a module that fails on every push
//!   is quarantined after `max_consecutive_failures` pushes however many pulls it answers in
//!   between;
//! - **a crash loop** ([`CrashLoop`], after proxy-wasm's and Envoy's reload backoff): a module
//!   that fails now and then, with successes in between, is restarted at once the first time;
//!   each further failure within the window keeps it out for a backoff that doubles (1 s, 2 s,
//!   4 s, ...: the shard runs on the fallback rules meanwhile), and the
//!   [`CrashLoop::failures`]th within the window quarantines it;
//! - **stalls** ([`SupervisorConfig::no_progress_ns`]): a rule under which every live worker
//!   waited for the no-progress time is a failure too; [`CrashLoop::stalls`] of them within ten
//!   no-progress times quarantine it.
//!
//! A swap starts the new module with a clean record. The record (the [`Health`]) is part of a
//! shard's snapshot, so a restored shard, and a backup started from a snapshot, count on.

use std::collections::VecDeque;

use syncopate_policy_sdk::abi::{Envelope, Handoff, InitArgs, WorkerClock};
use syncopate_policy_sdk::clocks::Clocks;

use crate::runtime::{PolicyError, PolicyInstance, PolicyModule, PolicyUsage};

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
    /// How long every live worker of the shard may wait on the policy's decisions (a parked pull
    /// or a held push each) before that counts as the rule's failure, in nanoseconds of the
    /// driver's time; 0 turns the rule off. A rule that parks every pull or holds every push
    /// and never lets go would otherwise stall the run for ever: instead every stuck request is
    /// resolved by the fallback rules (held pushes admitted, parked pulls put under BSP's rule),
    /// the failure is reported with what was stuck, and the policy is restarted (or backed off,
    /// or quarantined, as for any failure). A worker that is computing, or waits for another
    /// shard, is not waiting on this one: a straggler or a long local round never trips it.
    /// Default [`DEFAULT_NO_PROGRESS_NS`].
    pub no_progress_ns: u64,
    /// When repeated failures back off and quarantine.
    pub crash_loop: CrashLoop,
}

/// The no-progress time a shard has unless told otherwise: 30 s, three peer timeouts, so that a
/// worker that died while it waited has been dropped (and its requests with it) long before.
pub const DEFAULT_NO_PROGRESS_NS: u64 = 30_000_000_000;

/// The crash-loop rule: restarts back off, and a module that keeps failing is quarantined
/// (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrashLoop {
    /// Failures within `window_ns` that quarantine the module.
    pub failures: u32,
    /// How far back failures count, in nanoseconds.
    pub window_ns: u64,
    /// The restart delay after the second failure within the window; it doubles with each
    /// further one (0: every restart at once).
    pub backoff_ns: u64,
    /// The longest restart delay.
    pub max_backoff_ns: u64,
    /// Stalls within ten no-progress times that quarantine the module.
    pub stalls: u32,
}

impl Default for CrashLoop {
    fn default() -> Self {
        CrashLoop {
            failures: 5,
            window_ns: 60_000_000_000,
            backoff_ns: 1_000_000_000,
            max_backoff_ns: 30_000_000_000,
            stalls: 3,
        }
    }
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            checkpoint_every: 256,
            checkpoint_scales: true,
            max_consecutive_failures: 3,
            no_progress_ns: DEFAULT_NO_PROGRESS_NS,
            crash_loop: CrashLoop::default(),
        }
    }
}

/// A module's record of failures on a shard, counted across restarts (module docs): kept in
/// snapshots.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Health {
    /// Per event kind ([`EventKind`]): failures since the last fresh success of that kind.
    in_a_row: Vec<u32>,
    /// When the failures within the crash-loop window happened, oldest first.
    recent: VecDeque<u64>,
    /// When the stalls within ten no-progress times happened, oldest first.
    stalls: VecDeque<u64>,
    /// Restarted not before this time (a crash loop's backoff): until then the shard runs on
    /// the fallback rules.
    backoff_until: Option<u64>,
    /// Failures of the running module since it started (its swap, or the shard's start).
    failures: u64,
}

impl Health {
    fn in_a_row(&mut self, kind: EventKind) -> &mut u32 {
        if self.in_a_row.len() < EventKind::COUNT {
            self.in_a_row.resize(EventKind::COUNT, 0);
        }
        &mut self.in_a_row[kind as usize]
    }
}

/// What happened after a failure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Recovery {
    /// A fresh instance runs from the last checkpoint.
    Restarted,
    /// A crash loop: a fresh instance runs from the last checkpoint once the shard's time has
    /// reached `until` ([`Supervisor::resume`]); the fallback rules apply meanwhile.
    BackingOff {
        /// When the restart is due.
        until: u64,
    },
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
    health: Health,
    /// Set once the module is given up on: it stays out until a swap, whatever the backoff.
    quarantined: bool,
    /// What the instances gone before the running one cost (restarted, swapped out), since
    /// this supervisor started: with the running one's, the shard's policy calls and fuel.
    retired: PolicyUsage,
    /// Restarts after a failure (from the last checkpoint, at once or after a backoff), since
    /// this supervisor started.
    restarts: u64,
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
    /// No decision for the no-progress time (not a call: [`SupervisorConfig::no_progress_ns`]).
    Stall,
    /// The answer to a measure (ABI v3; last, as the record's counts are by position).
    Measured,
}

impl EventKind {
    const COUNT: usize = 10;

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
            Event::Measured { .. } => EventKind::Measured,
        }
    }
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("module", &self.module)
            .field("quarantined", &self.quarantined)
            .field("health", &self.health)
            .finish_non_exhaustive()
    }
}

fn init_args<'a>(shard: u32, shards: u32, now_ns: u64, config: &'a [(String, String)]) -> InitArgs<'a> {
    InitArgs { shard, shards, now_ns, config: config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect() }
}

/// What a shard's snapshot kept of its policy, for [`Supervisor::restore`].
pub(crate) struct Kept {
    /// The policy's exported state.
    pub(crate) state: Vec<u8>,
    /// The live workers when it was exported.
    pub(crate) workers: Vec<WorkerClock>,
    /// Whether the module was quarantined.
    pub(crate) quarantined: bool,
    /// The module's record.
    pub(crate) health: Health,
    /// The snapshot's time.
    pub(crate) now_ns: u64,
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
            health: Health::default(),
            quarantined: false,
            retired: PolicyUsage::default(),
            restarts: 0,
        };
        Ok((sup, start))
    }

    /// The running instance's state as of now (the last checkpoint when it is not running),
    /// whether the module is quarantined, and its record of failures: what a shard snapshot
    /// keeps of its policy.
    pub(crate) fn snapshot(&mut self) -> Result<(Vec<u8>, bool, Health), PolicyError> {
        let health = self.health.clone();
        match self.instance.as_mut() {
            Some(instance) => Ok((instance.export_state()?, false, health)),
            None => Ok((self.checkpoint.clone(), self.quarantined, health)),
        }
    }

    /// A supervisor whose instance continues from what a snapshot `kept` of the policy (its
    /// state, exported by the same module from a shard whose live workers were the ones it
    /// names, and the module's record). The module's start-up decisions are not returned: the
    /// shard's mode and timers come from the snapshot. A module backing off at the snapshot
    /// waits out its backoff before it runs.
    pub(crate) fn restore(
        cfg: SupervisorConfig,
        (shard, shards): (u32, u32),
        module: &PolicyModule,
        config: &[(String, String)],
        kept: Kept,
    ) -> Result<Self, PolicyError> {
        let Kept { state, workers, quarantined, health, now_ns } = kept;
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
            health,
            quarantined,
            retired: PolicyUsage::default(),
            restarts: 0,
        };
        if !quarantined && sup.health.backoff_until.is_none() {
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

    /// Charges the running instance's next event `fuel` (the host's measures it answers).
    pub(crate) fn charge(&mut self, fuel: u64) {
        if let Some(instance) = self.instance.as_mut() {
            instance.charge(fuel);
        }
    }

    pub(crate) fn shards(&self) -> u32 {
        self.shards
    }

    pub(crate) fn config(&self) -> &[(String, String)] {
        &self.config
    }

    pub(crate) fn cfg(&self) -> &SupervisorConfig {
        &self.cfg
    }

    /// Whether the module is quarantined (given up on until a swap).
    pub(crate) fn is_quarantined(&self) -> bool {
        self.quarantined
    }

    /// Whether an instance is running (not quarantined, not backing off).
    pub(crate) fn is_running(&self) -> bool {
        self.instance.is_some()
    }

    /// Until when a crash loop keeps the module out, if it does.
    pub(crate) fn backoff_until(&self) -> Option<u64> {
        self.health.backoff_until.filter(|_| !self.quarantined)
    }

    /// Failures of the running module since it started.
    pub(crate) fn failures(&self) -> u64 {
        self.health.failures
    }

    /// Stops the running instance, if any, keeping what it cost.
    fn retire(&mut self) {
        if let Some(gone) = self.instance.take() {
            self.retired = self.retired + gone.usage();
        }
    }

    /// Restarts after failures so far.
    pub(crate) fn restarts(&self) -> u64 {
        self.restarts
    }

    /// The policy calls and fuel of every instance this supervisor ran.
    pub(crate) fn usage(&self) -> PolicyUsage {
        self.retired + self.instance.as_ref().map(PolicyInstance::usage).unwrap_or_default()
    }

    /// Calls the instance; `None` when none runs (quarantined, or backing off).
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
            *self.health.in_a_row(kind) = 0;
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

    /// After a failure on an event of `kind` (or a stall) at `now_ns`: restart from the last
    /// checkpoint, back off, or quarantine (module docs).
    pub(crate) fn failed(&mut self, kind: EventKind, now_ns: u64) -> Recovery {
        self.retire();
        let cl = self.cfg.crash_loop;
        let h = &mut self.health;
        h.failures += 1;
        let in_a_row = {
            let count = h.in_a_row(kind);
            *count += 1;
            *count
        };
        h.recent.push_back(now_ns);
        while h.recent.front().is_some_and(|&t| t.saturating_add(cl.window_ns) <= now_ns) {
            h.recent.pop_front();
        }
        if kind == EventKind::Stall {
            let window = self.cfg.no_progress_ns.saturating_mul(10);
            h.stalls.push_back(now_ns);
            while h.stalls.front().is_some_and(|&t| t.saturating_add(window) <= now_ns) {
                h.stalls.pop_front();
            }
        }
        let recent = h.recent.len() as u32;
        if in_a_row >= self.cfg.max_consecutive_failures
            || recent >= cl.failures.max(1)
            || (kind == EventKind::Stall && h.stalls.len() as u32 >= cl.stalls.max(1))
        {
            return self.quarantine(None);
        }
        // Failures in a row go to their rule's quick quarantine; a failure after successes of
        // its kind (a crash loop) waits out its backoff.
        if recent >= 2 && in_a_row == 1 && cl.backoff_ns > 0 {
            let doubled = cl.backoff_ns.saturating_mul(1u64 << (recent - 2).min(32));
            let until = now_ns.saturating_add(doubled.min(cl.max_backoff_ns));
            h.backoff_until = Some(until);
            return Recovery::BackingOff { until };
        }
        match self.restart(now_ns) {
            Ok(instance) => {
                self.instance = Some(instance);
                self.since_checkpoint = 0;
                self.restarts += 1;
                Recovery::Restarted
            }
            Err(e) => self.quarantine(Some(e)),
        }
    }

    fn quarantine(&mut self, cause: Option<PolicyError>) -> Recovery {
        self.quarantined = true;
        self.health.backoff_until = None;
        Recovery::Quarantined(cause)
    }

    /// Restarts a module whose backoff is over at `now_ns`: `None` if none was due, else
    /// whether it runs again (a module that cannot even restart is quarantined).
    pub(crate) fn resume(&mut self, now_ns: u64) -> Option<Result<(), PolicyError>> {
        let until = self.backoff_until()?;
        if until > now_ns {
            return None;
        }
        self.health.backoff_until = None;
        match self.restart(now_ns) {
            Ok(instance) => {
                self.instance = Some(instance);
                self.since_checkpoint = 0;
                self.restarts += 1;
                Some(Ok(()))
            }
            Err(e) => {
                self.quarantine(None);
                Some(Err(e))
            }
        }
    }

    /// Replaces the running policy with `module`. On error nothing changes. The new module
    /// starts with a clean record.
    pub(crate) fn swap(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
        now_ns: u64,
    ) -> Result<Vec<u8>, PolicyError> {
        let started = self.handoff(module, config, workers.clone(), now_ns)?;
        self.install(started, module, config, workers)
    }

    /// Replaces the running policy with a fresh instance of `module`, started from `config`
    /// alone (its hand-over refused). On error nothing changes.
    pub(crate) fn swap_fresh(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
        now_ns: u64,
    ) -> Result<Vec<u8>, PolicyError> {
        let started = PolicyInstance::new(module, &init_args(self.shard, self.shards, now_ns, config))?;
        self.install(started, module, config, workers)
    }

    /// Makes `started` (a new instance and its start-up decisions) the running policy, with a
    /// clean record; returns the decisions. On error nothing changes.
    fn install(
        &mut self,
        started: (PolicyInstance, Vec<u8>),
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
    ) -> Result<Vec<u8>, PolicyError> {
        let (mut instance, start) = started;
        self.checkpoint = instance.export_state()?;
        self.checkpoint_workers = workers;
        self.retire();
        self.instance = Some(instance);
        self.module = module.clone();
        self.config = config.to_vec();
        self.since_checkpoint = 0;
        self.health = Health::default();
        self.quarantined = false;
        Ok(start)
    }

    /// Whether `module` with `config` would take over from the running policy now: the hand-over
    /// a swap makes, tried and thrown away (a swap's preparation). Changes nothing.
    pub(crate) fn try_swap(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
        now_ns: u64,
    ) -> Result<(), PolicyError> {
        self.handoff(module, config, workers, now_ns).map(|_| ())
    }

    /// A new instance of `module` that took over the running policy's state.
    fn handoff(
        &mut self,
        module: &PolicyModule,
        config: &[(String, String)],
        workers: Vec<WorkerClock>,
        now_ns: u64,
    ) -> Result<(PolicyInstance, Vec<u8>), PolicyError> {
        let state = match self.instance.as_mut() {
            Some(old) => old.export_state().unwrap_or_else(|_| self.checkpoint.clone()),
            None => self.checkpoint.clone(),
        };
        let old = self.module.info();
        let handoff = Handoff { from_name: &old.name, from_version: &old.version, state: &state, workers };
        PolicyInstance::import(module, &init_args(self.shard, self.shards, now_ns, config), &handoff)
    }
}
