//! Per-event policy cost, each built-in policy as wasm and as its native build side by side, and
//! the cost of a hot swap with state handoff.
//!
//! `event_round_trip/<policy>/wasm`: encode the envelope, copy it into the guest, call, let the
//! policy decide, copy the reply out and decode every decision. `.../native`: the same encode,
//! guest glue and decode, without wasm. Their ratio is the sandbox's price.
//!
//! `hot_swap/*`: replace a shard's policy (state exported, new instance created from it, start-up
//! decisions applied) from an already compiled module, and from precompiled bytes.
//!
//! `fuel_exhausted/default_budget`: a call that loops for ever, stopped when the default fuel
//! budget runs out: what that budget is in time here.
//!
//! `shard_push/<size>`: what a server does with a push once the whole gradient has arrived and
//! before it acknowledges it: the finite check, the policy's event (ASP, as wasm) and the SGD
//! step with the default momentum. The gradient buffer comes back for the next push, as the
//! server's pool does. A synchronous push waits for this in full (`docs/performance.md`).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use syncopate::runtime::{PolicyError, PolicyInstance, PolicyModule, PolicyRuntime, DEFAULT_CALL_FUEL};
use syncopate::shard::{Observer, PullReply, PushRequest, Shard, ShardConfig, ShardSink};
use syncopate_policy_sdk::abi::{Decision, Envelope, Event, InitArgs, Pull, ShardView};
use syncopate_policy_sdk::guest::{Encoder, Guest};
use syncopate_policy_sdk::Policy;
use syncopate_suite::{builtin_module, config, hostile_wasm, runtime, Recorder};

fn envelope(i: u64) -> Envelope {
    Envelope {
        now_ns: 1_000_000 + i,
        random: i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        view: ShardView { min_clock: 40, max_clock: 43, workers: 8 },
        event: Event::Pull(Pull { id: i, worker: 3, iteration: 42, clock: 42, version: 40 }),
    }
}

fn decode_all(mut bytes: &[u8]) -> usize {
    let mut n = 0;
    while !bytes.is_empty() {
        let (d, rest) = postcard::take_from_bytes::<Decision<'_>>(bytes).expect("decodes");
        black_box(d);
        bytes = rest;
        n += 1;
    }
    n
}

fn init_args<'a>(cfg: &'a [(&'a str, &'a str)]) -> InitArgs<'a> {
    InitArgs { shard: 0, shards: 1, now_ns: 0, config: cfg.to_vec() }
}

/// The native build of a policy, driven through the same guest glue and codec.
struct Native<P: Policy> {
    guest: Guest<P>,
    enc: Encoder,
}

impl<P: Policy> Native<P> {
    fn new(cfg: &[(&str, &str)]) -> Self {
        let mut n = Native { guest: Guest::new(), enc: Encoder::new() };
        n.enc.push(&init_args(cfg));
        let len = write(&mut n.guest, n.enc.as_slice());
        n.guest.init(len);
        n
    }

    fn event(&mut self, env: &Envelope) -> usize {
        let len = write(&mut self.guest, &env.to_bytes());
        decode_all(self.guest.event(len))
    }
}

/// Copies `bytes` into the guest's input buffer, as the host does for a wasm module.
fn write<P: Policy>(guest: &mut Guest<P>, bytes: &[u8]) -> usize {
    let ptr = guest.buffer(bytes.len());
    // SAFETY: `buffer` returned at least `bytes.len()` bytes owned by the guest.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
    bytes.len()
}

fn bench_policy<P: Policy>(c: &mut Criterion, name: &str, cfg: &[(&str, &str)]) {
    let mut group = c.benchmark_group(format!("event_round_trip/{name}"));
    let module: PolicyModule = builtin_module(name);
    let (mut inst, _) = PolicyInstance::new(&module, &init_args(cfg)).expect("starts");
    let mut i = 0u64;
    group.bench_function("wasm", |b| {
        b.iter(|| {
            i += 1;
            decode_all(inst.on_event(black_box(&envelope(i))).expect("decides"))
        })
    });
    let mut native = Native::<P>::new(cfg);
    group.bench_function("native", |b| {
        b.iter(|| {
            i += 1;
            native.event(black_box(&envelope(i)))
        })
    });
    group.finish();
}

fn event_round_trip(c: &mut Criterion) {
    bench_policy::<syncopate_policy_ssp::Ssp>(c, "ssp", &[("s", "3")]);
    bench_policy::<syncopate_policy_bsp::Bsp>(c, "bsp", &[]);
    bench_policy::<syncopate_policy_asp::Asp>(c, "asp", &[]);
    bench_policy::<syncopate_policy_dssp::Dssp>(c, "dssp", &[("s_lo", "3"), ("s_hi", "15")]);
    bench_policy::<syncopate_policy_fluentps::FluentPs>(
        c,
        "fluentps",
        &[("s", "3"), ("p", "1.0"), ("mode", "constant")],
    );
    bench_policy::<syncopate_policy_r2sp::R2sp>(
        c,
        "r2sp",
        &[("global_batch", "0"), ("min_batch", "8"), ("retune_ms", "2000")],
    );
    bench_policy::<syncopate_policy_epsp::Epsp>(
        c,
        "epsp",
        &[
            ("mode", "enforced"),
            ("s", "3"),
            ("tasks", "8"),
            ("moves", "true"),
            ("elastic", "true"),
            ("global_batch", "0"),
            ("share_ms", "2000"),
        ],
    );
}

