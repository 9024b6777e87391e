//! Cluster policies: one instance for the whole cluster, run by the coordinator.
//!
//! A shard [`Policy`](crate::Policy) decides each push and pull of one shard, alone. A
//! [`ClusterPolicy`] sees the whole cluster and decides for it: at a cadence it sets, the host
//! hands it the cluster's [`Figures`] (each worker's progress, compute time, waiting and loss
//! over the last window; each shard's clocks, queues and policy health), and it may hot-swap
//! the shard policy that every shard runs ([`ClusterCtx::swap`]), the same two-phase swap
//! `syncopate policy swap` makes. The built-in `autopilot` is one: it picks among BSP, SSP, the
//! adaptive deadline and ASP from the stragglers it sees.
//!
//! The module contract is the shard policy's (the same `sp_*` exports, [`PolicyInfo`] and
//! configuration), with its own marker, [`CLUSTER_ABI_MARKER`], so that a host never runs a
//! cluster policy on a shard or a shard policy on the coordinator. Events are a postcard
//! [`ClusterEnvelope`]; the reply is a run of postcard [`ClusterDecision`]s. The cluster
//! policy is called about once a second, not on every push, so its events are plain encoded
//! structures rather than the shard ABI's fixed records.
//!
//! ```
//! use syncopate_policy_sdk::cluster::*;
//! use syncopate_policy_sdk::prelude::*;
//!
//! /// Goes asynchronous once any worker has waited more than half the last window.
//! struct Relax;
//!
//! impl ClusterPolicy for Relax {
//!     const INFO: PolicyInfo = PolicyInfo::new("relax", "0.1.0", "BSP until workers wait, then ASP.", &[]);
//!     fn new(_init: &ClusterInit) -> Result<Self, String> {
//!         Ok(Relax)
//!     }
//!     fn on_figures(&mut self, ctx: &mut ClusterCtx<'_>, f: &Figures) {
//!         let waits = f.workers.iter().any(|w| 2 * w.waited_ns > f.window_ns);
//!         if waits && f.policy == "bsp" {
//!             ctx.swap("asp", &[], "a worker waited over half the window");
//!         }
//!     }
//! }
//! syncopate_policy_sdk::export_cluster_policy!(Relax);
//!
//! let mut d = ClusterDriver::<Relax>::new(&[]).unwrap();
//! let mut f = Figures::example(3, "bsp");
//! assert!(d.figures(&f).is_empty());
//! f.workers[0].waited_ns = f.window_ns;
//! assert_eq!(d.figures(&f)[0].swap_target(), Some("asp"));
//! ```

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::cell::RefCell;
use core::marker::PhantomData;

use serde::{Deserialize, Serialize};

use crate::abi::{Handoff, InitArgs, PolicyInfo, WorkerId};
use crate::config::Config;
use crate::guest::{packed, Encoder};

/// The marker export a cluster policy module carries (a function `() -> i32` returning
/// [`CLUSTER_ABI_VERSION`]).
pub const CLUSTER_ABI_MARKER: &str = "syncopate_cluster_v1";

/// The cluster ABI's version.
pub const CLUSTER_ABI_VERSION: u32 = 1;

/// The slowest cadence a cluster policy may ask for: an hour.
pub const MAX_CADENCE_MS: u32 = 3_600_000;

/// The fastest cadence a cluster policy may ask for: each call gathers every shard's figures.
pub const MIN_CADENCE_MS: u32 = 100;

/// The cadence until the policy sets one.
pub const DEFAULT_CADENCE_MS: u32 = 1_000;

/// The most decisions one call may make (a call that makes more fails, as a crash does).
pub const MAX_CLUSTER_DECISIONS: usize = 16;

/// What the cluster looked like over the last window, as the coordinator gathered it from
/// every shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Nanoseconds since the previous figures (0 for the first: the per-window numbers then
    /// cover the run so far).
    pub window_ns: u64,
    /// The shard policy every shard runs (its name), or the one most run during a swap.
    pub policy: String,
    /// Its configuration.
    pub config: Vec<(String, String)>,
    /// Each live worker, by id.
    pub workers: Vec<WorkerFigures>,
    /// Each shard, by index.
    pub shards: Vec<ShardFigures>,
}

