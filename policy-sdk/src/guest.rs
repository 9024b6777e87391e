//! The guest side of the ABI: decodes host input from the guest buffer, calls the [`Policy`], and
//! encodes its decisions. The `export_policy!` macro wires these to wasm exports; the native
//! [`Driver`](crate::testing::Driver) calls the very same functions over bytes, so native tests
//! exercise the real codec. Not part of the author-facing API.

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::cell::RefCell;

use crate::abi::{self, Decision, Envelope, Event, Handoff, InitArgs};
use crate::config::Config;
use crate::{Ctx, Init, Policy, PullVerdict, PushVerdict};

/// One policy instance plus its input and output buffers.
#[derive(Debug)]
pub struct Guest<P> {
    policy: Option<P>,
    input: Vec<u8>,
    output: Encoder,
}

impl<P: Policy> Default for Guest<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Policy> Guest<P> {
    /// No instance yet; empty buffers.
    pub const fn new() -> Self {
        Guest { policy: None, input: Vec::new(), output: Encoder::new() }
    }

    /// A buffer of at least `len` bytes for the host's next input. It only moves when it grows.
    pub fn buffer(&mut self, len: usize) -> *mut u8 {
        grow(&mut self.input, len)
    }

    /// The policy's info.
    pub fn info(&mut self) -> &[u8] {
        self.output.clear();
        self.output.push(&P::INFO);
        self.output.as_slice()
    }

    /// Creates the instance from [`InitArgs`] in the buffer; answers `Result<(), String>` and the
    /// start-up decisions.
    pub fn init(&mut self, len: usize) -> &[u8] {
        install_panic_hook();
        self.output.clear();
        let created = create(&self.input[..len], false, |args, _| P::new(&make_init::<P>(args)?));
        self.start(created)
    }

    /// Creates the instance from [`InitArgs`] and a [`Handoff`] in the buffer.
    pub fn import(&mut self, len: usize) -> &[u8] {
        install_panic_hook();
        self.output.clear();
        let created = create(&self.input[..len], true, |args, handoff| {
            P::import_state(&make_init::<P>(args)?, handoff.expect("decoded"))
        });
        self.start(created)
    }

    /// Answers a creation: `Ok` and the decisions `on_start` makes at host time `now_ns`, or
    /// the refusal.
    fn start(&mut self, created: Result<(P, u64), String>) -> &[u8] {
        match created {
            Ok((mut policy, now_ns)) => {
                self.output.push(&Ok::<(), String>(()));
                let mut ctx = Ctx::new(now_ns, 0, Default::default(), &mut self.output);
                policy.on_start(&mut ctx);
                self.policy = Some(policy);
            }
            Err(reason) => self.output.push(&Err::<(), String>(reason)),
        }
        self.output.as_slice()
    }

    /// Handles the [`Envelope`] in the buffer; answers a run of decisions.
    ///
    /// # Panics
    /// If the host sends an event before a successful init, or malformed bytes: both are host
    /// bugs, and a panic becomes a trap the host reports.
    pub fn event(&mut self, len: usize) -> &[u8] {
        self.output.clear();
        let env = match Envelope::from_bytes(&self.input[..len]) {
            Ok(env) => env,
            Err(e) => panic!("malformed event from host: {e}"),
        };
        let Some(policy) = self.policy.as_mut() else {
            panic!("event before the policy was initialised");
        };
        handle(policy, &env, &mut self.output);
        self.output.as_slice()
    }

    /// The instance's exported state.
    pub fn export(&mut self) -> &[u8] {
        self.output.clear();
        if let Some(policy) = &self.policy {
            self.output.set(&policy.export_state());
        }
        self.output.as_slice()
    }
}

/// Grows a guest input buffer to at least `len` bytes (it only moves when it grows); its
/// address, for the host to write into.
pub fn grow(input: &mut Vec<u8>, len: usize) -> *mut u8 {
    if input.len() < len {
        input.resize(len.next_power_of_two(), 0);
    }
    input.as_mut_ptr()
}

/// Decodes a creation's input (the [`InitArgs`], then a [`Handoff`] when `handoff`) and makes
/// the instance with `make`; with the host time it was created at. Shard and cluster policies
/// alike.
pub fn create<T>(
    bytes: &[u8],
    handoff: bool,
    make: impl FnOnce(&InitArgs<'_>, Option<&Handoff<'_>>) -> Result<T, String>,
) -> Result<(T, u64), String> {
    let (args, rest) = postcard::take_from_bytes::<InitArgs<'_>>(bytes)
        .map_err(|e| alloc::format!("malformed init arguments: {e}"))?;
    let handed = match handoff {
        true => Some(
            postcard::from_bytes::<Handoff<'_>>(rest)
                .map_err(|e| alloc::format!("malformed handoff: {e}"))?,
        ),
        false => None,
    };
    make(&args, handed.as_ref()).map(|t| (t, args.now_ns))
}

