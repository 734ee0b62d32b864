//! The C ABI, declared in `include/herdless.h` (generated from this file by
//! cbindgen; `tests/ffi.rs` fails when the two differ).
//!
//! A make calls these functions where it reads and writes its token pipe
//! today. The handle is a [`Client`] made with
//! `Options::default().implicit_token(false)`: the embedding make keeps its
//! implicit token itself, so every successful acquire here is one token from
//! the shared pool.
//!
//! # Conventions
//!
//! - Functions that return `int` return 0 (or a documented non-negative
//!   value) on success and a negative `errno` value on failure; the two
//!   constructors return NULL and set `errno`.
//! - Each handle counts the tokens it holds. A release with none held is
//!   refused with `-EINVAL` before anything reaches the broker, so a double
//!   release cannot mint a token (nor make the broker drop the connection).
//! - NULL handles give `-EINVAL`; no call can crash on one.
//! - No panic crosses the boundary: every function runs under
//!   `catch_unwind`, and a caught panic (a bug in herdless) returns
//!   `-ENOTRECOVERABLE`.
//!
//! # Implementation notes
//!
//! Only `Client`'s public API is used, so the C ABI works with whichever
//! backend `Client::from_env` picks (a herdless broker, or a classic
//! jobserver named in `MAKEFLAGS`).
#![warn(missing_docs)]

use std::ffi::{c_char, c_int, c_uint, CStr, CString, OsStr, OsString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;

use herdless_lib::bridge::Bridge;
use herdless_lib::broker::{Broker, Config, Stopper};
use herdless_lib::classic::{Auth, Flavor, Style};
use herdless_lib::client::{
    self, classic_env_value, Client, ErrorKind, Options, Token, CLASSIC_ENV, SOCKET_ENV,
};
use herdless_lib::protocol::AbortReason;
use herdless_lib::rundir::RunDir;
use herdless_lib::status::Status;

/// Passed as `timeout_ms` to `herdless_acquire`: wait until a token is
/// granted, the tree aborts, the broker goes away or a signal arrives.
pub const HERDLESS_WAIT_FOREVER: c_int = -1;

/// What a caught panic returns: a bug in herdless, not in the caller.
const PANICKED: c_int = -libc::ENOTRECOVERABLE;

/// A connection to the jobserver, and the count of tokens taken through it.
///
/// Opaque: made by `herdless_client_from_env` or `herdless_client_connect`,
/// ended by `herdless_client_free`, which closes the connection; the broker
/// then takes back every token still held through it (as it does when the
/// process dies, however it dies).
///
/// Thread safety: every function except `herdless_client_free` may be
/// called on one handle from several threads at once; each grant goes to
/// exactly one of the callers. `herdless_client_free` must be the last
/// call on a handle, with no other call in progress.
///
/// fork: the connection and its tokens belong to the process that opened
/// the handle. In a fork every call on it fails with `-EPERM` and sends
/// nothing (`herdless_aborted` says 0); `herdless_client_free` there frees
/// the fork's copy only, giving nothing back. A broker on Linux takes the
/// tokens back when the opening process dies, even while a fork keeps the
/// socket open. The socket is close-on-exec.
#[allow(non_camel_case_types)]
pub struct herdless_client {
    client: Client,
    /// Tokens taken through this handle and not yet released.
    held: AtomicU32,
    /// `HERDLESS_SLOT=…` for the make's jobs (see `herdless_slot_env`).
    slot_env: Option<CString>,
    /// `HERDLESS_RUNNER=…` for the make's jobs (see `herdless_runner_env`).
    runner_env: Option<CString>,
}

impl herdless_client {
    fn took(&self, token: Token) {
        // The handle's count, not the Token value, stands for it now.
        token.forget();
        self.held.fetch_add(1, Ordering::AcqRel);
    }

    fn took_maybe(&self, token: client::Result<Option<Token>>, none: c_int) -> c_int {
        match token {
            Ok(Some(t)) => {
                self.took(t);
                0
            }
            Ok(None) => none,
            Err(e) => -e.errno(),
        }
    }
}

/// Runs `f`, turning a panic into [`PANICKED`].
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(PANICKED)
}

/// Turns a constructor's outcome into a pointer, setting `errno` on failure.
fn into_handle(made: std::thread::Result<Result<Client, c_int>>) -> *mut herdless_client {
    let errno = match made {
        Ok(Ok(client)) => {
            let slot_env = client
                .job_env()
                .and_then(|(k, v)| CString::new(format!("{k}={v}")).ok());
            // Only where there is a broker: a job of the make's recipes
            // goes by it to find the recipe whose slot it shares there.
            let runner_env = slot_env.as_ref().and_then(|_| {
                CString::new(format!(
                    "{}={}",
                    client::RUNNER_ENV,
                    client::runner_env_value()
                ))
                .ok()
            });
            return Box::into_raw(Box::new(herdless_client {
                client,
                held: AtomicU32::new(0),
                slot_env,
                runner_env,
            }));
        }
        Ok(Err(errno)) => errno,
        Err(_) => -PANICKED,
    };
    Errno::set_raw(errno);
    ptr::null_mut()
}

/// How long `herdless_client_free` waits for the broker's answers to
/// withdrawals still in flight (none in flight: no wait at all).
const SETTLE_AT_FREE: std::time::Duration = std::time::Duration::from_secs(1);

fn options() -> Options {
    Options::default().implicit_token(false)
}

/// `herdless_client_native_from_env_as` and `herdless_connect_begin_as`
/// flag: the caller is a make started as a sub-make, which keeps its
/// implicit token itself. A recipe may start several at once (`xargs -P
/// 4 make`, `make -C a & make -C b & wait`), or one beside `herdless exec`
/// jobs: they all run on the one token the make above took for that
/// recipe. Where this make's parent is not that make (the recipe's token
/// is shared), the connection names the recipe's slot, and the make must
/// hold it before it runs anything: see `herdless_implicit_token`. A make
/// that its parent make started directly owns the recipe's token outright,
/// as without the flag. Linux only (elsewhere the flag changes nothing).
pub const HERDLESS_AS_SUB_MAKE: c_uint = 1;

/// The options for connect flags `flags`, or `EINVAL` for an unknown one.
fn options_as(flags: c_uint) -> Result<Options, c_int> {
    if flags & !HERDLESS_AS_SUB_MAKE != 0 {
        return Err(libc::EINVAL);
    }
    Ok(options().runner_in_recipe(flags & HERDLESS_AS_SUB_MAKE != 0))
}

/// Borrows the handle behind `c`, or `None` for NULL.
///
/// # Safety
///
/// `c` is NULL or a handle from `herdless_client_from_env` or
/// `herdless_client_connect` that has not been freed, and it is not freed
/// while the returned reference lives.
unsafe fn handle<'a>(c: *const herdless_client) -> Option<&'a herdless_client> {
    // SAFETY: by this function's contract `c` is NULL or points to a live
    // `herdless_client` made by `Box::into_raw`; the handle is only ever
    // accessed through shared references (its fields are `Sync`).
    unsafe { c.as_ref() }
}

/// Connects to the jobserver named in the environment: the herdless broker
/// in `HERDLESS_SOCKET` (or, where supported, a classic jobserver named in
/// `MAKEFLAGS`: when `HERDLESS_SOCKET` is unset, and when that jobserver is
/// not the broker's own, as `herdless_client_native_from_env` says).
///
/// Returns a new handle, owned by the caller (free it with
/// `herdless_client_free`), or NULL with `errno` set: `ENOENT` when the
/// environment names no jobserver, `ECONNREFUSED` when nobody listens on
/// the socket or the broker refuses this client (one that turns it away
/// to keep descriptors free for the make it runs in is asked again, with
/// growing pauses, for up to two minutes, then `EMFILE`), `EBADF` when the classic
/// jobserver named is unusable, another value when the connection fails
/// otherwise. `herdless_strerror(-errno)` describes it.
#[no_mangle]
pub extern "C" fn herdless_client_from_env() -> *mut herdless_client {
    into_handle(catch_unwind(|| {
        standard_fds();
        match own_broker() {
            Some(path) => Client::connect_with(&path, options()),
            None => Client::from_env_with(options()),
        }
        .map_err(|e| e.errno())
    }))
}

