//! Prepares what `syncopate policy new` writes: the policy SDK's sources and a standalone manifest
//! for them (the crate vendors the SDK this binary speaks), and a lockfile that pins the SDK's
//! dependencies at the versions this workspace was tested with (from its `Cargo.lock`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let root = Path::new(&manifest).parent().expect("host/ sits in the workspace").to_path_buf();
    let sdk = root.join("policy-sdk");
    for p in [root.join("Cargo.toml"), root.join("Cargo.lock"), sdk.join("Cargo.toml"), sdk.join("src")] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    let workspace = read_toml(&root.join("Cargo.toml"));
    let sdk_manifest = read_toml(&sdk.join("Cargo.toml"));
    let version =
        workspace["workspace"]["package"]["version"].as_str().expect("workspace version").to_string();

    let mut out = String::new();
    writeln!(out, "/// The version of the vendored SDK.\npub const SDK_VERSION: &str = {version:?};")
        .unwrap();
    out.push_str("/// The SDK's sources: (path inside the SDK crate, text).\npub const SDK_FILES: &[(&str, &str)] = &[\n");
    let mut files = Vec::new();
    walk(&sdk.join("src"), &mut files);
    files.sort();
    for f in &files {
        let rel = f.strip_prefix(&sdk).expect("under the SDK").to_string_lossy().replace('\\', "/");
        writeln!(out, "    ({rel:?}, include_str!({:?})),", f.display().to_string()).unwrap();
    }
    out.push_str("];\n");
    let standalone = standalone_manifest(&workspace, &sdk_manifest, &version);
    writeln!(out, "/// The vendored SDK's manifest (no workspace inheritance).\npub const SDK_MANIFEST: &str = {standalone:?};")
        .unwrap();
    let lock = lockfile(&read_toml(&root.join("Cargo.lock")), &sdk_manifest, &version);
    out.push_str("/// The new crate's lockfile entries but its own: (package name, entry).\npub const LOCK_PACKAGES: &[(&str, &str)] = &[\n");
    for (name, entry) in lock {
        writeln!(out, "    ({name:?}, {entry:?}),").unwrap();
    }
    out.push_str("];\n");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out_dir.join("policy_template.rs"), out).expect("write OUT_DIR file");

    // The fault search's misbehaving module (`tests/hostile-policy`), which `syncopate simtest`
    // hot-swaps to in some seeds: it traps, spins or panics on the events it is told to.
    let hostile = syncopate_policy_build::build(
        &root,
        &["syncopate-hostile-policy"],
        &["tests/hostile-policy", "policy-sdk", "policy-build"],
    );
    let hostile = match hostile {
        Ok(paths) => paths[0].display().to_string(),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let text = format!(
        "/// The fault search's misbehaving policy module (`tests/hostile-policy`), as wasm.\n\
         pub const HOSTILE_WASM: &[u8] = include_bytes!({hostile:?});\n"
    );
    std::fs::write(out_dir.join("hostile_policy.rs"), text).expect("write OUT_DIR file");
}

fn read_toml(path: &Path) -> toml::Table {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    text.parse().unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the SDK sources") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            walk(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The SDK's manifest with every `workspace = true` replaced by the workspace's value.
fn standalone_manifest(workspace: &toml::Table, sdk: &toml::Table, version: &str) -> String {
    let ws = &workspace["workspace"];
    let package = &sdk["package"];
    let mut m = String::from(
        "# Vendored by `syncopate policy new`: the SDK this crate's `syncopate` speaks.\n[package]\n",
    );
    writeln!(m, "name = {}", inline(&package["name"])).unwrap();
    writeln!(m, "version = {version:?}").unwrap();
    writeln!(m, "edition = {}", inline(&ws["package"]["edition"])).unwrap();
    writeln!(m, "description = {}", inline(&package["description"])).unwrap();
    writeln!(m, "license = {}", inline(&ws["package"]["license"])).unwrap();
    m.push_str("\n[dependencies]\n");
    for (name, spec) in sdk["dependencies"].as_table().expect("SDK dependencies") {
        let mut spec = spec.clone();
        if let Some(t) = spec.as_table_mut() {
            if t.remove("workspace").is_some() {
                let mut from = ws["dependencies"][name].clone();
                if let toml::Value::String(v) = from {
                    from = toml::Value::Table(
                        [("version".to_string(), toml::Value::String(v))].into_iter().collect(),
                    );
                }
                let from = from.as_table_mut().expect("a dependency table");
                if let Some(extra) = t.remove("features") {
                    let all = from.entry("features").or_insert(toml::Value::Array(vec![]));
                    all.as_array_mut()
                        .expect("features")
                        .extend(extra.as_array().cloned().unwrap_or_default());
                }
                from.extend(t.clone());
                spec = toml::Value::Table(from.clone());
            }
        }
        writeln!(m, "{name} = {}", inline(&spec)).unwrap();
    }
    m
}

fn inline(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("{s:?}"),
        toml::Value::Array(a) => format!("[{}]", a.iter().map(inline).collect::<Vec<_>>().join(", ")),
        toml::Value::Table(t) => {
            format!(
                "{{ {} }}",
                t.iter().map(|(k, v)| format!("{k} = {}", inline(v))).collect::<Vec<_>>().join(", ")
            )
        }
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Datetime(_) => panic!("no dates in manifests here"),
    }
}

