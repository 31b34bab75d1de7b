//! Runs a seeded fault schedule against a site of real processes on loopback (three metadata
//! nodes, four bookies, two brokers), with stock Python-client producers and consumers and
//! metadata clients at work, then checks the recorded history: nothing acknowledged lost,
//! no duplicate where deduplication is on, per-producer order, no message id used twice,
//! every stored message delivered to every subscription, and linearizable metadata. With
//! `--sites 2` the site is east of two: it replicates a namespace to site west (a standalone)
//! over a link the schedule partitions and makes lossy, and west's copy is checked too.
//!
//! `meridian-chaos [--minutes N] [--seed S] [--topics K] [--sites 1|2] [--pause-ms M]
//! [--no-faults | --baseline] [--only KIND,...] [--keep]`
//!
//! Prints the schedule first, then a report (faults of each kind and how soon produce and
//! consume worked after each, what was checked, the rates). Exit status 1 when a check
//! failed: the report names the seed (the same seed replays the same schedule), the schedule
//! and the records that show each violation.
//!
//! The run is a child process in a group of its own: SIGTERM, SIGINT (Ctrl-C) or SIGHUP
//! ends it, with every process it started, its power-cut mounts and its temporary files
//! (exit status 128 + the signal).

use clap::Parser;
use meridian_integration::chaos::supervise::{supervise, SUPERVISED};
use meridian_integration::chaos::{run, Options};

#[derive(Parser, Debug)]
#[command(about = "Seeded fault schedules against a Meridian site, with checkers")]
struct Args {
    /// The schedule's length in minutes (faults and the gaps between them).
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// The schedule's seed (default: from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Topics (half with deduplication on; four subscription types in turn).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    topics: u64,
    /// The same load for the same time without faults (a baseline for the rates).
    #[arg(long, conflicts_with = "baseline")]
    no_faults: bool,
    /// First the same load for the same time without faults on a site of its own, then the
    /// schedule; prints the rates and p99 of both side by side.
    #[arg(long)]
    baseline: bool,
    /// Only the schedule's faults of these kinds (as the report names them: `kill broker`,
    /// `pause metadata-leader`, `power-cut`, `disk-full`, ...; a part of a kind matches).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Keep the processes' logs and data after the run (the paths are printed).
    #[arg(long)]
    keep: bool,
    /// 2: a second site, west, to which every third topic's namespace replicates; its link
    /// and its process take faults too.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=2))]
    sites: u64,
    /// Each Python producer's pause between sends in ms (a Rust-crate producer's is twice
    /// it): the offered load. Runs before 2026-12-07 used 5, at which a debug site on two
    /// cores queues sends for seconds (README, "Fault schedules").
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pause_ms: u64,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if std::env::var_os(SUPERVISED).is_none() {
        // The run is a child of this process, which ends all it started on a signal.
        let code = supervise(std::env::args_os().skip(1).collect(), a.keep)?;
        std::process::exit(code);
    }
    anyhow::ensure!(
        a.minutes > 0.0 && a.minutes <= 24.0 * 60.0,
        "--minutes must be more than 0 and at most 1440, not {}",
        a.minutes
    );
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let o = Options {
        seed,
        run_ms: (a.minutes * 60_000.0) as u64,
        topics: a.topics as usize,
        no_faults: a.no_faults,
        only: a.only.clone(),
        keep: a.keep,
        sites: a.sites as usize,
        pause_ms: a.pause_ms,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let baseline = if a.baseline {
        let quiet = Options {
            no_faults: true,
            ..o.clone()
        };
        let b = rt.block_on(run(&quiet))?;
        println!("without faults:\n{b}");
        Some(b)
    } else {
        None
    };
    let report = rt.block_on(run(&o))?;
    println!("{report}");
    if let Some(b) = baseline {
        println!(
            "quiet stretches against no faults: {:.0} against {:.0} acknowledged sends/s, publish p99 {:.1} ({:.1} of those answered before the next fault) against {:.1} ms",
            report.rate_quiet, b.rate_quiet, report.p99_quiet_ms, report.p99_quiet_within_ms, b.p99_quiet_ms
        );
        if !b.violations.is_empty() {
            std::process::exit(1);
        }
    }
    if !report.violations.is_empty() {
        let only = if a.only.is_empty() {
            String::new()
        } else {
            format!(" --only '{}'", a.only.join(","))
        };
        println!(
            "replay with: meridian-chaos --seed {seed} --minutes {} --topics {} --sites {} --pause-ms {}{only}",
            a.minutes, a.topics, a.sites, a.pause_ms
        );
        std::process::exit(1);
    }
    Ok(())
}
