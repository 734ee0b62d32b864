//! A connection to a herdless broker.
//!
//! The socket stays non-blocking; blocking calls wait in `poll(2)` on it, so
//! the same descriptor can be handed to a caller's own poll loop. Several
//! threads may wait at once: one of them reads (the *reader*), the others
//! sleep on a condition variable until the reader has taken what arrived.
//! Grants are fungible, so whichever thread reads one counts it in `ready`
//! and whichever thread wants one takes it from there.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use std::sync::atomic::{AtomicU32, Ordering};

use super::Wait;
use crate::error::{Error, ErrorKind, Result};
use crate::fast::{PollStep, PollWait, Table, WaitEnd};
use crate::protocol::{
    AbortReason, ControlOp, FrameBuffer, HelloFlags, Reply, Request, PROTOCOL_VERSION,
    TAKE_BACK_VERSION,
};
use crate::sync::lock;

/// How long a broker may take to answer the handshake. This is not in the
/// hand-off path: it only bounds how long a client waits on a broker that
/// accepted the connection but never answers.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a client keeps connecting again to a broker that is busy: out
/// of file descriptors, or with too many connections in their handshake.
/// A build that starts more jobs at once than the broker has descriptors
/// waits for running jobs to end instead of failing.
const BUSY_RETRY_FOR: Duration = Duration::from_secs(120);

/// The longest pause between two attempts.
const BUSY_BACKOFF_MAX: Duration = Duration::from_millis(200);

#[derive(Default)]
struct State {
    rx: FrameBuffer,
    /// Acquire requests sent and not yet answered.
    acquires: u32,
    /// Try-acquire requests sent and not yet answered.
    tries: u32,
    /// Cancel requests sent and not yet answered.
    cancels: u32,
    /// Of those, the ones sent by `cancel_nowait`, whose answers nobody
    /// waits for. They are always the oldest of `cancels`: a non-blocking
    /// cancel is not sent while a blocking one is outstanding.
    nowait_cancels: u32,
    /// Grants that arrived for requests a non-blocking cancel came too
    /// late to withdraw: each goes back to the broker as soon as it is
    /// spare (not wanted by a blocked thread).
    owed_releases: u32,
    /// Threads inside a blocking acquire.
    wanting: u32,
    /// Grants received and not yet handed out.
    ready: u32,
    /// One thread is waiting in poll() on the socket.
    reading: bool,
    aborted: Option<AbortReason>,
    /// Why the connection is unusable, once it is.
    dead: Option<(ErrorKind, String)>,
    /// Status replies not yet taken, in arrival order.
    statuses: std::collections::VecDeque<String>,
    /// `Controlled` replies not yet taken.
    controlled: u32,
    /// Answers (a grant, or a try's denial read out of order) that came
    /// for a wait in the table the broker moved to its queue before the
    /// waiting thread counted it.
    moves_answered: u32,
}

pub(crate) struct Native {
    stream: UnixStream,
    path: PathBuf,
    state: Mutex<State>,
    cond: Condvar,
    write_lock: Mutex<()>,
    capacity: u32,
    client_id: u64,
    /// The slot the broker minted for this client's own job.
    slot: u64,
    version: u16,
    /// The shared token table, when the broker gave this client one.
    fast: Option<Fast>,
    /// The hello said [`Ask::elsewhere`]: the broker runs in another PID
    /// namespace.
    elsewhere: bool,
}

impl Ask {
    /// This hello with `extra` flags too.
    fn with(self, extra: HelloFlags) -> Ask {
        Ask {
            flags: self.flags | extra,
            elsewhere: self.elsewhere.map(|f| f | extra),
            ..self
        }
    }
}

/// This client's part of the shared token table (`crate::fast`).
struct Fast {
    table: Table,
    /// This client's id in the table's words.
    owner: u32,
    /// Words this client holds.
    held: AtomicU32,
    /// The word taken last: where the next give-back looks first.
    last: AtomicU32,
    /// A thread of this client waits in the table (one at a time: a
    /// client has one slot there), or its poll loop does.
    waiting: std::sync::atomic::AtomicBool,
    /// Set once the caller's poll loop may wait in the table
    /// ([`Native::enable_poll_handoff`]): what it polls instead of the
    /// socket, readable also when a giver signals this process.
    wake: std::sync::OnceLock<herdless_platform::PollWake>,
    /// The poll loop's wait in the table, while there is one.
    poll: Mutex<Option<PollWait>>,
}

/// Where the caller's poll-loop wait in the table stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PollNow {
    /// It ended in a token: this client holds it.
    Took,
    /// It goes on.
    Waiting,
    /// There is none: the socket serves (a wait the broker moved to its
    /// queue is counted as a request sent).
    Off,
}

/// Waits until `fd` is readable or writable. `Ok(false)` on timeout.
fn wait_fd(fd: BorrowedFd<'_>, flags: PollFlags, deadline: Option<Instant>) -> io::Result<bool> {
    let timeout = match deadline {
        None => PollTimeout::NONE,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            // Round up so a sub-millisecond remainder still waits.
            let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
        }
    };
    let mut fds = [PollFd::new(fd, flags)];
    match nix::poll::poll(&mut fds, timeout) {
        Ok(0) => Ok(false),
        Ok(_) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// A wait that only the answer ends.
const NO_DEADLINE: Wait = Wait {
    deadline: None,
    interruptible: false,
};

/// Takes a grant that no blocked thread of this client is waiting for.
fn take_spare(st: &mut State) -> bool {
    if st.ready > st.wanting {
        st.ready -= 1;
        true
    } else {
        false
    }
}

/// What [`Native::settle_and_take_spare`] found.
enum AtHand<'a> {
    /// A grant had arrived that no blocked thread waits for: the caller
    /// now holds its token.
    Token,
    /// None: the state, drained and settled, to go on with.
    Nothing(MutexGuard<'a, State>),
}

/// Runs `connect` again while `again` says so of its error, with growing
/// pauses (spread between the processes turned away together), for up to
/// [`BUSY_RETRY_FOR`]. Returns its last result, and whether that time ran
/// out.
pub(crate) fn with_pauses<T>(
    mut connect: impl FnMut() -> Result<T>,
    again: impl Fn(&Error) -> bool,
) -> (Result<T>, bool) {
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    let mut attempt: u32 = 0;
    loop {
        match connect() {
            Err(e) if again(&e) => {
                if start.elapsed() >= BUSY_RETRY_FOR {
                    return (Err(e), true);
                }
            }
            done => return (done, false),
        }
        attempt += 1;
        let spread = (std::process::id().wrapping_mul(2_654_435_761) ^ attempt) % 1000;
        std::thread::sleep(pause + pause * spread / 1000);
        pause = (pause * 2).min(BUSY_BACKOFF_MAX);
    }
}

/// Whether a failed connection is worth trying again: the broker said it is
/// busy, closed the connection before its welcome (what a broker out of
/// descriptors may do), or its listen queue is full. A broker that is gone
/// fails the next attempt's `connect` for good.
fn is_busy(e: &Error) -> bool {
    match e.kind() {
        ErrorKind::Refused => e.to_string().contains(crate::protocol::BUSY_PREFIX),
        ErrorKind::BrokerGone => true,
        ErrorKind::Connect => std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<io::Error>())
            .and_then(io::Error::raw_os_error)
            .is_some_and(|n| n == libc::EAGAIN || n == libc::EWOULDBLOCK),
        _ => false,
    }
}

