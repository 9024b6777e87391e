//! An example cluster policy (`docs/writing-a-policy.md`, "Cluster policies"): the cluster
//! runs BSP until some worker's pulls waited more than half of a window, then ASP.
//!
//! With `planted_bug=true` it keeps a bug that a reader of the figures may well write: it looks
//! a worker up by its id as an index into `figures.workers`, which holds the live workers in id
//! order, so once a worker with a lower id has left the lookup runs past the end and panics.
//! `syncopate policy check` finds it in its generated clusters (workers join and leave there);
//! the suite checks that it does.

use syncopate_policy_sdk::cluster::{ClusterCtx, ClusterInit, ClusterPolicy, Figures};
use syncopate_policy_sdk::prelude::*;

/// BSP until workers wait, then ASP.
#[derive(Debug)]
pub struct Relax {
    planted_bug: bool,
}

impl ClusterPolicy for Relax {
    const INFO: PolicyInfo = PolicyInfo::new(
        "example-pilot",
        env!("CARGO_PKG_VERSION"),
        "BSP until a worker's pulls wait over half the window, then ASP.",
        &[ParamSpec::new(
            "planted_bug",
            ParamKind::Bool,
            "false",
            "look workers up by id as an index (wrong)",
        )],
    );

    fn new(init: &ClusterInit) -> Result<Self, String> {
        Ok(Relax { planted_bug: init.config.get("planted_bug").map_err(|e| e.0)? })
    }

    fn on_figures(&mut self, ctx: &mut ClusterCtx<'_>, f: &Figures) {
        let waited = |w: u32| -> u64 {
            if self.planted_bug {
                f.workers[w as usize].waited_ns // wrong: ids need not be dense
            } else {
                f.workers.iter().find(|x| x.worker == w).map_or(0, |x| x.waited_ns)
            }
        };
        let waits = f.workers.iter().any(|w| 2 * waited(w.worker) > f.window_ns);
        if waits && f.policy == "bsp" {
            ctx.swap("asp", &[], "a worker waited over half the window");
        }
    }
}

syncopate_policy_sdk::export_cluster_policy!(Relax);

#[cfg(test)]
mod tests {
    use super::*;
    use syncopate_policy_sdk::cluster::ClusterDriver;

    #[test]
    fn goes_asynchronous_once_a_worker_waits() {
        let mut d = ClusterDriver::<Relax>::new(&[]).unwrap();
        let mut f = Figures::example(3, "bsp");
        assert!(d.figures(&f).is_empty());
        f.workers[2].waited_ns = f.window_ns;
        assert_eq!(d.figures(&f)[0].swap_target(), Some("asp"));
        // Worker 0 left: the right lookup still finds worker 2.
        f.workers.remove(0);
        assert_eq!(d.figures(&f)[0].swap_target(), Some("asp"));
    }
}
