//! `herdless bench herd`: its JSON, its tables, its plot and its errors.

use std::collections::BTreeSet;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_herdless");

fn herdless(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run herdless")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn json_rows_have_exactly_the_documented_keys() {
    let dir = herdless::rundir::RunDir::create().unwrap();
    let svg = dir.dir().join("herd.svg");
    let out = herdless(&[
        "bench",
        "herd",
        "--mode",
        "poll,herdless",
        "--waiters",
        "2,4",
        "--grants",
        "20",
        "--json",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Map<String, serde_json::Value>> =
        serde_json::from_slice(&out.stdout).expect("a JSON list");
    assert_eq!(rows.len(), 4);
    let want: BTreeSet<&str> = [
        "mode",
        "waiters",
        "grants",
        "wakeups_per_grant",
        "cpu_us_per_grant",
        "handoff_p50_us",
        "handoff_p99_us",
        "handoff_deciles_us",
        "grants_per_s",
        "idle_while_free_us",
        "kernel",
    ]
    .into();
    for row in &rows {
        let keys: BTreeSet<&str> = row.keys().map(String::as_str).collect();
        assert_eq!(keys, want);
        assert!(row["grants"].as_u64().unwrap() >= 20);
        let deciles: Vec<f64> = row["handoff_deciles_us"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_f64().unwrap())
            .collect();
        assert_eq!(deciles.len(), 9, "{row:?}");
        assert!(deciles.windows(2).all(|w| w[0] <= w[1]), "{row:?}");
        let p50 = row["handoff_p50_us"].as_f64().unwrap();
        assert!((deciles[4] - p50).abs() < 0.01, "{row:?}");
        assert!(row["kernel"].as_str().unwrap().contains(' '));
    }
    let modes: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| (r["mode"].as_str().unwrap(), r["waiters"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        modes,
        [("poll", 2), ("poll", 4), ("herdless", 2), ("herdless", 4)]
    );
    // The broker wakes at most the one waiter it grants to (fewer when
    // that waiter had not gone back to sleep yet, as with two waiters); a
    // loaded machine may add the odd sleep of a waiter's own, where a herd
    // would show about one wake-up per waiter.
    for r in rows.iter().filter(|r| r["mode"] == "herdless") {
        if !cfg!(target_vendor = "apple") {
            assert!(r["wakeups_per_grant"].as_f64().unwrap() <= 1.5, "{r:?}");
        }
    }
    let plot = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    assert!(plot.starts_with("<svg"));
    assert!(plot.contains(">poll</text>") && plot.contains(">herdless</text>"));
    assert_eq!(plot.matches("<polyline").count(), 4);
}

#[test]
fn the_table_sets_modes_beside_herdless() {
    let out = herdless(&[
        "bench",
        "herd",
        "--mode",
        "poll,herdless",
        "--waiters",
        "3",
        "--grants",
        "10",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("wake/grant"), "{stdout}");
    assert!(stdout.contains("mode ÷ herdless"), "{stdout}");
}

#[test]
fn bad_modes_are_refused_and_missing_ones_skipped() {
    let out = herdless(&["bench", "herd", "--mode", "pol", "--waiters", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown wait mode"),
        "{}",
        text(&out.stderr)
    );

    let missing = if cfg!(target_os = "linux") {
        "kqueue"
    } else {
        "epoll"
    };
    let out = herdless(&["bench", "herd", "--mode", missing, "--waiters", "1"]);
    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(err.contains(&format!("skipping {missing}")), "{err}");
    assert!(err.contains("none of the modes"), "{err}");

    let out = herdless(&[
        "bench",
        "herd",
        "--mode",
        &format!("{missing},herdless"),
        "--waiters",
        "1",
        "--grants",
        "5",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rows.len(), 1);
}

#[test]
fn zero_waiters_are_a_usage_error() {
    let out = herdless(&["bench", "herd", "--waiters", "0"]);
    assert_eq!(out.status.code(), Some(2));
}

/// Herdless waiters keep their reports until the stop, and one of them
/// ends the grant phase: every grant must still be reported, once, with
/// more tokens than grants, one waiter, or many waiters sharing few
/// tokens.
#[test]
fn herdless_cells_report_exactly_their_grants() {
    for (waiters, tokens, grants) in [("3", "8", 7u64), ("16", "4", 300), ("1", "2", 50)] {
        let out = herdless(&[
            "bench",
            "herd",
            "--mode",
            "herdless,herdless-socket",
            "--waiters",
            waiters,
            "--tokens",
            tokens,
            "--grants",
            &grants.to_string(),
            "--json",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(
                r["grants"].as_u64(),
                Some(grants),
                "{waiters} × {tokens}: {r}"
            );
        }
    }
}
