//! Policy references as written on a command line (`ssp:s=3`, `./my_policy.wasm:alpha=0.5`),
//! which name a built-in module or a file, and the built-in modules themselves (embedded by the
//! engine, which reads no files).

use std::path::Path;

use crate::runtime::{PolicyError, PolicyModule, PolicyRuntime};
pub use syncopate_engine::builtin::{cluster_names, cluster_wasm, names, shard_config, wasm};

/// A policy and its configuration, as written on a command line: `NAME[:k=v,k=v]` for a
/// built-in, or `PATH.wasm[:k=v,...]` for a module file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    /// A built-in name or a path to a `.wasm` file.
    pub source: String,
    /// Configuration pairs.
    pub config: Vec<(String, String)>,
}

/// A policy reference that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad policy `{spec}`: {reason}")]
pub struct SpecError {
    spec: String,
    reason: String,
}

impl std::str::FromStr for PolicySpec {
    type Err = SpecError;

    fn from_str(spec: &str) -> Result<Self, SpecError> {
        let err = |reason: &str| SpecError { spec: spec.into(), reason: reason.into() };
        // The configuration starts at the first `:` followed by `key=` (or at a trailing `:`), so
        // values may contain colons (`hostile.wasm:mode=push:panic`).
        let starts_config = |rest: &str| {
            rest.is_empty()
                || rest.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                })
        };
        let (source, rest) = spec
            .char_indices()
            .filter(|(_, c)| *c == ':')
            .map(|(i, _)| (&spec[..i], &spec[i + 1..]))
            .find(|(_, rest)| starts_config(rest))
            .unwrap_or((spec, ""));
        if source.is_empty() {
            return Err(err("no policy name or file"));
        }
        let mut config = Vec::new();
        for pair in rest.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| err("configuration must be k=v pairs separated by commas"))?;
            if k.trim().is_empty() {
                return Err(err("empty parameter name"));
            }
            config.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        Ok(PolicySpec { source: source.to_owned(), config })
    }
}

/// Writes the spec back as it is parsed: `source[:k=v,k=v]`.
impl std::fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.source)?;
        for (i, (k, v)) in self.config.iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { ':' } else { ',' })?;
        }
        Ok(())
    }
}

impl PolicySpec {
    /// A short name for tables and plots: the spec as written, but a module file by its file
    /// name, not its whole path (`my_policy.wasm:k=3`).
    pub fn label(&self) -> String {
        let source = match wasm(&self.source) {
            Some(_) => self.source.as_str(),
            None => Path::new(&self.source).file_name().and_then(|f| f.to_str()).unwrap_or(&self.source),
        };
        let short = PolicySpec { source: source.to_owned(), config: self.config.clone() };
        short.to_string()
    }

    /// Whether it names a built-in policy (not a module file): a shard policy or a cluster
    /// policy.
    pub fn is_builtin(&self) -> bool {
        wasm(&self.source).is_some() || cluster_wasm(&self.source).is_some()
    }

    /// Whether it names a built-in cluster policy (`autopilot`).
    pub fn is_cluster_builtin(&self) -> bool {
        cluster_wasm(&self.source).is_some()
    }

    /// Compiles the module this spec names: a built-in, or a file.
    pub fn load(&self, rt: &PolicyRuntime) -> Result<PolicyModule, PolicyError> {
        let (label, bytes) = self.bytes()?;
        rt.compile(&label, &bytes)
    }

    /// The label and wasm bytes of the module this spec names (to send to a cluster).
    pub fn bytes(&self) -> Result<(String, Vec<u8>), PolicyError> {
        if let Some(bytes) = wasm(&self.source).or_else(|| cluster_wasm(&self.source)) {
            return Ok((format!("builtin:{}", self.source), bytes.to_vec()));
        }
        let path = Path::new(&self.source);
        if path.exists() || self.source.ends_with(".wasm") {
            let bytes = std::fs::read(path).map_err(|e| PolicyError::Invalid {
                label: self.source.clone(),
                reason: format!("cannot read the file: {e}"),
            })?;
            return Ok((self.source.clone(), bytes));
        }
        Err(PolicyError::Invalid {
            label: self.source.clone(),
            reason: format!(
                "no built-in policy of that name (built-ins: {}; cluster policies: {}) and no such file",
                names().collect::<Vec<_>>().join(", "),
                cluster_names().collect::<Vec<_>>().join(", ")
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_a_file_by_its_file_name() {
        let s: PolicySpec =
            "/very/long/target/wasm32-unknown-unknown/release/my_policy.wasm:k=3".parse().unwrap();
        assert_eq!(s.label(), "my_policy.wasm:k=3");
        let s: PolicySpec = "ssp:s=2".parse().unwrap();
        assert_eq!(s.label(), "ssp:s=2");
        let specs: Vec<PolicySpec> =
            ["/a/p.wasm", "/b/p.wasm", "/c/q.wasm:k=1"].iter().map(|x| x.parse().unwrap()).collect();
        assert_eq!(
            crate::lab::ab::labels(&specs),
            ["/a/p.wasm", "/b/p.wasm", "q.wasm:k=1"],
            "the same file name twice: whole paths"
        );
    }

    #[test]
    fn parses_names_files_and_configs() {
        let s: PolicySpec = "ssp:s=3".parse().unwrap();
        assert_eq!(s.source, "ssp");
        assert_eq!(s.config, vec![("s".to_owned(), "3".to_owned())]);
        let s: PolicySpec = "/tmp/p.wasm:a=1,b=x".parse().unwrap();
        assert_eq!(s.source, "/tmp/p.wasm");
        assert_eq!(s.config.len(), 2);
        let s: PolicySpec = "bsp".parse().unwrap();
        assert!(s.config.is_empty());
        let s: PolicySpec = "./h.wasm:mode=push:panic,after=2".parse().unwrap();
        assert_eq!(s.source, "./h.wasm");
        assert_eq!(s.config[0], ("mode".to_owned(), "push:panic".to_owned()));
        assert_eq!(s.to_string(), "./h.wasm:mode=push:panic,after=2", "written back as parsed");
        assert!(
            "ssp:s".parse::<PolicySpec>().is_err()
                || "ssp:s".parse::<PolicySpec>().unwrap().source == "ssp:s"
        );
        assert!(":s=1".parse::<PolicySpec>().is_err());
        for text in ["ssp:s=3", "/tmp/p.wasm:a=1,b=x", "bsp"] {
            assert_eq!(text.parse::<PolicySpec>().unwrap().to_string(), text);
        }
    }
}
