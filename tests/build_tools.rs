//! Build tools beyond make under `herdless run`: ninja (pipe and fifo
//! styles, and what it does with an explicit `-j`) and gcc's
//! `-flto=jobserver` link in a make recipe (under `herdless run`, and under
//! GNU make with herdless inside). Each test counts the jobs that
//! run at once from the jobs themselves and checks the broker lost nothing.
//!
//! ninja comes from PyPI into `target/tools/venv` (`bash ci/test` installs
//! it, through ci/install-python-tools.sh); a missing tool fails the test
//! with the command that installs it.

mod common;

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Output};

use common::{run_in, stat, venv_bin, JobTree as Tree};

/// ninja ≥ 1.13 (the first release that reads a jobserver): `HERDLESS_NINJA`
/// (a system package, where PyPI has no wheel), or the venv's.
fn ninja() -> PathBuf {
    let ninja = std::env::var_os("HERDLESS_NINJA")
        .map(PathBuf::from)
        .unwrap_or_else(|| venv_bin("ninja"));
    let out = Command::new(&ninja).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    assert!(
        (major, minor) >= (1, 13),
        "{} is ninja {version}; 1.13 or later reads a jobserver: `bash ci/test` installs it",
        ninja.display()
    );
    ninja
}

/// A build.ninja of `n` independent jobs, each `job.sh`.
fn ninja_file(tree: &Tree, n: usize) {
    let d = tree.dir.display();
    let mut f = format!("rule job\n  command = sh {d}/job.sh {d} && touch $out\n");
    for i in 1..=n {
        f += &format!("build out{i}: job\n");
    }
    fs::write(tree.path("build.ninja"), f).unwrap();
}

fn check(tree: &Tree, out: &Output, jobs: usize, limit: u32) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, jobs, "every job ran\n{stdout}\n{stderr}");
    assert_eq!(
        max, limit,
        "at most {limit} jobs at once, and {limit} reached\n{stdout}\n{stderr}"
    );
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    assert!(stat(&stderr, "classic").ends_with(" 0 lost"), "{stderr}");
}

/// Without `-j`, ninja takes its jobs from the jobserver in MAKEFLAGS. Its
/// own default (CPUs + 2) is at least 3, so a peak of exactly 2 is the
/// jobserver's doing.
fn ninja_without_j(style: &str) {
    let ninja = ninja();
    let tree = Tree::new(&format!("ninja-{style}"));
    ninja_file(&tree, 20);
    let out = run_in(
        &tree.dir,
        &[
            "-j",
            "2",
            "--style",
            style,
            "--stats",
            "--",
            ninja.to_str().unwrap(),
        ],
    );
    check(&tree, &out, 20, 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stat(&stderr, "classic").starts_with(&format!("gnu {style}")),
        "{stderr}"
    );
}

#[test]
fn ninja_pipe_style() {
    ninja_without_j("pipe");
}

#[test]
fn ninja_fifo_style() {
    ninja_without_j("fifo");
}

/// ninja documents that an explicit `-j N` on its command line wins over
/// the jobserver: it runs N at once whatever the pool holds. herdless
/// cannot limit a client that does not ask; it still loses nothing.
#[test]
fn ninja_with_an_explicit_j_ignores_the_jobserver() {
    let ninja = ninja();
    let tree = Tree::new("ninja-explicit");
    ninja_file(&tree, 20);
    let out = run_in(
        &tree.dir,
        &[
            "-j",
            "2",
            "--stats",
            "--",
            ninja.to_str().unwrap(),
            "-j",
            "5",
        ],
    );
    check(&tree, &out, 20, 5);
}

/// gcc's `-flto=jobserver`: at link time lto-wrapper runs a sub-make of one
/// LTRANS job per partition on the jobserver of the recipe that links
/// (marked `+`, so the descriptors reach it). Each LTRANS compile records
/// itself, through a wrapper put between collect2 and the compiler driver
/// it calls (`COLLECT_GCC`), in the same place as the make jobs.
#[cfg(target_os = "linux")]
mod gcc_lto {
    use super::*;

    const FUNCTIONS: usize = 12;

