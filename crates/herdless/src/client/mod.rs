//! The client: takes job tokens from a herdless broker, or from a classic
//! jobserver (GNU make, cargo, bmake) when no broker is named.
//!
//! ```no_run
//! let client = herdless::Client::from_env()?;
//! let token = client.acquire()?;   // waits; exactly this process is woken
//! // … run one job …
//! drop(token);                     // gives the token back
//! # Ok::<(), herdless::client::Error>(())
//! ```
//!
//! # The implicit token
//!
//! Every process that takes part in a jobserver owns one implicit token: it
//! may always run one job without asking (ARCHITECTURE §4.5). A client made with
//! [`Options::implicit_token`] (the default of [`Client::from_env`]) hands
//! that token out first, without a round trip to the broker; only while it
//! is in use do further acquires go to the broker. That is what keeps nested
//! tools progressing with zero spare tokens.
//!
//! A client made with [`Options::job_of_runner_above`] is itself a *job* of the
//! job runner above it (what `herdless exec` is): it owns no implicit
//! token, but the broker may lend it the runner's, when no other job of
//! that runner holds it. Which runner that is is handed down, never guessed
//! from process ids: each runner's slot is named in [`SLOT_ENV`]
//! (`HERDLESS_SLOT`), which `herdless run` sets for its command and
//! `herdless exec` for its own (see [`Client::job_env`]), so any number of
//! subshells, `timeout`s or `xargs` between a runner and its jobs share the
//! one slot. A make does not set it for its recipes; a job that sees a
//! different `MAKELEVEL` from the one recorded in `HERDLESS_SLOT` is a job
//! of a make recipe, and shares the recipe's slot (below).
//!
//! Under a classic jobserver there is no broker to lend that slot; see
//! [`crate::classic`] for how a job of a make recipe finds its slot there.
//! The same rule names a recipe's slot for the broker.
//!
//! # Backends
//!
//! [`Client::from_env`] connects to the broker named by `HERDLESS_SOCKET`
//! when it is set, unless a classic jobserver lies between
//! ([`jobserver_between`]: a stock make's own `-jN` group). Otherwise it
//! uses the classic jobserver named in
//! `CARGO_MAKEFLAGS`, `MAKEFLAGS` or `MFLAGS` ([`crate::classic`]). Every
//! call below works on both, except the status report, which only a broker
//! gives.
//!
//! # Integrating with a poll loop
//!
//! [`Client::as_fd`] is the socket to the broker, or under a classic
//! jobserver this client's own read description of the token pipe. Call
//! [`Client::take_grant`]: it returns a token if one has arrived, otherwise
//! it makes sure one is requested and returns `None`; the descriptor becomes
//! readable when the grant arrives (or when the broker goes away or the
//! tree aborts, which the next call reports).
//!
//! # Errors
//!
//! A missing broker, a dead broker and a broker of another user are errors
//! the caller sees at once: blocking calls never hang on a broker that is
//! gone, because its socket reads end-of-file the moment it dies.

mod classic;
mod native;

use classic::{Classic, Got};

use crate::classic::{Auth, Jobserver};

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::error::{Error, ErrorKind, Result};
use native::{Ask, Native};

use crate::protocol::{AbortReason, HelloFlags};

/// The environment variable naming the broker's socket.
pub const SOCKET_ENV: &str = "HERDLESS_SOCKET";

/// The environment variable naming the slot of the job runner above: its
/// value is [`slot_env_value`].
pub const SLOT_ENV: &str = "HERDLESS_SLOT";

/// The environment variable in which a make with herdless inside names
/// itself to the jobs it runs ([`runner_env_value`]): a job of its
/// recipes finds its recipe's slot below that process whatever the make's
/// file is called (the process tree is otherwise read by command names,
/// and a make installed as `hbmake` would not be known as one).
pub const RUNNER_ENV: &str = "HERDLESS_RUNNER";

/// The value of [`RUNNER_ENV`] for this process: its process id, and,
/// where the OS tells, `:` and its PID namespace's inode number. A job in
/// another PID namespace (a recipe's `bwrap --unshare-pid`, a container
/// given the environment) numbers processes otherwise, and ignores it.
pub fn runner_env_value() -> String {
    let pid = std::process::id();
    match herdless_platform::pid_namespace() {
        Some(ns) => format!("{pid}:{ns}"),
        None => pid.to_string(),
    }
}

/// The process [`RUNNER_ENV`] names, if its value is one this process may
/// go by: a process id above 1, in this process's PID namespace where the
/// value names one.
pub(crate) fn runner_named_in_env() -> Option<u32> {
    let value = std::env::var(RUNNER_ENV).ok()?;
    parse_runner_env(&value, herdless_platform::pid_namespace())
}

/// Parses a [`RUNNER_ENV`] value, given this process's PID namespace.
fn parse_runner_env(value: &str, own_ns: Option<u32>) -> Option<u32> {
    let (pid, ns) = match value.split_once(':') {
        Some((pid, ns)) => (pid, Some(ns.parse::<u32>().ok()?)),
        None => (value, None),
    };
    let pid = pid.parse::<u32>().ok().filter(|&p| p > 1)?;
    match (ns, own_ns) {
        (Some(ns), Some(own)) if ns != own => None,
        (Some(_), None) => None,
        _ => Some(pid),
    }
}

/// The value of [`SLOT_ENV`] for slot `id`: the id in hex, `/`, and the
/// `MAKELEVEL` of this environment (empty when unset). A job that sees
/// another `MAKELEVEL` knows a make lies between it and the runner.
pub fn slot_env_value(id: u64) -> String {
    format!("{id:016x}/{}", make_level())
}