fn hot_swap(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_swap");
    let ssp = builtin_module("ssp");
    let bsp = builtin_module("bsp");
    let mut rec = Recorder::default();
    let mut shard = Shard::new(ShardConfig::default(), vec![0.0; 1024], &bsp, &[], &mut rec).expect("starts");
    for w in 0..8 {
        shard.join(w, 0, &mut rec).expect("joins");
    }
    let ssp_cfg = config(&[("s", "3")]);
    let mut flip = false;
    group.bench_function("compiled_module", |b| {
        b.iter(|| {
            flip = !flip;
            let (m, cfg) = if flip { (&ssp, &ssp_cfg[..]) } else { (&bsp, &[][..]) };
            shard.swap_policy(m, cfg, &[], 0, &mut rec).expect("swaps");
        })
    });
    let ssp_bytes = ssp.precompiled().expect("serializes");
    let bsp_bytes = bsp.precompiled().expect("serializes");
    group.bench_function("precompiled_bytes", |b| {
        b.iter(|| {
            flip = !flip;
            let (bytes, digest, cfg) = if flip {
                (&ssp_bytes, ssp.sha256(), &ssp_cfg[..])
            } else {
                (&bsp_bytes, bsp.sha256(), &[][..])
            };
            // SAFETY: the bytes were produced by `precompiled` in this process.
            let m =
                unsafe { PolicyModule::from_precompiled(runtime(), "bench", bytes, digest) }.expect("loads");
            shard.swap_policy(&m, cfg, &[], 0, &mut rec).expect("swaps");
        })
    });
    group.finish();
}

/// Keeps the gradient buffer the shard hands back, for the next push.
#[derive(Default)]
struct Reuse {
    spare: Option<Vec<f32>>,
}

impl ShardSink for Reuse {
    fn pull_served(&mut self, _reply: PullReply<'_>) {}
}

impl Observer for Reuse {
    fn recycle(&mut self, buffer: Vec<f32>) {
        self.spare = Some(buffer);
    }
}

fn shard_push(c: &mut Criterion) {
    let mut group = c.benchmark_group("shard_push");
    let asp = builtin_module("asp");
    for (label, floats) in [("1MiB", 1 << 18), ("16MiB", 1 << 22)] {
        let mut sink = Reuse { spare: Some(vec![1e-3; floats]) };
        let mut shard =
            Shard::new(ShardConfig::default(), vec![0.5; floats], &asp, &[], &mut sink).expect("starts");
        shard.join(0, 0, &mut sink).expect("joins");
        let mut iteration = 0;
        group.throughput(criterion::Throughput::Bytes(4 * floats as u64));
        group.bench_function(label, |b| {
            b.iter(|| {
                let grad = sink.spare.take().expect("the last push's buffer came back");
                let req = PushRequest {
                    worker: 0,
                    iteration,
                    samples: 1,
                    grad,
                    based_on: None,
                    tasks: None,
                    local_steps: 0,
                    signals: Default::default(),
                };
                shard.push(req, iteration, &mut sink).expect("admitted");
                iteration += 1;
            })
        });
    }
    group.finish();
}

/// How long a call that loops for ever runs before the default fuel budget
/// ([`DEFAULT_CALL_FUEL`]) stops it: what the budget means in time on this machine.
fn fuel_exhausted(c: &mut Criterion) {
    let mut group = c.benchmark_group("fuel_exhausted");
    group.sample_size(10);
    let rt = PolicyRuntime::new().expect("wasm engine");
    let module = rt.compile("hostile.wasm", &hostile_wasm()).expect("compiles");
    let cfg = [("mode", "pull:loop"), ("after", "0")];
    group.bench_function("default_budget", |b| {
        b.iter(|| {
            // A fresh instance each time, as the shard restarts one that failed (this one's
            // state is left mid-call); starting it costs microseconds.
            let (mut instance, _) = PolicyInstance::new(&module, &init_args(&cfg)).expect("starts");
            let e = instance.on_event(&envelope(1)).expect_err("loops until its fuel runs out");
            assert!(matches!(e, PolicyError::OutOfFuel { fuel: DEFAULT_CALL_FUEL, .. }), "{e}");
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    targets = event_round_trip, hot_swap, shard_push, fuel_exhausted
}
criterion_main!(benches);
