//! Builds the test suite's hostile policy module from `tests/hostile-policy`, and the example
//! user policy from `policies/example-deadline`, to wasm32 (neither is built into the host).

use std::path::Path;

fn main() {
    let workspace = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let built = syncopate_policy_build::build(
        Path::new(&workspace),
        &["syncopate-hostile-policy", "syncopate-policy-example-deadline"],
        &["tests/hostile-policy", "policies/example-deadline", "policy-sdk"],
    );
    match built {
        Ok(paths) => {
            println!("cargo:rustc-env=SYNCOPATE_HOSTILE_WASM={}", paths[0].display());
            println!("cargo:rustc-env=SYNCOPATE_EXAMPLE_WASM={}", paths[1].display());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
