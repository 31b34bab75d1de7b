//! `meridian site up`: a whole site of separate processes on loopback (metadata nodes,
//! bookies, brokers), for development and tests. Each is this binary run as its role, with
//! its log in the data directory; the ports are chosen once and kept in `site.json`, so the
//! site comes back on the same addresses (the metadata nodes' membership names them). SIGINT
//! or SIGTERM stops them all by PID (brokers first, so they hand their bundles over, then
//! bookies, then metadata), as does the exit of any of them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

#[derive(clap::Args)]
pub struct SiteUpArgs {
    /// Directory of the site: one subdirectory and one log per process, and `site.json`.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// Metadata nodes (1 or 3 make sense; a new site only).
    #[arg(long, default_value_t = 3)]
    pub metadata: u32,
    #[arg(long, default_value_t = 3)]
    pub bookies: u32,
    #[arg(long, default_value_t = 2)]
    pub brokers: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct BrokerPorts {
    pulsar: String,
    http: String,
    admin: String,
}

/// The site's addresses, chosen at its first start.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Layout {
    metadata: Vec<String>,
    bookies: Vec<String>,
    /// Each bookie's /metrics and /health (absent in sites laid out before they had them).
    #[serde(default)]
    bookie_http: Vec<String>,
    brokers: Vec<BrokerPorts>,
}

fn free_addr() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

impl Layout {
    fn new(a: &SiteUpArgs) -> anyhow::Result<Layout> {
        let n = |k: u32| {
            (0..k)
                .map(|_| free_addr())
                .collect::<anyhow::Result<Vec<_>>>()
        };
        Ok(Layout {
            metadata: n(a.metadata)?,
            bookies: n(a.bookies)?,
            bookie_http: n(a.bookies)?,
            brokers: (0..a.brokers)
                .map(|_| {
                    Ok(BrokerPorts {
                        pulsar: free_addr()?,
                        http: free_addr()?,
                        admin: free_addr()?,
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
        })
    }
}

struct Proc {
    name: String,
    child: Child,
}

fn spawn(dir: &Path, name: &str, args: &[String], env: &[(&str, String)]) -> anyhow::Result<Proc> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .with_context(|| format!("{name}.log"))?;
    let exe = std::env::current_exe().context("this binary's path")?;
    let child = Command::new(exe)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        name: name.to_string(),
        child,
    })
}

/// SIGTERM, then SIGKILL after `grace`.
fn stop(p: &mut Proc, grace: Duration) {
    let pid = p.child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = p.child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "{} (pid {pid}) did not stop within {grace:?}: killed",
        p.name
    );
    let _ = p.child.kill();
    let _ = p.child.wait();
}

