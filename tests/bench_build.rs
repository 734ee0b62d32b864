//! `herdless bench build`: the seed's P C R matrix on a small tree.

use std::process::Command;

use herdless_bench::build::BuildRow;

const BIN: &str = env!("CARGO_BIN_EXE_herdless");

/// Three sub-makes, -j 2: the top make's implicit token and the pool's one
/// token both go to sub-makes, so a sub-make that may not run in its
/// implicit token (no C) never starts a job.
#[test]
fn without_the_implicit_token_check_the_tree_stalls() {
    let out = Command::new(BIN)
        .args([
            "bench",
            "build",
            "--makes",
            "3",
            "--jobs-per-make",
            "4",
            "--job-us",
            "200",
            "-j",
            "2",
            "--variants",
            "P1C0R0,P0C1R0,P1C1R0,herdless",
            "--stall-after",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<BuildRow> = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.variant.as_str()).collect();
    assert_eq!(names, ["P1C0R0", "P0C1R0", "P1C1R0", "herdless"]);

    let stalled = &rows[0];
    assert!(stalled.stalled, "{stalled:?}");
    assert_eq!(stalled.user_s, None);
    assert!(stalled.wall_s >= 2.0);

    for r in &rows[1..] {
        assert!(!r.stalled, "{r:?}");
        // Every token is back in the pool.
        assert_eq!(r.tokens_back, 1, "{r:?}");
        assert!(r.user_s.is_some() && r.voluntary_ctx_switches.is_some());
        assert_eq!((r.makes, r.jobs_per_make, r.jobs), (3, 4, 2));
    }
}

#[test]
fn unknown_variants_are_a_usage_error() {
    let out = Command::new(BIN)
        .args(["bench", "build", "--variants", "P2C0R0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("P0C0R0"));
}