fn make_level() -> String {
    std::env::var("MAKELEVEL").unwrap_or_default()
}

/// Which slot a job may borrow, from its environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Borrow {
    /// The runner's slot named in `HERDLESS_SLOT`.
    Slot(u64),
    /// The slot of the make recipe whose root is this pid.
    Recipe(u32),
    /// This process is a job that a make (or `herdless exec`) started
    /// directly: the token its starter holds for it is its own.
    Own,
    /// No runner named: a job of the command at the top, whose slot the
    /// broker lends when the hello names none.
    Nothing,
    /// A slot variable that is not one: the job borrows no slot at all.
    Unnamed,
}

/// What the environment alone says a job borrows: the slot
/// `HERDLESS_SLOT` names at this make level, nothing at the top (no
/// `MAKELEVEL`), none for a name that is not a slot (told when `warn`).
/// `None` when a make lies between the runner and this job: the recipe's
/// slot, found from the process tree.
fn borrow_named_in_env(warn: bool) -> Option<Borrow> {
    let level = make_level();
    if let Some(value) = std::env::var_os(SLOT_ENV) {
        match value.to_str().and_then(parse_slot_env) {
            Some((id, at)) if at == level => return Some(Borrow::Slot(id)),
            Some(_) => {}
            None => {
                if warn {
                    crate::log!(
                        crate::log::Level::Warn,
                        "{SLOT_ENV}={value:?} is not a slot (16 hex digits, '/', MAKELEVEL); \
                         this job borrows none"
                    );
                }
                return Some(Borrow::Unnamed);
            }
        }
    }
    level.is_empty().then_some(Borrow::Nothing)
}

/// Parses `HERDLESS_SLOT`: `(id, MAKELEVEL)`.
pub(crate) fn parse_slot_env(value: &str) -> Option<(u64, &str)> {
    let (id, level) = value.split_once('/')?;
    if id.len() != 16 {
        return None;
    }
    let id = u64::from_str_radix(id, 16).ok()?;
    (id != 0).then_some((id, level))
}

/// Whether `HERDLESS_SLOT` names a slot at the top level (no `MAKELEVEL`):
/// a `herdless run` or `exec` above handed its command's slot down.
fn slot_handed_down_at_top() -> bool {
    make_level().is_empty()
        && std::env::var_os(SLOT_ENV)
            .and_then(|v| {
                v.to_str()
                    .and_then(parse_slot_env)
                    .map(|(_, at)| at.is_empty())
            })
            .unwrap_or(false)
}

pub(crate) fn borrow_from_env() -> Borrow {
    if let Some(borrow) = borrow_named_in_env(true) {
        return borrow;
    }
    // A make lies between the runner and this job: the recipe's slot.
    match crate::classic::slot::this_slot_owner() {
        crate::classic::slot::Owner::Own => Borrow::Own,
        crate::classic::slot::Owner::Shared(root) => Borrow::Recipe(root),
        crate::classic::slot::Owner::Orphaned => Borrow::Unnamed,
    }
}

/// How a client takes part in the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    implicit_token: bool,
    job_of_runner_above: bool,
    runner_in_recipe: bool,
    /// Set when the hello names the recipe's slot (`runner_in_recipe`).
    borrows_recipe_slot: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            implicit_token: true,
            job_of_runner_above: false,
            runner_in_recipe: false,
            borrows_recipe_slot: false,
        }
    }
}

impl Options {
    /// Whether this process's own implicit token is handed out first
    /// (default: yes). An embedding that keeps its implicit token itself, as
    /// GNU make and bmake do, turns this off.
    pub fn implicit_token(mut self, yes: bool) -> Options {
        self.implicit_token = yes;
        self
    }

    /// Whether this process is a job of the job runner above it (a
    /// `herdless run`'s command, a `herdless exec`'s, or a make recipe),
    /// however many processes lie between: it owns no implicit token, and
    /// borrows the runner's slot, the one handed down in `HERDLESS_SLOT`
    /// (or its make recipe's), when no other job of that runner holds it
    /// (implies `implicit_token(false)`). A job that a make started directly
    /// runs in the token its make holds for it, as its implicit token.
    pub fn job_of_runner_above(mut self, yes: bool) -> Options {
        self.job_of_runner_above = yes;
        if yes {
            self.implicit_token = false;
        }
        self
    }

    /// For a job runner that keeps its implicit token itself (a make,
    /// `implicit_token(false)`) and may have been started by a make recipe
    /// beside other runners or jobs (`xargs -P 4 make`, `make & make &
    /// wait`): they all run on the one token the make above took for that
    /// recipe. Where the runner's parent is not the make (the recipe's
    /// slot is shared, found from the process tree as for a job of a
    /// recipe), the hello names that slot, still as a runner, and asks
    /// for it as the runner's implicit token: lent at once when no other
    /// process of the recipe holds it, otherwise a shared token or the
    /// slot when it comes back. The runner takes it with
    /// [`Client::borrow_recipe_slot`] before it runs anything
    /// ([`Client::borrows_recipe_slot`] says whether it must). A runner
    /// that the make started directly owns the recipe's token outright
    /// and names nothing, as before. Linux only (where the process table
    /// is read without starting a process); elsewhere the runner names
    /// nothing.
    pub fn runner_in_recipe(mut self, yes: bool) -> Options {
        self.runner_in_recipe = yes;
        self
    }
}

/// How a blocking wait may end early.
#[derive(Clone, Copy)]
pub(crate) struct Wait {
    /// Give up then (`Ok(None)`).
    pub deadline: Option<Instant>,
    /// Return `Interrupted` when a signal arrives.
    pub interruptible: bool,
}

enum Backend {
    Native(Native),
    Classic(Classic),
}

