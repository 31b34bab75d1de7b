//! The site a schedule runs against: three metadata nodes, four bookies (ensemble 3, write
//! and ack quorum 2) and two brokers, each a process of its own on loopback, and the faults
//! applied to them. Every metadata node and bookie keeps its data on a power-loss file system
//! of its own ([`PowerCutFs`]), so a power cut drops exactly what that process had not synced.

use std::time::Duration;

use anyhow::{bail, Context};

use super::clock::Clocks;
use super::remote::Remote;
use super::schedule::{Action, Cut, Fault, Shape, Target};
use crate::powercut::{CutReport, PowerCutFs};
use crate::{start_bookies, BookieProc, BrokerProc, MetaCluster, MetaNode};

pub const SHAPE: Shape = Shape {
    metadata: 3,
    bookies: 4,
    brokers: 2,
    remote: false,
};

/// Fields drop in order: the processes go before the file systems they use are unmounted.
pub struct Site {
    /// With two sites: site west and the link to it.
    pub remote: Option<Remote>,
    pub meta: MetaCluster,
    pub bookies: Vec<BookieProc>,
    pub brokers: Vec<BrokerProc>,
    /// The metadata nodes' disks, then the bookies'.
    disks: Vec<PowerCutFs>,
    /// Every process's wall clock.
    clocks: Clocks,
    _disk_root: tempfile::TempDir,
}

/// A fault in progress: what to undo when it ends.
pub struct Applied {
    action: Action,
    /// The process hit (the metadata leader named by its index).
    resolved: Target,
    /// What a power cut dropped.
    pub note: String,
    /// For a full disk: how long the bookie's log was when it began.
    log_from: usize,
}

impl Applied {
    pub fn resolved(&self) -> Target {
        self.resolved
    }
}

impl Site {
    /// Starts the site; with `two_sites`, as site east of two (see [`Remote`]), its brokers
    /// with geo links; with `clock_jumps`, every process's wall clock under [`Clocks`].
    pub async fn start(two_sites: bool, clock_jumps: bool) -> anyhow::Result<Site> {
        if let Some(why) = PowerCutFs::unavailable() {
            bail!("the power-loss file system cannot be mounted here: {why}");
        }
        let disk_root = tempfile::tempdir()?;
        let mut disks = Vec::new();
        let names = (1..=SHAPE.metadata)
            .map(|i| format!("node{i}"))
            .chain((0..SHAPE.bookies).map(|i| format!("bookie{i}")));
        for name in names {
            let d = disk_root.path().join(&name);
            disks.push(
                PowerCutFs::mount(&d.join("backing"), &d.join("mnt"))
                    .with_context(|| format!("the disk of {name}"))?,
            );
        }
        let root = tempfile::tempdir()?;
        let clocks = Clocks::new(&root.path().join("clocks"), clock_jumps)?;
        let mut nodes = Vec::new();
        for id in 1..=SHAPE.metadata as u64 {
            let mut n = MetaNode::new(id, root.path(), None);
            n.data_dir = disks[id as usize - 1].mountpoint.join("data");
            for (k, v) in clocks.env(&format!("node{id}"))? {
                n.env(k, &v);
            }
            nodes.push(n);
        }
        crate::make_members(&mut nodes);
        for n in &mut nodes {
            n.start()?;
        }
        let meta = MetaCluster { nodes, root };
        meta.wait_for_leader(Duration::from_secs(30)).await?;
        let endpoints = meta.endpoints().join(",");
        let root = meta.root.path().to_path_buf();
        let mut bookies = Vec::new();
        for i in 0..SHAPE.bookies {
            let name = format!("bookie{i}");
            let mut b = BookieProc::new(&name, &root, &endpoints);
            b.dir = disks[SHAPE.metadata + i].mountpoint.join("data");
            for (k, v) in clocks.env(&name)? {
                b.env(k, &v);
            }
            bookies.push(b);
        }
        start_bookies(&mut bookies, &meta.client(), Duration::from_secs(60)).await?;
        // Both run meridian-admin and wait for processes: off the runtime's workers.
        let remote = if two_sites {
            Some(tokio::task::block_in_place(|| Remote::start(&root))?)
        } else {
            None
        };
        let mut geo_listens = Vec::new();
        let mut brokers = Vec::new();
        for name in ["broker0", "broker1"] {
            let mut b = BrokerProc::new(name, &root, &endpoints);
            // The default session TTL (5 s): a broker paused or cut off longer loses its
            // bundles, as in production.
            b.env("MERIDIAN_BROKER_ENSEMBLE", "3")
                .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
                .env("MERIDIAN_BROKER_ACK_QUORUM", "2");
            for (k, v) in clocks.env(name)? {
                b.env(k, &v);
            }
            if let Some(r) = &remote {
                let listen = format!("127.0.0.1:{}", crate::free_udp_port());
                for (k, v) in r.east_broker_env(&listen) {
                    b.env(k, &v);
                }
                geo_listens.push(listen);
            }
            b.start().with_context(|| format!("starting {name}"))?;
            brokers.push(b);
        }
        if let Some(r) = &remote {
            tokio::task::block_in_place(|| {
                r.link(&brokers[0].admin_url, &brokers[0].url, &geo_listens[0])
            });
        }
        Ok(Site {
            remote,
            clocks,
            meta,
            bookies,
            brokers,
            disks,
            _disk_root: disk_root,
        })
    }