/// Connects to the herdless broker named in `HERDLESS_SOCKET`, and only
/// to it: never to a classic jobserver named in `MAKEFLAGS`. For a make
/// that manages its classic jobserver itself and uses herdless only when
/// a broker is there.
///
/// A broker is not this process's to use when the classic jobserver it
/// was handed (`--jobserver-auth` or `-J` in `MAKEFLAGS`) is not the
/// broker's own, as `HERDLESS_CLASSIC` names it: a stock make that
/// started a `-jN` group of its own lies between, and its `-j` must hold
/// (see `jobserver_between` in the Rust crate). Then this fails with
/// `ENOENT`, and the make uses that jobserver as a stock make would. A
/// process that started the broker itself (`herdless_broker_start`), or
/// a fork of it, is never turned away so: its `MAKEFLAGS` may name the jobserver of a make
/// above it, which its children no longer see.
///
/// Returns a new handle, or NULL with `errno` set: `ENOENT` when
/// `HERDLESS_SOCKET` is not set (or empty), a classic jobserver lies
/// between (above), or its socket does not exist,
/// `ECONNREFUSED` when nobody listens there or the broker refuses this
/// client, another value when the connection fails otherwise.
///
/// `EMFILE` also when fewer than `HERDLESS_FD_HEADROOM` descriptors are
/// free in this process: a connection takes up to four (the socket, the
/// shared table, and `herdless_poll_handoff`'s two), and the make must
/// still open its makefiles and run its jobs. Such a make goes on with
/// its stock jobserver, as it would without a broker, and keeps the
/// descriptors it has for its own work.
#[no_mangle]
pub extern "C" fn herdless_client_native_from_env() -> *mut herdless_client {
    herdless_client_native_from_env_as(0)
}

/// `herdless_client_native_from_env` with connect flags: 0, or
/// `HERDLESS_AS_SUB_MAKE`. NULL with `EINVAL` for any other bit.
#[no_mangle]
pub extern "C" fn herdless_client_native_from_env_as(flags: c_uint) -> *mut herdless_client {
    into_handle(catch_unwind(|| {
        standard_fds();
        let options = options_as(flags)?;
        match broker_from_env() {
            Some(path) => {
                fd_headroom()?;
                Client::connect_with(&path, options).map_err(|e| e.errno())
            }
            None => Err(libc::ENOENT),
        }
    }))
}

/// The descriptors that must be free for `herdless_client_native_from_env`
/// or `herdless_connect_begin` to connect: the four a connection may take,
/// and four left to the program.
pub const HERDLESS_FD_HEADROOM: usize = 8;

/// The sockets of the brokers this process started
/// (`herdless_broker_start`) and has not stopped; a fork (not yet an
/// exec) has its parent's list, and its parent's environment.
static STARTED_HERE: std::sync::Mutex<Vec<OsString>> = std::sync::Mutex::new(Vec::new());

/// The broker named in `HERDLESS_SOCKET`, unless a classic jobserver lies
/// between (`client::jobserver_between`): a process that started that
/// broker itself uses it whatever its own `MAKEFLAGS` names (the jobserver
/// of a make above it, which its children no longer see).
fn broker_from_env() -> Option<std::path::PathBuf> {
    own_broker().or_else(client::broker_from_env)
}

/// The socket in `HERDLESS_SOCKET`, when this process (or the process it
/// is a fork of) started that broker.
///
/// Never waits for the list's lock: a fork of a process in which another
/// thread held it (starting or stopping a broker) would wait for good. A
/// lock taken counts as not started here.
fn own_broker() -> Option<std::path::PathBuf> {
    let socket = client::socket_from_env()?;
    let here = STARTED_HERE
        .try_lock()
        .map(|l| l.iter().any(|s| *s == socket.as_os_str()))
        .unwrap_or(false);
    here.then_some(socket)
}

/// `Err(EMFILE)` when fewer than `HERDLESS_FD_HEADROOM` descriptors are
/// free (`herdless_fds_free`).
fn fd_headroom() -> Result<(), i32> {
    if herdless_platform::descriptors_free(HERDLESS_FD_HEADROOM) {
        Ok(())
    } else {
        Err(libc::EMFILE)
    }
}

/// Whether at least `n` file descriptors are free in this process: 1 if
/// so, 0 if not (the descriptor limit less those open, where the kernel
/// counts them: Linux's `/proc/self/fd`, read through one descriptor held
/// for the moment, FreeBSD's `kern.proc.nfds`; elsewhere it opens
/// `/dev/null` and duplicates it until `n` are open, and closes them
/// again). For a make that needs descriptors of
/// its own beside a connection: the herdless bmake finishes a sub-make's
/// connection only
/// with room for its job pipes too, and otherwise runs on its stock
/// jobserver. A failure other than a full table (to open `/dev/null`,
/// say) counts as room.
#[no_mangle]
pub extern "C" fn herdless_fds_free(n: c_uint) -> c_int {
    catch_unwind(|| c_int::from(herdless_platform::descriptors_free(n as usize))).unwrap_or(1)
}

/// Makes sure descriptors 0, 1 and 2 are open, opening `/dev/null` on each
/// one that is closed, so that no descriptor opened later takes a standard
/// stream's number: a make started with `2>&-` would otherwise write its
/// messages into its connection to the broker, or into a jobserver FIFO,
/// whichever it opened first. Every function here that opens a descriptor
/// (`herdless_client_from_env`, `herdless_client_native_from_env`,
/// `herdless_connect_begin`, `herdless_client_connect`,
/// `herdless_broker_start`) does this first; call it yourself before
/// opening descriptors of your own ahead of those (GNU make opens its
/// jobserver FIFO first).
///
/// Returns 0, or a negative errno value (`/dev/null` cannot be opened,
/// say); nothing is left half done.
#[no_mangle]
pub extern "C" fn herdless_open_standard_fds() -> c_int {
    catch_unwind(|| match herdless_platform::open_standard_fds() {
        Ok(()) => 0,
        Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
    })
    .unwrap_or(PANICKED)
}

/// Before a call that opens descriptors: see `herdless_open_standard_fds`
/// (a failure leaves the streams as they were, as without it).
fn standard_fds() {
    let _ = herdless_platform::open_standard_fds();
}

/// A connection to a broker begun by `herdless_connect_begin`: the hello
/// is sent, the broker's answer not read yet. Opaque: ended by
/// `herdless_connect_finish` or `herdless_connect_abandon`.
#[allow(non_camel_case_types)]
pub struct herdless_connecting {
    connecting: client::Connecting,
}

/// Begins `herdless_client_native_from_env`: connects to the broker named
/// in `HERDLESS_SOCKET` and sends the hello, without waiting for the
/// broker's answer. A make that begins as it starts (before it reads its
/// makefiles) and finishes when it sets up its jobserver finds the answer
/// there: connecting costs it no sleep, and no context switch.
///
/// Returns a new begun connection, owned by the caller (end it with
/// `herdless_connect_finish` or `herdless_connect_abandon`), or NULL with
/// `errno` set as `herdless_client_native_from_env` sets it for a failed
/// connection (`ENOENT`: no `HERDLESS_SOCKET`, or no such socket;
/// `ECONNREFUSED`: nobody listens there; `EMFILE`: too few descriptors
/// free, see `HERDLESS_FD_HEADROOM`). A broker's refusal is reported by
/// `herdless_connect_finish`, or here when the broker turned the
/// connection away as it accepted it, before the hello was sent (`EMFILE`
/// from a broker that keeps its process's descriptors free, see
/// `herdless_broker_keep_fds`; `ECONNREFUSED` from a busy one, which
/// `herdless_client_native_from_env` would ask again). The socket is
/// close-on-exec.
#[no_mangle]
pub extern "C" fn herdless_connect_begin() -> *mut herdless_connecting {
    herdless_connect_begin_as(0)
}

