//! The built-in policy modules, compiled from `policies/` to wasm32 by the build script and
//! embedded in the binary, and the per-shard configuration a policy runs with. (References to
//! policies as written on a command line, which may name files, are the host's:
//! `syncopate::builtin::PolicySpec`.)

include!(concat!(env!("OUT_DIR"), "/builtin_policies.rs"));

/// The wasm bytes of built-in policy `name`.
pub fn wasm(name: &str) -> Option<&'static [u8]> {
    MODULES.iter().find(|(n, _)| *n == name).map(|(_, w)| *w)
}

/// Names of the built-in policies.
pub fn names() -> impl Iterator<Item = &'static str> {
    MODULES.iter().map(|(n, _)| *n)
}

/// The wasm bytes of built-in cluster policy `name` (run by the coordinator, see
/// [`crate::pilot`]).
pub fn cluster_wasm(name: &str) -> Option<&'static [u8]> {
    CLUSTER_MODULES.iter().find(|(n, _)| *n == name).map(|(_, w)| *w)
}

/// Names of the built-in cluster policies.
pub fn cluster_names() -> impl Iterator<Item = &'static str> {
    CLUSTER_MODULES.iter().map(|(n, _)| *n)
}

/// The configuration shard `shard` runs with: `config`, with the overrides `(shard, key, value)`
/// naming this shard applied over it (a key the configuration lacks is added).
pub fn shard_config(
    config: &[(String, String)],
    overrides: &[(u32, String, String)],
    shard: u32,
) -> Vec<(String, String)> {
    let mut config = config.to_vec();
    for (_, k, v) in overrides.iter().filter(|(s, ..)| *s == shard) {
        match config.iter_mut().find(|(key, _)| key == k) {
            Some(entry) => entry.1 = v.clone(),
            None => config.push((k.clone(), v.clone())),
        }
    }
    config
}
