//! What a run measured: how soon produce and consume worked again after each fault (held to
//! a bound per kind of fault: [`bound_ms`]), and the rates and publish latency in the quiet
//! stretches between faults.

use serde_json::Value;

use super::{parsed, schedule, Report};

/// The longest produce and consume may take to work again (every producer a receipt, every
/// subscription a delivery) after a fault of `kind` healed: measured, with room for a loaded
/// machine (README, "Fault schedules").
pub fn bound_ms(kind: &str) -> f64 {
    let target = kind.split(' ').nth(1).unwrap_or("");
    match target {
        // Every process of the site starts again, the metadata store first.
        "site" => 90_000.0,
        // A new leader's election (a metadata node hit may be the leader); a broker's bundles
        // move once its session (5 s) expires.
        "metadata-leader" | "metadata" | "broker" => 30_000.0,
        // A bookie (a spare takes its writes), the other site or the link to it.
        _ => 15_000.0,
    }
}

/// Recovery after each fault, and the rates in and out of quiet stretches.
pub fn measure(
    r: &mut Report,
    sent: &[Vec<Box<str>>],
    delivered: &[Vec<Box<str>>],
    began: f64,
    ended: f64,
) {
    // When each line with `field` was printed, sorted, split by `side` (two series).
    let times = |lines: &[Box<str>], field: &str, side: fn(&Value) -> usize| -> [Vec<f64>; 2] {
        let mut t = [Vec::new(), Vec::new()];
        for v in parsed(lines).filter(|v| v.get(field).is_some()) {
            if let Some(at) = v.get("t").and_then(Value::as_f64) {
                t[side(&v)].push(at);
            }
        }
        for s in &mut t {
            s.sort_by(f64::total_cmp);
        }
        t
    };
    // Each producer's receipts (a topic's Python producer, and its crate producer's
    // incarnations together: their lines name them).
    let acks: Vec<Vec<f64>> = sent
        .iter()
        .flat_map(|l| times(l, "acked", |v| usize::from(v.get("p").is_some())))
        .collect();
    let gets: Vec<Vec<f64>> = delivered
        .iter()
        .map(|l| {
            let [all, _] = times(l, "p", |_| 0);
            all
        })
        .collect();
    let first_after = |ts: &[f64], h: f64| -> f64 {
        let i = ts.partition_point(|t| *t < h);
        ts.get(i).map_or(f64::INFINITY, |t| (t - h) * 1000.0)
    };
    // When the recoveries cut short so far were due at the latest: a fault that begins
    // while an earlier one's recovery is still within its bound (a site's restart, say) may
    // take as long as that earlier bound leaves, besides its own.
    let mut carried_until = f64::NEG_INFINITY;
    for (k, d) in r.done.iter().enumerate() {
        // Until the next fault starts (or the load stops): a recovery still short of its
        // bound then is cut short, neither counted nor held to the bound.
        let next = r.done.get(k + 1).map_or(ended, |n| n.started);
        let window_ms = (next - d.healed) * 1000.0;
        // The slowest series: its time and which it is.
        let longest = |series: &[Vec<f64>]| -> (f64, usize) {
            series
                .iter()
                .map(|s| first_after(s, d.healed))
                .enumerate()
                .fold((0.0, 0), |a, (i, t)| if t > a.0 { (t, i) } else { a })
        };
        let ((p, pi), (c, ci)) = (longest(&acks), longest(&gets));
        let kind = d.fault.kind();
        let own = bound_ms(&kind);
        let bound = own.max((carried_until - d.healed) * 1000.0);
        // acks: per topic its Python producer, then its crate producers; gets: per topic.
        let names = [
            format!(
                "produce (t{}'s {} producer)",
                pi / 2,
                if pi % 2 == 0 { "Python" } else { "Rust-crate" }
            ),
            format!("consume (t{ci}'s subscription)"),
        ];
        for (what, ms) in [(&names[0], p), (&names[1], c)] {
            // Past the bound while nothing else happened: a violation, whenever it came back
            // (if ever).
            if ms > bound && window_ms >= bound {
                let when = if ms.is_infinite() {
                    "did not work again".to_string()
                } else {
                    format!("worked again only {ms:.0} ms")
                };
                let whose = if bound > own {
                    format!("what was left of an earlier fault's bound ({kind}'s own: {own:.0} ms)")
                } else {
                    format!("the bound for {kind}")
                };
                r.violations.push(format!(
                    "[liveness] {what} {when} after {} healed ({:.1} s into the run), past {whose}: {bound:.0} ms\n",
                    d.fault,
                    d.healed - began
                ));
            }
        }
        // Cut short: still within the bound when the next fault began, and not back by then.
        if window_ms < bound && p.max(c) > window_ms {
            *r.cut_short.entry(kind).or_default() += 1;
            // Carried only while still owed when the next fault heals (back during it:
            // nothing is owed any more).
            let next_healed = r.done.get(k + 1).map_or(ended, |n| n.healed);
            if d.healed + p.max(c) / 1000.0 > next_healed {
                carried_until = carried_until.max(d.healed + bound / 1000.0);
            } else {
                carried_until = f64::NEG_INFINITY;
            }
            continue;
        }
        // Back (or a violation, reported): nothing earlier is owed any more.
        carried_until = f64::NEG_INFINITY;
        // Longer than its own bound but within an earlier fault's: counted apart, so that
        // the kind's figure stays its own.
        if p.max(c) > own && p.max(c) <= bound {
            *r.carried.entry(kind).or_default() += 1;
            continue;
        }
        // The slow ones too (a violation above): the figure shows the longest seen.
        if p.is_finite() && c.is_finite() {
            let e = r.recovery_ms.entry(kind).or_default();
            e.0 = e.0.max(p);
            e.1 = e.1.max(c);
        }
    }
    // Quiet: the long gaps between faults, from 8 s after a healing (a broker's session
    // outlives its kill by up to 5 s) to the next fault's start; and the whole run without
    // faults.
    let settle = 8.0;
    let mut quiet: Vec<(f64, f64)> = Vec::new();
    let mut from = began;
    for d in &r.done {
        if d.started - from >= (schedule::QUIET_MS as f64 / 1000.0) - settle {
            quiet.push((from, d.started));
        }
        from = d.healed + settle;
    }
    if ended > from {
        quiet.push((from, ended));
    }
    let quiet_s: f64 = quiet.iter().map(|(a, b)| b - a).sum();
    let all: usize = acks
        .iter()
        .map(|a| a.iter().filter(|t| **t >= began && **t < ended).count())
        .sum();
    r.rate_all = all as f64 / (ended - began).max(1e-9);
    // By when it was sent: sends held up by a fault end in the quiet after it. Of those, the
    // ones also answered before their stretch ended (the next fault did not hold them).
    let (mut lat, mut within) = (Vec::new(), Vec::new());
    for v in sent
        .iter()
        .flat_map(|l| parsed(l))
        .filter(|v| v.get("acked").is_some())
    {
        let (Some(t), Some(l)) = (
            v.get("t").and_then(|t| t.as_f64()),
            v.get("l").and_then(|l| l.as_f64()),
        ) else {
            continue;
        };
        let at = t - l / 1000.0;
        if let Some((_, end)) = quiet.iter().find(|(a, b)| at >= *a && at < *b) {
            lat.push(l);
            if t < *end {
                within.push(l);
            }
        }
    }
    r.rate_quiet = lat.len() as f64 / quiet_s.max(1e-9);
    r.p99_quiet_ms = p99(lat);
    r.p99_quiet_within_ms = p99(within);
}

