//! Errors from loading and running policy modules. Each names the module and, for runtime
//! failures, the event being handled.

/// A policy module could not be loaded, or misbehaved while running.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// The bytes are not a valid wasm module.
    #[error("{label}: not a valid wasm module: {reason}")]
    Invalid {
        /// The module's label.
        label: String,
        /// What is wrong.
        reason: String,
    },
    /// The module imports something; policy modules may import nothing.
    #[error("{label}: imports `{module}::{name}`, but policy modules may import nothing (no WASI, no host functions)")]
    ForbiddenImport {
        /// The module's label.
        label: String,
        /// Import module.
        module: String,
        /// Import name.
        name: String,
    },
    /// The module targets another ABI version.
    #[error(
        "{label}: built for policy ABI v{found}, but this host speaks v{} (and loads v2)",
        syncopate_policy_sdk::abi::ABI_VERSION
    )]
    WrongAbi {
        /// The module's label.
        label: String,
        /// The version its marker declares.
        found: String,
    },
    /// The module has no ABI marker at all.
    #[error("{label}: not a Syncopate policy module (no `{}` export; build it with syncopate-policy-sdk's export_policy!)", syncopate_policy_sdk::abi::ABI_MARKER)]
    NotAPolicy {
        /// The module's label.
        label: String,
    },
    /// A required export is missing or has the wrong type.
    #[error("{label}: export `{name}` is missing or is not {expected}")]
    BadExport {
        /// The module's label.
        label: String,
        /// The export.
        name: &'static str,
        /// What it should be.
        expected: &'static str,
    },
    /// The policy rejected its configuration or a swap's state.
    #[error("{policy}: refused {what}: {reason}")]
    Refused {
        /// The policy.
        policy: String,
        /// What it refused (its configuration, the handed-over state).
        what: &'static str,
        /// Its reason.
        reason: String,
    },
    /// A call burned its whole fuel budget ([`super::SandboxLimits::call_fuel`]): it looped,
    /// or did far more work than a policy should for one event.
    #[error("{policy}: used up its budget of {fuel} fuel units (about one per wasm instruction) while handling {event}")]
    OutOfFuel {
        /// The policy.
        policy: String,
        /// The budget.
        fuel: u64,
        /// The event being handled.
        event: String,
    },
    /// The instance tried to grow its memory past the cap.
    #[error("{policy}: tried to grow its memory to {wanted} bytes, past the {cap} byte cap, while handling {event}")]
    MemoryCap {
        /// The policy.
        policy: String,
        /// Requested size.
        wanted: usize,
        /// The cap.
        cap: usize,
        /// The event being handled.
        event: String,
    },
    /// The policy panicked.
    #[error("{policy}: panicked while handling {event}: {message}")]
    Panic {
        /// The policy.
        policy: String,
        /// The event being handled.
        event: String,
        /// The panic message.
        message: String,
    },
    /// The instance trapped.
    #[error("{policy}: trapped while handling {event}: {detail}")]
    Trap {
        /// The policy.
        policy: String,
        /// The event being handled.
        event: String,
        /// The trap.
        detail: String,
    },
    /// The policy answered with something that breaks the ABI's rules.
    #[error("{policy}: made a nonsense decision while handling {event}: {detail}")]
    BadDecision {
        /// The policy.
        policy: String,
        /// The event being handled.
        event: String,
        /// What was wrong.
        detail: String,
    },
    /// The host itself failed (engine creation).
    #[error("policy runtime: {0}")]
    Host(String),
    /// Every live worker waited on the policy's decisions for the shard's no-progress time and
    /// nothing else happened: the rule stalled the run ([`crate::shard::SupervisorConfig::no_progress_ns`]).
    #[error("{policy}: made no progress: {stuck}")]
    NoProgress {
        /// The policy.
        policy: String,
        /// What was stuck, and for how long (which workers' pulls and pushes).
        stuck: String,
    },
    /// A module of the wrong kind: a cluster policy given to a shard, or a shard policy given
    /// to the coordinator as its cluster policy.
    #[error("{policy} is {is}, but {wanted} was expected here")]
    WrongKind {
        /// The module.
        policy: String,
        /// What it is.
        is: super::ModuleKind,
        /// What was wanted.
        wanted: super::ModuleKind,
    },
}
