//! The broker: one thread, one mio loop, driving the [`Pool`] with sockets.
//!
//! Every readiness source is edge-triggered (mio's only mode): a source is
//! read until `WouldBlock`, a connection over as many turns as it takes
//! (see *Fairness and bounds*), or until a read shorter than asked, which
//! empties a stream socket (the next byte is a new edge) unless the peer
//! has closed its end. A grant is one frame written to one
//! client's socket, so exactly one process wakes per token. There is no
//! timer anywhere in the hand-off path: the loop sleeps in `epoll_wait` /
//! `kevent` and wakes only for I/O, a signal or a stop request (the
//! handshake deadline and the admission re-check are its only timeouts).
//!
//! # Failure handling
//!
//! - A peer of another uid, a malformed or oversized frame, a wrong protocol
//!   version, or a client that misuses the pool (releasing a token it does
//!   not hold) gets an `Error` frame with the reason; the broker logs the
//!   reason and closes that one connection. Its tokens return to the pool.
//! - A connection that closes for any reason (exit, crash, `kill -9`) gives
//!   back every token it held.
//! - `EMFILE`/`ENFILE` from `accept`: a reserve descriptor is released to
//!   accept the pending connection and tell it the broker is out of file
//!   descriptors, so the client sees an error at once instead of hanging;
//!   the clients already connected keep being served, and the loop does not
//!   spin: it accepts again when the listener signals or a connection
//!   closes. The refusal starts with `busy:` so the client retries.
//!
//! # Fairness and bounds
//!
//! Each wake-up gives every ready connection one *turn*: at most
//! [`READ_BUDGET`] requests (fewer when many connections are ready at once:
//! they share [`limits::ROUND_BUDGET`]) and [`READ_CHUNK`] bytes. A connection with more
//! to read queues for another turn after the others, and the loop polls
//! without sleeping until none is left, so one client flooding requests
//! cannot hold the loop. A connection is not read while its replies wait
//! unsent past [`OUTPUT_PAUSE`] or while a `Status` reply of its own waits,
//! so a client that does not read cannot grow the broker's memory. The other
//! bounds (handshakes, queued acquires, the status document) and what a
//! client sees at each are listed in [`limits`].
//!
//! The only timer is the handshake deadline: the loop sleeps with a timeout
//! only while some connection has not yet sent its `Hello`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{UnixListener, UnixStream};
use mio::{Events, Interest, Poll, Token, Waker};

use crate::backing::Backing;
use crate::bridge::Bridge;
use crate::log;
use crate::log::Level;
use crate::pool::{ClientId, ClientInfo, Effect, Pool, SlotKey};
use crate::protocol::{
    FrameBuffer, HelloFlags, ProtocolError, Reply, Request, BUSY_PREFIX, CONTROL_VERSION,
    FAST_VERSION, NO_ROOM_PREFIX, PROTOCOL_VERSION, TAKE_BACK_VERSION,
};
use crate::status::{ClientStatus, Status};

mod control;
pub use control::{Admission, SYSTEM_HOOK_ENV};

mod fast;

pub mod limits;

pub use limits::MAX_PENDING_ACQUIRES;
use limits::{
    HandshakeLog, Handshakes, Turns, ACCEPT_BUDGET, HANDSHAKE_DEADLINE, LISTEN_BACKLOG,
    MAX_HANDSHAKING, MAX_PENDING_OUTPUT, MAX_QUEUED_ACQUIRES, OUTPUT_PAUSE, READ_BUDGET,
    READ_CHUNK, TOTAL_OUTPUT_PAUSE,
};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
const SIGNALS: Token = Token(2);
const CLASSIC_OFFERS: Token = Token(3);
const CLASSIC_RETURNS: Token = Token(4);
/// The outer jobserver a backed pool borrows from has a byte to read.
const OUTER: Token = Token(5);
/// A classic client took the last token in the bridge's pipe.
const CLASSIC_DRAINED: Token = Token(6);
/// Turns each connection gets at the stop to have its last requests read
/// (see `Broker::read_what_was_sent`).
const STOP_TURNS: usize = 4;

const FIRST_CONN: usize = 16;
/// Set in the token of a connection's process-exit descriptor (its pidfd):
/// the rest of the bits are the connection's own token.
const EXIT_BIT: usize = 1 << (usize::BITS - 2);
/// Process-exit descriptors kept, registered, by connections that hold no
/// token at the moment: a client that takes and gives back tokens in turn
/// then costs no `pidfd_open`, `epoll_ctl` and `close` per grant. Past this
/// many, or when `accept` runs out of descriptors, they are closed on
/// release as before, so the broker never spends more than this many
/// descriptors beyond one per connection and one per holder.
const IDLE_EXIT_FDS: usize = 1024;

/// The largest `-j` a broker serves. More is no build's real limit, and
/// a stock make's own jobserver stalls well below it (its pipe fills).
pub const MAX_JOBS: u32 = 65536;

/// Checks a `-j` figure: 1 to [`MAX_JOBS`].
fn check_jobs(jobs: u32) -> io::Result<()> {
    if !(1..=MAX_JOBS).contains(&jobs) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("-j {jobs} is out of range (1 to {MAX_JOBS})"),
        ));
    }
    Ok(())
}

/// How a broker is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// The `-j` figure: at most this many jobs at once in the tree. The
    /// pool holds `jobs - 1` tokens; the last is the implicit token of the
    /// process at the top of the tree.
    pub jobs: u32,
    /// Stop cleanly on SIGINT and SIGTERM (for `herdless serve`). A broker
    /// embedded in `herdless run` leaves signals to its host.
    pub handle_signals: bool,
    /// Load and memory limits on granting shared tokens.
    pub admission: Admission,
    /// How long a new connection may take to send its `Hello` before it
    /// is closed ([`limits::HANDSHAKE_DEADLINE`] unless changed).
    pub handshake_deadline: Duration,
    /// Offer the shared token table to native clients that ask for it
    /// (protocol version 4, `crate::fast`), where the OS can make one and
    /// the pool is not backed by an outer jobserver; under a classic
    /// bridge it holds tokens only while the classic side is dormant. On
    /// unless `HERDLESS_FAST_PATH=0`.
    pub fast_path: bool,
}

/// The environment variable that turns the shared token table off: `0`
/// in a broker's environment offers it to nobody, in a client's makes the
/// client keep to the socket.
pub const FAST_PATH_ENV: &str = "HERDLESS_FAST_PATH";

/// Whether `HERDLESS_FAST_PATH` leaves the table on.
pub fn fast_path_wanted() -> bool {
    std::env::var_os(FAST_PATH_ENV).map_or(true, |v| v != "0")
}

impl Config {
    /// A broker for `-j jobs`, leaving signals alone.
    pub fn new(jobs: u32) -> Config {
        Config {
            jobs,
            handle_signals: false,
            admission: Admission::default(),
            handshake_deadline: HANDSHAKE_DEADLINE,
            fast_path: fast_path_wanted(),
        }
    }
}

/// A handle on a running broker from another thread: stops it, names
/// the command at the top, and sets how many descriptors it leaves free
/// for the process it runs in.
#[derive(Clone, Debug)]
pub struct Stopper {
    waker: Arc<Waker>,
    flag: Arc<AtomicBool>,
    halt: Arc<AtomicBool>,
    drain: Arc<AtomicBool>,
    command: Arc<AtomicU32>,
    keep_free: Arc<AtomicUsize>,
}