/// One worker over the window.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerFigures {
    /// The worker.
    pub worker: WorkerId,
    /// Its clock: the iterations it has pushed everywhere (the least over the shards).
    pub clock: u64,
    /// Iterations it finished in the window.
    pub iterations: u64,
    /// Its mean compute time per iteration in the window, as it reported it with its pushes
    /// ([`Signals::step_ns`](crate::abi::Signals)); 0 when it reported none.
    pub step_ns: u64,
    /// Time its pulls spent deferred in the window, on the shard where it waited most.
    pub waited_ns: u64,
    /// The last loss it reported, if any.
    pub loss: Option<f32>,
}

/// One shard now, and over the window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardFigures {
    /// The shard.
    pub shard: u32,
    /// Its shard policy (name).
    pub policy: String,
    /// The least and the largest clock of its live workers.
    pub clocks: (u64, u64),
    /// Pulls deferred now.
    pub parked: u32,
    /// Pushes held now.
    pub held: u32,
    /// Pushes admitted in the window.
    pub pushes: u64,
    /// Failures of the shard policy running now since it started.
    pub failures: u64,
    /// Whether the shard policy is quarantined (the shard runs on fallback rules).
    pub quarantined: bool,
    /// The shard policy's own metrics (`ctx.metric`), last values.
    pub metrics: Vec<(String, f64)>,
}

impl Figures {
    /// Figures of a steady cluster for tests and examples: `workers` workers at 100 ms per
    /// iteration, 10 iterations in a one-second window, nobody waiting; one shard running
    /// `policy`.
    pub fn example(workers: u32, policy: &str) -> Self {
        Figures {
            window_ns: 1_000_000_000,
            policy: policy.to_string(),
            config: Vec::new(),
            workers: (0..workers)
                .map(|worker| WorkerFigures {
                    worker,
                    clock: 10,
                    iterations: 10,
                    step_ns: 100_000_000,
                    waited_ns: 0,
                    loss: None,
                })
                .collect(),
            shards: alloc::vec![ShardFigures {
                shard: 0,
                policy: policy.to_string(),
                clocks: (10, 10),
                parked: 0,
                held: 0,
                pushes: u64::from(workers) * 10,
                failures: 0,
                quarantined: false,
                metrics: Vec::new(),
            }],
        }
    }
}

/// What the host tells a cluster policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ClusterEvent {
    /// The cluster's figures, at the policy's cadence.
    Figures(Figures),
    /// A swap the policy asked for ended: `ok`, or refused with the reason.
    Swapped {
        /// The shard policy it asked for.
        policy: String,
        /// Whether every shard runs it now.
        ok: bool,
        /// Why not, when not.
        detail: String,
    },
}

/// One event with the host's time and a seeded random value, as for shard policies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterEnvelope {
    /// Host time in nanoseconds (virtual in the simulator).
    pub now_ns: u64,
    /// A seeded random value.
    pub random: u64,
    /// The event.
    pub event: ClusterEvent,
}

/// What a cluster policy decides.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ClusterDecision {
    /// Hand the figures every `ms` milliseconds from now on ([`MIN_CADENCE_MS`] to
    /// [`MAX_CADENCE_MS`]).
    SetCadence {
        /// The cadence.
        ms: u32,
    },
    /// Hot-swap every shard to the built-in shard policy `policy` with `config` (two-phase,
    /// as `syncopate policy swap` does). At most one per call; the outcome comes back as
    /// [`ClusterEvent::Swapped`], and no figures come while it is under way.
    Swap {
        /// A built-in shard policy's name.
        policy: String,
        /// Its configuration.
        config: Vec<(String, String)>,
        /// Why, for the operator (`policy status`, the report).
        reason: String,
    },
    /// Record a named figure, shown by `policy status`.
    Metric {
        /// Its name.
        name: String,
        /// Its value.
        value: f64,
    },
}

impl ClusterDecision {
    /// The policy a [`ClusterDecision::Swap`] asks for.
    pub fn swap_target(&self) -> Option<&str> {
        match self {
            ClusterDecision::Swap { policy, .. } => Some(policy),
            _ => None,
        }
    }
}

/// What a cluster policy is created with.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterInit {
    /// How many shards the model is split into.
    pub shards: u32,
    /// The configuration, checked against [`ClusterPolicy::INFO`]'s parameters.
    pub config: Config,
}