struct Inner {
    backend: Backend,
    options: Options,
    /// The process that opened the handle: the only one that may use it.
    opened_by: u32,
    /// The fork count when it was opened, where the OS keeps one
    /// (`herdless_platform::fork_generation`): checked instead of the
    /// process id, without a system call.
    opened_gen: Option<u64>,
    implicit_in_use: AtomicBool,
    /// The implicit token was forgotten while in use: the next
    /// `release_raw` gives it back, locally.
    implicit_forgotten: AtomicBool,
}

/// A handle on the jobserver. Cheap to clone; `Send + Sync`: several
/// threads may wait on one client at once, and each grant goes to one of
/// them.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Client");
        match &self.inner.backend {
            Backend::Native(n) => d
                .field("socket", &n.path())
                .field("client_id", &n.client_id()),
            Backend::Classic(c) => d
                .field("jobserver", &c.jobserver().to_string())
                .field("holding", &c.holding()),
        };
        d.field("options", &self.inner.options).finish()
    }
}

/// Runs `connect` again, with growing pauses, for up to two minutes, while
/// the broker turns it away to keep descriptors free for the make it runs
/// in ([`Error::is_no_room`]); see [`Client::connect_when_room`].
pub fn when_room<T>(connect: impl FnMut() -> Result<T>) -> Result<T> {
    native::with_pauses(connect, Error::is_no_room).0
}

/// The socket named by `HERDLESS_SOCKET`, if it is set and not empty.
pub fn socket_from_env() -> Option<PathBuf> {
    std::env::var_os(SOCKET_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The environment variable that says which classic jobserver belongs to
/// the broker in [`SOCKET_ENV`]: [`classic_env_value`] of its pipe or FIFO,
/// or empty for a broker with no classic side. Whoever sets
/// `HERDLESS_SOCKET` for a tree sets it too (`herdless run`, a make with
/// the broker inside).
pub const CLASSIC_ENV: &str = "HERDLESS_CLASSIC";

/// The value of [`CLASSIC_ENV`] for the pipe or FIFO whose `(st_dev,
/// st_ino)` is `id` (see [`Jobserver::identity`]).
pub fn classic_env_value(id: (u64, u64)) -> String {
    format!("{}:{}", id.0, id.1)
}

/// A classic jobserver that lies between this process and the broker
/// named in `HERDLESS_SOCKET`: the one `MAKEFLAGS` names (or, where it
/// names none or a disabled one, `CARGO_MAKEFLAGS`, then `MFLAGS`), when
/// it is there to see ([`Jobserver::identity`]) and is not the broker's
/// own classic side ([`CLASSIC_ENV`]).
///
/// Every make passes `HERDLESS_SOCKET` on, but a stock make that starts a
/// group of its own (`make -j2` in a recipe) names its own pipe or FIFO in
/// `MAKEFLAGS`: the jobs below it must take their tokens there, within its
/// `-j`, not from the broker above. `MAKEFLAGS` decides because every make
/// writes it, while `CARGO_MAKEFLAGS` and `MFLAGS` may be left as a runner
/// above set them. `None` when the broker's side is not known (no or an
/// empty `HERDLESS_CLASSIC`: a broker with no classic side, or one that
/// does not say), and when the deciding variable names nothing there to
/// see (a descriptor not open, or reused for something that is not a
/// jobserver's pipe): then nothing shows a make between, and the broker
/// serves as before.
pub fn jobserver_between() -> Option<Jobserver> {
    let own = std::env::var_os(CLASSIC_ENV).filter(|v| !v.is_empty())?;
    for var in ["MAKEFLAGS", "CARGO_MAKEFLAGS", "MFLAGS"] {
        let Some(value) = std::env::var_os(var) else {
            continue;
        };
        let js = match Jobserver::parse(var, &value) {
            Ok(Some(js)) if !matches!(js.auth(), Auth::Disabled) => js,
            Ok(_) => continue,
            Err(_) => return None,
        };
        let id = js.identity()?;
        return (own.as_encoded_bytes() != classic_env_value(id).as_bytes()).then_some(js);
    }
    None
}

/// The broker this process takes its tokens from: the one named in
/// `HERDLESS_SOCKET`, unless a classic jobserver lies between
/// ([`jobserver_between`]).
pub fn broker_from_env() -> Option<PathBuf> {
    socket_from_env().filter(|_| jobserver_between().is_none())
}

impl Client {
    /// Connects to the broker named by `HERDLESS_SOCKET`, or when it is not
    /// set, to the classic jobserver named in `CARGO_MAKEFLAGS`,
    /// `MAKEFLAGS` or `MFLAGS` (see [`crate::classic`]); default options.
    /// A classic jobserver that lies between this process and the broker
    /// ([`jobserver_between`]) is used instead of the broker.
    ///
    /// # Errors
    ///
    /// - `NotFound` when neither is there, or the classic jobserver is
    ///   disabled (`--jobserver-auth=-2,-2`);
    /// - `Connect` when nobody listens on the socket, `Refused` when the
    ///   broker turns this client away;
    /// - `BadJobserver` when the classic jobserver named is unusable: the
    ///   message names the fd or path and why ("MAKEFLAGS names jobserver
    ///   fd 3, which is not open (was the recipe not marked with + ?)").
    pub fn from_env() -> Result<Client> {
        Client::from_env_with(Options::default())
    }

    /// [`Client::from_env`] with the given options.
    pub fn from_env_with(options: Options) -> Result<Client> {
        if let Some(path) = socket_from_env() {
            return match jobserver_between() {
                Some(js) => Client::from_jobserver(js, options),
                None => Client::connect_when_room(&path, options),
            };
        }
        match Jobserver::from_env()? {
            Some(js) => Client::from_jobserver(js, options),
            None => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "no jobserver: {SOCKET_ENV} is not set and none of {} names a classic one",
                    crate::classic::VARS.join(", ")
                ),
            )),
        }
    }

    /// Uses the classic jobserver `js` (see [`crate::classic`]).
    ///
    /// # Errors
    ///
    /// `NotFound` when `js` is disabled; `BadJobserver` when its fds or fifo
    /// are unusable, saying which and why.
    pub fn from_jobserver(js: Jobserver, options: Options) -> Result<Client> {
        let classic = Classic::open(js, options.job_of_runner_above)?;
        Ok(Client::with_backend(Backend::Classic(classic), options))
    }

    /// Refuses use from a process other than the one that opened the
    /// handle (a fork): acting for the parent would take or give back its
    /// tokens, or read its grants.
    fn same_process(&self) -> Result<()> {
        if let (Some(then), Some(now)) =
            (self.inner.opened_gen, herdless_platform::fork_generation())
        {
            if then == now {
                return Ok(());
            }
        }
        let me = std::process::id();
        if me == self.inner.opened_by {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Forked,
            format!(
                "this jobserver handle was opened by process {}; process {me}, a fork of it, \
                 must open its own",
                self.inner.opened_by
            ),
        ))
    }

    fn with_backend(backend: Backend, options: Options) -> Client {
        Client {
            inner: Arc::new(Inner {
                backend,
                options,
                opened_by: std::process::id(),
                opened_gen: herdless_platform::fork_generation(),
                implicit_in_use: AtomicBool::new(false),
                implicit_forgotten: AtomicBool::new(false),
            }),
        }
    }

    /// [`Client::connect_with`], asking again, with growing pauses, for up
    /// to two minutes, while the broker turns this client away to keep
    /// descriptors free for the make it runs in ([`Error::is_no_room`]):
    /// room comes back as that make's other clients end. A client that
    /// took its tokens from the make's classic jobserver instead would
    /// wait there for good where the make holds its tokens for recipes
    /// whose jobs were all turned away (the pipe never gets a token of
    /// theirs); at the broker, the recipe's slot is lent to the first of
    /// them that gets in.
    pub fn connect_when_room(path: impl AsRef<Path>, options: Options) -> Result<Client> {
        let path = path.as_ref();
        when_room(|| Client::connect_with(path, options))
    }

    /// Connects to the broker listening on `path`, with default options.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Client::connect_with(path.as_ref(), Options::default())
    }

    /// Connects to the broker listening on `path`.
    pub fn connect_with(path: impl AsRef<Path>, options: Options) -> Result<Client> {
        let (ask, options, elsewhere) = Ask::for_options(options);
        let native = Native::connect(path.as_ref(), ask)?;
        let options = native.options_seen(options, elsewhere);
        Ok(Client::with_backend(Backend::Native(native), options))
    }

    /// Begins [`connect_with`](Client::connect_with): connects to the
    /// broker on `path` and sends the hello, and returns without waiting
    /// for the broker's answer, which [`Connecting::finish`] reads. A
    /// program that begins early and has work of its own before it needs
    /// its first token (a make reading its makefiles) finds the answer
    /// there and does not sleep for it: connecting costs it no context
    /// switch. Errors of the connection itself (no socket, nobody
    /// listening, another user's broker) come here; the broker's refusal
    /// comes from `finish`.
    pub fn begin_connect_with(path: impl AsRef<Path>, options: Options) -> Result<Connecting> {
        let (ask, tree, elsewhere) = Ask::for_options(options);
        let started = Native::start(path.as_ref(), ask)?;
        Ok(Connecting {
            options: started.options_seen(tree, elsewhere),
            started,
            pid: std::process::id(),
        })
    }
}

