//! `herdless exec`: one job, one token.

use anyhow::{Context, Result};

use herdless::client::{Client, Options};
use herdless::protocol::AbortReason;

use super::child;
use super::ExecArgs;

/// Takes a token as a job of the runner above (so it may run in that
/// runner's slot, named by `HERDLESS_SLOT`), runs the command, and gives
/// the token back however the command ends. The command is a job runner
/// of its own: it gets this exec's slot in `HERDLESS_SLOT`, so its jobs run
/// on this exec's token, one at a time. If `exec` itself is killed, its
/// connection closes and the broker takes the token back. A broker that
/// stops before the token comes is an error (exit 125): the job never
/// starts.
pub fn exec(args: ExecArgs) -> Result<u8> {
    let client = Client::from_env_with(Options::default().job_of_runner_above(true))
        .context("herdless exec needs a jobserver")?;
    let token = client.acquire().context("cannot take a job token")?;
    let env: Vec<(&str, std::ffi::OsString)> = client
        .job_env()
        .map(|(k, v)| (k, v.into()))
        .into_iter()
        .collect();
    let outcome = child::run(&args.command, &env)?;
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