    /// The wrapper: for collect2, names itself as the driver LTRANS jobs
    /// run; for an LTRANS compile (`-fltrans`), records itself as a job
    /// (and in `lrunning/`, `lpeaks`, to tell LTRANS jobs apart).
    const WRAP_SH: &str = r#"#!/bin/sh
dir=@DIR@
case " $* " in
*" -fltrans "*)
  mkdir "$dir/running/$$" "$dir/lrunning/$$"
  n=$(ls "$dir/running" | wc -l); echo "$n" >> "$dir/peaks"
  n=$(ls "$dir/lrunning" | wc -l); echo "$n" >> "$dir/lpeaks"
  sleep 0.2
  "$HERDLESS_REAL_GCC" "$@"; rc=$?
  rmdir "$dir/running/$$" "$dir/lrunning/$$"
  echo x >> "$dir/ltrans"
  exit $rc;;
esac
case $1 in
*/collect2) HERDLESS_REAL_GCC=$COLLECT_GCC COLLECT_GCC=$dir/wrap.sh; export HERDLESS_REAL_GCC COLLECT_GCC; exec "$@";;
esac
exec "$HERDLESS_REAL_GCC" "$@"
"#;

    /// Objects for an LTO link of FUNCTIONS + 1 partitions.
    fn objects(tree: &Tree) -> Vec<String> {
        common::require("gcc");
        common::require("make");
        fs::create_dir_all(tree.path("lrunning")).unwrap();
        let wrap = tree.path("wrap.sh");
        fs::write(
            &wrap,
            WRAP_SH.replace("@DIR@", &tree.dir.display().to_string()),
        )
        .unwrap();
        fs::set_permissions(&wrap, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let mut main = String::from("#include <stdio.h>\n");
        let mut sum = String::new();
        let mut objects = Vec::new();
        for i in 1..=FUNCTIONS {
            fs::write(
                tree.path(&format!("f{i}.c")),
                format!(
                    "__attribute__((noinline)) int f{i}(int x) {{ int s = 0; \
                     for (int k = 0; k < x; k++) s += (k * {i}) ^ (s >> 3); return s; }}\n"
                ),
            )
            .unwrap();
            main += &format!("int f{i}(int);\n");
            sum += &format!("s += f{i}(argc * 100);\n");
            objects.push(format!("f{i}.c"));
        }
        main += &format!(
            "int main(int argc, char **argv) {{ (void)argv; int s = 0;\n{sum}printf(\"%d\\n\", s); return 0; }}\n"
        );
        fs::write(tree.path("main.c"), main).unwrap();
        objects.push("main.c".into());
        let status = Command::new("gcc")
            .args(["-O2", "-flto", "-c"])
            .args(&objects)
            .current_dir(&tree.dir)
            .status()
            .unwrap();
        assert!(status.success(), "gcc -flto -c");
        objects
            .iter()
            .map(|c| c.replace(".c", ".o"))
            .collect::<Vec<_>>()
    }

    fn link_recipe(tree: &Tree, objects: &[String]) -> String {
        format!(
            "\t+gcc -O2 -flto=jobserver -flto-partition=max -o prog {} \
             -wrapper {}/wrap.sh\n",
            objects.join(" "),
            tree.dir.display()
        )
    }

    /// A Makefile whose `all` links `prog` (LTO) beside six make jobs.
    fn link_beside_six_jobs(name: &str) -> Tree {
        let tree = Tree::new(name);
        let objects = objects(&tree);
        let d = tree.dir.display();
        let mut mk = String::from("all: prog j1 j2 j3 j4 j5 j6\nprog:\n");
        mk += &link_recipe(&tree, &objects);
        for i in 1..=6 {
            mk += &format!("j{i}:\n\t@sh {d}/job.sh {d}\n");
        }
        fs::write(tree.path("Makefile"), mk).unwrap();
        tree
    }

    fn lines(tree: &Tree, name: &str) -> Vec<u32> {
        fs::read_to_string(tree.path(name))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    fn check_link(tree: &Tree, out: &Output) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            !stderr.contains("jobserver is not available"),
            "lto-wrapper found the jobserver\n{stderr}"
        );
        assert_eq!(
            fs::read_to_string(tree.path("ltrans"))
                .unwrap_or_default()
                .lines()
                .count(),
            FUNCTIONS + 1,
            "one LTRANS job per partition\n{stderr}"
        );
        let run = Command::new(tree.path("prog")).output().unwrap();
        assert!(run.status.success(), "the linked program runs");
        assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
        assert!(stat(&stderr, "classic").ends_with(" 0 lost"), "{stderr}");
    }

    /// The link alone: its LTRANS jobs run 3 at once under `-j 3`, on the
    /// recipe's slot and two tokens.
    #[test]
    fn ltrans_jobs_take_tokens_from_the_pool() {
        let tree = Tree::new("lto-alone");
        let objects = objects(&tree);
        fs::write(
            tree.path("Makefile"),
            format!("all:\n{}", link_recipe(&tree, &objects)),
        )
        .unwrap();
        let out = run_in(&tree.dir, &["-j", "3", "--stats", "--", "make", "-s"]);
        check_link(&tree, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lmax = lines(&tree, "lpeaks").into_iter().max().unwrap_or(0);
        assert_eq!(
            lmax, 3,
            "at most 3 LTRANS jobs at once, and 3 reached\n{stderr}"
        );
    }

    /// The same link and make jobs under GNU make with herdless inside
    /// as the top make, `--jobserver-style=pipe -j 3`: gcc 12's
    /// lto-wrapper reads a pipe only (`R,W`; a FIFO leaves it without a
    /// jobserver, as under stock 4.4.1), which the make's own broker
    /// serves from the pool its make jobs take from.
    #[test]
    fn ltrans_jobs_under_a_herdless_make_with_a_pipe_share_its_limit() {
        let tree = link_beside_six_jobs("lto-herdless-make");
        let make = common::repo_file(
            "target/embed/gnu-make/bin/make",
            "HERDLESS_EMBED_GNU_MAKE",
            "bash embed/gnu-make/build.sh",
        );
        let mut cmd = Command::new(make);
        for var in ["HERDLESS_SOCKET", "HERDLESS_CLASSIC", "MAKEFLAGS", "MFLAGS"] {
            cmd.env_remove(var);
        }
        let out = cmd
            .args(["-s", "--jobserver-style=pipe", "-j3"])
            .env("HERDLESS_MAKE_STATS", tree.path("stats"))
            .current_dir(&tree.dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            !stderr.contains("jobserver is not available"),
            "lto-wrapper found the jobserver\n{stderr}"
        );
        let ltrans = fs::read_to_string(tree.path("ltrans")).unwrap_or_default();
        assert_eq!(ltrans.lines().count(), FUNCTIONS + 1, "{stderr}");
        let run = Command::new(tree.path("prog")).output().unwrap();
        assert!(run.status.success(), "the linked program runs");
        let (done, max) = tree.counts();
        assert_eq!(done, 6, "every make job ran\n{stderr}");
        assert_eq!(
            max, 3,
            "at most 3 jobs at once, LTRANS included, and 3 reached\n{stderr}"
        );
        let stats = common::make_stats(&tree.path("stats"));
        assert_eq!(stats.len(), 1, "one broker: {stats:?}");
        assert_eq!(common::figure(&stats[0], "lost"), 0, "{stats:?}");
        assert!(
            common::figure(&stats[0], "max_in_use") >= 2,
            "LTRANS jobs and make jobs held the two shared tokens: {stats:?}"
        );
    }

    /// The link beside six other make jobs: LTRANS jobs and make jobs
    /// together never pass `-j 3`.
    #[test]
    fn ltrans_and_make_jobs_share_one_limit() {
        let tree = link_beside_six_jobs("lto-mixed");
        let out = run_in(&tree.dir, &["-j", "3", "--stats", "--", "make", "-s"]);
        check_link(&tree, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let (done, max) = tree.counts();
        assert_eq!(done, 6, "every make job ran\n{stderr}");
        assert_eq!(
            max, 3,
            "at most 3 jobs at once, LTRANS included, and 3 reached\n{stderr}"
        );
    }
}
