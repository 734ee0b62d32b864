//! A herd waiter: one process that waits for tokens in one mode, reports
//! each token it gets, and at the end how often it woke.
//!
//! # Counting wake-ups
//!
//! On Linux the coordinator reads every waiter's counters from `/proc`
//! while all of them sleep, before the first token and after the last, and
//! uses those. Elsewhere it uses what each waiter reports here.
//!
//! A process's voluntary context switches grow by one each time it goes to
//! sleep; each sleep that ends is a wake-up. The waiter reads its own
//! counters (`getrusage(RUSAGE_SELF)`) once right after it reports ready,
//! before its first sleep, and once right after the wait call that the
//! coordinator's stop ended. Between the two, every sleep counted was ended
//! by something: a token, the herd of someone else's token, a lock on the
//! pipe — except the last, which the stop ended and which is therefore
//! taken off. The coordinator stops only once every waiter is asleep, so
//! that last sleep exists.
//!
//! macOS keeps no separate count of voluntary switches (XNU's `calcru()`
//! reports every switch as involuntary), so there both are counted.

use std::io;
use std::os::fd::AsFd;
use std::path::Path;

use herdless_platform::wait::{Mode, PipeWaiter, Woken};
use herdless_platform::{self_rusage, SharedCount, SharedWord, Usage};

use super::channel::{open_fifo_read, Record, RecordWriter};
use super::shared::{GIVE_BACKS, KEEPS, RECORDS, STOP_WORD, TOKENS, WORD};
use super::{now_ns, BenchMode, WorkerArgs};
use herdless::client::{Client, Options};
use herdless::rundir::SOCKET_NAME;

pub(super) fn main(args: &WorkerArgs) -> io::Result<()> {
    let mode: BenchMode = args.get("mode")?;
    let idx: u32 = args.get("index")?;
    let dir = Path::new(args.os("dir")?);
    super::procs::die_with_parent();
    let mut out = RecordWriter::open(&dir.join(RECORDS))?;
    let result = match mode {
        BenchMode::Kernel(Mode::Futex) => futex_waiter(dir, idx, &mut out),
        BenchMode::Kernel(m) => pipe_waiter(m, dir, idx, &mut out),
        BenchMode::Herdless | BenchMode::HerdlessSocket => herdless_waiter(dir, idx, &mut out),
    };
    if let Err(e) = &result {
        let _ = out.send(&Record::Failed {
            idx,
            message: format!("{mode} waiter {idx}: {e}"),
        });
    }
    result
}

/// The context switches that count as sleeps on this OS.
pub(crate) fn sleeps(u: &Usage) -> u64 {
    if cfg!(target_vendor = "apple") {
        u.voluntary_ctx + u.involuntary_ctx
    } else {
        u.voluntary_ctx
    }
}

/// A waiter's own counters from the moment it is ready.
struct Tally {
    idx: u32,
    start: Usage,
}

impl Tally {
    /// Reports ready, then reads the counters (so that a ready record that
    /// has to wait for room in the FIFO does not count).
    fn start(out: &mut RecordWriter, idx: u32) -> io::Result<Tally> {
        out.send(&Record::Ready {
            idx,
            pid: std::process::id(),
        })?;
        Ok(Tally {
            idx,
            start: self_rusage()?,
        })
    }

    /// Sends the final record. `stop_waited` says whether the stop ended
    /// a wait (nothing since has slept: the counters read now are those
    /// right after it); `t_rel` a give-back not reported yet.
    ///
    /// No mode reads its counters after each grant: that system call would
    /// fall inside the next hand-off measured.
    fn finish(
        &self,
        out: &mut RecordWriter,
        stop_waited: bool,
        t_want: u64,
        t_rel: Option<u64>,
    ) -> io::Result<()> {
        self.finish_after(out, stop_waited, t_want, t_rel, Vec::new())
    }

