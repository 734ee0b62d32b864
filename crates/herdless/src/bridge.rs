//! The classic bridge: the broker's pool, served to classic jobserver
//! clients (GNU make, bmake, cargo, rustc, gcc) through a pipe or a FIFO.
//!
//! # Channels
//!
//! Everything lives in the broker's private directory, as FIFOs (mode
//! 0600), so that the broker can hold its own non-blocking file
//! descriptions of them while the classic clients get ordinary blocking
//! ones:
//!
//! - **pipe style** (`--jobserver-auth=R,W`, bmake's `-J R,W`): two FIFOs.
//!   Clients read tokens from `offers` (fd R) and write them back into
//!   `returns` (fd W). Splitting the two directions lets the broker see
//!   every returned token, and every bmake abort token, the moment it is
//!   written. R and W are the only descriptors herdless lets a command
//!   inherit, each a read-write description, so that a client outliving
//!   the broker sees neither end-of-file nor a broken pipe.
//! - **fifo style** (`--jobserver-auth=fifo:PATH`, GNU make ≥ 4.4): one
//!   FIFO that clients open by path, for both directions.
//!
//! # Sharing one pool
//!
//! The classic side is one client of the [`Pool`], labelled `classic`; the
//! tokens it holds are those in the pipe plus those held by classic
//! clients, so conservation (ARCHITECTURE §4.1) holds across both worlds. The
//! classic protocol cannot tell the broker when a client *takes* a token
//! from the pipe, so the bridge works from what it can see: how many bytes
//! are in the pipe (`FIONREAD`), what comes back, and the native queue.
//!
//! - While no native client waits, every free token goes into the pipe:
//!   classic clients see the whole pool, as under a plain jobserver.
//! - While native clients wait, tokens that sit unread in the pipe are
//!   taken back and granted to them, except one *offer* for classic
//!   clients: the bridge queues for a token in the pool's FIFO like any
//!   waiter, and writes it into the pipe when its turn comes. An offer
//!   nobody reads is taken back after a round of native grants (one per
//!   waiting native, at most as many as there are tokens) once it has
//!   been there [`OFFER_MIN`] (2 ms), or at once if nothing else could
//!   free a token; each ignored offer
//!   doubles the number of rounds before the next one, up to
//!   [`MAX_BACKOFF`]; an offer that is read resets that. So a classic client
//!   that starts waiting while natives contend gets a token within at most
//!   2^`MAX_BACKOFF` rounds of native grants, usually within one, and a
//!   tree with no classic client at all leaves a token idle only rarely.
//!   These figures count grants, and time only as a bound: an offer
//!   left unread for [`OFFER_WAIT`] (50 ms) counts as ignored too, however
//!   few grants came, since a holder may keep its tokens for long (a top
//!   make's sub-makes run on them) while the waiters have nothing else to
//!   free one; the broker then wakes once, at that deadline. Likewise,
//!   while no native waits, the next offer is due after its rounds of
//!   grants or as many [`OFFER_WAIT`]s, whichever comes first: a top make
//!   with nothing left to start makes no grants, so a count alone could
//!   keep a free token from a classic reader for good. Natives that wait
//!   get grants as tokens are released, and those count.
//!
//! # Who reads the pipe
//!
//! The bridge never guesses from a command's name whether it reads the
//! pipe; it goes by what the broker sees:
//!
//! - **At the start** nothing is known, and the command may be a classic
//!   client (a stock make, cargo, a script that starts them): the back-off
//!   is 0, so an offer is made at every turn and one nobody reads is made
//!   again after a single round.
//! - **The command connects natively.** `herdless run` tells the broker
//!   the process id of its command ([`crate::broker::Stopper::command_started`];
//!   a make that starts its own broker names itself). When a native client
//!   of that process id says hello (a make with herdless inside, `herdless
//!   exec`, a nested `herdless run`), or a make with herdless inside that
//!   the command started through a wrapper that forks (`timeout`, `time`,
//!   `unshare --fork`: a runner whose recipe root is the command), the
//!   broker calls [`Bridge::command_is_native`]: unless a classic client
//!   was already seen at work, the back-off starts at 1, so the bridge
//!   relies on its back-off from the first ignored offer instead of
//!   assuming a reader up front. Stock sub-makes, cargo or gcc below a native make still get
//!   offers, within the back-off's bound.
//! - **A classic client is seen at work**: fewer bytes in the pipe than the
//!   bridge put there (an offer was read), or a token written back. The
//!   back-off drops to 0 at each such sign, whatever the command is.
//!
//! Which `MAKEFLAGS` syntax to write (`-J` for bmake, `--jobserver-auth`
//! for the rest) is a different question, answered before anything runs:
//! `herdless run` guesses it from the command's name unless `--flavor`
//! says. `status` reports what the bridge learnt ([`ClassicStatus`]:
//! `command_native`, `classic_seen`, `backoff`).
//!
//! # The shared table
//!
//! Where the broker has a shared token table (`crate::fast`), native
//! clients take, give back and wait for tokens there without a message to
//! the broker, which then sees neither their grants nor their waits. The
//! table holds the pool's free tokens only while the classic side is
//! *dormant* (the command connected natively, no classic client has been
//! seen at work) and the bridge holds nothing but the standing offer: no
//! other token in the pipe, no request in the pool's queue. An offer made
//! for waiting natives is out with the table half-open, where a release
//! is a broker event again and the rules above hold as they are:
//!
//! - the broker sees no grant or wait in the open table, so the table's
//!   notify word counts takes and waits there down to the next offer's
//!   due point, and the client that reaches it tells the broker (one
//!   message): natives busy in the table wake the broker about once per
//!   offer;
//! - an offer that is due is asked for in the pool's queue, as above,
//!   whether natives wait or not: a free word left in the table is taken
//!   back for it; otherwise the ask half-opens the table and takes the
//!   next token given back there, ahead of the waits in the table, which
//!   stay where they are. While an offer made for them is out, the table
//!   stays half-open: its clients give back to the broker, which hands
//!   each token to the oldest waiter in the table itself (nobody is moved
//!   to the pool's queue, to be granted over the socket). An offer made
//!   while no native waits is
//!   a *standing offer*: the table opens again with the rest of the free
//!   pool, and its notify word asks for the first wait that starts there
//!   (takes are not told), so natives that find a free word cost the
//!   broker nothing; the first native that waits, in the table or at the
//!   broker, has the offer taken back, and the back-off grows;
//! - once the offer is taken back, the table opens again; an offer still
//!   unread when no native waits any more stays as the standing offer.
//!
//! A classic client that reads an offer wakes the classic side for good:
//! the table stays closed from then on. With a table the pipe is shrunk to
//! one buffer where the OS allows (Linux, as for a backed pool), so the
//! broker wakes when a reader empties it: a stock make that took the
//! standing offer and gave it back before the broker looked again would
//! otherwise show no change in the pipe's count, and the classic side
//! would be fed one offer at a time.