/// A connection begun by [`Client::begin_connect_with`]: the hello is
/// sent, the broker's answer not read yet. Dropping it closes the
/// connection; the broker forgets it.
pub struct Connecting {
    started: native::Started,
    options: Options,
    /// The process that began it: a fork's copy is not its connection.
    pid: u32,
}

impl std::fmt::Debug for Connecting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connecting")
            .field("socket", &self.started.path())
            .field("options", &self.options)
            .finish()
    }
}

impl Connecting {
    /// The broker's socket.
    pub fn socket(&self) -> &Path {
        self.started.path()
    }

    /// The options it was begun with.
    pub fn options(&self) -> Options {
        self.options
    }

    /// Reads the broker's answer and returns the client, as
    /// [`Client::connect_with`] would have. A broker that was busy, or
    /// older than the shared table, is asked again as `connect_with`
    /// asks. In a fork of the process that began it, the begun
    /// connection is left to that process and a new one is made.
    pub fn finish(self) -> Result<Client> {
        let Connecting {
            started,
            options,
            pid,
        } = self;
        if pid != std::process::id() {
            let path = started.path().to_path_buf();
            // Dropping the fork's copy of the descriptor leaves the
            // connection to the process that began it.
            drop(started);
            return Client::connect_with(path, options);
        }
        let native = started.finish()?;
        Ok(Client::with_backend(Backend::Native(native), options))
    }
}

