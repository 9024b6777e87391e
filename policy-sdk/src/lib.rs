//! # Syncopate policy SDK
//!
//! A synchronization policy decides, for every push and pull a parameter-server shard receives,
//! whether to serve or defer, admit or hold, and what to tell workers. Policies are pure state
//! machines: events in, decisions out. They have no clock, no randomness and no I/O of their own:
//! the host passes time and a seeded random value with every event ([`Ctx`]), so every decision is
//! reproducible, and a policy runs the same way in a wasm sandbox, in a native unit test and in
//! the simulator.
//!
//! ## Write a policy
//! ```
//! use syncopate_policy_sdk::prelude::*;
//!
//! /// Stale synchronous parallel with a configurable bound.
//! pub struct MySsp { s: u64 }
//!
//! impl Policy for MySsp {
//!     const INFO: PolicyInfo = PolicyInfo::new("my-ssp", "0.1.0", "SSP, my way", &[
//!         ParamSpec::new("s", ParamKind::Uint, "3", "staleness bound"),
//!     ]);
//!
//!     fn new(init: &Init) -> Result<Self, String> {
//!         Ok(MySsp { s: init.config.get("s")? })
//!     }
//!
//!     fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
//!         let min = ctx.view().min_clock;
//!         if pull.clock <= min + self.s {
//!             PullVerdict::Serve
//!         } else {
//!             PullVerdict::Defer(Release::MinClockAtLeast(pull.clock - self.s))
//!         }
//!     }
//! }
//!
//! // Exports the wasm ABI when built for wasm32; does nothing in a native build.
//! syncopate_policy_sdk::export_policy!(MySsp);
//!
//! // Test it natively:
//! let mut d = Driver::<MySsp>::new(&[("s", "1")]).unwrap();
//! d.join(0);
//! d.join(1);
//! d.push(0).unwrap();
//! d.push(0).unwrap();
//! assert_eq!(d.pull(0).unwrap(), PullVerdict::Defer(Release::MinClockAtLeast(1)));
//! ```
//! `syncopate policy new NAME` writes a crate to start from (this SDK vendored, its dependencies
//! pinned); `syncopate policy build` builds the module (crate type `cdylib`, target
//! `wasm32-unknown-unknown`, release profile) and checks it; `syncopate policy swap FILE.wasm`
//! loads it into a running cluster. The guide `docs/writing-a-policy.md` in the repository walks
//! through it.
//!
//! ## What a policy must do
//! Answer every pull with a [`PullVerdict`] and every push with a [`PushVerdict`]; release what it
//! deferred explicitly and admit what it held. The host checks these obligations
//! (see [`abi`]) and treats a policy that breaks them like one that crashed.

#![deny(missing_docs)]

extern crate alloc;

pub mod abi;
pub mod clocks;
pub mod cluster;
pub mod codec;
pub mod config;
mod ctx;
#[doc(hidden)]
pub mod guest;
pub mod measure;
pub mod optimizer;
pub mod rounds;
pub mod rules;
pub mod shares;
pub mod state;
pub mod testing;

use alloc::string::String;
use alloc::vec::Vec;

pub use abi::{
    Applied, Control, Handoff, IterationReport, LeaveReason, Measure, ModuleInfo, ParamInfo, ParamKind,
    ParamSpec, PolicyInfo, Pull, Push, Release, RequestId, ShardView, Signals, Tensor, TimerId, UpdateMode,
    WorkerClock, WorkerId,
};
pub use config::{Config, ConfigError};
pub use ctx::Ctx;
pub use testing::Driver;

/// Everything a policy author usually needs, in one import.
pub mod prelude {
    pub use crate::abi::{
        Applied, Control, Handoff, IterationReport, LeaveReason, Measure, ParamKind, ParamSpec, PolicyInfo,
        Pull, Push, Release, RequestId, ShardView, Signals, Tensor, TimerId, UpdateMode, WorkerClock,
        WorkerId,
    };
    pub use crate::testing::Driver;
    pub use crate::{Ctx, Init, Policy, PullVerdict, PushVerdict};
    pub use alloc::string::String;
    pub use alloc::vec::Vec;
}