//! # Backed pools
//!
//! When the pool's tokens are borrowed from an outer jobserver
//! ([`crate::backing`]: `herdless run` in a make recipe), a token in the
//! pipe is one the outer build cannot use, so the pipe never holds more
//! than one ([`Bridge::set_backed`]). While natives wait, the offer rules
//! above apply unchanged. While none waits, the whole free pool does *not*
//! go to the pipe: one *standing offer* is kept there, and only while the
//! classic side is live: a classic client was seen taking or returning a
//! token, or no native client has connected yet (the command may be a
//! stock make, or a script that starts one: the first offer finds out).
//! Until a classic client is seen, that offer is on trial: left unread
//! for [`OFFER_WAIT`] it goes back to the outer jobserver, and the next
//! one waits for the back-off's time, as many [`OFFER_WAIT`]s as the
//! rounds of the table's mode (so a command that reads nothing, a
//! script, holds no outer token idle for its whole run).
//! Where the OS allows (Linux), the pipe is shrunk to one buffer, so a
//! description opened for writing becomes writable, edge-triggered,
//! exactly when a reader takes the last byte: the broker wakes and the
//! next offer follows at once, and an inner make reaches the inner `-j` as
//! fast as it reads.
//!
//! # Liveness
//!
//! While a native client waits, no token stays free, in the pool or unread
//! in the pipe, for longer than a bounded number of broker events: a free
//! pool token goes to the first waiter at once (the pool's own invariant),
//! and the one offer in the pipe stays there only while some native client
//! holds a token without waiting for another — so a broker event, its
//! release, is still to come — and until a round of native grants has
//! come and it is [`OFFER_MIN`] old, or for [`OFFER_WAIT`], whichever ends
//! first (the broker wakes at either time without another event).
//! When no such native holder is left, the offer is taken back in the same
//! event. What the classic side holds never keeps an offer in the pipe: a
//! classic job may run for a long time, or its holder may have died with
//! the token, and the classic protocol tells the broker neither.
//!
//! What the classic protocol cannot do: a classic client killed while
//! holding tokens takes them with it (no connection to close), and every
//! classic reader blocked on the pipe may be woken by each write (the herd
//! herdless removes for native clients). At exit the bridge drains both
//! FIFOs and reports the tokens that never came back.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::classic::{Auth, Flavor, Jobserver, Style};
use crate::client::{classic_env_value, CLASSIC_ENV};
use crate::fast::Notify;
use crate::log;
use crate::log::Level;
use crate::pool::{ClientId, ClientInfo, Pool};
use crate::protocol::AbortReason;
use crate::status::ClassicStatus;

/// The token byte. GNU make writes back whatever it read; bmake uses `+`.
const TOKEN: u8 = b'+';

/// How a byte came back from the classic side.
#[derive(Clone, Copy)]
enum How {
    /// Written to the returns FIFO by a classic client.
    Returned,
    /// Read back out of the offers pipe by the bridge.
    TakenBack,
}

/// What the broker's shared token table says, for [`Bridge::balance`].
#[derive(Clone, Copy, Debug, Default)]
pub struct TableView {
    /// Natives waiting in the table.
    pub waiting: usize,
    /// Natives holding a token of the table that wait neither in it nor
    /// at the broker.
    pub holders_not_waiting: usize,
    /// The table's own client of the pool, which holds the tokens lent to
    /// the table (whoever holds them there).
    pub client: Option<crate::pool::ClientId>,
}

struct Offer {
    native_grants_at: u64,
    patience: u64,
    /// When it went into the pipe.
    made_at: std::time::Duration,
}

/// How long an offer made while natives wait stays in the pipe unread
/// before it counts as ignored, however few native grants came meanwhile:
/// a classic reader blocked on the pipe takes it at once, and the natives'
/// grants may not come for a long time (a holder keeping its tokens, as a
/// top make does for its sub-makes, and waiters that nothing else frees).
pub const OFFER_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// The least time an offer made while natives wait stays in the pipe
/// unread before its round of native grants can count it as ignored: a
/// classic reader that the offer wakes needs a processor before the
/// broker reads the token back, and natives that contend without pause
/// make a round of grants in tens of microseconds, less than the time a
/// busy scheduler takes to run a woken process. The liveness rule (no
/// native release to come) still takes an offer back at once.
pub const OFFER_MIN: std::time::Duration = std::time::Duration::from_millis(2);

/// A round of native grants: one per waiter, but no more than there are
/// tokens, since a classic reader that wants an offer takes it at once and
/// a long native queue must not leave it idle for long.
fn round(pool: &Pool, natives_waiting: u64) -> u64 {
    natives_waiting.min(u64::from(pool.capacity())).max(1)
}

/// Fewer tokens than this fit one pipe buffer (a page of 4 KiB, one byte
/// per token, bytes written one after another sharing it).
const ONE_BUFFER_TOKENS: u32 = 4096;

/// The most doublings of the gap between offers nobody reads.
pub const MAX_BACKOFF: u32 = 4;

