//! The worker machine on its own: the order of its actions, task hand-overs in both directions,
//! the emulated device, pauses and stops, driven by hand as any driver would.

use syncopate_policy_sdk::abi::Control;

use super::*;

const MS: u64 = 1_000_000;

fn machine(iterations: u64, device: Device) -> WorkerMachine {
    let cfg = WorkerConfig {
        id: 1,
        start: 0,
        iterations,
        batch: 32,
        part: 1,
        can_split: true,
        numbering_shared: true,
        device,
        tokens_per_sample: 0,
    };
    WorkerMachine::new(cfg, 0).unwrap()
}

fn actions(m: &mut WorkerMachine, now: u64) -> Vec<Action> {
    std::iter::from_fn(|| m.poll_action(now)).collect()
}

fn computed(samples: u32) -> Input {
    Input::Computed { step: Some(StepStats { samples, loss: 0.5 }), compute_ns: 0 }
}

fn own_pushed() -> Input {
    Input::Pushed { kind: JobKind::Own, result: Ok(0) }
}

fn control(control: Control) -> Input {
    Input::Control(ControlMessage::plain(0, control))
}

#[test]
fn an_iteration_is_pull_compute_push_report_then_the_next_and_finally_leave() {
    let mut m = machine(2, Device::default());
    assert_eq!(actions(&mut m, 0), [Action::Pull { iteration: 0 }]);
    m.handle(5, Input::Pulled { deferred: true, deferred_ns: 3, local_steps: 0 }).unwrap();
    let a = actions(&mut m, 5);
    assert!(matches!(&a[..], [Action::Compute(j)] if j.whole && j.kind == JobKind::Own), "{a:?}");
    m.handle(5, computed(32)).unwrap();
    let a = actions(&mut m, 5);
    assert!(matches!(&a[..], [Action::Push(p)] if p.tasks.is_none() && p.samples == 32), "{a:?}");
    m.handle(9, own_pushed()).unwrap();
    let a = actions(&mut m, 9);
    assert!(
        matches!(&a[..], [Action::Finished(r), Action::Pull { iteration: 1 }] if r.iteration == 0),
        "{a:?}"
    );
    m.handle(10, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(&mut m, 10);
    m.handle(10, computed(32)).unwrap();
    actions(&mut m, 10);
    m.handle(12, own_pushed()).unwrap();
    let a = actions(&mut m, 12);
    assert!(matches!(&a[..], [Action::Finished(_), Action::Leave]), "{a:?}");
    let r = m.report();
    assert_eq!(
        (r.iterations, r.deferred_pulls, r.deferred_ns, r.wait_ns),
        (2, 1, 3, 6),
        "pulls took 5 and 1"
    );
    assert!(m.is_done());
    // An input it is not waiting for is a driver bug, reported as such.
    assert!(matches!(m.handle(13, own_pushed()), Err(WorkerError::Unexpected { .. })));
}

#[test]
fn a_hand_over_yields_exactly_the_tasks_not_started_and_the_push_covers_the_rest() {
    let mut m = machine(5, Device::default());
    m.handle(0, control(Control::SetTaskShare { tasks: 4 })).unwrap();
    let a = actions(&mut m, 0);
    assert!(matches!(a[0], Action::Applied { iteration: 0, .. }), "applies from the next iteration: {a:?}");
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    let a = actions(&mut m, 1);
    assert!(
        matches!(&a[..], [Action::Compute(j)] if j.work.tasks == (0..1) && j.first_of_iteration),
        "task 0 starts: {a:?}"
    );
    // While task 0 computes, worker 2 asks for tasks 0..4: only 1..4 are not started.
    let ask = ControlMessage {
        yield_to: Some(2),
        ..ControlMessage::plain(0, Control::MoveTasks { from: 1, iteration: 0, first: 0, count: 4 })
    };
    m.handle(2, Input::Control(ask)).unwrap();
    let a = actions(&mut m, 2);
    let [Action::Handover { handover: h, .. }] = &a[..] else { panic!("{a:?}") };
    assert_eq!((h.to, h.first, h.count, h.split.total, h.split.part), (2, 1, 3, 4, 1));
    m.handle(3, computed(8)).unwrap();
    let a = actions(&mut m, 3);
    let [Action::Push(p)] = &a[..] else { panic!("no more tasks of ours to compute: {a:?}") };
    assert_eq!(p.tasks, Some(TaskPart { mask: 0b0001, total: 4 }));
    assert_eq!((p.samples, p.mean_over), (8, Some(8)));
    assert_eq!(m.report().tasks_given, 3);
}

#[test]
fn moved_tasks_are_computed_between_own_work_and_pushed_for_their_owner() {
    let mut m = machine(1, Device { compute_ns: 10 * MS, granularity_ns: 0, ..Device::default() });
    assert_eq!(actions(&mut m, 0), [Action::Pull { iteration: 0 }]);
    let split = MovedTasks { total: 8, batch: 32, part: 0 };
    let moved = ControlMessage {
        moved: Some(split),
        ..ControlMessage::plain(1, Control::MoveTasks { from: 0, iteration: 3, first: 6, count: 2 })
    };
    // It arrives while our pull waits: it is computed at once, on the model last pulled.
    m.handle(1, Input::Control(moved)).unwrap();
    let a = actions(&mut m, 1);
    let [Action::Compute(j)] = &a[..] else { panic!("{a:?}") };
    assert_eq!(
        (j.kind, j.work.iteration, j.work.part, j.work.tasks.clone(), j.work.total),
        (JobKind::Help { owner: 0 }, 3, 0, 6..8, 8)
    );
    m.handle(1, computed(8)).unwrap();
    // 8 of 32 samples: a quarter of the emulated 10 ms.
    assert_eq!(actions(&mut m, 1), []);
    assert_eq!(m.poll_timeout(), Some(1 + 10 * MS / 4));
    // Our pull is answered meanwhile; our own compute waits for the device.
    m.handle(2, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    assert_eq!(actions(&mut m, 2), []);
    m.handle(1 + 10 * MS / 4, Input::Timer).unwrap();
    let a = actions(&mut m, 1 + 10 * MS / 4);
    let [Action::Push(p)] = &a[..] else { panic!("{a:?}") };
    assert_eq!((p.owner, p.iteration, p.tasks), (0, 3, Some(TaskPart { mask: 0b1100_0000, total: 8 })));
    m.handle(3 * MS, Input::Pushed { kind: JobKind::Help { owner: 0 }, result: Ok(0) }).unwrap();
    let a = actions(&mut m, 3 * MS);
    assert!(matches!(&a[..], [Action::Compute(j)] if j.kind == JobKind::Own), "now our own: {a:?}");
    assert_eq!(m.report().tasks_helped, 2);
}

#[test]
fn a_pause_delays_the_next_pull_and_a_stop_ends_after_the_iteration() {
    let mut m = machine(10, Device { jitter_ms: Some((5.0, 0.0)), ..Device::default() });
    actions(&mut m, 0);
    m.handle(0, control(Control::Pause { for_ns: 50 * MS })).unwrap();
    assert!(matches!(actions(&mut m, 0)[..], [Action::Applied { iteration: 1, .. }]));
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(&mut m, 1);
    m.handle(1, computed(32)).unwrap();
    // The jitter (5 ms, no spread) comes after computing, before pushing.
    assert_eq!(actions(&mut m, 1), []);
    assert_eq!(m.poll_timeout(), Some(1 + 5 * MS));
    m.handle(1 + 5 * MS, Input::Timer).unwrap();
    assert!(matches!(actions(&mut m, 1 + 5 * MS)[..], [Action::Push(_)]));
    m.handle(6 * MS, own_pushed()).unwrap();
    assert!(matches!(actions(&mut m, 6 * MS)[..], [Action::Finished(_)]), "paused: no pull yet");
    assert_eq!(m.poll_timeout(), Some(50 * MS));
    m.handle(50 * MS, Input::Stop).unwrap();
    assert_eq!(actions(&mut m, 50 * MS), [Action::Leave]);
    assert!(m.report().stopped_early);
    assert_eq!(m.report().iterations, 1);
}

#[test]
fn a_skip_abandons_the_computation_in_progress_tells_the_shards_and_is_acknowledged_once_done() {
    let mut m = machine(10, Device::default());
    assert_eq!(actions(&mut m, 0), [Action::Pull { iteration: 0 }]);
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    assert!(matches!(actions(&mut m, 1)[..], [Action::Compute(_)]));
    // The skip arrives mid-computation: the gradient, once computed, is not pushed.
    m.handle(2, control(Control::SkipTo { iteration: 4 })).unwrap();
    assert_eq!(actions(&mut m, 2), [], "nothing to do until the computation returns");
    m.handle(3, computed(32)).unwrap();
    let a = actions(&mut m, 3);
    let applied = Action::Applied { shard: 0, control: Control::SkipTo { iteration: 4 }, iteration: 4 };
    assert_eq!(a, [Action::Skip { from: 0, to: 4 }, applied, Action::Pull { iteration: 4 }], "{a:?}");
    assert_eq!((m.report().iterations, m.report().iterations_skipped), (0, 4));
    // A skip to where it already is changes nothing and is acknowledged at once.
    m.handle(4, control(Control::SkipTo { iteration: 3 })).unwrap();
    let a = actions(&mut m, 4);
    assert!(matches!(a[..], [Action::Applied { iteration: 5, .. }]), "{a:?}");
    assert_eq!(m.report().iterations_skipped, 4);
}

#[test]
fn a_push_already_sent_completes_before_the_skip() {
    let mut m = machine(10, Device::default());
    actions(&mut m, 0);
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(&mut m, 1);
    m.handle(2, computed(32)).unwrap();
    assert!(matches!(actions(&mut m, 2)[..], [Action::Push(_)]));
    m.handle(3, control(Control::SkipTo { iteration: 6 })).unwrap();
    assert_eq!(actions(&mut m, 3), []);
    m.handle(4, own_pushed()).unwrap();
    let a = actions(&mut m, 4);
    assert!(
        matches!(&a[..], [Action::Finished(r), Action::Skip { from: 1, to: 6 }, Action::Applied { .. }, Action::Pull { iteration: 6 }] if r.iteration == 0),
        "the pushed iteration counts, then the skip: {a:?}"
    );
    assert_eq!((m.report().iterations, m.report().iterations_skipped), (1, 5));
}

/// An iteration of local steps is computed whole even with a task share set, hands no task
/// over, pushes its pseudo-gradient marked with its steps, and counts them; the next iteration
/// takes what its own pull says.
#[test]
fn an_iteration_takes_the_local_steps_its_pull_said_whole_and_pushes_them_marked() {
    let mut m = machine(2, Device::default());
    m.handle(0, control(Control::SetTaskShare { tasks: 4 })).unwrap();
    actions(&mut m, 0);
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 8 }).unwrap();
    let a = actions(&mut m, 1);
    let [Action::Compute(j)] = &a[..] else { panic!("{a:?}") };
    assert!(j.whole && j.local_steps == 8, "{j:?}");
    let ask = ControlMessage {
        yield_to: Some(2),
        ..ControlMessage::plain(0, Control::MoveTasks { from: 1, iteration: 0, first: 0, count: 4 })
    };
    m.handle(2, Input::Control(ask)).unwrap();
    let a = actions(&mut m, 2);
    assert!(matches!(&a[..], [Action::Handover { handover, .. }] if handover.count == 0), "{a:?}");
    m.handle(3, computed(8 * 32)).unwrap();
    let a = actions(&mut m, 3);
    let [Action::Push(p)] = &a[..] else { panic!("{a:?}") };
    assert_eq!((p.tasks, p.mean_over, p.local_steps, p.samples), (None, None, 8, 256));
    m.handle(4, own_pushed()).unwrap();
    actions(&mut m, 4);
    m.handle(5, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    let a = actions(&mut m, 5);
    assert!(matches!(&a[..], [Action::Compute(j)] if j.local_steps == 0 && !j.whole), "{a:?}");
    let r = m.report();
    assert_eq!((r.iterations, r.steps, r.local_iterations), (1, 8, 1));
}

/// `H` local steps of plain SGD at learning rate 1 on the counter workload move the model by
/// `H` times the worker's value: the pseudo-gradient is exactly that, from the pulled model.
#[test]
fn local_steps_leave_the_pseudo_gradient_of_the_inner_optimizer() {
    use syncopate_policy_sdk::optimizer::OptimizerConfig;
    use syncopate_workloads::counter::Counter;
    let mut bufs = Buffers::new(3, false);
    bufs.params.copy_from_slice(&[10.0, 0.0, -4.0]);
    bufs.set_inner_optimizer(OptimizerConfig::AVERAGING);
    let job = ComputeJob {
        kind: JobKind::Own,
        work: syncopate_workloads::Tasks { part: 2, iteration: 0, batch: 4, tasks: 0..1, total: 1 },
        whole: true,
        first_of_iteration: false,
        local_steps: 5,
    };
    let step = bufs.compute(2, &job, Some(&mut Counter::new(3))).unwrap();
    assert_eq!(step.samples, 20);
    assert_eq!(bufs.grad, [15.0; 3], "5 steps of worker 2's value, 3");
    assert_eq!(bufs.params, [-5.0, -15.0, -19.0], "the local model reached");
    // With momentum, the inner optimizer's velocity carries over to the next iteration.
    let cfg = OptimizerConfig { lr: 1.0, momentum: 0.5, weight_decay: 0.0, nesterov: false };
    bufs.set_inner_optimizer(cfg);
    bufs.params.fill(0.0);
    let one = ComputeJob { local_steps: 1, ..job };
    bufs.compute(0, &one, Some(&mut Counter::new(3))).unwrap();
    assert_eq!(bufs.grad, [1.0; 3]);
    bufs.params.fill(0.0);
    bufs.compute(0, &one, Some(&mut Counter::new(3))).unwrap();
    assert_eq!(bufs.grad, [1.5; 3], "v = 0.5 * 1 + 1");
}

/// Runs `m` to its own push of the iteration it is on (from its pull), at `now`.
fn to_push(m: &mut WorkerMachine, now: u64) {
    actions(m, now);
    m.handle(now, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(m, now);
    m.handle(now, computed(32)).unwrap();
    let a = actions(m, now);
    assert!(matches!(&a[..], [Action::Push(_)]), "{a:?}");
}

#[test]
fn the_next_pull_is_promised_only_while_nothing_can_change_it() {
    let mut m = machine(3, Device::default());
    assert_eq!(m.next_pull_if_quiet(), None, "no push in progress");
    to_push(&mut m, 0);
    assert_eq!(m.next_pull_if_quiet(), Some(1));
    m.handle(1, own_pushed()).unwrap();
    let a = actions(&mut m, 1);
    assert!(matches!(&a[..], [Action::Finished(_), Action::Pull { iteration: 1 }]), "as promised: {a:?}");
    assert_eq!(m.next_pull_if_quiet(), None, "pulling, not pushing");
    // A skip, a pause or a stop that comes in while pushing withdraws the promise.
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(&mut m, 1);
    m.handle(1, computed(32)).unwrap();
    actions(&mut m, 1);
    assert_eq!(m.next_pull_if_quiet(), Some(2));
    m.handle(2, control(Control::Pause { for_ns: 50 * MS })).unwrap();
    assert_eq!(m.next_pull_if_quiet(), None, "paused");
    m.handle(60 * MS, own_pushed()).unwrap();
    to_push(&mut m, 60 * MS);
    assert_eq!(m.next_pull_if_quiet(), None, "the budget ends with this iteration");
    let mut m = machine(5, Device::default());
    to_push(&mut m, 0);
    m.handle(0, control(Control::SkipTo { iteration: 3 })).unwrap();
    assert_eq!(m.next_pull_if_quiet(), None, "a skip is pending");
    let mut m = machine(5, Device::default());
    to_push(&mut m, 0);
    m.handle(0, Input::Stop).unwrap();
    assert_eq!(m.next_pull_if_quiet(), None, "stopping");
}

#[test]
fn a_pull_that_waits_is_told_to_the_shards_once_and_so_is_its_end() {
    let mut m = machine(3, Device::default());
    assert_eq!(actions(&mut m, 0), [Action::Pull { iteration: 0 }]);
    assert_eq!(m.poll_timeout(), Some(WAIT_NOTICE_NS), "it wakes to tell the shards");
    assert_eq!(actions(&mut m, WAIT_NOTICE_NS - 1), []);
    m.handle(WAIT_NOTICE_NS, Input::Timer).unwrap();
    assert_eq!(actions(&mut m, WAIT_NOTICE_NS), [Action::Waiting { iteration: 0, waiting: true }]);
    assert_eq!(m.poll_timeout(), None, "told once");
    m.handle(2 * WAIT_NOTICE_NS, Input::Pulled { deferred: true, deferred_ns: 1, local_steps: 0 }).unwrap();
    let a = actions(&mut m, 2 * WAIT_NOTICE_NS);
    assert!(
        matches!(&a[..], [Action::Waiting { iteration: 0, waiting: false }, Action::Compute(_)]),
        "its end before the computation: {a:?}"
    );
    // A pull answered in time is told nobody.
    let t = 2 * WAIT_NOTICE_NS;
    m.handle(t, computed(32)).unwrap();
    actions(&mut m, t);
    m.handle(t + 1, own_pushed()).unwrap();
    assert!(matches!(actions(&mut m, t + 1)[..], [Action::Finished(_), Action::Pull { iteration: 1 }]));
    m.handle(t + 2, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    assert!(matches!(actions(&mut m, t + 2)[..], [Action::Compute(_)]));
    m.handle(t + 3, computed(32)).unwrap();
    actions(&mut m, t + 3);
    m.handle(t + 4, own_pushed()).unwrap();
    actions(&mut m, t + 4);
    // A pull given up at a stop after its notice: its end is told too.
    m.handle(t + 4 + WAIT_NOTICE_NS, Input::Timer).unwrap();
    assert_eq!(actions(&mut m, t + 4 + WAIT_NOTICE_NS), [Action::Waiting { iteration: 2, waiting: true }]);
    m.handle(t + 5 + WAIT_NOTICE_NS, Input::Stop).unwrap();
    let a = actions(&mut m, t + 5 + WAIT_NOTICE_NS);
    assert_eq!(a, [Action::Waiting { iteration: 2, waiting: false }, Action::Leave], "{a:?}");
}

/// A refusal of the worker's own push ends it with the shard's reason, typed: a driver can
/// tell a NaN from an iteration out of order without reading a sentence.
#[test]
fn a_refused_own_push_ends_the_worker_with_the_shards_typed_reason() {
    use crate::shard::{RequestError, ShardError};
    let mut m = machine(2, Device::default());
    actions(&mut m, 0);
    m.handle(1, Input::Pulled { deferred: false, deferred_ns: 0, local_steps: 0 }).unwrap();
    actions(&mut m, 1);
    m.handle(1, computed(32)).unwrap();
    actions(&mut m, 1);
    let nan = RequestError::Shard(ShardError::NonFinite(1, 0));
    let refused = Input::Pushed { kind: JobKind::Own, result: Err(PushFailed::Refused(nan.clone())) };
    assert_eq!(
        m.handle(2, refused),
        Err(WorkerError::PushRefused { iteration: 0, why: PushFailed::Refused(nan) })
    );
}
