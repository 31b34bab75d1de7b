//! Process-level test harness: real `meridian` processes on loopback addresses, started and
//! stopped by PID (SIGTERM, or SIGKILL for crash tests). Each node's output goes to a log file
//! in the test's temporary directory; a failing test prints where.
//!
//! Used by the tests in `integration/tests/`; it has no product code.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub mod access;
pub mod chaos;
pub mod geo_sites;
pub mod powercut;
pub mod raw;
pub mod udp_proxy;
use meridian_metadata::MetadataClient;

/// The `meridian` binary: `$MERIDIAN_BIN`, else the one cargo built next to this test.
pub fn meridian_bin() -> PathBuf {
    built_bin("meridian", "MERIDIAN_BIN")
}

/// The `meridian-admin` binary: `$MERIDIAN_ADMIN_BIN`, else the one cargo built next to this
/// test.
pub fn admin_bin() -> PathBuf {
    built_bin("meridian-admin", "MERIDIAN_ADMIN_BIN")
}

fn built_bin(name: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/<name>; a binary of this crate (a
    // benchmark) lives in target/<profile> itself.
    let here = exe.parent().expect("the binary's directory");
    let profile_dir = if here.join(name).exists() {
        here
    } else {
        here.parent()
            .expect("test binary lives in target/<profile>/deps")
    };
    let bin = profile_dir.join(name);
    assert!(
        bin.exists(),
        "{} not found: run `cargo build --bin {name}` first (scripts/test does)",
        bin.display()
    );
    bin
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// A UDP port free on 127.0.0.1 now (a geo link's QUIC listener). A port free for TCP may be
/// held by a UDP socket (another test's QUIC endpoint): a geo listener on it failed to bind.
pub fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("bind udp 127.0.0.1:0")
}

/// Prints a step of a test, so a failure reads like a story.
pub fn step(msg: impl AsRef<str>) {
    eprintln!("[step] {}", msg.as_ref());
}

/// `got` is exactly `want`, in order; a failure names the first difference, not the lists.
pub fn assert_seq(got: &[u64], want: std::ops::Range<u64>) {
    let want: Vec<u64> = want.collect();
    if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
        panic!(
            "sequence differs at index {i}: got {:?}, want {:?} ({} received, {} expected)",
            got.get(i),
            want.get(i),
            got.len(),
            want.len()
        );
    }
}

/// GET over HTTP/1.0; the whole response (status line, headers, body).
pub fn http_get(addr: &str, path: &str) -> String {
    http_get_with(addr, path, None)
}

/// [`http_get`] with `Authorization: Bearer TOKEN`.
pub fn http_get_with(addr: &str, path: &str, token: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("http connect");
    let auth = token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"));
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n{auth}\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// One `meridian metadata` process.
pub struct MetaNode {
    pub id: u64,
    pub addr: String,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    initial_members: Option<String>,
    child: Option<Child>,
    extra_env: Vec<(String, String)>,
}

impl MetaNode {
    pub fn new(id: u64, root: &Path, initial_members: Option<String>) -> Self {
        let addr = format!("127.0.0.1:{}", free_port());
        Self {
            id,
            addr,
            data_dir: root.join(format!("node{id}")),
            log: root.join(format!("node{id}.log")),
            initial_members,
            child: None,
            extra_env: Vec::new(),
        }
    }

    /// A `MERIDIAN_*` setting for the next start.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.extra_env.push((key.to_string(), value.to_string()));
        self
    }

    pub fn set_initial_members(&mut self, members: String) {
        self.initial_members = Some(members);
    }

    pub fn start(&mut self) -> anyhow::Result<()> {
        assert!(self.child.is_none(), "node {} already running", self.id);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = Command::new(meridian_bin());
        cmd.arg("metadata")
            .args(["--node-id", &self.id.to_string()])
            .args(["--listen", &self.addr])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .env("RUST_LOG", "info,openraft=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(m) = &self.initial_members {
            cmd.args(["--initial-members", m]);
        }
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().context("spawning meridian metadata")?);
        Ok(())
    }

    fn signal(&mut self, sig: &str) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let status = Command::new("kill")
            .args([sig, &child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill {sig} {} failed", child.id());
        }
        child.wait()?;
        Ok(())
    }

    /// SIGSTOP (`pause = true`) or SIGCONT: the process freezes with its sockets open, as a
    /// node stalled by a long pause or a VM migration would.
    pub fn pause(&mut self, pause: bool) -> anyhow::Result<()> {
        pause_child(self.child.as_ref(), pause)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// How the node ended, if it ended by itself (a crash); it counts as stopped after.
    pub fn exited(&mut self) -> Option<String> {
        exited_by_itself(&mut self.child)
    }

    /// SIGKILL: a crash, no clean-up.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        self.signal("-KILL")
    }

    /// SIGTERM: a clean stop.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        self.signal("-TERM")
    }

    /// Waits for the process to exit on its own and returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<i32> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().context("not running")?;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status.code().unwrap_or(-1));
            }
            if Instant::now() > deadline {
                bail!("node {} still running after {timeout:?}", self.id);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn client(&self) -> MetadataClient {
        MetadataClient::connect_to(std::slice::from_ref(&self.addr)).expect("client")
    }
}