/// The hello's flags and the slot a client with `options` names, from the
/// environment (`HERDLESS_SLOT`, `MAKELEVEL`); a job of a runner that
/// owns its slot takes the implicit token, and a runner in a shared
/// recipe slot is marked to borrow it (`options` changed).
fn hello_for(options: &mut Options) -> (HelloFlags, u64) {
    let mut flags = HelloFlags::empty();
    let mut slot = 0;
    options.borrows_recipe_slot = false;
    if options.job_of_runner_above {
        match borrow_from_env() {
            Borrow::Slot(id) => {
                flags |= HelloFlags::JOB;
                slot = id;
            }
            Borrow::Recipe(root) => {
                flags |= HelloFlags::RECIPE_JOB;
                slot = u64::from(root);
            }
            Borrow::Own => options.implicit_token = true,
            // A job of the top (a shell that only exported
            // HERDLESS_SOCKET, as a service's users do).
            Borrow::Nothing => flags |= HelloFlags::JOB,
            Borrow::Unnamed => {}
        }
    } else if may_share_a_recipe(options) {
        // Found from the process tree, whatever `HERDLESS_SLOT` says (a
        // bmake names its own slot there at its children's level). A
        // runner that the make started itself owns its token, and one
        // with no make above it has no recipe: both name nothing. At the
        // top (no make above), a runner started by the command of a
        // `herdless run` or an `exec` beside others (`sh -c 'make & make &
        // wait'`) shares that command's token in the same way: the root
        // is the command, whose parent is the `herdless` that runs it.
        if let crate::classic::slot::Owner::Shared(root) = crate::classic::slot::this_slot_owner() {
            flags |= HelloFlags::RECIPE_JOB | HelloFlags::RUNNER;
            slot = u64::from(root);
            options.borrows_recipe_slot = true;
        }
    }
    (flags, slot)
}

/// Whether a runner with `options` may share the token of a recipe
/// above it: it asks to (`runner_in_recipe`), the process tree can be
/// read (Linux), and a make or a `herdless run`'s command lies above.
fn may_share_a_recipe(options: &Options) -> bool {
    options.runner_in_recipe
        && cfg!(any(target_os = "linux", target_os = "android"))
        && (!make_level().is_empty() || slot_handed_down_at_top())
}

/// What a job or a runner of a make recipe says instead of
/// [`hello_for`]'s hello when the broker runs in another PID namespace
/// (its process id reads 0 here: `unshare --pid`, `bwrap --unshare-pid`
/// or a container lies between the make and this process): the process
/// tree seen from here ends at that namespace's first process, above
/// which the recipe's root lies, so the hello names root 0, and the broker
/// finds the root in its own process table. `None` where the hello names
/// no recipe however the tree is seen (no make above, or a slot named in
/// `HERDLESS_SLOT`, which is the same in every namespace).
fn hello_elsewhere(options: Options) -> Option<(HelloFlags, Options)> {
    let mut options = options;
    options.borrows_recipe_slot = false;
    if options.job_of_runner_above {
        if borrow_named_in_env(false).is_some() {
            return None;
        }
        options.implicit_token = false;
        return Some((HelloFlags::RECIPE_JOB, options));
    }
    if may_share_a_recipe(&options) {
        options.borrows_recipe_slot = true;
        return Some((HelloFlags::RECIPE_JOB | HelloFlags::RUNNER, options));
    }
    None
}

impl Ask {
    /// The hello a client with `options` says, with the options it then
    /// has as the process tree here shows its recipe, and as they are
    /// where it says [`hello_elsewhere`]'s.
    fn for_options(options: Options) -> (Ask, Options, Options) {
        let mut tree = options;
        let (flags, slot) = hello_for(&mut tree);
        let (elsewhere, other) = match hello_elsewhere(options) {
            Some((flags, other)) => (Some(flags), other),
            None => (None, tree),
        };
        (
            Ask {
                flags,
                slot,
                elsewhere,
            },
            tree,
            other,
        )
    }
}

impl Client {
    /// Whether this runner shares its make recipe's token with other
    /// processes of that recipe ([`Options::runner_in_recipe`]): it must
    /// take its share with [`Client::borrow_recipe_slot`], and run nothing
    /// before it has it. Always false on a classic jobserver.
    pub fn borrows_recipe_slot(&self) -> bool {
        self.inner.options.borrows_recipe_slot && matches!(self.inner.backend, Backend::Native(_))
    }