/// The broker at `path` turned this client away, saying `message`. One
/// turned away to keep descriptors free for the process the broker runs
/// in ([`crate::protocol::NO_ROOM_PREFIX`]) carries `EMFILE` for the C ABI.
fn refusal(path: &Path, message: &str) -> Error {
    let text = format!(
        "the broker at {} refused this client: {message}",
        path.display()
    );
    if message.starts_with(crate::protocol::NO_ROOM_PREFIX) {
        let why = io::Error::from_raw_os_error(libc::EMFILE);
        Error::io(ErrorKind::Refused, text, why)
    } else {
        Error::new(ErrorKind::Refused, text)
    }
}

/// A connection whose hello is sent and whose welcome is not read yet
/// ([`Native::start`]).
pub(crate) struct Started {
    native: Native,
    /// What was asked for, without `FAST`.
    ask: Ask,
    /// Whether the hello asked for the shared table.
    fast: bool,
}

/// What a client names in its hello: its flags and slot, and the flags it
/// says instead, naming recipe root 0, where the broker runs in another
/// PID namespace (`crate::client::hello_elsewhere`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ask {
    pub(crate) flags: HelloFlags,
    pub(crate) slot: u64,
    pub(crate) elsewhere: Option<HelloFlags>,
}

impl Ask {
    /// A hello the same in every namespace.
    pub(crate) fn plain(flags: HelloFlags, slot: u64) -> Ask {
        Ask {
            flags,
            slot,
            elsewhere: None,
        }
    }
}

impl Started {
    /// The socket it is connected to.
    pub(crate) fn path(&self) -> &Path {
        &self.native.path
    }

    /// See [`Native::options_seen`].
    pub(crate) fn options_seen(
        &self,
        tree: crate::client::Options,
        elsewhere: crate::client::Options,
    ) -> crate::client::Options {
        self.native.options_seen(tree, elsewhere)
    }

    /// Reads the broker's answer, as [`Native::connect`] does after its
    /// hello. A broker that turned this hello away, busy or older than
    /// this client, is asked again as `connect` asks: with growing pauses
    /// while it is busy, and in [`PROTOCOL_VERSION`], without the table,
    /// when it does not speak [`TAKE_BACK_VERSION`].
    pub(crate) fn finish(self) -> Result<Native> {
        let Started { native, ask, fast } = self;
        let path = native.path.clone();
        match native.handshake(fast) {
            Ok(native) => Ok(native),
            Err(e) if e.kind() == ErrorKind::Refused && !is_busy(&e) && !e.is_no_room() => {
                Native::connect_version(&path, ask, PROTOCOL_VERSION)
            }
            Err(e) if is_busy(&e) => Native::connect(&path, ask),
            Err(e) => Err(e),
        }
    }
}

impl Native {
    /// Connects, checks the broker is this user's, and shakes hands. A
    /// broker that is busy (see [`is_busy`]) is tried again with growing
    /// pauses for up to [`BUSY_RETRY_FOR`].
    pub(crate) fn connect(path: &Path, ask: Ask) -> Result<Native> {
        let first = if Native::asks_for_table(ask.flags) {
            ask.with(HelloFlags::FAST)
        } else {
            ask
        };
        match Native::connect_version(path, first, TAKE_BACK_VERSION) {
            // A broker older than this client refuses the hello (by its
            // version, or by the flag `FAST`, which its decoder may not
            // know): ask again in the oldest version, as a client of the
            // socket alone. A refusal for any other reason comes again,
            // and is reported then.
            Err(e) if e.kind() == ErrorKind::Refused && !e.is_no_room() => {
                Native::connect_version(path, ask, PROTOCOL_VERSION)
            }
            other => other,
        }
    }

    /// The options this client has (`tree`, or `elsewhere` where it said
    /// the hello of a client whose broker is in another PID namespace).
    pub(crate) fn options_seen(
        &self,
        tree: crate::client::Options,
        elsewhere: crate::client::Options,
    ) -> crate::client::Options {
        if self.elsewhere {
            elsewhere
        } else {
            tree
        }
    }

    /// Whether a hello with `flags` asks for the shared table: not for an
    /// observer, nor where it is turned off or the OS has none.
    fn asks_for_table(flags: HelloFlags) -> bool {
        !flags.contains(HelloFlags::OBSERVER)
            && crate::broker::fast_path_wanted()
            && herdless_platform::segment_support().is_ok()
    }

