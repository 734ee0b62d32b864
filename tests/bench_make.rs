//! `herdless bench make`: the real makes on a small tree of mixed job
//! lengths. The figures are reports; what is checked is that every variant
//! ran the whole tree within `-j`, that the idle-slot figures are sane,
//! and that the makes with herdless inside report their broker's figures.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_herdless");

#[test]
fn every_make_runs_the_mixed_tree_within_j() {
    let out = Command::new(BIN)
        .args([
            "bench", "make", "--subs", "2", "--per", "8", "--job-ms", "20", "--mix", "-j", "4",
            "--repeat", "1", "--json",
        ])
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("HERDLESS_SOCKET")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = rows.iter().filter_map(|r| r["variant"].as_str()).collect();
    for v in [
        "GNU make (stock)",
        "GNU make (stock) in run",
        "GNU make (herdless)",
    ] {
        assert!(names.contains(&v), "{v} missing from {names:?}");
    }
    for r in &rows {
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["jobs_run"], 16, "{r}");
        let most = r["most_at_once"].as_u64().unwrap();
        assert!((1..=4).contains(&most), "{r}");
        let share = r["idle_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{r}");
        let idle = r["idle_slot_s"].as_f64().unwrap();
        assert!(idle >= 0.0, "{r}");
        // Idle slot-seconds cannot exceed all four slots for the whole run.
        assert!(idle <= 4.0 * r["wall_s"].as_f64().unwrap(), "{r}");
        // A make with herdless inside reports its broker's figures; the
        // broker's thread is one of the top make's, whose switches are
        // among the makes'. Stock makes have no broker to report.
        let name = r["variant"].as_str().unwrap();
        if name.ends_with("(herdless)") {
            assert!(r["woken"].as_u64().is_some(), "{r}");
            assert!(r["moved"].as_u64().is_some(), "{r}");
            if cfg!(target_os = "linux") {
                let broker = r["broker_vcsw"].as_u64().expect("counted on Linux");
                assert!(broker >= 1, "{r}");
                assert!(broker <= r["makes_vcsw"].as_u64().unwrap(), "{r}");
            }
        } else {
            assert!(r["woken"].is_null(), "{r}");
            assert!(r["broker_vcsw"].is_null(), "{r}");
            assert!(r["moved"].is_null(), "{r}");
        }
    }
}
