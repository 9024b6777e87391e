//! Builds policy crates of this workspace to `wasm32-unknown-unknown` modules.
//!
//! Called from build scripts (the host embeds the built-in policies; the test suite builds its
//! hostile modules), so that a plain `cargo build` or `cargo test` builds every policy from source
//! and no `.wasm` is ever committed. The nested cargo uses its own target directory, so it never
//! waits on the outer build's lock, and the `wasm-policy` profile of the workspace manifest.

use std::env;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target policies are built for.
pub const TARGET: &str = "wasm32-unknown-unknown";

/// Why a policy build failed; the message says what to do.
#[derive(Debug)]
pub struct BuildError(pub String);

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BuildError {}

/// Builds the given packages (by package name) of the workspace rooted at `workspace` and returns
/// the path of each package's `.wasm`, in order. Emits `cargo:rerun-if-changed` lines for
/// `watch` (paths relative to the workspace).
pub fn build(workspace: &Path, packages: &[&str], watch: &[&str]) -> Result<Vec<PathBuf>, BuildError> {
    for w in watch.iter().chain(["Cargo.toml", "Cargo.lock"].iter()) {
        println!("cargo:rerun-if-changed={}", workspace.join(w).display());
    }
    ensure_target()?;
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let target_dir = workspace.join("target").join("policy-wasm");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace)
        .args(["build", "--quiet", "--profile", "wasm-policy", "--target", TARGET, "--target-dir"])
        .arg(&target_dir);
    for p in packages {
        cmd.args(["-p", p]);
    }
    // Flags meant for the outer (native) build must not leak into the wasm build.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_LLVM_COV",
        "LLVM_PROFILE_FILE",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd
        .status()
        .map_err(|e| BuildError(format!("could not run cargo to build the policy modules: {e}")))?;
    if !status.success() {
        return Err(BuildError(format!(
            "building the policy modules ({}) for {TARGET} failed; see the errors above",
            packages.join(", ")
        )));
    }
    Ok(packages
        .iter()
        .map(|p| target_dir.join(TARGET).join("wasm-policy").join(format!("{}.wasm", p.replace('-', "_"))))
        .collect())
}

/// Makes sure the wasm32 standard library is installed, installing it with rustup if needed.
pub fn ensure_target() -> Result<(), BuildError> {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| BuildError(format!("could not run rustc: {e}")))?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    if sysroot.join("lib/rustlib").join(TARGET).exists() {
        return Ok(());
    }
    println!("cargo:warning=installing the {TARGET} target with rustup (needed to build policy modules)");
    let installed =
        Command::new("rustup").args(["target", "add", TARGET]).status().is_ok_and(|s| s.success());
    if installed {
        Ok(())
    } else {
        Err(BuildError(format!(
            "the {TARGET} target is not installed and rustup could not add it; run `rustup target add {TARGET}`"
        )))
    }
}