    /// Takes this runner's implicit token when it shares its recipe's
    /// ([`Client::borrows_recipe_slot`]): the recipe's slot, lent at once
    /// when no other process of the recipe holds it, otherwise a shared
    /// token or the slot, whichever comes first; its hello asked for it.
    /// Waits as long as it takes; a signal ends the wait with
    /// `Interrupted` and leaves the request queued for the next call.
    /// `None` when the runner owns its implicit token outright. Call it
    /// once, before anything else takes a token.
    pub fn borrow_recipe_slot(&self) -> Result<Option<Token>> {
        if !self.borrows_recipe_slot() {
            return Ok(None);
        }
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => {
                n.take_hello_grant()?;
                Ok(Some(self.token(TokenKind::Shared)))
            }
            Backend::Classic(_) => Ok(None),
        }
    }

    /// The slot the broker minted for this client's own job; `None` on a
    /// classic jobserver.
    pub fn slot(&self) -> Option<u64> {
        match &self.inner.backend {
            Backend::Native(n) => Some(n.slot()).filter(|&s| s != 0),
            Backend::Classic(_) => None,
        }
    }

    /// The variable a job runner exports to the command it runs on this
    /// client's token, so that the command's jobs share this one slot:
    /// `(HERDLESS_SLOT, value)`. `None` on a classic jobserver.
    pub fn job_env(&self) -> Option<(&'static str, String)> {
        self.slot().map(|id| (SLOT_ENV, slot_env_value(id)))
    }

    /// Connects as an observer, which may only ask for status.
    pub fn observe(path: impl AsRef<Path>) -> Result<Observer> {
        let native = Native::connect(path.as_ref(), Ask::plain(HelloFlags::OBSERVER, 0))?;
        Ok(Observer { native })
    }

    /// Connects as an observer that may change the running pool.
    pub fn control(path: impl AsRef<Path>) -> Result<Control> {
        let native = Native::connect_version(
            path.as_ref(),
            Ask::plain(HelloFlags::OBSERVER, 0),
            crate::protocol::CONTROL_VERSION,
        )?;
        Ok(Control { native })
    }

    /// The number of shared tokens (`-j` minus one): the broker's, or for a
    /// classic jobserver the `-j` that came with it, when it gave a number.
    pub fn capacity(&self) -> Option<u32> {
        match &self.inner.backend {
            Backend::Native(n) => Some(n.capacity()),
            Backend::Classic(c) => c.jobserver().jobs().map(|j| j.saturating_sub(1)),
        }
    }

    /// How this client takes tokens: `"shared table"` (the broker's shared
    /// token table, where it also waits when the broker allows it, with the
    /// socket for everything else),
    /// `"socket"` (the broker's socket alone) or `"classic"` (a classic
    /// jobserver's pipe or fifo).
    pub fn token_path(&self) -> &'static str {
        match &self.inner.backend {
            Backend::Native(n) => n.path_in_use(),
            Backend::Classic(_) => "classic",
        }
    }

    /// The broker's socket; `None` on a classic jobserver.
    pub fn socket(&self) -> Option<&Path> {
        match &self.inner.backend {
            Backend::Native(n) => Some(n.path()),
            Backend::Classic(_) => None,
        }
    }

    /// The classic jobserver in use; `None` with a broker.
    pub fn jobserver(&self) -> Option<&Jobserver> {
        match &self.inner.backend {
            Backend::Native(_) => None,
            Backend::Classic(c) => Some(c.jobserver()),
        }
    }

    fn implicit(&self) -> Option<Token> {
        if self.inner.options.implicit_token
            && self
                .inner
                .implicit_in_use
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Some(self.token(TokenKind::Implicit));
        }
        None
    }

    fn got(&self, got: Option<Got>) -> Option<Token> {
        got.map(|g| {
            self.token(match g {
                Got::Byte => TokenKind::Shared,
                Got::Slot => TokenKind::ParentSlot,
            })
        })
    }

    fn shared(&self, granted: bool) -> Option<Token> {
        granted.then(|| self.token(TokenKind::Shared))
    }

    fn token(&self, kind: TokenKind) -> Token {
        Token {
            client: self.clone(),
            kind,
            live: true,
        }
    }

    /// Takes a token, waiting as long as it takes. Signals do not end the
    /// wait.
    ///
    /// # Errors
    ///
    /// `Aborted` when the tree aborts (under bmake: when its abort token is
    /// in the pipe), `BrokerGone` when the broker dies, both at once,
    /// whatever the wait.
    pub fn acquire(&self) -> Result<Token> {
        match self.acquire_inner(None, false)? {
            Some(t) => Ok(t),
            None => unreachable!("no deadline"),
        }
    }

    /// Takes a token if one is free now (or this client's implicit token).
    pub fn try_acquire(&self) -> Result<Option<Token>> {
        self.same_process()?;
        if let Some(t) = self.implicit() {
            return Ok(Some(t));
        }
        match &self.inner.backend {
            Backend::Native(n) => Ok(self.shared(n.try_acquire()?)),
            Backend::Classic(c) => Ok(self.got(c.try_acquire()?)),
        }
    }

    /// Takes a token, waiting at most until `deadline`; `None` when it
    /// passed. A request the broker had not answered by then is withdrawn,
    /// so no token is stranded.
    ///
    /// # Portability
    ///
    /// On a classic jobserver whose pipe this OS cannot reopen and whose
    /// shared description is blocking (not Linux; see [`crate::classic`]),
    /// this returns an `Unsupported` error.
    pub fn acquire_deadline(&self, deadline: Instant) -> Result<Option<Token>> {
        self.acquire_inner(Some(deadline), false)
    }

    /// [`Client::acquire_deadline`] with a timeout.
    pub fn acquire_timeout(&self, timeout: Duration) -> Result<Option<Token>> {
        self.acquire_deadline(Instant::now() + timeout)
    }

    /// Like [`Client::acquire_deadline`] (no deadline when `None`), but a
    /// signal ends the wait with an `Interrupted` error. The request stays
    /// pending: the grant, when it comes, is kept for the next call, so
    /// nothing is lost (the contract GNU make relies on for SIGCHLD). On a
    /// classic jobserver nothing is pending: the pipe keeps the byte.
    pub fn acquire_interruptible(&self, deadline: Option<Instant>) -> Result<Option<Token>> {
        self.acquire_inner(deadline, true)
    }

    fn acquire_inner(
        &self,
        deadline: Option<Instant>,
        interruptible: bool,
    ) -> Result<Option<Token>> {
        self.same_process()?;
        if let Some(t) = self.implicit() {
            return Ok(Some(t));
        }
        let wait = Wait {
            deadline,
            interruptible,
        };
        match &self.inner.backend {
            Backend::Native(n) => Ok(self.shared(n.acquire(wait)?)),
            Backend::Classic(c) => Ok(self.got(c.acquire(wait)?)),
        }
    }

    /// For a caller's own poll loop: a token if a grant has arrived, or if
    /// one is free now (asked for with one round trip to the broker);
    /// otherwise `None`, after making sure a request is pending so that
    /// [`Client::as_fd`] becomes readable when the grant arrives. Never
    /// waits for a token to be released. Never hands out the implicit
    /// token.
    ///
    /// On a classic jobserver nothing needs requesting: this reads the pipe
    /// without blocking, and [`Client::as_fd`] is readable while a byte is
    /// in it (every process watching the pipe wakes then; a blocking
    /// acquire wakes just one).
    pub fn take_grant(&self) -> Result<Option<Token>> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => Ok(self.shared(n.take_grant(true)?)),
            Backend::Classic(c) => Ok(self.got(c.try_acquire()?)),
        }
    }

    /// Like [`Client::take_grant`], but never waits for the broker: when
    /// no grant has arrived and no request is queued, it queues one (a
    /// single message) and returns `None` at once. A token that is free
    /// comes as a grant straight away, making [`Client::as_fd`] readable.
    /// Cheaper than `take_grant` when the pool is usually empty (one
    /// broker wake-up per token instead of two), at the price of one more
    /// pass through the caller's poll loop when it is not.
    pub fn request_grant(&self) -> Result<Option<Token>> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => Ok(self.shared(n.take_grant(false)?)),
            Backend::Classic(c) => Ok(self.got(c.try_acquire()?)),
        }
    }

    /// Lets a caller's poll loop wait for tokens in the broker's shared
    /// table, as blocking acquires do on Linux: a token given back by
    /// another client is handed to this one directly, with no message to
    /// the broker, and the giver wakes this process with a signal
    /// (`SIGURG`, handled by herdless from then on). After it,
    /// [`Client::as_fd`] is a different descriptor, readable also when
    /// such a hand-over comes: poll that one.
    ///
    /// Returns whether it is on: `false` on a classic jobserver, on a
    /// broker that keeps waits out of its table (`HERDLESS_HANDOFF=0`, or
    /// not Linux), or when this client has no table; requests then go
    /// over the socket as before.
    ///
    /// # Errors
    ///
    /// `Io` when the program handles `SIGURG` itself, or the descriptors
    /// cannot be made; nothing changes then.
    pub fn enable_poll_handoff(&self) -> Result<bool> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => n.enable_poll_handoff(),
            Backend::Classic(_) => Ok(false),
        }
    }

    /// Withdraws a request left pending by [`Client::take_grant`] or an
    /// interrupted acquire. Returns the token if it had been granted
    /// already. On a classic jobserver there is never one: `Ok(None)`.
    pub fn cancel_pending(&self) -> Result<Option<Token>> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => Ok(self.shared(n.cancel_pending()?)),
            Backend::Classic(_) => Ok(None),
        }
    }

    /// For a client about to be dropped: withdraws whatever is still
    /// pending (a wait in the shared table, a request at the broker) and
    /// waits, for at most `within`, for the broker's answers to every
    /// withdrawal made so far, [`cancel_pending_nowait`] included. Returns
    /// the tokens handed over or granted meanwhile, each given back when
    /// dropped, so that the connection closes holding nothing it did not
    /// take: the broker then counts no token taken back from a client that
    /// died. A broker that does not answer in time takes back what is
    /// left when the connection closes, as always. On a classic
    /// jobserver there is nothing pending.
    ///
    /// [`cancel_pending_nowait`]: Client::cancel_pending_nowait
    pub fn settle_pending(&self, within: Duration) -> Result<Vec<Token>> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => {
                let got = n.settle_for_close(Instant::now() + within)?;
                Ok((0..got).map(|_| self.token(TokenKind::Shared)).collect())
            }
            Backend::Classic(_) => Ok(Vec::new()),
        }
    }

    /// Withdraws, without waiting for the broker's answer, a request left
    /// pending by [`Client::take_grant`] or an interrupted acquire, and
    /// gives back a grant that had arrived for it: the caller holds
    /// nothing new afterwards. A grant that races the withdrawal (sent
    /// before the broker read it) is taken back by the broker as it reads
    /// the withdrawal, and goes on to the next waiter (protocol version 5,
    /// `CancelNowait`); a broker of an older herdless has it given back
    /// when this client next reads its socket. On a classic jobserver
    /// there is nothing to withdraw.
    pub fn cancel_pending_nowait(&self) -> Result<()> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => n.cancel_nowait(),
            Backend::Classic(_) => Ok(()),
        }
    }

    /// Whether a request left by [`Client::take_grant`] or an interrupted
    /// acquire is still queued, or its grant has arrived and is not taken
    /// yet. Never on a classic jobserver.
    pub fn has_pending(&self) -> Result<bool> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => n.pending(),
            Backend::Classic(_) => Ok(false),
        }
    }

    /// Aborts the whole tree: every client is told, bmake children get an
    /// `E` or `I` token, and no token is granted after it. Through a
    /// broker it returns once the broker has taken the abort (it waits for
    /// the broker to tell this client too), so no acquire anywhere, on
    /// the shared table or the socket, succeeds after it returns.
    ///
    /// On a classic bmake jobserver this drains the pipe and puts the abort
    /// token in, as bmake does.
    ///
    /// # Errors
    ///
    /// `Unsupported` on a classic GNU make (or cargo) jobserver, which has
    /// no abort token; nothing is changed then. Exit with a failure status
    /// instead: make stops the build.
    pub fn abort(&self, reason: AbortReason) -> Result<()> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => {
                n.abort(reason)?;
                n.wait_aborted()
            }
            Backend::Classic(c) => c.abort(reason),
        }
    }

    /// The abort that has reached this client, if any. On a classic
    /// jobserver: one this client read from the pipe or posted.
    pub fn aborted(&self) -> Option<AbortReason> {
        // A fork must not read its parent's connection.
        self.same_process().ok()?;
        match &self.inner.backend {
            Backend::Native(n) => n.aborted(),
            Backend::Classic(c) => c.aborted(),
        }
    }

    /// The broker's status report (JSON, see `herdless status --json`).
    ///
    /// # Errors
    ///
    /// `Unsupported` on a classic jobserver, which keeps no status.
    pub fn status_json(&self) -> Result<String> {
        self.same_process()?;
        match &self.inner.backend {
            Backend::Native(n) => n.status(),
            Backend::Classic(c) => Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the {} keeps no status: a status report needs a herdless broker",
                    c.jobserver()
                ),
            )),
        }
    }
}