/// The lockfile entries of a crate that depends on the vendored SDK only, less the crate's own:
/// the SDK's and every package the SDK depends on (transitively), as this workspace's lockfile
/// has them, by name and version.
fn lockfile(lock: &toml::Table, sdk: &toml::Table, version: &str) -> Vec<(String, String)> {
    let packages = lock["package"].as_array().expect("packages in Cargo.lock");
    let find = |dep: &str| -> &toml::Table {
        let mut parts = dep.split(' ');
        let (name, ver) = (parts.next().expect("a name"), parts.next());
        let matches: Vec<&toml::Table> = packages
            .iter()
            .filter_map(|p| p.as_table())
            .filter(|p| {
                p["name"].as_str() == Some(name) && ver.is_none_or(|v| p["version"].as_str() == Some(v))
            })
            .collect();
        assert_eq!(matches.len(), 1, "Cargo.lock names `{dep}` ambiguously");
        matches[0]
    };
    let sdk_name = sdk["package"]["name"].as_str().expect("the SDK's name");
    let sdk_entry = find(sdk_name);
    let mut seen = BTreeSet::new();
    let mut todo: Vec<String> = deps(sdk_entry);
    let mut entries = BTreeMap::new();
    while let Some(dep) = todo.pop() {
        if !seen.insert(dep.clone()) {
            continue;
        }
        let entry = find(&dep);
        todo.extend(deps(entry));
        entries.insert((entry["name"].as_str().unwrap().to_string(), inline(&entry["version"])), entry);
    }
    // Cargo names a dependency with its version only where the lockfile has several of that name.
    let mut versions: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, _) in entries.keys() {
        *versions.entry(name).or_default() += 1;
    }
    let dependencies = |body: &mut String, entry: &toml::Table| {
        if let Some(d) = entry.get("dependencies").and_then(|d| d.as_array()) {
            body.push_str("dependencies = [\n");
            for dep in d.iter().filter_map(|d| d.as_str()) {
                let name = dep.split(' ').next().unwrap_or(dep);
                let dep = if versions.get(name).copied().unwrap_or(0) > 1 { dep } else { name };
                writeln!(body, " {dep:?},").unwrap();
            }
            body.push_str("]\n");
        }
    };
    let mut body = format!("[[package]]\nname = \"{sdk_name}\"\nversion = {version:?}\n");
    dependencies(&mut body, sdk_entry);
    let mut out = vec![(sdk_name.to_string(), body)];
    for ((name, _), entry) in &entries {
        let mut body = format!("[[package]]\nname = {name:?}\nversion = {}\n", inline(&entry["version"]));
        for key in ["source", "checksum"] {
            if let Some(v) = entry.get(key) {
                writeln!(body, "{key} = {}", inline(v)).unwrap();
            }
        }
        dependencies(&mut body, entry);
        out.push((name.clone(), body));
    }
    out
}

fn deps(entry: &toml::Table) -> Vec<String> {
    entry.get("dependencies").and_then(|d| d.as_array()).map_or_else(Vec::new, |d| {
        d.iter().filter_map(|d| d.as_str()).map(|d| d.split(" (").next().unwrap_or(d).to_string()).collect()
    })
}