/// `herdless_connect_begin` with connect flags: 0, or
/// `HERDLESS_AS_SUB_MAKE` (see `herdless_client_native_from_env_as`).
/// NULL with `EINVAL` for any other bit.
#[no_mangle]
pub extern "C" fn herdless_connect_begin_as(flags: c_uint) -> *mut herdless_connecting {
    let made = catch_unwind(|| {
        standard_fds();
        let options = options_as(flags)?;
        match broker_from_env() {
            Some(path) => {
                fd_headroom()?;
                Client::begin_connect_with(&path, options).map_err(|e| e.errno())
            }
            None => Err(libc::ENOENT),
        }
    });
    let errno = match made {
        Ok(Ok(connecting)) => {
            return Box::into_raw(Box::new(herdless_connecting { connecting }));
        }
        Ok(Err(errno)) => errno,
        Err(_) => -PANICKED,
    };
    Errno::set_raw(errno);
    ptr::null_mut()
}

/// Ends a connection begun by `herdless_connect_begin`: reads the broker's
/// answer (waiting for it only if it has not come yet) and returns the
/// handle, as `herdless_client_native_from_env` returns it, or NULL with
/// `errno` set as that function sets it. `p` is freed either way. When
/// `HERDLESS_SOCKET` no longer names the socket it was begun on, the begun
/// connection is dropped and this connects as
/// `herdless_client_native_from_env` does (NULL with `ENOENT` when the
/// variable is gone); so it does in a fork of the process that began it.
/// A broker that was busy, or does not know the shared table, is asked
/// again as the plain connect asks it. NULL `p`: `EINVAL`.
///
/// # Safety
///
/// `p` is NULL or a begun connection not yet finished or abandoned; it is
/// not used after this call.
#[no_mangle]
pub unsafe extern "C" fn herdless_connect_finish(
    p: *mut herdless_connecting,
) -> *mut herdless_client {
    if p.is_null() {
        Errno::set_raw(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: not NULL, and by this function's contract made by
    // `Box::into_raw` in `herdless_connect_begin` and not used after this
    // call, so ownership can return to a Box.
    let begun = unsafe { Box::from_raw(p) };
    into_handle(catch_unwind(AssertUnwindSafe(move || {
        let connecting = begun.connecting;
        match broker_from_env() {
            Some(path) if path == connecting.socket() => connecting.finish().map_err(|e| e.errno()),
            Some(path) => {
                let options = connecting.options();
                drop(connecting);
                fd_headroom()?;
                Client::connect_with(&path, options).map_err(|e| e.errno())
            }
            None => Err(libc::ENOENT),
        }
    })))
}

/// Drops a connection begun by `herdless_connect_begin` without finishing
/// it (the make turned out not to need the broker): the connection closes
/// and the broker forgets it. NULL is ignored.
///
/// # Safety
///
/// `p` is NULL or a begun connection not yet finished or abandoned; it is
/// not used after this call.
#[no_mangle]
pub unsafe extern "C" fn herdless_connect_abandon(p: *mut herdless_connecting) {
    if p.is_null() {
        return;
    }
    // SAFETY: as in `herdless_connect_finish`.
    let begun = unsafe { Box::from_raw(p) };
    let _ = catch_unwind(AssertUnwindSafe(move || drop(begun)));
}

/// Connects to the herdless broker listening on the Unix socket
/// `socket_path` (a NUL-terminated path).
///
/// Returns a new handle, owned by the caller (free it with
/// `herdless_client_free`), or NULL with `errno` set: `EINVAL` when
/// `socket_path` is NULL or empty, `ENAMETOOLONG` when it cannot be reached
/// for its length (a socket address holds 107 bytes on Linux and 103 on the
/// BSDs and macOS; on Linux a longer path is reached through its directory,
/// `/proc/self/fd/N/NAME`), `ENOENT` when it does not exist, `ECONNREFUSED`
/// when nobody listens there or the broker refuses this client.
///
/// # Safety
///
/// `socket_path` is NULL or points to a NUL-terminated string that stays
/// valid and unchanged during the call.
#[no_mangle]
pub unsafe extern "C" fn herdless_client_connect(
    socket_path: *const c_char,
) -> *mut herdless_client {
    if socket_path.is_null() {
        Errno::set_raw(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: not NULL, and by this function's contract a NUL-terminated
    // string valid for the whole call; it is copied before returning.
    let path = unsafe { CStr::from_ptr(socket_path) };
    let path = OsStr::from_bytes(path.to_bytes());
    into_handle(catch_unwind(|| {
        if path.is_empty() {
            return Err(libc::EINVAL);
        }
        standard_fds();
        Client::connect_with(path, options()).map_err(|e| e.errno())
    }))
}

/// Takes one token from the shared pool, waiting at most `timeout_ms`
/// milliseconds (`HERDLESS_WAIT_FOREVER`, -1, waits as long as it takes; 0
/// asks once, through the queue). The caller's implicit token is never
/// involved: keep it yourself.
///
/// Returns 0 when a token is now held through `c` (give it back with
/// `herdless_release`), or:
/// - `-ETIMEDOUT`: the time ran out; the request was withdrawn, no token is
///   held or owed;
/// - `-EINTR`: a signal handler ran during the wait (`SA_RESTART` makes no
///   difference). No token is lost: the request stays queued at the
///   broker and the next `herdless_acquire`, `herdless_try_acquire` or
///   `herdless_take_grant` picks up its grant; `herdless_cancel` withdraws
///   it instead;
/// - `-ECANCELED`: the tree was aborted (see `herdless_aborted`);
/// - `-ECONNRESET`: the broker went away;
/// - `-EINVAL`: `c` is NULL or `timeout_ms` is below -1.
///
/// # Safety
///
/// `c` is NULL or a live handle (not yet freed, and not freed during the
/// call).
#[no_mangle]
pub unsafe extern "C" fn herdless_acquire(c: *mut herdless_client, timeout_ms: c_int) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| {
        let deadline = match timeout_ms {
            HERDLESS_WAIT_FOREVER => None,
            ms if ms < 0 => return -libc::EINVAL,
            ms => Some(Instant::now() + Duration::from_millis(ms.unsigned_abs().into())),
        };
        c.took_maybe(c.client.acquire_interruptible(deadline), -libc::ETIMEDOUT)
    })
}

/// For a make connected with `HERDLESS_AS_SUB_MAKE`: makes sure the
/// implicit token its first job runs on is its own. Call it once, right
/// after connecting and before the make runs anything.
///
/// Returns 0 when the make owns its implicit token outright (its parent
/// make started it directly, or the flag was not given): nothing is taken
/// or held. Returns 1 when the make shares its recipe's token with other
/// processes of that recipe and now holds one through `c`, waiting as long
/// as it takes: the recipe's slot, lent at once unless another process of
/// the recipe holds it, or else a shared token or the slot, whichever
/// comes first. It is the make's implicit token: keep it until the make's
/// last job has ended, then give it back with `herdless_release` (or let
/// `herdless_client_free` give back everything). A release gives back a
/// shared token before the slot. Failures are `herdless_acquire`'s with
/// no time limit: after `-EINTR` call it again (the request stays queued).
/// Called again after it returned 1: `-EINVAL`.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_implicit_token(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.borrow_recipe_slot() {
        Ok(Some(token)) => {
            c.took(token);
            1
        }
        Ok(None) => 0,
        Err(e) => -e.errno(),
    })
}

/// Takes one token from the shared pool if one is free now (or a grant for
/// an earlier request has arrived). Never waits for a token to be
/// released; it does wait for the broker's answer, a round trip. While a
/// request is queued (left by `herdless_take_grant` or an interrupted
/// acquire) it does not ask again: it returns 0 only once that request's
/// grant has arrived.
///
/// Returns 0 when a token is now held through `c`, `-EAGAIN` when none is
/// free, or `-ECANCELED`, `-ECONNRESET`, `-EINVAL` as `herdless_acquire`.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_try_acquire(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| c.took_maybe(c.client.try_acquire(), -libc::EAGAIN))
}