impl AsFd for Client {
    /// The socket to the broker: readable when a grant (or an abort, or
    /// the broker's end) has arrived; after
    /// [`Client::enable_poll_handoff`], a descriptor readable also when a
    /// token is handed over in the shared table. On a classic jobserver, this client's
    /// own read description of the token pipe: readable while a byte is in
    /// the pipe. Watch it for reading only; read from it only through
    /// [`Client::take_grant`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        match &self.inner.backend {
            Backend::Native(n) => n.fd(),
            Backend::Classic(c) => c.fd(),
        }
    }
}

impl AsRawFd for Client {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

/// A status-only connection (see [`Client::observe`]).
pub struct Observer {
    native: Native,
}

impl Observer {
    /// The broker's status report as JSON.
    pub fn json(&self) -> Result<String> {
        self.native.status()
    }
}

/// A connection that changes a running pool (from [`Client::control`]).
/// Each call returns once the broker has made the change.
pub struct Control {
    native: Native,
}

impl Control {
    /// Makes the pool `-j jobs` (at least 1): grows at once; shrinks at
    /// once by the free tokens and by the others as they are given back.
    /// No running job loses its token.
    pub fn set_jobs(&self, jobs: u32) -> Result<()> {
        self.native
            .control(crate::protocol::ControlOp::SetJobs(jobs))
    }

