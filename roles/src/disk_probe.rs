//! The disk's own limits, measured beside a benchmark so that its figures can be read against
//! them: the rate and latency of 4 KiB writes each followed by an fdatasync (what a journal
//! waits for when it is not loaded), and the bandwidth of 1 MiB writes each followed by an
//! fdatasync (fio's `--bs=1M --fdatasync=1`: what a loaded journal can reach at most).
//! `meridian perf disk` prints both; `meridian perf produce|e2e --fsync-probe-dir` runs the
//! 4 KiB probe in a thread during the run; `meridian meta bench --fsync-dir` the rate alone.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

#[derive(clap::Args, Clone, Debug)]
pub struct DiskArgs {
    /// Directory on the disk to measure (a file is written there and removed).
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Seconds for each of the two probes.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
}

/// The latency percentiles of a histogram of microseconds, in milliseconds.
pub fn percentiles(h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return "no samples".into();
    }
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    format!(
        "p50 {:.3} p95 {:.3} p99 {:.3} p99.9 {:.3} max {:.3} ms",
        ms(0.5),
        ms(0.95),
        ms(0.99),
        ms(0.999),
        h.max() as f64 / 1000.0
    )
}

fn micros() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

/// A file of this process in `dir`, removed on drop.
struct ProbeFile {
    path: PathBuf,
    file: std::fs::File,
}

impl ProbeFile {
    fn create(dir: &Path, what: &str) -> std::io::Result<ProbeFile> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("meridian-{what}-{}", std::process::id()));
        let file = std::fs::File::create(&path)?;
        Ok(ProbeFile { path, file })
    }

    /// Appends `block` and fdatasyncs; starts the file over past 64 MiB.
    fn write_synced(&mut self, block: &[u8], written: &mut u64) -> std::io::Result<()> {
        self.file.write_all(block)?;
        self.file.sync_data()?;
        *written += block.len() as u64;
        if *written >= 64 << 20 {
            self.file.set_len(0)?;
            use std::io::Seek;
            self.file.seek(std::io::SeekFrom::Start(0))?;
            *written = 0;
        }
        Ok(())
    }
}

impl Drop for ProbeFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// 4 KiB appends, each fdatasynced, back to back for `seconds`: the latencies (µs). Appends
/// grow the file, so each fdatasync also commits its new size (a journal writing into a
/// pre-filled file does less).
pub fn sync_latency(dir: &Path, seconds: f64) -> std::io::Result<Histogram<u64>> {
    let mut f = ProbeFile::create(dir, "fsync-probe")?;
    let block = [0x5au8; 4096];
    let mut h = micros();
    let mut written = 0;
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        f.write_synced(&block, &mut written)?;
        let _ = h.record((t.elapsed().as_micros() as u64).max(1));
    }
    Ok(h)
}

/// 1 MiB writes, each fdatasynced, back to back for `seconds`: MB/s (10^6 bytes).
pub fn sync_bandwidth(dir: &Path, seconds: f64) -> std::io::Result<f64> {
    let mut f = ProbeFile::create(dir, "bandwidth-probe")?;
    let block = vec![0x5au8; 1 << 20];
    let mut written = 0;
    let mut total = 0u64;
    let started = Instant::now();
    while started.elapsed().as_secs_f64() < seconds {
        f.write_synced(&block, &mut written)?;
        total += block.len() as u64;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64() / 1e6)
}

/// 4 KiB write+fdatasync every 2 ms in a thread until `stop`: the disk's latency while a
/// benchmark loads it, without adding much load of its own.
pub fn background_latency(
    dir: String,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Histogram<u64>> {
    std::thread::spawn(move || {
        let mut h = micros();
        let mut f = match ProbeFile::create(Path::new(&dir), "perf-fsync") {
            Ok(f) => f,
            Err(e) => {
                eprintln!("perf: cannot create a probe file in {dir}: {e}");
                return h;
            }
        };
        let block = [0x5au8; 4096];
        let mut written = 0;
        while !stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            if f.write_synced(&block, &mut written).is_err() {
                break;
            }
            let _ = h.record((t.elapsed().as_micros() as u64).max(1));
            std::thread::sleep(Duration::from_millis(2));
        }
        h
    })
}

/// Prints what [`background_latency`] measured.
pub fn print_background(probe: Option<std::thread::JoinHandle<Histogram<u64>>>) {
    if let Some(Ok(h)) = probe.map(std::thread::JoinHandle::join) {
        println!(
            "summary disk 4 KiB write+fdatasync ({} samples): {}",
            h.len(),
            percentiles(&h)
        );
    }
}

/// `meridian perf disk`.
pub fn run(a: DiskArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.seconds > 0.0 && a.seconds <= 3600.0,
        "--seconds must be in (0, 3600], got {}",
        a.seconds
    );
    let mbps = sync_bandwidth(&a.dir, a.seconds)?;
    println!(
        "summary disk 1 MiB write+fdatasync: {mbps:.0} MB/s ({:.0} MiB/s) in {}",
        mbps * 1e6 / (1 << 20) as f64,
        a.dir.display()
    );
    let started = Instant::now();
    let h = sync_latency(&a.dir, a.seconds)?;
    println!(
        "summary disk 4 KiB write+fdatasync back to back: {:.0}/s, {}",
        h.len() as f64 / started.elapsed().as_secs_f64(),
        percentiles(&h)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_directory_then_both_probes_measure_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let h = sync_latency(dir.path(), 0.2).unwrap();
        assert!(!h.is_empty());
        assert!(sync_bandwidth(dir.path(), 0.2).unwrap() > 0.0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
