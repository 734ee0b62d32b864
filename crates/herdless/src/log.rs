//! Minimal leveled logging to stderr.
//!
//! The level comes from `HERDLESS_LOG` (`error`, `warn`, `info`, `debug`;
//! default `warn`). Lines look like `herdless[1234]: warn: message`, so the
//! broker's words can be told apart from a build's own output.

use std::io::Write;
use std::sync::OnceLock;

/// How loud a message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Something failed: a connection refused, a client cut off.
    Error = 1,
    /// Something is wrong but herdless goes on (the default level).
    Warn = 2,
    /// What the broker does: connections, aborts, reclaimed tokens.
    Info = 3,
    /// Every request and grant.
    Debug = 4,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

fn threshold() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("HERDLESS_LOG").as_deref() {
        Ok("error") => Level::Error,
        Ok("info") => Level::Info,
        Ok("debug") => Level::Debug,
        _ => Level::Warn,
    })
}

/// Whether messages of `level` are written.
pub fn enabled(level: Level) -> bool {
    level <= threshold()
}

/// Writes one line to stderr if `level` is enabled. Errors writing to
/// stderr are ignored: logging must never take the broker down.
pub fn write(level: Level, args: std::fmt::Arguments<'_>) {
    if enabled(level) {
        let line = format!(
            "herdless[{}]: {}: {}\n",
            std::process::id(),
            level.name(),
            args
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// `log!(Level::Warn, "format", args…)`.
#[macro_export]
macro_rules! log {
    ($level:expr, $($arg:tt)+) => {
        $crate::log::write($level, format_args!($($arg)+))
    };
}
