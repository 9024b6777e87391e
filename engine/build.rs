//! Builds the built-in policy modules from `policies/` so the host can embed them.

// The build script runs in cargo, not in the engine: it may read cargo's environment and write
// OUT_DIR, which `engine/clippy.toml` bans for the engine's own code.
#![allow(clippy::disallowed_methods)]

use std::path::Path;

const BUILTIN: &[&str] = &[
    "asp",
    "bsp",
    "ssp",
    "dssp",
    "fluentps",
    "r2sp",
    "epsp",
    "localsgd",
    "diloco",
    "adaptive-deadline",
    "async-localsgd",
    "syncswitch",
    "adacomm",
    "robust",
    "decoupled-diloco",
];

/// The built-in cluster policies (run by the coordinator).
const CLUSTER: &[&str] = &["autopilot"];

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let workspace = Path::new(&manifest).parent().expect("engine/ sits in the workspace");
    let all: Vec<&str> = BUILTIN.iter().chain(CLUSTER).copied().collect();
    let packages: Vec<String> = all.iter().map(|p| format!("syncopate-policy-{p}")).collect();
    let packages: Vec<&str> = packages.iter().map(String::as_str).collect();
    let built = match syncopate_policy_build::build(workspace, &packages, &["policies", "policy-sdk"]) {
        Ok(built) => built,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let out = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let mut table = String::from(
        "/// The built-in policy modules: (name, wasm bytes).\npub const MODULES: &[(&str, &[u8])] = &[\n",
    );
    for (name, path) in BUILTIN.iter().zip(&built) {
        table.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", path.display().to_string()));
    }
    table.push_str("];\n");
    table.push_str("/// The built-in cluster policy modules: (name, wasm bytes).\npub const CLUSTER_MODULES: &[(&str, &[u8])] = &[\n");
    for (name, path) in CLUSTER.iter().zip(&built[BUILTIN.len()..]) {
        table.push_str(&format!("    ({name:?}, include_bytes!({:?})),\n", path.display().to_string()));
    }
    table.push_str("];\n");
    std::fs::write(Path::new(&out).join("builtin_policies.rs"), table).expect("write OUT_DIR file");
}