    /// A service URL listing both brokers (clients look topics up at either).
    pub fn service_url(&self) -> String {
        let hosts: Vec<&str> = self.brokers.iter().map(|b| crate::host(&b.url)).collect();
        format!("pulsar://{}", hosts.join(","))
    }

    /// The admin URL of a running broker.
    pub fn admin_url(&self) -> String {
        self.brokers
            .iter()
            .find(|b| b.pid().is_some())
            .map(|b| b.admin_url.clone())
            .unwrap_or_default()
    }

    pub fn root(&self) -> &std::path::Path {
        self.meta.root.path()
    }

    /// Starts `fault`.
    pub async fn apply(&mut self, fault: &Fault) -> anyhow::Result<Applied> {
        let resolved = match fault.target {
            Target::MetadataLeader => {
                let id = self.meta.wait_for_leader(Duration::from_secs(30)).await?;
                Target::Metadata(id as usize - 1)
            }
            t => t,
        };
        let mut note = String::new();
        let mut log_from = 0;
        match (fault.action, resolved) {
            (Action::Kill, Target::Metadata(i)) => self.meta.nodes[i].kill9()?,
            (Action::Kill, Target::Bookie(i)) => self.bookies[i].kill9()?,
            (Action::Kill | Action::PowerCut(_), Target::Broker(i)) => self.brokers[i].kill9()?,
            (Action::Pause, Target::Metadata(i)) => self.meta.nodes[i].pause(true)?,
            (Action::Pause, Target::Bookie(i)) => self.bookies[i].pause(true)?,
            (Action::Pause, Target::Broker(i)) => self.brokers[i].pause(true)?,
            (Action::PowerCut(cut), Target::Metadata(i)) => {
                self.meta.nodes[i].kill9()?;
                note = show(&cut_disk(&self.disks[i], cut)?);
            }
            (Action::PowerCut(cut), Target::Bookie(i)) => {
                self.bookies[i].kill9()?;
                note = show(&cut_disk(&self.disks[SHAPE.metadata + i], cut)?);
            }
            (Action::PowerCut(cut), Target::Site) => {
                for n in &mut self.meta.nodes {
                    n.kill9()?;
                }
                for b in &mut self.bookies {
                    b.kill9()?;
                }
                for b in &mut self.brokers {
                    b.kill9()?;
                }
                // Each disk tears or keeps pages by a seed of its own.
                let mut dropped = Vec::new();
                for (k, d) in self.disks.iter().enumerate() {
                    let cut = match cut {
                        Cut::Clean => Cut::Clean,
                        Cut::Torn(s) => Cut::Torn(s.wrapping_add(k as u64)),
                        Cut::Partial(s) => Cut::Partial(s.wrapping_add(k as u64)),
                    };
                    dropped.push(cut_disk(d, cut)?.bytes);
                }
                note = format!("bytes dropped per disk {dropped:?}");
            }
            (Action::DiskFull, Target::Bookie(i)) => {
                log_from = self.bookies[i].log_text().len();
                self.disks[SHAPE.metadata + i].set_full(true);
            }
            (Action::Partition | Action::Flaky, Target::Link) => {
                self.remote()?.disturb(fault.action == Action::Partition)
            }
            (
                Action::ClockJump(secs),
                t @ (Target::Metadata(_) | Target::Bookie(_) | Target::Broker(_)),
            ) => {
                self.clocks.jump(&clock_name(t), secs)?;
                note = format!("its wall clock {secs:+} s");
            }
            (Action::Kill, Target::Remote) => self.remote_mut()?.west.kill9()?,
            (Action::Pause, Target::Remote) => self.remote_mut()?.west.pause(true)?,
            (
                Action::Kill | Action::Pause | Action::DiskFull | Action::ClockJump(_),
                Target::Site,
            )
            | (Action::Partition | Action::Flaky, _)
            | (_, Target::Link | Target::Remote)
            | (Action::DiskFull, _)
            | (_, Target::MetadataLeader) => {
                bail!("{fault} cannot be applied")
            }
        }
        Ok(Applied {
            action: fault.action,
            resolved,
            note,
            log_from,
        })
    }

