//! Which codec a tensor crosses the wire in: a policy chooses one per shard for pushes
//! ([`crate::abi::Control::SetPushCodec`], sent to each worker) and one for pulls
//! ([`crate::abi::Decision::SetPullCodec`]). This is the
//! name and its bounds; the host's engine does the encoding (`syncopate_engine::codec`), for
//! the workers (Rust and Python alike) and the servers.
//!
//! Text forms, as policy parameters and the command line take them: `none`, `fp16`, `bf16`,
//! `int8` (blocks of 256 values) or `int8-B` (blocks of `B`), `topk-F` (the fraction `F` of the
//! values with the largest magnitudes, e.g. `topk-0.01`), `sparseloco-F` or `sparseloco-F-B`
//! (SparseLoCo's: the fraction `F` of each chunk of 4,096 values, in 2 bits each, with error
//! feedback decayed by `B`, 0.95 by default; e.g. `sparseloco-0.02`).

use alloc::collections::BTreeSet;
use alloc::format;
use alloc::string::String;
use core::fmt;
use core::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::abi::{Control, ParamKind, ParamSpec, WorkerId};
use crate::{Config, Ctx};

/// A codec for tensors on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Codec {
    /// float32, as computed: 4 bytes a value.
    #[default]
    None,
    /// IEEE half precision: 2 bytes a value (values beyond ±65504 become infinite, so a shard
    /// refuses them as it refuses any non-finite gradient).
    Fp16,
    /// bfloat16 (float32's range, 8 bits of mantissa): 2 bytes a value.
    Bf16,
    /// 8-bit integers in blocks of `block` values, each block with its own float32 scale
    /// (its largest magnitude over 127): about 1 byte a value.
    Int8 {
        /// Values per block (16 to 65,536).
        block: u32,
    },
    /// The `ppm` millionths of the values with the largest magnitudes, as (index, value) pairs:
    /// 8 bytes a value kept. Pushes only; the worker keeps what it did not send and adds it to
    /// its next push (error feedback).
    TopK {
        /// Parts per million of the values kept (1 to 1,000,000), at least one value.
        ppm: u32,
    },
    /// SparseLoCo's compression (Sarfi et al. 2025, arXiv 2508.15706): in each chunk of
    /// [`SPARSELOCO_CHUNK`] values, the `ppm` millionths with the largest magnitudes, each as a
    /// 16-bit index and a 2-bit code (sign, and above or below the chunk's median kept
    /// magnitude) that decodes to the mean of the chunk's kept values with that code: about
    /// 2.3 bytes a value kept. Pushes only; the worker keeps what it did not send, **decayed**
    /// by `beta_milli / 1000` before it adds the next push to it (the paper's error feedback,
    /// which stands in for DiLoCo's outer momentum). The 2-bit quantizer is **our reading**.
    SparseLoCo {
        /// Parts per million of each chunk's values kept (1 to 1,000,000), at least one.
        ppm: u32,
        /// The residual's decay per push, in thousandths (0 to 1,000).
        beta_milli: u32,
    },
}

/// The chunk of values SparseLoCo picks its top values in (the 64 × 64 tiles of its authors'
/// chunking, flattened).
pub const SPARSELOCO_CHUNK: usize = 4096;

/// SparseLoCo's error-feedback decay without one: 0.95, in thousandths.
pub const DEFAULT_SPARSELOCO_BETA_MILLI: u32 = 950;

/// The block size of `int8` without one.
pub const DEFAULT_INT8_BLOCK: u32 = 256;

impl Codec {
    /// Whether its parameters are within bounds; the error says why not.
    pub fn check(self) -> Result<(), String> {
        match self {
            Codec::Int8 { block } if !(16..=65_536).contains(&block) => {
                Err(format!("int8 blocks of {block} values (16 to 65536)"))
            }
            Codec::TopK { ppm } if !(1..=1_000_000).contains(&ppm) => {
                Err(format!("top-k of {ppm} parts per million (1 to 1000000)"))
            }
            Codec::SparseLoCo { ppm, .. } if !(1..=1_000_000).contains(&ppm) => {
                Err(format!("sparseloco keeping {ppm} parts per million (1 to 1000000)"))
            }
            Codec::SparseLoCo { beta_milli, .. } if beta_milli > 1000 => {
                Err(format!("sparseloco's decay {} (0 to 1)", f64::from(beta_milli) / 1000.0))
            }
            _ => Ok(()),
        }
    }

