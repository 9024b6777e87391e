//! Builds the test suite's hostile policy module from `tests/hostile-policy` to wasm32.

use std::path::Path;

fn main() {
    let workspace = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let built = syncopate_policy_build::build(
        Path::new(&workspace),
        &["syncopate-hostile-policy"],
        &["tests/hostile-policy", "policy-sdk"],
    );
    match built {
        Ok(paths) => println!("cargo:rustc-env=SYNCOPATE_HOSTILE_WASM={}", paths[0].display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
