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

#[test]
fn given_a_chaos_run_ended_by_sigterm_then_its_processes_mounts_and_files_go_with_it() {
    if let Some(why) = PowerCutFs::unavailable() {
        panic!("the power-loss file system cannot be mounted here: {why}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().canonicalize().unwrap();
    let mut chaos = Command::new(env!("CARGO_BIN_EXE_meridian-chaos"))
        .args(["--minutes", "5", "--no-faults", "--topics", "1"])
        .env("TMPDIR", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = rustix::process::Pid::from_child(&chaos);
    let mut lines = BufReader::new(chaos.stderr.take().unwrap()).lines();

    step("the run starts its site and its load");
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut said = Vec::new();
    loop {
        let line = match lines.next() {
            Some(Ok(l)) => l,
            other => {
                let _ = chaos.kill();
                panic!(
                    "meridian-chaos ended before its load ran ({other:?}):\n{}",
                    said.join("\n")
                );
            }
        };
        let begun = line.contains("the schedule begins");
        said.push(line);
        if begun {
            break;
        }
        assert!(Instant::now() < deadline, "{}", said.join("\n"));
    }
    // The rest of what it says is drained (a full pipe would stall it).
    let rest = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>());
    let mounts = mounts_under(&dir);
    let running = processes_naming(&dir);
    assert!(mounts.len() >= 7, "the site's disks: {mounts:?}");
    assert!(running.len() >= 9, "the site's processes: {running:#?}");

    step("SIGTERM ends the run, and all it started with it");
    let sent = Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = loop {
        if let Some(s) = chaos.try_wait().unwrap() {
            break s;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(60),
            "still running 60 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = sent.elapsed();
    let said = rest.join().unwrap();
    assert_eq!(status.code(), Some(143), "{status:?}: {}", said.join("\n"));
    assert_eq!(mounts_under(&dir), Vec::<std::path::PathBuf>::new());
    assert_eq!(processes_naming(&dir), Vec::<String>::new());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    step(format!("ended {} ms after SIGTERM", took.as_millis()));
}