/// Gives back one token taken through `c`.
///
/// Returns 0, or `-EINVAL` when `c` is NULL or holds no token (a double
/// release; nothing is sent), or `-ECONNRESET` when the broker is gone
/// (it has taken the token back already; the handle counts it as given
/// back). On any other error the token is still held.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_release(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| {
        let counted = c
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if counted.is_err() {
            return -libc::EINVAL;
        }
        match c.client.release_raw() {
            Ok(()) => 0,
            // A broker that is gone has taken the token back already.
            Err(e) if e.kind() == ErrorKind::BrokerGone => -e.errno(),
            Err(e) => {
                // Not given back (a classic pipe that could not be written,
                // say): still held, and still owed.
                c.held.fetch_add(1, Ordering::AcqRel);
                -e.errno()
            }
        }
    })
}

/// The descriptor to watch for reading in the caller's own `poll`,
/// `select` or `pselect`: it becomes readable when a grant for a pending
/// request has arrived (or an abort, or the broker's end, which the next
/// call reports). Use it only to wait; read from it only through
/// `herdless_take_grant`. It stays owned by the handle and valid until
/// `herdless_client_free`.
///
/// Returns the descriptor (0 or more), or `-EINVAL` when `c` is NULL.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_fd(c: *const herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| c.client.as_raw_fd())
}

/// For a caller's own poll loop: takes a token if a grant has arrived, or
/// if one is free now (asked for with one round trip to the broker, so a
/// free token never costs a pass through the poll loop); otherwise makes
/// sure one request is queued at the broker, so that `herdless_fd` becomes
/// readable when it is granted. Never waits for a token to be released.
/// While a request is queued it sends nothing.
///
/// Returns 0 when a token is now held through `c`; `-EAGAIN` when none has
/// arrived yet (wait for `herdless_fd` to become readable, then call this
/// again); `-ECANCELED`, `-ECONNRESET`, `-EINVAL` as `herdless_acquire`.
/// A request it leaves queued stays until granted and taken, withdrawn by
/// `herdless_cancel`, or the handle is freed.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_take_grant(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| c.took_maybe(c.client.take_grant(), -libc::EAGAIN))
}

/// Like `herdless_take_grant`, but never waits for the broker: when no
/// grant has arrived and no request is queued, it queues one (a single
/// message) and returns `-EAGAIN` at once; a token that is free comes as
/// a grant straight away and makes `herdless_fd` readable (or, on the
/// broker's host, is taken from the shared token table at once, with no
/// message: then it returns 0). Under a pool
/// that is usually empty (a make at a high `-j`) this costs one broker
/// wake-up per token instead of two; when tokens are free it costs one
/// more pass through the caller's poll loop.
///
/// Returns 0 when a token is now held through `c`, `-EAGAIN` when none has
/// arrived yet, or `-ECANCELED`, `-ECONNRESET`, `-EINVAL` as
/// `herdless_acquire`.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_request_grant(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| c.took_maybe(c.client.request_grant(), -libc::EAGAIN))
}

/// Lets the caller's poll loop wait for tokens in the broker's shared
/// table (Linux): a token another client gives back is handed to this one
/// directly, without a message to the broker, and the giver wakes this
/// process with `SIGURG`, which herdless handles from then on (with
/// `SA_RESTART`; `poll`, `select` and sleeps return `EINTR` when it
/// comes). Call it once, before the first `herdless_request_grant` or
/// `herdless_take_grant`; from then on `herdless_fd` returns another
/// descriptor, readable also when such a hand-over comes: poll that one.
///
/// Returns 1 when it is on; 0 when it is not available (a classic
/// jobserver, a broker that keeps waits out of its table, not Linux):
/// requests go over the socket as before; `-EEXIST` when the program
/// handles `SIGURG` itself (nothing changes); another negative errno when
/// the descriptors cannot be made; `-EINVAL` when `c` is NULL.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_poll_handoff(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.enable_poll_handoff() {
        Ok(on) => c_int::from(on),
        Err(e) => -e.errno(),
    })
}

/// Withdraws a request left queued by `herdless_take_grant` or by an
/// acquire that a signal interrupted, when the caller no longer wants the
/// token (a make whose last jobs are running, for instance), so that it
/// goes to another waiter instead of idling here. Waits for the broker's
/// answer, a round trip.
///
/// Returns 0 when nothing is owed any more, 1 when the grant had arrived
/// already: a token is now held through `c` (use it, or give it back with
/// `herdless_release`), or `-ECANCELED`, `-ECONNRESET`, `-EINVAL` as
/// `herdless_acquire`.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_cancel(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.cancel_pending() {
        Ok(Some(t)) => {
            c.took(t);
            1
        }
        Ok(None) => 0,
        Err(e) => -e.errno(),
    })
}

/// Withdraws, without waiting for the broker's answer, a request left
/// queued by `herdless_take_grant` or by an interrupted acquire, for a
/// caller that no longer wants the token (a make with nothing left to
/// start, say). A grant that had arrived already goes back to the broker,
/// and so does one that races the withdrawal (the broker granted the
/// request before it read the withdrawal): the caller holds nothing new
/// afterwards. The broker takes that raced grant back itself the moment it
/// reads the withdrawal, and the token goes on to the next waiter; the
/// grant, read at this handle's next call, is void (protocol version 5).
/// Against a broker of an older herdless, the raced grant is read and
/// given back at the next call on this handle that reads the socket
/// (`herdless_pending`, `herdless_take_grant`, `herdless_release`, …),
/// and idles in this process's socket until then. On a classic jobserver
/// there is nothing to withdraw.
///
/// Returns 0, or `-ECONNRESET`, `-EINVAL` as `herdless_acquire`. After an
/// abort it returns 0: the broker ended every request.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_cancel_nowait(c: *mut herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.cancel_pending_nowait() {
        Ok(()) => 0,
        Err(e) => -e.errno(),
    })
}

/// Whether a request is pending: 1 when a request left by
/// `herdless_take_grant` or an interrupted acquire is still queued at the
/// broker or its grant has arrived and is not taken yet, 0 when not (and
/// always on a classic jobserver or after an abort). Never waits: it reads
/// what has arrived. `-ECONNRESET`, `-EINVAL` as `herdless_acquire`.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_pending(c: *const herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.has_pending() {
        Ok(p) => c_int::from(p),
        Err(e) => -e.errno(),
    })
}

/// The number of shared tokens in the pool (`-j` minus one): what a make
/// connected through `HERDLESS_SOCKET` alone learns its `-j` from (its `-j`
/// is this plus one). On a classic jobserver, the `-j` minus one that came
/// with it in `MAKEFLAGS`.
///
/// Returns the count (0 or more), `-ENOTSUP` on a classic jobserver that
/// gave no `-j`, or `-EINVAL` when `c` is NULL.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_capacity(c: *const herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| match c.client.capacity() {
        Some(n) => c_int::try_from(n).unwrap_or(c_int::MAX),
        None => -libc::ENOTSUP,
    })
}