/// Waits until `log` has a line starting with `prefix` (a started broker's banner).
fn wait_for_line(log: &Path, prefix: &str, p: &mut Proc) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = text.lines().rev().find(|l| l.starts_with(prefix)) {
            return Ok(l.to_string());
        }
        if let Some(status) = p.child.try_wait()? {
            bail!("{} exited with {status}; see {}", p.name, log.display());
        }
        if Instant::now() > deadline {
            bail!(
                "{} did not start within 120 s; see {}",
                p.name,
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub async fn run(a: SiteUpArgs) -> anyhow::Result<()> {
    if a.metadata == 0 || a.bookies == 0 || a.brokers == 0 {
        bail!("a site needs at least one metadata node, one bookie and one broker");
    }
    std::fs::create_dir_all(&a.data_dir)
        .with_context(|| format!("--data-dir {}", a.data_dir.display()))?;
    let dir = a.data_dir.canonicalize()?;
    let layout_file = dir.join("site.json");
    let layout: Layout = match std::fs::read(&layout_file) {
        Ok(b) => {
            let l: Layout = serde_json::from_slice(&b).context("site.json")?;
            if l.metadata.len() != a.metadata as usize
                || l.bookies.len() != a.bookies as usize
                || l.brokers.len() != a.brokers as usize
            {
                bail!(
                    "{} holds a site of {} metadata nodes, {} bookies and {} brokers; start it with those counts (or a new --data-dir)",
                    dir.display(),
                    l.metadata.len(),
                    l.bookies.len(),
                    l.brokers.len()
                );
            }
            let mut l = l;
            if l.bookie_http.len() != l.bookies.len() {
                l.bookie_http = (0..l.bookies.len())
                    .map(|_| free_addr())
                    .collect::<anyhow::Result<Vec<_>>>()?;
                std::fs::write(&layout_file, serde_json::to_vec_pretty(&l)?)?;
            }
            l
        }
        Err(_) => {
            let l = Layout::new(&a)?;
            std::fs::write(&layout_file, serde_json::to_vec_pretty(&l)?)?;
            l
        }
    };
    let endpoints = layout.metadata.join(",");
    let members: Vec<String> = layout
        .metadata
        .iter()
        .enumerate()
        .map(|(i, m)| format!("{}={m}", i + 1))
        .collect();
    let mut procs: Vec<(u8, Proc)> = Vec::new();
    let started = async {
        for (i, m) in layout.metadata.iter().enumerate() {
            let name = format!("metadata-{}", i + 1);
            let args = vec![
                "metadata".to_string(),
                "--node-id".into(),
                (i + 1).to_string(),
                "--listen".into(),
                m.clone(),
                "--data-dir".into(),
                dir.join(&name).display().to_string(),
                "--initial-members".into(),
                members.join(","),
            ];
            procs.push((2, spawn(&dir, &name, &args, &[])?));
        }
        for (i, b) in layout.bookies.iter().enumerate() {
            let name = format!("bookie-{}", i + 1);
            let d = dir.join(&name);
            let args = vec![
                "bookie".to_string(),
                "--metadata".into(),
                endpoints.clone(),
                "--listen".into(),
                b.clone(),
                "--journal-dir".into(),
                d.join("journal").display().to_string(),
                "--ledger-dir".into(),
                d.join("ledgers").display().to_string(),
                "--http-listen".into(),
                layout.bookie_http[i].clone(),
            ];
            procs.push((1, spawn(&dir, &name, &args, &[])?));
        }
        // The brokers start once every bookie is registered (their first ledgers need them).
        let meta = meridian_metadata::MetadataClient::connect_to(&layout.metadata)
            .context("a client of the site's metadata store")?;
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let registered = meta
                .list(meridian_storage::ledger::BOOKIES_PREFIX, "", 0)
                .await
                .map(|p| p.kvs.len())
                .unwrap_or(0);
            if registered >= layout.bookies.len() {
                break;
            }
            for (_, p) in procs.iter_mut() {
                if let Some(status) = p.child.try_wait()? {
                    bail!(
                        "{} exited with {status}; see its log in {}",
                        p.name,
                        dir.display()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "{registered} of {} bookies registered within 120 s; see their logs in {}",
                    layout.bookies.len(),
                    dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Ensembles over the site's bookies: E = min(3, bookies), Qw = Qa = min(2, bookies).
        let e = a.bookies.min(3).to_string();
        let q = a.bookies.min(2).to_string();
        let mut banners = Vec::new();
        for (i, b) in layout.brokers.iter().enumerate() {
            let name = format!("broker-{}", i + 1);
            let args = vec![
                "broker".to_string(),
                "--metadata".into(),
                endpoints.clone(),
                "--listen".into(),
                b.pulsar.clone(),
                "--http-listen".into(),
                b.http.clone(),
                "--admin-listen".into(),
                b.admin.clone(),
            ];
            let env = [
                ("MERIDIAN_BROKER_ENSEMBLE", e.clone()),
                ("MERIDIAN_BROKER_WRITE_QUORUM", q.clone()),
                ("MERIDIAN_BROKER_ACK_QUORUM", q.clone()),
            ];
            let mut p = spawn(&dir, &name, &args, &env)?;
            let line = wait_for_line(
                &dir.join(format!("{name}.log")),
                "meridian broker: ",
                &mut p,
            );
            procs.push((0, p));
            banners.push(line?);
        }
        Ok::<_, anyhow::Error>(banners)
    }
    .await;
    let banners = match started {
        Ok(b) => b,
        Err(e) => {
            stop_all(&mut procs);
            return Err(e);
        }
    };
    println!("meridian site up: {} (logs and data there)", dir.display());
    println!("  metadata: {endpoints}");
    println!("  bookies: {}", layout.bookies.join(","));
    let pages: Vec<String> = layout
        .bookie_http
        .iter()
        .map(|h| format!("http://{h}"))
        .collect();
    println!("  bookie metrics: {} (/metrics, /health)", pages.join(","));
    for b in &banners {
        println!("  {}", b.trim_start_matches("meridian "));
    }
    let urls: Vec<&str> = layout.brokers.iter().map(|b| b.pulsar.as_str()).collect();
    println!("  clients: pulsar://{}", urls.join(","));
    println!(
        "  admin: meridian-admin --admin-url http://{} ...",
        layout.brokers[0].admin
    );
    // Until a signal, or until one of them exits.
    let exited = loop {
        tokio::select! {
            _ = crate::shutdown_signal() => break None,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        if let Some(name) = procs
            .iter_mut()
            .find_map(|(_, p)| matches!(p.child.try_wait(), Ok(Some(_))).then(|| p.name.clone()))
        {
            break Some(name);
        }
    };
    if let Some(name) = &exited {
        eprintln!("{name} exited; stopping the site");
    }
    stop_all(&mut procs);
    match exited {
        Some(name) => bail!("{name} exited (see its log in {})", dir.display()),
        None => Ok(()),
    }
}

/// Brokers first (they hand their bundles over), then bookies, then the metadata nodes.
fn stop_all(procs: &mut [(u8, Proc)]) {
    for rank in 0..=2u8 {
        for (r, p) in procs.iter_mut() {
            if *r == rank {
                stop(p, Duration::from_secs(20));
            }
        }
    }
}
