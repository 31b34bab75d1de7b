//! Memory of a subscription's delay index: the growth of this process's resident memory
//! (VmRSS) while 100,000 and then 1,000,000 delayed messages are indexed, each in a fresh
//! index, the way the dispatcher inserts them.
//!
//! `cargo bench -p meridian-broker --bench delay_index`

use meridian_broker::broker::subscription::DelayIndex;
use meridian_storage::managed_ledger::Position;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .expect("VmRSS in /proc/self/status")
}

fn main() {
    for n in [100_000u64, 1_000_000] {
        let before = rss_kib();
        let mut index = DelayIndex::new();
        // Delivery times spread over an hour, positions over ledgers of 50,000 entries, in
        // publish order.
        let start = 1_700_000_000_000i64;
        for i in 0..n {
            let at = start + (i as i64 * 7_919) % 3_600_000;
            index.insert((at, Position::new(1 + i / 50_000, i % 50_000)));
        }
        let grown = rss_kib().saturating_sub(before);
        println!(
            "delay index of {n} messages: resident memory +{:.1} MiB ({:.1} bytes per message)",
            grown as f64 / 1024.0,
            grown as f64 * 1024.0 / n as f64
        );
        assert_eq!(index.len() as u64, n);
        drop(index);
    }
}
