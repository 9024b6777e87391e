//! Builds the test suite's hostile policy module from `tests/hostile-policy`, and the example
//! user policies from `policies/example-deadline`, `policies/example-backup`,
//! `policies/example-firstk`, `policies/example-clip` and `policies/example-pilot` (a cluster
//! policy), to wasm32
//! (none is built into the host).

use std::path::Path;

fn main() {
    let workspace = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let built = syncopate_policy_build::build(
        Path::new(&workspace),
        &[
            "syncopate-hostile-policy",
            "syncopate-policy-example-deadline",
            "syncopate-policy-example-backup",
            "syncopate-policy-example-firstk",
            "syncopate-policy-example-clip",
            "syncopate-policy-example-pilot",
        ],
        &[
            "tests/hostile-policy",
            "policies/example-deadline",
            "policies/example-backup",
            "policies/example-firstk",
            "policies/example-clip",
            "policies/example-pilot",
            "policy-sdk",
        ],
    );
    match built {
        Ok(paths) => {
            println!("cargo:rustc-env=SYNCOPATE_HOSTILE_WASM={}", paths[0].display());
            println!("cargo:rustc-env=SYNCOPATE_EXAMPLE_WASM={}", paths[1].display());
            println!("cargo:rustc-env=SYNCOPATE_BACKUP_WASM={}", paths[2].display());
            println!("cargo:rustc-env=SYNCOPATE_FIRSTK_WASM={}", paths[3].display());
            println!("cargo:rustc-env=SYNCOPATE_CLIP_WASM={}", paths[4].display());
            println!("cargo:rustc-env=SYNCOPATE_PILOT_WASM={}", paths[5].display());
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
