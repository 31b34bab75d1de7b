//! The fault-schedule runner behind `meridian-chaos`: a site of real processes driven by the
//! stock Python client while a seeded schedule kills and pauses its processes, then checkers
//! over everything recorded (see [`check`] and [`linearizable`]).

pub mod check;
pub mod clock;
pub mod crate_load;
pub mod linearizable;
pub mod measure;
pub mod meta_load;
pub mod remote;
pub mod replicated;
pub mod schedule;
pub mod site;
pub mod supervise;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde_json::Value;

use crate::{admin_json, PyClient};
use check::{Checked, Received, Send, TopicHistory, Violation};
use schedule::Fault;
use site::Site;

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    /// The schedule's length: faults and the gaps between them.
    pub run_ms: u64,
    pub topics: usize,
    /// The same run with no fault (a baseline for the rates).
    pub no_faults: bool,
    /// Only faults whose kind (as the report names them, e.g. `pause metadata-leader`)
    /// contains one of these; all when empty.
    pub only: Vec<String>,
    /// Keep the processes' logs and data directories after the run (their paths are printed).
    pub keep: bool,
    /// 1, or 2: the site becomes east and replicates a namespace to site west (see
    /// [`remote`]), whose link and process take faults too.
    pub sites: usize,
    /// Each Python producer's pause between sends, in ms (a crate producer's is twice it):
    /// the offered load. The processes of a run share the machine's cores with its clients,
    /// so a load near their limit turns any other work on the machine into seconds of
    /// queueing, which the liveness bounds would take for a slow recovery.
    pub pause_ms: u64,
}

/// One topic of the run and how it is used.
struct TopicPlan {
    name: String,
    /// In the namespace replicated to site west.
    replicated: bool,
    dedup: bool,
    batch: bool,
    sub_type: &'static str,
    consumers: usize,
}

/// With two sites, every third topic is in the replicated namespace (deduplication on).
fn plan(topics: usize, two_sites: bool) -> Vec<TopicPlan> {
    const TYPES: [&str; 4] = ["exclusive", "shared", "failover", "key_shared"];
    (0..topics)
        .map(|i| {
            let replicated = two_sites && i % 3 == 2;
            let dedup = replicated || i % 2 == 0;
            let ns = if replicated {
                remote::NAMESPACE
            } else if dedup {
                "public/chaos-dedup"
            } else {
                "public/chaos-plain"
            };
            let sub_type = TYPES[i % TYPES.len()];
            TopicPlan {
                name: format!("persistent://{ns}/t{i}"),
                replicated,
                dedup,
                batch: (i / 2) % 2 == 1,
                sub_type,
                consumers: if sub_type == "exclusive" { 1 } else { 2 },
            }
        })
        .collect()
}

/// A fault as it happened.
#[derive(Clone, Debug)]
pub struct Done {
    pub fault: Fault,
    /// The process it hit (the leader by its index).
    pub hit: schedule::Target,
    /// Wall-clock seconds of its start and of its healing.
    pub started: f64,
    pub healed: f64,
}

