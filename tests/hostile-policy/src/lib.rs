//! A policy that misbehaves on purpose, for the host's sandbox tests.
//!
//! `mode` picks the misbehaviour and `after` how many events it behaves (as BSP) before it
//! starts; with `every` = N it misbehaves only on every Nth event after that (a crash loop: it
//! behaves in between, and its count of events is part of its exported state, so a restart from
//! its checkpoint fails again N events on). With `skew` = 1, shard `s` misbehaves only on the
//! requests of worker `s` (modulo the live workers): different shards keep different workers
//! waiting, and no shard keeps them all. Every mode is something a buggy or hostile module could really do from inside the
//! sandbox: trap, spin forever, allocate without bound, panic, answer with decisions that
//! break the ABI's rules, or park a pull or hold a push and never let it go.

use std::hint::black_box;
use syncopate_policy_sdk::prelude::*;

/// The misbehaving policy.
#[derive(Debug)]
pub struct Hostile {
    mode: String,
    after: u64,
    every: u64,
    skew: bool,
    shard: u32,
    seen: u64,
    hoard: Vec<Vec<u8>>,
}

impl Hostile {
    fn bsp(ctx: &Ctx<'_>, pull: &Pull) -> PullVerdict {
        if ctx.view().min_clock >= pull.clock {
            PullVerdict::Serve
        } else {
            PullVerdict::Defer(Release::MinClockAtLeast(pull.clock))
        }
    }

    /// Whether to misbehave on this event of `worker`'s (of a kind `on`).
    fn armed_for(&mut self, on: &str, ctx: &Ctx<'_>, worker: WorkerId) -> bool {
        let armed = self.armed(on);
        let workers = ctx.view().workers.max(1);
        armed && (!self.skew || worker % workers == self.shard % workers)
    }

    fn armed(&mut self, on: &str) -> bool {
        self.seen += 1;
        let past = self.seen > self.after;
        let due = past && (self.every == 0 || (self.seen - self.after).is_multiple_of(self.every));
        due && self.mode.starts_with(on)
    }

    fn misbehave(&mut self, ctx: &mut Ctx<'_>, own_request: RequestId) {
        match self.mode.split_once(':').map_or(self.mode.as_str(), |m| m.1) {
            "trap" => trap(),
            "loop" => {
                let mut x = 0u64;
                loop {
                    x = black_box(x.wrapping_add(1));
                }
            }
            // Reserved, not written: growing memory costs a few instructions, so the cap, not the
            // fuel budget, stops it.
            "bomb" => loop {
                self.hoard.push(black_box(Vec::with_capacity(1 << 20)));
            },
            "panic" => panic!("hostile policy panics on purpose"),
            "release-unknown" => ctx.release_pull(own_request + 1_000_000),
            "admit-unknown" => ctx.admit_push(own_request + 1_000_000),
            "control-stranger" => ctx.control(4242, Control::Resume),
            _ => {}
        }
    }
}

/// Executes `unreachable` on wasm32 (a trap); aborts natively.
fn trap() -> ! {
    #[cfg(target_arch = "wasm32")]
    core::arch::wasm32::unreachable();
    #[cfg(not(target_arch = "wasm32"))]
    std::process::abort();
}

impl Policy for Hostile {
    const INFO: PolicyInfo = PolicyInfo::new(
        "hostile",
        "0.0.0",
        "Misbehaves on purpose (tests only).",
        &[
            ParamSpec::new("mode", ParamKind::Text, "none", "pull:MODE or push:MODE, MODE one of trap, loop, bomb, panic, release-unknown, admit-unknown, control-stranger; pull:park (never released), push:hold (never admitted); or refuse-state"),
            ParamSpec::new("after", ParamKind::Uint, "0", "events to behave before misbehaving"),
            ParamSpec::new("every", ParamKind::Uint, "0", "misbehave only on every Nth event after that (0: on every one)"),
            ParamSpec::new("skew", ParamKind::Uint, "0", "1: on shard s, misbehave only on worker s's requests (modulo the live workers)"),
        ],
    );

    fn new(init: &Init) -> Result<Self, String> {
        Ok(Hostile {
            mode: init.config.get("mode")?,
            after: init.config.get("after")?,
            every: init.config.get("every")?,
            skew: init.config.get::<u64>("skew")? == 1,
            shard: init.shard,
            seen: 0,
            hoard: Vec::new(),
        })
    }

    fn on_start(&mut self, ctx: &mut Ctx<'_>) {
        ctx.set_update_mode(UpdateMode::Aggregate);
        ctx.metric("started_at_ns", ctx.now_ns() as f64);
    }

    fn on_pull(&mut self, ctx: &mut Ctx<'_>, pull: &Pull) -> PullVerdict {
        if self.armed_for("pull:", ctx, pull.worker) {
            if self.mode == "pull:park" {
                // Parked until released, and never released.
                return PullVerdict::Defer(Release::Explicit);
            }
            self.misbehave(ctx, pull.id);
        }
        Self::bsp(ctx, pull)
    }

    fn on_push(&mut self, ctx: &mut Ctx<'_>, push: &Push) -> PushVerdict {
        if self.armed_for("push:", ctx, push.worker) {
            if self.mode == "push:hold" {
                // Held, and never admitted.
                return PushVerdict::Hold;
            }
            self.misbehave(ctx, push.id);
        }
        PushVerdict::Admit
    }

    fn export_state(&self) -> Vec<u8> {
        self.seen.to_le_bytes().to_vec()
    }

    fn import_state(init: &Init, handoff: &Handoff<'_>) -> Result<Self, String> {
        let mut me = Self::new(init)?;
        if me.mode == "refuse-state" && handoff.from_name != "hostile" {
            return Err(format!("cannot take over from `{}`", handoff.from_name));
        }
        if handoff.from_name == "hostile" {
            if let Ok(bytes) = <[u8; 8]>::try_from(handoff.state) {
                me.seen = u64::from_le_bytes(bytes);
            }
        }
        Ok(me)
    }
}

syncopate_policy_sdk::export_policy!(Hostile);