fn make_init<P: Policy>(args: &InitArgs<'_>) -> Result<Init, String> {
    let config = Config::validate(P::INFO.params, &args.config)?;
    Ok(Init { shard: args.shard, shards: args.shards, config })
}

/// Dispatches one event to the policy's handlers and writes the decisions into `out`.
pub fn handle<P: Policy>(policy: &mut P, env: &Envelope, out: &mut Encoder) {
    let mut ctx = Ctx::new(env.now_ns, env.random, env.view, out);
    match &env.event {
        Event::Pull(pull) => {
            let decision = match policy.on_pull(&mut ctx, pull) {
                PullVerdict::Serve => Decision::ServePull { pull: pull.id },
                PullVerdict::Defer(until) => Decision::DeferPull { pull: pull.id, until },
            };
            ctx.emit(&decision);
        }
        Event::Push(push) => {
            let verdict = policy.on_push(&mut ctx, push);
            let decision = match verdict {
                PushVerdict::Admit => Decision::AdmitPush { push: push.id, weight: None },
                PushVerdict::AdmitWeighted(w) => Decision::AdmitPush { push: push.id, weight: Some(w) },
                PushVerdict::Hold => Decision::HoldPush { push: push.id },
                PushVerdict::Drop => Decision::DropPush { push: push.id },
                PushVerdict::Group(group) => Decision::AdmitToGroup { push: push.id, group, weight: None },
            };
            ctx.emit(&decision);
            policy.after_push(&mut ctx, push, verdict);
        }
        Event::WorkerJoined { worker, clock } => policy.on_worker_joined(&mut ctx, *worker, *clock),
        Event::WorkerLeft { worker, reason } => policy.on_worker_left(&mut ctx, *worker, *reason),
        Event::IterationFinished(report) => policy.on_iteration_finished(&mut ctx, report),
        Event::Timer { timer } => policy.on_timer(&mut ctx, *timer),
        Event::ControlApplied(applied) => policy.on_control_applied(&mut ctx, applied),
        Event::Measured { query, value } => policy.on_measured(&mut ctx, *query, *value),
    }
}

/// A reusable postcard output buffer. Its storage stays initialised and only grows, so encoding
/// an event or a decision neither allocates nor zero-fills once the buffer has grown to size.
#[derive(Debug, Default, Clone)]
pub struct Encoder {
    buf: Vec<u8>,
    len: usize,
}

impl Encoder {
    /// An empty encoder.
    pub const fn new() -> Self {
        Encoder { buf: Vec::new(), len: 0 }
    }

    /// Forgets the encoded bytes, keeping the storage.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends the encoding of `value`.
    ///
    /// # Panics
    /// If serialization fails for a reason other than space, which cannot happen for ABI types.
    pub fn push<T: serde::Serialize + ?Sized>(&mut self, value: &T) {
        loop {
            if self.buf.len() - self.len < 32 {
                self.grow();
            }
            match postcard::to_slice(value, &mut self.buf[self.len..]) {
                Ok(used) => {
                    self.len += used.len();
                    return;
                }
                Err(postcard::Error::SerializeBufferFull) => self.grow(),
                Err(e) => panic!("encoding failed: {e}"),
            }
        }
    }

    /// Replaces the content with `bytes`.
    pub fn set(&mut self, bytes: &[u8]) {
        self.len = 0;
        while self.buf.len() < bytes.len() {
            self.grow();
        }
        self.buf[..bytes.len()].copy_from_slice(bytes);
        self.len = bytes.len();
    }

    /// The encoded bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn grow(&mut self) {
        let n = (self.buf.len() * 2).max(256);
        self.buf.resize(n, 0);
    }
}

/// The encoding of `value` as a new vector (for one-off, off-hot-path uses).
pub fn encode<T: serde::Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut e = Encoder::new();
    e.push(value);
    e.as_slice().to_vec()
}

/// Packs a guest slice as the `i64` an export returns.
pub fn packed(bytes: &[u8]) -> i64 {
    abi::pack_ptr_len(bytes.as_ptr() as usize as u32, bytes.len() as u32)
}

std::thread_local! {
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn install_panic_hook() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    if cfg!(target_arch = "wasm32") {
        INSTALLED.call_once(|| {
            std::panic::set_hook(alloc::boxed::Box::new(|info| {
                LAST_PANIC.with_borrow_mut(|m| *m = info.to_string());
            }));
        });
    }
}

/// The message of the last panic, packed for the `sp_last_panic` export.
pub fn last_panic() -> i64 {
    LAST_PANIC.with_borrow(|m| packed(m.as_bytes()))
}
