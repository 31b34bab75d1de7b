//! The console (`/console` on a site's HTTP port) in headless Chromium: the page renders and
//! names both sites, a replicated topic with its lag, a replicated subscription and a drill.

use std::process::Command;
use std::time::{Duration, Instant};

use meridian_integration::geo_sites::{admin_ok, mesh_with, slow_link};
use meridian_integration::{step, PyClient};

/// Chromium, headless, as this machine runs it (no sandbox as root, no background traffic).
fn chromium(profile: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            &format!("--user-data-dir={}", profile.display()),
            "--virtual-time-budget=6000",
        ])
        .args(args)
        .output()
        .expect("chromium runs (scripts/setup.sh installs Debian's chromium)")
}

#[test]
fn given_two_sites_then_the_console_renders_the_sites_a_topic_s_lag_and_a_drill() {
    let (root, procs, proxies) = mesh_with(&["east", "west"], &[], true);
    let east = &procs[0];
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/console";

    step("east's link to west is slow; east takes 2,000 messages and a replicated subscription acknowledges 500");
    slow_link(&proxies, 0, 1, 300);
    let mut p = PyClient::run(
        &dir,
        "producer",
        &["produce", &east.url, t, "--count", "2000", "--batch"],
    );
    p.finish(Duration::from_secs(120)).unwrap();
    let mut c = PyClient::run(
        &dir,
        "acker",
        &[
            "repl-sub",
            "ack",
            &east.url,
            t,
            "s1",
            "--count",
            "2000",
            "--cumulative",
            "500",
        ],
    );
    c.finish(Duration::from_secs(120)).unwrap();
    // Kept at east, whose console shows it.
    admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "geo",
        "drill",
        "--from",
        "east",
        "--to",
        "west",
        "--namespace",
        "acme/g",
        "--dry-run",
    ]);
    step("its data: both sites, the topic's lag toward west, the subscription, the drill");
    let deadline = Instant::now() + Duration::from_secs(30);
    let data = loop {
        let page = meridian_integration::http_get(&east.http, "/console/data");
        let body = page.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        let d: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let has_topic = d["topics"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["topic"] == t && x["remote"] == "west"));
        let has_sub = d["subscriptions"].as_array().is_some_and(|a| !a.is_empty());
        if has_topic && has_sub {
            break d;
        }
        assert!(Instant::now() < deadline, "console data: {page}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(data["site"], "east");
    let sites: Vec<&str> = data["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(sites.contains(&"east") && sites.contains(&"west"), "{data}");

    step("the page in headless Chromium names both sites, the topic with its lag, and the drill");
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}/console", east.http);
    let out = chromium(profile.path(), &["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        dom.contains("Meridian: site <span id=\"site\">east</span>"),
        "{dom}"
    );
    assert!(dom.contains("<td>west</td>"), "{dom}");
    assert!(dom.contains(t), "{dom}");
    assert!(dom.contains(" s</td>"), "no lag shown: {dom}");
    assert!(dom.contains("s1"), "{dom}");
    assert!(dom.contains("dry-run from east to west"), "{dom}");
    assert!(
        dom.contains("<div id=\"error\"></div>"),
        "the page could not read its data: {dom}"
    );

    let shots = std::path::PathBuf::from(
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()),
    )
    .join("test-output");
    std::fs::create_dir_all(&shots).unwrap();
    let shot = shots.join("console-east.png");
    let _ = std::fs::remove_file(&shot);
    let out = chromium(
        profile.path(),
        &[
            &format!("--screenshot={}", shot.display()),
            "--window-size=1100,1000",
            &url,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(
        size > 10_000,
        "screenshot {} is {size} bytes",
        shot.display()
    );
    step(format!("screenshot kept at {}", shot.display()));
}