    /// Whether it sends a sparse update (top-k, SparseLoCo): for pushes only, since a pull
    /// carries parameters, not an update that error feedback could make up for.
    pub fn is_sparse(self) -> bool {
        matches!(self, Codec::TopK { .. } | Codec::SparseLoCo { .. })
    }

    /// Its number and parameter in the fixed-layout [`Envelope`](crate::abi::Envelope).
    pub(crate) fn code(self) -> (u32, u64) {
        match self {
            Codec::None => (0, 0),
            Codec::Fp16 => (1, 0),
            Codec::Bf16 => (2, 0),
            Codec::Int8 { block } => (3, u64::from(block)),
            Codec::TopK { ppm } => (4, u64::from(ppm)),
            Codec::SparseLoCo { ppm, beta_milli } => (5, u64::from(ppm) | (u64::from(beta_milli) << 32)),
        }
    }

    /// The codec [`code`](Self::code) gave.
    pub(crate) fn from_code(code: u32, param: u64) -> Option<Codec> {
        if code == 5 {
            let (ppm, beta_milli) = (param as u32, u32::try_from(param >> 32).ok()?);
            return Some(Codec::SparseLoCo { ppm, beta_milli });
        }
        let param = u32::try_from(param).ok()?;
        Some(match code {
            0 => Codec::None,
            1 => Codec::Fp16,
            2 => Codec::Bf16,
            3 => Codec::Int8 { block: param },
            4 => Codec::TopK { ppm: param },
            _ => return None,
        })
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Codec::None => f.write_str("none"),
            Codec::Fp16 => f.write_str("fp16"),
            Codec::Bf16 => f.write_str("bf16"),
            Codec::Int8 { block: DEFAULT_INT8_BLOCK } => f.write_str("int8"),
            Codec::Int8 { block } => write!(f, "int8-{block}"),
            Codec::TopK { ppm } => write!(f, "topk-{}", ppm as f64 / 1e6),
            Codec::SparseLoCo { ppm, beta_milli: DEFAULT_SPARSELOCO_BETA_MILLI } => {
                write!(f, "sparseloco-{}", ppm as f64 / 1e6)
            }
            Codec::SparseLoCo { ppm, beta_milli } => {
                write!(f, "sparseloco-{}-{}", ppm as f64 / 1e6, f64::from(beta_milli) / 1000.0)
            }
        }
    }
}

impl FromStr for Codec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let codec = match s.trim() {
            "none" => Codec::None,
            "fp16" => Codec::Fp16,
            "bf16" => Codec::Bf16,
            "int8" => Codec::Int8 { block: DEFAULT_INT8_BLOCK },
            other => {
                if let Some(b) = other.strip_prefix("int8-") {
                    let block = b.parse().map_err(|_| format!("`{b}` is not a block size"))?;
                    Codec::Int8 { block }
                } else if let Some(fr) = other.strip_prefix("topk-") {
                    let f: f64 = fr.parse().map_err(|_| format!("`{fr}` is not a fraction"))?;
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(format!("top-k keeps a fraction in (0, 1], not {fr}"));
                    }
                    Codec::TopK { ppm: ((f * 1e6).round() as u32).max(1) }
                } else if let Some(rest) = other.strip_prefix("sparseloco-") {
                    let (fr, beta) = rest.split_once('-').unwrap_or((rest, "0.95"));
                    let f: f64 = fr.parse().map_err(|_| format!("`{fr}` is not a fraction"))?;
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(format!("sparseloco keeps a fraction in (0, 1], not {fr}"));
                    }
                    let b: f64 = beta.parse().map_err(|_| format!("`{beta}` is not a decay"))?;
                    if !(0.0..=1.0).contains(&b) {
                        return Err(format!("sparseloco's decay lies in [0, 1], not {beta}"));
                    }
                    Codec::SparseLoCo {
                        ppm: ((f * 1e6).round() as u32).max(1),
                        beta_milli: (b * 1000.0).round() as u32,
                    }
                } else {
                    return Err(format!(
                        "unknown codec `{other}` (none, fp16, bf16, int8, int8-BLOCK, topk-FRACTION, sparseloco-FRACTION[-DECAY])"
                    ));
                }
            }
        };
        codec.check()?;
        Ok(codec)
    }
}

