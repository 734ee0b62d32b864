//! The classic bridge with the real programs: GNU make 4.3 (pipe style),
//! GNU make 4.4.1 (fifo style), bmake `-J`, cargo, and native jobs mixed
//! with classic ones, all under one `herdless run -j N`.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{path_with_bin, run_command, run_in as run, stat, JobTree as Tree, BIN, PATIENCE};

fn gnu_make_44() -> PathBuf {
    let path = std::env::var_os("HERDLESS_GNU_MAKE_44")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tools/gnu-make-4.4.1/bin/make")
        });
    assert!(
        path.exists(),
        "GNU make 4.4.1 not found at {}: run `bash ci/build-gnu-make-4.4.1.sh` (CI does)",
        path.display()
    );
    path
}

fn require(tool: &str) {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{tool} is not installed: `bash ci/install-tools.sh` installs it (CI does)"
    );
}

fn check(tree: &Tree, out: &Output, jobs: usize, limit: u32) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, jobs, "every job ran\n{stderr}");
    assert_eq!(
        max, limit,
        "at most {limit} jobs at once, and {limit} reached\n{stderr}"
    );
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    assert!(stat(&stderr, "classic").ends_with(" 0 lost"), "{stderr}");
}

#[test]
fn gnu_make_43_pipe_style() {
    require("make");
    let tree = Tree::new("gnu43");
    tree.flat_makefile("Makefile", "j", 40);
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "make", "-s"]);
    check(&tree, &out, 40, 4);
}

#[test]
fn gnu_make_43_pipe_style_recursive() {
    require("make");
    let tree = Tree::new("gnu43r");
    tree.recursive_makefile(8, 5);
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "make", "-s"]);
    check(&tree, &out, 40, 4);
}

#[test]
fn gnu_make_44_fifo_style() {
    let make = gnu_make_44();
    let tree = Tree::new("gnu44");
    tree.flat_makefile("Makefile", "j", 40);
    let out = run(
        &tree.dir,
        &[
            "-j",
            "4",
            "--style",
            "fifo",
            "--stats",
            "--",
            make.to_str().unwrap(),
            "-s",
        ],
    );
    check(&tree, &out, 40, 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stat(&stderr, "classic").starts_with("gnu fifo"), "{stderr}");
}