/// Writes the broker's status report (a JSON object, the same as
/// `herdless status --json`) into `buf`, NUL-terminated, truncated to
/// `len` bytes (terminator included). Waits for the broker's answer, a
/// round trip.
///
/// Returns the length of the whole report without its terminator (call
/// again with a buffer of at least that plus one when it is `len` or more),
/// `-ENOTSUP` on a classic jobserver (it keeps no status), `-ECONNRESET`
/// when the broker is gone, or `-EINVAL` when `c` is NULL, or `buf` is NULL
/// with `len` above 0.
///
/// # Safety
///
/// `c` is NULL or a live handle; `buf` is NULL or points to `len` writable
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn herdless_status(
    c: *const herdless_client,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    if buf.is_null() && len > 0 {
        return -libc::EINVAL;
    }
    let json = match catch_unwind(AssertUnwindSafe(|| c.client.status_json())) {
        Ok(Ok(json)) => json,
        Ok(Err(e)) => return -e.errno(),
        Err(_) => return PANICKED,
    };
    if len > 0 {
        let n = json.len().min(len - 1);
        // SAFETY: `buf` is not NULL and, by this function's contract, has
        // `len` writable bytes; `n + 1 <= len`, and the source is a Rust
        // string that cannot overlap a buffer the caller owns.
        unsafe {
            ptr::copy_nonoverlapping(json.as_ptr().cast::<c_char>(), buf, n);
            *buf.add(n) = 0;
        }
    }
    c_int::try_from(json.len()).unwrap_or(c_int::MAX)
}

/// Aborts the whole tree: `reason` is `'E'` (a job failed) or `'I'` (the
/// build was interrupted). Every client is told (native clients by
/// message, bmake children by an `E` or `I` token), waiting acquires end
/// with `-ECANCELED`, and no token is granted after it: through a broker
/// it returns once the broker has taken the abort (one round trip), so no
/// acquire anywhere succeeds after it returns. The first abort wins; later
/// ones succeed and change nothing. Tokens held stay held until released
/// or freed.
///
/// Returns 0, or `-EINVAL` when `c` is NULL or `reason` is neither `'E'`
/// nor `'I'`, `-ECONNRESET` when the broker is gone, or `-ENOTSUP` on a
/// classic GNU make jobserver, which has no abort token (exit with a
/// failure status instead).
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_abort(c: *mut herdless_client, reason: c_char) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| {
        // `c_char` is signed on some targets: compare the byte.
        let Some(reason) = AbortReason::from_byte(reason as u8) else {
            return -libc::EINVAL;
        };
        match c.client.abort(reason) {
            Ok(()) => 0,
            Err(e) => -e.errno(),
        }
    })
}

/// Whether an abort has reached this client: 0 when not (yet), `'E'` or
/// `'I'` when it has; `-EINVAL` when `c` is NULL. Never waits: it reads
/// what has arrived. A waiting `herdless_acquire` ends with `-ECANCELED`
/// as soon as the abort arrives.
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_aborted(c: *const herdless_client) -> c_int {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return -libc::EINVAL;
    };
    guard(|| {
        c.client
            .aborted()
            .map_or(0, |reason| c_int::from(reason.byte()))
    })
}

/// Gives back every token still held through the handle, closes the
/// connection and frees the handle. A request still pending (a wait in the
/// shared table, a request queued at the broker) is withdrawn first, and
/// the broker's answers to withdrawals still in flight
/// (`herdless_cancel_nowait`) are awaited, for at most a second and only
/// when there are any: a token handed over or granted meanwhile is given
/// back, not left for the broker to take back from the closed connection
/// as from a client that died. Under a classic jobserver the tokens are
/// written back to its pipe. NULL is ignored.
///
/// # Safety
///
/// `c` is NULL or a live handle, and no other call on it is in progress
/// or follows: after this call the pointer dangles.
#[no_mangle]
pub unsafe extern "C" fn herdless_client_free(c: *mut herdless_client) {
    if c.is_null() {
        return;
    }
    // SAFETY: not NULL, and by this function's contract made by
    // `Box::into_raw` in `into_handle` and used by nobody after this call,
    // so ownership can return to a Box.
    let handle = unsafe { Box::from_raw(c) };
    // A panic while closing must not unwind into C; the handle is gone
    // either way.
    let _ = catch_unwind(AssertUnwindSafe(move || {
        // A wait still pending, or a withdrawal not answered yet, may bring
        // a token as the handle closes (a make that withdrew its request
        // before its last poll, then exits): settle them, briefly, and give
        // back what they brought, so the broker takes nothing back from a
        // client that died. Dropping the tokens gives them back.
        drop(handle.client.settle_pending(SETTLE_AT_FREE));
        // A broker would take these back when the connection closes, but a
        // classic pipe would not: give them back one by one. Failures are
        // moot (a broker that is gone has them already).
        for _ in 0..handle.held.load(Ordering::Acquire) {
            let _ = handle.client.release_raw();
        }
        drop(handle)
    }));
}

/// The variable a make puts into the environment of each job it starts,
/// `HERDLESS_SLOT=…`: it names the slot the broker minted for this handle's
/// own job, so that a `herdless exec` in one of the make's jobs runs in the
/// make's slot (one such exec at a time; the others wait for shared
/// tokens) instead of taking the slot of the runner above the make, which
/// the make itself runs a job on. A make that sets `MAKELEVEL` for its jobs
/// (GNU make and bmake do) needs it less: a changed `MAKELEVEL` already
/// makes `exec` use its recipe's slot. The value ends in `/` and the
/// `MAKELEVEL` of this process when it connected; a make that had raised
/// it in its own environment for its jobs (bmake does) puts its own level
/// there instead, or every job of it matches and shares the one slot.
/// Put `herdless_runner_env` beside it.
///
/// Returns a NUL-terminated string owned by the handle, valid until
/// `herdless_client_free`, or NULL for a NULL handle and on a classic
/// jobserver (which has no broker to lend a slot).
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_slot_env(c: *const herdless_client) -> *const c_char {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return ptr::null();
    };
    c.slot_env.as_ref().map_or(ptr::null(), |s| s.as_ptr())
}

/// The other variable a make puts into the environment of each job it
/// starts, `HERDLESS_RUNNER=…`: this process's id and PID namespace, as
/// they were when the handle was made. A job of the make's recipes finds
/// the recipe whose token it shares (README, "How many jobs") by walking
/// up the process tree to a make, which it knows by its command name
/// (`make`, `bmake`, …) or by this variable: a make installed under a
/// name of its own (`hmake`) is then known too. A job in another PID
/// namespace ignores it.
///
/// Returns a NUL-terminated string owned by the handle, valid until
/// `herdless_client_free`, or NULL for a NULL handle and on a classic
/// jobserver (as `herdless_slot_env`).
///
/// # Safety
///
/// `c` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_runner_env(c: *const herdless_client) -> *const c_char {
    // SAFETY: this function's contract is `handle`'s.
    let Some(c) = (unsafe { handle(c) }) else {
        return ptr::null();
    };
    c.runner_env.as_ref().map_or(ptr::null(), |s| s.as_ptr())
}

/// A static, NUL-terminated English description of `code` (negative, as
/// the functions return it, or a positive `errno`). Never NULL; the
/// string must not be freed. Safe from any thread.
#[no_mangle]
pub extern "C" fn herdless_strerror(code: c_int) -> *const c_char {
    describe(code).as_ptr()
}

fn describe(code: c_int) -> &'static CStr {
    let errno = i32::try_from(code.unsigned_abs()).unwrap_or(i32::MAX);
    match errno {
        0 => c"success",
        libc::ETIMEDOUT => c"timed out: no token was granted in time (the request was withdrawn)",
        libc::EAGAIN => c"no token is free now",
        libc::EINTR => c"interrupted by a signal (the request stays queued; no token is lost)",
        libc::ECONNRESET => c"the herdless broker went away",
        libc::ECONNREFUSED => c"no herdless broker listens there, or it refused this client",
        libc::ENOENT => c"no jobserver: HERDLESS_SOCKET is not set or its socket does not exist",
        libc::EINVAL => c"invalid argument: a NULL handle, no token held, or a bad value",
        libc::ECANCELED => c"the build was aborted",
        libc::EPROTO => c"the herdless broker sent something this client does not understand",
        libc::EBADF => c"the jobserver named in the environment is unusable",
        libc::ENAMETOOLONG => c"the socket path is too long for a Unix socket",
        libc::ENOTSUP => c"this jobserver cannot do that (an abort on a GNU make pipe)",
        libc::EPERM => c"this handle was opened by another process (this one is a fork of it)",
        libc::EACCES => c"permission denied",
        libc::ENOTRECOVERABLE => c"internal error in herdless (a bug)",
        libc::EIO => c"input/output error",
        libc::EMFILE | libc::ENFILE => {
            c"too many open files: too few descriptors free for herdless"
        }
        _ => c"unknown error",
    }
}

