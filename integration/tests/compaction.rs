//! Topic compaction against a real `meridian standalone`.
//!
//! With the stock Python client (integration/python/client.py `keyed-produce` and
//! `compacted-read`) and `meridian-admin`: `topics compact` and `compaction-status`, compacted
//! readers and durable read_compacted subscriptions (the latest message of each key up to the
//! horizon, with its original id, then everything after), batches, incremental runs, kill -9,
//! the threshold policy, and retention trimming what a compaction covers. Each test asserts
//! exactly which messages arrive, with which ids, in which order.
//!
//! Where the contract left a choice, Pulsar's behaviour is asserted:
//! - The CLI is given full topic names (`persistent://public/default/x`); its texts name the
//!   topic as given.
//! - After the horizon messages come as published: tombstones (empty payloads) and messages
//!   without a key included.
//! - A compacted reader of a topic whose only key was deleted: `has_message_available()`
//!   answers false (Pulsar's GET_LAST_MESSAGE_ID rule for read_compacted, #13533), promptly.
//! - Shared and Key_Shared with read_compacted: the C++ client under the Python one refuses
//!   them itself (InvalidConfiguration) before the broker sees them, so the broker's refusal
//!   is checked with a raw SUBSCRIBE: NotAllowedError, as Pulsar's, with a text naming
//!   compacted reads, exclusive and failover.
//! - A consumer that reconnects may get again, with a redelivery count, what it had received
//!   but not acknowledged: ids and values are compared, not redelivery counts.
//! - Backlog 0 after acknowledging what was received: a durable compacted subscription counts
//!   what the view skipped (earlier versions, tombstones, entries removed whole) as
//!   acknowledged. Pulsar leaves those in its backlog; Meridian does not.
//! - `compaction-status` exits 1 with ERROR in the JSON mode as well; ERROR is provoked with
//!   `broker.compaction_keys_max` below a topic's number of distinct keys.
//! - The `__compaction` cursor is listed by `topics stats-internal` once a threshold applies.
//! - After a compaction, retention deletes every ledger before the one holding the horizon;
//!   that one may stay (it may be the open ledger).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use meridian_integration::{run_admin, step, PyClient, StandaloneProc};
use serde_json::{json, Value};

/// A Python client run.
const T: Duration = Duration::from_secs(120);
/// A `meridian-admin` run (`compaction-status -w` included).
const ADMIN_T: Duration = Duration::from_secs(60);

/// A message as published or received: its partition key (None: no key), its payload as text
/// ("": a tombstone), its id `ledger:entry` or `ledger:entry:batch_index`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Msg {
    key: Option<String>,
    value: String,
    id: String,
}

impl Msg {
    /// A line of `keyed-produce` or `compacted-read` that carries a message.
    fn from_line(v: &Value) -> Option<Msg> {
        Some(Msg {
            key: v.get("key")?.as_str().map(str::to_string),
            value: v.get("value")?.as_str()?.to_string(),
            id: v.get("id")?.as_str()?.to_string(),
        })
    }
}

/// `[key, value]` for `keyed-produce --messages`.
fn kv(key: &str, value: &str) -> Value {
    json!([key, value])
}

/// A message without a partition key.
fn nokey(value: &str) -> Value {
    json!([null, value])
}

/// With `--batch`: the batch so far is sent.
fn flush() -> Value {
    json!("flush")
}

/// `versions` rounds of keys `k0..k{keys}`, values `kK-vV`.
fn rounds(keys: usize, versions: usize) -> Vec<Value> {
    let mut items = Vec::new();
    for v in 1..=versions {
        for k in 0..keys {
            items.push(kv(&format!("k{k}"), &format!("k{k}-v{v}")));
        }
    }
    items
}

/// What a compacted reader gets of `published` (in log order) when the horizon is its last
/// message: the latest message of each key unless that is a tombstone, in log order; nothing
/// without a key.
fn view(published: &[Msg]) -> Vec<Msg> {
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (i, m) in published.iter().enumerate() {
        if let Some(k) = &m.key {
            last.insert(k.as_str(), i);
        }
    }
    published
        .iter()
        .enumerate()
        .filter(|(i, m)| m.key.as_deref().is_some_and(|k| last[k] == *i) && !m.value.is_empty())
        .map(|(_, m)| m.clone())
        .collect()
}

fn values(msgs: &[Msg]) -> Vec<&str> {
    msgs.iter().map(|m| m.value.as_str()).collect()
}

fn ledger_of(id: &str) -> u64 {
    id.split(':')
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("not a message id: {id:?}"))
}

