//! TensorBoard event files of a run's figures (`--tensorboard DIR` on `local` and `ab`), so a
//! researcher sees accuracy, loss, throughput and waiting beside their own scalars, and
//! TensorBoard overlays the policies of a comparison.
//!
//! No maintained Rust writer exists (tensorboard-rs was last released in 2022 and pulls in a
//! protobuf toolchain), so the format is written here: TFRecord framing (length, masked
//! CRC-32C of the length, data, masked CRC-32C of the data) around `Event` protocol buffers
//! holding scalar `Summary` values, the subset TensorBoard's scalar dashboard reads. The
//! Python suite reads the files back with TensorBoard's own `EventAccumulator`.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::lab::report::{RunReport, WatchPoint};

/// An event file being written.
#[derive(Debug)]
pub struct EventWriter {
    out: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    /// The run's start on the Unix clock: a point's wall time is this plus its `t_s`, so
    /// TensorBoard's "relative" axis shows seconds since the workers started.
    started_unix_s: f64,
    last: Option<WatchPoint>,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), for a run that started at `started_unix_s`.
    pub fn create(dir: &Path, started_unix_s: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name = format!(
            "events.out.tfevents.{}.{}.{}.syncopate",
            started_unix_s as u64,
            host.trim(),
            std::process::id()
        );
        let path = dir.join(name);
        let out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        let mut w = EventWriter { out, path, started_unix_s, last: None };
        let mut event = Vec::new();
        field_double(&mut event, 1, started_unix_s);
        field_bytes(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One look at the cluster, as scalars at step = the iterations pushed so far.
    pub fn point(&mut self, p: &WatchPoint) -> std::io::Result<()> {
        let mut values: Vec<(String, f32)> = Vec::new();
        if let Some(a) = p.accuracy {
            values.push(("train/accuracy".into(), a));
        }
        if let Some(l) = p.loss {
            values.push(("train/loss".into(), l));
        }
        values.push(("cluster/deferred_pulls".into(), p.pulls_deferred as f32));
        values.push(("cluster/deferred_wait_s".into(), p.deferred_s as f32));
        values.push(("cluster/clock_spread".into(), p.max_clock.saturating_sub(p.min_clock) as f32));
        values.push(("cluster/held_pushes_now".into(), p.held_now as f32));
        values.push(("cluster/servers_lost".into(), p.lost_servers.len() as f32));
        if let Some(st) = p.staleness_mean {
            values.push(("cluster/staleness_mean".into(), st as f32));
        }
        if p.server_bytes > 0 {
            values.push(("cluster/server_bytes".into(), p.server_bytes as f32));
        }
        if let Some(rates) = self.last.as_ref().and_then(|prev| p.rates_since(prev)) {
            values.push(("cluster/iterations_per_s".into(), rates.iterations_per_s as f32));
            // The share of the workers' time spent in deferred pulls since the last look.
            values.push(("cluster/waiting_share".into(), rates.waiting_share as f32));
            if p.server_bytes > 0 {
                values.push(("cluster/server_bytes_per_s".into(), rates.server_bytes_per_s as f32));
            }
        }
        for (name, v) in &p.metrics {
            values.push((format!("policy/{name}"), *v as f32));
        }
        let mut summary = Vec::new();
        for (tag, v) in &values {
            let mut value = Vec::new();
            field_bytes(&mut value, 1, tag.as_bytes());
            field_float(&mut value, 2, *v);
            field_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        field_double(&mut event, 1, self.started_unix_s + p.t_s);
        field_varint(&mut event, 2, p.iterations);
        field_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.last = Some(p.clone());
        Ok(())
    }

    /// Writes what is buffered, so a TensorBoard watching the directory sees it.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }
}

/// Writes a whole run's looks (`report.watch`) into an event file in `dir`: what `ab` does for
/// each run, so TensorBoard overlays the policies and seeds.
pub fn write_run(dir: &Path, report: &RunReport) -> std::io::Result<PathBuf> {
    let mut w = EventWriter::create(dir, report.started_unix_s)?;
    for p in &report.watch {
        w.point(p)?;
    }
    w.flush()?;
    Ok(w.path)
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, u64::from(field) << 3 | u64::from(wire));
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u32, v: u64) {
    key(out, field, 0);
    varint(out, v);
}

fn field_double(out: &mut Vec<u8>, field: u32, v: f64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn field_float(out: &mut Vec<u8>, field: u32, v: f32) {
    key(out, field, 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn field_bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
    key(out, field, 2);
    varint(out, v.len() as u64);
    out.extend_from_slice(v);
}

/// CRC-32C (Castagnoli), as TFRecord checks records with.
fn crc32c(data: &[u8]) -> u32 {
    const POLY: u32 = 0x82F6_3B78;
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
        }
    }
    !crc
}

/// TFRecord's masked CRC: the CRC rotated right by 15 bits plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CRC-32C check value of the standard test string, and a protocol buffer varint.
    #[test]
    fn crc32c_and_varints_are_the_standard_ones() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        let mut v = Vec::new();
        varint(&mut v, 300);
        assert_eq!(v, [0xAC, 0x02]);
    }
}
