//! What the waiters of one herd run share, and how tokens enter it.
//!
//! - Pipe modes: a FIFO in the run's directory. A release writes one byte;
//!   the stop closes the write end, which every waiter sees as end of
//!   file.
//! - Futex: a token word and a stop word, each in a mapped file. A release
//!   posts the token word; the stop sets the stop word and posts once per
//!   waiter.
//! - Herdless: a broker on a thread of this process and a client of it,
//!   the releaser, which takes all the broker's tokens at the start: T to
//!   circulate, one for the stop. A release gives one back.
//!
//!   A waiter that gets a token reads one byte from the *budget* FIFO and
//!   does what it says: `+` give the token straight back to the broker,
//!   `k` keep it (the grants are done), `s` stop. The budget is written
//!   ahead of the grants: a `+` for each grant wanted after the first T,
//!   then a `k` for each circulating token, so the run ends after exactly
//!   G grants with every token kept by the waiter that got it last. (A
//!   waiter would only block on the budget if this process fell thousands
//!   of grants behind.) The end is told by a byte, not by closing the FIFO:
//!   a process forking elsewhere in this process could hold the write end
//!   open a moment longer, and a waiter would sleep until it let go.
//!
//!   The stop is a grant too: the releaser writes an `s` per waiter and
//!   gives back its last token, which wakes the first waiter in line; that
//!   one passes it on (with any it kept) and ends, and so on down the
//!   line, so each waiter wakes once for the stop, as in the other modes.
//!   Stopping the broker instead would wake a waiter that holds a token
//!   twice: once for the broker's word about it, once for the closed
//!   connection.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;

use herdless_platform::wait::Mode;
use herdless_platform::SharedWord;

use super::channel::{make_fifo, open_fifo_read, open_fifo_write};
use super::BenchMode;
use herdless::broker::{Broker, Config, Stopper};
use herdless::client::{Client, Options};
use herdless::rundir::RunDir;
use herdless::status::Status;
use herdless::Token;
use herdless_platform::{current_tid, thread_cpu_ns};

/// The FIFO the pipe modes wait on.
pub(crate) const TOKENS: &str = "tokens";
/// The FIFO waiters report on.
pub(crate) const RECORDS: &str = "records";
/// The futex mode's token word.
pub(crate) const WORD: &str = "word";
/// The futex mode's stop flag.
pub(crate) const STOP_WORD: &str = "stop-word";
/// Herdless mode: what to do with each token, a byte each.
pub(crate) const BUDGET: &str = "budget";
/// Budget byte: give the token back.
pub(crate) const GIVE_BACK: u8 = b'+';
/// Budget byte: keep the token, the grants are done.
pub(crate) const KEEP: u8 = b'k';
/// Budget byte: stop.
pub(crate) const STOP: u8 = b's';

/// Budget bytes written ahead of the grants; small enough for the smallest
/// FIFO buffer of the supported systems.
const BUDGET_AHEAD: u64 = 2048;

/// Grants reported between two top-ups of the budget: the coordinator's
/// writes stay off most grants, and the window stays at least
/// `BUDGET_AHEAD - BUDGET_BATCH` bytes ahead of what was reported, room for
/// a byte for every token in flight. With more tokens than that, it tops
/// up at every grant.
const BUDGET_BATCH: u64 = 64;

/// The run's private directory; removes what it made when dropped.
pub(crate) struct Scratch {
    dir: RunDir,
    files: Vec<PathBuf>,
}

impl Scratch {
    pub(crate) fn new() -> io::Result<Scratch> {
        Ok(Scratch {
            dir: RunDir::create()?,
            files: Vec::new(),
        })
    }

    pub(crate) fn dir(&self) -> &Path {
        self.dir.dir()
    }

    fn socket(&self) -> &Path {
        self.dir.socket()
    }

    /// The path of `name` in the directory, to be removed at the end.
    pub(crate) fn track(&mut self, name: &str) -> PathBuf {
        let p = self.dir.dir().join(name);
        self.files.push(p.clone());
        p
    }

    /// Makes FIFO `name`.
    pub(crate) fn fifo(&mut self, name: &str) -> io::Result<PathBuf> {
        let p = self.track(name);
        make_fifo(&p)?;
        Ok(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = fs::remove_file(f);
        }
    }
}

/// A FIFO this process writes to, holding a read end of its own so the
/// write end can be opened before anyone else opens the FIFO.
pub(crate) struct FifoOut {
    writer: Option<File>,
    _reader: File,
}

impl FifoOut {
    fn open(path: &Path) -> io::Result<FifoOut> {
        let reader = open_fifo_read(path, true)?;
        Ok(FifoOut {
            writer: Some(open_fifo_write(path, true)?),
            _reader: reader,
        })
    }