/// `herdless_broker_start` flag: serve classic clients (stock GNU make
/// 4.4 and later, cargo) through a FIFO, `fifo:PATH`.
pub const HERDLESS_BROKER_CLASSIC_FIFO: c_uint = 1;
/// `herdless_broker_start` flag: serve classic clients through inherited
/// descriptors `R,W` (every GNU make, bmake's `-J`, cargo).
pub const HERDLESS_BROKER_CLASSIC_PIPE: c_uint = 2;
/// `herdless_broker_start` flag, with `HERDLESS_BROKER_CLASSIC_PIPE`: the
/// classic clients are bmakes (their `E`/`I` abort tokens are understood
/// and written).
pub const HERDLESS_BROKER_BMAKE: c_uint = 4;

/// Where a broker's thread stands.
enum BrokerThread {
    Running(std::thread::JoinHandle<std::io::Result<Status>>),
    /// Taken out to be joined, for the length of the join.
    Joining,
    /// Drained: what the thread returned.
    Ended(Box<std::thread::Result<std::io::Result<Status>>>),
}

/// Whether this process started `b` (not a fork of it), which alone may
/// drain, stop or unlink it. Async-signal-safe.
fn started_by_me(b: &herdless_broker) -> bool {
    // SAFETY: getpid(2) takes nothing and always succeeds.
    unsafe { libc::getpid() == b.pid }
}

/// A broker running on a thread of the calling process, with its socket in
/// a private directory (mode 0700). Opaque: made by
/// `herdless_broker_start`, ended by `herdless_broker_stop`.
#[allow(non_camel_case_types)]
pub struct herdless_broker {
    dir: Option<RunDir>,
    stopper: Stopper,
    /// The broker's thread, or what it returned once
    /// `herdless_broker_drain` joined it.
    thread: std::sync::Mutex<BrokerThread>,
    socket: CString,
    dir_path: CString,
    /// Every entry of the directory once the broker was set up (its
    /// socket and FIFOs), for `herdless_broker_unlink`.
    entries: Vec<CString>,
    /// The process that started it.
    pid: libc::pid_t,
    auth: Option<CString>,
    /// Pipe style: the descriptors children inherit (no close-on-exec).
    fds: Option<(OwnedFd, OwnedFd)>,
    /// `HERDLESS_SOCKET` and `HERDLESS_CLASSIC` before the start, put
    /// back by the stop.
    previous: [Option<OsString>; 2],
}

/// What a broker did, filled in by `herdless_broker_stop`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(non_camel_case_types)]
pub struct herdless_broker_report {
    /// The `-j` it served.
    pub jobs: u32,
    /// The most tokens in use at once (jobs beyond the implicit one).
    pub max_in_use: u32,
    /// Grants to native clients (connections through the socket).
    pub native_grants: u64,
    /// Tokens the classic bridge put into the pipe or FIFO.
    pub classic_offered: u64,
    /// Tokens taken back from clients that died holding them.
    pub reclaimed: u64,
    /// Tokens not accounted for at the end (0 unless something was lost).
    pub lost: i64,
    /// 0, or `'E'` / `'I'` when the tree was aborted.
    pub aborted: c_char,
    /// Native clients woken to take a grant: one per grant that waited,
    /// handed over in the shared table or sent over the socket.
    pub woken: u64,
    /// Voluntary context switches of the broker's own thread, one per
    /// wake-up of its event loop (apart from this process's other
    /// threads); -1 where the OS does not count them per thread.
    pub broker_vcsw: i64,
    /// Waits in the shared table that the broker moved to its queue when
    /// the table closed: each woke its client once more, before the grant
    /// counted in `woken`.
    pub moved: u64,
    /// Clients turned away to keep this process's descriptors free
    /// (`herdless_broker_keep_fds`); each ran on the classic jobserver.
    pub no_room: u64,
}

/// `fd` moved to the lowest free number from 15 up, inheritable as it was;
/// `fd` itself where there is none (a limit of 16 or less).
fn above_fifteen(fd: OwnedFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    if fd.as_raw_fd() >= 15 {
        return fd;
    }
    match nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_DUPFD(15)) {
        // SAFETY: `moved` was just returned by fcntl(F_DUPFD): a new
        // descriptor that nothing else owns.
        Ok(moved) => unsafe { OwnedFd::from_raw_fd(moved) },
        Err(_) => fd,
    }
}

/// Starts a broker for `-j jobs` on a new thread of this process: the pool
/// holds `jobs - 1` tokens, the last being the implicit token of the
/// caller. Its socket lives in a fresh private directory (under
/// `$XDG_RUNTIME_DIR`, `$TMPDIR` or `/tmp`), and `HERDLESS_SOCKET` is set
/// in this process's environment so that children inherit it. `flags`:
/// 0 (native clients only), or `HERDLESS_BROKER_CLASSIC_FIFO`, or
/// `HERDLESS_BROKER_CLASSIC_PIPE` (with `HERDLESS_BROKER_BMAKE` for bmake
/// conventions): classic clients then share the same pool through
/// `herdless_broker_classic_auth`. The broker leaves signals to the
/// caller.
///
/// Returns a new handle, owned by the caller (stop it with
/// `herdless_broker_stop`), or NULL with `errno` set: `EINVAL` when `jobs`
/// is 0 or more than 65536 (a make given more should run its stock
/// jobserver, or none) or `flags` is not one of the combinations above,
/// another value
/// when the directory, socket or FIFOs cannot be made.
///
/// `parent_dir`, when not NULL, is where the private directory is made
/// (a make passes its own temporary directory, so that its users'
/// settings apply), unless the socket's path there would be too long for
/// a socket address: then in the first of the defaults above where it
/// fits. NULL or an empty string picks the default above.
///
/// Call it before starting threads that read the environment: it sets
/// `HERDLESS_SOCKET` with `setenv`, and `HERDLESS_CLASSIC` (which classic
/// jobserver is the broker's own: a client handed another one does not
/// use the broker; empty without a classic side). The stop puts both
/// back as they were. A make that exports its variables to its children
/// from a table of its own (GNU make) must put both there.
///
/// # Safety
///
/// `parent_dir` is NULL or a NUL-terminated string valid for the call.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_start(
    jobs: c_uint,
    flags: c_uint,
    parent_dir: *const c_char,
) -> *mut herdless_broker {
    let parent = if parent_dir.is_null() {
        None
    } else {
        // SAFETY: not NULL, and by this function's contract a
        // NUL-terminated string valid for the call; copied at once.
        let dir = unsafe { CStr::from_ptr(parent_dir) };
        // An empty name is no directory: the default, as for NULL.
        (!dir.is_empty()).then(|| std::path::PathBuf::from(OsStr::from_bytes(dir.to_bytes())))
    };
    let made = catch_unwind(|| {
        standard_fds();
        start_broker(jobs, flags, parent.as_deref())
    });
    match made {
        Ok(Ok(b)) => Box::into_raw(Box::new(b)),
        Ok(Err(errno)) => {
            Errno::set_raw(errno);
            ptr::null_mut()
        }
        Err(_) => {
            Errno::set_raw(-PANICKED);
            ptr::null_mut()
        }
    }
}

/// The `errno` value of an I/O error, also for errors that wrap one with
/// a message (and so carry only its kind).
fn io_errno(e: &std::io::Error) -> c_int {
    use std::io::ErrorKind as K;
    e.raw_os_error().unwrap_or(match e.kind() {
        K::NotFound => libc::ENOENT,
        K::PermissionDenied => libc::EACCES,
        K::AlreadyExists => libc::EEXIST,
        K::InvalidInput => libc::EINVAL,
        K::AddrInUse => libc::EADDRINUSE,
        _ => libc::EIO,
    })
}

