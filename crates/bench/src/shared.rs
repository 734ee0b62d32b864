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
//!   A waiter that gets a token asks the *budget* what to do with it: two
//!   counts in mapped files, give-backs (G − T, or 0 when G ≤ T) and keeps
//!   (T, or G). It takes one from the give-backs and gives the token
//!   straight back to the broker; if there are none left, one from the
//!   keeps and keeps the token (the grants are done); if both are spent,
//!   it stops. So the run ends after exactly G grants with every token
//!   kept by the waiter that got it last, and the budget costs a waiter
//!   two atomic operations at most, no system call: the kernel modes'
//!   waiters make none for it either (their releaser decides). The keep
//!   that leaves 0 is the run's last grant; its waiter tells the
//!   coordinator (the `drained` record), and the grant phase is over.
//!
//!   The stop is a grant too: with the budget spent, the releaser gives
//!   back its last token, which wakes the first waiter in line; that one
//!   passes it on (with any it kept) and ends, and so on down the line,
//!   so each waiter wakes once for the stop, as in the other modes.
//!   Stopping the broker instead would wake a waiter that holds a token
//!   twice: once for the broker's word about it, once for the closed
//!   connection.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::thread;

use herdless_platform::wait::Mode;
use herdless_platform::{SharedCount, SharedWord};

use super::channel::{make_fifo, open_fifo_read, open_fifo_write};
use super::BenchMode;
use herdless::broker::{Broker, Config, Stopper};
use herdless::client::{Client, Options};
use herdless::rundir::RunDir;
use herdless::status::Status;
use herdless::Token;

/// The FIFO the pipe modes wait on.
pub(crate) const TOKENS: &str = "tokens";
/// The FIFO waiters report on.
pub(crate) const RECORDS: &str = "records";
/// The futex mode's token word.
pub(crate) const WORD: &str = "word";
/// The futex mode's stop flag.
pub(crate) const STOP_WORD: &str = "stop-word";
/// Herdless mode: grants whose token goes straight back (a count).
pub(crate) const GIVE_BACKS: &str = "give-backs";
/// Herdless mode: grants whose token is kept, the last ones (a count).
pub(crate) const KEEPS: &str = "keeps";

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

    fn close(&mut self) {
        drop(self.writer.take());
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
        /// Give-backs and keeps left (see the module's notes).
        _budget: (SharedCount, SharedCount),
        stopper: Stopper,
        thread: Option<thread::JoinHandle<io::Result<Status>>>,
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
                let thread = thread::Builder::new()
                    .name("herdless-broker".into())
                    .spawn(move || broker.run())?;
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
                    _budget: (
                        SharedCount::create(scratch.track(GIVE_BACKS), count(grants - first)?)?,
                        SharedCount::create(scratch.track(KEEPS), count(first)?)?,
                    ),
                    stopper,
                    thread: Some(thread),
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

    /// Starts the grant phase: puts the first tokens into circulation,
    /// pushing the time of each release onto `releases`.
    pub(crate) fn start(&mut self, tokens: u32, releases: &mut Vec<u64>) -> io::Result<()> {
        for _ in 0..tokens {
            if !self.release_one(releases)? {
                break;
            }
        }
        Ok(())
    }

    /// After each grant reported: the kernel modes' releaser puts the next
    /// token in; in herdless mode the waiters pass tokens on themselves.
    pub(crate) fn after_grant(&mut self, releases: &mut Vec<u64>) -> io::Result<()> {
        match self {
            Shared::Herdless { .. } => Ok(()),
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
            Shared::Herdless { last, .. } => {
                // The budget is spent: the token that starts the line.
                let token = last.take().expect("stopped once");
                token.release().map_err(io::Error::other)
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

/// `n` as a budget count.
fn count(n: u64) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| io::Error::other(format!("{n} grants do not fit a budget count")))
}