/// `got` is exactly `want`, in order; a failure shows both lists.
fn assert_msgs(what: &str, got: &[Msg], want: &[Msg]) {
    if got == want {
        return;
    }
    let show = |l: &[Msg]| {
        l.iter()
            .map(|m| format!("  {} {:?} = {:?}", m.id, m.key, m.value))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let first = (0..got.len().max(want.len()))
        .find(|&i| got.get(i) != want.get(i))
        .unwrap_or(0);
    panic!(
        "{what}: differs at index {first} ({} received, {} expected)\nreceived:\n{}\nexpected:\n{}",
        got.len(),
        want.len(),
        show(got),
        show(want)
    );
}

/// Polls `check` until it answers Ok; a timeout shows what it answered last.
fn wait_for(what: &str, within: Duration, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + within;
    loop {
        match check() {
            Ok(()) => return,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {within:?} waiting for {what}; last seen: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A standalone in its own directory (the Python clients' stderr files go there too). A
/// failing test prints the end of the standalone's log.
struct Site {
    s: StandaloneProc,
    dir: tempfile::TempDir,
}

impl Drop for Site {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.s.log_text();
            let tail: Vec<&str> = log.lines().rev().take(80).collect();
            eprintln!(
                "--- standalone log, last {} lines (client stderr in {}) ---",
                tail.len(),
                self.dir.path().display()
            );
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

impl Site {
    fn start(env: &[(&str, &str)]) -> Site {
        let dir = tempfile::tempdir().unwrap();
        let mut s = StandaloneProc::new(dir.path());
        for (k, v) in env {
            s.env(k, v);
        }
        s.start().expect("standalone starts");
        Site { s, dir }
    }

    /// `meridian-admin ARGS` against this standalone: (exit code, stdout, stderr).
    fn admin(&self, args: &[&str]) -> (i32, String, String) {
        let mut all: Vec<String> = vec!["--admin-url".into(), self.s.admin_url.clone()];
        all.extend(args.iter().map(|a| a.to_string()));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            let _ = tx.send(run_admin(&refs).map_err(|e| format!("{e:#}")));
        });
        match rx.recv_timeout(ADMIN_T) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => panic!("meridian-admin {args:?} did not run: {e}"),
            Err(_) => panic!("meridian-admin {args:?} did not finish within {ADMIN_T:?}"),
        }
    }

    fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.admin(args);
        assert_eq!(code, 0, "meridian-admin {args:?} failed: {out}{err}");
        out
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--output", "json"];
        all.extend_from_slice(args);
        let out = self.ok(&all);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("meridian-admin {args:?}: not JSON ({e}): {out}"))
    }

    /// A refusal: a non-zero exit and `status` on stderr.
    fn refused(&self, args: &[&str], status: &str) -> String {
        let (code, out, err) = self.admin(args);
        assert_ne!(code, 0, "meridian-admin {args:?} should fail: {out}");
        assert!(err.contains(status), "{args:?}: want {status}, got {err}");
        err
    }

    /// `topics compact TOPIC`: accepted, with Pulsar's text.
    fn compact(&self, topic: &str) {
        let out = self.ok(&["topics", "compact", topic]);
        assert_eq!(
            out.trim(),
            format!("Topic compaction requested for {topic}")
        );
    }

    /// `topics compaction-status TOPIC -w`: a success.
    fn wait_success(&self, topic: &str) {
        let (code, out, err) = self.admin(&["topics", "compaction-status", topic, "-w"]);
        assert_eq!(
            (code, out.trim()),
            (0, "Compaction was a success"),
            "compaction-status {topic} -w: {err}"
        );
    }

    fn compact_and_wait(&self, topic: &str) {
        self.compact(topic);
        self.wait_success(topic);
    }

    /// `compaction-status` in JSON: (status, last_error); the exit code is 1 with ERROR only.
    fn status(&self, topic: &str) -> (String, String) {
        let (code, out, err) =
            self.admin(&["--output", "json", "topics", "compaction-status", topic]);
        let v: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("compaction-status {topic}: not JSON ({e}): {out}{err}"));
        let field = |f: &str| {
            v[f].as_str()
                .unwrap_or_else(|| panic!("compaction-status {topic}: no {f} in {v}"))
                .to_string()
        };
        let (status, last_error) = (field("status"), field("last_error"));
        let want = i32::from(status == "ERROR");
        assert_eq!(code, want, "compaction-status {topic} with {status}: {err}");
        (status, last_error)
    }

    /// `compaction-status TOPIC` as people see it.
    fn status_text(&self, topic: &str) -> String {
        let (code, out, err) = self.admin(&["topics", "compaction-status", topic]);
        assert_eq!(code, 0, "compaction-status {topic}: {out}{err}");
        out.trim().to_string()
    }

    /// The backlog (entries) of subscription `sub`, None if it is not listed.
    fn backlog(&self, topic: &str, sub: &str) -> Option<u64> {
        let st = self.json(&["topics", "stats", topic]);
        st["subscriptions"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == sub)
            .and_then(|s| s["backlog_entries"].as_u64())
    }

    /// The topic's ledgers, from `stats-internal`, and the whole answer.
    fn ledgers(&self, topic: &str) -> (Vec<u64>, Value) {
        let st = self.json(&["topics", "stats-internal", topic]);
        let ids = st["ledgers"]
            .as_array()
            .unwrap_or_else(|| panic!("no ledgers in {st}"))
            .iter()
            .map(|l| l["ledger_id"].as_u64().expect("ledger_id"))
            .collect();
        (ids, st)
    }

    fn cursors(&self, topic: &str) -> Vec<String> {
        let st = self.json(&["topics", "stats-internal", topic]);
        st["cursors"]
            .as_array()
            .map(|c| {
                c.iter()
                    .filter_map(|c| c["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Runs client.py to completion; its lines.
    fn py(&self, name: &str, args: &[&str]) -> Vec<Value> {
        PyClient::run(self.dir.path(), name, args)
            .finish(T)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"))
    }

    /// `keyed-produce TOPIC ARGS`: what was published, in order.
    fn publish_args(&self, name: &str, topic: &str, args: &[&str]) -> Vec<Msg> {
        let mut all = vec!["keyed-produce", self.s.url.as_str(), topic];
        all.extend_from_slice(args);
        let lines = self.py(name, &all);
        let got: Vec<Msg> = lines.iter().filter_map(Msg::from_line).collect();
        let done = lines.iter().find_map(|v| v["done"].as_u64());
        assert_eq!(
            done,
            Some(got.len() as u64),
            "{name}: receipts {got:?}, lines {lines:?}"
        );
        got
    }

    /// Publishes `items` (`[key, value]` pairs, and `"flush"` between batches with `batch`).
    fn publish(&self, name: &str, topic: &str, items: &[Value], batch: bool) -> Vec<Msg> {
        let list = Value::Array(items.to_vec()).to_string();
        let mut args = vec!["--messages", list.as_str()];
        if batch {
            args.push("--batch");
        }
        let got = self.publish_args(name, topic, &args);
        let sent = items.iter().filter(|v| v.is_array()).count();
        assert_eq!(got.len(), sent, "{name}: {sent} sent, receipts {got:?}");
        got
    }

    /// `compacted-read TOPIC ARGS`: its lines and the messages received.
    fn read(&self, name: &str, topic: &str, args: &[&str]) -> (Vec<Value>, Vec<Msg>) {
        let mut all = vec!["compacted-read", self.s.url.as_str(), topic];
        all.extend_from_slice(args);
        let lines = self.py(name, &all);
        let msgs = lines.iter().filter_map(Msg::from_line).collect();
        (lines, msgs)
    }

    /// Reads as many messages as `want` holds (and waits 1 s for one more) with `args`: they
    /// are `want`, in order.
    fn expect_read(&self, name: &str, topic: &str, args: &[&str], want: &[Msg]) {
        let count = want.len().to_string();
        let mut all = args.to_vec();
        all.extend(["--count", count.as_str(), "--extra-ms", "1000"]);
        let (lines, got) = self.read(name, topic, &all);
        assert!(
            lines.iter().all(|v| v.get("subscribe_failed").is_none()),
            "{name}: {lines:?}"
        );
        assert_msgs(
            &format!("{name}: compacted-read {topic} {args:?}"),
            &got,
            want,
        );
    }
}

#[test]
fn compacted_readers_and_subscriptions_get_the_latest_of_each_key_then_everything_after() {
    let site = Site::start(&[]);
    let t = "persistent://public/default/kv";
    step("36 messages: 10 keys x 3 versions, then messages without a key, tombstones, k5 written again after its tombstone");
    let mut items = rounds(10, 3);
    items.extend([
        nokey("no-key-1"),
        kv("k3", ""),
        kv("k5", ""),
        kv("k5", "k5-v4"),
        nokey("no-key-2"),
        kv("k7", "k7-v4"),
    ]);
    let first = site.publish("p1", t, &items, false);
    step("a plain reader gets all 36");
    site.expect_read("plain-1", t, &["--plain"], &first);

    step("compact: a compacted reader gets the latest of each key, with its original id");
    site.compact_and_wait(t);
    let (status, _) = site.status(t);
    assert_eq!(status, "SUCCESS");
    let view1 = view(&first);
    assert_eq!(
        values(&view1),
        ["k0-v3", "k1-v3", "k2-v3", "k4-v3", "k6-v3", "k8-v3", "k9-v3", "k5-v4", "k7-v4"],
        "the test's own expectation"
    );
    site.expect_read("reader-1", t, &[], &view1);
    step("durable read_compacted subscriptions, exclusive and failover, get the same");
    site.expect_read("ex-1", t, &["--sub", "ex", "--type", "exclusive"], &view1);
    site.expect_read("fo-1", t, &["--sub", "fo", "--type", "failover"], &view1);

    step("after the horizon messages come as published: a tombstone and no key included");
    let second = site.publish(
        "p2",
        t,
        &[
            kv("k1", "k1-v4"),
            kv("k3", "k3-v5"),
            nokey("no-key-3"),
            kv("k1", ""),
            kv("k8", "k8-v4"),
        ],
        false,
    );
    site.expect_read(
        "reader-2",
        t,
        &[],
        &[view1.clone(), second.clone()].concat(),
    );
    step("the durable subscriptions go on with the new messages only");
    site.expect_read("ex-2", t, &["--sub", "ex", "--type", "exclusive"], &second);
    site.expect_read("fo-2", t, &["--sub", "fo", "--type", "failover"], &second);
    let all = [first, second].concat();
    site.expect_read("plain-2", t, &["--plain"], &all);

    step("a second compaction: the latest of each key over everything");
    site.compact_and_wait(t);
    let view2 = view(&all);
    assert_eq!(
        values(&view2),
        ["k0-v3", "k2-v3", "k4-v3", "k6-v3", "k9-v3", "k5-v4", "k7-v4", "k3-v5", "k8-v4"],
        "the test's own expectation"
    );
    site.expect_read("reader-3", t, &[], &view2);
    site.expect_read("ex2-1", t, &["--sub", "ex2", "--type", "exclusive"], &view2);
    site.expect_read("plain-3", t, &["--plain"], &all);

    step("Shared and Key_Shared with read_compacted: the Python client refuses them");
    for ty in ["shared", "key_shared"] {
        let (lines, got) = site.read(
            &format!("refused-{ty}"),
            t,
            &["--sub", "nope", "--type", ty, "--first-ms", "500"],
        );
        assert!(
            got.is_empty() && lines.iter().any(|v| v.get("subscribe_failed").is_some()),
            "{ty} with read_compacted: {lines:?}"
        );
    }
    step("and so does the broker, to a raw SUBSCRIBE");
    {
        use meridian_integration::raw::{error_of, subscribe, Raw};
        use meridian_protocol::pb::{command_subscribe::SubType, ServerError};
        let mut c = Raw::connected(&site.s.url);
        for (id, ty) in [(1u64, SubType::Shared), (2, SubType::KeyShared)] {
            let mut cmd = subscribe(t, &format!("raw-{id}"), id, id);
            let sc = cmd.subscribe.as_mut().expect("a subscribe command");
            sc.sub_type = ty as i32;
            sc.read_compacted = Some(true);
            c.send(&cmd);
            let (code, msg) = error_of(&c.expect());
            assert_eq!(code, ServerError::NotAllowedError, "{ty:?}: {msg}");
            let lower = msg.to_lowercase();
            assert!(
                lower.contains("compacted")
                    && lower.contains("exclusive")
                    && lower.contains("failover"),
                "{ty:?}: {msg}"
            );
        }
    }
}

#[test]
fn batches_keep_only_their_latest_items_with_batch_ids_and_batch_index_acks_clear_the_backlog() {
    let site = Site::start(&[]);
    let t = "persistent://public/default/batches";
    step("three batches, keys interleaved, a tombstone inside the first");
    let items = [
        kv("k1", "a1"),
        kv("k2", "a2"),
        kv("k1", "a3"),
        kv("k3", "a4"),
        kv("k2", ""),
        flush(),
        kv("k4", "b1"),
        kv("k1", "b2"),
        kv("k5", "b3"),
        kv("k4", "b4"),
        flush(),
        kv("k5", "c1"),
        kv("k6", "c2"),
        kv("k6", "c3"),
        nokey("c4"),
        flush(),
    ];
    let published = site.publish("p1", t, &items, true);
    let entries: BTreeSet<&str> = published
        .iter()
        .map(|m| m.id.rsplit_once(':').map_or(m.id.as_str(), |(e, _)| e))
        .collect();
    assert!(
        entries.len() == 3 && published.iter().all(|m| m.id.split(':').count() == 3),
        "three batches as flushed, ids ledger:entry:index: {published:?}"
    );
    step("compact: only the latest item of each key, with its batch id");
    site.compact_and_wait(t);
    let v = view(&published);
    assert_eq!(
        values(&v),
        ["a4", "b2", "b4", "c1", "c3"],
        "the test's own expectation"
    );
    site.expect_read("reader-1", t, &[], &v);
    site.expect_read("plain-1", t, &["--plain"], &published);

    step("a durable subscription with batch-index acks acknowledges what it gets: backlog 0");
    site.expect_read(
        "bia",
        t,
        &["--sub", "bia", "--type", "exclusive", "--batch-index-ack"],
        &v,
    );
    wait_for(
        "no backlog on bia",
        Duration::from_secs(10),
        || match site.backlog(t, "bia") {
            Some(0) => Ok(()),
            other => Err(format!(
                "backlog {other:?}; stats {}",
                site.json(&["topics", "stats", t])
            )),
        },
    );

    step("after the horizon, a batch with k3 again and k7 written and deleted comes whole");
    let more = site.publish(
        "p2",
        t,
        &[kv("k3", "d1"), kv("k7", "d2"), kv("k7", ""), flush()],
        true,
    );
    site.expect_read("reader-2", t, &[], &[v.clone(), more.clone()].concat());
    step("a second compaction over the batches");
    site.compact_and_wait(t);
    let all = [published, more].concat();
    let v2 = view(&all);
    assert_eq!(
        values(&v2),
        ["b2", "b4", "c1", "c3", "d1"],
        "the test's own expectation"
    );
    site.expect_read("reader-3", t, &[], &v2);
    site.expect_read("fo", t, &["--sub", "fo", "--type", "failover"], &v2);
    site.expect_read("plain-2", t, &["--plain"], &all);
}

#[test]
fn durable_compacted_subscriptions_resume_without_gap_or_duplicate_and_the_view_survives_kill9() {
    let mut site = Site::start(&[]);
    let t = "persistent://public/default/durable";
    step("12 keys x 2 versions, k0 deleted; compact");
    let mut items = rounds(12, 2);
    items.push(kv("k0", ""));
    let first = site.publish("p1", t, &items, false);
    site.compact_and_wait(t);
    let v = view(&first);
    assert_eq!(v.len(), 11, "the test's own expectation: {v:?}");

    let subs = [
        ("ex", "exclusive", "individual", 4usize),
        ("fo", "failover", "cumulative", 7),
    ];
    for (sub, ty, ack, k) in subs {
        step(format!(
            "{sub}: {k} messages acknowledged ({ack}), close, reconnect: the rest, once"
        ));
        let count = k.to_string();
        let (lines, got) = site.read(
            &format!("{sub}-1"),
            t,
            &["--sub", sub, "--type", ty, "--ack", ack, "--count", &count],
        );
        assert_msgs(&format!("{sub} before closing ({lines:?})"), &got, &v[..k]);
        site.expect_read(
            &format!("{sub}-2"),
            t,
            &["--sub", sub, "--type", ty, "--ack", ack],
            &v[k..],
        );
        // What the view skipped (earlier versions, the tombstone) counts as acknowledged.
        wait_for(
            &format!("{sub} has no backlog"),
            Duration::from_secs(10),
            || match site.backlog(t, sub) {
                Some(0) => Ok(()),
                other => Err(format!("backlog {other:?}")),
            },
        );
    }

    step("messages after the horizon: each subscription gets them, nothing else");
    let second = site.publish(
        "p2",
        t,
        &[kv("k1", "k1-v3"), kv("k0", "k0-v3"), nokey("no-key")],
        false,
    );
    for (sub, ty, ack, _) in subs {
        site.expect_read(
            &format!("{sub}-3"),
            t,
            &["--sub", sub, "--type", ty, "--ack", ack],
            &second,
        );
    }

    step("an incremental compaction");
    site.compact_and_wait(t);
    let all = [first, second].concat();
    let v2 = view(&all);
    site.expect_read("reader-1", t, &[], &v2);

    step("kill -9 and restart on the same data directory");
    // Acknowledgements are persisted within broker.cursor_persist_interval_ms.
    std::thread::sleep(Duration::from_millis(1000));
    site.s.kill9().unwrap();
    site.s.start().unwrap();
    step("the same view; the status is not run since the broker started");
    site.expect_read("reader-2", t, &[], &v2);
    site.expect_read("fo2", t, &["--sub", "fo2", "--type", "failover"], &v2);
    site.expect_read("plain", t, &["--plain"], &all);
    for (sub, ty, ack, _) in subs {
        site.expect_read(
            &format!("{sub}-after-restart"),
            t,
            &["--sub", sub, "--type", ty, "--ack", ack],
            &[],
        );
    }
    assert_eq!(
        site.status_text(t),
        format!("Compaction has not been run for {t} since broker startup")
    );
    assert_eq!(site.status(t).0, "NOT_RUN");
}

#[test]
fn compaction_admin_texts_concurrent_requests_errors_unknown_and_tombstone_only_topics_delete() {
    let site = Site::start(&[
        ("MERIDIAN_BROKER_COMPACTION_KEYS_MAX", "100"),
        // Each run lasts at least 1 s: concurrent requests certainly meet one.
        ("MERIDIAN_TEST_FAILPOINTS", "compaction:pause_1s"),
    ]);
    let t = "persistent://public/default/adm";
    step("3,000 messages over 50 keys; not compacted yet");
    let mut published = site.publish_args("p-1", t, &["--count", "3000", "--keys", "50"]);
    assert_eq!(
        site.status_text(t),
        format!("Compaction has not been run for {t} since broker startup")
    );
    assert_eq!(site.status(t).0, "NOT_RUN");

    step("three requests at once: one runs, the others are refused while it does");
    let mut refusal = None;
    for round in 1..=5 {
        if round > 1 {
            published.extend(site.publish_args(
                &format!("p-{round}"),
                t,
                &["--count", "3000", "--keys", "50"],
            ));
        }
        let on = &site;
        let results: Vec<(i32, String, String)> = std::thread::scope(|sc| {
            let runs: Vec<_> = (0..3)
                .map(|_| sc.spawn(move || on.admin(&["topics", "compact", t])))
                .collect();
            runs.into_iter()
                .map(|r| r.join().expect("an admin run"))
                .collect()
        });
        assert!(
            results.iter().any(|r| r.0 == 0),
            "round {round}: none accepted: {results:?}"
        );
        for (code, out, err) in &results {
            if *code == 0 {
                assert_eq!(out.trim(), format!("Topic compaction requested for {t}"));
            } else {
                assert!(
                    err.contains("already in progress"),
                    "round {round}: refused for another reason: {out}{err}"
                );
                refusal = Some(err.clone());
            }
        }
        let text = site.status_text(t);
        assert!(
            [
                "Compaction is currently running",
                "Compaction was a success"
            ]
            .contains(&text.as_str()),
            "right after a request: {text}"
        );
        site.wait_success(t);
        if refusal.is_some() {
            break;
        }
    }
    assert!(
        refusal.is_some(),
        "in 5 rounds of 3 simultaneous requests none was refused as already in progress"
    );
    assert_eq!(site.status(t).0, "SUCCESS");
    site.expect_read("reader", t, &[], &view(&published));

    step("more distinct keys than broker.compaction_keys_max (100): an error");
    let many = "persistent://public/default/many-keys";
    site.publish_args("p-many", many, &["--count", "150", "--keys", "150"]);
    site.compact(many);
    let (code, out, err) = site.admin(&["topics", "compaction-status", many, "-w"]);
    assert_eq!(code, 1, "an error exits 1: {out}{err}");
    let prefix = "Error in compaction: ";
    assert!(
        format!("{out}{err}")
            .lines()
            .any(|l| l.starts_with(prefix) && l.len() > prefix.len()),
        "{out}{err}"
    );
    let (status, why) = site.status(many);
    assert!(status == "ERROR" && !why.is_empty(), "{status}: {why:?}");

    step("an unknown topic: not found");
    let (code, out, err) =
        site.admin(&["topics", "compact", "persistent://public/default/nowhere"]);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("NotFound") || err.to_lowercase().contains("not found"),
        "{err}"
    );

    step("a topic whose only key was deleted: nothing to read, has_message_available() false, promptly");
    let tomb = "persistent://public/default/tombstones";
    site.publish("p-tomb", tomb, &[kv("k", "v"), kv("k", "")], false);
    site.compact_and_wait(tomb);
    let lines = PyClient::run(
        site.dir.path(),
        "tomb-reader",
        &[
            "compacted-read",
            site.s.url.as_str(),
            tomb,
            "--check-available",
            "--first-ms",
            "2000",
        ],
    )
    .finish(Duration::from_secs(30))
    .unwrap_or_else(|e| panic!("a compacted reader of a tombstone-only topic hung: {e:#}"));
    let available = lines.iter().find_map(|v| v.get("has_message_available"));
    assert_eq!(available, Some(&json!(false)), "{lines:?}");
    let got: Vec<Msg> = lines.iter().filter_map(Msg::from_line).collect();
    assert!(got.is_empty(), "read from a tombstone-only topic: {got:?}");

    step("a compacted topic can be deleted");
    site.ok(&["topics", "delete", t, "--force"]);
    site.refused(&["topics", "stats", t], "NotFound");
}

#[test]
fn compaction_thresholds_compact_topics_by_themselves_the_topic_policy_over_the_namespace() {
    let site = Site::start(&[("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200")]);
    let ns = "public/default";
    site.ok(&["namespaces", "create", "public/own"]);
    let auto = "persistent://public/default/thr-auto";
    let big = "persistent://public/default/thr-big";
    let own = "persistent://public/own/t";
    let none = "persistent://public/own/none";
    step("60 messages of 100 bytes over 10 keys on each of four topics, no threshold yet");
    let mut published: HashMap<&str, Vec<Msg>> = HashMap::new();
    for (i, topic) in [auto, big, own, none].into_iter().enumerate() {
        let got = site.publish_args(
            &format!("p-{i}"),
            topic,
            &["--count", "60", "--keys", "10", "--size", "100"],
        );
        published.insert(topic, got);
    }
    assert_eq!(
        site.json(&["namespaces", "get-compaction-threshold", ns]),
        Value::Null
    );

    let compacted = |topic: &str| {
        wait_for(
            &format!("{topic} compacted by its threshold"),
            Duration::from_secs(30),
            || match site.status(topic) {
                (s, _) if s == "SUCCESS" => Ok(()),
                (s, e) => Err(format!("{s} {e}")),
            },
        );
    };

    step("topic thresholds: 1G on thr-big, 1K on own/t (whose namespace has none)");
    site.ok(&["topics", "set-compaction-threshold", big, "-t", "1G"]);
    site.ok(&[
        "topics",
        "set-compaction-threshold",
        own,
        "--threshold",
        "1K",
    ]);
    assert_eq!(
        site.json(&["topics", "get-compaction-threshold", big]),
        json!(1u64 << 30)
    );
    assert_eq!(
        site.json(&["topics", "get-compaction-threshold", own]),
        json!(1024)
    );
    step("own/t compacts by itself, everything published before its threshold included");
    compacted(own);
    site.expect_read("view-own", own, &[], &view(&published[own]));
    // thr-big's own threshold was set with own/t's: in force too by now.
    std::thread::sleep(Duration::from_millis(500));

    step("namespace threshold: 2K, then 1K");
    site.ok(&[
        "namespaces",
        "set-compaction-threshold",
        ns,
        "--threshold",
        "2K",
    ]);
    assert_eq!(
        site.json(&["namespaces", "get-compaction-threshold", ns]),
        json!(2048)
    );
    site.ok(&["namespaces", "set-compaction-threshold", ns, "-t", "1K"]);
    assert_eq!(
        site.ok(&["namespaces", "get-compaction-threshold", ns])
            .trim(),
        "1024"
    );
    assert_eq!(
        site.json(&["namespaces", "get-compaction-threshold", ns]),
        json!(1024)
    );
    step("thr-auto (the namespace's threshold) compacts by itself");
    compacted(auto);
    site.expect_read("view-auto", auto, &[], &view(&published[auto]));
    step("thr-big (its own 1G over the namespace's 1K) and own/none (no threshold) do not");
    std::thread::sleep(Duration::from_millis(1500));
    for topic in [big, none] {
        assert_eq!(site.status(topic).0, "NOT_RUN", "{topic}");
    }

    step("without its own threshold thr-big follows the namespace's 1K");
    site.ok(&["topics", "remove-compaction-threshold", big]);
    assert_eq!(
        site.json(&["topics", "get-compaction-threshold", big]),
        Value::Null
    );
    compacted(big);
    site.expect_read("view-big", big, &[], &view(&published[big]));

    step("the namespace's threshold removed: null");
    site.ok(&["namespaces", "remove-compaction-threshold", ns]);
    assert_eq!(
        site.json(&["namespaces", "get-compaction-threshold", ns]),
        Value::Null
    );
}

#[test]
fn with_retention_0_consumed_ledgers_stay_until_a_compaction_covers_them() {
    let mut site = Site::start(&[
        ("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200"),
        ("MERIDIAN_BROKER_LEDGER_ROLLOVER_ENTRIES_MAX", "5"),
        ("MERIDIAN_BROKER_LEDGER_ROLLOVER_MIN_AGE_MS", "0"),
    ]);
    let ns = "public/default";
    let t = "persistent://public/default/trim";
    site.ok(&[
        "namespaces",
        "set-retention",
        ns,
        "--size",
        "0",
        "--time",
        "0",
    ]);
    step("a threshold never reached: the __compaction cursor is there from the earliest message");
    site.ok(&["namespaces", "set-compaction-threshold", ns, "-t", "1G"]);
    site.ok(&["topics", "create", t]);
    site.ok(&[
        "topics",
        "create-subscription",
        t,
        "-s",
        "s",
        "-m",
        "earliest",
    ]);
    wait_for("a __compaction cursor", Duration::from_secs(10), || {
        let names = site.cursors(t);
        if names.iter().any(|n| n == "__compaction") {
            Ok(())
        } else {
            Err(format!("cursors {names:?}"))
        }
    });

    step("40 messages (10 keys x 4 versions), 5 entries a ledger; s consumes them all");
    let published = site.publish("p", t, &rounds(10, 4), false);
    let used: BTreeSet<u64> = published.iter().map(|m| ledger_of(&m.id)).collect();
    assert!(used.len() >= 8, "a ledger every 5 entries: {used:?}");
    site.expect_read(
        "s",
        t,
        &["--plain", "--sub", "s", "--type", "exclusive"],
        &published,
    );
    wait_for(
        "s acknowledged everything",
        Duration::from_secs(10),
        || match site.backlog(t, "s") {
            Some(0) => Ok(()),
            other => Err(format!("backlog {other:?}")),
        },
    );
    step("nothing is trimmed before a compaction: __compaction still needs it all");
    std::thread::sleep(Duration::from_millis(1500));
    let (ledgers, st) = site.ledgers(t);
    let gone: Vec<&u64> = used.iter().filter(|l| !ledgers.contains(*l)).collect();
    assert!(
        gone.is_empty(),
        "ledgers {gone:?} trimmed before any compaction: {st}"
    );
    assert_eq!(site.json(&["topics", "stats", t])["storage_entries"], 40);

    step("compact: the ledgers before the horizon's go");
    site.compact_and_wait(t);
    let horizon_ledger = ledger_of(&published.last().expect("published").id);
    wait_for(
        "the ledgers before the horizon's trimmed",
        Duration::from_secs(20),
        || {
            let (ledgers, _) = site.ledgers(t);
            let left: Vec<u64> = ledgers
                .iter()
                .copied()
                .filter(|l| *l < horizon_ledger)
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "still there: {left:?} (all {ledgers:?}, the horizon in {horizon_ledger})"
                ))
            }
        },
    );
    step("a compacted reader from the earliest still gets the latest of every key");
    let v = view(&published);
    assert_eq!(v.len(), 10, "the test's own expectation: {v:?}");
    site.expect_read("reader", t, &[], &v);

    step("a durable compacted subscription created after the trim: the view (partly in trimmed ledgers), all acknowledged, nothing again after kill -9");
    let late = ["--sub", "late", "--type", "exclusive"];
    site.expect_read("late-1", t, &late, &v);
    wait_for(
        "late acknowledged everything",
        Duration::from_secs(10),
        || match site.backlog(t, "late") {
            Some(0) => Ok(()),
            other => Err(format!("backlog {other:?}")),
        },
    );
    // Acknowledgements are persisted within broker.cursor_persist_interval_ms.
    std::thread::sleep(Duration::from_millis(1000));
    site.s.kill9().unwrap();
    site.s.start().unwrap();
    site.expect_read("late-2", t, &late, &[]);
    assert_eq!(site.backlog(t, "late"), Some(0));

    step("compaction's own subscription is moved by compaction only");
    let c = "__compaction";
    for args in [
        vec!["topics", "clear-backlog", t, "-s", c],
        vec!["topics", "skip", t, "-s", c, "-n", "1"],
        vec!["topics", "expire-messages", t, "-s", c, "-t", "1"],
        vec!["topics", "reset-cursor", t, "-s", c, "-m", "earliest"],
    ] {
        site.refused(&args, "FailedPrecondition");
    }

    step("the topic can be deleted");
    site.ok(&["topics", "delete", t, "--force"]);
    site.refused(&["topics", "stats", t], "NotFound");
}

/// The embedded metadata store's address (`addresses.json` in the data directory).
fn metadata_addr(site: &Site) -> String {
    let a: Value = serde_json::from_slice(
        &std::fs::read(site.s.data_dir.join("addresses.json")).expect("addresses.json"),
    )
    .expect("addresses.json is JSON");
    a["metadata"]
        .as_str()
        .expect("metadata address")
        .to_string()
}

/// Whether ledger `id` still exists (`meridian ledger show`).
fn ledger_exists(site: &Site, id: u64) -> bool {
    let addr = metadata_addr(site);
    let (code, out, err) = meridian_integration::run_cli(&[
        "ledger",
        "show",
        &id.to_string(),
        "--metadata",
        &addr,
        "--json",
    ])
    .expect("meridian ledger show runs");
    assert!(
        code == 0 || format!("{out}{err}").contains("does not exist"),
        "ledger show {id}: {out}{err}"
    );
    code == 0
}

/// `stats-internal`: (compacted ledger, horizon, the `__compaction` cursor's mark-delete).
fn compacted_state(site: &Site, t: &str) -> (Option<u64>, String, String) {
    let st = site.json(&["topics", "stats-internal", t]);
    let c = &st["compacted_ledger"];
    let md = st["cursors"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "__compaction"))
        .and_then(|c| c["mark_delete_position"].as_str())
        .unwrap_or_else(|| panic!("no __compaction cursor in {st}"))
        .to_string();
    let horizon = c["horizon"].as_str().unwrap_or_default().to_string();
    (c["ledger_id"].as_u64(), horizon, md)
}

