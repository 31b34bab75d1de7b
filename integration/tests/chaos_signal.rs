//! `meridian-chaos` ended by a signal ends all it started: the site's processes, its
//! clients, its power-cut mounts and its temporary files.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meridian_integration::powercut::{mounts_under, PowerCutFs};
use meridian_integration::step;

/// The processes whose command line names `dir` (the site's data, the clients' files).
fn processes_naming(dir: &Path) -> Vec<String> {
    let want = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let line = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if line.contains(&want) {
            found.push(format!("{}: {line}", e.file_name().to_string_lossy()));
        }
    }
    found
}

/// The run, sent SIGTERM if the test fails before it does (its supervisor ends the rest).
struct Chaos(std::process::Child);

impl Drop for Chaos {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let pid = rustix::process::Pid::from_child(&self.0);
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            let _ = self.0.wait();
        }
    }
}

#[test]
fn given_a_chaos_run_ended_by_sigterm_then_its_processes_mounts_and_files_go_with_it() {
    if let Some(why) = PowerCutFs::unavailable() {
        panic!("the power-loss file system cannot be mounted here: {why}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let mut chaos = Chaos(
        // Under nohup, as a long run is started: SIGHUP ignored, which the run leaves so.
        Command::new("nohup")
            .arg(env!("CARGO_BIN_EXE_meridian-chaos"))
            .args(["--minutes", "5", "--no-faults", "--topics", "1"])
            .env("TMPDIR", &dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = rustix::process::Pid::from_child(&chaos.0);
    let stderr = BufReader::new(chaos.0.stderr.take().unwrap());
    // What it says, read beside the test (a full pipe would stall it).
    let (tx, said) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });

    step("the run starts its site and its load");
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match said.recv_timeout(left) {
            Ok(line) => {
                let begun = line.contains("the schedule begins");
                lines.push(line);
                if begun {
                    break;
                }
            }
            Err(e) => panic!(
                "no load within 240 s ({e}); meridian-chaos said:\n{}",
                lines.join("\n")
            ),
        }
    }
    let mounts = mounts_under(&dir);
    let running = processes_naming(&dir);
    assert!(mounts.len() >= 7, "the site's disks: {mounts:?}");
    assert!(running.len() >= 9, "the site's processes: {running:#?}");

    step("SIGHUP, ignored as under nohup, leaves it running");
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert!(chaos.0.try_wait().unwrap().is_none(), "ended by SIGHUP");
    assert_eq!(mounts_under(&dir).len(), mounts.len());
    let still = processes_naming(&dir);
    assert!(still.len() >= running.len(), "after SIGHUP: {still:#?}");

    step("SIGTERM ends the run, and all it started with it");
    let sent = Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = loop {
        if let Some(s) = chaos.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(60),
            "still running 60 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = sent.elapsed();
    lines.extend(said.try_iter());
    assert_eq!(status.code(), Some(143), "{status:?}: {}", lines.join("\n"));
    assert_eq!(mounts_under(&dir), Vec::<std::path::PathBuf>::new());
    assert_eq!(processes_naming(&dir), Vec::<String>::new());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    step(format!("ended {} ms after SIGTERM", took.as_millis()));
}