fn start_broker(
    jobs: c_uint,
    flags: c_uint,
    parent: Option<&std::path::Path>,
) -> Result<herdless_broker, c_int> {
    let classic = match flags {
        0 => None,
        HERDLESS_BROKER_CLASSIC_FIFO => Some((Style::Fifo, Flavor::Gnu)),
        HERDLESS_BROKER_CLASSIC_PIPE => Some((Style::Pipe, Flavor::Gnu)),
        f if f == HERDLESS_BROKER_CLASSIC_PIPE | HERDLESS_BROKER_BMAKE => {
            Some((Style::Pipe, Flavor::Bmake))
        }
        _ => return Err(libc::EINVAL),
    };
    if !(1..=herdless_lib::broker::MAX_JOBS).contains(&jobs) {
        return Err(libc::EINVAL);
    }
    let mut dir = match parent {
        Some(p) => RunDir::create_near(p),
        None => RunDir::create(),
    }
    .map_err(|e| io_errno(&e))?;
    let mut broker = Broker::bind(dir.socket(), Config::new(jobs)).map_err(|e| io_errno(&e))?;
    dir.set_bound();
    let mut auth = None;
    let mut fds = None;
    let mut id = String::new();
    if let Some((style, flavor)) = classic {
        let mut bridge =
            Bridge::create(dir.dir(), style, flavor, jobs).map_err(|e| io_errno(&e))?;
        fds = bridge.take_inheritable_fds().map_err(|e| io_errno(&e))?;
        if flavor == Flavor::Bmake {
            // Where bmake puts its own job pipe (`JobCreatePipe(…, 15)`):
            // a sub-make run under a low `ulimit -n` finds room below it.
            fds = fds.map(|(r, w)| (above_fifteen(r), above_fifteen(w)));
        }
        let raw = fds.as_ref().map(|(r, w)| (r.as_raw_fd(), w.as_raw_fd()));
        let text = match bridge.auth(raw) {
            Auth::Fifo(path) => {
                let mut t = b"fifo:".to_vec();
                t.extend_from_slice(path.as_os_str().as_bytes());
                t
            }
            Auth::Fds { read, write } => format!("{read},{write}").into_bytes(),
            Auth::Disabled => unreachable!("a bridge is never disabled"),
        };
        auth = Some(CString::new(text).map_err(|_| libc::EINVAL)?);
        id = classic_env_value(bridge.id());
        broker = broker.with_bridge(bridge).map_err(|e| io_errno(&e))?;
    }
    // Children may change directory: the variable names the socket by an
    // absolute path even when `parent_dir` is relative (the FIFO keeps the
    // caller's form, as a make's own FIFO would: GNU make's test suite
    // checks that form).
    let socket = std::path::absolute(dir.socket()).map_err(|e| io_errno(&e))?;
    let socket = CString::new(socket.into_os_string().into_vec()).map_err(|_| libc::EINVAL)?;
    let dir_path = CString::new(dir.dir().as_os_str().as_bytes()).map_err(|_| libc::EINVAL)?;
    // Everything the broker and its bridge made is there now; nothing is
    // added later.
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir.dir()).map_err(|e| io_errno(&e))? {
        let path = entry.map_err(|e| io_errno(&e))?.path();
        entries.push(CString::new(path.into_os_string().into_vec()).map_err(|_| libc::EINVAL)?);
    }
    // The caller is the command at the top: when it connects natively, as
    // a make with herdless inside does next, the bridge learns it from the
    // broker like any other native command.
    broker.set_command(std::process::id());
    let stopper = broker.stopper();
    // The make's signals (SIGCHLD, the table's SIGURG, SIGINT) are the
    // make's threads' to take, never the broker's.
    let thread = herdless_platform::spawn_unsignalled(
        std::thread::Builder::new().name("herdless-broker".into()),
        move || broker.run(),
    )
    .map_err(|e| io_errno(&e))?;
    if let Ok(mut list) = STARTED_HERE.lock() {
        list.push(OsStr::from_bytes(socket.as_bytes()).to_owned());
    }
    let previous = [SOCKET_ENV, CLASSIC_ENV].map(std::env::var_os);
    std::env::set_var(SOCKET_ENV, OsStr::from_bytes(socket.as_bytes()));
    std::env::set_var(CLASSIC_ENV, id);
    Ok(herdless_broker {
        dir: Some(dir),
        stopper,
        thread: std::sync::Mutex::new(BrokerThread::Running(thread)),
        socket,
        dir_path,
        entries,
        pid: std::process::id() as libc::pid_t,
        auth,
        fds,
        previous,
    })
}

/// The most descriptors a broker started by `herdless_broker_start` takes
/// of its own, with its classic bridge and the caller's own connection
/// (on Linux 13 with a classic pipe, as in a bmake or a GNU make with
/// `--jobserver-style=pipe`, and 10 with a FIFO): a make that has fewer
/// free than this beyond what it needs itself keeps its stock jobserver.
pub const HERDLESS_BROKER_FDS: c_uint = 16;

/// Keeps `n` of this process's file descriptors free for the caller: the
/// broker runs in the caller's process and shares its descriptor table,
/// and each client costs it a socket, and a process descriptor while it
/// holds tokens (Linux). From the call on, a new client is accepted only
/// while `n` descriptors stay free beyond those two; one turned away is
/// told so and does not try again (`herdless_client_native_from_env` and
/// `herdless_connect_finish` fail with `EMFILE` there), and a make runs on
/// the classic jobserver, which the broker's bridge serves from the same
/// pool. The caller's own connection is never turned away. Pass how many
/// the caller may still open beside those it holds (a bmake: a pipe per
/// job, and a few more); 0, the default, keeps none. Returns 0, or
/// `-EINVAL` when `b` is NULL.
///
/// # Safety
///
/// `b` is NULL or a live broker handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_keep_fds(b: *const herdless_broker, n: c_uint) -> c_int {
    // SAFETY: by this function's contract `b` is NULL or a live handle made
    // by `Box::into_raw`, only read here.
    match unsafe { b.as_ref() } {
        Some(b) => {
            b.stopper.keep_fds_free(n as usize);
            0
        }
        None => -libc::EINVAL,
    }
}

/// The broker's socket path (what `HERDLESS_SOCKET` was set to), or NULL
/// when `b` is NULL. Owned by the handle, valid until
/// `herdless_broker_stop`.
///
/// # Safety
///
/// `b` is NULL or a live broker handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_socket(b: *const herdless_broker) -> *const c_char {
    // SAFETY: by this function's contract `b` is NULL or a live handle made
    // by `Box::into_raw`, only read here.
    match unsafe { b.as_ref() } {
        Some(b) => b.socket.as_ptr(),
        None => ptr::null(),
    }
}

/// The broker's private directory (the socket's and FIFOs' parent). NULL
/// when `b` is NULL. Owned by the handle, valid until
/// `herdless_broker_stop`. A program that must clean up from a signal
/// handler calls `herdless_broker_unlink`.
///
/// # Safety
///
/// `b` is NULL or a live broker handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_dir(b: *const herdless_broker) -> *const c_char {
    // SAFETY: as in `herdless_broker_socket`.
    match unsafe { b.as_ref() } {
        Some(b) => b.dir_path.as_ptr(),
        None => ptr::null(),
    }
}

/// Where classic clients find the tokens, as a jobserver option's value:
/// `fifo:PATH` (GNU make's `--jobserver-auth=`) or `R,W` (GNU make's
/// `--jobserver-auth=`, bmake's `-J`), with R and W descriptors open in
/// this process without close-on-exec, for children to inherit. NULL when
/// the broker was started without a classic flag, or `b` is NULL. Owned by
/// the handle, valid until `herdless_broker_stop`.
///
/// # Safety
///
/// `b` is NULL or a live broker handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_classic_auth(b: *const herdless_broker) -> *const c_char {
    // SAFETY: as in `herdless_broker_socket`.
    match unsafe { b.as_ref() } {
        Some(b) => b.auth.as_ref().map_or(ptr::null(), |a| a.as_ptr()),
        None => ptr::null(),
    }
}

