//! The client's error type.

use std::fmt;
use std::io;

use crate::protocol::AbortReason;

/// What went wrong, for callers that branch on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// No jobserver is named in the environment.
    NotFound,
    /// The broker could not be reached (missing socket, nobody listening,
    /// a broker of another user).
    Connect,
    /// The broker refused this client and said why.
    Refused,
    /// The broker went away (closed the connection or died).
    BrokerGone,
    /// The broker sent something this client does not understand.
    Protocol,
    /// The tree was aborted: `E` (a job failed) or `I` (interrupted).
    Aborted(AbortReason),
    /// The deadline passed before a token was granted.
    TimedOut,
    /// No token is free now (non-blocking calls only).
    WouldBlock,
    /// A signal arrived while waiting (interruptible calls only). No token
    /// is lost: the request stays pending and the next call picks it up.
    Interrupted,
    /// A token was released that is not held.
    NotHolding,
    /// A classic jobserver named in the environment is unusable.
    BadJobserver,
    /// This jobserver cannot do what was asked (a status report or an abort
    /// from a classic GNU make jobserver, for instance).
    Unsupported,
    /// Another I/O error.
    Io,
    /// The handle was opened by another process (this one is a fork of
    /// it): the connection and its tokens belong to that process, so this
    /// one may not use them. It must open a handle of its own.
    Forked,
}

/// An error from the herdless client. Messages are lowercase and name the
/// path, fd or value that is wrong.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<io::Error>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn io(kind: ErrorKind, message: impl Into<String>, source: io::Error) -> Error {
        Error {
            kind,
            message: message.into(),
            source: Some(source),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether a broker turned this client away to keep descriptors free
    /// for the process it runs in (a make with its broker inside that is
    /// short of them). Asking it again gets the same answer; the classic
    /// jobserver that the same broker serves is the way in.
    pub fn is_no_room(&self) -> bool {
        self.kind == ErrorKind::Refused && self.errno() == libc::EMFILE
    }

    /// The closest `errno` value, for the C ABI and for exit codes.
    pub fn errno(&self) -> i32 {
        match self.kind {
            ErrorKind::NotFound => libc::ENOENT,
            ErrorKind::Connect => self
                .source
                .as_ref()
                .and_then(io::Error::raw_os_error)
                .unwrap_or(libc::ECONNREFUSED),
            ErrorKind::Refused => self
                .source
                .as_ref()
                .and_then(io::Error::raw_os_error)
                .unwrap_or(libc::ECONNREFUSED),
            ErrorKind::BrokerGone => libc::ECONNRESET,
            ErrorKind::Protocol => libc::EPROTO,
            ErrorKind::Aborted(_) => libc::ECANCELED,
            ErrorKind::TimedOut => libc::ETIMEDOUT,
            ErrorKind::WouldBlock => libc::EAGAIN,
            ErrorKind::Interrupted => libc::EINTR,
            ErrorKind::NotHolding => libc::EINVAL,
            ErrorKind::BadJobserver => libc::EBADF,
            ErrorKind::Unsupported => libc::ENOTSUP,
            ErrorKind::Forked => libc::EPERM,
            ErrorKind::Io => self
                .source
                .as_ref()
                .and_then(io::Error::raw_os_error)
                .unwrap_or(libc::EIO),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {source}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A client `Result`.
pub type Result<T> = std::result::Result<T, Error>;