/// The 99th percentile of `v` (0 when empty).
fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get((v.len() as f64 * 0.99) as usize)
        .or(v.last())
        .copied()
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::schedule::{Action, Fault, Target};
    use crate::chaos::Done;
    use serde_json::json;

    fn done(started: f64, healed: f64) -> Done {
        Done {
            fault: Fault {
                after_ms: 1_000,
                action: Action::Kill,
                target: Target::Bookie(0),
                length_ms: 1_000,
            },
            hit: Target::Bookie(0),
            started,
            healed,
        }
    }

    /// Lines as the clients print them.
    fn text(lines: Vec<serde_json::Value>) -> Vec<Box<str>> {
        lines.iter().map(|v| v.to_string().into()).collect()
    }

    /// One producer acknowledged at `acks`, one subscription delivering at `gets`.
    fn run(faults: Vec<Done>, acks: &[f64], gets: &[f64]) -> Report {
        let mut r = Report {
            done: faults,
            ..Report::default()
        };
        // A Python producer's lines (no "p") and a crate producer's.
        let sent = vec![text(
            acks.iter()
                .flat_map(|t| {
                    [
                        json!({"acked": 1, "t": t, "l": 1.0}),
                        json!({"acked": 1, "t": t, "l": 1.0, "p": "r0.0"}),
                    ]
                })
                .collect(),
        )];
        let delivered = vec![text(
            gets.iter().map(|t| json!({"p": "p0", "t": t})).collect(),
        )];
        measure(&mut r, &sent, &delivered, 0.0, 300.0);
        r
    }

    #[test]
    fn given_a_send_of_a_quiet_stretch_held_by_the_next_fault_then_only_the_first_p99_counts_it() {
        // Quiet from 0 to 90 s (the fault's start); 200 sends of 1 ms in it, and 5 sent at
        // 89.5 s and answered at 100.5 s, after the fault healed.
        let mut r = Report {
            done: vec![done(90.0, 100.0)],
            ..Report::default()
        };
        let mut lines: Vec<serde_json::Value> = (0..200)
            .map(|i| json!({"acked": 1, "t": 1.0 + f64::from(i) * 0.4, "l": 1.0}))
            .collect();
        lines.extend((0..5).map(|_| json!({"acked": 1, "t": 100.5, "l": 11_000.0})));
        measure(&mut r, &[text(lines)], &[], 0.0, 100.0);
        assert_eq!(r.p99_quiet_ms, 11_000.0);
        assert_eq!(r.p99_quiet_within_ms, 1.0);
    }

    #[test]
    fn given_produce_back_past_the_bound_then_a_liveness_violation() {
        let r = run(vec![done(90.0, 100.0)], &[80.0, 120.0], &[80.0, 100.5]);
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
        assert!(r.violations[0].contains("producer) worked again only 20000 ms"));
        assert_eq!(r.recovery_ms["kill bookie"], (20_000.0, 500.0));
    }

    #[test]
    fn given_a_recovery_cut_short_by_the_next_fault_then_it_is_left_out() {
        let r = run(
            vec![done(90.0, 100.0), done(105.0, 106.0)],
            &[80.0, 120.0],
            &[80.0, 120.0],
        );
        // The first fault's recovery runs into the second's start: only the second counts.
        assert_eq!(r.recovery_ms["kill bookie"], (14_000.0, 14_000.0));
        assert_eq!(r.cut_short["kill bookie"], 1);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
    }

    #[test]
    fn given_a_recovery_past_the_bound_and_past_the_next_fault_then_a_violation_still() {
        // The next fault comes 20 s after the healing, past the 15 s bound: produce was not
        // back by then.
        let r = run(
            vec![done(90.0, 100.0), done(120.0, 121.0)],
            &[80.0, 130.0],
            &[80.0, 100.5, 121.5],
        );
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
        assert!(r.violations[0].contains("producer) worked again only 30000 ms"));
        // A violation, not a recovery cut short: the figure shows it.
        assert!(!r.cut_short.contains_key("kill bookie"));
        assert_eq!(r.recovery_ms["kill bookie"].0, 30_000.0);
    }

    #[test]
    fn given_a_producer_that_never_comes_back_then_a_violation_once_the_bound_has_passed() {
        // Healed at 100 and 200 s, the run's end at 300 s: both windows pass the bound.
        let r = run(
            vec![done(90.0, 100.0), done(190.0, 200.0)],
            &[80.0],
            &[80.0, 101.0, 201.0],
        );
        assert_eq!(r.violations.len(), 2, "{:?}", r.violations);
        assert!(r.violations[0].contains("producer) did not work again"));
        // Healed 5 s before the end: too near it to tell.
        let r = run(vec![done(290.0, 295.0)], &[80.0], &[80.0, 296.0]);
        assert!(r.violations.is_empty(), "{:?}", r.violations);
    }

    fn site_cut(started: f64, healed: f64) -> Done {
        let mut d = done(started, healed);
        d.fault.action = Action::PowerCut(crate::chaos::schedule::Cut::Clean);
        d.fault.target = Target::Site;
        d.hit = Target::Site;
        d
    }

    #[test]
    fn given_a_site_restart_cut_short_by_a_bookie_kill_then_the_kill_may_take_what_is_left_of_its_bound(
    ) {
        // The site is back at 100 s (bound 90 s: due by 190 s); a bookie is killed at 110 s
        // and back at 112 s; produce works again at 150 s: 38 s after the kill, past the
        // kill's 15 s but within the site's.
        let r = run(
            vec![site_cut(90.0, 100.0), done(110.0, 112.0)],
            &[80.0, 150.0],
            &[80.0, 150.0],
        );
        assert!(r.violations.is_empty(), "{:?}", r.violations);
        assert_eq!(r.cut_short["power-cut site"], 1);
        assert_eq!(r.carried["kill bookie"], 1);
        assert!(!r.recovery_ms.contains_key("kill bookie"));
    }

    #[test]
    fn given_a_recovery_past_an_earlier_faults_bound_too_then_a_violation() {
        // Due by 190 s at the latest; produce works again only at 200 s.
        let r = run(
            vec![site_cut(90.0, 100.0), done(110.0, 112.0)],
            &[80.0, 200.0],
            &[80.0, 150.0],
        );
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
        assert!(
            r.violations[0].contains("past what was left of an earlier fault's bound"),
            "{:?}",
            r.violations
        );
        // Once back, nothing is carried further: a later kill is held to its own bound.
        let r = run(
            vec![
                site_cut(90.0, 100.0),
                done(110.0, 112.0),
                done(150.0, 151.0),
            ],
            &[80.0, 113.0, 180.0],
            &[80.0, 113.0, 151.5],
        );
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
        assert!(r.violations[0].contains("the bound for kill bookie"));
    }

    #[test]
    fn given_a_cut_short_recovery_that_came_back_during_the_next_fault_then_nothing_is_carried() {
        // The site is back at 100 s; a bookie is killed at 105 s and back at 120 s; produce
        // worked again at 110 s (during the kill), then stopped: 40 s after the kill healed
        // is past the kill's own 15 s, and nothing of the site's bound is owed.
        let r = run(
            vec![site_cut(90.0, 100.0), done(105.0, 120.0)],
            &[80.0, 110.0, 160.0],
            &[80.0, 110.0, 121.0],
        );
        assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
        assert!(r.violations[0].contains("the bound for kill bookie"));
    }

    #[test]
    fn given_the_kinds_then_their_bounds() {
        assert_eq!(bound_ms("power-cut site"), 90_000.0);
        assert_eq!(bound_ms("kill broker"), 30_000.0);
        assert_eq!(bound_ms("pause metadata-leader"), 30_000.0);
        assert_eq!(bound_ms("power-cut metadata"), 30_000.0);
        assert_eq!(bound_ms("kill bookie"), 15_000.0);
        assert_eq!(bound_ms("partition link"), 15_000.0);
    }
}