/// Removes the broker's socket, its FIFOs and its directory with
/// async-signal-safe calls only (`getpid`, `unlink`, `rmdir`: nothing is
/// allocated, no lock is taken), for a fatal-signal handler of the program
/// that started it, about to let the process die: the broker goes on
/// serving the connections it has until then, and new clients cannot find
/// it. `herdless_broker_stop` still stops it, and copes with the files
/// being gone.
///
/// Returns 0 when the directory is gone; the negative `errno` of the
/// `rmdir` that failed otherwise; `-EPERM`, removing nothing, when called
/// in another process than the one that started the broker (a forked
/// child); `-EINVAL` when `b` is NULL.
///
/// # Safety
///
/// `b` is NULL or a live broker handle. Safe to call from a signal handler
/// that interrupted any herdless call except `herdless_broker_stop` on
/// the same handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_unlink(b: *const herdless_broker) -> c_int {
    // SAFETY: as in `herdless_broker_socket`.
    let Some(b) = (unsafe { b.as_ref() }) else {
        return -libc::EINVAL;
    };
    if !started_by_me(b) {
        return -libc::EPERM;
    }
    for entry in &b.entries {
        // SAFETY: `entry` is a NUL-terminated path owned by the handle;
        // unlink(2) only reads it. A missing entry is no error here.
        unsafe { libc::unlink(entry.as_ptr()) };
    }
    // SAFETY: as for unlink(2) above.
    if unsafe { libc::rmdir(b.dir_path.as_ptr()) } == 0 {
        return 0;
    }
    // Reads errno into a plain value: nothing allocated.
    -std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Waits until no job runner uses the broker any more, then ends its
/// thread; `herdless_broker_stop` still frees it and reports. Until then
/// it serves as before. A job runner is a connected client whose hello
/// names no runner's slot to borrow and that is not an observer (a make,
/// any client with an implicit token of its own, a `herdless exec` on the
/// token its starter took for it), or a connection not past its
/// handshake; jobs that borrow a runner's slot, and observers, are not
/// waited for. A top-level make calls it before it exits, as stock GNU
/// make reads its jobserver back until every process that opened it has
/// closed it: a sub-make it left running in the background (`$(MAKE) …
/// &`) keeps its broker to the end. Close the caller's own connection
/// first: it is a job runner too. The wait has no deadline (stock make's
/// read has none either); a signal does not end it, so call it with
/// handlers in place for the fatal signals that remove the broker's files
/// (`herdless_broker_unlink`) and end the process without calling
/// `exit()` (from an `atexit` handler, `exit()` would run no other).
/// Not at the same time as `herdless_broker_stop`, which frees the handle.
///
/// Returns 0, `-EINVAL` when `b` is NULL, `-EPERM` in a process other
/// than the one that started it (a fork), `-EALREADY` when it was drained
/// before, `-ENOTRECOVERABLE` when the broker's thread panicked.
///
/// # Safety
///
/// `b` is NULL or a live broker handle.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_drain(b: *const herdless_broker) -> c_int {
    // SAFETY: NULL or, by this function's contract, a live handle made by
    // `Box::into_raw`; only read here (its thread and result sit behind
    // locks).
    let Some(b) = (unsafe { b.as_ref() }) else {
        return -libc::EINVAL;
    };
    if !started_by_me(b) {
        return -libc::EPERM;
    }
    let drained = catch_unwind(AssertUnwindSafe(|| {
        let Ok(mut thread) = b.thread.lock() else {
            return PANICKED;
        };
        if !matches!(*thread, BrokerThread::Running(_)) {
            return -libc::EALREADY;
        }
        let BrokerThread::Running(t) = std::mem::replace(&mut *thread, BrokerThread::Joining)
        else {
            unreachable!("checked above, under the lock");
        };
        b.stopper.stop_when_idle();
        let ended = t.join();
        let code = if ended.is_err() { PANICKED } else { 0 };
        // The stop reports what it returned.
        *thread = BrokerThread::Ended(Box::new(ended));
        code
    }));
    drained.unwrap_or(PANICKED)
}

/// Stops the broker, waits for its thread, removes its socket, FIFOs and
/// directory, closes the classic descriptors, puts `HERDLESS_SOCKET` and
/// `HERDLESS_CLASSIC` back as they were before the start, and frees the
/// handle. When `report` is not NULL it is filled in with what the broker
/// did (after `herdless_broker_drain`, what it did until the drain ended
/// it). Clients still connected see `-ECONNRESET`. NULL is ignored
/// (returns `-EINVAL`).
///
/// Returns the number of tokens lost (0 when every token came home), or
/// a negative `errno` value when the broker failed. In another process
/// than the one that started the broker (a fork of it) it returns `-EPERM`
/// and changes nothing: the broker, its thread and its socket are the
/// starting process's, and the fork's copy of the handle is left as it is.
///
/// # Safety
///
/// `b` is NULL or a live broker handle, not used after this call;
/// `report` is NULL or points to a writable `herdless_broker_report`.
#[no_mangle]
pub unsafe extern "C" fn herdless_broker_stop(
    b: *mut herdless_broker,
    report: *mut herdless_broker_report,
) -> c_int {
    // SAFETY: NULL or, by this function's contract, a live handle: only
    // read here.
    let Some(mine) = (unsafe { b.as_ref() }).map(started_by_me) else {
        return -libc::EINVAL;
    };
    if !mine {
        return -libc::EPERM;
    }
    // SAFETY: not NULL, and by this function's contract made by
    // `Box::into_raw` in `herdless_broker_start` and not used after this.
    let mut b = unsafe { Box::from_raw(b) };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let thread = b.thread.get_mut().map_err(|_| PANICKED)?;
        let status = match std::mem::replace(thread, BrokerThread::Joining) {
            BrokerThread::Running(t) => {
                b.stopper.stop();
                t.join()
            }
            BrokerThread::Ended(ended) => *ended,
            BrokerThread::Joining => return Err(PANICKED),
        };
        let status = match status {
            Ok(Ok(status)) => Ok(status),
            Ok(Err(e)) => Err(-io_errno(&e)),
            Err(_) => Err(PANICKED),
        };
        b.fds = None;
        b.dir = None;
        if let Ok(mut list) = STARTED_HERE.lock() {
            let socket = OsStr::from_bytes(b.socket.as_bytes());
            list.retain(|s| s.as_os_str() != socket);
        }
        for (var, value) in [SOCKET_ENV, CLASSIC_ENV].iter().zip(&b.previous) {
            match value {
                Some(v) => std::env::set_var(var, v),
                None => std::env::remove_var(var),
            }
        }
        status
    }));
    let status = match outcome {
        Ok(Ok(s)) => s,
        Ok(Err(code)) => return code,
        Err(_) => return PANICKED,
    };
    let classic = status.classic.as_ref().map_or(0, |c| c.offered);
    if !report.is_null() {
        let r = herdless_broker_report {
            jobs: status.jobs,
            max_in_use: status.max_in_use,
            native_grants: status.grants.saturating_sub(classic),
            classic_offered: classic,
            reclaimed: status.reclaimed,
            lost: status.lost,
            aborted: status
                .aborted
                .as_deref()
                .and_then(|a| a.bytes().next())
                .map_or(0, |c| c.to_ascii_uppercase() as c_char),
            woken: status.wakeups,
            broker_vcsw: status
                .broker_vcsw
                .map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX)),
            moved: status.fast.as_ref().map_or(0, |f| f.moved),
            no_room: status.refused_no_room,
        };
        // SAFETY: not NULL, and by this function's contract writable.
        unsafe { report.write(r) };
    }
    c_int::try_from(status.lost.max(0)).unwrap_or(c_int::MAX)
}
