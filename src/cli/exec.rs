//! `herdless exec`: one job, one token.

use anyhow::{Context, Result};

use herdless::client::{Client, Options};
use herdless::protocol::AbortReason;

use super::child;
use super::ExecArgs;

/// Takes a token as a job of the calling process (so it may run in the
/// caller's implicit slot), runs the command, and gives the token back
/// however the command ends. If `exec` itself is killed, its connection
/// closes and the broker takes the token back.
pub fn exec(args: ExecArgs) -> Result<u8> {
    let client = Client::from_env_with(Options::default().job_of_parent(true))
        .context("herdless exec needs a jobserver")?;
    let token = client.acquire().context("cannot take a job token")?;
    let outcome = child::run(&args.command, &[])?;
    drop(token);
    let code = outcome.code();
    if args.abort_on_failure && code != 0 {
        let reason = if code == 128 + libc::SIGINT as u8 {
            AbortReason::Interrupt
        } else {
            AbortReason::Error
        };
        client
            .abort(reason)
            .context("cannot post the abort to the tree")?;
    }
    drop(client);
    Ok(child::end(outcome.exit()))
}
