//! The lab: what users run to try policies under realistic conditions, above the cluster.
//!
//! - [`scenario`]: scenarios as TOML files (workload, cluster size, heterogeneity, optimizer,
//!   budget), the one typed specification of a run that both drivers accept;
//! - [`local`]: a real cluster on this machine, as processes over QUIC (`syncopate local`);
//! - [`sim`]: the deterministic simulator, which runs the engine's shards and worker machines in
//!   virtual time (`syncopate ab --simulate`);
//! - [`report`]: what a run (real or simulated) reports, and the watcher's readings and stop
//!   rules, shared by both;
//! - [`ab`]: one scenario under several policies, compared;
//! - [`plots`]: the SVG plots of a run and of a comparison;
//! - [`tensorboard`]: TensorBoard event files of a run's looks (`--tensorboard`);
//! - [`stats`]: medians, confidence intervals and rank tests for repeated comparisons;
//! - [`simtest`]: a seeded search for lost or doubled updates under server failures, in the
//!   simulator (`syncopate simtest`);
//! - [`explore`]: generated event sequences for one policy module on one shard, the rules a
//!   policy must keep, and the shrunk sequence that broke one (`syncopate policy check`);
//! - [`explore_cluster`]: generated clusters for a cluster policy (stragglers coming and going,
//!   workers joining and leaving, swaps that fail), run through the coordinator's pilot.
//!
//! Dependencies run one way: `report` and `stats` depend on no other lab module; `plots` on
//! `report` and `stats`; `tensorboard` on `report`; `local` and `sim` on `report`, `plots` and `scenario`; `ab` on all of
//! them but `simtest`; `simtest` on `scenario` and `sim`; `explore` on none; `explore_cluster` on `explore`.

pub mod ab;
pub mod explore;
pub mod explore_cluster;
pub mod local;
pub mod plots;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod simtest;
pub mod stats;
pub mod tensorboard;
