//! Chaos: many clients of one broker doing random things at once — acquire,
//! try, cancel, a withdrawal nobody waits for, release, status, reconnect,
//! garbage — while client
//! processes holding or awaiting tokens are killed with SIGKILL and two
//! clients flood requests without reading. A checker samples the broker at
//! random moments. At the end every well-behaved client has been served,
//! tokens in use never exceeded N, and no token is lost; then an abort
//! reaches every waiter.
//!
//! The operations are drawn from a seed (`HERDLESS_CHAOS_SEED`, printed on
//! failure), so a failing sequence can be replayed; the checks are counts
//! and invariants only, never timings.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{Helper, Rng, Serve, PATIENCE};
use herdless::client::{Client, ErrorKind, Options};
use herdless::protocol::{AbortReason, Request};

#[test]
fn helper_process() {
    if std::env::var("HERDLESS_TEST_ROLE").as_deref() == Ok("chaos-driver") {
        chaos_driver();
    }
    common::helper_main();
}

const JOBS: u32 = 4;
const WORKERS: u64 = 16;
const OPS_PER_WORKER: usize = 1000;
const KILLS: usize = 200;

/// Tokens held by this process's well-behaved clients right now.
struct Held {
    now: AtomicI64,
    max: AtomicI64,
}

impl Held {
    fn take(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
    }

    fn give(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One well-behaved client's life: `OPS_PER_WORKER` random operations.
/// Returns how many it completed; every blocking acquire must be granted.
fn worker(socket: &std::path::Path, seed: u64, held: &Held) -> usize {
    let mut rng = Rng(seed);
    let connect = || {
        Client::connect_with(socket, Options::default().implicit_token(false))
            .unwrap_or_else(|e| panic!("seed {seed}: connect: {e}"))
    };
    let mut client = connect();
    let mut tokens = Vec::new();
    let mut done = 0;
    for op in 0..OPS_PER_WORKER {
        let what = rng.below(100);
        match what {
            // Acquire and hold. Only a client holding nothing blocks, so
            // the clients cannot deadlock among themselves (hold and wait).
            0..=29 if tokens.is_empty() => {
                let t = client
                    .acquire_timeout(PATIENCE)
                    .unwrap_or_else(|e| panic!("seed {seed} op {op}: acquire: {e}"))
                    .unwrap_or_else(|| panic!("seed {seed} op {op}: never granted"));
                held.take();
                tokens.push(t);
            }
            // Try (a second token at most).
            30..=44 if tokens.len() < 2 => {
                if let Some(t) = client
                    .try_acquire()
                    .unwrap_or_else(|e| panic!("seed {seed} op {op}: try: {e}"))
                {
                    held.take();
                    tokens.push(t);
                }
            }
            // Ask without waiting, as a poll loop does, and give up after
            // a moment without waiting for the answer: a grant that races
            // the withdrawal is taken back by the broker.
            45..=49 => {
                if let Some(t) = client
                    .take_grant()
                    .unwrap_or_else(|e| panic!("seed {seed} op {op}: take_grant: {e}"))
                {
                    held.take();
                    held.give();
                    t.release().unwrap();
                } else {
                    std::thread::sleep(Duration::from_micros(rng.below(1000)));
                    client
                        .cancel_pending_nowait()
                        .unwrap_or_else(|e| panic!("seed {seed} op {op}: cancel_nowait: {e}"));
                }
            }
            // Ask, wait a moment, give up (a cancel on the wire).
            50..=54 => {
                let wait = Duration::from_millis(rng.below(3));
                if let Some(t) = client
                    .acquire_timeout(wait)
                    .unwrap_or_else(|e| panic!("seed {seed} op {op}: timed acquire: {e}"))
                {
                    held.take();
                    held.give();
                    t.release().unwrap();
                }
            }
            // Status.
            55..=64 => {
                let json = client
                    .status_json()
                    .unwrap_or_else(|e| panic!("seed {seed} op {op}: status: {e}"));
                let s: herdless::status::Status = serde_json::from_str(&json).unwrap();
                assert!(s.in_use <= JOBS, "seed {seed}: {} in use", s.in_use);
            }
            // Reconnect, dropping whatever it holds: the broker takes it back.
            65..=69 => {
                for _ in tokens.drain(..) {
                    held.give();
                }
                client = connect();
            }
            // Release one.
            _ => {
                if let Some(t) = tokens.pop() {
                    held.give();
                    t.release()
                        .unwrap_or_else(|e| panic!("seed {seed} op {op}: release: {e}"));
                }
            }
        }
        done += 1;
    }
    for t in tokens.drain(..) {
        held.give();
        t.release().unwrap();
    }
    done
}

/// Writes frames of `unit` without reading until `stop`.
fn flooder(socket: &std::path::Path, unit: Request, stop: &AtomicBool) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_write_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let out = common::plain_hello();
    let _ = s.write_all(&out);
    let mut one = Vec::new();
    unit.encode(&mut one);
    let burst = one.repeat(1024);
    while !stop.load(Ordering::Relaxed) {
        let _ = s.write(&burst);
    }
}

#[test]
fn chaos() {
    let seed = chaos_seed();
    let serve = Serve::start(JOBS);
    let (ops, kills, samples, garbage) = storm(&serve.socket, seed);
    let socket = serve.socket.clone();

    // Every token comes back.
    let s = serve.wait_for("every token back", |s| {
        s.free == s.capacity && s.waiting == 0
    });
    assert_eq!(s.lost, 0, "seed {seed}");
    assert!(
        s.max_in_use <= JOBS,
        "seed {seed}: max in use {}",
        s.max_in_use
    );

    // Last, an abort reaches waiters and stops all granting.
    let holder = Client::connect_with(&socket, Options::default().implicit_token(false)).unwrap();
    let tokens: Vec<_> = (0..JOBS - 1).map(|_| holder.acquire().unwrap()).collect();
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let c = Client::connect_with(&socket, Options::default().implicit_token(false))
                    .unwrap();
                c.acquire_timeout(PATIENCE).map(|t| t.is_some())
            })
        })
        .collect();
    serve.wait_for("3 waiters", |s| s.waiting == 3);
    holder.abort(AbortReason::Error).unwrap();
    for w in waiters {
        let got = w.join().unwrap();
        assert!(
            matches!(&got, Err(e) if e.kind() == ErrorKind::Aborted(AbortReason::Error)),
            "seed {seed}: a waiter got {:?}",
            got.map_err(|e| e.to_string())
        );
    }
    drop(tokens);
    drop(holder);
    let s = serve.wait_for("tokens back after the abort", |s| s.free == s.capacity);
    assert_eq!(s.lost, 0);
    let (exit, log) = serve.stop();
    assert!(exit.success(), "seed {seed}: {log}");
    assert!(log.contains("tokens lost   0"), "seed {seed}: {log}");
    eprintln!(
        "chaos seed {seed}: {ops} operations, {kills} kills, {} samples, {} garbage connections, \
         max in use {} of {JOBS}, tokens lost {}",
        samples, garbage, s.max_in_use, s.lost
    );
}