/// The classic bridge. Made by [`Bridge::create`]; the broker drives it.
pub struct Bridge {
    style: Style,
    flavor: Flavor,
    jobs: u32,
    offers_path: PathBuf,
    /// `(st_dev, st_ino)` of the offers FIFO: which jobserver this is.
    id: (u64, u64),
    returns_path: Option<PathBuf>,
    /// The broker's own non-blocking read-write description of `offers`.
    offers: File,
    /// The broker's own non-blocking description of `returns` (pipe style).
    returns: Option<File>,
    /// Blocking descriptions for the command to inherit (pipe style).
    child_ends: Option<(File, File)>,
    client: Option<ClientId>,
    queued: bool,
    offer: Option<Offer>,
    /// Tokens the bridge believes are in the pipe; fewer means classic
    /// clients took some.
    expected_in_pipe: u32,
    backoff: u32,
    /// The native grants after which the next offer is due
    /// ([`Bridge::offer_allowed`]).
    next_offer_at: u64,
    /// The time after which, while no native waits, the next offer is due
    /// however few native grants came: a make with nothing left to start
    /// makes none, and must not keep a free token from a classic reader
    /// for good.
    next_offer_time: std::time::Duration,
    /// When [`Bridge::balance`] last ran.
    balanced_at: std::time::Duration,
    /// The native grants counted at the last [`Bridge::balance`].
    grants_seen: u64,
    /// Natives waiting in the shared table at the last
    /// [`Bridge::balance`].
    table_waiting: usize,
    /// Natives waiting, in the pool's queue or the table, at the last
    /// [`Bridge::balance`] that counted them.
    natives_waiting_seen: usize,

    /// The command at the top connected to the broker as a native client.
    command_native: bool,
    /// A classic client was seen at work: it read an offer or wrote a
    /// token back.
    classic_seen: bool,
    aborted: Option<AbortReason>,
    offered: u64,
    returned: u64,
    taken_back: u64,
    /// Bytes written by classic clients that were not tokens they held.
    stray: u64,
    lost: u32,
    /// The pool's tokens are borrowed from an outer jobserver (see
    /// [`Bridge::set_backed`]).
    backed: bool,
    /// A backed pool's standing offer made before any classic client was
    /// seen: when it went into the pipe. Unread for [`OFFER_WAIT`], it goes
    /// back to the outer jobserver and the next one waits for the
    /// back-off's time.
    speculative_at: Option<std::time::Duration>,
    /// When the broker must look at a backed pool's speculative standing
    /// offer again: its expiry, or the time the next one is due.
    speculative_due: Option<std::time::Duration>,
    /// The broker has a shared token table, which takes the free pool
    /// while the classic side is dormant (see [`Bridge::set_table`]).
    table: bool,
    /// A write-only description of `offers`, on a pipe of one buffer:
    /// writable again, edge-triggered, when a reader takes the last byte.
    drained: Option<File>,
}

fn mkfifo(path: &Path) -> io::Result<()> {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!("cannot make FIFO {}: {e}", path.display()),
        )
    })
}

fn open_private(path: &Path) -> io::Result<File> {
    // Read-write, so the broker's description never sees end-of-file or a
    // broken pipe, and opening never blocks.
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))
}