impl Drop for MetaNode {
    fn drop(&mut self) {
        let _ = kill9(self.child.take());
    }
}

/// Makes `nodes` the initial members of one new cluster (each node is told all of them).
pub fn make_members(nodes: &mut [MetaNode]) {
    let members = nodes
        .iter()
        .map(|m| format!("{}={}", m.id, m.addr))
        .collect::<Vec<_>>()
        .join(",");
    for node in nodes {
        node.initial_members = Some(members.clone());
    }
}

/// Several metadata nodes in one temporary directory.
pub struct MetaCluster {
    pub nodes: Vec<MetaNode>,
    pub root: tempfile::TempDir,
}

impl Drop for MetaCluster {
    /// A failing test shows what its nodes logged (their directory goes with the cluster).
    fn drop(&mut self) {
        if std::thread::panicking() {
            for n in &self.nodes {
                let log = n.log_text();
                let tail: Vec<&str> = log.lines().rev().take(60).collect();
                eprintln!("--- node {} log, last {} lines ---", n.id, tail.len());
                for line in tail.into_iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
    }
}

impl MetaCluster {
    /// Starts `n` nodes as a new cluster (ids 1..=n) and waits until it has a leader.
    pub async fn start(n: u64) -> anyhow::Result<Self> {
        let root = tempfile::tempdir()?;
        let mut nodes: Vec<MetaNode> = (1..=n)
            .map(|id| MetaNode::new(id, root.path(), None))
            .collect();
        make_members(&mut nodes);
        for node in &mut nodes {
            node.start()?;
        }
        let cluster = Self { nodes, root };
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        Ok(cluster)
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.addr.clone()).collect()
    }

    pub fn client(&self) -> MetadataClient {
        MetadataClient::connect_to(&self.endpoints()).expect("client")
    }

    pub fn node(&mut self, id: u64) -> &mut MetaNode {
        self.nodes.iter_mut().find(|n| n.id == id).expect("node id")
    }

    /// The leader's id, as the running nodes report it.
    pub async fn wait_for_leader(&self, timeout: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            for n in self.nodes.iter().filter(|n| n.child.is_some()) {
                if let Ok(m) = n.client().members().await {
                    if m.leader != 0 {
                        return Ok(m.leader);
                    }
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "no leader within {timeout:?}; logs in {}",
                    self.root.path().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Runs `meridian ARGS` to completion; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    run_bin(&meridian_bin(), args)
}

/// Publishes `n` unbatched messages of 1 KiB to `topic` at `url` with `meridian perf produce`,
/// and waits for every receipt.
pub fn perf_produce(url: &str, topic: &str, n: u64) {
    let (code, out, err) = run_cli(&[
        "perf",
        "produce",
        "--url",
        url,
        "--topic",
        topic,
        "--seconds",
        "0",
        "--messages",
        &n.to_string(),
        "--size",
        "1024",
        "--batch-max-messages",
        "1",
        "--report-every",
        "600",
    ])
    .expect("meridian perf runs");
    assert_eq!(code, 0, "perf produce: {out}\n{err}");
}

/// `meridian ledger recover LEDGER`: closes the ledger from this process and returns its last
/// entry id (panics, with the tool's output, if it fails).
pub fn recover_ledger(endpoint: &str, ledger: &str) -> u64 {
    let (code, out, err) =
        run_cli(&["ledger", "recover", ledger, "--metadata", endpoint]).expect("run");
    assert_eq!(code, 0, "ledger recover {ledger}: {out}{err}");
    out.trim()
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no last entry in {out:?}"))
}

/// Every acknowledged id is among those consumed (`got`), and `got` is in log order; a failure
/// names the first lost ids, then `context`.
pub fn assert_acked_consumed_in_order(
    acked: &std::collections::BTreeSet<u64>,
    got: &[u64],
    context: &str,
) {
    let got_set: std::collections::BTreeSet<u64> = got.iter().copied().collect();
    let lost: Vec<&u64> = acked.difference(&got_set).take(10).collect();
    assert!(
        lost.is_empty(),
        "acknowledged but lost: {lost:?} ({} of {} in all)\n{context}",
        acked.difference(&got_set).count(),
        acked.len()
    );
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "log order broken\n{context}"
    );
}

/// `meridian-admin --admin-url URL --output json ARGS`, which must succeed: its JSON.
pub fn admin_json(admin_url: &str, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--admin-url", admin_url, "--output", "json"];
    all.extend_from_slice(args);
    let (code, out, err) = run_admin(&all).expect("meridian-admin runs");
    assert_eq!(code, 0, "meridian-admin {args:?}: {out}{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

/// The value of one series in a `/metrics` page (`name` with its labels, as printed), 0
/// when absent.
pub fn metric_value(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `HOST:PORT` of a `pulsar://HOST:PORT` URL (a broker's id).
pub fn host(url: &str) -> &str {
    url.trim_start_matches("pulsar://")
}

/// Runs `meridian-admin` with `args`: (exit code, stdout, stderr).
pub fn run_admin(args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    run_bin(&admin_bin(), args)
}

fn run_bin(bin: &Path, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let out = Command::new(bin)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Moves every thread of process `pid` (and the threads it starts later) to `cpu`, with
/// `taskset`: for benchmarks that give each process a core of its own.
pub fn pin_to_cpu(pid: Option<u32>, cpu: &str) -> anyhow::Result<()> {
    let pid = pid.ok_or_else(|| anyhow::anyhow!("a process that is not running"))?;
    let ok = Command::new("taskset")
        .args(["-a", "-p", "-c", cpu, &pid.to_string()])
        .stdout(Stdio::null())
        .status()?
        .success();
    anyhow::ensure!(ok, "taskset of {pid} on cpu {cpu} failed");
    Ok(())
}

/// How a process that ended by itself ended (`None` while it runs, or if it was never
/// started or was stopped by the harness).
fn exited_by_itself(child: &mut Option<Child>) -> Option<String> {
    let status = child.as_mut()?.try_wait().ok()??;
    *child = None;
    Some(status.to_string())
}

/// SIGSTOP (`pause = true`) or SIGCONT to a running process: frozen with its sockets open, as
/// a process stalled by a long pause or a VM migration would be.
fn pause_child(child: Option<&Child>, pause: bool) -> anyhow::Result<()> {
    let child = child.context("not running")?;
    let sig = if pause { "-STOP" } else { "-CONT" };
    let status = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()?;
    if !status.success() {
        bail!("kill {sig} {} failed", child.id());
    }
    Ok(())
}

/// SIGKILL and reap (nothing if the process is not running).
fn kill9(child: Option<Child>) -> anyhow::Result<()> {
    if let Some(mut child) = child {
        child.kill()?;
        child.wait()?;
    }
    Ok(())
}

/// SIGTERM, then waits for the exit and returns its code (0 if the process is not running).
fn sigterm_and_wait(child: Option<Child>) -> anyhow::Result<i32> {
    let Some(mut child) = child else {
        return Ok(0);
    };
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -TERM {} failed", child.id());
    }
    Ok(child.wait()?.code().unwrap_or(-1))
}

/// One `meridian bookie` process with its own journal and ledger directories.
pub struct BookieProc {
    pub addr: String,
    /// `127.0.0.1:PORT` of the bookie's /metrics and /health.
    pub http: String,
    pub dir: PathBuf,
    pub log: PathBuf,
    metadata: String,
    child: Option<Child>,
    extra_env: Vec<(String, String)>,
}

impl BookieProc {
    pub fn new(name: &str, root: &Path, metadata: &str) -> Self {
        Self {
            addr: format!("127.0.0.1:{}", free_port()),
            http: format!("127.0.0.1:{}", free_port()),
            dir: root.join(name),
            log: root.join(format!("{name}.log")),
            metadata: metadata.to_string(),
            child: None,
            extra_env: Vec::new(),
        }
    }

    /// A `MERIDIAN_*` setting for the next start.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.extra_env.push((key.to_string(), value.to_string()));
        self
    }

    pub fn start(&mut self) -> anyhow::Result<()> {
        assert!(self.child.is_none(), "bookie {} already running", self.addr);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(meridian_bin())
            .arg("bookie")
            .args(["--metadata", &self.metadata])
            .args(["--listen", &self.addr])
            .args(["--http-listen", &self.http])
            .arg("--journal-dir")
            .arg(self.dir.join("journal"))
            .arg("--ledger-dir")
            .arg(self.dir.join("ledgers"))
            .env("RUST_LOG", "info")
            .env("MERIDIAN_BOOKIE_SESSION_TTL_MS", "2000")
            .env("MERIDIAN_BOOKIE_FLUSH_INTERVAL_MS", "200")
            // Small journal files: a fresh bookie zero-fills its first one before it starts,
            // and tests roll and recycle files.
            .env("MERIDIAN_BOOKIE_JOURNAL_FILE_BYTES_MAX", "8388608")
            .envs(self.extra_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning meridian bookie")?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGSTOP (`pause = true`) or SIGCONT.
    pub fn pause(&mut self, pause: bool) -> anyhow::Result<()> {
        pause_child(self.child.as_ref(), pause)
    }

    /// SIGKILL: a crash.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        kill9(self.child.take())
    }

    /// SIGTERM, then waits for a clean exit and returns its code.
    pub fn stop(&mut self) -> anyhow::Result<i32> {
        sigterm_and_wait(self.child.take())
    }

    /// How the process ended, if it ended by itself (a crash); it counts as stopped after.
    pub fn exited(&mut self) -> Option<String> {
        exited_by_itself(&mut self.child)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for BookieProc {
    fn drop(&mut self) {
        let _ = kill9(self.child.take());
        show_warnings_if_panicking("bookie", &self.log_text());
    }
}

/// A failing test shows the warnings and errors a process logged and what it said of
/// ledgers (its directory goes with the test's), the last 120.
fn show_warnings_if_panicking(what: &str, log: &str) {
    if !std::thread::panicking() {
        return;
    }
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR ") || l.contains("ledger"))
        .collect();
    let tail = &lines[lines.len().saturating_sub(120)..];
    eprintln!(
        "--- {what} log, its last {} warnings, errors and ledger lines ---",
        tail.len()
    );
    for l in tail {
        eprintln!("{l}");
    }
}

/// Starts `bookies` and waits until all are registered in the metadata store. A bookie that
/// exits meanwhile (its port, picked free, taken by another process before it bound) is
/// started again on new ports, twice at most; a failure shows each one's last log lines.
pub async fn start_bookies(
    bookies: &mut [BookieProc],
    client: &MetadataClient,
    timeout: Duration,
) -> anyhow::Result<()> {
    for b in bookies.iter_mut() {
        b.start()?;
    }
    let deadline = Instant::now() + timeout;
    let mut restarts = vec![0u32; bookies.len()];
    loop {
        for (i, b) in bookies.iter_mut().enumerate() {
            let exited = b
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited && restarts[i] < 2 {
                restarts[i] += 1;
                eprintln!(
                    "bookie {} exited before it registered; starting it on new ports: {}",
                    b.addr,
                    log_tail(&b.log, 3)
                );
                b.child = None;
                b.addr = format!("127.0.0.1:{}", free_port());
                b.http = format!("127.0.0.1:{}", free_port());
                b.start()?;
            }
        }
        if registered_bookies(client).await == Some(bookies.len()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = bookies
                .iter()
                .map(|b| format!("{}: {}", b.addr, log_tail(&b.log, 3)))
                .collect();
            bail!(
                "{} bookies not registered within {timeout:?}; their logs end:\n{}",
                bookies.len(),
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many bookies are registered (none when the store does not answer).
async fn registered_bookies(client: &MetadataClient) -> Option<usize> {
    let page = client.list("/bookies/available/", "", 0).await.ok()?;
    Some(page.kvs.len())
}

/// The last `n` lines of a log file (empty when it cannot be read).
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Waits until `n` bookies are registered in the metadata store.
pub async fn wait_for_bookies(
    client: &MetadataClient,
    n: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if registered_bookies(client).await == Some(n) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{n} bookies not registered within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts every bookie and waits until each has printed that it listens, which it does after
/// its journal replay: its port closes connections before that, and the registration of a
/// bookie killed just before outlives it by the session TTL, so [`wait_for_bookies`] alone
/// can return while a restarted bookie still replays.
pub async fn start_serving(bookies: &mut [BookieProc]) {
    const LINE: &str = " listening on ";
    let before: Vec<usize> = bookies
        .iter()
        .map(|b| b.log_text().matches(LINE).count())
        .collect();
    for b in bookies.iter_mut() {
        b.start().expect("bookie starts");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for (b, n) in bookies.iter().zip(before) {
        while b.log_text().matches(LINE).count() <= n {
            assert!(
                Instant::now() < deadline,
                "bookie {} not started within 60 s:\n{}",
                b.addr,
                b.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// One `meridian standalone` process on a data directory, with ports chosen by the OS.
pub struct StandaloneProc {
    pub data_dir: PathBuf,
    pub log: PathBuf,
    /// `pulsar://127.0.0.1:PORT` once started.
    pub url: String,
    /// `127.0.0.1:PORT` of /metrics and /health once started.
    pub http: String,
    /// `http://127.0.0.1:PORT` of the admin API once started (`https://` with
    /// `MERIDIAN_BROKER_ADMIN_TLS`).
    pub admin_url: String,
    /// `pulsar+ssl://127.0.0.1:PORT` once started, when TLS is configured.
    pub tls_url: Option<String>,
    /// `quic://127.0.0.1:PORT` of the geo link once started, when it has one.
    pub geo_url: Option<String>,
    child: Option<Child>,
    extra_env: Vec<(String, String)>,
    extra_args: Vec<String>,
    /// Restart on the same ports (clients that stay up reconnect to them).
    keep_ports: bool,
    /// A command that execs the standalone (its PID stays the standalone's).
    wrapper: Vec<String>,
}

impl StandaloneProc {
    pub fn new(root: &Path) -> Self {
        Self {
            data_dir: root.join("standalone"),
            log: root.join("standalone.log"),
            url: String::new(),
            http: String::new(),
            admin_url: String::new(),
            tls_url: None,
            geo_url: None,
            child: None,
            extra_env: Vec::new(),
            extra_args: Vec::new(),
            keep_ports: false,
            wrapper: Vec::new(),
        }
    }

    /// Later starts run `meridian` under `wrapper`, a command that execs its arguments
    /// (`prlimit --nofile=256:`, say), so the PID stays the standalone's.
    pub fn under(&mut self, wrapper: &[&str]) -> &mut Self {
        self.wrapper = wrapper.iter().map(|a| a.to_string()).collect();
        self
    }

    /// Command-line arguments added to every later start.
    pub fn args(&mut self, args: &[&str]) -> &mut Self {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Later starts reuse the ports of the first one.
    pub fn keep_ports(&mut self) -> &mut Self {
        self.keep_ports = true;
        self
    }

    /// A `MERIDIAN_*` setting for the next start.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.extra_env.push((key.to_string(), value.to_string()));
        self
    }

    /// Starts the process and waits until it prints where it listens (again, a little
    /// later, while a port it must reuse is briefly taken: see [`retry_port_in_use`]).
    pub fn start(&mut self) -> anyhow::Result<()> {
        retry_port_in_use(|| self.start_once())
    }

    fn start_once(&mut self) -> anyhow::Result<()> {
        assert!(self.child.is_none(), "standalone already running");
        let before = std::fs::read_to_string(&self.log).unwrap_or_default().len();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let again = self.keep_ports && !self.url.is_empty();
        let (pulsar, http, admin) = if again {
            (
                self.url.trim_start_matches("pulsar://").to_string(),
                self.http.clone(),
                self.admin_url.trim_start_matches("http://").to_string(),
            )
        } else {
            let any = "127.0.0.1:0".to_string();
            (any.clone(), any.clone(), any)
        };
        let mut cmd = match self.wrapper.split_first() {
            None => Command::new(meridian_bin()),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(meridian_bin());
                c
            }
        };
        cmd.arg("standalone")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--pulsar-listen", &pulsar])
            .args(["--http-listen", &http])
            .args(["--admin-listen", &admin])
            .args(["--pulsar-tls-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info,openraft=warn")
            .env("MERIDIAN_BOOKIE_FLUSH_INTERVAL_MS", "500")
            .env("MERIDIAN_BOOKIE_JOURNAL_FILE_BYTES_MAX", "8388608")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        cmd.args(&self.extra_args);
        self.child = Some(cmd.spawn().context("spawning meridian standalone")?);
        let b = wait_for_banner(
            &mut self.child,
            &self.log,
            before,
            "meridian standalone: Pulsar protocol on ",
        )?;
        (
            self.url,
            self.tls_url,
            self.http,
            self.admin_url,
            self.geo_url,
        ) = (b.url, b.tls_url, b.http, b.admin_url, b.geo_url);
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: a crash, no clean-up.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        kill9(self.child.take())
    }

    /// SIGSTOP (`pause = true`) or SIGCONT.
    pub fn pause(&mut self, pause: bool) -> anyhow::Result<()> {
        pause_child(self.child.as_ref(), pause)
    }

    /// How the process ended, if it ended by itself.
    pub fn exited(&mut self) -> Option<String> {
        exited_by_itself(&mut self.child)
    }

    /// SIGTERM, then waits for the exit and returns its code.
    pub fn stop(&mut self) -> anyhow::Result<i32> {
        sigterm_and_wait(self.child.take())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A client of the embedded metadata store (its address is in `addresses.json`).
    pub fn metadata_client(&self) -> anyhow::Result<MetadataClient> {
        let a: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.data_dir.join("addresses.json"))?)?;
        let addr = a["metadata"]
            .as_str()
            .context("addresses.json without metadata")?
            .to_string();
        Ok(MetadataClient::connect_to(&[addr])?)
    }
}

/// Where a started broker (or standalone) listens, from the line it prints.
struct Banner {
    url: String,
    tls_url: Option<String>,
    http: String,
    admin_url: String,
    geo_url: Option<String>,
}

/// Waits until the process prints its banner (a line starting with `prefix`) after byte
/// `before` of its log; an exit or 60 s without it is an error carrying the log.
/// A process restarted on its earlier ports can find one briefly taken: tests run in
/// parallel, and another test's client may have been given that port as the local end of an
/// outgoing connection. `start` is tried again for up to 10 s while it fails for that reason.
fn retry_port_in_use(mut start: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match start() {
            Err(e)
                if format!("{e:#}").contains("Address already in use")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(500));
            }
            r => return r,
        }
    }
}

fn wait_for_banner(
    child: &mut Option<Child>,
    log: &Path,
    before: usize,
    prefix: &str,
) -> anyhow::Result<Banner> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let new = &text[before.min(text.len())..];
        if let Some(line) = new.lines().find(|l| l.starts_with(prefix)) {
            let word = |scheme: &str| {
                line.split_whitespace()
                    .find(|w| w.starts_with(scheme))
                    .map(|w| w.trim_end_matches(',').to_string())
            };
            return Ok(Banner {
                url: word("pulsar://").context("no pulsar:// in the banner")?,
                tls_url: word("pulsar+ssl://"),
                http: word("http://")
                    .context("no http:// in the banner")?
                    .trim_start_matches("http://")
                    .to_string(),
                admin_url: line
                    .split("admin API on ")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .context("no admin API in the banner")?
                    .trim_end_matches([';', ','])
                    .to_string(),
                geo_url: word("quic://"),
            });
        }
        if let Some(status) = child.as_mut().context("not started")?.try_wait()? {
            *child = None;
            bail!("{prefix:?} process exited with {status} before listening:\n{new}");
        }
        if Instant::now() > deadline {
            bail!("{prefix:?} process did not start within 60 s:\n{new}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One `meridian broker` process against a metadata store (and the bookies registered
/// there), with ports chosen by the OS; restarts keep its Pulsar port.
pub struct BrokerProc {
    pub log: PathBuf,
    pub metadata: String,
    /// `pulsar://127.0.0.1:PORT` once started.
    pub url: String,
    /// `127.0.0.1:PORT` of /metrics and /health once started.
    pub http: String,
    /// `http://127.0.0.1:PORT` of the admin API once started.
    pub admin_url: String,
    child: Option<Child>,
    extra_env: Vec<(String, String)>,
}

impl BrokerProc {
    pub fn new(name: &str, root: &Path, metadata: &str) -> Self {
        Self {
            log: root.join(format!("{name}.log")),
            metadata: metadata.to_string(),
            url: String::new(),
            http: String::new(),
            admin_url: String::new(),
            child: None,
            extra_env: Vec::new(),
        }
    }

    /// A `MERIDIAN_*` setting for the next start.
    pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
        self.extra_env.push((key.to_string(), value.to_string()));
        self
    }

    /// Starts the broker and waits until it prints where it listens (again, a little later,
    /// while a port it must reuse is briefly taken: see [`retry_port_in_use`]).
    pub fn start(&mut self) -> anyhow::Result<()> {
        retry_port_in_use(|| self.start_once())
    }

    fn start_once(&mut self) -> anyhow::Result<()> {
        assert!(self.child.is_none(), "broker already running");
        let before = std::fs::read_to_string(&self.log).unwrap_or_default().len();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let listen = match self.url.strip_prefix("pulsar://") {
            Some(a) => a.to_string(),
            None => "127.0.0.1:0".to_string(),
        };
        let mut cmd = Command::new(meridian_bin());
        cmd.arg("broker")
            .args(["--metadata", &self.metadata])
            .args(["--listen", &listen])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(["--admin-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().context("spawning meridian broker")?);
        let b = wait_for_banner(
            &mut self.child,
            &self.log,
            before,
            "meridian broker: Pulsar protocol on ",
        )?;
        (self.url, self.http, self.admin_url) = (b.url, b.http, b.admin_url);
        Ok(())
    }

    /// SIGSTOP (`pause = true`) or SIGCONT.
    pub fn pause(&mut self, pause: bool) -> anyhow::Result<()> {
        pause_child(self.child.as_ref(), pause)
    }

    /// SIGKILL: a crash.
    pub fn kill9(&mut self) -> anyhow::Result<()> {
        kill9(self.child.take())
    }

    /// SIGTERM, then waits for the exit and returns its code.
    pub fn stop(&mut self) -> anyhow::Result<i32> {
        sigterm_and_wait(self.child.take())
    }

    /// How the process ended, if it ended by itself (a crash); it counts as stopped after.
    pub fn exited(&mut self) -> Option<String> {
        exited_by_itself(&mut self.child)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for BrokerProc {
    fn drop(&mut self) {
        let _ = kill9(self.child.take());
        show_warnings_if_panicking("broker", &self.log_text());
    }
}

impl Drop for StandaloneProc {
    fn drop(&mut self) {
        let _ = kill9(self.child.take());
    }
}

/// The Python interpreter with `pulsar-client` (`$MERIDIAN_PYTHON`, set by scripts/setup.sh).
pub fn python() -> PathBuf {
    let p = std::env::var_os("MERIDIAN_PYTHON").map(PathBuf::from).expect(
        "MERIDIAN_PYTHON is not set: run the tests through scripts/test, whose set-up installs pulsar-client",
    );
    assert!(p.exists(), "{} does not exist", p.display());
    p
}

/// A run of `integration/python/client.py` whose JSON lines are collected as they come.
pub struct PyClient {
    child: Option<Child>,
    lines: std::sync::Arc<std::sync::Mutex<Kept>>,
    reader: Option<std::thread::JoinHandle<()>>,
    stderr: PathBuf,
}

/// A Python client's lines so far.
enum Kept {
    Parsed(Vec<serde_json::Value>),
    Text(Vec<Box<str>>),
}

impl PyClient {
    /// Starts `client.py ARGS...`; its stderr goes to `stderr_file`.
    /// Spawns the driver with its stderr in `dir/<name>.stderr`; panics if it cannot start.
    pub fn run(dir: &Path, name: &str, args: &[&str]) -> PyClient {
        PyClient::spawn(args, &dir.join(format!("{name}.stderr"))).expect("python client")
    }

    pub fn spawn(args: &[&str], stderr_file: &Path) -> anyhow::Result<PyClient> {
        Self::spawn_env(args, stderr_file, &[])
    }

    /// [`spawn`](PyClient::spawn) with extra environment variables.
    pub fn spawn_env(
        args: &[&str],
        stderr_file: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<PyClient> {
        Self::spawn_script("client.py", args, stderr_file, env)
    }

    /// Runs `integration/python/SCRIPT ARGS...` (stderr to `stderr_file`).
    pub fn spawn_script(
        script: &str,
        args: &[&str],
        stderr_file: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<PyClient> {
        Self::spawn_keeping(script, args, stderr_file, env, false)
    }

    /// [`spawn_script`](PyClient::spawn_script) for a client that prints millions of lines
    /// (a long fault schedule): they are kept as printed, about a tenth of the memory of
    /// parsed ones, and parsed each time they are read ([`each_line`](PyClient::each_line)
    /// reads them one at a time).
    pub fn spawn_script_as_text(
        script: &str,
        args: &[&str],
        stderr_file: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<PyClient> {
        Self::spawn_keeping(script, args, stderr_file, env, true)
    }

    fn spawn_keeping(
        script: &str,
        args: &[&str],
        stderr_file: &Path,
        env: &[(&str, &str)],
        as_text: bool,
    ) -> anyhow::Result<PyClient> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("python")
            .join(script);
        let err = std::fs::File::create(stderr_file)?;
        let mut child = Command::new(python())
            .arg(script)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .context("spawning the Python client")?;
        let stdout = child.stdout.take().expect("piped");
        let kept = if as_text {
            Kept::Text(Vec::new())
        } else {
            Kept::Parsed(Vec::new())
        };
        let lines = std::sync::Arc::new(std::sync::Mutex::new(kept));
        let sink = std::sync::Arc::clone(&lines);
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // Only lines that are JSON are kept, either way.
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                match &mut *sink.lock().expect("lines") {
                    Kept::Parsed(l) => l.push(v),
                    Kept::Text(l) => l.push(line.into_boxed_str()),
                }
            }
        });
        Ok(PyClient {
            child: Some(child),
            lines,
            reader: Some(reader),
            stderr: stderr_file.to_path_buf(),
        })
    }

    pub fn lines(&self) -> Vec<serde_json::Value> {
        match &*self.lines.lock().expect("lines") {
            Kept::Parsed(l) => l.clone(),
            Kept::Text(l) => l
                .iter()
                .filter_map(|t| serde_json::from_str(t).ok())
                .collect(),
        }
    }

    /// The lines so far as printed, taken (they are no longer kept here).
    pub fn take_text(&mut self) -> Vec<Box<str>> {
        match &mut *self.lines.lock().expect("lines") {
            Kept::Parsed(l) => std::mem::take(l)
                .into_iter()
                .map(|v| v.to_string().into_boxed_str())
                .collect(),
            Kept::Text(l) => std::mem::take(l),
        }
    }

    /// Each line so far as printed, in order (without copying them all at once).
    pub fn each_line(&self, mut f: impl FnMut(&str)) {
        match &*self.lines.lock().expect("lines") {
            Kept::Parsed(l) => l.iter().for_each(|v| f(&v.to_string())),
            Kept::Text(l) => l.iter().for_each(|t| f(t)),
        }
    }

    /// Values of `field` over the lines that have it, as integers.
    pub fn ints(&self, field: &str) -> Vec<u64> {
        self.lines()
            .iter()
            .filter_map(|v| v.get(field).and_then(serde_json::Value::as_u64))
            .collect()
    }

    /// Waits until `pred` holds for the lines so far.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[serde_json::Value]) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.lines()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "timed out waiting for {what}; last lines {:?}; stderr:\n{}",
                    self.lines().iter().rev().take(3).collect::<Vec<_>>(),
                    self.stderr_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stderr_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = s.lines().filter(|l| !l.contains(" INFO ")).collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Waits for the process to exit; fails on a non-zero exit.
    pub fn finish(&mut self, timeout: Duration) -> anyhow::Result<Vec<serde_json::Value>> {
        self.wait_exit(timeout)?;
        Ok(self.lines())
    }

    /// [`finish`](PyClient::finish) without the lines (read them with
    /// [`each_line`](PyClient::each_line)).
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().context("already finished")?;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                if let Some(r) = self.reader.take() {
                    let _ = r.join();
                }
                if !status.success() {
                    bail!(
                        "Python client exited with {status}; stderr:\n{}",
                        self.stderr_tail()
                    );
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "Python client still running after {timeout:?}; stderr:\n{}",
                    self.stderr_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL.
    pub fn kill9(&mut self) {
        let _ = kill9(self.child.take());
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl Drop for PyClient {
    fn drop(&mut self) {
        self.kill9();
    }
}