    /// Which way this client takes tokens: `"shared table"` or `"socket"`.
    pub(crate) fn path_in_use(&self) -> &'static str {
        if self.fast.is_some() {
            "shared table"
        } else {
            "socket"
        }
    }

    /// Connects speaking protocol `version` (the broker must speak it),
    /// naming `slot` as the one this client may borrow, trying again while
    /// the broker is busy.
    pub(crate) fn connect_version(path: &Path, ask: Ask, version: u16) -> Result<Native> {
        match with_pauses(|| Native::connect_once(path, ask, version), is_busy) {
            (Err(err), true) => Err(Error::new(
                err.kind(),
                format!(
                    "the broker at {} stayed busy for {} s; last answer: {err}",
                    path.display(),
                    BUSY_RETRY_FOR.as_secs()
                ),
            )),
            (done, _) => done,
        }
    }

    /// Connects and sends the hello, without waiting for the broker's
    /// answer: [`Started::finish`] reads it. A process that has work of
    /// its own to do meanwhile (a make reading its makefiles) does not
    /// sleep for the answer, which has come by then.
    pub(crate) fn start(path: &Path, ask: Ask) -> Result<Started> {
        let fast = Native::asks_for_table(ask.flags);
        let sent = if fast {
            ask.with(HelloFlags::FAST)
        } else {
            ask
        };
        let native = Native::hello(path, sent, TAKE_BACK_VERSION)?;
        Ok(Started { native, ask, fast })
    }

    fn connect_once(path: &Path, ask: Ask, version: u16) -> Result<Native> {
        Native::hello(path, ask, version)?.handshake(ask.flags.contains(HelloFlags::FAST))
    }

    /// Connects, checks the broker is this user's, and sends the hello:
    /// `ask`'s, or where the broker's process id reads 0 here (it runs in
    /// another PID namespace, which Linux alone has), what `ask` says
    /// instead.
    fn hello(path: &Path, ask: Ask, version: u16) -> Result<Native> {
        if std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()).contains(&0) {
            return Err(Error::io(
                ErrorKind::Connect,
                format!("cannot use {} as a socket address", path.display()),
                io::Error::from_raw_os_error(libc::EINVAL),
            ));
        }
        let stream = crate::rundir::connect(path).map_err(|e| {
            if e.kind() == io::ErrorKind::InvalidInput {
                // Too long to reach (crate::rundir::connect says why).
                return Error::io(
                    ErrorKind::Connect,
                    e.to_string(),
                    io::Error::from_raw_os_error(libc::ENAMETOOLONG),
                );
            }
            let what = match e.kind() {
                io::ErrorKind::NotFound => "no herdless broker: socket {} does not exist",
                // Connecting to a file that is not a socket is refused too.
                io::ErrorKind::ConnectionRefused
                    if std::fs::metadata(path).is_ok_and(|m| {
                        !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())
                    }) =>
                {
                    "no herdless broker: {} is not a socket"
                }
                io::ErrorKind::ConnectionRefused => {
                    "no herdless broker listening on {} (stale socket)"
                }
                _ => "cannot connect to the herdless broker at {}",
            };
            Error::io(
                ErrorKind::Connect,
                what.replace("{}", &path.display().to_string()),
                e,
            )
        })?;
        let uid = nix::unistd::geteuid().as_raw();
        // A broker in another PID namespace has no process id here.
        let elsewhere = match herdless_platform::peer_cred(stream.as_fd()) {
            Ok(c) if c.uid != uid => {
                return Err(Error::new(
                    ErrorKind::Connect,
                    format!(
                        "the broker at {} runs as uid {}, not as this user ({uid})",
                        path.display(),
                        c.uid
                    ),
                ))
            }
            Ok(c) => cfg!(target_os = "linux") && c.pid.is_none(),
            Err(e) => {
                return Err(Error::io(
                    ErrorKind::Connect,
                    format!("cannot check who runs the broker at {}", path.display()),
                    e,
                ))
            }
        };
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io(ErrorKind::Io, "cannot make the socket non-blocking", e))?;
        let mut native = Native {
            stream,
            path: path.to_path_buf(),
            state: Mutex::new(State::default()),
            cond: Condvar::new(),
            write_lock: Mutex::new(()),
            capacity: 0,
            client_id: 0,
            slot: 0,
            version,
            fast: None,
            elsewhere: false,
        };
        let (flags, slot) = match ask.elsewhere {
            Some(flags) if elsewhere => {
                native.elsewhere = true;
                (flags, 0)
            }
            _ => (ask.flags, ask.slot),
        };
        let sent = native.send(&Request::Hello {
            version,
            flags,
            pid: std::process::id(),
            slot,
        });
        match sent {
            Ok(()) => {
                let mut native = native;
                if flags.contains(HelloFlags::RUNNER) {
                    // The hello asks for the runner's implicit token too:
                    // its grant comes after the handshake, as an
                    // acquire's ([`Native::take_hello_grant`]).
                    native
                        .state
                        .get_mut()
                        .unwrap_or_else(|e| e.into_inner())
                        .acquires += 1;
                }
                Ok(native)
            }
            // A broker that turned the connection away before the hello
            // came has closed it (EPIPE here): its reason is still there
            // to be read, and says whether to try again.
            Err(e) if e.kind() == ErrorKind::BrokerGone => match native.handshake(false) {
                Err(why) if why.kind() == ErrorKind::Refused => Err(why),
                _ => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    /// Reads the `Welcome`, and with `fast` the `Segment` after it, whose
    /// first byte carries the table's descriptor.
    fn handshake(mut self, fast: bool) -> Result<Native> {
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut welcomed = false;
        let mut fd = None;
        loop {
            let reply = state.rx.next_reply().map_err(|e| {
                Error::new(
                    ErrorKind::Protocol,
                    format!("bad frame from the broker: {e}"),
                )
            })?;
            match reply {
                Some(reply) if !welcomed => {
                    let (capacity, client_id, slot) = welcome(reply, self.version, &self.path)?;
                    self.capacity = capacity;
                    self.client_id = client_id;
                    self.slot = slot;
                    welcomed = true;
                    if !fast {
                        return Ok(self);
                    }
                    continue;
                }
                Some(Reply::Segment { owner, words }) => {
                    if owner != 0 && fd.is_none() {
                        // The broker sent the table's descriptor, and this
                        // process had no room for it (a full descriptor
                        // table): the socket serves, as for a table that
                        // cannot be mapped.
                        crate::log!(
                            crate::log::Level::Info,
                            "no descriptor left for the shared table; tokens go over the socket"
                        );
                    }
                    if let (true, Some(fd)) = (owner != 0, fd.take()) {
                        // A table that cannot be mapped leaves the socket,
                        // which works on its own.
                        // A client in another PID namespace than the
                        // broker's keeps to the socket too: the process
                        // ids the table's waiters are woken by would name
                        // other processes there.
                        if let Some(table) = Table::open(fd, words)
                            .ok()
                            .filter(Table::same_pid_namespace)
                        {
                            self.fast = Some(Fast {
                                table,
                                owner,
                                held: AtomicU32::new(0),
                                last: AtomicU32::new(owner),
                                waiting: std::sync::atomic::AtomicBool::new(false),
                                wake: std::sync::OnceLock::new(),
                                poll: Mutex::new(None),
                            });
                        }
                    }
                    return Ok(self);
                }
                Some(Reply::Error { message }) => return Err(refusal(&self.path, &message)),
                // The answer to a runner's hello, which asks for its
                // implicit token too, may come before the table: the
                // broker lends the token before it sends the descriptor.
                Some(reply @ (Reply::Grant | Reply::Aborted { .. })) if state.acquires > 0 => {
                    Self::fold(state, reply);
                    continue;
                }
                Some(other) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("expected the shared table from the broker, got {other}"),
                    ))
                }
                None => {}
            }
            if let Some(got) =
                read_during_handshake(&self.stream, &mut state.rx, &self.path, deadline)?
            {
                fd = Some(got);
            }
        }
    }

    /// Takes a token from the shared table, if there is one and it is open.
    fn fast_take(&self) -> bool {
        let Some(f) = &self.fast else {
            return false;
        };
        match f.table.take(f.owner, f.last.load(Ordering::Relaxed)) {
            Some(i) => {
                f.last.store(i, Ordering::Relaxed);
                f.held.fetch_add(1, Ordering::SeqCst);
                f.table.nudge_if_asked(false, &|| self.nudge());
                true
            }
            None => false,
        }
    }

    /// Whether this client may wait in the shared table now: the broker
    /// allows it, and nothing of this client's is queued at the broker or
    /// waits in the table already (`st` says). When it may, this thread
    /// is now the one that waits there: [`fast_wait`](Self::fast_wait)
    /// must follow.
    fn may_wait_in_table(&self, st: &State) -> bool {
        let Some(f) = self.fast.as_ref() else {
            return false;
        };
        f.table.waits_here()
            && st.acquires <= st.cancels
            && st.ready == 0
            && st.tries == 0
            && st.wanting == 0
            && st.cancels == 0
            && st.dead.is_none()
            && st.aborted.is_none()
            && f.waiting
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }

    /// A token handed over in the table. When the table has closed since,
    /// the socket may hold an abort: then nothing is handed out, the token
    /// goes back, and the abort is the answer.
    fn after_table_grant(&self) -> Result<bool> {
        let Some(f) = self.fast.as_ref() else {
            return Ok(true);
        };
        if f.table.is_open() {
            return Ok(true);
        }
        let mut st = lock(&self.state);
        self.drain(&mut st);
        if st.aborted.is_some() {
            drop(st);
            self.fast_give_back()?;
            let st = lock(&self.state);
            Self::check(&st)?;
        }
        Ok(true)
    }

    /// The wait [`may_wait_in_table`](Self::may_wait_in_table) allowed.
    /// On [`WaitEnd::Got`] this client holds one more token.
    fn fast_wait(&self, wait: Wait) -> Result<WaitEnd> {
        let f = self.fast.as_ref().expect("a table");
        let end = f
            .table
            .wait_nudging(f.owner, wait.deadline, &|| self.nudge());
        f.waiting.store(false, Ordering::SeqCst);
        let end = end.map_err(|e| Error::io(ErrorKind::Io, "wait in the shared token table", e))?;
        if let WaitEnd::Got(n) = end {
            self.table_got(n)?;
        }
        Ok(end)
    }

    /// Counts `n` tokens handed over in the table as held (the words are
    /// this client's already); more than one (a giver died between its
    /// steps and the broker finished its gift as well) are passed on but
    /// one.
    fn table_got(&self, n: u32) -> Result<()> {
        let f = self.fast.as_ref().expect("a table");
        f.held.fetch_add(n, Ordering::SeqCst);
        if let Some(i) = f.table.held_word(f.owner) {
            f.last.store(i, Ordering::Relaxed);
        }
        for _ in 1..n {
            self.fast_give_back()?;
        }
        Ok(())
    }

    /// Lets the caller's poll loop wait in the shared table
    /// ([`Native::take_grant`]): from now on [`Native::fd`] is a descriptor
    /// that also becomes readable when a giver hands this client a token
    /// and signals this process (`herdless_platform::PollWake`).
    /// `Ok(false)` when there is no table to wait in (the socket serves as
    /// before).
    ///
    /// # Errors
    ///
    /// The program handles the wake-up signal itself, or the descriptors
    /// cannot be made; nothing changes then.
    pub(crate) fn enable_poll_handoff(&self) -> Result<bool> {
        let Some(f) = self.fast.as_ref() else {
            return Ok(false);
        };
        if !f.table.waits_here() {
            return Ok(false);
        }
        if f.wake.get().is_some() {
            return Ok(true);
        }
        let wake = herdless_platform::PollWake::new(self.stream.as_fd()).map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Error::io(
                    ErrorKind::Io,
                    "the program handles SIGURG itself: poll-loop hand-off unavailable",
                    io::Error::from_raw_os_error(libc::EEXIST),
                )
            } else {
                Error::io(ErrorKind::Io, "set up wake-ups for a poll loop", e)
            }
        })?;
        // Another thread that won the race keeps its own.
        let _ = f.wake.set(wake);
        Ok(true)
    }

    /// Where this client's poll-loop wait in the table stands, when it
    /// has one.
    fn poll_step(&self) -> Result<PollNow> {
        let Some(f) = self.fast.as_ref() else {
            return Ok(PollNow::Off);
        };
        let Some(wake) = f.wake.get() else {
            return Ok(PollNow::Off);
        };
        // Before looking: a wake-up after this leaves the descriptor
        // readable for the next look.
        wake.clear();
        let mut slot = lock(&f.poll);
        let Some(w) = *slot else {
            return Ok(PollNow::Off);
        };
        let step = f.table.poll_check(f.owner, w, &|| self.nudge());
        if let PollStep::Waiting(w) = step {
            // The socket is read too, so that what it says (nothing but the
            // end of the connection or an abort is expected while a wait is
            // in the table) does not keep the descriptor readable.
            let mut st = lock(&self.state);
            self.drain(&mut st);
            if st.dead.is_none() && st.aborted.is_none() {
                *slot = Some(w);
                return Ok(PollNow::Waiting);
            }
            drop(st);
            let end = f.table.poll_withdraw(f.owner, w);
            *slot = None;
            f.waiting.store(false, Ordering::SeqCst);
            drop(slot);
            return match end {
                Some(end) => self.poll_ended(end),
                None => Ok(PollNow::Off),
            };
        }
        *slot = None;
        f.waiting.store(false, Ordering::SeqCst);
        drop(slot);
        match step {
            PollStep::Ended(end) => self.poll_ended(end),
            PollStep::Waiting(_) => unreachable!("handled above"),
        }
    }

    /// A poll-loop wait in the table ended in `end`.
    fn poll_ended(&self, end: WaitEnd) -> Result<PollNow> {
        match end {
            WaitEnd::Got(n) => {
                self.table_got(n)?;
                self.after_table_grant()?;
                Ok(PollNow::Took)
            }
            WaitEnd::Moved => {
                // An acquire this client did not send, queued for it:
                // counted as sent (or as answered, if its grant was read
                // already); its grant is then taken as any other.
                let mut st = lock(&self.state);
                self.drain(&mut st);
                if st.moves_answered > 0 {
                    st.moves_answered -= 1;
                } else {
                    st.acquires += 1;
                }
                Ok(if Self::hand_out_spare(&mut st)? {
                    PollNow::Took
                } else {
                    PollNow::Off
                })
            }
            WaitEnd::Closed | WaitEnd::Gone | WaitEnd::TimedOut => Ok(PollNow::Off),
        }
    }

    /// Withdraws this client's poll-loop wait in the table, if it has one:
    /// whether a token came first (this client holds it now). A wait the
    /// broker had moved is counted as a queued request, for the caller to
    /// withdraw on the socket.
    fn poll_withdraw(&self) -> Result<bool> {
        let Some(f) = self.fast.as_ref() else {
            return Ok(false);
        };
        let mut slot = lock(&f.poll);
        let Some(w) = slot.take() else {
            return Ok(false);
        };
        let end = f.table.poll_withdraw(f.owner, w);
        f.waiting.store(false, Ordering::SeqCst);
        drop(slot);
        match end {
            None => Ok(false),
            Some(end) => Ok(self.poll_ended(end)? == PollNow::Took),
        }
    }

    /// Whether the caller's poll loop may start a wait in the table now
    /// (`st` says): when it may, [`poll_start`](Self::poll_start) must
    /// follow.
    fn may_poll_in_table(&self, st: &State) -> bool {
        self.fast.as_ref().is_some_and(|f| f.wake.get().is_some()) && self.may_wait_in_table(st)
    }

    /// Starts the poll-loop wait that
    /// [`may_poll_in_table`](Self::may_poll_in_table) allowed.
    fn poll_start(&self) -> Result<PollNow> {
        let f = self.fast.as_ref().expect("a table");
        let mut slot = lock(&f.poll);
        match f
            .table
            .poll_start(f.owner, std::process::id(), &|| self.nudge())
        {
            PollStep::Waiting(w) => {
                *slot = Some(w);
                Ok(PollNow::Waiting)
            }
            PollStep::Ended(end) => {
                f.waiting.store(false, Ordering::SeqCst);
                drop(slot);
                self.poll_ended(end)
            }
        }
    }

    /// Tells the broker that a wait started in the table, as it asked
    /// (`crate::fast`, `H_NOTIFY`). A failure shows at the next socket
    /// read.
    fn nudge(&self) {
        let _ = self.send(&Request::Returned);
    }

    /// Whether the caller's poll loop waits in the table now.
    fn poll_waiting(&self) -> bool {
        self.fast.as_ref().is_some_and(|f| lock(&f.poll).is_some())
    }

    /// Gives back a token taken from the shared table, if this client holds
    /// one; tells the broker when the table has closed meanwhile.
    fn fast_give_back(&self) -> Result<bool> {
        let Some(f) = &self.fast else {
            return Ok(false);
        };
        if f.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| h.checked_sub(1))
            .is_err()
        {
            return Ok(false);
        }
        match f
            .table
            .give_back(f.owner, Some(f.last.load(Ordering::Relaxed)))
        {
            Some(false) => Ok(true),
            Some(true) => {
                self.send(&Request::Returned)?;
                Ok(true)
            }
            // The broker took this client's words back (it closed the
            // connection, or stopped): the socket says why.
            None => Ok(false),
        }
    }

    pub(crate) fn slot(&self) -> u64 {
        self.slot
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    pub(crate) fn client_id(&self) -> u64 {
        self.client_id
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// What a caller's poll loop polls: the socket, or once
    /// [`enable_poll_handoff`](Self::enable_poll_handoff) succeeded, a
    /// descriptor readable also when a token is handed over in the table.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self.fast.as_ref().and_then(|f| f.wake.get()) {
            Some(w) => w.fd(),
            None => self.stream.as_fd(),
        }
    }

    fn send(&self, req: &Request) -> Result<()> {
        let mut frame = Vec::with_capacity(32);
        req.encode(&mut frame);
        let _guard = lock(&self.write_lock);
        let mut written = 0;
        while written < frame.len() {
            match (&self.stream).write(&frame[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The broker reads eagerly; this only waits for it to
                    // catch up with a burst.
                    match wait_fd(self.stream.as_fd(), PollFlags::POLLOUT, None) {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            return Err(Error::io(
                                ErrorKind::BrokerGone,
                                "writing to the broker",
                                e,
                            ))
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(Error::io(
                        ErrorKind::BrokerGone,
                        format!("the broker at {} is gone", self.path.display()),
                        e,
                    ))
                }
            }
        }
        Ok(())
    }

    /// Reads whatever has arrived, without blocking, and folds it into the
    /// state.
    /// Reads what has arrived, unless another thread is the reader: only
    /// the reader reads the socket while it waits in `poll`, or a frame it
    /// is waiting for could be taken from under it and its `poll` would
    /// never return. It folds what it reads in as soon as `poll` returns.
    fn drain(&self, st: &mut State) {
        if !st.reading {
            self.read_socket(st);
        }
    }

    /// Reads whatever has arrived, without blocking, and folds it into the
    /// state.
    fn read_socket(&self, st: &mut State) {
        let mut buf = [0u8; 4096];
        while st.dead.is_none() {
            match (&self.stream).read(&mut buf) {
                Ok(0) => {
                    st.dead = Some((
                        ErrorKind::BrokerGone,
                        format!(
                            "the broker at {} closed the connection",
                            self.path.display()
                        ),
                    ));
                }
                Ok(n) => st.rx.extend(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    st.dead = Some((
                        ErrorKind::BrokerGone,
                        format!("the broker at {} is gone: {e}", self.path.display()),
                    ));
                }
            }
        }
        loop {
            match st.rx.next_reply() {
                Ok(None) => break,
                Ok(Some(reply)) => Self::fold(st, reply),
                Err(e) => {
                    st.dead = Some((
                        ErrorKind::Protocol,
                        format!("bad frame from the broker: {e}"),
                    ));
                    break;
                }
            }
        }
        self.give_back_owed(st);
    }

    /// Gives back grants that a non-blocking cancel came too late for, as
    /// soon as no blocked thread of this client wants them.
    fn give_back_owed(&self, st: &mut State) {
        while st.owed_releases > 0 && st.ready > st.wanting && st.dead.is_none() {
            st.owed_releases -= 1;
            st.ready -= 1;
            if let Err(e) = self.send(&Request::Release) {
                st.dead.get_or_insert((e.kind(), e.to_string()));
            }
        }
    }

    /// Waits for the answers to non-blocking cancels, so that what this
    /// client holds and owes is settled before it takes or asks for more.
    /// Usually nothing to wait for; otherwise one round trip.
    fn settle_nowait<'a>(&'a self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        if st.nowait_cancels == 0 {
            return st;
        }
        let (st, _) = self.wait_until(st, NO_DEADLINE, |s| s.nowait_cancels == 0);
        st
    }

    fn fold(st: &mut State, reply: Reply) {
        match reply {
            Reply::Grant => {
                // A try is answered at once and no acquire is sent while
                // one is outstanding, so a grant answers the try first.
                if st.tries > 0 {
                    st.tries -= 1;
                } else if st.acquires > 0 {
                    st.acquires -= 1;
                } else {
                    // The grant of a moved wait not yet counted.
                    st.moves_answered += 1;
                }
                st.ready += 1;
            }
            Reply::Denied => {
                if st.tries > 0 {
                    st.tries -= 1;
                } else {
                    // The grant before it, taken as the try's answer, was
                    // a moved wait's: the try was denied.
                    st.moves_answered += 1;
                }
            }
            Reply::Cancelled { cancelled } => {
                st.cancels = st.cancels.saturating_sub(1);
                if cancelled {
                    st.acquires = st.acquires.saturating_sub(1);
                }
                if st.nowait_cancels > 0 {
                    st.nowait_cancels -= 1;
                    if !cancelled {
                        // The request had been granted: the grant arrived
                        // before this answer, and nobody wants it.
                        st.owed_releases += 1;
                    }
                }
            }
            Reply::TakenBack => {
                // The broker took back the token of a grant read since
                // the `CancelNowait` was sent: that grant is void. Such a
                // grant is never handed out before this answer (see
                // `cancel_nowait`).
                st.cancels = st.cancels.saturating_sub(1);
                st.nowait_cancels = st.nowait_cancels.saturating_sub(1);
                if st.ready > 0 {
                    st.ready -= 1;
                } else {
                    st.dead = Some((
                        ErrorKind::Protocol,
                        "the broker took back a token this client had no grant for".into(),
                    ));
                }
            }
            Reply::Aborted { reason } => {
                st.aborted.get_or_insert(reason);
                // The broker ends every pending request with the abort.
                st.acquires = 0;
                st.tries = 0;
                st.owed_releases = 0;
            }
            Reply::Status { json } => st.statuses.push_back(json),
            Reply::Controlled => st.controlled += 1,
            Reply::Error { message } if message == crate::protocol::STOPPING_MESSAGE => {
                st.dead = Some((ErrorKind::BrokerGone, message));
            }
            Reply::Error { message } => {
                st.dead = Some((
                    ErrorKind::Refused,
                    format!("the broker closed this client: {message}"),
                ));
            }
            Reply::Welcome { .. } | Reply::Segment { .. } => {
                st.dead = Some((
                    ErrorKind::Protocol,
                    format!("a second {reply} from the broker"),
                ));
            }
        }
    }

    /// Fails once an abort has reached this client, or the connection is
    /// over.
    fn check(st: &State) -> Result<()> {
        if let Some(reason) = st.aborted {
            return Err(Error::new(
                ErrorKind::Aborted(reason),
                format!("the build was aborted ({reason})"),
            ));
        }
        Self::check_alive(st)
    }

    /// Fails once the connection is over: the broker is gone, stopped or
    /// closed this client.
    fn check_alive(st: &State) -> Result<()> {
        match &st.dead {
            Some((kind, msg)) => Err(Error::new(*kind, msg.clone())),
            None => Ok(()),
        }
    }

    /// Takes a grant that has arrived and that no blocked thread waits
    /// for. After an abort nothing is handed out, not even a grant that
    /// arrived before it (the broker takes it back with the connection):
    /// the abort is the answer.
    fn hand_out_spare(st: &mut State) -> Result<bool> {
        Self::check(st)?;
        Ok(take_spare(st))
    }

    /// Locks the state, folds in what the broker sent, and waits for the
    /// answers to non-blocking cancels, so that what this client holds and
    /// owes is known before it takes or asks for more.
    fn settled(&self) -> MutexGuard<'_, State> {
        let mut st = lock(&self.state);
        self.drain(&mut st);
        self.settle_nowait(st)
    }

    /// How every taking operation begins: [`settled`](Self::settled), then
    /// [`hand_out_spare`](Self::hand_out_spare).
    fn settle_and_take_spare(&self) -> Result<AtHand<'_>> {
        let mut st = self.settled();
        if Self::hand_out_spare(&mut st)? {
            return Ok(AtHand::Token);
        }
        Ok(AtHand::Nothing(st))
    }

    /// Blocks until `done` holds, the connection dies, or the wait ends.
    /// Returns `Ok(false)` when the deadline passed.
    fn wait_until<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        wait: Wait,
        done: impl Fn(&State) -> bool,
    ) -> (MutexGuard<'a, State>, Result<bool>) {
        loop {
            if done(&st) || st.dead.is_some() || st.aborted.is_some() {
                return (st, Ok(true));
            }
            if st.reading {
                st = match wait.deadline {
                    None => self.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return (st, Ok(false));
                        }
                        self.cond
                            .wait_timeout(st, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                };
                continue;
            }
            st.reading = true;
            drop(st);
            let polled = wait_fd(self.stream.as_fd(), PollFlags::POLLIN, wait.deadline);
            st = lock(&self.state);
            st.reading = false;
            self.read_socket(&mut st);
            self.cond.notify_all();
            match polled {
                Ok(true) => {}
                Ok(false) => {
                    if done(&st) {
                        return (st, Ok(true));
                    }
                    return (st, Ok(false));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    if wait.interruptible && !done(&st) {
                        return (
                            st,
                            Err(Error::new(
                                ErrorKind::Interrupted,
                                "interrupted by a signal",
                            )),
                        );
                    }
                }
                Err(e) => {
                    return (
                        st,
                        Err(Error::io(ErrorKind::Io, "poll on the broker socket", e)),
                    )
                }
            }
        }
    }

    /// Takes one token from the pool, waiting as `wait` allows. `Ok(false)`
    /// when the deadline passed (the request is withdrawn first, so no
    /// token is left behind at the broker).
    pub(crate) fn acquire(&self, wait: Wait) -> Result<bool> {
        if self.fast_take() {
            return Ok(true);
        }
        // Straight to the table when this client has nothing at the
        // broker: what the socket could say (an abort, a stop) closes the
        // table, which ends the wait there, so it need not be read first.
        // An interruptible wait keeps to the socket: interrupted, its
        // request must stay queued at the broker for the next call, as it
        // is there from the start.
        let in_table = !wait.interruptible && self.may_wait_in_table(&lock(&self.state));
        let mut counted = None;
        if in_table {
            match self.fast_wait(wait) {
                Ok(WaitEnd::Got(_)) => return self.after_table_grant(),
                Ok(WaitEnd::TimedOut) => return Ok(false),
                Ok(WaitEnd::Moved) => {
                    // An acquire this client did not send: counted as
                    // sent (or as answered, if its grant was read
                    // already), and wanted, under one lock.
                    let mut st = lock(&self.state);
                    if st.moves_answered > 0 {
                        st.moves_answered -= 1;
                    } else {
                        st.acquires += 1;
                    }
                    st.wanting += 1;
                    self.drain(&mut st);
                    counted = Some(self.settle_nowait(st));
                }
                // Sent to the broker, or the broker is gone (the socket
                // says so): the socket path goes on.
                Ok(WaitEnd::Closed | WaitEnd::Gone) => {}
                Err(e) => return Err(e),
            }
        }
        let mut st = match counted {
            Some(st) => st,
            None => {
                let AtHand::Nothing(mut st) = self.settle_and_take_spare()? else {
                    return Ok(true);
                };
                st.wanting += 1;
                st
            }
        };
        let result = loop {
            if let Some(end) = Self::grant_or_end(&mut st) {
                break end.map(|()| true);
            }
            // Wait for an outstanding try to be answered before asking, so
            // every grant can be matched to its request.
            if st.tries == 0 {
                while st.acquires + st.ready < st.wanting {
                    if let Err(e) = self.send(&Request::Acquire) {
                        st.dead.get_or_insert((e.kind(), e.to_string()));
                        break;
                    }
                    st.acquires += 1;
                }
            }
            let (guard, r) = self.wait_until(st, wait, |s| {
                s.ready > 0 || s.tries == 0 && s.acquires + s.ready < s.wanting
            });
            st = guard;
            match r {
                Ok(true) => {}
                Ok(false) => {
                    st.wanting -= 1;
                    st = self.withdraw(st);
                    // An abort or a dead broker says more than the timeout.
                    return Self::hand_out_spare(&mut st);
                }
                Err(e) => break Err(e),
            }
        };
        st.wanting -= 1;
        result
    }

    /// How a wait for a grant ends, if it does now: with what the broker
    /// or the connection said (an abort, a stop, a dead broker), or with a
    /// grant that came (taken from `ready`).
    fn grant_or_end(st: &mut State) -> Option<Result<()>> {
        if let Err(e) = Self::check(st) {
            return Some(Err(e));
        }
        if st.ready > 0 {
            st.ready -= 1;
            return Some(Ok(()));
        }
        None
    }

    /// Takes the token a hello with [`HelloFlags::RUNNER`] asked for (a
    /// make's implicit token: its recipe's slot, or a shared token while
    /// another process of the recipe holds the slot), waiting as long as
    /// it takes; interrupted by a signal, the request stays queued for the
    /// next call. Never from the shared table: the broker answers it.
    pub(crate) fn take_hello_grant(&self) -> Result<()> {
        let wait = Wait {
            deadline: None,
            interruptible: true,
        };
        let AtHand::Nothing(mut st) = self.settle_and_take_spare()? else {
            return Ok(());
        };
        st.wanting += 1;
        let result = loop {
            if let Some(end) = Self::grant_or_end(&mut st) {
                break end;
            }
            if st.acquires == 0 {
                break Err(Error::new(
                    ErrorKind::NotHolding,
                    "this connection's hello asked for no implicit token, or it was taken",
                ));
            }
            let (guard, r) = self.wait_until(st, wait, |s| s.ready > 0);
            st = guard;
            if let Err(e) = r {
                break Err(e);
            }
        };
        st.wanting -= 1;
        result
    }

    /// After a timeout: cancels requests nobody wants any more and waits
    /// for the answers (a grant that raced the cancel stays in `ready`).
    fn withdraw<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.send_cancels(&mut st);
        let (guard, _) = self.wait_until(st, NO_DEADLINE, |s| s.cancels == 0);
        guard
    }

    /// Sends a `Cancel` for each acquire beyond what blocked threads still
    /// want (their places in the queue are kept).
    fn send_cancels(&self, st: &mut State) {
        while st.acquires > st.cancels && st.acquires - st.cancels + st.ready > st.wanting {
            if self.send(&Request::Cancel).is_err() {
                break;
            }
            st.cancels += 1;
        }
    }

    /// Asks for a token without waiting for one to be released.
    pub(crate) fn try_acquire(&self) -> Result<bool> {
        if self.fast_take() {
            return Ok(true);
        }
        let AtHand::Nothing(st) = self.settle_and_take_spare()? else {
            return Ok(true);
        };
        if st.acquires > 0 {
            // A grant for the pending acquire will come; asking again could
            // not be told apart from it.
            return Ok(false);
        }
        let (_st, took) = self.ask_for_free(st)?;
        Ok(took)
    }

    /// Asks the broker for a token that is free now and waits for its
    /// answer. Returns whether this client took one, and the state.
    fn ask_for_free<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<(MutexGuard<'a, State>, bool)> {
        self.send(&Request::TryAcquire)?;
        st.tries += 1;
        let (mut st, r) = self.wait_until(st, NO_DEADLINE, |s| s.tries == 0);
        r?;
        let took = Self::hand_out_spare(&mut st)?;
        Ok((st, took))
    }

    /// Takes a grant that has arrived, or with `try_first` a token that is
    /// free now (one round trip); otherwise makes sure one request is
    /// queued, so the socket becomes readable when it is granted. Never
    /// waits for a token to be released; without `try_first` never waits
    /// for the broker at all.
    pub(crate) fn take_grant(&self, try_first: bool) -> Result<bool> {
        match self.poll_step()? {
            PollNow::Took => return Ok(true),
            PollNow::Waiting => return Ok(false),
            PollNow::Off => {}
        }
        let AtHand::Nothing(mut st) = self.settle_and_take_spare()? else {
            return Ok(true);
        };
        if self.fast_take() {
            return Ok(true);
        }
        if st.acquires + st.ready > st.wanting || st.tries > 0 {
            // A request of this client's is queued: its grant will come.
            return Ok(false);
        }
        // The table's hand-off reaches the caller's poll loop too: wait
        // there, with no message to the broker.
        if self.may_poll_in_table(&st) {
            drop(st);
            match self.poll_start()? {
                PollNow::Took => return Ok(true),
                PollNow::Waiting => return Ok(false),
                PollNow::Off => {}
            }
            st = lock(&self.state);
            self.drain(&mut st);
            if st.acquires + st.ready > st.wanting || st.tries > 0 {
                // Moved to the broker's queue at once.
                return Ok(false);
            }
        }
        if !try_first {
            self.send(&Request::Acquire)?;
            st.acquires += 1;
            return Ok(false);
        }
        // Nothing queued: ask for a free token first, so one that is free
        // now is handed over at once rather than after a pass through the
        // caller's poll loop.
        let (mut st, took) = self.ask_for_free(st)?;
        if took {
            return Ok(true);
        }
        if st.acquires + st.ready <= st.wanting {
            self.send(&Request::Acquire)?;
            st.acquires += 1;
        }
        Ok(false)
    }

    /// Withdraws, without waiting for the broker's answer, every request
    /// beyond what blocked threads still want, and gives back any grant
    /// that arrived for them. Nothing is held or owed afterwards.
    ///
    /// A grant that races the withdrawal (sent before the broker read it)
    /// is taken back by the broker at once where it speaks
    /// [`TAKE_BACK_VERSION`] (`CancelNowait`, answered `TakenBack`): the
    /// token goes to the next waiter while this client is still unaware
    /// of it, and the grant is void when read. Such a grant is never
    /// handed out first: every caller that takes a spare grant waits for
    /// the answers to these withdrawals (`settle_nowait`), and blocked
    /// threads are not withdrawn for, so they take at most the grants
    /// that stay. With an older broker the grant goes back when it is
    /// read, at this client's next call that reads the socket.
    pub(crate) fn cancel_nowait(&self) -> Result<()> {
        if self.poll_withdraw()? {
            // Handed over before the withdrawal: it goes on at once.
            self.release()?;
        }
        let mut st = lock(&self.state);
        self.drain(&mut st);
        Self::check_alive(&st)?;
        if st.aborted.is_some() {
            // The broker ended every request with the abort.
            return Ok(());
        }
        // Grants beyond what blocked threads want go back, but for those
        // that may be void: while earlier withdrawals are unanswered, a
        // grant that raced one of them is taken back by the broker itself
        // (its `TakenBack` is on the way), and giving it back too would
        // take a token this client really holds off the broker's books.
        // No request is sent while they are unanswered, so every such
        // grant raced one. A moved wait's grant belongs to its thread.
        while st.ready > st.wanting + st.nowait_cancels + st.moves_answered {
            st.ready -= 1;
            self.send(&Request::Release)?;
        }
        if st.cancels > st.nowait_cancels {
            // A blocking withdrawal is under way; it withdraws these too.
            return Ok(());
        }
        let cancel = if self.version >= TAKE_BACK_VERSION {
            Request::CancelNowait
        } else {
            Request::Cancel
        };
        while st.acquires > st.cancels && st.acquires - st.cancels > st.wanting {
            self.send(&cancel)?;
            st.cancels += 1;
            st.nowait_cancels += 1;
        }
        Ok(())
    }

    /// Whether a request of this client is queued at the broker beyond
    /// what its blocked threads wait for, or a grant for one has arrived
    /// and is not taken yet.
    pub(crate) fn pending(&self) -> Result<bool> {
        if self.poll_waiting() {
            return Ok(true);
        }
        let mut st = lock(&self.state);
        self.drain(&mut st);
        Self::check_alive(&st)?;
        if st.aborted.is_some() {
            return Ok(false);
        }
        // While withdrawals nobody waits for are unanswered, a grant beyond
        // what blocked threads want raced one of them: the broker takes it
        // back (or it is given back when the answer comes), so it is not
        // pending for the caller, who withdrew every such request.
        let ready = if st.nowait_cancels > 0 {
            st.ready.min(st.wanting)
        } else {
            st.ready
        };
        let queued = st.acquires.saturating_sub(st.cancels) + ready + st.tries;
        Ok(queued > st.wanting)
    }

    /// Withdraws a request left by `take_grant` or an interrupted acquire
    /// that is no longer wanted. Returns whether a grant had arrived anyway
    /// (the caller now holds that token).
    pub(crate) fn cancel_pending(&self) -> Result<bool> {
        if self.poll_withdraw()? {
            return Ok(true);
        }
        let st = self.settled();
        // Withdraws only requests beyond what blocked threads still want,
        // so their places in the queue are kept.
        let mut st = self.withdraw(st);
        // A grant that arrived and that no blocked thread waits for is the
        // caller's.
        Self::hand_out_spare(&mut st)
    }

    /// Before the connection closes on purpose: withdraws a wait still
    /// pending (in the table or at the broker) and waits until `deadline`
    /// for the broker's answers to every withdrawal, blocking or not, so
    /// that a token that was handed over or granted meanwhile is known.
    /// Returns how many tokens that brought: they are the caller's now, to
    /// give back. Without it, such a token would go back only as the
    /// connection closes, counted as taken back from a client that died.
    /// Past the deadline (a broker that does not answer) it returns what it
    /// has; the broker takes the rest back when the connection closes.
    pub(crate) fn settle_for_close(&self, deadline: Instant) -> Result<u32> {
        let mut got = u32::from(self.poll_withdraw()?);
        let mut st = lock(&self.state);
        self.drain(&mut st);
        self.send_cancels(&mut st);
        let wait = Wait {
            deadline: Some(deadline),
            interruptible: false,
        };
        let (mut st, _) = self.wait_until(st, wait, |s| s.cancels == 0 && s.nowait_cancels == 0);
        while take_spare(&mut st) {
            got += 1;
        }
        Ok(got)
    }

    pub(crate) fn release(&self) -> Result<()> {
        // A connection known to be over holds nothing: the broker took its
        // table words back when it closed it.
        self.alive()?;
        if self.fast_give_back()? {
            return Ok(());
        }
        self.send(&Request::Release)
    }

    pub(crate) fn abort(&self, reason: AbortReason) -> Result<()> {
        self.alive()?;
        self.send(&Request::Abort { reason })
    }

    /// Waits until the broker has told this client of an abort: every
    /// client of the pool but an observer is told, so after a
    /// [`Native::abort`] this returns once the broker has taken it, and
    /// no token is granted after that, through the shared table or the
    /// socket.
    pub(crate) fn wait_aborted(&self) -> Result<()> {
        let st = lock(&self.state);
        let (st, r) = self.wait_until(st, NO_DEADLINE, |s| s.aborted.is_some());
        r?;
        if st.aborted.is_some() {
            return Ok(());
        }
        Self::check_alive(&st)?;
        Err(Error::new(ErrorKind::Protocol, "no answer from the broker"))
    }

    /// Fails once this client has learnt that the broker is gone or has
    /// stopped: a write to a connection the broker is about to close may
    /// still succeed, and would report a release that nobody takes.
    fn alive(&self) -> Result<()> {
        Self::check_alive(&lock(&self.state))
    }

    /// The abort posted to the tree, if one has reached this client.
    pub(crate) fn aborted(&self) -> Option<AbortReason> {
        let mut st = lock(&self.state);
        if !st.reading {
            self.drain(&mut st);
        }
        st.aborted
    }

    /// Sends a control request and waits for the broker's `Controlled`.
    pub(crate) fn control(&self, op: ControlOp) -> Result<()> {
        let st = lock(&self.state);
        self.send(&Request::Control(op))?;
        let (mut st, r) = self.wait_until(st, NO_DEADLINE, |s| s.controlled > 0);
        r?;
        if st.controlled > 0 {
            st.controlled -= 1;
            return Ok(());
        }
        Self::check_alive(&st)?;
        Err(Error::new(ErrorKind::Protocol, "no answer from the broker"))
    }

    /// The broker's status report, as JSON.
    pub(crate) fn status(&self) -> Result<String> {
        let st = lock(&self.state);
        self.send(&Request::Status)?;
        // Replies come in request order; any one of them will do.
        let (mut st, r) = self.wait_until(st, NO_DEADLINE, |s| !s.statuses.is_empty());
        r?;
        match st.statuses.pop_front() {
            Some(json) => Ok(json),
            None => {
                Self::check_alive(&st)?;
                Err(Error::new(ErrorKind::Protocol, "no status from the broker"))
            }
        }
    }
}