/// The codecs a policy was configured with (its `push_codec` and `pull_codec` parameters),
/// applied for it: the pull codec when it starts, and the push codec to each worker at its
/// first pull (after joining, or after a swap to this policy), acknowledged like any control.
/// `cluster` (the default) leaves the cluster's own setting alone.
///
/// ```ignore
/// const INFO: PolicyInfo = PolicyInfo::new("mine", "1.0.0", "...",
///     &[CodecChoice::PUSH_PARAM, CodecChoice::PULL_PARAM]);
/// // new():      codecs: CodecChoice::from_config(&init.config)?
/// // on_start(): self.codecs.on_start(ctx)
/// // on_pull():  self.codecs.on_pull(ctx, pull.worker)
/// // on_worker_left(): self.codecs.forget(worker)
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CodecChoice {
    push: Option<Codec>,
    pull: Option<Codec>,
    /// Workers told the push codec since they joined or this instance started.
    told: BTreeSet<WorkerId>,
}

impl CodecChoice {
    /// The `push_codec` parameter.
    pub const PUSH_PARAM: ParamSpec = ParamSpec::new(
        "push_codec",
        ParamKind::Text,
        "cluster",
        "codec of pushes: none, fp16, bf16, int8[-B], topk-F, sparseloco-F[-B], or the cluster's",
    );
    /// The `pull_codec` parameter.
    pub const PULL_PARAM: ParamSpec = ParamSpec::new(
        "pull_codec",
        ParamKind::Text,
        "cluster",
        "codec of pulls: none, fp16, bf16, int8[-B], or the cluster's",
    );

    /// Reads the two parameters (`cluster`: leave the cluster's setting).
    pub fn from_config(config: &Config) -> Result<Self, String> {
        let read = |name: &str| -> Result<Option<Codec>, String> {
            match config.text(name) {
                None | Some("cluster") => Ok(None),
                Some(t) => t.parse().map(Some).map_err(|e| format!("{name}: {e}")),
            }
        };
        let (push, pull) = (read("push_codec")?, read("pull_codec")?);
        if let Some(codec) = pull.filter(|c| c.is_sparse()) {
            return Err(format!("pull_codec: pulls carry parameters; {codec} is for pushes"));
        }
        Ok(CodecChoice { push, pull, told: BTreeSet::new() })
    }

    /// Sets the pull codec, if one was chosen.
    pub fn on_start(&self, ctx: &mut Ctx<'_>) {
        if let Some(codec) = self.pull {
            ctx.set_pull_codec(codec);
        }
    }

    /// Tells `worker` the push codec, if one was chosen and it was not told yet.
    pub fn on_pull(&mut self, ctx: &mut Ctx<'_>, worker: WorkerId) {
        if let Some(codec) = self.push {
            if self.told.insert(worker) {
                ctx.control(worker, Control::SetPushCodec { codec });
            }
        }
    }

    /// `worker` left: told again if it comes back.
    pub fn forget(&mut self, worker: WorkerId) {
        self.told.remove(&worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn text_forms_parse_and_print_back() {
        for (text, codec) in [
            ("none", Codec::None),
            ("fp16", Codec::Fp16),
            ("bf16", Codec::Bf16),
            ("int8", Codec::Int8 { block: 256 }),
            ("int8-1024", Codec::Int8 { block: 1024 }),
            ("topk-0.01", Codec::TopK { ppm: 10_000 }),
            ("sparseloco-0.02", Codec::SparseLoCo { ppm: 20_000, beta_milli: 950 }),
            ("sparseloco-0.01-0.9", Codec::SparseLoCo { ppm: 10_000, beta_milli: 900 }),
        ] {
            assert_eq!(text.parse::<Codec>().unwrap(), codec);
            assert_eq!(codec.to_string(), text);
            // And through the envelope's fixed-layout code.
            let (code, param) = codec.code();
            assert_eq!(Codec::from_code(code, param), Some(codec));
        }
        assert!(Codec::SparseLoCo { ppm: 1, beta_milli: 0 }.is_sparse() && !Codec::Fp16.is_sparse());
        for bad in [
            "zip",
            "int8-4",
            "int8-x",
            "topk-0",
            "topk-2",
            "topk-x",
            "sparseloco-0",
            "sparseloco-0.1-1.5",
            "sparseloco-x",
        ] {
            assert!(bad.parse::<Codec>().is_err(), "{bad}");
        }
    }
}