    /// Ends a fault: what was killed starts again on its addresses (a whole site in order:
    /// metadata, bookies, brokers), what was paused continues.
    pub async fn heal(&mut self, applied: &Applied) -> anyhow::Result<()> {
        let what = format!("healing {}", applied.resolved);
        match (applied.action, applied.resolved) {
            (Action::Pause, Target::Metadata(i)) => self.meta.nodes[i].pause(false),
            (Action::Pause, Target::Bookie(i)) => self.bookies[i].pause(false),
            (Action::Pause, Target::Broker(i)) => self.brokers[i].pause(false),
            (Action::DiskFull, Target::Bookie(i)) => self.free_disk(i, applied.log_from),
            (Action::ClockJump(_), t) => self.clocks.jump(&clock_name(t), 0),
            (_, Target::Metadata(i)) => self.meta.nodes[i].start(),
            (_, Target::Bookie(i)) => self.bookies[i].start(),
            // It waits for the broker's banner: off the runtime's worker.
            (_, Target::Broker(i)) => tokio::task::block_in_place(|| self.brokers[i].start()),
            (_, Target::Site) => self.start_all().await,
            (_, Target::MetadataLeader) => Ok(()),
            (_, Target::Link) => self.remote().map(Remote::heal_link),
            (Action::Pause, Target::Remote) => self.remote_mut()?.west.pause(false),
            (_, Target::Remote) => {
                let r = self.remote_mut()?;
                tokio::task::block_in_place(|| r.west.start())
            }
        }
        .context(what)
    }

    fn remote(&self) -> anyhow::Result<&Remote> {
        self.remote
            .as_ref()
            .context("a fault of a second site in a run of one")
    }

    fn remote_mut(&mut self) -> anyhow::Result<&mut Remote> {
        self.remote
            .as_mut()
            .context("a fault of a second site in a run of one")
    }

    /// Gives bookie `i` its space back. A bookie whose journal write failed on the full disk
    /// stays read-only until it restarts (the journal may end in a torn record, which only a
    /// replay removes), so it is restarted, as an operator would after freeing the disk; one
    /// that only saw the disk fill up (read-only by its usage check) takes writes again by
    /// itself.
    fn free_disk(&mut self, i: usize, log_from: usize) -> anyhow::Result<()> {
        self.disks[SHAPE.metadata + i].set_full(false);
        let b = &mut self.bookies[i];
        let log = b.log_text();
        if log
            .get(log_from..)
            .is_some_and(|l| l.contains("bookie is read-only from now on"))
        {
            b.kill9()?;
            b.start()?;
        }
        Ok(())
    }