/// A cluster policy. Implement it, then register it with
/// [`export_cluster_policy!`](crate::export_cluster_policy).
///
/// One instance runs per cluster, on the coordinator. Handlers must be deterministic functions
/// of the instance's state, the event and the [`ClusterCtx`], as for shard policies.
pub trait ClusterPolicy: Sized + 'static {
    /// The policy's name, version, description and parameters.
    const INFO: PolicyInfo;

    /// Creates an instance from a validated configuration.
    fn new(init: &ClusterInit) -> Result<Self, String>;

    /// Called once right after creation: set the cadence.
    fn on_start(&mut self, _ctx: &mut ClusterCtx<'_>) {}

    /// The cluster's figures over the last window.
    fn on_figures(&mut self, ctx: &mut ClusterCtx<'_>, figures: &Figures);

    /// A swap this policy asked for ended (`ok`: every shard runs `policy` now).
    fn on_swapped(&mut self, _ctx: &mut ClusterCtx<'_>, _policy: &str, _ok: bool, _detail: &str) {}

    /// The instance's state, kept across a restart of the coordinator from a checkpoint.
    fn export_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Creates an instance from a state [`export_state`](Self::export_state) gave. The default
    /// starts afresh.
    fn import_state(init: &ClusterInit, _state: &Handoff<'_>) -> Result<Self, String> {
        Self::new(init)
    }
}

/// What a cluster policy's handler can read and do.
#[derive(Debug)]
pub struct ClusterCtx<'a> {
    now_ns: u64,
    random: u64,
    out: &'a mut Encoder,
}

impl<'a> ClusterCtx<'a> {
    /// Host time in nanoseconds (virtual time in the simulator).
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// The next value from the host-seeded random source (SplitMix64, as [`crate::Ctx`]'s).
    pub fn random_u64(&mut self) -> u64 {
        crate::ctx::splitmix(&mut self.random)
    }

    /// Hand the figures every `ms` milliseconds from now on (clamped to [`MIN_CADENCE_MS`] ..=
    /// [`MAX_CADENCE_MS`]).
    pub fn set_cadence_ms(&mut self, ms: u32) {
        let ms = ms.clamp(MIN_CADENCE_MS, MAX_CADENCE_MS);
        self.out.push(&ClusterDecision::SetCadence { ms });
    }

    /// Hot-swap every shard to the built-in shard policy `policy` with `config`; `reason` is
    /// shown to the operator.
    pub fn swap(&mut self, policy: &str, config: &[(&str, &str)], reason: &str) {
        self.out.push(&ClusterDecision::Swap {
            policy: policy.to_string(),
            config: config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            reason: reason.to_string(),
        });
    }

    /// Record a named figure (last value kept), shown by `policy status`.
    pub fn metric(&mut self, name: &str, value: f64) {
        self.out.push(&ClusterDecision::Metric { name: name.to_string(), value });
    }
}

/// The guest side of a cluster policy module: decodes the host's input, calls the policy,
/// encodes its decisions. The native [`ClusterDriver`] calls the same functions.
#[doc(hidden)]
#[derive(Debug)]
pub struct ClusterGuest<P> {
    policy: Option<P>,
    input: Vec<u8>,
    output: Encoder,
}

impl<P: ClusterPolicy> Default for ClusterGuest<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: ClusterPolicy> ClusterGuest<P> {
    /// No instance yet.
    pub const fn new() -> Self {
        ClusterGuest { policy: None, input: Vec::new(), output: Encoder::new() }
    }

    /// A buffer of at least `len` bytes for the host's next input.
    pub fn buffer(&mut self, len: usize) -> *mut u8 {
        crate::guest::grow(&mut self.input, len)
    }

    /// The policy's info.
    pub fn info(&mut self) -> &[u8] {
        self.output.clear();
        self.output.push(&P::INFO);
        self.output.as_slice()
    }

    /// Creates the instance from [`InitArgs`] (its `shard` unused).
    pub fn init(&mut self, len: usize) -> &[u8] {
        crate::guest::install_panic_hook();
        self.output.clear();
        let created =
            crate::guest::create(&self.input[..len], false, |args, _| P::new(&make_init::<P>(args)?));
        self.start(created)
    }

    /// Creates the instance from [`InitArgs`] and a [`Handoff`].
    pub fn import(&mut self, len: usize) -> &[u8] {
        crate::guest::install_panic_hook();
        self.output.clear();
        let created = crate::guest::create(&self.input[..len], true, |args, handoff| {
            P::import_state(&make_init::<P>(args)?, handoff.expect("decoded"))
        });
        self.start(created)
    }

    fn start(&mut self, created: Result<(P, u64), String>) -> &[u8] {
        match created {
            Ok((mut policy, now_ns)) => {
                self.output.push(&Ok::<(), String>(()));
                policy.on_start(&mut ClusterCtx { now_ns, random: 0, out: &mut self.output });
                self.policy = Some(policy);
            }
            Err(reason) => self.output.push(&Err::<(), String>(reason)),
        }
        self.output.as_slice()
    }

    /// Handles the [`ClusterEnvelope`] in the buffer; answers a run of decisions.
    ///
    /// # Panics
    /// On malformed input or an event before a successful init: host bugs.
    pub fn event(&mut self, len: usize) -> &[u8] {
        self.output.clear();
        let env = match postcard::from_bytes::<ClusterEnvelope>(&self.input[..len]) {
            Ok(env) => env,
            Err(e) => panic!("malformed cluster event from host: {e}"),
        };
        let Some(policy) = self.policy.as_mut() else {
            panic!("event before the cluster policy was initialised");
        };
        let mut ctx = ClusterCtx { now_ns: env.now_ns, random: env.random, out: &mut self.output };
        match &env.event {
            ClusterEvent::Figures(f) => policy.on_figures(&mut ctx, f),
            ClusterEvent::Swapped { policy: to, ok, detail } => policy.on_swapped(&mut ctx, to, *ok, detail),
        }
        self.output.as_slice()
    }

    /// The instance's exported state.
    pub fn export(&mut self) -> &[u8] {
        self.output.clear();
        if let Some(policy) = &self.policy {
            self.output.set(&policy.export_state());
        }
        self.output.as_slice()
    }

    /// Packs a reply for an export.
    pub fn packed(bytes: &[u8]) -> i64 {
        packed(bytes)
    }
}

fn make_init<P: ClusterPolicy>(args: &InitArgs<'_>) -> Result<ClusterInit, String> {
    let config = Config::validate(P::INFO.params, &args.config)?;
    Ok(ClusterInit { shards: args.shards, config })
}

/// Decodes a run of decisions a cluster policy answered.
pub fn decode_decisions(bytes: &[u8]) -> Result<Vec<ClusterDecision>, postcard::Error> {
    decisions(bytes).collect()
}

/// The decisions a cluster policy answered, decoded one at a time (a host that bounds their
/// number stops at the bound without decoding the rest).
pub fn decisions(bytes: &[u8]) -> Decisions<'_> {
    Decisions { rest: bytes }
}

