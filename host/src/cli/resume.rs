//! What a command was started with, kept beside its checkpoints, so that `--resume` alone
//! continues as it was: `syncopate local` keeps it in its run folder (`command.json`), and a
//! coordinator in its checkpoint directory (`coordinator.json`). Flags given with `--resume`
//! may change only what the command lists as changeable; any other that differs is refused,
//! with the value the run had.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The command line as kept: the arguments after the subcommand's name.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Started {
    args: Vec<String>,
}

/// This process's arguments after `command` (`local`, `coordinator`), as given.
pub(super) fn given(command: &str) -> Vec<String> {
    std::env::args().skip_while(|t| t != command).skip(1).collect()
}

/// `args` as flags and their values, in order (`--flag=value` split; a positional argument
/// under the name ""; `--script` takes everything after it).
fn flags(args: &[String]) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let t = &args[i];
        i += 1;
        if t == "--script" {
            out.push((t.clone(), args[i..].to_vec()));
            break;
        }
        match t.strip_prefix("--").map(|_| t.split_once('=')) {
            Some(Some((f, v))) => out.push((f.to_string(), vec![v.to_string()])),
            Some(None) => {
                let mut values = Vec::new();
                while i < args.len() && !args[i].starts_with("--") {
                    values.push(args[i].clone());
                    i += 1;
                }
                out.push((t.clone(), values));
            }
            None => out.push((String::new(), vec![t.clone()])),
        }
    }
    out
}

/// Keeps `args` in `file`, but the flags in `skip` (the new run's own: where it runs, what it
/// resumes, secrets).
pub(super) fn remember(file: &Path, args: &[String], skip: &[&str]) -> anyhow::Result<()> {
    let kept: Vec<String> = flags(args)
        .into_iter()
        .filter(|f| !skip.contains(&f.0.as_str()))
        .flat_map(|(name, values)| (!name.is_empty()).then_some(name).into_iter().chain(values))
        .collect();
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(&Started { args: kept })?;
    crate::checkpoint::write_file(file, text.as_bytes())
        .with_context(|| format!("writing {}", file.display()))
}

/// The arguments of the run kept in the first of `files` that exists, with `now` (this
/// command's) applied: the flags in `changeable` replace the run's, and any other flag that
/// differs from how the run was started is refused. The run's flags in `drills` (failure
/// drills: a killed server, a stall) are not kept: they happen again only if given again.
/// `None` when no file exists (a run from before they were kept): then `now` is taken as it is.
pub(super) fn resumed(
    files: &[PathBuf],
    now: &[String],
    changeable: &[&str],
    drills: &[&str],
) -> anyhow::Result<Option<Vec<String>>> {
    let Some(file) = files.iter().find(|f| f.is_file()) else { return Ok(None) };
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let started: Started =
        serde_json::from_str(&text).with_context(|| format!("reading {}", file.display()))?;
    let (was, is) = (flags(&started.args), flags(now));
    let values = |set: &[(String, Vec<String>)], name: &str| -> Vec<Vec<String>> {
        set.iter().filter(|f| f.0 == name).map(|f| f.1.clone()).collect()
    };
    for (name, _) in is.iter().filter(|f| !changeable.contains(&f.0.as_str())) {
        let (before, after) = (values(&was, name), values(&is, name));
        if before != after {
            let show = |v: &[Vec<String>]| match v {
                [] => "not given".to_string(),
                v => v.iter().map(|x| format!("{name} {}", x.join(" "))).collect::<Vec<_>>().join(", "),
            };
            anyhow::bail!(
                "--resume continues the run as it was started ({}): {} would change it (it had {}); \
                 give --resume alone, or with the flags a run may change ({})",
                file.display(),
                show(&after),
                show(&before),
                changeable.join(", ")
            );
        }
    }
    let set_now: Vec<&str> = is.iter().map(|f| f.0.as_str()).filter(|f| changeable.contains(f)).collect();
    let kept = was.iter().filter(|f| !set_now.contains(&f.0.as_str()) && !drills.contains(&f.0.as_str()));
    let changed = is.iter().filter(|f| changeable.contains(&f.0.as_str()));
    // `--script` takes what follows it: it comes last.
    let (script, others): (Vec<_>, Vec<_>) = kept.chain(changed).partition(|f| f.0 == "--script");
    let merged = others
        .into_iter()
        .chain(script)
        .flat_map(|(name, values)| {
            (!name.is_empty()).then(|| name.clone()).into_iter().chain(values.iter().cloned())
        })
        .collect();
    Ok(Some(merged))
}

/// `args` with the values of the flags in `paths` made absolute (against the current directory),
/// so that a run kept with them resumes from anywhere; a script's arguments (after `--script`)
/// are left as they are.
pub(super) fn absolute_paths(args: &[String], paths: &[&str]) -> Vec<String> {
    let absolute =
        |v: &str| std::path::absolute(v).map(|p| p.display().to_string()).unwrap_or_else(|_| v.to_string());
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.iter().peekable();
    while let Some(a) = it.next() {
        if a == "--script" {
            // The script's own arguments follow, as given.
            out.push(a.clone());
            out.extend(it.cloned());
            break;
        }
        match a.split_once('=') {
            Some((flag, v)) if paths.contains(&flag) => out.push(format!("{flag}={}", absolute(v))),
            _ if paths.contains(&a.as_str()) => {
                out.push(a.clone());
                if let Some(v) = it.next() {
                    out.push(absolute(v));
                }
            }
            _ => out.push(a.clone()),
        }
    }
    out
}

/// The arguments kept in `file` (a `command.json`), if it is there and reads.
pub(super) fn kept_args(file: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(file).ok()?;
    serde_json::from_str::<Started>(&text).ok().map(|s| s.args)
}

/// `command` with `args`, parsed as the command line would be.
pub(super) fn parse(command: &str, args: &[String]) -> anyhow::Result<super::Command> {
    let argv = ["syncopate", command].into_iter().map(String::from).chain(args.iter().cloned());
    Ok(<super::Cli as clap::Parser>::try_parse_from(argv)?.command)
}