/// The broker's answer to a hello: its capacity, this client's id and the
/// slot minted for it, or why it refused.
fn welcome(reply: Reply, want: u16, path: &Path) -> Result<(u32, u64, u64)> {
    match reply {
        Reply::Welcome {
            version,
            capacity,
            client_id,
            slot,
        } if version == want => Ok((capacity, client_id, slot)),
        Reply::Welcome { version, .. } => Err(Error::new(
            ErrorKind::Protocol,
            format!("broker speaks protocol {version}, this client {want}"),
        )),
        Reply::Error { message } => Err(refusal(path, &message)),
        other => Err(Error::new(
            ErrorKind::Protocol,
            format!("expected a welcome from the broker, got {other}"),
        )),
    }
}

/// Reads what the broker sent during the handshake into `rx`, waiting for
/// it until `deadline`.
fn read_during_handshake(
    stream: &UnixStream,
    rx: &mut FrameBuffer,
    path: &Path,
    deadline: Instant,
) -> Result<Option<std::os::fd::OwnedFd>> {
    let mut buf = [0u8; 256];
    // `recvmsg`, not `read`: the table's descriptor may come with these
    // bytes, and a plain read would drop it.
    match herdless_platform::recv_with_fd(stream.as_fd(), &mut buf) {
        Ok((0, _)) => Err(Error::new(
            ErrorKind::BrokerGone,
            format!(
                "the broker at {} closed the connection during the handshake",
                path.display()
            ),
        )),
        Ok((n, fd)) => {
            rx.extend(&buf[..n]);
            Ok(fd)
        }
        Err(e) => read_error_during_handshake(stream, e, path, deadline),
    }
}

fn read_error_during_handshake(
    stream: &UnixStream,
    e: io::Error,
    path: &Path,
    deadline: Instant,
) -> Result<Option<std::os::fd::OwnedFd>> {
    match e {
        e if e.kind() == io::ErrorKind::WouldBlock => {
            let ready = match wait_fd(stream.as_fd(), PollFlags::POLLIN, Some(deadline)) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => true,
                r => r.map_err(|e| Error::io(ErrorKind::Io, "poll on the broker socket", e))?,
            };
            if ready {
                return Ok(None);
            }
            Err(Error::new(
                ErrorKind::Connect,
                format!(
                    "the broker at {} did not answer within {} s",
                    path.display(),
                    HANDSHAKE_TIMEOUT.as_secs()
                ),
            ))
        }
        e if e.kind() == io::ErrorKind::Interrupted => Ok(None),
        e => Err(Error::io(
            ErrorKind::BrokerGone,
            "reading the broker's welcome",
            e,
        )),
    }
}
