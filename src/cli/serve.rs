//! `herdless serve`: a standalone broker.

use std::io::Write;

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use herdless::broker::{Broker, Config};
use herdless::client::{slot_env_value, CLASSIC_ENV, SLOT_ENV};
use herdless::rundir::RunDir;

use super::ServeArgs;

/// Listens, prints the line to export, serves until SIGINT or SIGTERM, then
/// removes its socket and prints the final report to stderr.
pub fn serve(args: ServeArgs) -> Result<u8> {
    super::raise_nofile_limit();
    let mut config = Config::new(args.jobs);
    config.handle_signals = true;
    config.admission = args.admission.admission()?;
    // Socket activation: a service manager made and owns the socket.
    let mut passed = herdless_platform::listen_fds().context("socket activation")?;
    if passed.len() > 1 {
        bail!(
            "socket activation passed {} sockets; herdless serves one",
            passed.len()
        );
    }
    if let Some(fd) = passed.pop() {
        let listener = std::os::unix::net::UnixListener::from(fd);
        let shown = match (&args.socket, listener.local_addr()) {
            (Some(path), _) => path.clone(),
            (None, Ok(addr)) => addr
                .as_pathname()
                .map(Path::to_path_buf)
                .ok_or_else(|| anyhow!("the passed socket has no path"))?,
            (None, Err(e)) => return Err(e).context("the passed socket"),
        };
        let broker =
            Broker::from_listener(listener, config).context("cannot serve on the passed socket")?;
        print_export(&shown, broker.top_slot())?;
        let report = broker.run()?;
        super::run::print_report(&report);
        return Ok(if report.lost == 0 {
            0
        } else {
            super::EXIT_FAILURE
        });
    }
    let mut dir = match &args.socket {
        Some(path) => RunDir::at(path),
        None => RunDir::create(),
    }
    .context("cannot prepare the socket directory")?;
    let broker = Broker::bind(dir.socket(), config)?;
    dir.set_bound();
    print_export(dir.socket(), broker.top_slot())?;
    let report = broker.run()?;
    super::run::print_report(&report);
    drop(dir);
    Ok(if report.lost == 0 {
        0
    } else {
        super::EXIT_FAILURE
    })
}

/// The line a shell evaluates to reach this broker: its socket, and the
/// slot of the shell at the top (the N-th token of `-jN`).
fn print_export(socket: &Path, top_slot: u64) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        // No classic side: an empty HERDLESS_CLASSIC, so that one left
        // from another broker does not take a make's jobserver for one
        // between this broker and its clients.
        "export HERDLESS_SOCKET={} {SLOT_ENV}={} {CLASSIC_ENV}=",
        shell_quote(&socket.to_string_lossy()),
        shell_quote(&slot_env_value(top_slot))
    )?;
    out.flush()?;
    Ok(())
}

/// Quotes `s` for a POSIX shell when it needs quoting.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+,:@%".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}
