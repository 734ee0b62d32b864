//! The client: takes job tokens from a herdless broker.
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
//! may always run one job without asking (DESIGN §4.5). A client made with
//! [`Options::implicit_token`] (the default of [`Client::from_env`]) hands
//! that token out first, without a round trip to the broker; only while it
//! is in use do further acquires go to the broker. That is what keeps nested
//! tools progressing with zero spare tokens.
//!
//! A client made with [`Options::job_of_parent`] is itself a *job* of its
//! parent process (what `herdless exec` is): it owns no implicit token, but
//! the broker may lend it its parent's, when no sibling holds it.
//!
//! # Integrating with a poll loop
//!
//! [`Client::as_fd`] is the socket to the broker. Call
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

mod error;
mod native;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use error::{Error, ErrorKind, Result};
use native::{Native, Wait};

use crate::protocol::{AbortReason, HelloFlags};

/// The environment variable naming the broker's socket.
pub const SOCKET_ENV: &str = "HERDLESS_SOCKET";

/// How a client takes part in the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    implicit_token: bool,
    job_of_parent: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            implicit_token: true,
            job_of_parent: false,
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

    /// Whether this process is a job of its parent: it owns no implicit
    /// token, and may run in its parent's when no sibling holds it (implies
    /// `implicit_token(false)`).
    pub fn job_of_parent(mut self, yes: bool) -> Options {
        self.job_of_parent = yes;
        if yes {
            self.implicit_token = false;
        }
        self
    }
}

struct Inner {
    native: Native,
    options: Options,
    implicit_in_use: AtomicBool,
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
        f.debug_struct("Client")
            .field("socket", &self.inner.native.path())
            .field("client_id", &self.inner.native.client_id())
            .field("options", &self.inner.options)
            .finish()
    }
}

