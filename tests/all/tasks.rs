//! The shard's per-(worker, iteration) task accounting, on one real shard run by the real BSP
//! module: an iteration reaches the policy only when all its tasks are in, whoever computed
//! them, as the samples-weighted mean over the whole mini-batch; each task counts once.

use syncopate::shard::{PushRequest, Shard, ShardConfig, ShardError, TaskPart};
use syncopate_suite::{builtin_module, config, Recorder};

use crate::harness::exact_sgd;

fn shard(workers: u32) -> (Shard, Recorder) {
    let mut rec = Recorder::default();
    let cfg = ShardConfig { optimizer: exact_sgd(), ..ShardConfig::default() };
    let mut shard =
        Shard::new(cfg, vec![0.0; 2], &builtin_module("bsp"), &config(&[]), &mut rec).expect("starts");
    for w in 0..workers {
        shard.join(w, 0, &mut rec).expect("join");
    }
    (shard, rec)
}

fn part(worker: u32, iteration: u64, samples: u32, value: f32, tasks: Option<TaskPart>) -> PushRequest {
    PushRequest {
        worker,
        iteration,
        samples,
        grad: vec![value; 2],
        based_on: None,
        tasks,
        local_steps: 0,
        signals: Default::default(),
    }
}

#[test]
fn an_iteration_counts_once_all_its_tasks_are_in_as_the_mean_over_its_batch() {
    let (mut s, mut rec) = shard(1);
    // Worker 0's iteration 0 in 4 tasks: tasks 0-2 by itself (24 samples, gradient 1), task 3
    // moved to a helper (8 samples, gradient 5).
    s.push(part(0, 0, 24, 1.0, Some(TaskPart::range(0, 3, 4))), 1, &mut rec).expect("own part");
    assert_eq!(s.view().min_clock, 0, "incomplete: the policy has not seen it");
    assert_eq!(s.open_iterations(), vec![(0, 0)]);
    // Its next iteration, whole, waits behind the incomplete one.
    s.push(part(0, 1, 32, 2.0, None), 2, &mut rec).expect("next iteration");
    assert_eq!(s.view().min_clock, 0);
    // A task that already arrived is refused; nothing changes.
    let dup = s.push(part(0, 0, 8, 9.0, Some(TaskPart::range(2, 1, 4))), 3, &mut rec);
    assert!(matches!(dup, Err(ShardError::BadTasks { .. })), "{dup:?}");
    // The moved task arrives: iteration 0 completes, then iteration 1, in order.
    s.push(part(0, 0, 8, 5.0, Some(TaskPart::range(3, 1, 4))), 4, &mut rec).expect("moved task");
    assert_eq!(s.view().min_clock, 2);
    assert!(s.open_iterations().is_empty());
    // lr 1, one worker: the model moved by (24 * 1 + 8 * 5) / 32 = 2, then by 2.
    assert_eq!(s.values(), &[-4.0, -4.0]);
    assert_eq!(s.stats().pushes_admitted, 2, "one push per iteration, not per part");
}

#[test]
fn bad_task_sets_are_refused_and_a_leaving_worker_drops_its_parts() {
    let (mut s, mut rec) = shard(2);
    for bad in [
        TaskPart { mask: 0, total: 4 },
        TaskPart { mask: 0b10000, total: 4 },
        TaskPart { mask: 1, total: 65 },
    ] {
        let r = s.push(part(0, 0, 8, 1.0, Some(bad)), 1, &mut rec);
        assert!(matches!(r, Err(ShardError::BadTasks { .. })), "{bad:?}: {r:?}");
    }
    s.push(part(0, 0, 8, 1.0, Some(TaskPart::range(0, 1, 2))), 2, &mut rec).expect("part");
    let other_split = s.push(part(0, 0, 8, 1.0, Some(TaskPart::range(1, 1, 3))), 3, &mut rec);
    assert!(matches!(other_split, Err(ShardError::BadTasks { .. })), "{other_split:?}");
    s.leave(0, syncopate_policy_sdk::abi::LeaveReason::Failed, 4, &mut rec).expect("leave");
    assert!(s.open_iterations().is_empty());
    assert_eq!(s.values(), &[0.0, 0.0], "an incomplete iteration never reaches the model");
}
