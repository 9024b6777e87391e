//! Fashion-MNIST: 60,000 training and 10,000 test images of 28x28 grey pixels in 10 classes,
//! read from the IDX files (gzipped or not) that Debian's `dataset-fashion-mnist` installs in
//! [`DEFAULT_DIR`]. Pixels are scaled to `[0, 1]`.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Where Debian's `dataset-fashion-mnist` puts the files.
pub const DEFAULT_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// Pixels per image.
pub const PIXELS: usize = 28 * 28;
/// Classes.
pub const CLASSES: usize = 10;
/// Images in the training set.
pub const TRAIN_IMAGES: usize = 60_000;

/// A dataset file that is missing or damaged.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file is missing (for Fashion-MNIST: neither `NAME` nor `NAME.gz` exists).
    #[error("{path}: missing (install Debian's {package}, as scripts/setup.sh does, or give --data DIR)")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The Debian package that installs it.
        package: &'static str,
    },
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What happened.
        source: std::io::Error,
    },
    /// The file is not the IDX data expected.
    #[error("{path}: corrupt or not the data expected: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
}

/// Images and labels.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// `len * PIXELS` pixels in `[0, 1]`, row after row.
    pub images: Vec<f32>,
    /// One label (0-9) per image.
    pub labels: Vec<u8>,
}

impl Dataset {
    /// Images in the set.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image `i`'s pixels.
    pub fn image(&self, i: usize) -> &[f32] {
        &self.images[i * PIXELS..(i + 1) * PIXELS]
    }
}

/// The training and test sets.
#[derive(Clone, Debug)]
pub struct FashionMnist {
    /// 60,000 training images.
    pub train: Dataset,
    /// 10,000 test images.
    pub test: Dataset,
}

fn read_file(dir: &Path, name: &str) -> Result<(PathBuf, Vec<u8>), DataError> {
    let plain = dir.join(name);
    let gz = dir.join(format!("{name}.gz"));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    if plain.exists() {
        let bytes = std::fs::read(&plain).map_err(io(&plain))?;
        return Ok((plain, bytes));
    }
    if gz.exists() {
        let file = std::fs::File::open(&gz).map_err(io(&gz))?;
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(file)
            .read_to_end(&mut bytes)
            .map_err(|e| DataError::Corrupt { path: gz.clone(), what: format!("cannot decompress: {e}") })?;
        return Ok((gz, bytes));
    }
    Err(DataError::Missing { path: plain, package: "dataset-fashion-mnist" })
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn load_set(dir: &Path, prefix: &str, expect: usize) -> Result<Dataset, DataError> {
    let (ipath, ib) = read_file(dir, &format!("{prefix}-images-idx3-ubyte"))?;
    let (lpath, lb) = read_file(dir, &format!("{prefix}-labels-idx1-ubyte"))?;
    let corrupt = |path: &Path, what: String| DataError::Corrupt { path: path.to_path_buf(), what };
    if ib.len() < 16 || be32(&ib, 0) != 2051 {
        return Err(corrupt(&ipath, "not an IDX image file (magic 2051)".into()));
    }
    let (n, rows, cols) = (be32(&ib, 4) as usize, be32(&ib, 8) as usize, be32(&ib, 12) as usize);
    if rows * cols != PIXELS || ib.len() != 16 + n * PIXELS {
        return Err(corrupt(&ipath, format!("{n} images of {rows}x{cols} in {} bytes", ib.len())));
    }
    if lb.len() < 8 || be32(&lb, 0) != 2049 || be32(&lb, 4) as usize != n || lb.len() != 8 + n {
        return Err(corrupt(&lpath, format!("expected {n} labels (magic 2049)")));
    }
    if n != expect {
        return Err(corrupt(&ipath, format!("{n} images, Fashion-MNIST has {expect}")));
    }
    let labels = lb[8..].to_vec();
    if let Some(bad) = labels.iter().find(|l| **l as usize >= CLASSES) {
        return Err(corrupt(&lpath, format!("label {bad} is not a class")));
    }
    let images = ib[16..].iter().map(|p| f32::from(*p) / 255.0).collect();
    Ok(Dataset { images, labels })
}

/// Loads both sets from `dir`.
pub fn load(dir: &Path) -> Result<FashionMnist, DataError> {
    Ok(FashionMnist { train: load_set(dir, "train", 60_000)?, test: load_set(dir, "t10k", 10_000)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("syncopate-fashion-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_missing_file_is_named() {
        let d = dir("missing");
        let err = load(&d).unwrap_err().to_string();
        assert!(err.contains(&d.join("train-images-idx3-ubyte").display().to_string()), "{err}");
        assert!(err.contains("dataset-fashion-mnist"), "{err}");
    }

    #[test]
    fn a_corrupt_file_is_named() {
        let d = dir("corrupt");
        std::fs::write(d.join("train-images-idx3-ubyte"), b"not an idx file at all").unwrap();
        std::fs::write(d.join("train-labels-idx1-ubyte"), b"nor this").unwrap();
        let err = load(&d).unwrap_err().to_string();
        assert!(err.contains("train-images-idx3-ubyte") && err.contains("corrupt"), "{err}");
        // A truncated image file: right header, missing pixels.
        let mut header = Vec::new();
        for v in [2051u32, 60_000, 28, 28] {
            header.extend_from_slice(&v.to_be_bytes());
        }
        header.extend_from_slice(&[0; 100]);
        std::fs::write(d.join("train-images-idx3-ubyte"), &header).unwrap();
        let err = load(&d).unwrap_err().to_string();
        assert!(err.contains("60000 images of 28x28"), "{err}");
    }

    #[test]
    fn the_real_files_load() {
        let data = load(Path::new(DEFAULT_DIR)).expect("the dataset (scripts/setup.sh installs it)");
        assert_eq!((data.train.len(), data.test.len()), (60_000, 10_000));
        assert!(data.train.images.iter().all(|p| (0.0..=1.0).contains(p)));
        let mut counts = [0usize; CLASSES];
        data.test.labels.iter().for_each(|l| counts[*l as usize] += 1);
        assert_eq!(counts, [1000; CLASSES], "the test set is balanced");
    }
}
