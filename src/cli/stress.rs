//! `herdless stress` (hidden): one misbehaving client against a running
//! broker, with a well-behaved client measured beside it. It produces the
//! figures of docs/RELIABILITY.md; run it against `herdless serve`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use herdless::client::{Client, Options};
use herdless::protocol::{HelloFlags, Request, PROTOCOL_VERSION};
use herdless::status::Status;
use herdless_platform::{sched_count, SchedCount};

/// What the misbehaving client does.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Case {
    /// Nothing: the well-behaved client alone, for the baseline.
    None,
    /// Sends `Status` frames as fast as it can, never reads.
    StatusFlood,
    /// Sends `TryAcquire` frames as fast as it can, never reads.
    TryFlood,
    /// Sends `Cancel` frames as fast as it can, never reads.
    CancelFlood,
    /// 200 connections, each queueing 4096 `Acquire`s.
    AcquireQueue,
    /// Connections that never send their `Hello`, as many as it can open.
    Silent,
    /// Idle clients past their `Hello`, then one status document.
    IdleStatus,
}

#[derive(clap::Args, Debug)]
pub struct StressArgs {
    /// What the misbehaving client does.
    #[arg(value_enum)]
    case: Case,
    /// The broker's socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// How long the flood lasts.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Connections for `silent` and `idle-status`.
    #[arg(long, default_value_t = 18_000)]
    connections: usize,
}

/// Peak and current resident memory of `pid`, in KiB (zeros where the
/// platform cannot tell).
fn rss_kib(pid: u32) -> (u64, u64) {
    herdless_platform::resident_kib(pid).unwrap_or((0, 0))
}

/// Descriptors given back for the well-behaved client when the flood
/// opened as many connections as this process may hold.
const PROBE_RESERVE: usize = 64;

fn frame(req: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    req.encode(&mut out);
    out
}

fn hello() -> Vec<u8> {
    frame(&Request::Hello {
        version: PROTOCOL_VERSION,
        flags: HelloFlags::empty(),
        pid: std::process::id(),
        slot: 0,
    })
}

