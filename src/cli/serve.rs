//! `herdless serve`: a standalone broker.

use std::io::Write;

use anyhow::{Context, Result};

use herdless::broker::{Broker, Config};
use herdless::client::{slot_env_value, SLOT_ENV};
use herdless::rundir::RunDir;

use super::ServeArgs;

/// Listens, prints the line to export, serves until SIGINT or SIGTERM, then
/// removes its socket and prints the final report to stderr.
pub fn serve(args: ServeArgs) -> Result<u8> {
    let mut dir = match &args.socket {
        Some(path) => RunDir::at(path),
        None => RunDir::create(),
    }
    .context("cannot prepare the socket directory")?;
    let config = Config {
        jobs: args.jobs,
        handle_signals: true,
    };
    let broker = Broker::bind(dir.socket(), config)?;
    dir.set_bound();
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "export HERDLESS_SOCKET={} {SLOT_ENV}={}",
        shell_quote(&dir.socket().to_string_lossy()),
        shell_quote(&slot_env_value(broker.top_slot()))
    )?;
    out.flush()?;
    drop(out);
    let report = broker.run()?;
    super::run::print_report(&report);
    drop(dir);
    Ok(if report.lost == 0 {
        0
    } else {
        super::EXIT_FAILURE
    })
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