/// The socket named by `HERDLESS_SOCKET`, if it is set and not empty.
pub fn socket_from_env() -> Option<PathBuf> {
    std::env::var_os(SOCKET_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

impl Client {
    /// Connects to the broker named by `HERDLESS_SOCKET`, with default
    /// options.
    ///
    /// # Errors
    ///
    /// `NotFound` when the variable is not set; `Connect` when nobody
    /// listens there; `Refused` when the broker turns this client away.
    pub fn from_env() -> Result<Client> {
        Client::from_env_with(Options::default())
    }

    /// [`Client::from_env`] with the given options.
    pub fn from_env_with(options: Options) -> Result<Client> {
        match socket_from_env() {
            Some(path) => Client::connect_with(&path, options),
            None => Err(Error::new(
                ErrorKind::NotFound,
                format!("no herdless broker: {SOCKET_ENV} is not set"),
            )),
        }
    }

    /// Connects to the broker listening on `path`, with default options.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Client::connect_with(path.as_ref(), Options::default())
    }

    /// Connects to the broker listening on `path`.
    pub fn connect_with(path: impl AsRef<Path>, options: Options) -> Result<Client> {
        let mut flags = HelloFlags::empty();
        if options.job_of_parent {
            flags |= HelloFlags::JOB_OF_PARENT;
        }
        let native = Native::connect(path.as_ref(), flags)?;
        Ok(Client {
            inner: Arc::new(Inner {
                native,
                options,
                implicit_in_use: AtomicBool::new(false),
            }),
        })
    }

    /// Connects as an observer, which may only ask for status.
    pub fn observe(path: impl AsRef<Path>) -> Result<Status> {
        let native = Native::connect(path.as_ref(), HelloFlags::OBSERVER)?;
        Ok(Status { native })
    }

    /// The number of shared tokens the broker holds (`-j` minus one).
    pub fn capacity(&self) -> u32 {
        self.inner.native.capacity()
    }

    /// The socket this client is connected to.
    pub fn socket(&self) -> &Path {
        self.inner.native.path()
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
    /// `Aborted` when the tree aborts, `BrokerGone` when the broker dies,
    /// both at once, whatever the wait.
    pub fn acquire(&self) -> Result<Token> {
        match self.acquire_inner(None, false)? {
            Some(t) => Ok(t),
            None => unreachable!("no deadline"),
        }
    }

    /// Takes a token if one is free now (or this client's implicit token).
    pub fn try_acquire(&self) -> Result<Option<Token>> {
        if let Some(t) = self.implicit() {
            return Ok(Some(t));
        }
        Ok(self
            .inner
            .native
            .try_acquire()?
            .then(|| self.token(TokenKind::Shared)))
    }

    /// Takes a token, waiting at most until `deadline`; `None` when it
    /// passed. A request the broker had not answered by then is withdrawn,
    /// so no token is stranded.
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
    /// nothing is lost (the contract GNU make relies on for SIGCHLD).
    pub fn acquire_interruptible(&self, deadline: Option<Instant>) -> Result<Option<Token>> {
        self.acquire_inner(deadline, true)
    }

    fn acquire_inner(
        &self,
        deadline: Option<Instant>,
        interruptible: bool,
    ) -> Result<Option<Token>> {
        if let Some(t) = self.implicit() {
            return Ok(Some(t));
        }
        let wait = Wait {
            deadline,
            interruptible,
        };
        Ok(self
            .inner
            .native
            .acquire(wait)?
            .then(|| self.token(TokenKind::Shared)))
    }

    /// Non-blocking, for a caller's own poll loop: a token if a grant has
    /// arrived; otherwise `None`, after making sure a request is pending so
    /// that [`Client::as_fd`] becomes readable when the grant arrives.
    /// Never hands out the implicit token.
    pub fn take_grant(&self) -> Result<Option<Token>> {
        Ok(self
            .inner
            .native
            .take_grant()?
            .then(|| self.token(TokenKind::Shared)))
    }

    /// Withdraws a request left pending by [`Client::take_grant`] or an
    /// interrupted acquire. Returns the token if it had been granted
    /// already.
    pub fn cancel_pending(&self) -> Result<Option<Token>> {
        Ok(self
            .inner
            .native
            .cancel_pending()?
            .then(|| self.token(TokenKind::Shared)))
    }

    /// Aborts the whole tree: every client is told, bmake children get an
    /// `E` or `I` token, and no token is granted after it.
    pub fn abort(&self, reason: AbortReason) -> Result<()> {
        self.inner.native.abort(reason)
    }

    /// The abort that has reached this client, if any.
    pub fn aborted(&self) -> Option<AbortReason> {
        self.inner.native.aborted()
    }

    /// The broker's status report (JSON, see `herdless status --json`).
    pub fn status_json(&self) -> Result<String> {
        self.inner.native.status()
    }
}

impl AsFd for Client {
    /// The socket to the broker: readable when a grant (or an abort, or
    /// the broker's end) has arrived. Watch it for reading only; read from
    /// it only through [`Client::take_grant`].
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.native.fd()
    }
}

impl AsRawFd for Client {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.native.raw_fd()
    }
}

/// A status-only connection (see [`Client::observe`]).
pub struct Status {
    native: Native,
}

impl Status {
    /// The broker's status report as JSON.
    pub fn json(&self) -> Result<String> {
        self.native.status()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    Implicit,
    Shared,
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
    }

    fn give_back(&self) -> Result<()> {
        match self.kind {
            TokenKind::Implicit => {
                self.client
                    .inner
                    .implicit_in_use
                    .store(false, Ordering::Release);
                Ok(())
            }
            TokenKind::Shared => self.client.inner.native.release(),
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
    /// Gives back one shared token that was [`Token::forget`]-ten. The
    /// caller keeps count: releasing a token the client does not hold makes
    /// the broker close the connection.
    pub fn release_raw(&self) -> Result<()> {
        self.inner.native.release()
    }
}