/// The seed of this run (`HERDLESS_CHAOS_SEED`, printed).
fn chaos_seed() -> u64 {
    let seed: u64 = std::env::var("HERDLESS_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_c4a0);
    eprintln!("chaos seed {seed} (HERDLESS_CHAOS_SEED={seed} replays it)");
    seed
}

/// The storm itself against the broker at `socket`: well-behaved workers,
/// floods, garbage, killed clients and a checker of the invariants at
/// random moments. Returns (operations done, kills, samples, garbage
/// connections) once every worker is done and the rest has stopped.
fn storm(socket: &std::path::Path, seed: u64) -> (usize, usize, u32, u64) {
    let socket = socket.to_path_buf();
    let stop = Arc::new(AtomicBool::new(false));
    let held = Arc::new(Held {
        now: AtomicI64::new(0),
        max: AtomicI64::new(0),
    });
    let samples = Arc::new(AtomicU32::new(0));
    let garbage_sent = Arc::new(AtomicU64::new(0));

    // Floods of requests that hold nothing (a flood of tries would hold
    // every token it is granted, and rightly starve the others).
    let flooders: Vec<_> = [Request::Status, Request::Cancel]
        .into_iter()
        .map(|unit| {
            let (socket, stop) = (socket.clone(), stop.clone());
            std::thread::spawn(move || flooder(&socket, unit, &stop))
        })
        .collect();

    // The checker: samples the broker at random moments.
    let checker = {
        let (socket, stop, samples) = (socket.clone(), stop.clone(), samples.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0xc4ec);
            while !stop.load(Ordering::Relaxed) {
                let json = Client::observe(&socket).unwrap().json().unwrap();
                let s: herdless::status::Status = serde_json::from_str(&json).unwrap();
                assert!(s.in_use <= JOBS, "seed {seed}: {} in use", s.in_use);
                assert!(s.max_in_use <= JOBS, "seed {seed}: max {}", s.max_in_use);
                assert_eq!(s.lost, 0, "seed {seed}");
                samples.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(rng.below(20)));
            }
        })
    };

    // Garbage: connections that send random bytes.
    let garbage = {
        let (socket, stop, sent) = (socket.clone(), stop.clone(), garbage_sent.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0x6a7b);
            while !stop.load(Ordering::Relaxed) {
                let mut s = UnixStream::connect(&socket).unwrap();
                let len = 1 + rng.below(64) as usize;
                let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                let _ = s.write_all(&bytes);
                sent.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(rng.below(10)));
            }
        })
    };

    // The killer: client processes that hold or wait, killed with SIGKILL.
    let killer = {
        let socket = socket.clone();
        std::thread::spawn(move || {
            let mut rng = Rng(seed ^ 0x4b11);
            let mut kills = 0;
            for _ in 0..KILLS {
                let role = if rng.below(2) == 0 { "hold" } else { "acquire" };
                let mut h = Helper::spawn(&socket, role, 1 + rng.below(2) as u32);
                // Let it connect (and maybe get its tokens) first, sometimes.
                if rng.below(2) == 0 {
                    let _ = h.line();
                }
                std::thread::sleep(Duration::from_millis(rng.below(30)));
                h.kill();
                kills += 1;
            }
            kills
        })
    };

    let workers: Vec<_> = (0..WORKERS)
        .map(|i| {
            let (socket, held) = (socket.clone(), held.clone());
            let seed = seed.wrapping_add(i.wrapping_mul(0x1000_0001));
            std::thread::spawn(move || worker(&socket, seed, &held))
        })
        .collect();
    let ops: usize = workers
        .into_iter()
        .map(|w| w.join().expect("a well-behaved client failed"))
        .sum();
    let kills = killer.join().expect("killer");
    stop.store(true, Ordering::Relaxed);
    checker
        .join()
        .expect("the checker found a broken invariant");
    garbage.join().unwrap();
    for f in flooders {
        f.join().unwrap();
    }
    // Every well-behaved client was served to the end.
    assert_eq!(ops, WORKERS as usize * OPS_PER_WORKER, "seed {seed}");
    assert_eq!(kills, KILLS);
    let max_here = held.max.load(Ordering::SeqCst);
    assert!(
        max_here <= i64::from(JOBS - 1),
        "seed {seed}: {max_here} tokens held at once in this process"
    );
    assert_eq!(held.now.load(Ordering::SeqCst), 0);
    (
        ops,
        kills,
        samples.load(Ordering::Relaxed),
        garbage_sent.load(Ordering::Relaxed),
    )
}