/// Writes `unit` over and over until `stop`, never reading.
fn flood(socket: &Path, unit: &Request, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) {
    let Ok(mut s) = herdless::rundir::connect(socket) else {
        return;
    };
    let _ = s.set_write_timeout(Some(Duration::from_millis(50)));
    if s.write_all(&hello()).is_err() {
        return;
    }
    let one = frame(unit);
    let burst: Vec<u8> = one.iter().copied().cycle().take(one.len() * 4096).collect();
    while !stop.load(Ordering::Relaxed) {
        match s.write(&burst) {
            Ok(n) => {
                sent.fetch_add((n / one.len()) as u64, Ordering::Relaxed);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return,
        }
    }
}

/// The well-behaved client: connects, tries to take a token (giving it
/// back at once when it gets one), asks for a status, over and over;
/// returns its longest wait for one such round while the misbehaving
/// client sets up (opens its connections) and after, how many rounds it
/// made and how many failed. A try never waits for a token, so the figure is the
/// broker's responsiveness, not the pool's occupancy.
/// What the well-behaved client saw.
#[derive(Default)]
struct ProbeFigures {
    /// Its longest round once the misbehaving client had set up.
    longest: Duration,
    /// The three parts of that round: connecting (to the welcome), the
    /// try and its release, connecting as an observer and reading the
    /// status.
    longest_parts: [Duration; 3],
    /// When that round began, counted from the end of the setup.
    longest_at: Duration,
    /// Every round's time once the misbehaving client had set up.
    times: Vec<Duration>,
    /// Its longest round while the misbehaving client set up.
    setup: Duration,
    rounds: u64,
    failures: u64,
}

fn probe(socket: &Path, set_up: Arc<AtomicBool>, stop: Arc<AtomicBool>) -> ProbeFigures {
    let mut fig = ProbeFigures::default();
    let mut set_up_at = None;
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let mut parts = [Duration::ZERO; 3];
        let ok = (|| -> herdless::client::Result<()> {
            let c = Client::connect_with(socket, Options::default().implicit_token(false))?;
            parts[0] = t.elapsed();
            if let Some(token) = c.try_acquire()? {
                token.release()?;
            }
            parts[1] = t.elapsed() - parts[0];
            Client::observe(socket)?.json()?;
            parts[2] = t.elapsed() - parts[0] - parts[1];
            Ok(())
        })();
        if ok.is_err() {
            fig.failures += 1;
        }
        let took = t.elapsed();
        if set_up.load(Ordering::Relaxed) {
            let since = *set_up_at.get_or_insert(t);
            fig.times.push(took);
            if took > fig.longest {
                fig.longest = took;
                fig.longest_parts = parts;
                fig.longest_at = t.saturating_duration_since(since);
            }
        } else {
            fig.setup = fig.setup.max(took);
        }
        fig.rounds += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    fig
}

fn status(socket: &Path) -> Result<(Status, usize)> {
    let json = Client::observe(socket)?.json()?;
    let s = serde_json::from_str(&json)
        .with_context(|| format!("invalid status document of {} bytes", json.len()))?;
    Ok((s, json.len()))
}

/// Runs one case and prints its figures as one JSON line.
pub fn stress(args: StressArgs) -> Result<u8> {
    super::raise_nofile_limit();
    let socket = args.socket.as_path();
    let (before, _) = status(socket).context("no broker to stress")?;
    let pid = before.pid;
    let sched_start = sched_count(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let mut held: Vec<UnixStream> = Vec::new();
    let mut flooders = Vec::new();
    let set_up = Arc::new(AtomicBool::new(false));
    let probe_thread = {
        let (socket, set_up, stop) = (socket.to_path_buf(), set_up.clone(), stop.clone());
        std::thread::spawn(move || probe(&socket, set_up, stop))
    };
    let unit = match args.case {
        Case::StatusFlood => Some(Request::Status),
        Case::TryFlood => Some(Request::TryAcquire),
        Case::CancelFlood => Some(Request::Cancel),
        _ => None,
    };
    let mut extra = serde_json::Map::new();
    if let Some(unit) = unit {
        let (socket, stop, sent) = (socket.to_path_buf(), stop.clone(), sent.clone());
        flooders.push(std::thread::spawn(move || {
            flood(&socket, &unit, stop, sent)
        }));
    }
    match args.case {
        Case::AcquireQueue => {
            let mut queued = Vec::new();
            for _ in 0..4096 {
                Request::Acquire.encode(&mut queued);
            }
            for _ in 0..200 {
                let mut s = herdless::rundir::connect(socket)?;
                s.write_all(&hello())?;
                s.write_all(&queued)?;
                held.push(s);
            }
        }
        Case::Silent => {
            for _ in 0..args.connections {
                match herdless::rundir::connect(socket) {
                    Ok(s) => held.push(s),
                    Err(_) => break,
                }
            }
        }
        Case::IdleStatus => {
            for _ in 0..args.connections {
                let Ok(mut s) = herdless::rundir::connect(socket) else {
                    break;
                };
                if s.write_all(&hello()).is_err() {
                    break;
                }
                held.push(s);
            }
        }
        _ => {}
    }
    if matches!(args.case, Case::Silent | Case::IdleStatus) && held.len() < args.connections {
        // Stopped by this process's own descriptor limit: give some back,
        // or the well-behaved client beside it could not open its own.
        let keep = held.len().saturating_sub(PROBE_RESERVE);
        held.truncate(keep);
    }
    extra.insert("connections_opened".into(), held.len().into());
    set_up.store(true, Ordering::Relaxed);
    let sched_set_up = sched_count(pid);
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    let sched_end = sched_count(pid);
    let during = status(socket);
    match &during {
        Ok((s, bytes)) => {
            extra.insert("status_bytes".into(), (*bytes).into());
            extra.insert("waiting".into(), s.waiting.into());
            extra.insert("clients_total".into(), s.clients_total.into());
            extra.insert("clients_listed".into(), s.clients.len().into());
            extra.insert("handshaking".into(), s.handshaking.into());
        }
        Err(e) => {
            extra.insert("status_error".into(), format!("{e:#}").into());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        let _ = f.join();
    }
    let ProbeFigures {
        longest,
        longest_parts,
        longest_at,
        mut times,
        setup,
        rounds,
        failures,
    } = probe_thread.join().expect("probe thread");
    times.sort_unstable();
    let quantile = |q: f64| {
        times
            .get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let broker_cpu = |from: Option<SchedCount>, to: Option<SchedCount>| match (from, to) {
        (Some(a), Some(b)) => serde_json::json!({
            "cpu_ms": (b.cpu_ns - a.cpu_ns) as f64 / 1e6,
            "runqueue_ms": (b.runqueue_ns - a.runqueue_ns) as f64 / 1e6,
        }),
        _ => serde_json::Value::Null,
    };
    // Connections the broker closed on its own.
    let mut closed_by_broker = 0;
    for s in &mut held {
        let _ = s.set_nonblocking(true);
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => {
                    closed_by_broker += 1;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // Reset: closed with requests of ours unread.
                    closed_by_broker += 1;
                    break;
                }
            }
        }
    }
    extra.insert("closed_by_broker".into(), closed_by_broker.into());
    let (peak, _) = rss_kib(pid);
    drop(held);
    // Let the broker see every close, then count its tokens.
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        let (s, _) = status(socket)?;
        if s.free == s.capacity || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (_, rss_now) = rss_kib(pid);
    if after.free != after.capacity {
        bail!(
            "{} token(s) not back after the flood",
            after.capacity - after.free
        );
    }
    let mut out = serde_json::Map::new();
    out.insert("case".into(), format!("{:?}", args.case).into());
    out.insert("seconds".into(), args.seconds.into());
    out.insert("frames_sent".into(), sent.load(Ordering::Relaxed).into());
    out.insert("broker_rss_peak_kib".into(), peak.into());
    out.insert("broker_rss_after_kib".into(), rss_now.into());
    out.insert(
        "probe_longest_wait_ms".into(),
        (longest.as_secs_f64() * 1000.0).into(),
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    out.insert(
        "probe_longest_wait_parts_ms".into(),
        longest_parts.map(ms).to_vec().into(),
    );
    out.insert("probe_longest_wait_at_ms".into(), ms(longest_at).into());
    out.insert("probe_p50_ms".into(), ms(quantile(0.5)).into());
    out.insert("probe_p99_ms".into(), ms(quantile(0.99)).into());
    out.insert(
        "broker_during_setup".into(),
        broker_cpu(sched_start, sched_set_up),
    );
    out.insert(
        "broker_during_flood".into(),
        broker_cpu(sched_set_up, sched_end),
    );
    out.insert(
        "probe_longest_wait_setup_ms".into(),
        (setup.as_secs_f64() * 1000.0).into(),
    );
    out.insert("probe_rounds".into(), rounds.into());
    out.insert("probe_failures".into(), failures.into());
    out.insert("tokens_lost".into(), after.lost.into());
    out.extend(extra);
    println!("{}", serde_json::Value::Object(out));
    Ok(0)
}