/// What a policy instance is created with.
#[derive(Clone, Debug)]
pub struct Init {
    /// The shard this instance serves (each shard runs its own instance).
    pub shard: u32,
    /// How many shards the model is split into.
    pub shards: u32,
    /// The configuration, already checked against [`Policy::INFO`]'s parameters.
    pub config: Config,
}

/// A policy's answer to a pull.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullVerdict {
    /// Answer now with the current parameters.
    Serve,
    /// Park the pull until the condition holds.
    Defer(Release),
}

impl PullVerdict {
    /// BSP's barrier: serve a pull at `clock` once every live worker has pushed as many
    /// iterations (`min_clock >= clock`), else defer it until then. The rule of `bsp`,
    /// `localsgd` and `diloco`.
    pub fn at_barrier(clock: u64, view: ShardView) -> PullVerdict {
        if view.min_clock >= clock {
            PullVerdict::Serve
        } else {
            PullVerdict::Defer(Release::MinClockAtLeast(clock))
        }
    }
}

/// A policy's answer to a push.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PushVerdict {
    /// Apply it (or add it to its iteration's aggregate) with the host's default weight.
    Admit,
    /// Admit it with this weight instead of the default.
    AdmitWeighted(f32),
    /// Hold it, unacknowledged, until [`Ctx::admit_push`] or [`Ctx::drop_push`].
    Hold,
    /// Discard it: the gradient never reaches the parameters (no optimizer step, so momentum
    /// and weight decay do not move them either), the worker's clock advances and the worker is
    /// told its push was dropped. Admitting with weight 0 means the same and is treated the same.
    Drop,
    /// Admit it into group `group` (weight 1), whatever its worker's clock: it is acknowledged,
    /// and its gradient waits in the group until [`Ctx::complete_group`] applies the group as
    /// one optimizer step of its mean ("the first K gradients from any workers").
    Group(u64),
}