/// Restarts the standalone (kill -9) with the fail points `points` armed ("" for none).
fn restart_with(site: &mut Site, points: &str) {
    site.s.kill9().unwrap();
    site.s.env("MERIDIAN_TEST_FAILPOINTS", points);
    site.s.start().unwrap();
}

#[test]
fn a_compaction_that_fails_before_or_after_its_commit_leaves_one_whole_view_and_no_orphan_ledger() {
    let mut site = Site::start(&[("MERIDIAN_TEST_FAILPOINTS", "compaction:before_commit")]);
    let t = "persistent://public/default/crashes";
    let first = site.publish("p1", t, &rounds(6, 2), false);

    step("a run that fails before its commit: no view, and the ledger it wrote is deleted");
    site.compact(t);
    let (code, out, _) = site.admin(&["topics", "compaction-status", t, "-w"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("compaction:before_commit"), "{out}");
    let (ledger, horizon, _) = compacted_state(&site, t);
    assert_eq!((ledger, horizon.as_str()), (None, ""));
    let log = site.s.log_text();
    let abandoned: u64 = log
        .lines()
        .find_map(|l| l.split("abandoned compacted ledger ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no abandoned ledger in the log"));
    assert!(
        !ledger_exists(&site, abandoned),
        "ledger {abandoned} is left"
    );
    site.expect_read("reader-1", t, &[], &first);

    step("restarted without the fail point: a run commits");
    restart_with(&mut site, "");
    site.compact_and_wait(t);
    site.expect_read("reader-2", t, &[], &view(&first));
    let (l1, h1, md1) = compacted_state(&site, t);
    let l1 = l1.expect("a compacted ledger");
    assert_eq!(md1, h1, "__compaction is at the horizon");

    step("a run that fails after its commit: the new view serves; __compaction lags");
    restart_with(&mut site, "compaction:after_commit");
    let second = site.publish("p2", t, &rounds(6, 1)[..4], false);
    site.compact(t);
    let (code, out, _) = site.admin(&["topics", "compaction-status", t, "-w"]);
    assert_eq!(code, 1, "{out}");
    let all = [first, second].concat();
    site.expect_read("reader-3", t, &[], &view(&all));
    let (l2, h2, md2) = compacted_state(&site, t);
    let l2 = l2.expect("a compacted ledger");
    assert_ne!(l2, l1);
    assert_ne!(h2, h1);
    assert_eq!(md2, h1, "__compaction was not moved by the failed run");
    assert!(ledger_exists(&site, l1), "the earlier view's ledger waits");

    step("kill -9 and restart: the load moves __compaction and deletes the earlier ledger");
    restart_with(&mut site, "");
    site.expect_read("reader-4", t, &[], &view(&all));
    let (l3, h3, md3) = compacted_state(&site, t);
    assert_eq!(
        (l3, h3.as_str(), md3.as_str()),
        (Some(l2), h2.as_str(), h2.as_str())
    );
    assert!(
        !ledger_exists(&site, l1),
        "ledger {l1} of the earlier view is left"
    );
    assert!(ledger_exists(&site, l2));
}