/// GNU make 4.4's FIFO protocol, one byte read and written back into the
/// same FIFO per job, by a client that leaves the other free tokens in it:
/// thousands of turns while the FIFO never empties. On Linux the broker
/// shrinks its pipe to one buffer while no classic client is at work; a
/// buffer that never empties fills up after a page's worth of turns, and
/// the client's blocking write back would wait for good.
#[test]
fn a_fifo_client_that_keeps_tokens_waiting_in_it_never_finds_it_full() {
    let tree = Tree::new("fifo-turns");
    let client = tree.path("client.sh");
    fs::write(
        &client,
        r#"fifo=$(printf '%s\n' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=fifo:\([^ ]*\).*/\1/p')
exec 3<>"$fifo"
for ((i = 0; i < $1; i++)); do
  IFS= read -r -d '' -n 1 -u 3 b || exit 3
  printf '%s' "$b" >&3 || exit 4
done
echo "done $1"
"#,
    )
    .unwrap();
    let script = client.to_str().unwrap();
    let out = run(
        &tree.dir,
        &[
            "-j", "8", "--style", "fifo", "--stats", "--", "timeout", "60", "bash", script, "6000",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "done 6000",
        "{stderr}"
    );
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    assert!(stat(&stderr, "classic").ends_with(" 0 lost"), "{stderr}");
}

/// Natives that their subtree's cap holds back do not keep free tokens
/// from a classic reader outside that subtree: no grant comes to them
/// while the capped holder runs, so none would ever count an offer as
/// ignored. The reader gets its token while the capped holder still holds.
#[test]
fn capped_natives_do_not_keep_free_tokens_from_a_classic_reader() {
    let tree = Tree::new("capped-natives-classic");
    let script = tree.path("capped.sh");
    fs::write(
        &script,
        r#"H=$HERDLESS
( sleep 0.3; $H exec sleep 20 & sleep 0.3; $H exec true & $H exec true & wait ) &
sub=$!
$H ctl cap $sub 1 || exit 2
sleep 1.2
r=$(printf '%s\n' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=\([0-9]*\),\([0-9]*\).*/\1/p')
w=$(printf '%s\n' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=\([0-9]*\),\([0-9]*\).*/\2/p')
if IFS= read -r -d '' -n 1 -t 8 -u "$r" b; then
  echo "got a token"
  printf '%s' "$b" >&"$w"
else
  echo "no token"
fi
pkill -P "$sub" -f 'sleep 20' 2>/dev/null
kill $(jobs -p) 2>/dev/null
wait
"#,
    )
    .unwrap();
    let out = run(
        &tree.dir,
        &["-j", "4", "--stats", "--", "bash", script.to_str().unwrap()],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("got a token"), "{stdout}\n{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

/// A classic client that exits holding a token: the token is lost (the
/// classic protocol cannot take it back), and counted once, as lost, not
/// also as taken back from a client that died.
#[test]
fn a_token_a_classic_client_kept_counts_once_as_lost() {
    let tree = Tree::new("classic-kept");
    let out = run(
        &tree.dir,
        &[
            "-j",
            "4",
            "--stats",
            "--",
            "bash",
            "-c",
            r#"r=$(printf '%s\n' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=\([0-9]*\),.*/\1/p'); IFS= read -r -d '' -n 1 -u "$r" b"#,
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "1", "{stderr}");
    assert!(stat(&stderr, "classic").ends_with(" 1 lost"), "{stderr}");
    assert!(stat(&stderr, "taken back").starts_with("0 "), "{stderr}");
}

/// After the stop no classic client starts a job: in fifo style a token
/// given back after it (a job that was running ends) lands in the FIFO the
/// other clients read, and is taken back before one of them can read it.
#[test]
fn a_token_given_back_into_the_fifo_after_the_stop_is_not_read_again() {
    let tree = Tree::new("fifo-after-stop");
    let client = tree.path("client.sh");
    fs::write(
        &client,
        r#"fifo=$(printf '%s\n' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=fifo:\([^ ]*\).*/\1/p')
exec 3<>"$fifo"
trap 'stopped=1' TERM
for i in 1 2 3; do IFS= read -r -d '' -n 1 -u 3 b || exit 3; done
echo holding > holding
while [ -z "$stopped" ]; do sleep 0.05; done
sleep 0.3
printf '+' >&3
sleep 0.5
if IFS= read -r -d '' -n 1 -t 1 -u 3 b; then echo "read a token after the stop"; else echo "no token after the stop"; fi
printf '++' >&3
"#,
    )
    .unwrap();
    let script = client.to_str().unwrap();
    let mut child = run_command(
        &tree.dir,
        &[
            "-j", "4", "--style", "fifo", "--stats", "--", "bash", script,
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let start = std::time::Instant::now();
    while !tree.path("holding").exists() {
        assert!(
            start.elapsed() < PATIENCE,
            "the client never held its tokens"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    if common::wait_timeout(&mut child, PATIENCE).is_none() {
        let _ = child.kill();
        panic!("run did not end after its command");
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stdout.trim(), "no token after the stop", "{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[test]
fn gnu_make_44_fifo_style_recursive() {
    let make = gnu_make_44();
    let tree = Tree::new("gnu44r");
    tree.recursive_makefile(8, 5);
    let out = run(
        &tree.dir,
        &[
            "-j",
            "4",
            "--style",
            "fifo",
            "--stats",
            "--",
            make.to_str().unwrap(),
            "-s",
        ],
    );
    check(&tree, &out, 40, 4);
}

#[test]
fn bmake_pipe_style() {
    require("bmake");
    let tree = Tree::new("bmake");
    tree.flat_makefile("Makefile", "j", 40);
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "bmake"]);
    check(&tree, &out, 40, 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stat(&stderr, "classic").starts_with("bmake pipe"),
        "{stderr}"
    );
}

#[test]
fn bmake_pipe_style_recursive() {
    require("bmake");
    let tree = Tree::new("bmaker");
    tree.recursive_makefile(8, 5);
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "bmake"]);
    check(&tree, &out, 40, 4);
}

#[test]
fn a_failing_bmake_job_stops_every_branch() {
    require("bmake");
    let tree = Tree::new("bmakeabort");
    tree.recursive_makefile(8, 5);
    // Branch 1's first job fails at once; every other job takes a while.
    let sub1 = tree.path("sub1.mk");
    let mk = fs::read_to_string(&sub1).unwrap();
    let failed = tree.path("b1j1.failed");
    let mk = mk.replacen(
        &format!("b1j1:\n\t@sh {0}/job.sh {0}\n", tree.dir.display()),
        &format!(
            "b1j1:\n\t@echo failing; touch {}; exit 1\n",
            failed.display()
        ),
        1,
    );
    fs::write(&sub1, mk).unwrap();
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "bmake"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // bmake's own status for a failed build, passed on by herdless.
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let (done, _) = tree.counts();
    assert!(
        done < 39,
        "the abort stopped the other branches ({done} jobs ran)\n{stderr}"
    );
    // The failing job ran. (bmake's own "Error code 1" line is not checked:
    // a make that reads the abort token first may exit before it has
    // printed what its sub-make wrote.)
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        failed.exists(),
        "the failing job never ran:\n{stdout}{stderr}"
    );
    // The broker saw bmake's E token and told the tree.
    assert_eq!(
        stat(&stderr, "aborted"),
        "E (every client was told)",
        "{stderr}"
    );
}

#[test]
fn cargo_build_runs_at_most_two_rustc() {
    cargo_build_at_j2("pipe");
}

/// cargo 1.75 and later read `--jobserver-auth=fifo:PATH`.
#[test]
fn cargo_build_fifo_style_runs_at_most_two_rustc() {
    cargo_build_at_j2("fifo");
}

/// `herdless run -j 2 --style STYLE -- cargo build` of a 4-crate
/// workspace, with cargo's own job count at 64: at most 2 rustc at once,
/// 2 reached, nothing lost.
fn cargo_build_at_j2(style: &str) {
    require("cargo");
    let tree = Tree::new(&format!("cargo-{style}"));
    let ws = tree.path("ws");
    common::cargo_workspace(&ws, 4);
    // A wrapper records how many rustc compile at once.
    let wrapper = tree.path("rustc-wrapper.sh");
    fs::write(
        &wrapper,
        format!(
            r#"#!/bin/sh
dir={0}
mkdir "$dir/running/$$"
n=$(ls "$dir/running" | wc -l)
echo "$n" >> "$dir/peaks"
"$@"
rc=$?
rmdir "$dir/running/$$"
exit $rc
"#,
            tree.dir.display()
        ),
    )
    .unwrap();
    fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args([
            "run",
            "-j",
            "2",
            "--style",
            style,
            "--stats",
            "--",
            "cargo",
            "build",
            "--offline",
            "-q",
        ])
        .current_dir(&ws)
        .env("PATH", path_with_bin())
        .env("RUSTC_WRAPPER", &wrapper)
        .env("CARGO_TARGET_DIR", tree.path("target"))
        .env("CARGO_BUILD_JOBS", "64")
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (_, max) = tree.counts();
    assert_eq!(max, 2, "at most 2 rustc at once, and 2 reached\n{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    let classic = stat(&stderr, "classic");
    assert!(classic.starts_with(&format!("gnu {style}")), "{stderr}");
    assert!(classic.ends_with(" 0 lost"), "{stderr}");
}

#[test]
fn native_and_classic_jobs_share_one_limit() {
    require("make");
    let tree = Tree::new("mixed");
    // Plain make jobs, a sub-make, and a recipe that starts six native
    // jobs at once through `herdless exec`.
    tree.flat_makefile("sub.mk", "s", 6);
    let d = tree.dir.display();
    let natives: String = (0..6)
        .map(|_| format!("herdless exec sh {d}/job.sh {d} & "))
        .collect();
    let mut mk = String::from("all: p1 p2 p3 p4 p5 p6 natives sub\n");
    for i in 1..=6 {
        mk += &format!("p{i}:\n\t@sh {d}/job.sh {d}\n");
    }
    mk += &format!("natives:\n\t@{natives} wait\n");
    mk += &format!("sub:\n\t@${{MAKE}} -f {d}/sub.mk\n");
    fs::write(tree.path("Makefile"), mk).unwrap();
    let out = run(&tree.dir, &["-j", "3", "--stats", "--", "make", "-s"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, 18, "{stderr}");
    assert!(
        max <= 3,
        "never more than 3 at once in total: {max}\n{stderr}"
    );
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[test]
fn helper_process() {
    match std::env::var("HERDLESS_TEST_ROLE").as_deref() {
        Ok("starve-driver") => starve_driver(),
        Ok("hog-driver") => hog_driver(),
        Ok("classic-hog") => classic_hog(),
        Ok("holder-driver") => holder_driver(),
        Ok("table-kill-driver") => table_kill_driver(),
        Ok("table-churner") => table_churner(),
        _ => {}
    }
    common::helper_main();
}

/// Runs as the command of `herdless run`: four native clients take and
/// give back tokens without pause while this process, a classic client,
/// reads one token from the pipe. Prints how many native grants happened
/// while it waited, and how many in all.
fn starve_driver() -> ! {
    use herdless::client::{Client, Options};
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    let flags = std::env::var("MAKEFLAGS").unwrap();
    let auth = flags.rsplit("--jobserver-auth=").next().unwrap();
    let (r, w) = auth.split_once(',').unwrap();
    let (r, w): (i32, i32) = (r.trim().parse().unwrap(), w.trim().parse().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let native = Arc::new(AtomicU64::new(0));
    let socket = std::env::var("HERDLESS_SOCKET").unwrap();
    let hold: u64 = std::env::var("HERDLESS_TEST_HOLD_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let rounds: u64 = std::env::var("HERDLESS_TEST_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let churners: Vec<_> = (0..4)
        .map(|_| {
            let (stop, native, socket) = (stop.clone(), native.clone(), socket.clone());
            std::thread::spawn(move || {
                let c = Client::connect_with(&socket, Options::default().implicit_token(false))
                    .unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) && n < rounds {
                    let t = c.acquire().unwrap();
                    native.fetch_add(1, Ordering::SeqCst);
                    if hold > 0 {
                        std::thread::sleep(std::time::Duration::from_micros(hold));
                    }
                    drop(t);
                    n += 1;
                }
            })
        })
        .collect();
    if std::env::var_os("HERDLESS_TEST_NO_READ").is_some() {
        // No classic client at all: the broker's figures tell what became
        // of the bridge's offers while the natives contended, from their
        // 200th grant (the pipe's first fill and the start behind) to
        // their last.
        let figures = || {
            let json = Client::observe(&socket).unwrap().json().unwrap();
            let s: herdless::status::Status = serde_json::from_str(&json).unwrap();
            let (classic, fast) = (s.classic.expect("a bridge"), s.fast.expect("a table"));
            [classic.offered, classic.taken_back, fast.moved, fast.grants]
        };
        while native.load(Ordering::SeqCst) < 200 {
            std::thread::yield_now();
        }
        let before = figures();
        for c in churners {
            c.join().unwrap();
        }
        let after = figures();
        let d: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        println!(
            "role: natives {} offered {} taken back {} moved {} table grants {}",
            native.load(Ordering::SeqCst),
            d[0],
            d[1],
            d[2],
            d[3]
        );
        std::process::exit(0);
    }
    // Let the natives contend before the classic client asks.
    while native.load(Ordering::SeqCst) < 200 {
        std::thread::yield_now();
    }
    let before = native.load(Ordering::SeqCst);
    let mut byte = [0u8; 1];
    match std::env::var("HERDLESS_TEST_READ_EVERY_US") {
        // A reader that looks at the pipe now and then instead of
        // sleeping in `read` (as Debian's bmake does when a child ends).
        Ok(us) => {
            use std::os::unix::fs::OpenOptionsExt;
            let every = std::time::Duration::from_micros(us.parse().unwrap());
            let rf = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(format!("/proc/self/fd/{r}"))
                .unwrap();
            loop {
                match (&rf).read(&mut byte) {
                    Ok(1) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(every)
                    }
                    other => panic!("reading the jobserver's pipe: {other:?}"),
                }
            }
        }
        Err(_) => inherited(r).read_exact(&mut byte).unwrap(),
    }
    let waited = native.load(Ordering::SeqCst) - before;
    let mut wf = inherited(w);
    wf.write_all(&byte).unwrap();
    stop.store(true, Ordering::SeqCst);
    for c in churners {
        c.join().unwrap();
    }
    println!("role: waited {waited} of {}", native.load(Ordering::SeqCst));
    std::process::exit(0);

    /// An inherited descriptor, reopened through /proc (the FIFO behind
    /// it) so no raw descriptor is adopted.
    fn inherited(fd: i32) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))
            .unwrap()
    }
}

/// A classic client that takes one token from the inherited pipe, says
/// `held`, and keeps it until killed or until stdin closes.
fn classic_hog() -> ! {
    use std::io::{BufRead, Read};
    let flags = std::env::var("MAKEFLAGS").unwrap();
    let auth = flags.rsplit("--jobserver-auth=").next().unwrap();
    let (r, _) = auth.split_once(',').unwrap();
    let mut rf = std::fs::File::open(format!("/proc/self/fd/{}", r.trim())).unwrap();
    let mut byte = [0u8; 1];
    rf.read_exact(&mut byte).unwrap();
    println!("held");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    std::process::exit(0);
}

/// Runs as the command of `herdless run -j 3`: a classic client (another
/// process) takes one token and keeps it, or is killed with -9 holding it
/// (`HERDLESS_TEST_KILL_HOG=1`); then three native clients, none of them a
/// job of anyone, each take and give back a token 100 times, holding it 5
/// ms. Prints how many of the 300 jobs ran.
fn hog_driver() -> ! {
    use std::io::BufRead;

    let mut hog = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "classic-hog")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(hog.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the hog ended");
        if line.trim() == "held" {
            break;
        }
    }
    if std::env::var_os("HERDLESS_TEST_KILL_HOG").is_some() {
        hog.kill().unwrap();
        hog.wait().unwrap();
    }
    let socket = std::env::var("HERDLESS_SOCKET").unwrap();
    println!("role: {} jobs done", native_jobs(&socket, 3, 100));
    drop(hog.stdin.take());
    let _ = hog.wait();
    std::process::exit(0);
}

/// `clients` native clients, one thread each, each taking and giving back
/// a token `rounds` times, holding it 5 ms: the jobs they ran.
fn native_jobs(socket: &str, clients: usize, rounds: u32) -> u64 {
    use herdless::client::{Client, Options};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    let done = Arc::new(AtomicU64::new(0));
    let natives: Vec<_> = (0..clients)
        .map(|_| {
            let (done, socket) = (done.clone(), socket.to_string());
            std::thread::spawn(move || {
                let c = Client::connect_with(&socket, Options::default().implicit_token(false))
                    .unwrap();
                for _ in 0..rounds {
                    let t = c.acquire().unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    drop(t);
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for n in natives {
        n.join().unwrap();
    }
    done.load(Ordering::SeqCst)
}

/// Runs as the command of `herdless run -j 4` (three shared tokens beside
/// its implicit one), as a top make does: one native client takes two
/// tokens and keeps them to the end, without waiting for more (a make's
/// sub-makes running on them); three more take and give back the third,
/// 20 times each, holding it 5 ms. Prints
/// how many of the 60 jobs ran.
fn holder_driver() -> ! {
    use herdless::client::{Client, Options};

    let socket = std::env::var("HERDLESS_SOCKET").unwrap();
    let holder = Client::connect_with(&socket, Options::default().implicit_token(false)).unwrap();
    let held = [holder.acquire().unwrap(), holder.acquire().unwrap()];
    let done = native_jobs(&socket, 3, 20);
    drop(held);
    println!("role: {done} jobs done");
    std::process::exit(0);
}

/// Liveness of the bridge: an offer for classic clients that nobody reads
/// does not stay in the pipe while natives wait and the only other
/// holder keeps its tokens for a long time (a top make whose sub-makes
/// run on them): no native grant comes to count the offer ignored, so it
/// must also be taken back after a while.
#[cfg(target_os = "linux")]
#[test]
fn an_unread_offer_does_not_idle_a_token_while_the_other_holder_keeps_its_own() {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "-j", "4", "--stats", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "holder-driver")
        .env_remove("MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET");
    // A stall (the one token the natives share left unread in the pipe)
    // lasts until the holder lets go, which it does only after the 60 jobs;
    // the bound is far above their 0.3 s of work.
    let out = common::output_within(&mut cmd, PATIENCE);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("role: 60 jobs done"), "{stdout}\n{stderr}");
    let max: u32 = stat(&stderr, "max in use").parse().unwrap();
    assert!(max <= 3, "{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[cfg(target_os = "linux")]
fn hog_scenario(kill_hog: bool) {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "-j", "3", "--stats", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "hog-driver")
        .env_remove("MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET");
    if kill_hog {
        cmd.env("HERDLESS_TEST_KILL_HOG", "1");
    }
    // A stall (a token left unread in the pipe while the natives wait)
    // never ends; the bound is far above the 0.5 s of work.
    let out = common::output_within(&mut cmd, common::PATIENCE);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("role: 300 jobs done"), "{stdout}\n{stderr}");
    let max: u32 = stat(&stderr, "max in use").parse().unwrap();
    assert!(max <= 3, "{stderr}");
}

/// Liveness of the bridge: a classic client that keeps a token does not
/// make the bridge leave another one unread in the pipe while natives wait.
#[cfg(target_os = "linux")]
#[test]
fn a_classic_holder_does_not_idle_a_token_natives_wait_for() {
    hog_scenario(false);
}

/// The same, with the classic holder killed holding its token: the token is
/// lost (the classic protocol cannot take it back), the natives go on with
/// the rest.
#[cfg(target_os = "linux")]
#[test]
fn a_dead_classic_holder_does_not_stall_the_natives() {
    hog_scenario(true);
}

#[cfg(target_os = "linux")]
/// Four native clients contend without pause while a classic client
/// reads one token from the pipe; returns (native grants while it waited,
/// native grants in all). `env` goes to `herdless run` and its command.
fn starve(env: &[(&str, &str)]) -> (u64, u64) {
    let mut cmd = Command::new(BIN);
    cmd.args(["run", "-j", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "helper_process", "--nocapture"])
        .env("HERDLESS_TEST_ROLE", "starve-driver")
        .env_remove("MAKEFLAGS")
        .env_remove("HERDLESS_SOCKET");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| l.split("role: waited ").nth(1))
        .unwrap_or_else(|| panic!("{stdout}"));
    let (waited, total) = line.split_once(" of ").unwrap();
    (waited.parse().unwrap(), total.trim().parse().unwrap())
}

/// An offer comes at least every 2^MAX_BACKOFF rounds of (at most four)
/// native grants; allow two such gaps, for an offer the reader was too
/// slow to take. A starving bridge would show all 80 000.
#[cfg(target_os = "linux")]
fn assert_not_starved(what: &str, waited: u64, total: u64) {
    eprintln!("{what}: the classic client waited through {waited} of {total} native grants");
    let bound = 2 * (1 << herdless::bridge::MAX_BACKOFF) * 4;
    assert!(
        waited <= bound,
        "{what}: the classic client waited through {waited} native grants (bound {bound})"
    );
    assert!(
        total < 80_000,
        "{what}: natives were still contending when it got its token"
    );
}

#[cfg(target_os = "linux")]
#[test]
fn a_classic_client_is_not_starved_by_contending_natives() {
    // The natives kept to the socket: every grant is a broker event.
    let (waited, total) = starve(&[("HERDLESS_FAST_PATH", "0")]);
    assert_not_starved("socket", waited, total);
}

/// The reader of the test above does not sleep in `read`: it looks at
/// the pipe once a millisecond. An offer stays in the pipe at least
/// `bridge::OFFER_MIN` (2 ms), so a look finds it, however fast the
/// natives' rounds of grants go (an offer taken back after its round
/// alone, some tens of microseconds here, is seldom found).
#[cfg(target_os = "linux")]
#[test]
fn a_classic_client_that_reads_now_and_then_is_not_starved() {
    let (waited, total) = starve(&[
        ("HERDLESS_FAST_PATH", "0"),
        ("HERDLESS_TEST_READ_EVERY_US", "1000"),
    ]);
    assert_not_starved("socket, a look every 1 ms", waited, total);
}

#[cfg(target_os = "linux")]
#[test]
fn a_classic_client_is_not_starved_by_natives_contending_in_the_shared_table() {
    // The command is native and no classic client was seen yet, so the
    // natives take and hand over their tokens in the shared table, which
    // the broker does not see: the table's notify word wakes it when an
    // offer is due. Each native holds its token 50 µs, as a job would: a
    // native that never blocks leaves no processor to the broker on this
    // 2-core machine, and the broker's offer then comes as late as the
    // scheduler lets it run (the classic client is never stuck: it runs on
    // its own implicit token).
    let (waited, total) = starve(&[("HERDLESS_TEST_HOLD_US", "50")]);
    assert_not_starved("table", waited, total);
}

/// Four natives contend in the shared table at `-j3` (two of them always
/// wait there) and no classic client ever reads the pipe. The bridge's
/// offers, due every few rounds of grants, go ahead of the waits in the
/// table, which stay where they are: while an offer is out the broker
/// serves them itself, and none is moved to its queue (each offer used to
/// move every wait in the table there, to be granted over the socket).
/// Counted from the natives' 200th grant: at the start the pipe holds
/// the whole pool, and the first waits may meet a closed table.
#[cfg(target_os = "linux")]
#[test]
fn offers_made_while_natives_wait_in_the_table_leave_their_waits_there() {
    let (line, _) = common::run_role(
        3,
        "starve-driver",
        &[
            ("HERDLESS_TEST_HOLD_US", "50"),
            ("HERDLESS_TEST_ROUNDS", "3000"),
            ("HERDLESS_TEST_NO_READ", "1"),
        ],
        "role: ",
    );
    let figure = |name| common::number_after(&line, name);
    assert_eq!(figure("natives"), 4 * 3000, "{line}");
    assert!(figure("offered") >= 10, "too few offers to tell: {line}");
    assert!(figure("back") >= 10, "{line}");
    assert!(figure("grants") > 0, "{line}");
    assert_eq!(
        figure("moved"),
        0,
        "waits moved to the broker's queue: {line}"
    );
}

/// Four native processes contend in the shared table at `-j3` while the
/// bridge's offers, which nobody reads, come and go, and one of them is
/// killed with `SIGKILL` every few milliseconds (holding a word, waiting,
/// being handed one by the broker while an offer is out: wherever it is)
/// and started again, 60 times. Every process left alive is served to
/// its end, no token is lost or over `-j`, and the offers kept coming.
#[cfg(target_os = "linux")]
#[test]
fn natives_killed_while_offers_come_and_go_lose_nothing() {
    let (line, stderr) = common::run_role(3, "table-kill-driver", &[], "role: ");
    let figure = |name| common::number_after(&line, name);
    assert_eq!(figure("kills"), 60, "{line}");
    assert_eq!(figure("finished"), 4, "{line}");
    assert!(figure("offered") >= 10, "too few offers to tell: {line}");
    // The two shared tokens of `-j3` (the third is the command's own).
    assert!(figure("use") <= 2, "{line}");
    assert_eq!(figure("lost"), 0, "{line}");
    assert!(stderr.contains("tokens lost   0"), "{stderr}");
}

/// The command of the test above.
fn table_kill_driver() -> ! {
    use herdless::client::Client;
    let socket = std::env::var("HERDLESS_SOCKET").unwrap();
    let spawn = |rounds: &str| {
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "helper_process", "--nocapture"])
            .env("HERDLESS_TEST_ROLE", "table-churner")
            .env("HERDLESS_TEST_ROUNDS", rounds)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    // Churners that run without end until killed, then four that finish.
    let mut victims: Vec<_> = (0..4).map(|_| spawn("0")).collect();
    let mut rng = common::Rng(0x7ab1e);
    let mut kills = 0;
    while kills < 60 {
        std::thread::sleep(std::time::Duration::from_micros(500 + rng.below(5000)));
        let k = rng.below(victims.len() as u64) as usize;
        victims[k].kill().unwrap();
        victims[k].wait().unwrap();
        kills += 1;
        victims[k] = spawn("0");
    }
    let finishers: Vec<_> = (0..4).map(|_| spawn("2000")).collect();
    for mut v in victims {
        v.kill().unwrap();
        v.wait().unwrap();
    }
    let mut finished = 0;
    for mut f in finishers {
        if f.wait().unwrap().success() {
            finished += 1;
        }
    }
    let s: herdless::status::Status =
        serde_json::from_str(&Client::observe(&socket).unwrap().json().unwrap()).unwrap();
    let classic = s.classic.expect("a bridge");
    println!(
        "role: kills {kills} finished {finished} offered {} taken back {} max in use {} lost {}",
        classic.offered, classic.taken_back, s.max_in_use, s.lost
    );
    std::process::exit(0);
}

/// A native client that takes a token in the shared table, holds it
/// 50 µs and gives it back, `HERDLESS_TEST_ROUNDS` times (0: until
/// killed); a round that gets no token within PATIENCE fails it.
fn table_churner() -> ! {
    use herdless::client::{Client, Options};
    let rounds: u64 = std::env::var("HERDLESS_TEST_ROUNDS")
        .unwrap()
        .parse()
        .unwrap();
    let c = Client::from_env_with(Options::default().implicit_token(false)).unwrap();
    let mut n = 0;
    while rounds == 0 || n < rounds {
        let t = c
            .acquire_timeout(PATIENCE)
            .unwrap()
            .unwrap_or_else(|| panic!("round {n}: no token within {PATIENCE:?}"));
        std::thread::sleep(std::time::Duration::from_micros(50));
        drop(t);
        n += 1;
    }
    std::process::exit(0);
}

#[test]
fn a_native_abort_stops_bmake_through_the_stopper_token() {
    require("bmake");
    let tree = Tree::new("nativeabort");
    tree.recursive_makefile(8, 5);
    // Branch 1's first job is a native job that fails and aborts the tree;
    // the recipe itself succeeds, so bmake learns of the failure only from
    // the `E` token herdless puts into its pipe.
    let sub1 = tree.path("sub1.mk");
    let mk = fs::read_to_string(&sub1).unwrap().replacen(
        &format!("b1j1:\n\t@sh {0}/job.sh {0}\n", tree.dir.display()),
        "b1j1:\n\t@herdless exec --abort-on-failure false || true\n",
        1,
    );
    fs::write(&sub1, mk).unwrap();
    let out = run(&tree.dir, &["-j", "4", "--stats", "--", "bmake"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "bmake stopped on the E token\n{stderr}"
    );
    let (done, _) = tree.counts();
    assert!(
        done < 39,
        "the abort stopped the other branches ({done} jobs ran)\n{stderr}"
    );
    assert_eq!(
        stat(&stderr, "aborted"),
        "E (every client was told)",
        "{stderr}"
    );
}

#[test]
fn bytes_written_back_without_being_taken_add_no_tokens() {
    // A misbehaving classic client writes tokens it never read into the
    // returns side: they must not become extra tokens.
    let tree = Tree::new("stray");
    let d = tree.dir.display();
    let script = format!(
        r#"printf '++++' > "$(dirname "$HERDLESS_SOCKET")/returns.fifo"; sleep 0.2
for i in 1 2 3 4 5 6; do herdless exec sh {d}/job.sh {d} & done; wait"#
    );
    let out = run(
        &tree.dir,
        &["-j", "3", "--stats", "--", "sh", "-c", &script],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, 6);
    assert!(
        max <= 3,
        "stray bytes ran extra jobs: {max} at once\n{stderr}"
    );
    assert!(stderr.contains("wrote a token it never took"), "{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

#[test]
fn a_run_nested_in_a_make_recipe_replaces_the_outer_jobserver() {
    require("make");
    let tree = Tree::new("nested");
    tree.flat_makefile("sub.mk", "s", 10);
    let d = tree.dir.display();
    fs::write(
        tree.path("Makefile"),
        format!("all:\n\t+herdless run -j 2 --stats -- $(MAKE) -s -f {d}/sub.mk\n"),
    )
    .unwrap();
    let out = common::output_within(
        Command::new("make")
            .args(["-s", "-j8"])
            .current_dir(&tree.dir)
            .env("PATH", path_with_bin())
            .env_remove("MAKEFLAGS")
            .env_remove("MFLAGS")
            .env_remove("CARGO_MAKEFLAGS")
            .env_remove("HERDLESS_SOCKET"),
        PATIENCE * 2,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, max) = tree.counts();
    assert_eq!(done, 10);
    assert_eq!(max, 2, "the inner -j 2 rules, not the outer -j8\n{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
}

/// A script under `herdless run --style pipe` that reuses the number of
/// the bridge's read descriptor for a pipe of its own (`R>&1 | cat`
/// around each job): the `herdless exec` jobs there find `MAKEFLAGS`
/// naming a pipe that is not the broker's, but no jobserver either (the
/// two numbers are not one pipe's ends), so nothing shows a make between
/// and they take their tokens from the broker as before, rather than fail
/// on, or read from, the script's pipe.
#[test]
fn a_reused_jobserver_descriptor_does_not_count_as_a_make_between() {
    let t = Tree::new("bridge-reused-fd");
    let script = t.path("jobs.sh");
    fs::write(
        &script,
        r#"d=$1
r=$(printf '%s' "$MAKEFLAGS" | sed -n 's/.*--jobserver-auth=\([0-9]*\),.*/\1/p')
[ -n "$r" ] || exit 3
for i in 1 2 3 4 5 6 7 8; do
  eval '"$HERDLESS" exec -- sh "$d/job.sh" "$d"' "$r>&1" | cat &
done
wait
"#,
    )
    .unwrap();
    let mut cmd = run_command(&t.dir, &["-j", "4", "--style", "pipe", "--stats", "--"]);
    // bash: dash takes one-digit descriptors only in a redirection.
    cmd.arg("bash")
        .arg(&script)
        .arg(&t.dir)
        .env("JOB_SLEEP", "0.3");
    let out = common::output_within(&mut cmd, PATIENCE * 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let (done, most) = t.counts();
    assert_eq!(done, 8, "{stderr}");
    assert!(most <= 4, "{most} jobs at once under -j4\n{stderr}");
    assert_eq!(stat(&stderr, "tokens lost"), "0", "{stderr}");
    let grants = stat(&stderr, "grants");
    assert!(!grants.starts_with("0 to native"), "{grants}\n{stderr}");
}
