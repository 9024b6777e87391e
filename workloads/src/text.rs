//! English text for the language model: the fortune-cookie files of Debian's `fortunes`
//! package (about 2.5 MB of quotations, jokes, poems and definitions in 42 files, installed
//! offline into [`DEFAULT_DIR`]; `scripts/setup.sh` installs it).
//!
//! Each file holds fortunes separated by lines of `%`. Every file without an extension in the
//! directory is read in name order (the `.dat` indexes and `.u8` links skipped, and
//! `ascii-art`, which is pictures, not prose); every tenth fortune, counted across the files,
//! is held out for validation, the rest are training text. Each split is one byte stream, each
//! fortune followed by `\n%\n` as in the files, so the model also learns where one ends.

use std::path::{Path, PathBuf};

use crate::DataError;

/// Where Debian's `fortunes` package puts the files.
pub const DEFAULT_DIR: &str = "/usr/share/games/fortunes";
/// Files in the directory that are not prose.
const SKIPPED: &[&str] = &["ascii-art"];
/// One fortune in this many is held out.
const HOLD_OUT_EVERY: usize = 10;
/// The least text a corpus must have for each split (bytes).
const MIN_BYTES: usize = 1024;

/// The training and validation text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    /// The training bytes.
    pub train: Vec<u8>,
    /// The held-out bytes.
    pub valid: Vec<u8>,
    /// How many files it was read from.
    pub files: usize,
}

/// Reads the corpus from the fortune files in `dir`.
pub fn load(dir: &Path) -> Result<Corpus, DataError> {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
        move |source| DataError::Io { path: path.to_path_buf(), source }
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                DataError::Missing { path: dir.to_path_buf(), package: "fortunes" }
            }
            _ => io(dir)(e),
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.extension().is_none())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !SKIPPED.contains(&n)))
        .collect();
    names.sort();
    let (mut train, mut valid, mut index) = (Vec::new(), Vec::new(), 0usize);
    for path in &names {
        let bytes = std::fs::read(path).map_err(io(path))?;
        let text = String::from_utf8_lossy(&bytes);
        let mut fortune = String::new();
        for line in text.lines().chain(std::iter::once("%")) {
            if line.trim_end() != "%" {
                fortune.push_str(line);
                fortune.push('\n');
                continue;
            }
            if !fortune.trim().is_empty() {
                let into = if index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 { &mut valid } else { &mut train };
                into.extend_from_slice(fortune.as_bytes());
                into.extend_from_slice(b"%\n");
                index += 1;
            }
            fortune.clear();
        }
    }
    if valid.len() < MIN_BYTES {
        return Err(DataError::Corrupt {
            path: dir.to_path_buf(),
            what: format!(
                "{} fortunes in {} files, too little text (install Debian's fortunes or give --data DIR)",
                index,
                names.len()
            ),
        });
    }
    Ok(Corpus { train, valid, files: names.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tenth_fortune_is_held_out_and_each_ends_as_in_the_files() {
        let dir = std::env::temp_dir().join(format!("syncopate-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let body: String =
            (0..400).map(|i| format!("Fortune number {i}, {}\n%\n", "words ".repeat(i % 7 + 1))).collect();
        std::fs::write(dir.join("quotes"), &body).unwrap();
        std::fs::write(dir.join("quotes.dat"), [0u8, 1, 2]).unwrap();
        std::fs::write(dir.join("ascii-art"), "#####\n%\n").unwrap();
        let c = load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(c.files, 1);
        let valid = String::from_utf8(c.valid).unwrap();
        assert!(valid.starts_with("Fortune number 9, "), "{}", &valid[..40]);
        assert_eq!(valid.matches("%\n").count(), 40);
        assert_eq!(String::from_utf8(c.train).unwrap().matches("%\n").count(), 360);
        assert!(!valid.contains('#'));
    }

    #[test]
    fn a_directory_without_fortunes_is_a_clear_error() {
        let err = load(Path::new("/nonexistent/fortunes")).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
