//! Hot swap at the runtime level: policies replaced under a stream of events, state handed over,
//! refusals leaving the old policy in place, nothing dropped.

use std::sync::mpsc;
use std::thread;

use syncopate::runtime::PolicyError;
use syncopate::shard::{PullRequest, PushRequest, PushWeight, Shard, ShardConfig};
use syncopate_policy_sdk::abi::UpdateMode;
use syncopate_suite::{builtin_module, config, hostile_module, Recorder};

use crate::harness::{exact_sgd, Cluster};

const N: u32 = 4;

#[test]
fn bsp_to_ssp_and_back_under_a_stream_of_events_counts_every_push_once() {
    let plan = [
        ("ssp", vec![("s", "2")]),
        ("bsp", vec![]),
        ("asp", vec![]),
        ("ssp", vec![("s", "0")]),
        ("bsp", vec![]),
    ];
    for seed in [1u64, 9, 42] {
        // Workers leave when done, as real ones do: a swap levels the clocks, so a worker that
        // was behind runs on past the others' last clock (see the shard's `swap_policy`).
        let mut c = Cluster::leaving(&builtin_module("bsp"), &[], N, 40, seed, PushWeight::Sum);
        let mut steps = 0u64;
        let mut next = 0;
        while !c.done() {
            c.step_random();
            steps += 1;
            if steps.is_multiple_of(37) && next < plan.len() {
                let (name, cfg) = &plan[next];
                let now = c.now;
                let level = c.shard.levelling();
                c.shard
                    .swap_policy(&builtin_module(name), &config(cfg), &level, now, &mut c.rec)
                    .expect("swap");
                assert_eq!(c.shard.policy().info().name, *name);
                next += 1;
            }
        }
        assert_eq!(next, plan.len(), "every swap happened mid-run");
        assert_eq!(c.shard.stats().swaps, plan.len() as u64);
        assert!(c.rec.errors.is_empty(), "{:?}", c.rec.errors);
        assert_eq!(c.rec.acked.len() as u64, c.pushes);
        assert_eq!(c.shard.values()[0], -(c.pushes as f32), "seed {seed}: every push counted once");
        assert_eq!(c.shard.view().workers, 0, "every worker left");
        assert_eq!(c.shard.parked_pulls(), 0);
        assert!(c.shard.stats().clocks_rebased > 0, "seed {seed}: some swap found the workers apart");
    }
}

#[test]
fn swapping_to_a_looser_policy_releases_parked_pulls() {
    let mut rec = Recorder::default();
    let cfg = ShardConfig { optimizer: exact_sgd(), ..ShardConfig::default() };
    let mut shard = Shard::new(cfg, vec![0.0], &builtin_module("bsp"), &[], &mut rec).unwrap();
    shard.join(0, 0, &mut rec).unwrap();
    shard.join(1, 0, &mut rec).unwrap();
    shard
        .push(
            PushRequest {
                worker: 0,
                iteration: 0,
                samples: 1,
                grad: vec![1.0],
                based_on: None,
                tasks: None,
                local_steps: 0,
                signals: Default::default(),
            },
            1,
            &mut rec,
        )
        .unwrap();
    let id = shard.pull(PullRequest { worker: 0, iteration: 1 }, 2, &mut rec).unwrap();
    assert!(!rec.was_served(id), "BSP holds the fast worker");
    assert_eq!(shard.update_mode(), UpdateMode::Aggregate);
    shard.swap_policy(&builtin_module("asp"), &[], &shard.levelling(), 3, &mut rec).unwrap();
    assert!(rec.was_served(id), "ASP serves the parked pull at once");
    assert_eq!(shard.update_mode(), UpdateMode::OnArrival);
    // The partial BSP aggregate was applied when the mode changed: the push is not lost.
    assert_eq!(shard.values()[0], -0.5);
}

#[test]
fn a_refused_swap_changes_nothing() {
    let mut c = Cluster::new(&builtin_module("bsp"), &[], N, 10, 3);
    for _ in 0..50 {
        c.step_random();
    }
    let now = c.now;
    let err = c
        .shard
        .swap_policy(&hostile_module(), &config(&[("mode", "refuse-state")]), &[], now, &mut c.rec)
        .unwrap_err();
    assert!(matches!(err, PolicyError::Refused { .. }), "{err}");
    assert!(err.to_string().contains("cannot take over from `bsp`"), "{err}");
    assert_eq!(c.shard.policy().info().name, "bsp");
    let err = c
        .shard
        .swap_policy(&builtin_module("ssp"), &config(&[("s", "-1")]), &[], now, &mut c.rec)
        .unwrap_err();
    assert!(err.to_string().contains("parameter `s` must be a uint, got `-1`"), "{err}");
    assert_eq!(c.shard.policy().info().name, "bsp");
    c.run_to_end();
    assert_eq!(c.shard.values()[0], -(c.pushes as f32) / N as f32);
}