    /// Writes `n` copies of `byte`, or as many as fit; returns how many
    /// did.
    fn put(&mut self, byte: u8, n: u64) -> io::Result<u64> {
        let Some(w) = self.writer.as_mut() else {
            return Ok(0);
        };
        let mut done = 0;
        while done < n {
            let chunk = (n - done).min(512) as usize;
            match w.write(&vec![byte; chunk]) {
                Ok(k) => done += k as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Writes `n` copies of `byte`, waiting for room as readers drain it.
    fn put_all(&mut self, byte: u8, n: u64) -> io::Result<()> {
        let mut done = 0;
        while done < n {
            done += self.put(byte, n - done)?;
            if done < n {
                let w = self.writer.as_ref().expect("open");
                let mut fds = [nix::poll::PollFd::new(
                    w.as_fd(),
                    nix::poll::PollFlags::POLLOUT,
                )];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    fn close(&mut self) {
        drop(self.writer.take());
    }
}

/// The herdless budget: `give_backs` `+` bytes, then `keeps` `k` bytes,
/// written a window ahead of the grants.
pub(crate) struct Budget {
    fifo: FifoOut,
    give_backs: u64,
    keeps: u64,
    /// Grants reported since the last top-up.
    owed: u64,
    /// Grants reported between two top-ups.
    batch: u64,
}

impl Budget {
    /// Writes up to `n` more bytes of the script; never blocks.
    fn top_up(&mut self, n: u64) -> io::Result<()> {
        let plus = self.give_backs.min(n);
        let wrote = self.fifo.put(GIVE_BACK, plus)?;
        self.give_backs -= wrote;
        if wrote < plus || self.give_backs > 0 {
            return Ok(());
        }
        let k = self.keeps.min(n - wrote);
        self.keeps -= self.fifo.put(KEEP, k)?;
        Ok(())
    }
}

pub(crate) enum Shared {
    Pipe {
        fifo: FifoOut,
        /// Tokens still to release.
        left: u64,
    },
    Futex {
        word: SharedWord,
        stop: SharedWord,
        left: u64,
    },
    Herdless {
        socket: PathBuf,
        /// The releaser's connection, and the tokens it has not released.
        _releaser: Client,
        held: Vec<Token>,
        /// Tokens beyond G, when G < T.
        _spare: Vec<Token>,
        /// The token that starts the stop.
        last: Option<Token>,
        budget: Budget,
        stopper: Stopper,
        thread: Option<thread::JoinHandle<io::Result<Status>>>,
        /// The broker's thread, whose CPU time is the relay's (Linux).
        tid: Option<i32>,
    },
}

impl Shared {
    /// Sets up what waiters of `mode` share, for `grants` grants of
    /// `tokens` tokens at a time.
    pub(crate) fn create(
        mode: BenchMode,
        grants: u64,
        tokens: u32,
        scratch: &mut Scratch,
    ) -> io::Result<Shared> {
        match mode {
            BenchMode::Kernel(Mode::Futex) => Ok(Shared::Futex {
                word: SharedWord::create(scratch.track(WORD))?,
                stop: SharedWord::create(scratch.track(STOP_WORD))?,
                left: grants,
            }),
            BenchMode::Kernel(_) => Ok(Shared::Pipe {
                fifo: FifoOut::open(&scratch.fifo(TOKENS)?)?,
                left: grants,
            }),
            BenchMode::Herdless | BenchMode::HerdlessSocket => {
                let socket = scratch.socket().to_path_buf();
                // T tokens to circulate and one for the stop; the pool of
                // `-j N` holds N − 1.
                let mut config = Config::new(tokens + 2);
                config.fast_path = mode == BenchMode::Herdless && config.fast_path;
                let broker = Broker::bind(&socket, config)?;
                scratch.dir.set_bound();
                let stopper = broker.stopper();
                let (tid_tx, tid_rx) = mpsc::channel();
                let thread = thread::Builder::new()
                    .name("herdless-broker".into())
                    .spawn(move || {
                        let _ = tid_tx.send(current_tid());
                        broker.run()
                    })?;
                let tid = tid_rx.recv().ok().flatten();
                let releaser =
                    Client::connect_with(&socket, Options::default().implicit_token(false))
                        .map_err(io::Error::other)?;
                let held = (0..=tokens)
                    .map(|_| releaser.acquire())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(io::Error::other)?;
                // Only G tokens circulate when G < T; the rest stay here.
                let first = u64::from(tokens).min(grants);
                let mut held = held;
                let last = held.pop();
                let spare = held.split_off(first as usize);
                Ok(Shared::Herdless {
                    socket,
                    _releaser: releaser,
                    held,
                    _spare: spare,
                    last,
                    budget: Budget {
                        fifo: FifoOut::open(&scratch.fifo(BUDGET)?)?,
                        give_backs: grants - first,
                        keeps: first,
                        owed: 0,
                        batch: if u64::from(tokens) + BUDGET_BATCH > BUDGET_AHEAD {
                            1
                        } else {
                            BUDGET_BATCH
                        },
                    },
                    stopper,
                    thread: Some(thread),
                    tid,
                })
            }
        }
    }

    /// The broker's socket, in herdless mode.
    pub(crate) fn socket(&self) -> Option<&Path> {
        match self {
            Shared::Herdless { socket, .. } => Some(socket),
            _ => None,
        }
    }

    /// CPU time of the relay between waiters — the broker's thread —
    /// where it can be told apart from the rest of this process, whose
    /// other thread only reads the waiters' records. `None` means: count
    /// the whole process (the kernel modes' releaser is this process).
    pub(crate) fn relay_cpu_ns(&self) -> Option<u64> {
        match self {
            Shared::Herdless { tid: Some(tid), .. } => thread_cpu_ns(*tid),
            _ => None,
        }
    }

    /// Starts the grant phase: puts the first tokens into circulation,
    /// pushing the time of each release onto `releases`.
    pub(crate) fn start(&mut self, tokens: u32, releases: &mut Vec<u64>) -> io::Result<()> {
        // The budget first: a waiter may get a token the moment it is
        // released, and must find its give-back already there.
        if let Shared::Herdless { budget, .. } = self {
            budget.top_up(BUDGET_AHEAD)?;
        }
        for _ in 0..tokens {
            if !self.release_one(releases)? {
                break;
            }
        }
        Ok(())
    }

    /// After each grant reported: the kernel modes' releaser puts the next
    /// token in; herdless tops up the budget.
    pub(crate) fn after_grant(&mut self, releases: &mut Vec<u64>) -> io::Result<()> {
        match self {
            // One byte per grant, a batch at a time, keeps the window
            // where it was.
            Shared::Herdless { budget, .. } => {
                budget.owed += 1;
                if budget.owed < budget.batch {
                    return Ok(());
                }
                let n = std::mem::take(&mut budget.owed);
                budget.top_up(n)
            }
            _ => self.release_one(releases).map(drop),
        }
    }

    /// Releases one token if any is left to release; `Ok(false)` if none.
    fn release_one(&mut self, releases: &mut Vec<u64>) -> io::Result<bool> {
        let t = super::now_ns();
        match self {
            Shared::Pipe { fifo, left } => {
                if *left == 0 {
                    return Ok(false);
                }
                releases.push(t);
                if fifo.put(b'+', 1)? != 1 {
                    return Err(io::Error::other("the token FIFO is full"));
                }
                *left -= 1;
            }
            Shared::Futex { word, left, .. } => {
                if *left == 0 {
                    return Ok(false);
                }
                releases.push(t);
                word.post()?;
                *left -= 1;
            }
            Shared::Herdless { held, .. } => {
                let Some(token) = held.pop() else {
                    return Ok(false);
                };
                releases.push(t);
                token.release().map_err(io::Error::other)?;
            }
        }
        Ok(true)
    }

    /// Wakes every waiter for the last time.
    pub(crate) fn stop(&mut self, waiters: u32) -> io::Result<()> {
        match self {
            Shared::Pipe { fifo, .. } => {
                fifo.close();
                Ok(())
            }
            Shared::Futex { word, stop, .. } => {
                stop.post()?;
                for _ in 0..waiters {
                    word.post()?;
                }
                Ok(())
            }
            Shared::Herdless { last, budget, .. } => {
                // As many as fit now, the token that starts the line, then
                // the rest as the line drains the FIFO.
                let now = budget.fifo.put(STOP, u64::from(waiters))?;
                let token = last.take().expect("stopped once");
                token.release().map_err(io::Error::other)?;
                budget.fifo.put_all(STOP, u64::from(waiters) - now)
            }
        }
    }

    /// After every waiter has ended: checks that the broker lost nothing.
    pub(crate) fn finish(&mut self) -> io::Result<()> {
        if let Shared::Herdless {
            stopper, thread, ..
        } = self
        {
            stopper.stop();
            let status = thread
                .take()
                .expect("finished once")
                .join()
                .map_err(|_| io::Error::other("the broker thread panicked"))??;
            if status.lost != 0 {
                return Err(io::Error::other(format!(
                    "the broker lost {} token(s)",
                    status.lost
                )));
            }
        }
        Ok(())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Shared::Herdless {
            stopper, thread, ..
        } = self
        {
            if let Some(t) = thread.take() {
                stopper.stop();
                let _ = t.join();
            }
        }
    }
}