/// The storm above under a classic bridge whose classic side stays
/// dormant: the command of `herdless run` is this test's driver, whose
/// workers are native clients of its own process, so the shared table
/// holds the pool, and the bridge's offers, which nobody reads, come and
/// go while natives wait there (the broker then serves the table's
/// waiters itself) and clients are killed holding or awaiting tokens. The
/// checker's invariants hold at every sample, every worker is served, and
/// the run ends with no token lost, classic ones included.
#[cfg(target_os = "linux")]
#[test]
fn chaos_under_a_classic_bridge_nobody_reads() {
    let seed = chaos_seed();
    let (line, stderr) = common::run_role(
        JOBS,
        "chaos-driver",
        &[("HERDLESS_CHAOS_SEED", &seed.to_string())],
        "chaos-driver: ",
    );
    let figure = |name| common::number_after(&line, name);
    assert_eq!(figure("lost"), 0, "seed {seed}: {line}");
    // The bridge made offers while the natives contended, and the table
    // served them: the storm ran through the code it is meant to attack.
    assert!(figure("offered") > u64::from(JOBS), "seed {seed}: {line}");
    assert!(figure("grants") > 0, "seed {seed}: {line}");
    assert!(stderr.contains("tokens lost   0"), "seed {seed}: {stderr}");
    assert!(
        stderr.contains("classic clients not seen"),
        "seed {seed}: the classic side woke: {stderr}"
    );
}

/// The command of the test above: the storm against the broker of the
/// `herdless run` it runs under, then the broker's figures.
fn chaos_driver() -> ! {
    let socket = std::path::PathBuf::from(std::env::var_os("HERDLESS_SOCKET").unwrap());
    let seed = chaos_seed();
    let (ops, kills, samples, garbage) = storm(&socket, seed);
    let json = Client::observe(&socket).unwrap().json().unwrap();
    let s: herdless::status::Status = serde_json::from_str(&json).unwrap();
    let classic = s.classic.expect("a bridge");
    let fast = s.fast.expect("a table");
    println!(
        "chaos-driver: {ops} ops {kills} kills {samples} samples {garbage} garbage \
         offered {} taken back {} moved {} table grants {} max in use {} lost {}",
        classic.offered, classic.taken_back, fast.moved, fast.grants, s.max_in_use, s.lost
    );
    std::process::exit(0);
}