/// What a shard's owner thread receives.
enum Msg {
    Push(u32, u64),
    Pull(u32, u64),
    Swap(&'static str, Vec<(String, String)>),
}

#[test]
fn events_sent_during_a_swap_wait_in_line_and_none_is_dropped() {
    // One thread owns the shard (as a server's shard task does); producers send pushes and pulls
    // while a controller sends swaps. Everything goes through one channel, so events that arrive
    // during a swap wait for it.
    let (tx, rx) = mpsc::channel::<Msg>();
    let owner = thread::spawn(move || {
        let mut rec = Recorder::default();
        let cfg = ShardConfig { optimizer: exact_sgd(), ..ShardConfig::default() };
        let mut shard = Shard::new(cfg, vec![0.0; 8], &builtin_module("asp"), &[], &mut rec).unwrap();
        for w in 0..N {
            shard.join(w, 0, &mut rec).unwrap();
        }
        let (mut now, mut pushes, mut pulls) = (0u64, 0u64, 0u64);
        for msg in rx {
            now += 1;
            match msg {
                Msg::Push(worker, iteration) => {
                    shard
                        .push(
                            PushRequest {
                                worker,
                                iteration,
                                samples: 1,
                                grad: vec![1.0; 8],
                                based_on: None,
                                tasks: None,
                                local_steps: 0,
                                signals: Default::default(),
                            },
                            now,
                            &mut rec,
                        )
                        .unwrap();
                    pushes += 1;
                }
                Msg::Pull(worker, iteration) => {
                    shard.pull(PullRequest { worker, iteration }, now, &mut rec).unwrap();
                    pulls += 1;
                }
                Msg::Swap(name, cfg) => {
                    shard.swap_policy(&builtin_module(name), &cfg, &shard.levelling(), now, &mut rec).unwrap()
                }
            }
        }
        (
            shard.values()[0],
            pushes,
            pulls,
            rec.acked.len() as u64,
            rec.served.len() as u64,
            shard.stats().swaps,
        )
    });
    let producers: Vec<_> = (0..N)
        .map(|w| {
            let tx = tx.clone();
            thread::spawn(move || {
                for i in 0..200 {
                    tx.send(Msg::Pull(w, i)).unwrap();
                    tx.send(Msg::Push(w, i)).unwrap();
                }
            })
        })
        .collect();
    let controller = {
        let tx = tx.clone();
        thread::spawn(move || {
            for k in 0..20 {
                let (name, cfg) =
                    if k % 2 == 0 { ("ssp", config(&[("s", "1000")])) } else { ("asp", vec![]) };
                tx.send(Msg::Swap(name, cfg)).unwrap();
                thread::yield_now();
            }
        })
    };
    for p in producers {
        p.join().unwrap();
    }
    controller.join().unwrap();
    drop(tx);
    let (value, pushes, pulls, acked, served, swaps) = owner.join().unwrap();
    assert_eq!(pushes, u64::from(N) * 200);
    assert_eq!(acked, pushes, "every push acknowledged");
    assert_eq!(served, pulls, "every pull answered (the bound never binds)");
    assert_eq!(swaps, 20);
    assert_eq!(value, -(pushes as f32) / N as f32, "every push applied exactly once");
}

#[test]
fn a_stateful_policy_takes_its_state_across_a_swap() {
    // The hostile policy counts the pushes and pulls it has seen and exports the count. Armed to
    // panic on pulls after 21 events, the incoming instance panics on the third event after the
    // swap only if it inherited the outgoing instance's count of 20.
    let mut rec = Recorder::default();
    let cfg = ShardConfig { optimizer: exact_sgd(), ..ShardConfig::default() };
    let hostile = hostile_module();
    let mut shard = Shard::new(cfg, vec![0.0], &hostile, &config(&[("mode", "none")]), &mut rec).unwrap();
    shard.join(0, 0, &mut rec).unwrap();
    shard.join(1, 0, &mut rec).unwrap();
    let now = std::cell::Cell::new(0u64);
    let step = |shard: &mut Shard, rec: &mut Recorder, worker: u32, iteration: u64, push: bool| {
        now.set(now.get() + 1);
        let now = now.get();
        if push {
            shard
                .push(
                    PushRequest {
                        worker,
                        iteration,
                        samples: 1,
                        grad: vec![1.0],
                        based_on: None,
                        tasks: None,
                        local_steps: 0,
                        signals: Default::default(),
                    },
                    now,
                    rec,
                )
                .unwrap();
        } else {
            shard.pull(PullRequest { worker, iteration }, now, rec).unwrap();
        }
    };
    for i in 0..5 {
        for w in 0..2 {
            step(&mut shard, &mut rec, w, i, false);
            step(&mut shard, &mut rec, w, i, true);
        }
    }
    assert_eq!(rec.metrics, vec![("started_at_ns".to_owned(), 0.0)], "a shard starts at time 0");
    shard
        .swap_policy(&hostile, &config(&[("mode", "pull:panic"), ("after", "21")]), &[], now.get(), &mut rec)
        .unwrap();
    assert_eq!(rec.metrics[1], ("started_at_ns".to_owned(), 20.0), "on_start sees the swap's time");
    step(&mut shard, &mut rec, 0, 5, false); // event 21
    step(&mut shard, &mut rec, 0, 5, true); // event 22: a push, not armed
    assert!(rec.errors.is_empty(), "{:?}", rec.errors);
    step(&mut shard, &mut rec, 1, 5, false); // event 23: a pull past 21
    assert_eq!(rec.errors.len(), 1, "the count of 20 came across the swap");
    assert!(matches!(rec.errors[0], PolicyError::Panic { .. }), "{}", rec.errors[0]);
}