impl Stopper {
    /// Asks the broker to shut down; `Broker::run` then returns its report.
    /// No token is granted from the moment the broker sees the request.
    pub fn stop(&self) {
        self.halt.store(true, Ordering::SeqCst);
        self.flag.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Asks the broker to shut down once no job runner is connected: it
    /// serves as before until every connection that said hello as one and
    /// every connection still in its handshake (or in the listener's
    /// queue) has closed, then `Broker::run` returns its report. A job
    /// runner is any client whose hello names no runner's slot to borrow
    /// (neither `JOB` nor `RECIPE_JOB`), or says `RUNNER`, and is not an
    /// observer: a make (also one that borrows its recipe's slot as its
    /// implicit token), a client with an implicit token of its own, and a
    /// `herdless exec` that runs on the token its starter took for it.
    /// What a top-level make does before it exits, as stock GNU make reads
    /// its jobserver
    /// back until every process that opened it has closed it: a sub-make
    /// in the background still has its broker. Jobs that borrow a runner's
    /// slot are not waited for: their runner is, or is gone.
    pub fn stop_when_idle(&self) {
        self.drain.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Asks the broker to stop granting but keep serving: every waiting
    /// client is told at once that no token will come (`herdless exec`
    /// exits 125), later acquires are refused, tokens coming back are
    /// counted. `herdless run` calls this when a stop signal arrives, while
    /// its command may still be winding down.
    pub fn halt(&self) {
        self.halt.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Tells the broker the process id of the command at the top, once it
    /// is spawned: when that process connects as a native client (now or
    /// already), the classic bridge knows the command reads no pipe (see
    /// [`Bridge::command_is_native`]).
    pub fn command_started(&self, pid: u32) {
        self.command.store(pid, Ordering::SeqCst);
        self.wake();
    }

    /// A broker that runs in another program's process (a make that
    /// started it) shares that process's descriptor table, and the
    /// program needs its own share: a new client is accepted only while
    /// `n` descriptors stay free beyond the two it may cost (its socket and
    /// the process-exit descriptor of a holder). One turned away is told
    /// so ([`crate::protocol::NO_ROOM_PREFIX`]) and does not try again; a
    /// make then runs on the classic jobserver, which the bridge serves
    /// from the same pool. The command at the top is never turned away.
    /// 0 (the default) keeps none back.
    pub fn keep_fds_free(&self, n: usize) {
        self.keep_free.store(n, Ordering::SeqCst);
    }

    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            log!(Level::Error, "cannot wake the broker: {e}");
        }
    }
}

/// The recipe root a `RECIPE_JOB` hello stands for, in the broker's own
/// numbering of processes: `Some(Some(root))`, or `Some(None)` for a job
/// that no make's recipe holds (orphaned: it borrows no slot); `None` for
/// a hello that names no process.
///
/// `peer`: the client's process id as the broker sees it; `said`: the
/// one its hello gives; `slot`: the root it names. A client in another
/// PID namespace (the two ids differ, or it names root 0 because its own
/// view of the tree ends at that namespace's first process: see
/// `client::hello_elsewhere`) numbers processes as that namespace does,
/// so the broker finds the root itself, from the process table it sees:
/// the highest ancestor below a job runner. A client whose own parent is
/// the runner, and a runner that no recipe holds, get a slot of their
/// own: the token the make holds for it, or the implicit token a runner
/// started outside any recipe owns.
fn recipe_root(peer: Option<u32>, said: u32, slot: u64, flags: HelloFlags) -> Option<Option<u32>> {
    let named = u32::try_from(slot).ok().filter(|&root| root > 1);
    let Some(peer) = peer.filter(|&p| p != said || named.is_none()) else {
        return named.map(Some);
    };
    use crate::classic::slot::Owner;
    let table = herdless_platform::ProcessTable::read();
    let ps = |pid: u32| table.parent_and_name(pid);
    let (ppid, _) = ps(peer)?;
    // The client's environment, where a make with herdless inside names
    // itself, is not the broker's to read: runners by their names.
    Some(
        match crate::classic::slot::slot_owner(ppid, |_| false, ps) {
            Owner::Shared(root) if root > 1 => Some(root),
            Owner::Shared(_) => None,
            Owner::Own => Some(peer),
            Owner::Orphaned if flags.contains(HelloFlags::RUNNER) => Some(peer),
            Owner::Orphaned => None,
        },
    )
}

/// A fresh, unguessable slot id: 64 bits from the standard library's
/// randomly keyed hasher (seeded by the OS), never 0.
fn random_slot_id(counter: u64) -> u64 {
    use std::hash::BuildHasher;
    let id = std::collections::hash_map::RandomState::new().hash_one(counter);
    id.max(1)
}

struct Conn {
    stream: UnixStream,
    rx: FrameBuffer,
    tx: Vec<u8>,
    client: Option<ClientId>,
    /// From the kernel where it tells (SO_PEERCRED), else from the hello.
    pid: Option<u32>,
    /// Said hello as an observer (takes no tokens).
    observer: bool,
    /// Said hello as a job runner: a client with an implicit token of its
    /// own (a make), not a job of a runner, not an observer.
    runner: bool,
    /// Watched for writability: only while replies wait in `tx`, so a
    /// client reading its grant does not wake the broker again.
    watching_writes: bool,
    /// The protocol version agreed in the handshake.
    version: u16,
    /// Readable once the process that opened the connection has exited
    /// (a pidfd, Linux): its tokens come back then, even if a fork of it
    /// keeps the socket open. Held only while the connection holds tokens,
    /// so the broker spends one more descriptor per holder, not per client.
    exit_fd: Option<std::os::fd::OwnedFd>,
    /// `exit_fd` is kept while the connection holds no token (counted in
    /// `Broker::idle_exit_fds`).
    exit_fd_idle: bool,
    /// The kernel reported the peer's end of the socket closed (or an
    /// error): read it to the end. Otherwise a read shorter than asked
    /// means the socket is empty, and the next byte to arrive is a new
    /// edge, so the turn ends without the read that would fail `EAGAIN`.
    read_closed: bool,
    /// This connection's owner id in the shared table; 0 when it has none.
    fast_owner: u32,
    /// In `Broker::turns`, waiting for a turn.
    queued: bool,
    /// Not read until its replies drain (see [`Broker::reading_paused`]).
    paused: bool,
    /// Bytes at the front of `tx` up to the end of the last `Status` reply:
    /// while non-zero the connection is not read, so a client never has
    /// more than one status document in the broker.
    status_owed: usize,
    /// A write to the peer failed (it closed its end): what it sent before
    /// is still read, and nothing more is written to it.
    peer_gone: bool,
    /// The slot minted for this client's own job (its `Welcome.slot`); 0
    /// when it has none.
    own_slot: u64,
    /// A recipe job's hello read before the command at the top was named
    /// ([`Broker::expect_command`]): answered, and the connection read
    /// again, once it is.
    held_hello: Option<Request>,
}

impl Conn {
    /// Not yet past its hello: one held for the command's name was said
    /// in time, and is neither expired nor evicted.
    fn in_handshake(&self) -> bool {
        self.client.is_none() && self.held_hello.is_none()
    }
}

/// The broker. Build it with [`Broker::bind`], run it with [`Broker::run`].
pub struct Broker {
    poll: Poll,
    listener: UnixListener,
    conns: HashMap<Token, Conn>,
    by_client: HashMap<ClientId, Token>,
    next_token: usize,
    pool: Pool,
    config: Config,
    epoch: Instant,
    waker: Arc<Waker>,
    stop: Arc<AtomicBool>,
    halt: Arc<AtomicBool>,
    /// Stop once no job runner is connected ([`Stopper::stop_when_idle`]).
    drain: Arc<AtomicBool>,
    /// The process id of the command at the top, once known (0 before).
    command: Arc<AtomicU32>,
    /// Descriptors left free for the process the broker runs in
    /// ([`Stopper::keep_fds_free`]).
    keep_free: Arc<AtomicUsize>,
    /// Counts the process's open descriptors for [`Self::room_for`],
    /// without opening any (made when first needed).
    fd_count: Option<herdless_platform::DescriptorCount>,
    /// Clients turned away to keep them free.
    refused_no_room: u64,
    /// The command connected as a native client, and the bridge was told.
    command_native: bool,
    /// The command pid the connections were last searched for.
    command_looked: u32,
    /// A command at the top is being started and will be named
    /// ([`Broker::expect_command`]); while it is not, recipe jobs' hellos
    /// wait in `held`.
    command_expected: bool,
    /// Connections whose hello waits for the command's name.
    held: Vec<Token>,
    /// The slot of the command at the top: the N-th token of `-jN`.
    top_slot: u64,
    minted: u64,
    /// Connections told of the stop, closed once the effects are applied.
    closing: Vec<Token>,
    /// Connections granted a token whose process had already exited.
    dead: Vec<Token>,
    signals: Option<(UnixStream, Vec<signal_hook::SigId>)>,
    reserve: Option<File>,
    uid: u32,
    dirty: Vec<Token>,
    bridge: Option<Bridge>,
    /// The outer jobserver the shared tokens are borrowed from, if any.
    backing: Option<Backing>,
    native_grants: u64,
    /// Grants that woke a waiting native client: one process each.
    native_wakeups: u64,
    max_in_use: u32,
    /// Admission by load and memory, caps: see `broker/control.rs`.
    controls: control::State,
    turns: Turns,
    handshakes: Handshakes,
    /// Connections closed for their handshake, logged as counts.
    handshake_log: HandshakeLog,
    /// Unsent reply bytes over all connections.
    output_total: usize,
    /// A connection closed because a write to it failed, while replies
    /// were flushed: what it gave back is settled as after any event
    /// ([`Broker::settle_and_flush`]).
    closed_in_flush: bool,
    /// `accept` ran out of descriptors: try again when one is freed.
    accept_starved: bool,
    /// A connection closed since the last look.
    fd_freed: bool,
    /// The last turn of the listener left connections pending.
    accept_more: bool,
    /// Connections keeping their `exit_fd` while holding no token.
    idle_exit_fds: usize,
    /// The shared token table, when there is one (`broker/fast.rs`).
    fast: Option<fast::FastState>,
    /// Whether a table was made (its pool client is no connection).
    table_made: bool,
}

fn ns_to_us(ns: u64) -> f64 {
    (ns as f64 / 1000.0 * 10.0).round() / 10.0
}

impl Broker {
    /// Listens on `socket` (whose directory the caller has made private,
    /// see [`crate::rundir`]). A stale socket file left by a dead broker is
    /// replaced; a live one is an `AddrInUse` error. A `-j` of 0 or above
    /// [`MAX_JOBS`] is an `InvalidInput` error.
    pub fn bind(socket: &Path, config: Config) -> io::Result<Broker> {
        check_jobs(config.jobs)?;
        if let Ok(meta) = std::fs::symlink_metadata(socket) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not a socket", socket.display()),
                ));
            }
            if crate::rundir::connect(socket).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("a broker is already listening on {}", socket.display()),
                ));
            }
            // A socket nobody listens on: left by a broker that died.
            std::fs::remove_file(socket)?;
        }
        let listener = crate::rundir::bind(socket)
            .and_then(|l| {
                if let Err(e) = l.set_nonblocking(true) {
                    let _ = std::fs::remove_file(socket);
                    return Err(e);
                }
                Ok(UnixListener::from_std(l))
            })
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot listen on {}: {e}", socket.display()),
                )
            })?;
        // A second `listen` on a listening socket sets its queue length.
        let made = nix::sys::socket::listen(
            &listener,
            nix::sys::socket::Backlog::new(LISTEN_BACKLOG).expect("a valid backlog"),
        )
        .map_err(|e| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("cannot listen on {}: {e}", socket.display()),
            )
        })
        .and_then(|()| {
            Broker::on_listener(listener, config).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot set up the broker's event loop: {e}"),
                )
            })
        });
        if made.is_err() {
            // Nobody will listen on it: the directory can go.
            let _ = std::fs::remove_file(socket);
        }
        made
    }

    /// Serves on a socket already listening, such as one a service manager
    /// passed (socket activation, [`herdless_platform::listen_fds`]).
    pub fn from_listener(
        listener: std::os::unix::net::UnixListener,
        config: Config,
    ) -> io::Result<Broker> {
        check_jobs(config.jobs)?;
        listener.set_nonblocking(true)?;
        Broker::on_listener(UnixListener::from_std(listener), config)
    }

    fn on_listener(mut listener: UnixListener, config: Config) -> io::Result<Broker> {
        let poll = Poll::new()?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let signals = if config.handle_signals {
            let (mut read, write) = UnixStream::pair()?;
            let write = std::os::unix::net::UnixStream::from(std::os::fd::OwnedFd::from(write));
            let mut ids = Vec::new();
            for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
                ids.push(signal_hook::low_level::pipe::register(
                    sig,
                    write.try_clone()?,
                )?);
            }
            poll.registry()
                .register(&mut read, SIGNALS, Interest::READABLE)?;
            Some((read, ids))
        } else {
            None
        };
        let controls = control::State::new(&config.admission);
        let mut pool = Pool::new(config.jobs - 1);
        let top_slot = random_slot_id(0);
        pool.add_slot(SlotKey::Minted(top_slot), None, true);
        let mut broker = Broker {
            poll,
            listener,
            conns: HashMap::new(),
            by_client: HashMap::new(),
            next_token: FIRST_CONN,
            pool,
            config,
            epoch: Instant::now(),
            waker,
            stop: Arc::new(AtomicBool::new(false)),
            halt: Arc::new(AtomicBool::new(false)),
            drain: Arc::new(AtomicBool::new(false)),
            command: Arc::new(AtomicU32::new(0)),
            keep_free: Arc::new(AtomicUsize::new(0)),
            fd_count: None,
            refused_no_room: 0,
            command_native: false,
            command_looked: 0,
            command_expected: false,
            held: Vec::new(),
            top_slot,
            minted: 1,
            closing: Vec::new(),
            dead: Vec::new(),
            signals,
            reserve: File::open("/dev/null").ok(),
            uid: nix::unistd::geteuid().as_raw(),
            dirty: Vec::new(),
            bridge: None,
            backing: None,
            native_grants: 0,
            native_wakeups: 0,
            max_in_use: 0,
            turns: Turns::default(),
            handshakes: Handshakes::default(),
            handshake_log: HandshakeLog::default(),
            output_total: 0,
            closed_in_flush: false,
            accept_starved: false,
            fd_freed: false,
            accept_more: false,
            idle_exit_fds: 0,
            fast: None,
            table_made: false,
            controls,
        };
        if broker.config.fast_path && broker.config.jobs > 1 {
            match herdless_platform::segment_support()
                .map_err(io::Error::other)
                .and_then(|()| {
                    fast::FastState::new(
                        &mut broker.pool,
                        (broker.config.jobs - 1).min(fast::MAX_TABLE_WORDS),
                    )
                }) {
                Ok(state) => {
                    broker.fast = Some(state);
                    broker.table_made = true;
                }
                Err(e) => log!(Level::Info, "no shared token table: {e}"),
            }
        }
        broker.check_admission(true);
        Ok(broker)
    }

    /// Serves classic jobserver clients from the same pool through
    /// `bridge` (see [`crate::bridge`]).
    pub fn with_bridge(mut self, mut bridge: Bridge) -> io::Result<Broker> {
        // The table takes the free pool only while the classic side is
        // dormant (crate::bridge, "The shared table").
        bridge.set_table(self.fast.is_some())?;
        if self.backing.is_some() {
            bridge.set_backed()?;
        }
        bridge.attach(&mut self.pool);
        let (offers, returns) = bridge.watched_fds();
        let registry = self.poll.registry();
        if let Some(fd) = bridge.drained_fd() {
            registry.register(
                &mut mio::unix::SourceFd(&fd),
                CLASSIC_DRAINED,
                Interest::WRITABLE,
            )?;
        }
        registry.register(
            &mut mio::unix::SourceFd(&offers),
            CLASSIC_OFFERS,
            Interest::READABLE,
        )?;
        if let Some(fd) = returns {
            registry.register(
                &mut mio::unix::SourceFd(&fd),
                CLASSIC_RETURNS,
                Interest::READABLE,
            )?;
        }
        self.bridge = Some(bridge);
        self.rebalance();
        Ok(self)
    }

    /// Gives up the shared token table before the broker runs (nothing
    /// is lent to it before [`Broker::run`]).
    fn drop_table(&mut self) {
        if let Some(fast) = self.fast.take() {
            let now = self.now();
            self.pool.disconnect(fast.client(), now);
        }
    }

    /// Borrows this pool's shared tokens from an outer classic jobserver,
    /// on demand, instead of owning them (see [`crate::backing`]): the
    /// pool starts with none, and every one it hands out was read from
    /// the outer jobserver and goes back there once nobody here may take
    /// it. Call before [`Broker::with_bridge`].
    pub fn with_backing(mut self, mut backing: Backing) -> io::Result<Broker> {
        // A borrowed token goes back to the outer pool as soon as nobody
        // here may take it; lent to the table it would stay: no table for
        // a backed pool.
        self.drop_table();
        let now = self.now();
        self.pool.resize(0, now);
        backing.set_jobs(self.config.jobs);
        self.poll.registry().register(
            &mut mio::unix::SourceFd(&backing.fd()),
            OUTER,
            Interest::READABLE,
        )?;
        log!(
            Level::Info,
            "borrowing up to {} token(s) from the outer jobserver ({})",
            self.config.jobs - 1,
            backing.what()
        );
        self.backing = Some(backing);
        Ok(self)
    }

    /// Lets the bridge move tokens between the pipe and native waiters,
    /// and a backed pool borrow or give back outer tokens, then carries
    /// out what that changed.
    fn rebalance(&mut self) {
        // A wait that started in the table while the standing offer was
        // out, before the notify word asked to hear of it, is seen by
        // `set_table_notify`: the next pass takes the offer back for it
        // (and the word then asks for nothing). The bound is a guard.
        for _ in 0..4 {
            self.rebalance_pass();
            if !self.set_table_notify() {
                return;
            }
        }
    }

    /// One pass of [`rebalance`](Self::rebalance).
    fn rebalance_pass(&mut self) {
        // Each pass settles what the last one's effects changed (a grant
        // to a process already gone frees its token, which a backed pool
        // gives back); each frees fewer, so this ends.
        for _ in 0..64 {
            let now = self.now();
            let table_grants = self.fast.as_ref().map_or(0, |f| f.table.grant_count());
            let grants = self.native_grants.saturating_add(table_grants);
            let natives_waiting =
                self.pool.waiting() + self.fast.as_ref().map_or(0, |f| f.table.waiting_count());
            if self
                .bridge
                .as_ref()
                .is_some_and(|b| b.offer_due(grants, natives_waiting, now))
            {
                self.fast_ask_for_offer();
            }
            let view = match (&self.bridge, &self.fast) {
                (Some(_), Some(f)) => crate::bridge::TableView {
                    waiting: f.table.waiting_count(),
                    holders_not_waiting: self.fast_holders_not_waiting(),
                    client: Some(f.client()),
                },
                _ => crate::bridge::TableView::default(),
            };
            if let Some(bridge) = self.bridge.as_mut() {
                bridge.balance(&mut self.pool, grants, view, now);
                self.apply_effects();
            }
            let Some(backing) = self.backing.as_mut() else {
                break;
            };
            backing.balance(&mut self.pool, now);
            self.apply_effects();
            if self.pool.free() == 0 {
                break;
            }
        }
        self.retire_from_pipe();
        self.fast_balance();
        self.note_in_use();
    }

    /// Tells the shared table's clients when to tell the broker of what
    /// they do there. Returns whether a wait is already in the open table
    /// that the standing offer must be taken back for (or, in the table
    /// half-open around an offer for waiting natives, one that the last
    /// balance did not see, or that a free token can go to): the word is
    /// written before the waits are read, and a client starts its wait
    /// before it reads the word (both sequentially consistent), so a wait
    /// either sees the word or is seen here.
    ///
    /// Likewise for a give-back the word asks to hear of
    /// (`Notify::AfterOrFree`): a word freed with nobody waiting before
    /// the word asked for it is seen here.
    fn set_table_notify(&self) -> bool {
        let (Some(bridge), Some(fast)) = (self.bridge.as_ref(), self.fast.as_ref()) else {
            return false;
        };
        // The table half-open around an offer for waiting natives, its
        // waiters served by the broker: the first wait that starts tells
        // the broker, whose rules for the offer count waits (a native that
        // stops holding to wait may leave no release to come), and which
        // hands it a token left free here (none waited when it came).
        let serving = !fast.table.is_open() && self.fast_may_serve();
        let notify = if serving {
            crate::fast::Notify::FirstWait
        } else {
            bridge.notify(&self.pool)
        };
        fast.table.set_notify(notify);
        if serving {
            // A wait that started before the word was written, and after
            // this event's balance read the table, is seen here.
            let waiting = fast.table.waiting_count();
            return waiting > 0 && (self.pool.free() > 0 || waiting != bridge.table_waiting_seen());
        }
        match notify {
            crate::fast::Notify::FirstWait => {
                fast.table.is_open() && fast.table.waiting_count() > 0
            }
            crate::fast::Notify::AfterOrFree(_) => {
                fast.table.is_open()
                    && fast.table.waiting_count() == 0
                    && fast.free_and_held().0 > 0
            }
            _ => false,
        }
    }

    /// A handle that stops this broker from another thread.
    pub fn stopper(&self) -> Stopper {
        Stopper {
            waker: self.waker.clone(),
            flag: self.stop.clone(),
            halt: self.halt.clone(),
            drain: self.drain.clone(),
            command: self.command.clone(),
            keep_free: self.keep_free.clone(),
        }
    }

    /// Names the process id of the command at the top before the broker
    /// runs, as [`Stopper::command_started`] does while it runs.
    pub fn set_command(&mut self, pid: u32) {
        self.command.store(pid, Ordering::SeqCst);
    }

    /// Says that a command at the top is about to be started and named
    /// ([`Stopper::command_started`]), as `herdless run` does: until it is,
    /// the hello of a recipe job (`RECIPE_JOB`) is held unanswered. Such a
    /// job may be a make that the command started through a wrapper that
    /// forks (`timeout`, a shell), which shares the command's slot, the top
    /// one; taken before the name came, it would have got a recipe slot of
    /// its own beside the top slot, one job more than `-j`.
    pub fn expect_command(&mut self) {
        self.command_expected = true;
    }

    /// Whether a recipe job's hello must wait for the command's name.
    fn hello_waits_for_command(&self) -> bool {
        self.command_expected && self.command.load(Ordering::SeqCst) == 0
    }

    /// Once the command is named, answers the hellos held for it and reads
    /// their connections on.
    fn release_held_hellos(&mut self) {
        if self.held.is_empty() || self.hello_waits_for_command() {
            return;
        }
        for token in std::mem::take(&mut self.held) {
            let Some(req) = self.conns.get_mut(&token).and_then(|c| c.held_hello.take()) else {
                continue;
            };
            if let Err(reason) = self.handle_hello(token, req) {
                self.close(token, Some(reason));
                continue;
            }
            self.queue_turn(token);
        }
    }

    /// The slot of the `herdless exec` whose command is `root`, the recipe
    /// root a make names when that command starts it beside others
    /// (`herdless exec -- sh -c 'make & make & herdless exec job & wait'`):
    /// the makes share it with the command's `exec` jobs, which borrow it
    /// through `HERDLESS_SLOT`, as makes beside `run`'s command share the
    /// top slot. The `exec` is known as a connected client that is
    /// `root`'s parent and a `herdless` process (a make's recipe root is
    /// the child of a make, whose slot none of its jobs borrows). `None`
    /// otherwise, or where the process tree is not read (only Linux
    /// shares a recipe's slot).
    fn exec_slot_of_command(&self, root: u32) -> Option<u64> {
        if !cfg!(any(target_os = "linux", target_os = "android")) {
            return None;
        }
        let table = herdless_platform::ProcessTable::read();
        let (parent, _) = table.parent_and_name(root)?;
        let slot = self
            .conns
            .values()
            .find(|c| c.pid == Some(parent) && c.client.is_some() && !c.observer)
            .map(|c| c.own_slot)
            .filter(|&slot| slot != 0 && self.pool.has_slot(SlotKey::Minted(slot)))?;
        let (_, name) = table.parent_and_name(parent)?;
        (crate::classic::Program::of(name.as_ref()) == Some(crate::classic::Program::Herdless))
            .then_some(slot)
    }

    /// Whether `pid` is the command at the top.
    fn is_command(&self, pid: u32) -> bool {
        pid != 0 && self.command.load(Ordering::SeqCst) == pid
    }

    /// The command at the top connected natively: tell the bridge, once.
    fn command_connected(&mut self) {
        if self.command_native {
            return;
        }
        self.command_native = true;
        log!(Level::Debug, "the command at the top is a native client");
        if let Some(bridge) = self.bridge.as_mut() {
            bridge.command_is_native();
        }
    }

    /// If the command's pid just became known (one atomic load otherwise)
    /// and it has already connected natively, tells the bridge.
    fn look_for_command(&mut self) {
        let pid = self.command.load(Ordering::SeqCst);
        if self.command_native || pid == 0 || pid == self.command_looked {
            return;
        }
        self.command_looked = pid;
        // The command itself, or a make it started through a wrapper that
        // forks, whose recipe root it is (see `handle_hello`).
        let found = self.conns.values().any(|c| {
            c.client.is_some_and(|id| {
                !c.observer
                    && (c.pid.is_some_and(|p| self.is_command(p))
                        || (c.runner && self.pool.borrows(id) == Some(SlotKey::Recipe(pid))))
            })
        });
        if found {
            self.command_connected();
        }
    }

    /// The counts of the outer tokens borrowed, when the pool is backed
    /// (see [`Broker::with_backing`]); readable after the broker ends.
    pub fn backing_figures(&self) -> Option<std::sync::Arc<crate::backing::Figures>> {
        self.backing.as_ref().map(|b| b.ledger().figures())
    }

    /// The id of the top command's slot: the N-th token of `-jN`. Whoever
    /// starts the command at the top exports it as `HERDLESS_SLOT` (see
    /// [`crate::client::slot_env_value`]); every job below that names it
    /// may run in it, one at a time.
    pub fn top_slot(&self) -> u64 {
        self.top_slot
    }

    /// Mints a slot for `owner`'s own job, under a fresh unguessable id.
    fn mint_slot(&mut self, owner: ClientId) -> u64 {
        loop {
            self.minted += 1;
            let id = random_slot_id(self.minted);
            if self.pool.add_slot(SlotKey::Minted(id), Some(owner), false) {
                return id;
            }
            if !self.by_client.contains_key(&owner) && self.pool.held_by(owner).is_none() {
                return 0;
            }
        }
    }

    /// Stops granting: waiters are told and closed, the classic pipe is
    /// emptied of unread tokens, later acquires are refused.
    fn stop_granting(&mut self) {
        if !self.pool.stop() {
            return;
        }
        self.fast_close();
        log!(Level::Info, "stopping: no more tokens are granted");
        let now = self.now();
        if let Some(bridge) = self.bridge.as_mut() {
            bridge.on_stop(&mut self.pool, now);
        }
        self.apply_effects();
    }

    /// Serves until stopped (by a [`Stopper`], or by SIGINT/SIGTERM when
    /// the config asks for it), then closes every connection, takes back
    /// every token and returns the final report.
    pub fn run(mut self) -> io::Result<Status> {
        let mut events = Events::with_capacity(256);
        // The table's tokens are lent before the first client connects.
        self.fast_balance();
        while !self.stop.load(Ordering::SeqCst) {
            if self.drain.load(Ordering::SeqCst) && !self.runner_connected() {
                // A connection still in the listener's queue is a client
                // that may be a make: take it in before deciding.
                self.accept_all();
                if !self.runner_connected() {
                    break;
                }
            }
            if self.halt.load(Ordering::SeqCst) {
                self.stop_granting();
                self.flush_dirty();
            }
            // No timeout, except while a connection waits for a turn or
            // its hello, while an offer in the classic pipe waits for a
            // reader (`bridge::OFFER_WAIT`), or while waiters are held back
            // only by a load or memory limit (see control.rs).
            let timeout = self
                .poll_timeout()
                .into_iter()
                .chain(self.admission_timeout())
                .min();
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Ends as a stop does: the classic pipe drained, borrowed
                // bytes given back, before the error is reported.
                let _ = self.shut_down();
                return Err(e);
            }
            // Before this batch's requests: the command's pid may have
            // just become known (a stopper's wake-up is among the events).
            self.release_held_hellos();
            self.look_for_command();
            // A timeout (no events) is the slow re-check: sample now.
            self.check_admission(events.is_empty());
            self.flush_dirty();
            // The connections ready in this batch share a round's budget.
            let event_budget = limits::turn_budget(events.iter().count());
            for event in events.iter() {
                // A stop that came in during this batch (a signal, a
                // stopper) takes effect before the next event is handled.
                if self.halt.load(Ordering::SeqCst) && !self.pool.stopped() {
                    self.stop_granting();
                }
                match event.token() {
                    LISTENER => self.accept_all(),
                    WAKER => {}
                    SIGNALS => self.drain_signals(),
                    CLASSIC_OFFERS | CLASSIC_DRAINED | OUTER => {}
                    CLASSIC_RETURNS => {
                        let now = self.now();
                        if let Some(bridge) = self.bridge.as_mut() {
                            // Count the tokens coming back as in use until
                            // they are read.
                            bridge.refresh();
                        }
                        self.note_in_use();
                        if let Some(bridge) = self.bridge.as_mut() {
                            bridge.on_returns(&mut self.pool, now);
                        }
                        self.apply_effects();
                    }
                    token if token.0 & EXIT_BIT != 0 => {
                        self.process_exited(Token(token.0 & !EXIT_BIT));
                    }
                    token => {
                        if event.is_read_closed() || event.is_error() {
                            if let Some(conn) = self.conns.get_mut(&token) {
                                conn.read_closed = true;
                            }
                        }
                        self.conn_event(
                            token,
                            event.is_readable(),
                            event.is_writable(),
                            event_budget,
                        )
                    }
                }
                self.settle_and_flush();
            }
            self.take_turns();
            self.expire_handshakes();
            if self.accept_more || (self.accept_starved && self.fd_freed) {
                self.accept_all();
            }
            self.fd_freed = false;
            self.settle_and_flush();
        }
        Ok(self.shut_down())
    }

    /// Rebalances after an event and sends the replies it made; again while
    /// a connection closed as its replies failed, so that a token it gave
    /// back or held reaches the table, the bridge or a backed pool before
    /// the broker sleeps.
    fn settle_and_flush(&mut self) {
        loop {
            self.rebalance();
            self.flush_dirty();
            if !std::mem::take(&mut self.closed_in_flush) {
                break;
            }
        }
    }

    /// A job runner is connected, or a connection has not said hello yet
    /// (it may be one): what [`Stopper::stop_when_idle`] waits for.
    fn runner_connected(&self) -> bool {
        self.conns.values().any(|c| c.runner || c.client.is_none())
    }

    /// No sleep while a connection waits for a turn; otherwise until the
    /// next handshake deadline, or for I/O only.
    fn poll_timeout(&mut self) -> Option<Duration> {
        if !self.turns.is_empty() || self.accept_more || (self.accept_starved && self.fd_freed) {
            return Some(Duration::ZERO);
        }
        let conns = &self.conns;
        let handshake = self
            .handshakes
            .next_deadline(|t| conns.get(&t).is_some_and(Conn::in_handshake));
        let offer = self.bridge.as_ref().and_then(Bridge::offer_deadline);
        let deadline = handshake.into_iter().chain(offer).min()?;
        // Round up so the loop does not wake just before the deadline.
        Some(deadline.saturating_sub(self.now()) + Duration::from_millis(1))
    }

    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn drain_signals(&mut self) {
        let Some((read, _)) = self.signals.as_mut() else {
            return;
        };
        let mut buf = [0u8; 64];
        loop {
            match read.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {
                    log!(Level::Info, "signal received; shutting down");
                    self.stop.store(true, Ordering::SeqCst);
                    self.halt.store(true, Ordering::SeqCst);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }

    /// Accepts up to [`ACCEPT_BUDGET`] pending connections; with more
    /// pending, the listener gets another turn after the connections'.
    fn accept_all(&mut self) {
        self.accept_starved = false;
        self.accept_more = false;
        for _ in 0..ACCEPT_BUDGET {
            match self.listener.accept() {
                Ok((stream, _)) => self.admit(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    if self.close_idle_exit_fds() {
                        continue;
                    }
                    if !self.refuse_for_lack_of_fds(&e) {
                        // No reserve left: try again when a connection
                        // closes, or on the listener's next edge, rather
                        // than spin.
                        self.accept_starved = true;
                        return;
                    }
                }
                Err(e) => {
                    log!(Level::Error, "accept failed: {e}");
                    return;
                }
            }
        }
        self.accept_more = true;
    }

    /// Spends the reserve descriptor to accept one pending connection and
    /// tell it to come back later. Returns whether it accepted one; either
    /// way the listener is tried again once a connection closes.
    fn refuse_for_lack_of_fds(&mut self, cause: &io::Error) -> bool {
        let Some(reserve) = self.reserve.take() else {
            log!(Level::Warn, "accept: {cause}; no reserve descriptor left");
            return false;
        };
        drop(reserve);
        let accepted = match self.listener.accept() {
            Ok((mut stream, _)) => {
                log!(
                    Level::Info,
                    "accept: {cause}; asking a new client to retry, serving the {} connected",
                    self.conns.len()
                );
                let mut frame = Vec::new();
                Reply::Error {
                    message: format!(
                        "{BUSY_PREFIX}broker is out of file descriptors ({cause}); try again"
                    ),
                }
                .encode(&mut frame);
                let _ = stream.write(&frame);
                true
            }
            Err(_) => false,
        };
        self.reserve = File::open("/dev/null").ok();
        accepted
    }

    fn admit(&mut self, mut stream: UnixStream) {
        let cred = herdless_platform::peer_cred(stream.as_fd());
        let pid = match cred {
            Ok(c) if c.uid != self.uid => {
                let reason = format!(
                    "peer uid {} is not the broker's uid {}; connection refused",
                    c.uid, self.uid
                );
                log!(Level::Warn, "{reason}");
                let mut frame = Vec::new();
                Reply::Error { message: reason }.encode(&mut frame);
                let _ = stream.write(&frame);
                return;
            }
            Ok(c) => c.pid.and_then(|p| u32::try_from(p).ok()),
            Err(e) => {
                log!(
                    Level::Warn,
                    "cannot read peer credentials ({e}); connection refused"
                );
                return;
            }
        };
        if !self.room_for(pid) {
            self.refused_no_room += 1;
            let keep = self.keep_free.load(Ordering::SeqCst);
            log!(
                Level::Debug,
                "client of pid {pid:?} turned away: fewer than {keep} descriptors free"
            );
            if self.refused_no_room.is_power_of_two() {
                log!(
                    Level::Info,
                    "{} client(s) turned away to keep {keep} descriptors free for this process",
                    self.refused_no_room
                );
            }
            let mut frame = Vec::new();
            Reply::Error {
                message: format!(
                    "{NO_ROOM_PREFIX}the broker keeps {keep} descriptors free for the \
                     process it runs in; use the classic jobserver"
                ),
            }
            .encode(&mut frame);
            let _ = stream.write(&frame);
            return;
        }
        let token = Token(self.next_token);
        self.next_token += 1;
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut stream, token, Interest::READABLE)
        {
            log!(Level::Error, "cannot watch a new connection: {e}");
            return;
        }
        self.conns.insert(
            token,
            Conn {
                stream,
                rx: FrameBuffer::default(),
                tx: Vec::new(),
                client: None,
                pid,
                observer: false,
                runner: false,
                watching_writes: false,
                version: PROTOCOL_VERSION,
                exit_fd: None,
                exit_fd_idle: false,
                read_closed: false,
                fast_owner: 0,
                queued: false,
                paused: false,
                held_hello: None,
                own_slot: 0,
                status_owed: 0,
                peer_gone: false,
            },
        );
        let now = self.now();
        self.handshakes
            .start(token, now, self.config.handshake_deadline);
        // The client may have written its hello already; with
        // edge-triggered readiness the registration reports it, but reading
        // now saves a trip through the loop. Up to ACCEPT_BUDGET
        // connections come in one turn of the listener: they share a round.
        self.conn_event(token, true, false, limits::turn_budget(ACCEPT_BUDGET));
        if self.handshakes.live() > MAX_HANDSHAKING {
            self.evict_oldest_handshake();
        }
    }

    /// Whether a new client of process `pid`, its socket accepted, leaves
    /// the descriptors [`Stopper::keep_fds_free`] asks for free, with one
    /// more for the process-exit descriptor it may cost. The command at
    /// the top (the process the broker runs in, for a make) always has
    /// room.
    fn room_for(&mut self, pid: Option<u32>) -> bool {
        let keep = self.keep_free.load(Ordering::SeqCst);
        keep == 0
            || pid.is_some_and(|p| self.is_command(p))
            || self
                .fd_count
                .get_or_insert_with(herdless_platform::DescriptorCount::new)
                .free(keep + 1)
    }

    /// Closes the oldest connection still in its handshake, to make room.
    fn evict_oldest_handshake(&mut self) {
        let conns = &self.conns;
        if let Some(token) = self
            .handshakes
            .pop_oldest(None, |t| conns.get(&t).is_some_and(Conn::in_handshake))
        {
            self.close_handshake(
                token,
                format!(
                    "{BUSY_PREFIX}more than {MAX_HANDSHAKING} connections have not sent their hello"
                ),
            );
        }
    }

    /// Closes a connection that has not sent its hello, telling it why;
    /// the log gets a count of these (see [`limits::HANDSHAKE_LOG_EVERY`]),
    /// not a line each.
    fn close_handshake(&mut self, token: Token, reason: String) {
        if let Some(n) = self.handshake_log.note(self.now()) {
            log!(
                Level::Warn,
                "closed {n} connection(s) that had not sent their hello; the last: {reason}"
            );
        }
        self.close_as(token, Some(reason), false, false);
    }

    /// Closes the connections whose handshake deadline has passed.
    fn expire_handshakes(&mut self) {
        let now = self.now();
        loop {
            let conns = &self.conns;
            let Some(token) = self
                .handshakes
                .pop_oldest(Some(now), |t| conns.get(&t).is_some_and(Conn::in_handshake))
            else {
                return;
            };
            // A hello that came while this broker could not run (its
            // process stopped, a batch of more events than one poll
            // returns) is read before the connection is given up on.
            self.conn_event(token, true, false, READ_BUDGET);
            if !self.conns.get(&token).is_some_and(|c| c.client.is_none()) {
                continue;
            }
            let reason = format!(
                "no hello within {} ms of connecting",
                self.config.handshake_deadline.as_millis()
            );
            self.close_handshake(token, reason);
        }
    }

    /// The connection of `token` now holds a token: watch for the exit of
    /// the process that opened it. Where the OS has no process descriptors
    /// (the BSDs, macOS, Linux before 5.3), or none is left, the
    /// connection's end is its socket's. A process already gone (a fork
    /// kept the socket, and a queued grant just reached it) is closed.
    fn watch_holder(&mut self, token: Token) {
        use std::os::fd::AsRawFd;
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if conn.exit_fd_idle {
            conn.exit_fd_idle = false;
            self.idle_exit_fds -= 1;
        }
        let (None, Some(pid)) = (&conn.exit_fd, conn.pid) else {
            return;
        };
        if pid == std::process::id() {
            // The process the broker runs in (a make that started it):
            // its exit ends the broker too.
            return;
        }
        match herdless_platform::process_exit_fd(pid) {
            Ok(fd) => {
                let registered = self.poll.registry().register(
                    &mut mio::unix::SourceFd(&fd.as_raw_fd()),
                    Token(token.0 | EXIT_BIT),
                    Interest::READABLE,
                );
                if registered.is_ok() {
                    conn.exit_fd = Some(fd);
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => self.dead.push(token),
            Err(_) => {}
        }
    }

    /// The connection of `token` holds no token any more: stop watching
    /// its process, or keep the watch for its next token while fewer than
    /// [`IDLE_EXIT_FDS`] are kept. A kept watch that fires closes the
    /// connection, which is what a holder's would do: a fork of the process
    /// cannot use it.
    fn unwatch_holder(&mut self, token: Token) {
        use std::os::fd::AsRawFd;
        let idle = self.idle_exit_fds;
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if conn.fast_owner != 0 {
            // A client of the shared table may hold tokens the pool does
            // not see: watched while connected.
            return;
        }
        if conn.exit_fd.is_some() && !conn.exit_fd_idle && idle < IDLE_EXIT_FDS {
            conn.exit_fd_idle = true;
            self.idle_exit_fds += 1;
            return;
        }
        if let Some(fd) = conn.exit_fd.take() {
            if conn.exit_fd_idle {
                conn.exit_fd_idle = false;
                self.idle_exit_fds -= 1;
            }
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&fd.as_raw_fd()));
        }
    }

    /// Closes every process-exit descriptor kept by a connection holding no
    /// token, for `accept` to have them. Returns whether it closed any.
    fn close_idle_exit_fds(&mut self) -> bool {
        use std::os::fd::AsRawFd;
        if self.idle_exit_fds == 0 {
            return false;
        }
        for conn in self.conns.values_mut().filter(|c| c.exit_fd_idle) {
            conn.exit_fd_idle = false;
            if let Some(fd) = conn.exit_fd.take() {
                let _ = self
                    .poll
                    .registry()
                    .deregister(&mut mio::unix::SourceFd(&fd.as_raw_fd()));
            }
        }
        self.idle_exit_fds = 0;
        true
    }

    /// The process that opened a connection has exited, while the socket
    /// stays open (a fork of it inherited it): the connection is its, so
    /// it closes now and its tokens come back.
    fn process_exited(&mut self, token: Token) {
        // What it wrote before it died comes first (a release, say); that
        // read also closes a connection whose socket has ended.
        if let Some(conn) = self.conns.get_mut(&token) {
            conn.read_closed = true;
        }
        self.conn_event(token, true, false, READ_BUDGET);
        let Some(conn) = self.conns.get(&token) else {
            return;
        };
        log!(
            Level::Info,
            "the process (pid {}) of connection {} exited, and a fork of it keeps the \
             socket open; closing the connection",
            conn.pid.unwrap_or(0),
            token.0
        );
        self.close(token, None);
    }

    fn conn_event(&mut self, token: Token, readable: bool, writable: bool, budget: usize) {
        let paused = self.conns.get(&token).is_some_and(|c| c.paused);
        if writable || paused {
            // A paused connection is not read, so a peer that went away
            // shows up when its replies are flushed: that fails, and the
            // connection closes and gives its tokens back.
            self.dirty.push(token);
        }
        if readable {
            self.turn(token, budget);
        }
    }

    /// Gives every connection queued for a turn one more, sharing
    /// [`limits::ROUND_BUDGET`] among them.
    fn take_turns(&mut self) {
        let round = self.turns.round();
        let budget = limits::turn_budget(round.len());
        for token in round {
            if let Some(conn) = self.conns.get_mut(&token) {
                conn.queued = false;
                self.turn(token, budget);
            }
        }
    }

    /// Whether the broker should read no more from `conn` for now: its
    /// replies wait unsent past the bounds, or a status document of its own
    /// does.
    fn reading_paused(conn: &Conn, output_total: usize) -> bool {
        conn.status_owed > 0
            || conn.tx.len() > OUTPUT_PAUSE
            || (!conn.tx.is_empty() && output_total > TOTAL_OUTPUT_PAUSE)
    }

    /// One turn of a connection: handles up to `budget` requests (at most
    /// [`READ_BUDGET`]), reading at most [`READ_CHUNK`] bytes, then queues
    /// the connection for another turn if it may have more.
    fn turn(&mut self, token: Token, budget: usize) {
        let mut budget = budget;
        let mut read = 0;
        let mut drained = false;
        let mut buf = [0u8; READ_CHUNK];
        loop {
            let total = self.output_total;
            let Some(conn) = self.conns.get_mut(&token) else {
                return;
            };
            if Self::reading_paused(conn, total) {
                // Resumed by `flush_dirty` once its replies drain.
                conn.paused = true;
                return;
            }
            if conn.held_hello.is_some() {
                // Read on by `release_held_hellos`.
                return;
            }
            if budget == 0 {
                self.queue_turn(token);
                return;
            }
            match conn.rx.next_request() {
                Ok(Some(req)) => {
                    budget -= 1;
                    if matches!(req, Request::Status) {
                        // A status document is the whole turn.
                        budget = 0;
                    }
                    if let Err(reason) = self.handle_request(token, req) {
                        self.close(token, Some(reason));
                        return;
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    self.close(token, Some(protocol_reason(&e)));
                    return;
                }
            }
            if read >= READ_CHUNK {
                self.queue_turn(token);
                return;
            }
            if drained {
                conn.rx.shrink_if_empty();
                return;
            }
            let want = READ_CHUNK - read;
            match conn.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    let reason = (!conn.rx.is_empty()).then(|| {
                        format!(
                            "peer closed the connection in the middle of a frame ({} bytes unread)",
                            conn.rx.len()
                        )
                    });
                    self.close(token, reason);
                    return;
                }
                Ok(n) => {
                    read += n;
                    conn.rx.extend(&buf[..n]);
                    // A short read emptied the socket: what comes next is
                    // a new edge (see `Conn::read_closed`).
                    drained = n < want && !conn.read_closed;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    conn.rx.shrink_if_empty();
                    return;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // ECONNRESET and friends: the peer is gone.
                    log!(Level::Debug, "read from connection {}: {e}", token.0);
                    self.close(token, None);
                    return;
                }
            }
        }
    }

    fn queue_turn(&mut self, token: Token) {
        if let Some(conn) = self.conns.get_mut(&token) {
            if !conn.queued {
                conn.queued = true;
                self.turns.push(token);
            }
        }
    }

    fn handle_request(&mut self, token: Token, req: Request) -> Result<(), String> {
        let conn = self.conns.get(&token).expect("live connection");
        match conn.client {
            None => self.handle_hello(token, req),
            Some(id) => self.handle_client_request(token, id, req),
        }
    }

    /// The first frame of a connection: a hello, or the connection closes.
    fn handle_hello(&mut self, token: Token, req: Request) -> Result<(), String> {
        let hold = self.hello_waits_for_command();
        let conn = self.conns.get_mut(&token).expect("live connection");
        let Request::Hello {
            version,
            flags,
            pid,
            slot,
        } = req
        else {
            return Err(format!("expected a hello frame first, got {req}"));
        };
        if !(PROTOCOL_VERSION..=TAKE_BACK_VERSION).contains(&version) {
            return Err(format!(
                "unsupported protocol version {version} (broker speaks {PROTOCOL_VERSION} to \
                 {TAKE_BACK_VERSION}); \
                 versions before 3 named a job's parent by process id, which this broker \
                 no longer trusts: use a herdless of the same version"
            ));
        }
        conn.version = version;
        if flags.contains(HelloFlags::FAST) && version < FAST_VERSION {
            return Err(format!(
                "the hello flag FAST needs protocol version {FAST_VERSION}; this hello speaks {version}"
            ));
        }
        if hold && flags.contains(HelloFlags::RECIPE_JOB) {
            // Whether its recipe root is the command is not known yet.
            conn.held_hello = Some(req);
            self.held.push(token);
            return Ok(());
        }
        let peer = conn.pid;
        let observer = flags.contains(HelloFlags::OBSERVER);
        let (command, top_slot) = (self.command.load(Ordering::SeqCst), self.top_slot);
        let mut below_command = false;
        let borrows = match (
            flags.contains(HelloFlags::JOB),
            flags.contains(HelloFlags::RECIPE_JOB),
        ) {
            (true, true) => return Err("hello flags JOB and RECIPE_JOB exclude each other".into()),
            // A job that names no runner is a job of the top.
            (true, false) if slot == 0 => Some(SlotKey::Minted(self.top_slot)),
            (true, false) => Some(SlotKey::Minted(slot)),
            // The command of `run` as a recipe root: a runner it started
            // beside others shares the command's slot, the top one, with
            // the command's other jobs.
            (false, true) => match recipe_root(peer, pid, slot, flags) {
                Some(Some(root)) if command == root => {
                    below_command = true;
                    Some(SlotKey::Minted(top_slot))
                }
                // The same below the command of an `exec`: its slot.
                Some(Some(root)) => match self.exec_slot_of_command(root) {
                    Some(slot) => Some(SlotKey::Minted(slot)),
                    None => Some(SlotKey::Recipe(root)),
                },
                Some(None) => None,
                None => return Err(format!("hello names recipe root {slot}, not a process id")),
            },
            (false, false) => None,
        };
        if flags.contains(HelloFlags::RUNNER) && !flags.contains(HelloFlags::RECIPE_JOB) {
            return Err("the hello flag RUNNER goes with RECIPE_JOB only".into());
        }
        let conn = self.conns.get_mut(&token).expect("live connection");
        let pid = *conn.pid.get_or_insert(pid);
        conn.observer = observer;
        conn.runner = !observer && (borrows.is_none() || flags.contains(HelloFlags::RUNNER));
        let info = ClientInfo {
            pid,
            borrows,
            observer,
            label: if observer { "observer" } else { "native" },
            internal: false,
        };
        let id = self.pool.connect(info);
        conn.client = Some(id);
        self.handshakes.end();
        self.by_client.insert(id, token);
        if borrows.is_some() && self.pool.borrows(id).is_none() {
            log!(
                Level::Debug,
                "client {id} (pid {pid}) names a slot that is gone; it waits for shared tokens"
            );
        }
        let own = if observer { 0 } else { self.mint_slot(id) };
        if let Some(conn) = self.conns.get_mut(&token) {
            conn.own_slot = own;
        }
        self.note_ancestry(id, pid, 0);
        if flags.contains(HelloFlags::RUNNER) {
            // The hello is also the acquire of the runner's implicit
            // token, taken before the table's descriptor goes out: a slot
            // that is free is lent now, and the table stays open (it
            // would close while a client names a free slot). Its grant
            // follows the handshake's replies.
            if self.pool.waiting() >= MAX_QUEUED_ACQUIRES {
                return Err(format!(
                    "the broker already has {MAX_QUEUED_ACQUIRES} acquires waiting"
                ));
            }
            if !self.pool.slot_free_for(id) {
                self.fast_take_back_for_socket();
            }
            let now = self.now();
            self.pool.acquire(id, now).map_err(|e| e.to_string())?;
        }
        // The command connected natively: itself, or a make it started
        // through a wrapper that forks (`timeout`, `time`, `unshare
        // --fork`, a shell that runs it in the background), whose recipe
        // root is the command.
        if !observer
            && (self.is_command(pid) || (below_command && flags.contains(HelloFlags::RUNNER)))
        {
            self.command_connected();
        }
        self.send(
            token,
            &Reply::Welcome {
                version,
                capacity: self.pool.capacity(),
                client_id: id.0,
                slot: own,
            },
        );
        if flags.contains(HelloFlags::FAST) {
            if observer {
                self.send(token, &Reply::Segment { owner: 0, words: 0 });
            } else {
                self.send_segment(token, id);
            }
        }
        log!(
            Level::Debug,
            "client {id} (pid {pid}) connected{}",
            match self.pool.borrows(id) {
                Some(key) => format!(", may borrow {key}"),
                None => String::new(),
            }
        );
        self.apply_effects();
        Ok(())
    }

    /// A request of a client that has said hello.
    fn handle_client_request(
        &mut self,
        token: Token,
        id: ClientId,
        req: Request,
    ) -> Result<(), String> {
        let now = self.now();
        let conn = self.conns.get(&token).expect("live connection");
        let conn_version = conn.version;
        let result = match req {
            Request::Hello { .. } => return Err("second hello on one connection".into()),
            Request::Acquire if self.pool.pending(id) >= MAX_PENDING_ACQUIRES => {
                return Err(format!(
                    "more than {MAX_PENDING_ACQUIRES} acquires waiting on one connection"
                ));
            }
            Request::Acquire if self.pool.waiting() >= MAX_QUEUED_ACQUIRES => {
                return Err(format!(
                    "the broker already has {MAX_QUEUED_ACQUIRES} acquires waiting"
                ));
            }
            Request::Acquire => {
                self.fast_take_back_for_socket();
                self.pool.acquire(id, now)
            }
            Request::TryAcquire => {
                self.fast_take_back_for_socket();
                self.try_acquire(id, now)
            }
            Request::Returned if conn.fast_owner == 0 => {
                return Err("returned to a shared table this connection does not have".into());
            }
            Request::Returned => {
                self.fast_returned();
                Ok(())
            }
            Request::Cancel => self.pool.cancel(id),
            Request::CancelNowait if conn_version < TAKE_BACK_VERSION => {
                return Err(format!(
                    "CancelNowait needs protocol version {TAKE_BACK_VERSION}; \
                     this connection speaks {conn_version}"
                ));
            }
            Request::CancelNowait => {
                let done = self.pool.cancel_or_take_back(id, now);
                if self.pool.held_by(id) == Some(0) {
                    self.unwatch_holder(token);
                }
                done
            }
            Request::Release => {
                let released = self.pool.release(id, now);
                if self.pool.held_by(id) == Some(0) {
                    self.unwatch_holder(token);
                }
                released
            }
            Request::Abort { reason } => {
                self.fast_close();
                if self.pool.abort(reason) {
                    log!(Level::Info, "client {id} aborted the tree ({reason})");
                }
                Ok(())
            }
            Request::Status => {
                self.send_status(token);
                Ok(())
            }
            Request::Control(op) => {
                if conn_version < CONTROL_VERSION {
                    return Err(format!(
                        "control requests need protocol version {CONTROL_VERSION}; \
                         this connection speaks {conn_version}"
                    ));
                }
                // A cap counts what the subtree holds from the shared
                // table: read it, and close the table, before the cap.
                if self.fast.is_some() {
                    self.fast_close();
                    self.fast_sweep(true);
                }
                self.control(id, op)?;
                self.send(token, &Reply::Controlled);
                Ok(())
            }
        };
        result.map_err(|e| e.to_string())?;
        self.apply_effects();
        // The check is linear in the queue: in debug builds it runs on
        // every request while the queue is short, so that a test filling
        // the queue to its bound does not take quadratic time.
        if cfg!(debug_assertions) && self.pool.waiting() < 1024 {
            assert_eq!(self.pool.check_invariants(), Ok(()));
        }
        Ok(())
    }

    /// A try-acquire. A token unread in the classic pipe is taken back for
    /// it only when nobody queues ahead and no slot would serve: otherwise
    /// the token would go elsewhere and the classic side would just lose
    /// its offer.
    fn try_acquire(&mut self, id: ClientId, now: Duration) -> Result<(), crate::pool::PoolError> {
        if self.pool.free() == 0 && self.pool.waiting() == 0 && !self.pool.slot_free_for(id) {
            if let Some(bridge) = self.bridge.as_mut() {
                bridge.reclaim_one(&mut self.pool, now);
            }
        }
        self.pool.try_acquire(id)
    }

    /// Answers a status request; the connection is read no more until the
    /// document has gone out.
    fn send_status(&mut self, token: Token) {
        // What the table says is checked before it is reported, and what
        // the check changed is settled: a token it found freed in a
        // half-open table may have gone to the bridge's queued request,
        // which makes it the standing offer and reopens the table. The
        // status shows where the broker stands between events, never a
        // state it is about to leave.
        if let Some(open) = self.fast.as_ref().map(|f| f.table.is_open()) {
            self.fast_sweep(!open);
            self.apply_effects();
            self.rebalance();
        }
        let json = self.status().to_json();
        self.send(token, &Reply::Status { json });
        if let Some(conn) = self.conns.get_mut(&token) {
            conn.status_owed = conn.tx.len();
        }
    }

    fn apply_effects(&mut self) {
        loop {
            let effects = self.pool.take_effects();
            if effects.is_empty() {
                break;
            }
            for effect in effects {
                self.apply(effect);
            }
            self.note_in_use();
        }
        // Clients told of the stop: their connections close now, after
        // the loop above, so no token freed by one reaches another.
        while let Some(token) = self.closing.pop() {
            self.close_at_stop(token);
        }
        // Holders whose process is gone while a fork keeps the socket.
        while let Some(token) = self.dead.pop() {
            self.process_exited(token);
        }
    }

    /// Tokens running jobs now: held by native clients, lent as parent
    /// slots, or taken by classic clients (tokens unread in the pipe are
    /// not in use).
    /// Tokens in use as the broker sees them: not those in the classic
    /// pipe, nor those lent to the shared table (which counts its own).
    fn in_use(&self) -> u32 {
        let in_pipe = self.bridge.as_ref().map_or(0, Bridge::in_pipe_estimate);
        let lent = self.fast.as_ref().map_or(0, fast::FastState::lent);
        (self.pool.shared_in_use() + self.pool.slots_in_use() as u32)
            .saturating_sub(in_pipe)
            .saturating_sub(lent)
    }

    pub(super) fn note_in_use(&mut self) {
        let in_use = self.in_use();
        self.max_in_use = self.max_in_use.max(in_use);
        self.fast_note_in_use(in_use);
    }

    fn apply(&mut self, effect: Effect) {
        if let Effect::Swapped { client, key } = effect {
            log!(
                Level::Debug,
                "client {client} holds {key} in place of a shared token"
            );
            return;
        }
        if let Some(table) = self.fast.as_ref().map(fast::FastState::client) {
            match effect {
                Effect::Grant { client, .. } if client == table => {
                    self.fast_on_grant();
                    return;
                }
                Effect::Denied { client }
                | Effect::Cancelled { client, .. }
                | Effect::TakenBack { client }
                | Effect::Aborted { client, .. }
                | Effect::Stopped { client }
                    if client == table =>
                {
                    return;
                }
                _ => {}
            }
        }
        let bridge_id = self.bridge.as_ref().and_then(Bridge::client);
        let now = self.now();
        match (&effect, self.bridge.as_mut()) {
            (Effect::Grant { client, waited, .. }, Some(bridge)) if Some(*client) == bridge_id => {
                // Counted as the bridge counts them: the table's too.
                let grants = self
                    .native_grants
                    .saturating_add(self.fast.as_ref().map_or(0, |f| f.table.grant_count()));
                bridge.on_grant(&mut self.pool, *waited, grants, now);
                return;
            }
            (Effect::Aborted { client, reason }, Some(bridge)) if Some(*client) == bridge_id => {
                bridge.on_abort(&mut self.pool, *reason, now);
                return;
            }
            (
                Effect::Denied { client }
                | Effect::Cancelled { client, .. }
                | Effect::TakenBack { client }
                | Effect::Stopped { client },
                _,
            ) if Some(*client) == bridge_id => {
                return;
            }
            (Effect::Stopped { client }, _) => {
                if let Some(&token) = self.by_client.get(client) {
                    self.send(
                        token,
                        &Reply::Error {
                            message: crate::protocol::STOPPING_MESSAGE.into(),
                        },
                    );
                    self.closing.push(token);
                }
                return;
            }
            (Effect::Grant { client, waited, .. }, _) => {
                self.native_grants += 1;
                self.native_wakeups += u64::from(*waited);
                if let Some(&token) = self.by_client.get(client) {
                    self.watch_holder(token);
                }
            }
            _ => {}
        }
        {
            let (client, reply) = match effect {
                Effect::Grant { client, .. } => (client, Reply::Grant),
                Effect::Denied { client } => (client, Reply::Denied),
                Effect::Cancelled { client, cancelled } => (client, Reply::Cancelled { cancelled }),
                Effect::TakenBack { client } => (client, Reply::TakenBack),
                Effect::Aborted { client, reason } => (client, Reply::Aborted { reason }),
                Effect::Stopped { .. } | Effect::Swapped { .. } => unreachable!("handled above"),
            };
            if let Some(&token) = self.by_client.get(&client) {
                self.send(token, &reply);
            }
        }
    }

    fn send(&mut self, token: Token, reply: &Reply) {
        if let Some(conn) = self.conns.get_mut(&token) {
            if conn.peer_gone {
                return;
            }
            let before = conn.tx.len();
            reply.encode(&mut conn.tx);
            self.output_total += conn.tx.len() - before;
            self.dirty.push(token);
        }
    }

    fn flush_dirty(&mut self) {
        while let Some(token) = self.dirty.pop() {
            let Some(conn) = self.conns.get_mut(&token) else {
                continue;
            };
            let before = conn.tx.len();
            let flushed = flush(conn);
            self.output_total -= before - conn.tx.len();
            match flushed {
                Ok(()) if conn.tx.len() > MAX_PENDING_OUTPUT => {
                    self.close(token, Some("client does not read its replies".into()));
                }
                Ok(()) => {
                    if conn.paused && !Self::reading_paused(conn, self.output_total) {
                        conn.paused = false;
                        if !conn.queued {
                            conn.queued = true;
                            self.turns.push(token);
                        }
                    }
                    // Watch for writability only while output is pending.
                    let want = !conn.tx.is_empty();
                    if want != conn.watching_writes {
                        let interest = if want {
                            Interest::READABLE | Interest::WRITABLE
                        } else {
                            Interest::READABLE
                        };
                        match self
                            .poll
                            .registry()
                            .reregister(&mut conn.stream, token, interest)
                        {
                            Ok(()) => conn.watching_writes = want,
                            Err(e) => {
                                log!(Level::Error, "cannot watch connection {}: {e}", token.0);
                                self.close(token, None);
                            }
                        }
                    }
                }
                Err(e) => {
                    log!(Level::Debug, "write to connection {}: {e}", token.0);
                    self.close_after_last_frames(token);
                }
            }
        }
    }

    /// Closes a connection whose peer is gone (a write to it failed): what
    /// it sent before it went is handled first, as when its process exits
    /// ([`Broker::process_exited`]), so that a token it gave back, or a
    /// withdrawal whose grant raced its exit, counts as such and not as a
    /// token taken back from a client that died. Nothing more is written
    /// to it.
    fn close_after_last_frames(&mut self, token: Token) {
        if let Some(conn) = self.conns.get_mut(&token) {
            self.output_total -= conn.tx.len();
            conn.tx = Vec::new();
            conn.status_owed = 0;
            conn.paused = false;
            conn.read_closed = true;
            conn.peer_gone = true;
        }
        self.turn(token, READ_BUDGET);
        self.close(token, None);
        self.closed_in_flush = true;
    }

    /// Closes a connection and returns its tokens to the pool. With a
    /// reason, the client is told why and the reason is logged.
    fn close(&mut self, token: Token, reason: Option<String>) {
        self.close_as(token, reason, false, true);
    }

    /// Closes a connection the broker ends itself because it stops: the
    /// tokens it held count as held at shutdown, not as taken back from a
    /// client that died.
    fn close_at_stop(&mut self, token: Token) {
        self.close_as(token, None, true, true);
    }

    /// Closes a connection; `log_reason` says whether its reason is logged
    /// here (the caller logs a count instead when it is not).
    fn close_as(&mut self, token: Token, reason: Option<String>, at_stop: bool, log_reason: bool) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return;
        };
        self.fd_freed = true;
        self.output_total -= conn.tx.len();
        if conn.client.is_none() {
            self.handshakes.end();
        }
        let who = match (conn.client, conn.pid) {
            (Some(id), Some(pid)) => format!("client {id} (pid {pid})"),
            (None, Some(pid)) => format!("connection from pid {pid}"),
            _ => format!("connection {}", token.0),
        };
        if let Some(reason) = &reason {
            if log_reason {
                log!(Level::Warn, "closing {who}: {reason}");
            }
            Reply::Error {
                message: reason.clone(),
            }
            .encode(&mut conn.tx);
        }
        // Its table words are free before its last frames go out: a client
        // that reads them finds them taken back.
        let in_table = if conn.fast_owner != 0 {
            self.fast_forget(conn.fast_owner, conn.client, at_stop, reason.is_some())
        } else {
            0
        };
        // Replies already owed (to a client that only half-closed) go out
        // before the connection does, as far as the socket takes them.
        let _ = flush(&mut conn);
        // No `deregister`: closing the socket, dropped below, takes it out
        // of the poll set, one system call fewer per connection (what a
        // flood of connections costs). The broker holds its only
        // descriptor; a command forked meanwhile holds a copy only until
        // its exec (close-on-exec), and an event for the token then finds no
        // connection, tokens being never reused.
        if conn.exit_fd_idle {
            self.idle_exit_fds -= 1;
        }
        if let Some(fd) = conn.exit_fd.take() {
            use std::os::fd::AsRawFd;
            let _ = self
                .poll
                .registry()
                .deregister(&mut mio::unix::SourceFd(&fd.as_raw_fd()));
        }
        if let Some(id) = conn.client {
            self.by_client.remove(&id);
            let now = self.now();
            let reclaimed = in_table
                + if at_stop {
                    self.pool.close_at_shutdown(id, now)
                } else {
                    self.pool.disconnect(id, now)
                };
            if reclaimed > 0 && !at_stop {
                log!(
                    Level::Info,
                    "{who} closed holding {reclaimed} token(s); taken back"
                );
            }
            self.apply_effects();
        }
    }

    /// The client lines of a status document (see
    /// [`Status::list_clients`]) and the count of all clients. The pool
    /// hands over only the clients that can be listed (the busy ones and
    /// the oldest idle ones) and lines are made only for those listed: with
    /// tens of thousands of idle clients a status costs what it lists.
    /// Tokens a client holds in the shared table count as held; the
    /// table's own bookkeeping client is not listed.
    fn status_clients(&self) -> (Vec<ClientStatus>, u64) {
        let max = limits::MAX_STATUS_CLIENTS;
        let table_client = self.fast.as_ref().map(fast::FastState::client);
        let table_held = self.fast_held_by_client();
        let (picked, mut total) = self.pool.holdings_for_status(max);
        if table_client.is_some_and(|c| self.pool.holding_of(c).is_some()) {
            total -= 1;
        }
        let mut picked: Vec<_> = picked
            .into_iter()
            .filter(|h| Some(h.client) != table_client && !table_held.contains_key(&h.client))
            .collect();
        // Holders in the table may look idle to the pool: add them all.
        picked.extend(table_held.iter().filter_map(|(&id, &n)| {
            let mut h = self.pool.holding_of(id)?;
            h.held += n;
            Some(h)
        }));
        let (clients, _) = Status::list_clients(
            picked
                .into_iter()
                .map(|h| ClientStatus {
                    id: h.client.0,
                    pid: h.pid,
                    kind: h.label.to_string(),
                    held: h.held,
                    waiting: h.waiting,
                })
                .collect(),
        );
        (clients, total as u64)
    }

    fn status(&self) -> Status {
        let (clients, clients_total) = self.status_clients();
        let stats = self.pool.stats();
        let fast = self.fast.as_ref().map(|f| {
            let (free, held) = f.free_and_held();
            crate::status::FastStatus {
                open: f.table.is_open(),
                clients: f.clients() as u64,
                lent: f.lent(),
                free,
                held,
                grants: f.table.grant_count(),
                lends: f.lends,
                reclaimed: f.reclaimed,
                cut_off: f.cut_off,
                handoff: f.table.waits_here(),
                waiting: f.table.waiters().len() as u32,
                moved: f.moved,
            }
        });
        let (lends, table_grants, table_free, table_held, table_reclaimed) =
            fast.as_ref().map_or((0, 0, 0, 0, 0), |f| {
                (f.lends, f.grants, f.free, f.held, f.reclaimed)
            });
        // The table's clients write its peak: it is believed only up to
        // what the pool could have had in use.
        let table_peak = self
            .fast
            .as_ref()
            .map_or(0, |f| f.table.peak().min(self.config.jobs));
        let free = self.pool.free() + table_free;
        // A wait in the table counts when it ends in a token or at its
        // deadline; one the broker moved counts in the queue.
        let (table_got, table_cancelled) = self.fast.as_ref().map_or((0, 0), |f| {
            (f.table.waits_got(), u64::from(f.table.waits_cancelled()))
        });
        let grants = (stats.grants - lends).saturating_add(table_grants);
        let immediate =
            (stats.immediate - lends).saturating_add(table_grants.saturating_sub(table_got));
        // Waits in the table are timed by the clients that waited.
        let mut wait_ns = stats.wait_ns.clone();
        if let Some(f) = self.fast.as_ref() {
            f.table.add_waits_to(&mut wait_ns);
        }
        Status {
            pid: std::process::id(),
            jobs: self.config.jobs,
            capacity: self.pool.capacity(),
            free,
            in_use: self.in_use() + table_held,
            waiting: (self.pool.waiting() as u32)
                .saturating_add(fast.as_ref().map_or(0, |f| f.waiting)),
            aborted: self.pool.aborted().map(|r| (r.byte() as char).to_string()),
            grants,
            immediate,
            // Grants after a wait, in the queue or the table: a wait that
            // ended at its deadline or was withdrawn granted nothing.
            // Figures the table's clients write are added without trust.
            waits: grants.saturating_sub(immediate),
            // A waiter woken by its giver's hand-off; a wait moved from the
            // table to the queue counts when its grant wakes it.
            wakeups: self
                .native_wakeups
                .saturating_add(self.fast.as_ref().map_or(0, |f| f.table.handoffs())),
            denied: stats.denied,
            cancelled: stats.cancelled.saturating_add(table_cancelled),
            raced_grants: stats.raced_grants,
            reclaimed: stats.reclaimed + table_reclaimed,
            connections: stats.connections - u64::from(self.table_made),
            stopped: self.pool.stopped(),
            refused_after_stop: stats.refused_after_stop,
            refused_no_room: self.refused_no_room,
            held_at_shutdown: stats.held_at_shutdown
                + self.fast.as_ref().map_or(0, |f| f.held_at_shutdown),
            slots: self.pool.slot_count() as u32,
            max_in_use: self.max_in_use.max(table_peak),
            wait_p50_us: ns_to_us(wait_ns.quantile(0.5)),
            wait_p99_us: ns_to_us(wait_ns.quantile(0.99)),
            wait_max_us: ns_to_us(wait_ns.max()),
            lost: self.pool.unaccounted(),
            classic: self.bridge.as_ref().map(|b| b.status(&self.pool)),
            controls: Some(self.controls_status()),
            wait_histogram: Some(crate::status::WaitHistogram::of(&wait_ns)),
            clients,
            clients_total,
            handshaking: self.handshakes.live() as u32,
            fast,
            // Read on the broker's thread: status is built there.
            broker_vcsw: herdless_platform::thread_rusage()
                .ok()
                .map(|u| u.voluntary_ctx),
        }
    }

    /// Closes every connection, takes every token back and reports. `lost`
    /// counts shared tokens that are not free once nobody holds any.
    /// At the stop, reads what every connection has already sent: a
    /// client that gave its tokens back and exited just before the stop
    /// (its frames and the stop can reach the loop in either order) did
    /// not die holding them. Acquires read now are answered `Stopped`.
    /// Bounded: at most [`STOP_TURNS`] turns per connection, so a flooding
    /// client cannot hold the shutdown.
    fn read_what_was_sent(&mut self) {
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        for token in tokens {
            for _ in 0..STOP_TURNS {
                self.turn(token, READ_BUDGET);
                if !self.conns.get(&token).is_some_and(|c| c.queued) {
                    break;
                }
            }
        }
        self.flush_dirty();
    }

    fn shut_down(mut self) -> Status {
        // Stop first: no token freed by a closing connection may reach a
        // waiter that is about to be closed too.
        self.stop_granting();
        self.read_what_was_sent();
        let unlogged = self.handshake_log.take();
        if unlogged > 0 {
            log!(
                Level::Warn,
                "closed {unlogged} more connection(s) that had not sent their hello"
            );
        }
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        for token in tokens {
            self.close_at_stop(token);
        }
        // Every client of the shared table is gone: its words come back.
        if let Some(fast) = self.fast.as_ref() {
            fast.table.close_gate();
            self.fast_sweep(true);
        }
        let now = self.now();
        let mut classic = None;
        if let Some(mut bridge) = self.bridge.take() {
            bridge.drain(&mut self.pool, now);
            let _ = self.pool.take_effects();
            classic = Some(bridge.status(&self.pool));
        }
        if let Some(backing) = self.backing.as_mut() {
            backing.balance(&mut self.pool, now);
            let _ = self.pool.take_effects();
            let back = backing.give_back_all();
            log!(
                Level::Info,
                "gave {back} borrowed token(s) back to the outer jobserver at the end"
            );
        }
        let mut report = self.status();
        report.classic = classic;
        // Every connection is closed and the pipe drained: whatever is not
        // free now is lost (classic tokens that never came back).
        report.lost = i64::from(self.pool.shared_in_use())
            + report.classic.as_ref().map_or(0, |c| i64::from(c.lost));
        if let Some((_, ids)) = self.signals.take() {
            for id in ids {
                signal_hook::low_level::unregister(id);
            }
        }
        report
    }
}

fn flush(conn: &mut Conn) -> io::Result<()> {
    let mut written = 0;
    while written < conn.tx.len() {
        match conn.stream.write(&conn.tx[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    conn.tx.drain(..written);
    conn.status_owed = conn.status_owed.saturating_sub(written);
    if conn.tx.is_empty() && conn.tx.capacity() > READ_CHUNK {
        // An idle connection keeps no large buffer.
        conn.tx = Vec::new();
    }
    Ok(())
}

fn protocol_reason(e: &ProtocolError) -> String {
    format!("malformed frame: {e}")
}