/// A synchronization policy. Implement this, then register it with [`export_policy!`].
///
/// One instance runs per shard. Handlers must be deterministic functions of the instance's state,
/// the event and the [`Ctx`]: that is what makes replay, checkpoint recovery and the simulator
/// exact.
pub trait Policy: Sized + 'static {
    /// The policy's name, version, description and parameters.
    const INFO: PolicyInfo;

    /// Creates an instance from a validated configuration. Return `Err` with a readable reason
    /// when the configuration makes no sense (e.g. a range whose low end exceeds its high end).
    fn new(init: &Init) -> Result<Self, String>;

    /// Called once right after creation (or a swap): set the update mode, arm timers.
    fn on_start(&mut self, _ctx: &mut Ctx<'_>) {}

    /// A worker asks for the parameters. Serve now or defer.
    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict;

    /// A gradient arrived. Admit it (the default), hold it or drop it.
    fn on_push(&mut self, _ctx: &mut Ctx<'_>, _push: &Push) -> PushVerdict {
        PushVerdict::Admit
    }

    /// Called right after a push's verdict took effect. Decisions emitted here come after the
    /// verdict: admit held pushes that this one unblocks (R²SP's rotation does), so the host
    /// applies them in that order.
    fn after_push(&mut self, _ctx: &mut Ctx<'_>, _push: &Push, _verdict: PushVerdict) {}

    /// A worker joined with the given starting clock.
    fn on_worker_joined(&mut self, _ctx: &mut Ctx<'_>, _worker: WorkerId, _clock: u64) {}

    /// A worker left; anything the policy held for it is now moot.
    fn on_worker_left(&mut self, _ctx: &mut Ctx<'_>, _worker: WorkerId, _reason: LeaveReason) {}

    /// A worker reported a finished iteration (with its compute time).
    fn on_iteration_finished(&mut self, _ctx: &mut Ctx<'_>, _report: &IterationReport) {}

    /// A timer set with [`Ctx::set_timer`] fired.
    fn on_timer(&mut self, _ctx: &mut Ctx<'_>, _timer: TimerId) {}

    /// A worker acknowledged a control message this instance sent (for a task move: which tasks
    /// actually moved).
    fn on_control_applied(&mut self, _ctx: &mut Ctx<'_>, _applied: &Applied) {}

    /// The host's answer to [`Ctx::measure`] number `query` (ABI v3): it arrives right after
    /// the event that asked, before any other. `value` is NaN when a tensor named was not there
    /// (a push already decided, an empty group) or a cosine involved a zero tensor.
    fn on_measured(&mut self, _ctx: &mut Ctx<'_>, _query: u64, _value: f64) {}

    /// The instance's state, for checkpoints and hot swaps. Stateless policies keep the default.
    ///
    /// Do not include parked pulls or held pushes: after a swap or a recovery the host hands
    /// every pending request to the new instance again as a fresh event.
    fn export_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Creates an instance that takes over from another policy during a hot swap. The default
    /// ignores the old state and starts from the configuration, which is right for stateless
    /// policies. Return `Err` to refuse the swap (it is then cancelled cleanly).
    fn import_state(init: &Init, _handoff: &Handoff<'_>) -> Result<Self, String> {
        Self::new(init)
    }
}

impl PolicyInfo {
    /// Describes a policy; for use in [`Policy::INFO`].
    pub const fn new(
        name: &'static str,
        version: &'static str,
        description: &'static str,
        params: &'static [ParamSpec],
    ) -> Self {
        PolicyInfo { name, version, description, params }
    }
}

impl ParamSpec {
    /// Declares a parameter; for use in [`PolicyInfo::new`].
    pub const fn new(name: &'static str, kind: ParamKind, default: &'static str, doc: &'static str) -> Self {
        ParamSpec { name, kind, default, doc }
    }
}

impl From<ConfigError> for String {
    fn from(e: ConfigError) -> String {
        e.0
    }
}

impl Release {
    /// Whether the host releases a pull parked with this condition, given the shard's clocks.
    pub fn is_met(self, view: ShardView) -> bool {
        match self {
            Release::MinClockAtLeast(c) => view.min_clock >= c,
            Release::Explicit => false,
        }
    }
}

/// Registers a [`Policy`] type as the policy of this crate's wasm module.
///
/// Put it once in the policy crate's `lib.rs` (crate type `["cdylib", "rlib"]`). On `wasm32` it
/// generates the ABI exports; natively it generates nothing, so the same crate unit-tests with
/// plain `cargo test` and the [`Driver`].
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        #[cfg(target_arch = "wasm32")]
        #[doc(hidden)]
        pub mod __syncopate_policy_exports {
            #[allow(unused_imports)]
            use super::*;
            use $crate::guest::Guest;
            ::std::thread_local! {
                static GUEST: ::core::cell::RefCell<Guest<$policy>> =
                    const { ::core::cell::RefCell::new(Guest::new()) };
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn syncopate_abi_v3() -> u32 {
                $crate::abi::ABI_VERSION
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_buffer(len: u32) -> u32 {
                GUEST.with_borrow_mut(|g| g.buffer(len as usize) as u32)
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_info() -> i64 {
                GUEST.with_borrow_mut(|g| $crate::guest::packed(g.info()))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_init(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| $crate::guest::packed(g.init(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_import_state(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| $crate::guest::packed(g.import(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_event(len: u32) -> i64 {
                GUEST.with_borrow_mut(|g| $crate::guest::packed(g.event(len as usize)))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_export_state() -> i64 {
                GUEST.with_borrow_mut(|g| $crate::guest::packed(g.export()))
            }
            #[unsafe(no_mangle)]
            pub extern "C" fn sp_last_panic() -> i64 {
                $crate::guest::last_panic()
            }
        }
    };
}
