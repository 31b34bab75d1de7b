//! Where a publish's time goes: the broker's and the bookie's own latency histograms, read
//! from `/metrics` before and after a `meridian perf` run, as the difference of the two. A
//! quantile is the upper bound of the bucket it falls in (Prometheus keeps no more). The
//! stages are not all counted alike: per SEND and per add, but per journal batch (the oldest
//! record of it) and per fdatasync (the oldest batch it covers), so their means do not add up.
//! A broker without a bookie of its own (`meridian broker`) has only the broker's stages.

use std::collections::HashMap;

/// The stages, in the order a publish passes them, with what each one times.
pub const STAGES: &[(&str, &str)] = &[
    (
        "meridian_publish_latency_seconds",
        "broker: SEND received to receipt",
    ),
    (
        "meridian_storage_write_latency_seconds",
        "broker: entry submitted to the ledger until durable",
    ),
    (
        "meridian_bookie_add_seconds",
        "bookie: add request to its answer",
    ),
    (
        "meridian_bookie_add_reserve_seconds",
        "bookie: an add's wait for room in the write cache",
    ),
    (
        "meridian_journal_queue_seconds",
        "journal: a batch's oldest record queued until the batch is written",
    ),
    (
        "meridian_journal_write_seconds",
        "journal: a batch written into the page cache",
    ),
    (
        "meridian_journal_sync_wait_seconds",
        "journal: the oldest batch an fdatasync covers, written until the fdatasync starts",
    ),
    ("meridian_journal_sync_seconds", "journal: one fdatasync"),
    (
        "meridian_journal_completion_seconds",
        "journal: fdatasync returned until the callbacks of the batches it covers start",
    ),
];

/// One histogram: cumulative counts by upper bound (ascending, `+Inf` last), sum and count.
#[derive(Clone, Debug, Default, PartialEq)]
struct Hist {
    buckets: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

/// The unlabelled histograms of one `/metrics` page.
#[derive(Clone, Debug, Default)]
pub struct Snapshot(HashMap<String, Hist>);

impl Snapshot {
    pub fn parse(text: &str) -> Snapshot {
        let mut out: HashMap<String, Hist> = HashMap::new();
        for line in text.lines() {
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            if let Some((name, rest)) = key.split_once("_bucket{le=\"") {
                let Some(le) = rest.strip_suffix("\"}") else {
                    continue;
                };
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    match le.parse() {
                        Ok(v) => v,
                        Err(_) => continue,
                    }
                };
                out.entry(name.to_string())
                    .or_default()
                    .buckets
                    .push((le, value));
            } else if let Some(name) = key.strip_suffix("_sum") {
                out.entry(name.to_string()).or_default().sum = value;
            } else if let Some(name) = key.strip_suffix("_count") {
                out.entry(name.to_string()).or_default().count = value;
            }
        }
        for h in out.values_mut() {
            h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        Snapshot(out)
    }

    /// One line per stage with samples between `before` and `self`.
    pub fn report_since(&self, before: &Snapshot) -> Vec<String> {
        let mut lines = Vec::new();
        for (name, what) in STAGES {
            let Some(after) = self.0.get(*name) else {
                continue;
            };
            let empty = Hist::default();
            let earlier = before.0.get(*name).unwrap_or(&empty);
            let n = after.count - earlier.count;
            if n <= 0.0 {
                continue;
            }
            let mean = (after.sum - earlier.sum) / n;
            let delta: Vec<(f64, f64)> = after
                .buckets
                .iter()
                .map(|&(le, c)| {
                    let was = earlier
                        .buckets
                        .iter()
                        .find(|(l, _)| *l == le)
                        .map_or(0.0, |(_, c)| *c);
                    (le, c - was)
                })
                .collect();
            let q = |q: f64| {
                let want = q * n;
                match delta.iter().find(|(_, c)| *c >= want) {
                    Some((le, _)) if le.is_finite() => format!("<={:.3}", le * 1000.0),
                    _ => {
                        let top = delta
                            .iter()
                            .rev()
                            .find(|(le, _)| le.is_finite())
                            .map_or(0.0, |(le, _)| *le);
                        format!(">{:.0}", top * 1000.0)
                    }
                }
            };
            lines.push(format!(
                "{name}: {n:.0} samples, mean {:.3} ms, p50 {} p99 {} p99.9 {} max {} ms ({what})",
                mean * 1000.0,
                q(0.5),
                q(0.99),
                q(0.999),
                q(1.0),
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(counts: [u64; 3], sum: f64) -> String {
        format!(
            "# TYPE meridian_journal_sync_seconds histogram\n\
             meridian_journal_sync_seconds_bucket{{le=\"0.001\"}} {}\n\
             meridian_journal_sync_seconds_bucket{{le=\"0.002\"}} {}\n\
             meridian_journal_sync_seconds_bucket{{le=\"+Inf\"}} {}\n\
             meridian_journal_sync_seconds_sum {sum}\n\
             meridian_journal_sync_seconds_count {}\n\
             meridian_other_bucket{{topic=\"t\",le=\"1\"}} 5\n",
            counts[0], counts[1], counts[2], counts[2]
        )
    }

    #[test]
    fn given_two_pages_then_the_report_covers_only_the_samples_between_them() {
        let before = Snapshot::parse(&page([10, 10, 10], 0.005));
        // 100 more: 98 under 1 ms, 1 under 2 ms, 1 above.
        let after = Snapshot::parse(&page([108, 109, 110], 0.105));
        let lines = after.report_since(&before);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with(
                "meridian_journal_sync_seconds: 100 samples, mean 1.000 ms, p50 <=1.000 p99 <=2.000 p99.9 >2 max >2 ms"
            ),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn given_no_new_samples_then_nothing_is_reported() {
        let p = Snapshot::parse(&page([1, 2, 3], 0.1));
        assert!(p.report_since(&p).is_empty());
        assert!(Snapshot::parse("garbage\n{\n").report_since(&p).is_empty());
    }
}
