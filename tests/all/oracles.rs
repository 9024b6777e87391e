//! The paradigms' oracles on the real wasm builds of BSP, SSP and ASP, over random interleavings.

use proptest::prelude::*;
use syncopate_suite::builtin_module;

use crate::harness::Cluster;

const N: u32 = 4;

/// Every push of ones moves the parameter by exactly -1/N.
fn assert_every_push_counted_once(c: &Cluster) {
    assert_eq!(c.rec.acked.len() as u64, c.pushes, "every push acknowledged exactly once");
    let expected = -(c.pushes as f32) / N as f32;
    assert_eq!(c.shard.values()[0], expected, "parameters hold every push exactly once");
}

#[test]
fn bsp_barrier_every_pull_sees_all_updates_of_the_previous_iteration() {
    let mut c = Cluster::new(&builtin_module("bsp"), &[], N, 20, 7);
    c.run_to_end();
    for s in &c.rec.served {
        assert!(
            s.min_applied >= s.clock,
            "pull at clock {} saw only {} iterations of the slowest",
            s.clock,
            s.min_applied
        );
        // Aggregated: the model holds whole iterations only, each worth exactly -1.
        assert_eq!(s.first_value, -(s.min_applied as f32));
    }
    assert!(c.rec.served.iter().any(|s| s.waited_ns > 0), "some worker had to wait at the barrier");
    assert_every_push_counted_once(&c);
}

#[test]
fn ssp_never_serves_a_model_more_than_s_behind() {
    for s in [0u64, 1, 3] {
        let module = builtin_module("ssp");
        let bound = s.to_string();
        let mut c = Cluster::new(&module, &[("s", &bound)], N, 25, 11 + s);
        c.run_to_end();
        for p in &c.rec.served {
            assert!(
                p.clock <= p.min_applied + s,
                "s={s}: pull at clock {} served with slowest at {}",
                p.clock,
                p.min_applied
            );
        }
        assert_every_push_counted_once(&c);
    }
}

#[test]
fn asp_never_defers() {
    let mut c = Cluster::new(&builtin_module("asp"), &[], N, 30, 3);
    c.run_to_end();
    assert!(c.pull_log.iter().all(|(_, deferred)| !deferred));
    assert_eq!(c.shard.stats().pulls_deferred, 0);
    assert_every_push_counted_once(&c);
}

#[test]
fn ssp_with_zero_staleness_decides_exactly_as_bsp() {
    for seed in [1, 2, 3, 4, 5] {
        let mut bsp = Cluster::new(&builtin_module("bsp"), &[], N, 15, seed);
        let mut ssp = Cluster::new(&builtin_module("ssp"), &[("s", "0")], N, 15, seed);
        bsp.run_to_end();
        ssp.run_to_end();
        assert_eq!(bsp.pull_log, ssp.pull_log, "seed {seed}: same pulls deferred");
        let order = |c: &Cluster| c.rec.served.iter().map(|s| (s.id, s.worker, s.clock)).collect::<Vec<_>>();
        assert_eq!(order(&bsp), order(&ssp), "seed {seed}: same pulls served in the same order");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_on_random_interleavings(seed in any::<u64>(), s in 0u64..5, iterations in 1u64..12) {
        let mut bsp = Cluster::new(&builtin_module("bsp"), &[], N, iterations, seed);
        bsp.run_to_end();
        for p in &bsp.rec.served {
            prop_assert!(p.min_applied >= p.clock);
        }
        prop_assert_eq!(bsp.shard.values()[0], -(bsp.pushes as f32) / N as f32);

        let bound = s.to_string();
        let mut ssp = Cluster::new(&builtin_module("ssp"), &[("s", &bound)], N, iterations, seed);
        ssp.run_to_end();
        for p in &ssp.rec.served {
            prop_assert!(p.clock <= p.min_applied + s);
        }
        prop_assert_eq!(ssp.shard.values()[0], -(ssp.pushes as f32) / N as f32);

        let mut asp = Cluster::new(&builtin_module("asp"), &[], N, iterations, seed);
        asp.run_to_end();
        prop_assert!(asp.pull_log.iter().all(|(_, d)| !d));
    }
}