/// The iterator [`decisions`] returns; it ends after the first error.
#[derive(Debug)]
pub struct Decisions<'a> {
    rest: &'a [u8],
}

impl Iterator for Decisions<'_> {
    type Item = Result<ClusterDecision, postcard::Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match postcard::take_from_bytes::<ClusterDecision>(self.rest) {
            Ok((d, rest)) => {
                self.rest = rest;
                Some(Ok(d))
            }
            Err(e) => {
                self.rest = &[];
                Some(Err(e))
            }
        }
    }
}

/// Runs a [`ClusterPolicy`] natively, through the same encoding the wasm module uses: for
/// unit tests of a cluster policy.
#[derive(Debug)]
pub struct ClusterDriver<P: ClusterPolicy> {
    guest: RefCell<ClusterGuest<P>>,
    /// Host time the next event is sent at; [`figures`](Self::figures) adds the window to it.
    pub now_ns: u64,
    /// Decisions made at start-up.
    pub started: Vec<ClusterDecision>,
    _p: PhantomData<P>,
}

impl<P: ClusterPolicy> ClusterDriver<P> {
    /// Creates the policy with `config` on a one-shard cluster.
    pub fn new(config: &[(&str, &str)]) -> Result<Self, String> {
        let mut guest = ClusterGuest::<P>::new();
        let args = InitArgs { shard: 0, shards: 1, now_ns: 0, config: config.to_vec() };
        let bytes = crate::guest::encode(&args);
        guest.buffer(bytes.len());
        guest.input[..bytes.len()].copy_from_slice(&bytes);
        let reply = guest.init(bytes.len()).to_vec();
        let (result, rest) =
            postcard::take_from_bytes::<Result<(), String>>(&reply).map_err(|e| e.to_string())?;
        result?;
        let started = decode_decisions(rest).map_err(|e| e.to_string())?;
        Ok(ClusterDriver { guest: RefCell::new(guest), now_ns: 0, started, _p: PhantomData })
    }