/// Everything a run found.
#[derive(Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub schedule: Vec<Fault>,
    pub done: Vec<Done>,
    pub checked: Checked,
    pub meta_ops: u64,
    pub meta_unknown: u64,
    /// Messages checked at site west against east (two sites).
    pub replicated: u64,
    pub violations: Vec<String>,
    /// Keys whose linearizability search gave up (neither shown nor refuted).
    pub inconclusive: Vec<String>,
    /// Per kind of fault: the longest time from its healing until every producer had a send
    /// acknowledged and every subscription a message delivered, in ms (of the faults whose
    /// recovery came before the next fault began).
    pub recovery_ms: BTreeMap<String, (f64, f64)>,
    /// Per kind of fault: how many recoveries the next fault (or the run's end) cut short.
    pub cut_short: BTreeMap<String, u64>,
    /// Per kind of fault: how many recoveries took longer than the kind's bound but not
    /// longer than an earlier fault's, which this one cut short, left (not in `recovery_ms`).
    pub carried: BTreeMap<String, u64>,
    /// Acknowledged sends per second over the run, and of the sends made in quiet stretches
    /// (long gaps between faults, from 8 s after a fault healed to the next one); their
    /// publish latency p99 (ms), and that of those of them also answered before their
    /// stretch ended (not held by the next fault).
    pub rate_all: f64,
    pub rate_quiet: f64,
    pub p99_quiet_ms: f64,
    pub p99_quiet_within_ms: f64,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "seed {}: {} faults", self.seed, self.done.len())?;
        let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
        for d in &self.done {
            *kinds.entry(d.fault.kind()).or_default() += 1;
        }
        for (k, n) in &kinds {
            let cut = self.cut_short.get(k).copied().unwrap_or(0);
            let carried = match self.carried.get(k) {
                Some(m) => format!(
                    "; {m} past the bound of {} ms but within an earlier fault's",
                    measure::bound_ms(k)
                ),
                None => String::new(),
            };
            match self.recovery_ms.get(k) {
                Some((p, c)) => writeln!(
                    f,
                    "  {k}: {n}, produce again within {p:.0} ms, consume again within {c:.0} ms (bound {:.0} ms; {cut} cut short by the next fault or the run's end{carried})",
                    measure::bound_ms(k)
                )?,
                None => writeln!(
                    f,
                    "  {k}: {n}, cut short by the next fault or the run's end: {cut}{carried}"
                )?,
            }
        }
        writeln!(
            f,
            "checked: {} sends ({} acknowledged), {} stored, {} deliveries; {} metadata operations ({} of unknown outcome)",
            self.checked.sends,
            self.checked.acked,
            self.checked.stored,
            self.checked.delivered,
            self.meta_ops,
            self.meta_unknown
        )?;
        if self.replicated > 0 {
            writeln!(
                f,
                "replicated: {} messages at site west checked against east",
                self.replicated
            )?;
        }
        writeln!(
            f,
            "acknowledged sends/s: {:.0} over the run, {:.0} in quiet stretches (publish p99 {:.1} ms there; {:.1} ms of those answered before the next fault)",
            self.rate_all, self.rate_quiet, self.p99_quiet_ms, self.p99_quiet_within_ms
        )?;
        for i in &self.inconclusive {
            writeln!(f, "linearizability inconclusive for {i}")?;
        }
        writeln!(f, "violations: {}", self.violations.len())?;
        for v in &self.violations {
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

pub(crate) fn wall() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn say(msg: impl AsRef<str>) {
    eprintln!("chaos: {}", msg.as_ref());
}

/// With `--keep`: the recorded history beside the logs, a JSON object per line (the run's
/// start and end, each fault with its start and healing, then each topic's sends and
/// deliveries as the clients printed them), for a look at what a report sums up.
fn keep_history(
    root: &std::path::Path,
    began: f64,
    ended: f64,
    done: &[Done],
    sent: &[Vec<Box<str>>],
    delivered: &[Vec<Box<str>>],
) -> anyhow::Result<()> {
    use std::io::Write as _;
    let path = root.join("history.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
    writeln!(f, "{}", serde_json::json!({"began": began, "ended": ended}))?;
    for d in done {
        let line = serde_json::json!({
            "fault": d.fault.to_string(),
            "started": d.started,
            "healed": d.healed,
        });
        writeln!(f, "{line}")?;
    }
    for (kind, topics) in [("sent", sent), ("delivered", delivered)] {
        for (i, lines) in topics.iter().enumerate() {
            // Each line is a JSON object already: written as it was printed.
            for line in lines {
                writeln!(f, "{{\"{kind}\":{i},\"line\":{line}}}")?;
            }
        }
    }
    f.flush()?;
    Ok(())
}
/// Runs one schedule against a fresh site and checks what happened.
pub async fn run(o: &Options) -> anyhow::Result<Report> {
    let schedule = if o.no_faults {
        Vec::new()
    } else {
        let shape = schedule::Shape {
            remote: o.sites > 1,
            ..site::SHAPE
        };
        schedule::generate_only(o.seed, o.run_ms, shape, |f| {
            o.only.is_empty() || o.only.iter().any(|k| f.kind().contains(k.as_str()))
        })
    };
    say(format!("seed {}: {} faults", o.seed, schedule.len()));
    for f in &schedule {
        say(format!("  {f}"));
    }
    anyhow::ensure!(
        (1..=2).contains(&o.sites),
        "--sites must be 1 or 2, not {}",
        o.sites
    );
    anyhow::ensure!(
        o.sites == 1 || o.topics >= 3,
        "--sites 2 needs --topics 3 or more (every third topic is replicated), not {}",
        o.topics
    );
    let clock_jumps = schedule
        .iter()
        .any(|f| matches!(f.action, schedule::Action::ClockJump(_)));
    let mut site = Site::start(o.sites == 2, clock_jumps)
        .await
        .context("starting the site")?;
    let result = drive(o, &mut site, schedule).await;
    if result.is_err() {
        // What each process complained of, before the site (and its logs) goes.
        site.show_warnings();
    }
    if o.keep {
        let (logs, disks) = site.keep_files()?;
        say(format!(
            "kept: logs in {}, the disks' durable contents in {}",
            logs.display(),
            disks.display()
        ));
    }
    result
}

/// The run on a started site: load, schedule, drain, checks.
async fn drive(o: &Options, site: &mut Site, schedule: Vec<Fault>) -> anyhow::Result<Report> {
    let root = site.root().to_path_buf();
    let admin = site.admin_url();
    for (ns, dedup) in [("public/chaos-dedup", true), ("public/chaos-plain", false)] {
        admin_json(&admin, &["namespaces", "create", ns]);
        if dedup {
            admin_json(&admin, &["namespaces", "set-deduplication", ns, "--enable"]);
        }
    }
    let url = site.service_url();
    let topics = plan(o.topics, site.remote.is_some());
    let stop_produce = root.join("stop-produce");
    let stop_consume = root.join("stop-consume");

    let mut consumers: Vec<(usize, PyClient)> = Vec::new();
    for (i, t) in topics.iter().enumerate() {
        for k in 0..t.consumers {
            let name = format!("c{i}-{k}");
            let mut args = [
                "consume",
                &url,
                &t.name,
                "s",
                "--type",
                t.sub_type,
                "--name",
                &name,
                "--stop",
                path_str(&stop_consume)?,
            ]
            .to_vec();
            if t.replicated {
                args.push("--replicated");
            }
            consumers.push((i, py(&root, &name, &args)?));
        }
    }
    for (_, c) in &consumers {
        tokio::task::block_in_place(|| {
            c.wait_for("a subscription", Duration::from_secs(60), |l| {
                l.iter().any(|v| v.get("subscribed").is_some())
            })
        })?;
    }
    let mut producers: Vec<PyClient> = Vec::new();
    let pause = o.pause_ms.to_string();
    for (i, t) in topics.iter().enumerate() {
        let name = format!("p{i}");
        let mut args = vec![
            "produce",
            &url,
            &t.name,
            "--name",
            &name,
            "--stop",
            path_str(&stop_produce)?,
        ];
        if t.batch {
            args.push("--batch");
        }
        args.extend(["--pause-ms", &pause]);
        producers.push(py(&root, &name, &args)?);
    }
    let urls: Vec<String> = site.brokers.iter().map(|b| b.url.clone()).collect();
    let crates: Vec<crate_load::CrateProducer> = topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            crate_load::CrateProducer::start(
                &urls,
                &t.name,
                &format!("r{i}"),
                Duration::from_millis(2 * o.pause_ms),
            )
        })
        .collect();
    for p in &producers {
        tokio::task::block_in_place(|| {
            p.wait_for("the first receipts", Duration::from_secs(60), |l| {
                l.iter().filter(|v| v.get("acked").is_some()).count() >= 10
            })
        })?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while crates.iter().any(|c| c.acked() < 10) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the Rust crate's producers had no receipts within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    say(format!(
        "the load is on ({} topics); the schedule begins",
        topics.len()
    ));
    let t0 = Instant::now();
    let began = wall();
    let meta = meta_load::MetaLoad::start(
        &site.meta.endpoints(),
        &format!("/chaos/{}", o.seed),
        3,
        3,
        o.seed,
        t0,
    )?;
    let mut done = Vec::new();
    // Processes that ended by themselves (none may: a crash is a violation).
    let mut crashes: Vec<String> = Vec::new();
    for f in &schedule {
        tokio::time::sleep(Duration::from_millis(f.after_ms)).await;
        // A process that died by itself is reported before a fault could reap it unseen.
        crashes.extend(site.crashes().await);
        let started = wall();
        let applied = site.apply(f).await?;
        say(format!(
            "{:.1} s: {f} ({}) {}",
            started - began,
            applied.resolved(),
            applied.note
        ));
        tokio::time::sleep(Duration::from_millis(f.length_ms)).await;
        if let Err(e) = site.heal(&applied).await {
            // Reported with the rest; the run and its checks go on.
            crashes.push(format!("{f} could not be healed: {e:#}"));
        }
        crashes.extend(site.crashes().await);
        done.push(Done {
            fault: *f,
            hit: applied.resolved(),
            started,
            healed: wall(),
        });
    }
    if schedule.is_empty() {
        tokio::time::sleep(Duration::from_millis(o.run_ms)).await;
    }
    // The last fault's effects settle while the load goes on, as long as its bound: its
    // recovery is measured and held to it too.
    let settle_ms = schedule
        .last()
        .map_or(5_000.0, |f| measure::bound_ms(&f.kind()).max(5_000.0));
    tokio::time::sleep(Duration::from_millis(settle_ms as u64)).await;
    crashes.extend(site.crashes().await);
    let ended = wall();
    let meta_history = meta.finish().await;

    say("stopping the producers");
    std::fs::write(&stop_produce, b"")?;
    // Every line as printed (a long run has millions; parsed when read).
    let mut sent: Vec<Vec<Box<str>>> = Vec::new();
    // A producer whose last sends cannot end is a violation (the site does not take writes
    // again): its lines so far are checked with the rest.
    let mut stuck: Vec<String> = Vec::new();
    // One deadline for all of them: the run stays within its test's time limit.
    let deadline = Instant::now() + Duration::from_secs(120);
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1))
    };
    for (i, p) in producers.iter_mut().enumerate() {
        if let Err(e) = tokio::task::block_in_place(|| p.wait_exit(left())) {
            stuck.push(format!(
                "[liveness] producer p{i} did not end cleanly once the load stopped: {}\n",
                format!("{e:#}").lines().next().unwrap_or_default()
            ));
            p.kill9();
        }
        sent.push(p.take_text());
    }
    for (i, c) in crates.into_iter().enumerate() {
        sent[i].extend(c.finish(left()).await);
    }
    say("reading every topic from its first message");
    let mut stored: Vec<Vec<Received>> = Vec::new();
    for t in &topics {
        stored.push(read_all(&root, &url, &t.name, 10).await?);
    }
    say("waiting for the subscriptions to be handed every stored message");
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let behind = topics.iter().enumerate().any(|(i, _)| {
            let got = delivered_ids(&consumers, i);
            stored[i].iter().any(|m| !got.contains(&m.id))
        });
        if !behind {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    std::fs::write(&stop_consume, b"")?;
    let mut delivered: Vec<Vec<Box<str>>> = vec![Vec::new(); topics.len()];
    for (i, c) in consumers.iter_mut() {
        tokio::task::block_in_place(|| c.wait_exit(Duration::from_secs(60)))
            .with_context(|| format!("a consumer of t{i} did not finish"))?;
        delivered[*i].extend(c.take_text());
    }
    let mut replication_violations = Vec::new();
    let mut replicated_checked = 0;
    if let Some(r) = &site.remote {
        say("waiting for site west to hold every replicated message");
        for (i, t) in topics.iter().enumerate().filter(|(_, t)| t.replicated) {
            let deadline = Instant::now() + Duration::from_secs(180);
            let copy = loop {
                match read_all(&root, &r.west.url, &t.name, 2).await {
                    Ok(got) if replicated::caught_up(&stored[i], &got) => break Some(got),
                    Ok(got) if Instant::now() > deadline => break Some(got),
                    Err(e) if Instant::now() > deadline => {
                        replication_violations.push(Violation {
                            kind: "replication lost",
                            topic: t.name.clone(),
                            what: format!("site west could not be read to its end: {e:#}"),
                            excerpt: Vec::new(),
                        });
                        break None;
                    }
                    _ => tokio::time::sleep(Duration::from_secs(2)).await,
                }
            };
            if let Some(copy) = copy {
                replicated_checked += copy.len() as u64;
                replication_violations
                    .extend(replicated::check(&t.name, "west", &stored[i], &copy));
            }
        }
        // The consumers are done: each subscription's state is final at east.
        say("waiting for the replicated subscriptions to agree");
        for t in topics.iter().filter(|t| t.replicated) {
            if let Some(v) =
                subscription_agrees(&site.admin_url(), &r.west.admin_url, &t.name).await
            {
                replication_violations.push(v);
            }
        }
    }

    let mut report = Report {
        seed: o.seed,
        schedule: schedule.clone(),
        done,
        replicated: replicated_checked,
        ..Report::default()
    };
    report
        .violations
        .extend(replication_violations.iter().map(ToString::to_string));
    report.violations.extend(stuck);
    for (i, t) in topics.iter().enumerate() {
        let h = TopicHistory {
            dedup: t.dedup,
            sends: sends_of(&t.name, &format!("p{i}"), &sent[i]),
            stored: stored[i].clone(),
            delivered: BTreeMap::from([("s".to_string(), received(parsed(&delivered[i])))]),
        };
        let (violations, c) = check::check_topic(&t.name, &h);
        report.checked.sends += c.sends;
        report.checked.acked += c.acked;
        report.checked.stored += c.stored;
        report.checked.delivered += c.delivered;
        report
            .violations
            .extend(violations.iter().map(ToString::to_string));
    }
    crashes.extend(site.crashes().await);
    for c in &crashes {
        report.violations.push(format!("[crash] {c}\n"));
    }
    for (key, calls) in &meta_history {
        report.meta_ops += calls.len() as u64;
        report.meta_unknown += calls.iter().filter(|c| c.completed.is_none()).count() as u64;
        if let Err(v) = linearizable::check(calls) {
            if v.inconclusive {
                report.inconclusive.push(format!("{key}: {}", v.what));
                continue;
            }
            let mut s = format!("[linearizability] {key}: {}\n", v.what);
            for c in &v.excerpt {
                s.push_str(&format!("    {c}\n"));
            }
            report.violations.push(s);
        }
    }
    measure::measure(&mut report, &sent, &delivered, began, ended);
    if o.keep {
        if let Err(e) = keep_history(&root, began, ended, &report.done, &sent, &delivered) {
            say(format!("the history could not be kept: {e:#}"));
        }
    }
    if !report.violations.is_empty() {
        say("a violation: the schedule of this seed was");
        for f in &report.schedule {
            say(format!("  {f}"));
        }
        for (who, log) in site.logs() {
            say(format!("{who} logged to {}", log.display()));
        }
    }
    Ok(report)
}