impl Bridge {
    /// Makes the FIFOs in `dir` (the broker's private directory) for `-j
    /// jobs`. The bridge starts out assuming that the command may read the
    /// pipe (see "Who reads the pipe" in the module docs).
    ///
    /// # Errors
    ///
    /// Making or opening a FIFO (out of inodes or descriptors, say): what
    /// it made is removed again, so the directory can go.
    pub fn create(dir: &Path, style: Style, flavor: Flavor, jobs: u32) -> io::Result<Bridge> {
        if style == Style::Fifo && flavor == Flavor::Bmake {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bmake does not read fifo: jobservers; use --style pipe",
            ));
        }
        let offers_path = dir.join(match style {
            Style::Pipe => "offers.fifo",
            Style::Fifo => "jobserver.fifo",
        });
        let made = Bridge::make(dir, style, flavor, jobs, offers_path.clone());
        if made.is_err() {
            let _ = std::fs::remove_file(&offers_path);
            if style == Style::Pipe {
                let _ = std::fs::remove_file(dir.join("returns.fifo"));
            }
        }
        made
    }

    fn make(
        dir: &Path,
        style: Style,
        flavor: Flavor,
        jobs: u32,
        offers_path: PathBuf,
    ) -> io::Result<Bridge> {
        mkfifo(&offers_path)?;
        let offers = open_private(&offers_path)?;
        let meta = offers.metadata()?;
        let id = (meta.dev(), meta.ino());
        let (returns_path, returns, child_ends) = match style {
            Style::Fifo => (None, None, None),
            Style::Pipe => {
                let path = dir.join("returns.fifo");
                mkfifo(&path)?;
                let returns = open_private(&path)?;
                // The command's own descriptions, as each make makes its
                // pipe: blocking for GNU make (older versions fail on
                // EAGAIN), non-blocking for bmake (its sub-makes read
                // without polling first and would otherwise hang). Both
                // read-write, as each end of a make's own pipe is held by
                // a process that holds the other: a client that outlives
                // the broker (a sub-make left in the background, a top
                // make killed) then finds R empty rather than at its end,
                // which a make's poll loop would see as readable for
                // good, and writes to W without a broken pipe, which
                // kills it; it goes on with the tokens it holds, its own
                // implicit one at least.
                let flags = match flavor {
                    Flavor::Gnu => 0,
                    Flavor::Bmake => libc::O_NONBLOCK,
                };
                let r = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(flags)
                    .open(&offers_path)?;
                let w = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(flags)
                    .open(&path)?;
                (Some(path), Some(returns), Some((r, w)))
            }
        };
        Ok(Bridge {
            style,
            flavor,
            jobs,
            offers_path,
            id,
            returns_path,
            offers,
            returns,
            child_ends,
            client: None,
            queued: false,
            offer: None,
            expected_in_pipe: 0,
            backoff: 0,
            command_native: false,
            classic_seen: false,
            next_offer_at: 0,
            next_offer_time: std::time::Duration::ZERO,
            balanced_at: std::time::Duration::ZERO,
            grants_seen: 0,
            table_waiting: 0,
            natives_waiting_seen: 0,

            aborted: None,
            offered: 0,
            returned: 0,
            taken_back: 0,
            stray: 0,
            lost: 0,
            backed: false,
            speculative_at: None,
            speculative_due: None,
            table: false,
            drained: None,
        })
    }

    /// The descriptors the command must inherit (pipe style), without
    /// close-on-exec; `None` for the fifo style, and once taken. The
    /// bridge keeps no copy (its own descriptions of the FIFOs are
    /// read-write), so a broker inside a make spends two descriptors on
    /// them, not four. Drop them once the command is spawned.
    pub fn take_inheritable_fds(&mut self) -> io::Result<Option<(OwnedFd, OwnedFd)>> {
        let Some((r, w)) = self.child_ends.take() else {
            return Ok(None);
        };
        let (r, w) = (OwnedFd::from(r), OwnedFd::from(w));
        for fd in [&r, &w] {
            nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
            )
            .map_err(io::Error::from)?;
        }
        Ok(Some((r, w)))
    }

    /// Where classic clients find the tokens: the FIFO's path (fifo style),
    /// or the descriptors `fds` the command inherits (pipe style, from
    /// [`Bridge::take_inheritable_fds`]).
    ///
    /// # Panics
    ///
    /// In pipe style without `fds`.
    pub fn auth(&self, fds: Option<(RawFd, RawFd)>) -> Auth {
        match (self.style, fds) {
            (Style::Fifo, _) => Auth::Fifo(self.offers_path.clone()),
            (Style::Pipe, Some((read, write))) => Auth::Fds { read, write },
            (Style::Pipe, None) => panic!("pipe style exports descriptors"),
        }
    }

    /// `(st_dev, st_ino)` of the FIFO classic clients read, as
    /// [`CLASSIC_ENV`] tells the broker's clients. In fifo style it is the
    /// identity [`Jobserver::identity`] finds for what [`Bridge::auth`]
    /// names; in pipe style the two descriptors are two FIFOs, which name
    /// no identity there (on Linux), so the broker's own pipe never counts
    /// as a make between.
    pub fn id(&self) -> (u64, u64) {
        self.id
    }

    /// The environment to export, given the inherited descriptors (pipe
    /// style) and the command's current `MAKEFLAGS`, whose content is kept
    /// (the jobserver flags are appended, and the last ones win), and
    /// [`CLASSIC_ENV`], which tells the broker's clients that this
    /// jobserver is the broker's own.
    pub fn env(
        &self,
        fds: Option<(RawFd, RawFd)>,
        makeflags: Option<&OsStr>,
    ) -> Vec<(&'static str, OsString)> {
        let flags =
            Jobserver::new(self.auth(fds), self.flavor, Some(self.jobs)).makeflags(makeflags);
        let mut env = vec![
            ("MAKEFLAGS", flags.clone()),
            (CLASSIC_ENV, classic_env_value(self.id).into()),
        ];
        if self.flavor == Flavor::Gnu {
            env.push(("CARGO_MAKEFLAGS", flags));
        }
        env
    }

    /// Serves a pool whose shared tokens are borrowed from an outer
    /// jobserver on demand (see [`crate::backing`]): a token put into the
    /// pipe is one the outer build cannot use, so the pipe never holds
    /// more than one (see *Backed pools* in the module documentation).
    /// Where the OS allows (Linux), the pipe is shrunk to one buffer and
    /// [`Bridge::drained_fd`] tells the broker the moment a classic client
    /// reads the offer, so the next one follows at once.
    pub fn set_backed(&mut self) -> io::Result<()> {
        self.backed = true;
        self.watch_drain()
    }

    /// Shrinks the pipe to one buffer, where the OS allows (Linux), and
    /// opens [`Bridge::drained_fd`]: the broker then wakes when a classic
    /// client takes the last token from the pipe.
    fn watch_drain(&mut self) -> io::Result<()> {
        if self.drained.is_none() && herdless_platform::pipe_one_buffer(self.offers.as_fd())? {
            self.drained = Some(
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&self.offers_path)?,
            );
        }
        Ok(())
    }

    /// When the offer in the pipe, if any, counts as ignored for its age
    /// ([`OFFER_WAIT`], or [`OFFER_MIN`] once its round of native grants
    /// came): the broker balances again then, with no other event to wake
    /// it.
    ///
    /// In [`table_mode`](Self::table_mode) with nothing in the pipe, also
    /// when the next offer is due by time ([`Bridge::back_off`]): the
    /// broker sees no grant or release in the open table that would
    /// otherwise bring it there. With no native waiting it makes the
    /// standing offer then; with natives waiting it makes none (their
    /// grants count), but from then on asks the table to tell it of the
    /// first give-back that leaves a word free ([`Bridge::notify`]), when
    /// they stop waiting. Only a time still ahead of the last
    /// [`Bridge::balance`] counts, which acted on any before it.
    pub fn offer_deadline(&self) -> Option<std::time::Duration> {
        let unread = self
            .offer
            .as_ref()
            .filter(|_| self.expected_in_pipe > 0)
            .map(|o| {
                // Its round of grants already came: only its least age
                // keeps it there.
                let rounds_done = self.grants_seen.saturating_sub(o.native_grants_at) >= o.patience;
                o.made_at + if rounds_done { OFFER_MIN } else { OFFER_WAIT }
            });
        let due = Some(self.next_offer_time).filter(|&t| {
            t > self.balanced_at && self.table_mode() && !self.queued && self.expected_in_pipe == 0
        });
        let speculative = self.speculative_due.filter(|_| self.aborted.is_none());
        unread.into_iter().chain(due).chain(speculative).min()
    }

    /// The descriptor to watch, edge-triggered, for writability: the pipe
    /// was emptied by a classic reader (backed pools on Linux).
    pub fn drained_fd(&self) -> Option<RawFd> {
        self.drained.as_ref().map(|f| f.as_raw_fd())
    }

    /// Whether a backed pool keeps a standing offer in the pipe: classic
    /// clients were seen at work, or no native client has connected yet
    /// (the command may be a stock make, or start one; the first offer
    /// finds out).
    /// The broker has a shared token table (`crate::fast`): while the
    /// classic side is dormant the free pool goes to the table, not the
    /// pipe (see *The shared table* in the module documentation).
    ///
    /// With a table, the pipe is watched for the moment a classic client
    /// empties it (as for a backed pool): the standing offer that a
    /// classic client reads, and gives back before the broker looks
    /// again, shows no change in the pipe's count, and the classic side
    /// would stay dormant, fed one offer at a time. Not for a pipe that
    /// may have to hold more tokens than one buffer does.
    ///
    /// # Errors
    ///
    /// Opening the pipe again for the watch.
    pub fn set_table(&mut self, yes: bool) -> io::Result<()> {
        self.table = yes;
        if yes && self.jobs < ONE_BUFFER_TOKENS {
            self.watch_drain()?;
        }
        Ok(())
    }

    /// Whether the table may take the free pool: there is one and the
    /// classic side is dormant (the command is a native client, and no
    /// classic client has been seen at work).
    pub fn table_mode(&self) -> bool {
        self.table && self.command_native && !self.classic_seen && self.aborted.is_none()
    }

    /// Whether the shared table may be open now: in
    /// [`table_mode`](Self::table_mode), with nothing asked for in the
    /// pool and nothing in the pipe but the standing offer. An offer made
    /// for waiting natives is out with the table half-open, where every
    /// release is a broker event again ([`offer_out_to_waiters`]); the
    /// standing offer
    /// leaves it open, and the first wait in it tells the broker
    /// ([`notify`](Self::notify)), which takes the offer back for it.
    ///
    /// [`offer_out_to_waiters`]: Self::offer_out_to_waiters
    pub fn leaves_pool_to_table(&self, pool: &Pool) -> bool {
        self.table_mode() && !self.queued && (self.held(pool) == 0 || self.standing_offer_out(pool))
    }

    /// The natives waiting in the shared table at the last
    /// [`balance`](Self::balance).
    pub fn table_waiting_seen(&self) -> usize {
        self.table_waiting
    }

    /// Whether the bridge's ask for an offer waits in the pool's queue.
    pub fn offer_queued(&self) -> bool {
        self.queued
    }

    /// Whether the one token out is an offer made for waiting natives, in
    /// [`table_mode`](Self::table_mode), unread: the table stays
    /// half-open meanwhile, its clients give back to the broker, and the
    /// broker hands what they give back to the oldest waiter in the table
    /// itself (a release is then a broker event, as the offer's rules
    /// need, and the first wait that starts tells it too).
    pub fn offer_out_to_waiters(&self, pool: &Pool) -> bool {
        self.table_mode()
            && !self.queued
            && self.offer.is_some()
            && self.expected_in_pipe == 1
            && self.held(pool) == 1
    }

    /// Tokens the classic side holds in the pool's books: in the pipe, or
    /// taken from it.
    fn held(&self, pool: &Pool) -> u32 {
        self.client.map_or(0, |id| pool.held_by(id).unwrap_or(0))
    }

    /// Whether the one token out is the standing offer: put into the pipe
    /// while no native waited, in [`table_mode`](Self::table_mode), and
    /// still there.
    pub fn standing_offer_out(&self, pool: &Pool) -> bool {
        self.table_mode()
            && !self.queued
            && self.offer.is_none()
            && self.expected_in_pipe == 1
            && self.held(pool) == 1
    }

    /// In [`table_mode`](Self::table_mode), whether the next
    /// [`balance`](Self::balance) asks for an offer in the pool's queue
    /// (`native_grants` counted as there): the broker first takes a free
    /// word of the table back for it, when there is one; otherwise the ask
    /// goes ahead of the natives waiting in the table, who stay there.
    /// `natives_waiting`: natives waiting in the pool's queue and in the
    /// table.
    pub fn offer_due(
        &self,
        native_grants: u64,
        natives_waiting: usize,
        now: std::time::Duration,
    ) -> bool {
        self.table_mode()
            && !self.queued
            && self.expected_in_pipe == 0
            && self.offer_allowed(native_grants, natives_waiting == 0, now)
    }

    /// When the broker should hear of takes and waits in the open shared
    /// table (`crate::fast`'s notify word): with the standing offer out,
    /// at the first wait; otherwise, in [`table_mode`](Self::table_mode),
    /// when the next offer is due (counted in takes and waits, for
    /// grants: natives that contend in the table wake the broker about
    /// once per offer), and, while natives wait, also at the first
    /// give-back that leaves a word free: the natives then stop waiting
    /// with no event the broker sees, and a classic reader waiting
    /// meanwhile would find no standing offer, nor a deadline for one,
    /// until the broker woke for something else; never otherwise.
    pub fn notify(&self, pool: &Pool) -> Notify {
        if self.standing_offer_out(pool) {
            return Notify::FirstWait;
        }
        if !self.table_mode() || self.expected_in_pipe > 0 || self.queued {
            return Notify::Never;
        }
        let after =
            u32::try_from(self.next_offer_at.saturating_sub(self.grants_seen)).unwrap_or(u32::MAX);
        // Only once the back-off's time allows the standing offer the
        // notice would bring; until then the broker wakes at that time
        // ([`Bridge::offer_deadline`]) and asks again.
        if self.natives_waiting_seen > 0 && self.balanced_at >= self.next_offer_time {
            Notify::AfterOrFree(after)
        } else {
            Notify::After(after)
        }
    }

    /// Brings the pipe to `keep` tokens (0 or 1; `in_pipe` there now):
    /// takes the surplus back, or asks for the one missing, in the queue
    /// when none is free.
    fn keep_in_pipe(&mut self, pool: &mut Pool, in_pipe: u32, keep: u32, now: std::time::Duration) {
        let Some(id) = self.client else {
            return;
        };
        let mut in_pipe = in_pipe;
        if in_pipe > keep {
            in_pipe -= self.take_back(pool, in_pipe - keep, now);
        }
        if in_pipe < keep && !self.queued {
            if pool.free() > 0 {
                let _ = pool.try_acquire(id);
            } else if pool.acquire(id, now).is_ok() {
                self.queued = true;
            }
        }
    }

    fn standing_offer(&self, pool: &Pool) -> bool {
        self.classic_seen || pool.external_connections() == 0
    }

    /// A backed pool's standing offer while no classic client has been
    /// seen (the command may be one that has not read yet, or read
    /// nothing at all: a script): 1 to keep one in the pipe, 0 to have
    /// none. Each one is a token the outer build cannot use, so one left
    /// unread for [`OFFER_WAIT`] goes back and the next waits for the
    /// back-off's time (doubling up to [`MAX_BACKOFF`]), as in the shared
    /// table's mode: a command that never reads holds an outer token a
    /// sixteenth of the time at most, not for its whole run, and one
    /// that reads late finds a token within the longest gap (0.75 s).
    fn speculative_offer(&mut self, in_pipe: u32, now: std::time::Duration) -> u32 {
        if in_pipe > 0 {
            let at = *self.speculative_at.get_or_insert(now);
            if now < at + OFFER_WAIT {
                self.speculative_due = Some(at + OFFER_WAIT);
                return 1;
            }
            self.speculative_at = None;
            self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
            self.next_offer_time = now + OFFER_WAIT * ((1u32 << self.backoff) - 1);
            self.speculative_due = Some(self.next_offer_time);
            return 0;
        }
        self.speculative_at = None;
        if now >= self.next_offer_time {
            return 1;
        }
        self.speculative_due = Some(self.next_offer_time);
        0
    }

    /// Joins the pool as the `classic` client.
    pub fn attach(&mut self, pool: &mut Pool) {
        let id = pool.connect(ClientInfo {
            pid: std::process::id(),
            borrows: None,
            observer: false,
            label: "classic",
            internal: true,
        });
        self.client = Some(id);
    }

    /// Takes one unread token back out of the pipe for a native client
    /// that will not wait (a try-acquire), so a token no classic client
    /// has read is not refused to it. Returns whether one came back.
    pub fn reclaim_one(&mut self, pool: &mut Pool, now: std::time::Duration) -> bool {
        if self.aborted.is_some() || self.in_pipe() == 0 {
            return false;
        }
        self.take_back(pool, 1, now) == 1
    }

    /// Re-reads how many tokens sit in the pipe (noting whether classic
    /// clients took some), before anything else changes it.
    pub fn refresh(&mut self) {
        let in_pipe = self.in_pipe();
        if in_pipe < self.expected_in_pipe {
            self.classic_active();
        }
        self.expected_in_pipe = in_pipe;
    }

    /// Tokens believed to sit unread in the pipe, as of the last
    /// rebalance and the bridge's own writes and reads since.
    pub fn in_pipe_estimate(&self) -> u32 {
        self.expected_in_pipe
    }

    /// The bridge's client id in the pool.
    pub fn client(&self) -> Option<ClientId> {
        self.client
    }

    /// The descriptors the broker watches for readability.
    pub fn watched_fds(&self) -> (RawFd, Option<RawFd>) {
        (
            self.offers.as_raw_fd(),
            self.returns.as_ref().map(|f| f.as_raw_fd()),
        )
    }

    fn in_pipe(&self) -> u32 {
        herdless_platform::bytes_readable(self.offers.as_fd())
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
            .unwrap_or(0)
    }

    /// Writes one granted token into the pipe (the pool has already
    /// counted it as the bridge's). `waited`: the grant answered the
    /// bridge's queued request.
    pub fn on_grant(
        &mut self,
        pool: &mut Pool,
        waited: bool,
        native_grants: u64,
        now: std::time::Duration,
    ) {
        if waited {
            self.queued = false;
        }
        let id = self.client.expect("attached");
        match (&self.offers).write(&[TOKEN]) {
            Ok(1) => {
                self.offered += 1;
                self.expected_in_pipe += 1;
                // With natives waiting this token is the classic side's
                // offer; otherwise it is just the pipe filling up, which the
                // natives may take back as soon as they wait.
                let waiting = pool.waiting_grantable(Some(id)) as u64 + self.table_waiting as u64;
                // A grant the bridge waited for in the queue is an offer
                // too: natives that queued ahead of it, or that it went
                // ahead of in the shared table, may all hold a token by
                // now, and wait again at once.
                self.offer = (waiting > 0 || waited).then_some(Offer {
                    native_grants_at: native_grants,
                    patience: round(pool, waiting),
                    made_at: now,
                });
                if self.backed && !self.classic_seen && self.offer.is_none() {
                    self.speculative_at = Some(now);
                }
            }
            other => {
                log!(
                    Level::Warn,
                    "cannot put a token into the jobserver pipe: {other:?}"
                );
                let _ = pool.release(id, now);
            }
        }
    }

    /// Reads the tokens classic clients gave back (pipe style) and returns
    /// them to the pool; an abort token (bmake) aborts the tree.
    pub fn on_returns(&mut self, pool: &mut Pool, now: std::time::Duration) {
        let Some(returns) = &self.returns else {
            return;
        };
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            match (&*returns).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        if !got.is_empty() {
            self.classic_active();
        }
        for b in got {
            self.take_in(pool, b, now, How::Returned);
        }
    }

    /// Accounts for one byte read from the classic side.
    fn take_in(&mut self, pool: &mut Pool, byte: u8, now: std::time::Duration, how: How) {
        let id = self.client.expect("attached");
        if self.flavor == Flavor::Bmake && byte != TOKEN {
            let reason = AbortReason::from_byte(byte).unwrap_or(AbortReason::Error);
            if pool.abort(reason) {
                log!(Level::Info, "a bmake posted an abort token ({reason})");
            } else {
                // Another make read the stopper and put it back: keep it in
                // the pipe for the next one.
                self.write_stopper(reason);
            }
            return;
        }
        let tokens = pool.held_by(id).unwrap_or(0);
        // A return is a token only if a classic client is holding one: the
        // tokens on the classic side include those still unread in the pipe.
        let out_with_clients = match how {
            How::Returned => tokens.saturating_sub(self.in_pipe()),
            How::TakenBack => tokens,
        };
        if out_with_clients == 0 {
            self.stray += 1;
            if self.stray.is_power_of_two() {
                log!(
                    Level::Warn,
                    "a classic client wrote a token it never took (byte {byte:#04x}); \
                     ignored ({} such bytes so far)",
                    self.stray
                );
            }
            return;
        }
        match how {
            How::Returned => self.returned += 1,
            How::TakenBack => self.taken_back += 1,
        }
        let _ = pool.release(id, now);
    }

    /// Reads up to `n` bytes out of the pipe that are not tokens.
    fn discard(&mut self, n: u32) -> u32 {
        let mut got = 0;
        let mut byte = [0u8; 1];
        while got < n {
            match (&self.offers).read(&mut byte) {
                Ok(1) => got += 1,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => break,
            }
        }
        self.expected_in_pipe = self.expected_in_pipe.saturating_sub(got);
        if got > 0 {
            self.stray += u64::from(got);
            log!(
                Level::Warn,
                "{got} byte(s) in the jobserver FIFO were not tokens (written back by a \
                 client that never took them); removed"
            );
        }
        got
    }

    /// Takes up to `n` unread tokens back out of the pipe into the pool.
    fn take_back(&mut self, pool: &mut Pool, n: u32, now: std::time::Duration) -> u32 {
        let mut got = 0;
        let mut byte = [0u8; 1];
        while got < n {
            match (&self.offers).read(&mut byte) {
                Ok(1) => {
                    got += 1;
                    self.expected_in_pipe = self.expected_in_pipe.saturating_sub(1);
                    self.take_in(pool, byte[0], now, How::TakenBack);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // Empty: a classic client took it first.
                _ => break,
            }
        }
        got
    }

    /// Classic clients were seen at work: offer again at every turn.
    fn classic_active(&mut self) {
        let first = !self.classic_seen;
        if first {
            log!(
                Level::Debug,
                "classic: a classic client read or returned a token"
            );
        }
        self.classic_seen = true;
        self.backoff = 0;
        self.next_offer_at = 0;
        self.next_offer_time = std::time::Duration::ZERO;
        // The table will not take the free pool again: the pipe holds it,
        // and classic clients take and give back tokens while others stay
        // in it. On one buffer that never empties, a page's worth of such
        // turns would leave it full with a few bytes in it, and a client
        // blocked writing its token back (GNU make's FIFO) would wait for
        // good (herdless_platform::pipe_one_buffer).
        // (A pipe shrunk for a backed pool keeps its one buffer: its one
        // offer is read or taken back, so it empties.)
        if first && self.drained.is_some() && !self.backed {
            if let Err(e) = herdless_platform::pipe_default_size(self.offers.as_fd()) {
                log!(
                    Level::Warn,
                    "classic: cannot give the jobserver's pipe its size back ({e}); \
                     a client that keeps tokens in it may find it full"
                );
            }
        }
    }

    /// An offer nobody read: the next one waits for more rounds of
    /// native grants (doubling up to [`MAX_BACKOFF`]), or, while no native
    /// waits, as many [`OFFER_WAIT`]s, whichever comes first.
    fn back_off(
        &mut self,
        pool: &Pool,
        natives_waiting: usize,
        native_grants: u64,
        now: std::time::Duration,
    ) {
        self.backoff = (self.backoff + 1).min(MAX_BACKOFF);
        let rounds = (1u32 << self.backoff) - 1;
        self.next_offer_at =
            native_grants + round(pool, natives_waiting as u64) * u64::from(rounds);
        self.next_offer_time = now + OFFER_WAIT * rounds;
    }

    /// Whether the next offer is due: after its rounds of native grants,
    /// or, when no native waits (`idle`), its time, whichever comes first
    /// (see [`Bridge::back_off`]). Natives that wait are granted tokens as
    /// others are released, in the table too, and those grants count; an
    /// offer made by the clock while they contend would only send their
    /// releases through the broker for nothing more.
    fn offer_allowed(&self, native_grants: u64, idle: bool, now: std::time::Duration) -> bool {
        native_grants >= self.next_offer_at || (idle && now >= self.next_offer_time)
    }

    /// The broker saw the command at the top connect as a native client
    /// (a make with herdless inside, `herdless exec`, a nested `herdless
    /// run`): it takes its tokens from the broker, not from the pipe. Unless
    /// a classic client has already been seen at work, the bridge stops
    /// assuming a reader up front: the next ignored offer waits three
    /// rounds, not one, and the gaps double from there.
    pub fn command_is_native(&mut self) {
        if self.command_native {
            return;
        }
        self.command_native = true;
        if !self.classic_seen {
            self.backoff = self.backoff.max(1);
        }
        log!(
            Level::Debug,
            "classic: the command is a native client{}",
            if self.classic_seen {
                "; classic clients already at work"
            } else {
                ""
            }
        );
    }

    /// Rebalances the pool between native waiters and the pipe; called
    /// after every event the broker handles. `native_grants` counts grants
    /// to native clients so far.
    /// `table`: what the shared table says, which the pool does not see.
    pub fn balance(
        &mut self,
        pool: &mut Pool,
        native_grants: u64,
        table: TableView,
        now: std::time::Duration,
    ) {
        self.balanced_at = now;
        // Set again below only where a speculative offer is still to be
        // looked at: a deadline left from before an abort or a stop would
        // be in the past at every turn of the loop.
        self.speculative_due = None;
        let Some(id) = self.client else {
            return;
        };
        if self.aborted.is_some() || pool.aborted().is_some() {
            return;
        }
        if pool.stopped() {
            // In fifo style a classic client gives its token back into the
            // FIFO the others read: taken back at once, so that none of
            // them starts a job on it after the stop.
            self.take_back_unread(pool, now);
            return;
        }
        // Fewer tokens in the pipe than put there: classic clients took some.
        self.refresh();
        let mut in_pipe = self.expected_in_pipe;
        let tokens = pool.held_by(id).unwrap_or(0);
        if in_pipe > tokens {
            // More bytes than tokens (a client wrote back what it never
            // took, fifo style): read the surplus out so it cannot run jobs.
            in_pipe -= self.discard(in_pipe - tokens);
        }
        // Natives that a cap or an admission limit holds back do not
        // count: no grant comes to them meanwhile, and a classic reader
        // must not wait for one with tokens free.
        let natives_waiting = pool.waiting_grantable(Some(id)) + table.waiting;
        self.table_waiting = table.waiting;
        self.natives_waiting_seen = natives_waiting;
        self.grants_seen = native_grants;
        let table_mode = self.table_mode();
        if natives_waiting == 0 && table_mode {
            // The table takes the free pool: one standing offer while no
            // native waits, once the back-off allows: a free word the
            // broker took back from the table, or asked for in the pool's
            // queue (which half-opens the table).
            self.offer = None;
            let keep = u32::from(in_pipe > 0 || self.offer_allowed(native_grants, true, now));
            self.keep_in_pipe(pool, in_pipe, keep, now);
            return;
        }
        if natives_waiting == 0 && self.backed {
            // Nobody native is waiting, and every token is an outer one:
            // one standing offer at most, only for a live classic side.
            self.offer = None;
            let keep = if self.classic_seen {
                1
            } else if self.standing_offer(pool) {
                self.speculative_offer(in_pipe, now)
            } else {
                0
            };
            if keep == 0 && self.queued {
                let _ = pool.cancel(id);
                self.queued = false;
            }
            self.keep_in_pipe(pool, in_pipe, keep, now);
            return;
        }
        if natives_waiting == 0 {
            // Nobody native is waiting: the whole free pool goes to the pipe.
            self.offer = None;
            while pool.free() > 0 && !self.queued {
                // A denial (a load limit or a cap holds the token back)
                // leaves the token free: stop rather than ask again.
                let free = pool.free();
                if pool.try_acquire(id).is_err() || pool.free() == free {
                    break;
                }
            }
            return;
        }
        // Natives wait: keep at most the current offer in the pipe.
        if table_mode && self.offer.is_none() && in_pipe > 0 {
            // The standing offer, put there while no native waited: nobody
            // read it before a native wanted it. It comes back below;
            // the next waits for the back-off.
            self.back_off(pool, natives_waiting, native_grants, now);
        }
        let keep = match &self.offer {
            Some(o) if in_pipe > 0 => {
                let age = now.saturating_sub(o.made_at);
                let ignored = (native_grants.saturating_sub(o.native_grants_at) >= o.patience
                    && age >= OFFER_MIN)
                    || age >= OFFER_WAIT;
                // Liveness: the offer may wait for a classic reader only
                // while some native client holds a token without waiting
                // for another, so that its release, a broker event, is
                // still to come. What the classic side holds never counts:
                // the classic protocol cannot promise it comes back (a long
                // job, or a holder that died with it).
                // The shared table is half-open (or closed) while an offer
                // for waiting natives is out, so a release there is a
                // broker event too (its client tells the broker); its
                // holders count as they wait, not as the table's client,
                // which holds the words in the pool's books.
                let table_client = table
                    .client
                    .is_some_and(|t| pool.held_by(t).unwrap_or(0) > 0);
                let no_event_to_come = pool
                    .holders_not_waiting(id)
                    .saturating_sub(usize::from(table_client))
                    + table.holders_not_waiting
                    == 0;
                if ignored || no_event_to_come {
                    // Nobody read it: back off before the next offer.
                    self.back_off(pool, natives_waiting, native_grants, now);
                    self.offer = None;
                    0
                } else {
                    1
                }
            }
            _ => 0,
        };
        if in_pipe > keep {
            in_pipe -= self.take_back(pool, in_pipe - keep, now);
        }
        if in_pipe == 0 {
            self.offer = None;
            if !self.queued && self.offer_allowed(native_grants, false, now) {
                if pool.free() > 0 {
                    // Taken-back tokens went to natives; any left is ours.
                    let _ = pool.try_acquire(id);
                } else if pool.acquire(id, now).is_ok() {
                    self.queued = true;
                }
            }
        }
    }

    /// The tree aborted: with bmake, empty the pipe and leave the stopper
    /// token in it, as bmake itself does, so every make stops.
    pub fn on_abort(&mut self, pool: &mut Pool, reason: AbortReason, now: std::time::Duration) {
        self.queued = false;
        // No offer is taken back after this: none has a deadline.
        self.offer = None;
        self.aborted = Some(reason);
        let n = self.in_pipe();
        self.take_back(pool, n, now);
        if self.flavor == Flavor::Bmake {
            self.write_stopper(reason);
        } else {
            log!(
                Level::Info,
                "abort ({reason}): GNU make has no abort token; classic clients are not told"
            );
        }
    }

    /// The broker stopped granting: the tokens unread in the pipe come
    /// back, so no classic client starts a job after the stop.
    pub fn on_stop(&mut self, pool: &mut Pool, now: std::time::Duration) {
        self.queued = false;
        self.offer = None;
        self.take_back_unread(pool, now);
    }

    /// Takes every token unread in the pipe back into the pool.
    fn take_back_unread(&mut self, pool: &mut Pool, now: std::time::Duration) {
        self.refresh();
        let n = self.expected_in_pipe;
        if n > 0 {
            self.take_back(pool, n, now);
        }
    }

    fn write_stopper(&self, reason: AbortReason) {
        if let Err(e) = (&self.offers).write(&[reason.byte()]) {
            log!(Level::Warn, "cannot put the abort token into the pipe: {e}");
        }
    }

    /// At shutdown: drains both FIFOs, gives every token found back to the
    /// pool, and counts those that never came back as lost.
    pub fn drain(&mut self, pool: &mut Pool, now: std::time::Duration) {
        let Some(id) = self.client else {
            return;
        };
        self.on_returns(pool, now);
        let mut buf = [0u8; 512];
        loop {
            match (&self.offers).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    for &b in &buf[..n] {
                        let is_token = b == TOKEN || self.flavor == Flavor::Gnu;
                        if is_token && pool.held_by(id).unwrap_or(0) > 0 {
                            let _ = pool.release(id, now);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.lost = pool.held_by(id).unwrap_or(0);
        if self.lost > 0 {
            let why = match self.aborted {
                Some(_) if self.flavor == Flavor::Bmake => {
                    "a bmake posting an abort token empties the pipe first"
                }
                _ => "a classic client exited or was killed holding them",
            };
            log!(
                Level::Warn,
                "{} classic token(s) never came back ({why})",
                self.lost
            );
        }
        // Counted once, as lost (the report adds them), not also as taken
        // back from a client that died.
        pool.close_lost(id, now);
        self.client = None;
    }

    /// The classic side's figures.
    pub fn status(&self, pool: &Pool) -> ClassicStatus {
        let tokens = self.client.and_then(|id| pool.held_by(id)).unwrap_or(0);
        let in_pipe = if self.client.is_some() {
            self.in_pipe().min(tokens)
        } else {
            0
        };
        ClassicStatus {
            style: self.style.name().to_string(),
            flavor: self.flavor.name().to_string(),
            tokens,
            in_pipe,
            held: tokens - in_pipe,
            offered: self.offered,
            returned: self.returned,
            taken_back: self.taken_back,
            lost: self.lost,
            command_native: self.command_native,
            classic_seen: self.classic_seen,
            backoff: self.backoff,
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.offers_path);
        if let Some(p) = &self.returns_path {
            let _ = std::fs::remove_file(p);
        }
    }
}