    async fn start_all(&mut self) -> anyhow::Result<()> {
        for n in &mut self.meta.nodes {
            n.start()?;
        }
        self.meta.wait_for_leader(Duration::from_secs(60)).await?;
        for b in &mut self.bookies {
            b.start()?;
        }
        for b in &mut self.brokers {
            tokio::task::block_in_place(|| b.start())?;
        }
        Ok(())
    }

    /// Keeps the run's directories past the site's end: (logs, the disks' backing
    /// directories). The processes still stop and the disks unmount when the site drops.
    pub fn keep_files(&mut self) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
        let logs = std::mem::replace(&mut self.meta.root, tempfile::tempdir()?).keep();
        let disks = std::mem::replace(&mut self._disk_root, tempfile::tempdir()?).keep();
        Ok((logs, disks))
    }

    /// Processes that ended by themselves since the last call (crashes), each started again
    /// so the run goes on: a line per crash with how it ended and the end of its log.
    pub async fn crashes(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        let tail = |log: &std::path::Path| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(3)..].join(" | ")
        };
        for n in &mut self.meta.nodes {
            if let Some(how) = n.exited() {
                out.push(format!("metadata node {} {how}: {}", n.id, tail(&n.log)));
                let _ = n.start();
            }
        }
        for (i, b) in self.bookies.iter_mut().enumerate() {
            if let Some(how) = b.exited() {
                out.push(format!("bookie {i} {how}: {}", tail(&b.log)));
                let _ = b.start();
            }
        }
        for (i, b) in self.brokers.iter_mut().enumerate() {
            if let Some(how) = b.exited() {
                out.push(format!("broker {i} {how}: {}", tail(&b.log)));
                let _ = b.start();
            }
        }
        if let Some(r) = &mut self.remote {
            if let Some(how) = r.west.exited() {
                out.push(format!("site west {how}: {}", tail(&r.west.log)));
                let _ = tokio::task::block_in_place(|| r.west.start());
            }
        }
        out
    }

    /// Prints each process's last warnings and errors (a run that failed).
    pub fn show_warnings(&self) {
        for (who, log) in self.logs() {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                .collect();
            eprintln!(
                "--- {who}: its last {} warnings and errors ---",
                lines.len().min(30)
            );
            for l in &lines[lines.len().saturating_sub(30)..] {
                eprintln!("{l}");
            }
        }
    }

    /// Every process's log, for a run that found something.
    pub fn logs(&self) -> Vec<(String, std::path::PathBuf)> {
        let mut out: Vec<(String, std::path::PathBuf)> = self
            .meta
            .nodes
            .iter()
            .map(|n| (format!("metadata node {}", n.id), n.log.clone()))
            .collect();
        out.extend(
            self.bookies
                .iter()
                .enumerate()
                .map(|(i, b)| (format!("bookie {i}"), b.log.clone())),
        );
        out.extend(
            self.brokers
                .iter()
                .enumerate()
                .map(|(i, b)| (format!("broker {i}"), b.log.clone())),
        );
        if let Some(r) = &self.remote {
            out.push(("site west".to_string(), r.west.log.clone()));
        }
        out
    }
}

/// The name of a process's clock file.
fn clock_name(t: Target) -> String {
    match t {
        Target::Metadata(i) => format!("node{}", i + 1),
        Target::Bookie(i) => format!("bookie{i}"),
        Target::Broker(i) => format!("broker{i}"),
        other => format!("{other}"),
    }
}

fn cut_disk(disk: &PowerCutFs, cut: Cut) -> anyhow::Result<CutReport> {
    match cut {
        Cut::Clean => Ok(disk.cut()),
        Cut::Torn(seed) => disk.cut_torn(seed),
        Cut::Partial(seed) => disk.cut_partial(seed),
    }
}

fn show(r: &CutReport) -> String {
    format!("{} unsynced bytes of {} files dropped", r.bytes, r.files)
}
