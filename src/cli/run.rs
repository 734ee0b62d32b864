//! `herdless run`: a broker for the life of one command.

use anyhow::{Context, Result};

use std::os::fd::AsRawFd;

use herdless::bridge::Bridge;
use herdless::broker::{Broker, Config};
use herdless::classic::{Flavor, Program};
use herdless::client::SOCKET_ENV;
use herdless::rundir::RunDir;
use herdless::status::Status;

use super::child;
use super::RunArgs;

/// Starts a broker in this process for `-j N`, runs the command with
/// `HERDLESS_SOCKET` exported, and exits with the command's status.
///
/// The pool holds N − 1 tokens; the N-th is the command's implicit token.
/// A command that is a make uses it for its first job; a command that
/// runs its jobs through `herdless exec` lends it to one of them (the
/// broker gives each exec the implicit slot of its parent process when no
/// sibling holds it). Either way, at most N jobs run at once.
pub fn run(args: RunArgs) -> Result<u8> {
    let mut dir = RunDir::create().context("cannot prepare the socket directory")?;
    let mut config = Config::new(args.jobs);
    config.admission = args.admission.admission()?;
    let mut broker = Broker::bind(dir.socket(), config)?;
    dir.set_bound();
    let mut env = vec![(SOCKET_ENV, dir.socket().as_os_str().to_owned())];
    // Scripts can call `"$HERDLESS" exec …` without herdless on PATH.
    if let Ok(me) = std::env::current_exe() {
        env.push(("HERDLESS", me.into_os_string()));
    }
    let mut inherit = Vec::new();
    if !args.no_classic {
        let program = &args.command[0];
        let flavor = args.flavor.unwrap_or_else(|| Flavor::for_command(program));
        let bridge = Bridge::create(
            dir.dir(),
            args.style,
            flavor,
            args.jobs,
            Program::of(program).is_some_and(Program::reads_jobserver),
        )
        .context("cannot set up the classic jobserver")?;
        let fds = bridge.inheritable_fds()?;
        let raw = fds.as_ref().map(|(r, w)| (r.as_raw_fd(), w.as_raw_fd()));
        env.extend(bridge.env(raw, std::env::var_os("MAKEFLAGS").as_deref()));
        inherit.extend(fds.into_iter().flat_map(|(r, w)| [r, w]));
        broker = broker.with_bridge(bridge)?;
    }
    let stopper = broker.stopper();
    let thread = std::thread::Builder::new()
        .name("herdless-broker".into())
        .spawn(move || broker.run())
        .context("cannot start the broker thread")?;
    let outcome = child::run_inheriting(&args.command, &env, inherit);
    stopper.stop();
    let report = thread
        .join()
        .map_err(|_| anyhow::anyhow!("the broker thread panicked"))??;
    drop(dir);
    let outcome = outcome?;
    if args.stats {
        print_report(&report);
    }
    if report.lost != 0 {
        eprintln!("herdless: {} token(s) lost", report.lost);
    }
    Ok(child::end(outcome.exit()))
}

fn ms(us: f64) -> String {
    if us >= 1000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else {
        format!("{us:.0} µs")
    }
}

/// The final statistics, for a person, on stderr.
pub fn print_report(r: &Status) {
    let lines = [
        format!(
            "-j {} ({} shared token(s) and the command's implicit one)",
            r.jobs, r.capacity
        ),
        {
            let classic = r.classic.as_ref().map_or(0, |c| c.offered);
            let native = r.grants - classic;
            format!(
                "grants        {} to native clients ({} at once, {} after a wait){}",
                native,
                native - r.wakeups,
                r.wakeups,
                if r.classic.is_some() {
                    format!(", {classic} into the classic pipe")
                } else {
                    String::new()
                }
            )
        },
        format!("max in use    {}", r.max_in_use),
        format!(
            "wait          p50 {}, p99 {}, max {}",
            ms(r.wait_p50_us),
            ms(r.wait_p99_us),
            ms(r.wait_max_us)
        ),
        format!("wake-ups      {} (one per grant that waited)", r.wakeups),
        format!(
            "taken back    {} from clients that died holding them",
            r.reclaimed
        ),
        format!("tokens lost   {}", r.lost),
    ];
    let classic = r.classic.as_ref().map(|c| {
        format!(
            "classic       {} {} jobserver: {} offered, {} returned, {} taken back, {} lost",
            c.flavor, c.style, c.offered, c.returned, c.taken_back, c.lost
        )
    });
    let aborted = r
        .aborted
        .as_ref()
        .map(|a| format!("aborted       {a} (every client was told)"));
    let lines = lines.into_iter().chain(classic).chain(aborted);
    for line in lines {
        eprintln!("herdless: {line}");
    }
}
