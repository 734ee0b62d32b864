//! `herdless ctl`: change a running broker.

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};

use herdless::client::{socket_from_env, Client};
use herdless::protocol::AbortReason;

#[derive(clap::Args, Debug)]
pub struct CtlArgs {
    /// The broker's socket (default: $HERDLESS_SOCKET).
    #[arg(long, value_name = "PATH", global = true)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand, Debug)]
enum What {
    /// Make the pool -j N: it grows at once, and shrinks at once by the
    /// free tokens and by the others as running jobs give them back (no job
    /// loses its token).
    Jobs {
        /// The new job count.
        #[arg(value_parser = clap::value_parser!(u32).range(1..=i64::from(herdless::broker::MAX_JOBS)))]
        n: u32,
    },
    /// Let process PID and all its descendants hold at most N job tokens at
    /// once (native clients; `none` lifts the cap).
    Cap {
        /// The process whose subtree is capped.
        #[arg(value_parser = clap::value_parser!(u32).range(1..))]
        pid: u32,
        /// The most tokens at once, or `none`.
        #[arg(value_parser = parse_max)]
        n: Max,
    },
    /// Abort the build: every client is told, bmakes find the abort byte.
    Abort {
        /// Abort as for a failed job (`E`) rather than an interrupt (`I`).
        #[arg(long)]
        error: bool,
    },
}

#[derive(Clone, Copy, Debug)]
struct Max(Option<u32>);

fn parse_max(s: &str) -> Result<Max, String> {
    if s == "none" {
        return Ok(Max(None));
    }
    s.parse()
        .map(|n| Max(Some(n)))
        .map_err(|_| format!("{s:?} is not a token count or `none`"))
}

/// Connects with protocol version 2 and makes the change; returns once the
/// broker has made it.
pub fn ctl(args: CtlArgs) -> Result<u8> {
    let path = args
        .socket
        .or_else(socket_from_env)
        .ok_or_else(|| anyhow!("no broker named: pass --socket or set HERDLESS_SOCKET"))?;
    let control = Client::control(&path)?;
    match args.what {
        What::Jobs { n } => control.set_jobs(n).context("ctl jobs")?,
        What::Cap { pid, n } => control.cap(pid, n.0).context("ctl cap")?,
        What::Abort { error } => {
            let reason = if error {
                AbortReason::Error
            } else {
                AbortReason::Interrupt
            };
            control.abort(reason).context("ctl abort")?
        }
    }
    Ok(0)
}