/// Subscription `s` of `topic` at the site of `admin_url`: its backlog (entries not
/// acknowledged), and the acknowledgements and held state its sync to other sites has not
/// settled (`pending_acks` and `held` summed); None when the site has no such subscription
/// (or does not answer).
fn subscription_state(admin_url: &str, topic: &str) -> Option<(u64, u64)> {
    let (code, out, _) = crate::run_admin(&[
        "--admin-url",
        admin_url,
        "--output",
        "json",
        "topics",
        "stats",
        topic,
    ])
    .ok()?;
    if code != 0 {
        return None;
    }
    let stats: Value = serde_json::from_str(&out).ok()?;
    let sub = stats["subscriptions"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == "s")?
        .clone();
    let unsettled = sub["sync"].as_array().map_or(0, |a| {
        a.iter()
            .map(|r| r["pending_acks"].as_u64().unwrap_or(0) + r["held"].as_u64().unwrap_or(0))
            .sum()
    });
    Some((sub["backlog_entries"].as_u64()?, unsettled))
}

/// A replicated subscription's documented bound: once its state has synced (nothing pending
/// or held at east), the other site holds it where this one does (a consumer moving there
/// gets what was not acknowledged here). Waits up to 60 s for east's sync to settle and
/// west's backlog of subscription `s` to equal east's, twice in a row; the violation
/// otherwise.
async fn subscription_agrees(east: &str, west: &str, topic: &str) -> Option<Violation> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut agreed = 0;
    loop {
        let (e, w) = tokio::task::block_in_place(|| {
            (
                subscription_state(east, topic),
                subscription_state(west, topic),
            )
        });
        let same = matches!((e, w), (Some((eb, 0)), Some((wb, _))) if eb == wb);
        agreed = if same { agreed + 1 } else { 0 };
        if agreed >= 2 {
            return None;
        }
        if Instant::now() > deadline {
            return Some(Violation {
                kind: "replicated subscription",
                topic: topic.to_string(),
                what: format!(
                    "60 s after the run, subscription s is (backlog, unsettled sync) {e:?} at east and {w:?} at west"
                ),
                excerpt: Vec::new(),
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn path_str(p: &Path) -> anyhow::Result<&str> {
    p.to_str().context("a path that is not UTF-8")
}

fn py(root: &Path, name: &str, args: &[&str]) -> anyhow::Result<PyClient> {
    PyClient::spawn_script_as_text(
        "chaos_client.py",
        args,
        &root.join(format!("{name}.stderr")),
        &[],
    )
}

/// A topic's messages from its first, read again (up to `attempts` times) until a reader gets
/// to the end.
async fn read_all(
    root: &Path,
    url: &str,
    topic: &str,
    attempts: usize,
) -> anyhow::Result<Vec<Received>> {
    let mut last = String::new();
    for attempt in 0..attempts {
        let name = format!("read-{}-{attempt}", topic.rsplit('/').next().unwrap_or("t"));
        let mut r = py(root, &name, &["read", url, topic])?;
        match tokio::task::block_in_place(|| r.wait_exit(Duration::from_secs(120))) {
            Ok(()) => {
                let lines = r.take_text();
                if parsed(&lines).any(|v| v.get("done").is_some()) {
                    return Ok(received(parsed(&lines)));
                }
                last = "ended without reaching the end".to_string();
            }
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    bail!("{topic} could not be read to its end: {last}")
}

/// Lines as printed, parsed one at a time.
pub(crate) fn parsed(lines: &[Box<str>]) -> impl Iterator<Item = Value> + '_ {
    lines.iter().filter_map(|l| serde_json::from_str(l).ok())
}

fn received(lines: impl Iterator<Item = Value>) -> Vec<Received> {
    lines
        .filter_map(|v| {
            Some(Received {
                producer: v.get("p")?.as_str()?.to_string(),
                seq: v.get("s")?.as_u64()?,
                id: v.get("id")?.as_str()?.to_string(),
            })
        })
        .collect()
}

fn delivered_ids(
    consumers: &[(usize, PyClient)],
    topic: usize,
) -> std::collections::HashSet<String> {
    consumers
        .iter()
        .filter(|(i, _)| *i == topic)
        .flat_map(|(_, c)| {
            let mut got = Vec::new();
            c.each_line(|l| {
                got.extend(received(serde_json::from_str::<Value>(l).into_iter()));
            });
            got
        })
        .map(|m| m.id)
        .collect()
}

/// The sends of a topic's producers, from their lines (the Python producer's lines do not
/// name it: `python_name`).
fn sends_of(topic: &str, python_name: &str, lines: &[Box<str>]) -> Vec<Send> {
    let mut by_send: BTreeMap<(String, u64), Option<String>> = BTreeMap::new();
    for v in parsed(lines) {
        let name = v.get("p").and_then(Value::as_str).unwrap_or(python_name);
        if let Some(s) = v.get("acked").and_then(Value::as_u64) {
            let id = v
                .get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            by_send.insert((name.to_string(), s), Some(id));
        } else if let Some(s) = v.get("failed").and_then(Value::as_u64) {
            by_send.entry((name.to_string(), s)).or_insert(None);
        }
    }
    by_send
        .into_iter()
        .map(|((producer, seq), acked)| Send {
            topic: topic.to_string(),
            producer,
            seq,
            acked,
        })
        .collect()
}