    /// [`finish`](Self::finish), sending the `Got` records kept back
    /// before the final one, after the counters are read (a write that
    /// waits for room in the FIFO does not count).
    fn finish_after(
        &self,
        out: &mut RecordWriter,
        stop_waited: bool,
        t_want: u64,
        t_rel: Option<u64>,
        kept_back: Vec<Record>,
    ) -> io::Result<()> {
        let at = self_rusage()?;
        for r in &kept_back {
            out.send(r)?;
        }
        let stop_sleep = u64::from(stop_waited);
        let slept = sleeps(&at).saturating_sub(sleeps(&self.start));
        let cpu = at.cpu().saturating_sub(self.start.cpu());
        out.send(&Record::Final {
            idx: self.idx,
            wakes: slept.saturating_sub(stop_sleep),
            cpu_ns: u64::try_from(cpu.as_nanos()).unwrap_or(u64::MAX),
            t_want,
            t_rel,
        })
    }
}

/// Waits on the token FIFO until its writer closes it.
fn pipe_waiter(mode: Mode, dir: &Path, idx: u32, out: &mut RecordWriter) -> io::Result<()> {
    // Readiness modes claim with a non-blocking read, which the BSDs can
    // only do on a non-blocking description; this one is the waiter's own.
    let fifo = open_fifo_read(&dir.join(TOKENS), mode.is_readiness())?;
    let mut waiter = PipeWaiter::new(fifo.as_fd(), mode)?;
    let tally = Tally::start(out, idx)?;
    let mut t_want = now_ns();
    let mut waited = false;
    loop {
        let claimed = if mode.is_readiness() {
            match waiter.try_claim() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return tally.finish(out, waited, t_want, None)
                }
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        if claimed.is_none() {
            let woken = waiter.wait();
            waited = true;
            match woken {
                Ok(Woken::Claimed(_)) => {}
                // `PipeWaiter::wait` has no deadline and retries `EINTR`.
                Ok(Woken::Readable | Woken::TimedOut | Woken::Interrupted) => continue,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return tally.finish(out, waited, t_want, None)
                }
                Err(e) => return Err(e),
            }
        }
        let t_got = now_ns();
        waited = false;
        out.send(&Record::Got {
            idx,
            t_want,
            t_got,
            t_rel: None,
        })?;
        t_want = now_ns();
    }
}

/// Takes tokens from the shared word until the stop word is set.
fn futex_waiter(dir: &Path, idx: u32, out: &mut RecordWriter) -> io::Result<()> {
    let word = SharedWord::open(dir.join(WORD))?;
    let stop = SharedWord::open(dir.join(STOP_WORD))?;
    let tally = Tally::start(out, idx)?;
    loop {
        let t_want = now_ns();
        let mut waited = false;
        if !word.try_take() {
            word.take()?;
            waited = true;
        }
        if stop.value() > 0 {
            return tally.finish(out, waited, t_want, None);
        }
        let t_got = now_ns();
        out.send(&Record::Got {
            idx,
            t_want,
            t_got,
            t_rel: None,
        })?;
    }
}

/// Takes tokens from the broker and, for each, does what the budget says:
/// give it back at once, keep it, or stop (pass it on, with those kept,
/// and end). The grants are reported at the stop, each with the give-back
/// before it; the grant that spends the budget says so at once
/// ([`Record::Drained`]).
fn herdless_waiter(dir: &Path, idx: u32, out: &mut RecordWriter) -> io::Result<()> {
    let client = Client::connect_with(
        dir.join(SOCKET_NAME),
        Options::default().implicit_token(false),
    )
    .map_err(io::Error::other)?;
    let give_backs = SharedCount::open(dir.join(GIVE_BACKS))?;
    let keeps = SharedCount::open(dir.join(KEEPS))?;
    let tally = Tally::start(out, idx)?;
    let mut kept = Vec::new();
    let mut t_rel = None;
    let mut reports = Vec::new();
    loop {
        let t_want = now_ns();
        let token = client.acquire().map_err(io::Error::other)?;
        let t_got = now_ns();
        let give_back = give_backs.take_one();
        let keep = if give_back {
            None
        } else {
            keeps.take_one_left()
        };
        if !give_back && keep.is_none() {
            // The stop, which ended a wait: every waiter sleeps before it.
            let waited = true;
            drop(token);
            drop(kept);
            return tally.finish_after(out, waited, t_want, t_rel, reports);
        }
        reports.push(Record::Got {
            idx,
            t_want,
            t_got,
            t_rel: t_rel.take(),
        });
        if keep == Some(0) {
            out.send(&Record::Drained { idx })?;
        }
        if give_back {
            t_rel = Some(now_ns());
            drop(token);
        } else {
            kept.push(token);
        }
    }
}