    /// Lets the subtree of process `pid` (itself and its descendants) hold
    /// at most `max` shared tokens at once; `None` lifts the cap.
    pub fn cap(&self, pid: u32, max: Option<u32>) -> Result<()> {
        self.native
            .control(crate::protocol::ControlOp::Cap { pid, max })
    }

    /// Aborts the tree: every client is told, bmakes find the abort byte.
    pub fn abort(&self, reason: AbortReason) -> Result<()> {
        self.native.abort(reason)?;
        // The abort has no reply to an observer; a status round trip shows
        // the broker has read it.
        self.native.status().map(drop)
    }

    /// The broker's status report as JSON.
    pub fn json(&self) -> Result<String> {
        self.native.status()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    Implicit,
    /// From the broker, or a byte from a classic pipe.
    Shared,
    /// The parent's slot under a classic jobserver (see
    /// [`Options::job_of_runner_above`]).
    ParentSlot,
}

/// A job token. Dropping it gives it back.
#[derive(Debug)]
pub struct Token {
    client: Client,
    kind: TokenKind,
    live: bool,
}

impl Token {
    /// Whether this is the process's implicit token (no broker involved).
    pub fn is_implicit(&self) -> bool {
        self.kind == TokenKind::Implicit
    }

    /// Gives the token back now, reporting a failure to do so (a broker
    /// that is gone has taken it back already).
    pub fn release(mut self) -> Result<()> {
        self.live = false;
        self.give_back()
    }

    /// Keeps the token held without this value; it goes back when the
    /// connection closes, or through [`Client::release_raw`].
    pub fn forget(mut self) {
        self.live = false;
        if self.kind == TokenKind::Implicit {
            self.client
                .inner
                .implicit_forgotten
                .store(true, Ordering::Release);
        }
    }

    fn give_back(&self) -> Result<()> {
        // A token copied into a fork is its parent's: only the parent gives
        // it back.
        self.client.same_process()?;
        match self.kind {
            TokenKind::Implicit => {
                self.client
                    .inner
                    .implicit_in_use
                    .store(false, Ordering::Release);
                Ok(())
            }
            TokenKind::Shared => match &self.client.inner.backend {
                Backend::Native(n) => n.release(),
                Backend::Classic(c) => c.release_byte(),
            },
            TokenKind::ParentSlot => match &self.client.inner.backend {
                Backend::Native(n) => n.release(),
                Backend::Classic(c) => c.release_slot(),
            },
        }
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        if self.live {
            let _ = self.give_back();
        }
    }
}

impl Client {
    /// Gives back one token that was [`Token::forget`]-ten: the implicit
    /// token first (which never involves the broker), then a shared one.
    /// The caller keeps count: releasing a shared token the client does not
    /// hold makes the broker close the connection. On a classic jobserver
    /// it writes back the byte most recently read (or gives back the
    /// parent's slot when no byte is held); holding none is a `NotHolding`
    /// error.
    pub fn release_raw(&self) -> Result<()> {
        self.same_process()?;
        if self.inner.implicit_forgotten.swap(false, Ordering::AcqRel) {
            self.inner.implicit_in_use.store(false, Ordering::Release);
            return Ok(());
        }
        match &self.inner.backend {
            Backend::Native(n) => n.release(),
            Backend::Classic(c) => c.release_any(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_runner_env;

    #[test]
    fn a_runner_is_named_by_pid_in_this_pid_namespace() {
        assert_eq!(parse_runner_env("4242", Some(7)), Some(4242));
        assert_eq!(parse_runner_env("4242:7", Some(7)), Some(4242));
        assert_eq!(parse_runner_env("4242", None), Some(4242));
        // Another namespace numbers processes otherwise.
        assert_eq!(parse_runner_env("4242:8", Some(7)), None);
        assert_eq!(parse_runner_env("4242:8", None), None);
        // Not a process this walk may take for a make.
        for bad in ["", "1", "0", "-5", "x", "4242:", "4242:x", ":7", "4242:7:7"] {
            assert_eq!(parse_runner_env(bad, Some(7)), None, "{bad:?}");
        }
    }
}