    /// Hands `figures` to the policy (time moves on by its window); returns its decisions.
    pub fn figures(&mut self, figures: &Figures) -> Vec<ClusterDecision> {
        self.now_ns += figures.window_ns;
        self.send(ClusterEvent::Figures(figures.clone()))
    }

    /// Tells the policy a swap it asked for ended.
    pub fn swapped(&mut self, policy: &str, ok: bool, detail: &str) -> Vec<ClusterDecision> {
        self.send(ClusterEvent::Swapped { policy: policy.to_string(), ok, detail: detail.to_string() })
    }

    fn send(&mut self, event: ClusterEvent) -> Vec<ClusterDecision> {
        let env = ClusterEnvelope { now_ns: self.now_ns, random: self.now_ns, event };
        let bytes = crate::guest::encode(&env);
        let mut g = self.guest.borrow_mut();
        g.buffer(bytes.len());
        g.input[..bytes.len()].copy_from_slice(&bytes);
        let reply = g.event(bytes.len());
        decode_decisions(reply).expect("the SDK encodes what it decodes")
    }
}

/// Registers a [`ClusterPolicy`] as the module's cluster policy: generates the wasm exports
/// the coordinator calls (with the [`CLUSTER_ABI_MARKER`] marker). Only on `wasm32`; natively
/// it expands to nothing, so the same crate runs its tests with [`ClusterDriver`].
#[macro_export]
macro_rules! export_cluster_policy {
    ($policy:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __syncopate_cluster_policy_exports {
            #[allow(unused_imports)]
            use super::*;
            use $crate::cluster::ClusterGuest;
            ::std::thread_local! {
                static GUEST: ::core::cell::RefCell<ClusterGuest<$policy>> =
                    const { ::core::cell::RefCell::new(ClusterGuest::new()) };
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn syncopate_cluster_v1() -> u32 {
                $crate::cluster::CLUSTER_ABI_VERSION
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_buffer(len: u32) -> u32 {
                GUEST.with_borrow_mut(|g| g.buffer(len as usize) as u32)
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_info() -> i64 {
                GUEST.with_borrow_mut(|g| ClusterGuest::<$policy>::packed(g.info()))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_init(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| ClusterGuest::<$policy>::packed(g.init(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_import_state(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| ClusterGuest::<$policy>::packed(g.import(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_event(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| ClusterGuest::<$policy>::packed(g.event(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_export_state() -> i64 {
                GUEST.with_borrow_mut(|g| ClusterGuest::<$policy>::packed(g.export()))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_last_panic() -> i64 {
                $crate::guest::last_panic()
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    struct Echo {
        every: u32,
    }

    impl ClusterPolicy for Echo {
        const INFO: PolicyInfo = PolicyInfo::new(
            "echo",
            "0.1.0",
            "test",
            &[crate::abi::ParamSpec::new("every", crate::abi::ParamKind::Uint, "2000", "cadence")],
        );
        fn new(init: &ClusterInit) -> Result<Self, String> {
            Ok(Echo { every: init.config.get("every").map_err(|e| e.0)? })
        }
        fn on_start(&mut self, ctx: &mut ClusterCtx<'_>) {
            ctx.set_cadence_ms(self.every);
        }
        fn on_figures(&mut self, ctx: &mut ClusterCtx<'_>, f: &Figures) {
            ctx.metric("workers", f.workers.len() as f64);
            ctx.swap("ssp", &[("s", "2")], "asked");
        }
    }

    #[test]
    fn decisions_go_through_the_encoding_and_the_cadence_is_clamped() {
        let d = ClusterDriver::<Echo>::new(&[("every", "5")]).unwrap();
        assert_eq!(d.started, vec![ClusterDecision::SetCadence { ms: MIN_CADENCE_MS }]);
        let mut d = ClusterDriver::<Echo>::new(&[]).unwrap();
        assert_eq!(d.started, vec![ClusterDecision::SetCadence { ms: 2000 }]);
        let out = d.figures(&Figures::example(4, "bsp"));
        assert_eq!(out[0], ClusterDecision::Metric { name: "workers".into(), value: 4.0 });
        assert_eq!(
            out[1],
            ClusterDecision::Swap {
                policy: "ssp".into(),
                config: vec![("s".into(), "2".into())],
                reason: "asked".into()
            }
        );
        assert!(ClusterDriver::<Echo>::new(&[("every", "x")]).is_err());
    }
}
