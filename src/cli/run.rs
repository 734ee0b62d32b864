//! `herdless run`: a broker for the life of one command.

use anyhow::{Context, Result};

use std::os::fd::AsRawFd;

use std::sync::atomic::Ordering;

use herdless::backing::{Backing, Broker as OuterBroker, Figures};
use herdless::bridge::Bridge;
use herdless::broker::{Broker, Config, Stopper};
use herdless::classic::{Auth, Flavor, Jobserver, Program};
use herdless::client::{
    broker_from_env, jobserver_between, slot_env_value, when_room, Client, Options, Token,
    CLASSIC_ENV, SLOT_ENV, SOCKET_ENV,
};
use herdless::rundir::RunDir;
use herdless::status::Status;

use super::child;
use super::RunArgs;

/// Starts a broker in this process for `-j N`, runs the command with
/// `HERDLESS_SOCKET` exported, and exits with the command's status.
///
/// The pool holds N − 1 tokens; the N-th is the command's implicit token,
/// the broker's top slot, named to the command in `HERDLESS_SLOT`. A
/// command that is a make uses it for its first job; a command that runs
/// its jobs through `herdless exec` lends it to one of them at a time,
/// however many processes lie between. Either way, at most N jobs run at
/// once.
///
/// A stop signal (SIGINT, SIGTERM, SIGHUP, or another that would end this
/// process and can be caught: `child::FORWARDED`) stops the granting at once,
/// before it is passed on: waiting jobs are refused (`exec` exits 125), so
/// none starts after it. When the command ends on its own, the broker
/// serves on until no job runner is connected (sub-makes it left in the
/// background), then stops for good; a stop signal meanwhile stops it at
/// once.
///
/// Under another herdless broker (`HERDLESS_SOCKET` set) it starts no pool
/// of its own unless `--new-pool` says so: see [`run_joined`]. Under a
/// classic jobserver (an outer make's `MAKEFLAGS`, also one between this
/// process and such a broker: `herdless::client::jobserver_between`) its
/// pool is *backed*
/// by the outer one: the command's token is taken there as `exec` takes
/// one (the recipe's, unless another job of the recipe holds it), and
/// each of the N − 1 others is borrowed from the outer jobserver when a
/// job waits for it and given back as soon as none does (see
/// `herdless::backing`).
pub fn run(args: RunArgs) -> Result<u8> {
    let mut backing = None;
    if let Some(outer) = broker_from_env() {
        if !args.new_pool {
            // A make with its broker inside, short of descriptors, turns
            // new clients away until its others end: wait for room.
            let client =
                Client::connect_when_room(&outer, Options::default().job_of_runner_above(true))
                    .with_context(|| {
                        format!("cannot join the herdless pool at {}", outer.display())
                    })?;
            return run_joined(args, &outer, client);
        }
        eprintln!(
            "herdless: warning: --new-pool: -j{} forced in a pool of its own; the pool at {} \
             no longer bounds this subtree",
            args.jobs,
            outer.display()
        );
    } else {
        backing = outer_jobserver(&args)?;
    }
    // This process serves one connection per job from here on.
    super::raise_nofile_limit();
    let mut dir = RunDir::create().context("cannot prepare the socket directory")?;
    let mut config = Config::new(args.jobs);
    config.admission = args.admission.admission()?;
    let mut broker = Broker::bind(dir.socket(), config)?;
    dir.set_bound();
    // The command's token is held until the command and its broker have
    // ended.
    let (backing, command_token) = match backing {
        Some((backing, token)) => (Some(backing), token),
        None => (None, None),
    };
    if let Some(backing) = backing {
        broker = broker
            .with_backing(backing)
            .context("cannot watch the outer jobserver")?;
    }
    let figures = broker.backing_figures();
    let mut env = vec![
        (SOCKET_ENV, dir.socket().as_os_str().to_owned()),
        (SLOT_ENV, slot_env_value(broker.top_slot()).into()),
    ];
    // Scripts can call `"$HERDLESS" exec …` without herdless on PATH.
    if let Ok(me) = std::env::current_exe() {
        env.push(("HERDLESS", me.into_os_string()));
    }
    let mut inherit = Vec::new();
    if args.no_classic {
        // No classic side: no jobserver in the command's MAKEFLAGS is the
        // broker's, and none shows a make between.
        env.push((CLASSIC_ENV, "".into()));
    } else {
        let (bridge, more) = classic_side(&args, &dir, &mut inherit)?;
        env.extend(more);
        broker = broker
            .with_bridge(bridge)
            .context("cannot watch the classic jobserver")?;
    }
    broker.expect_command();
    let stopper = broker.stopper();
    let thread = herdless_platform::spawn_unsignalled(
        std::thread::Builder::new().name("herdless-broker".into()),
        move || broker.run(),
    )
    .context("cannot start the broker thread")?;
    let halter = stopper.clone();
    let namer = stopper.clone();
    let outcome = child::run_inheriting(
        &args.command,
        &env,
        inherit,
        move |pid| {
            naming_delay();
            namer.command_started(pid);
        },
        move || halter.halt(),
    );
    let (report, stop_signal) = serve_to_the_end(&outcome, &stopper, thread)?;
    drop(dir);
    let outcome = outcome?;
    if args.stats {
        match &figures {
            Some(f) => {
                // A backed pool ends with no shared token: say how many it
                // could borrow.
                let mut shown = report.clone();
                shown.capacity = args.jobs - 1;
                print_report(&shown);
                print_outer(f);
            }
            None => print_report(&report),
        }
    }
    if report.lost != 0 {
        eprintln!("herdless: {} token(s) lost", report.lost);
    }
    if let Some(f) = &figures {
        let lost = f.lost.load(Ordering::Relaxed);
        if lost != 0 {
            eprintln!("herdless: {lost} token(s) could not be given back to the outer jobserver");
        }
    }
    // Back in the outer jobserver before this process ends, perhaps by a
    // signal's default action.
    drop(command_token);
    Ok(child::end(match stop_signal {
        Some(sig) => child::Exit::Signal(sig),
        None => outcome.exit(),
    }))
}

/// Ends `run`'s broker once its command has ended. A command that exited
/// on its own (not killed, no stop signal) may have left sub-makes
/// running in the background (`$(MAKE) … &`): the broker serves on until
/// no job runner is connected, as a make with the broker inside does
/// before it exits; a stop signal meanwhile stops it at once, and is
/// returned, for this process to die of it. A command's death by a
/// signal is a stop, as before.
fn serve_to_the_end(
    outcome: &Result<child::Outcome>,
    stopper: &Stopper,
    thread: std::thread::JoinHandle<std::io::Result<Status>>,
) -> Result<(Status, Option<i32>)> {
    let mut stop_signal = None;
    let joined = match outcome {
        Ok(child::Outcome::Exited {
            status,
            received: None,
        }) if status.code().is_some() => {
            stopper.stop_when_idle();
            let stop = stopper.clone();
            let (joined, got) = child::catching_stops(move || stop.stop(), || thread.join())?;
            stop_signal = got;
            joined
        }
        _ => {
            stopper.stop();
            thread.join()
        }
    };
    let report = joined.map_err(|_| anyhow::anyhow!("the broker thread panicked"))??;
    Ok((report, stop_signal))
}

/// The classic jobserver of `run`'s pool, in `dir`: the bridge, the
/// environment that names it, and (pipe style) the descriptors the
/// command inherits, added to `inherit`.
fn classic_side(
    args: &RunArgs,
    dir: &RunDir,
    inherit: &mut Vec<std::os::fd::OwnedFd>,
) -> Result<(Bridge, Vec<(&'static str, std::ffi::OsString)>)> {
    // Which MAKEFLAGS syntax to write is guessed from the command's name
    // (bmake reads `-J`, the rest `--jobserver-auth`). Whether the command
    // reads the pipe at all is not: the broker sees whether it connects as
    // a native client (`Stopper::command_started`).
    let flavor = args
        .flavor
        .unwrap_or_else(|| Flavor::for_command_line(&args.command));
    let mut bridge = Bridge::create(dir.dir(), args.style, flavor, args.jobs)
        .context("cannot set up the classic jobserver")?;
    let fds = bridge
        .take_inheritable_fds()
        .context("cannot hand the classic jobserver's pipe to the command")?;
    let raw = fds.as_ref().map(|(r, w)| (r.as_raw_fd(), w.as_raw_fd()));
    let env = bridge.env(raw, std::env::var_os("MAKEFLAGS").as_deref());
    inherit.extend(fds.into_iter().flat_map(|(r, w)| [r, w]));
    Ok((bridge, env))
}

/// The outer classic jobserver to borrow from, when `MAKEFLAGS` names one
/// and `--new-pool` does not say otherwise. One that cannot be used (GNU
/// make closes its descriptors for recipes not marked `+`) leaves the
/// pool on its own, with a warning, as GNU make's "jobserver unavailable:
/// using -j1" does.
///
/// # Errors
///
/// The command's token cannot be had (the outer build was aborted, its
/// jobserver went away): the command must not run, as an `exec` job would
/// not.
fn outer_jobserver(args: &RunArgs) -> Result<Option<(Backing, Option<Token>)>> {
    let found = match jobserver_between() {
        Some(js) => Ok(Some(js)),
        None => Jobserver::from_env(),
    };
    let js = match found {
        Ok(Some(js)) if !matches!(js.auth(), Auth::Disabled) => js,
        Ok(_) => return Ok(None),
        Err(e) => {
            eprintln!(
                "herdless: warning: jobserver unavailable: {e}; using a pool of its own, -j{}, \
                 which the outer make's -j does not bound",
                args.jobs
            );
            return Ok(None);
        }
    };
    if args.new_pool {
        eprintln!(
            "herdless: warning: --new-pool: -j{} forced in a pool of its own; the outer \
             jobserver ({}) no longer bounds this subtree",
            args.jobs,
            js.option()
        );
        return Ok(None);
    }
    match Backing::open(&js, args.jobs) {
        Ok(backing) => Ok(Some((backing, command_token(js)?))),
        Err(e) => {
            let rule = match js.flavor() {
                Flavor::Gnu => "Add '+' to the parent make rule.",
                Flavor::Bmake => "Mark the parent target .MAKE.",
            };
            eprintln!(
                "herdless: warning: jobserver unavailable ({e}): using a pool of its own, \
                 -j{}, which the outer make's -j does not bound. {rule}",
                args.jobs
            );
            Ok(None)
        }
    }
}

/// The outer jobserver's token for the command, taken as `exec` takes one
/// (see [`Options::job_of_runner_above`]): the recipe's own slot when no
/// other job of the recipe holds it, else a token read from the pipe. A
/// recipe that starts several runs at once (`run … & run … &`) runs each
/// command on a token of its own, where each used to count on the
/// recipe's slot. A jobserver this process cannot open as a client leaves
/// the command on the recipe's slot, with a warning; one whose token
/// cannot be had (an abort, a jobserver gone) is an error.
fn command_token(js: Jobserver) -> Result<Option<Token>> {
    let what = js.option().to_owned();
    let client = match Client::from_jobserver(js, Options::default().job_of_runner_above(true)) {
        Ok(client) => client,
        Err(e) => {
            eprintln!(
                "herdless: warning: cannot take the command's token from the outer jobserver \
                 ({what}): {e}; the command runs on the recipe's own"
            );
            return Ok(None);
        }
    };
    let token = client
        .acquire()
        .with_context(|| format!("cannot take the command's token from {what}"))?;
    Ok(Some(token))
}

/// The `--stats` line of a pool backed by an outer jobserver.
fn print_outer(f: &Figures) {
    eprintln!(
        "herdless: outer         {} token(s) borrowed from the outer jobserver ({} at once at \
         most), {} given back, {} lost",
        f.borrowed.load(Ordering::Relaxed),
        f.max_held.load(Ordering::Relaxed),
        f.returned.load(Ordering::Relaxed),
        f.lost.load(Ordering::Relaxed)
    );
}

/// `herdless run` under another herdless broker: the command becomes a job
/// runner of that pool, as a sub-make is of its make's. It takes one token
/// from the outer pool for its command (borrowing the slot of the runner
/// above when it is free, as `exec` does), exports the slot minted for it
/// in `HERDLESS_SLOT`, and caps its own process subtree at `-j N` (the
/// broker's `Cap`, which follows process ancestry: Linux only), so the
/// outer `-j` bounds everything and its own `-j` bounds its subtree.
///
/// When the command is itself a classic client (a make, cargo: see
/// `Program`; also behind a wrapper or in a shell's `-c` string, as
/// `Program::run_by_command_line` reads them), it gets a pool of this
/// run's own, whose tokens are
/// borrowed from the outer pool (`herdless::backing`): a classic
/// jobserver, and the socket and top slot its native clients use (a make
/// with herdless inside, which a name cannot tell from a stock one), so
/// `-j` caps it too; a classic client started deeper (by a script) reads
/// the outer jobserver, which the cap does not reach.
fn run_joined(args: RunArgs, outer: &std::path::Path, client: Client) -> Result<u8> {
    let token = client
        .acquire()
        .context("cannot take a job token from the outer pool")?;
    // The cap counts this process's own token and the job in its slot, one
    // real job between them: N + 1 of them is N jobs.
    let me = std::process::id();
    let control =
        when_room(|| Client::control(outer)).context("cannot reach the outer pool's controls")?;
    control
        .cap(me, Some(args.jobs.saturating_add(1)))
        .context("cannot cap this subtree in the outer pool")?;
    let mut env: Vec<(&str, std::ffi::OsString)> = client
        .job_env()
        .map(|(k, v)| (k, v.into()))
        .into_iter()
        .collect();
    if let Ok(me) = std::env::current_exe() {
        env.push(("HERDLESS", me.into_os_string()));
    }
    // A make behind a wrapper or in a shell's `-c` string counts too: it
    // would read the outer make's flags, in the outer make's syntax.
    let classic = !args.no_classic
        && Program::run_by_command_line(&args.command)
            .into_iter()
            .any(Program::reads_jobserver);
    let mut inherit = Vec::new();
    let mut inner = None;
    if classic {
        super::raise_nofile_limit();
        let mut dir = RunDir::create().context("cannot prepare the socket directory")?;
        let borrower =
            Client::connect_when_room(outer, Options::default().implicit_token(false))
                .with_context(|| format!("cannot join the herdless pool at {}", outer.display()))?;
        let mut config = Config::new(args.jobs);
        config.admission = args.admission.admission()?;
        let mut broker = Broker::bind(dir.socket(), config)?;
        dir.set_bound();
        broker = broker
            .with_backing(Backing::broker(
                OuterBroker::new(borrower, outer),
                args.jobs,
            ))
            .context("cannot watch the outer pool")?;
        // The command's pool is this one, for native clients too: a make
        // with herdless inside that went to the outer broker past it
        // would wait there for the tokens this pool borrows for its
        // classic readers, and this broker would not learn that its
        // command is native. Its top slot is the command's token, the one
        // taken from the outer pool above.
        env.retain(|(key, _)| *key != SLOT_ENV);
        env.push((SOCKET_ENV, dir.socket().as_os_str().to_owned()));
        env.push((SLOT_ENV, slot_env_value(broker.top_slot()).into()));
        let (bridge, more) = classic_side(&args, &dir, &mut inherit)?;
        env.extend(more);
        broker = broker
            .with_bridge(bridge)
            .context("cannot watch the classic jobserver")?;
        let figures = broker.backing_figures();
        broker.expect_command();
        let stopper = broker.stopper();
        let thread = herdless_platform::spawn_unsignalled(
            std::thread::Builder::new().name("herdless-broker".into()),
            move || broker.run(),
        )
        .context("cannot start the broker thread")?;
        inner = Some((dir, stopper, thread, figures));
    }
    let halter = inner.as_ref().map(|(_, s, _, _)| s.clone());
    let namer = halter.clone();
    let outcome = child::run_inheriting(
        &args.command,
        &env,
        inherit,
        move |pid| {
            if let Some(n) = &namer {
                naming_delay();
                n.command_started(pid);
            }
        },
        move || {
            if let Some(h) = &halter {
                h.halt();
            }
        },
    );
    // The inner broker serves its sub-makes left in the background to the
    // end, as `run`'s own does, and gives its borrowed tokens back as it
    // ends; the cap is lifted and the command's token given back whatever
    // that says.
    let ended = match inner {
        Some((dir, stopper, thread, figures)) => {
            let ended = serve_to_the_end(&outcome, &stopper, thread);
            drop(dir);
            Some((ended, figures))
        }
        None => None,
    };
    let uncapped = control.cap(me, None);
    drop(token);
    drop(client);
    let (report, stop_signal) = match ended {
        Some((ended, figures)) => {
            let (status, got) = ended?;
            (Some((status, figures)), got)
        }
        None => (None, None),
    };
    let outcome = outcome?;
    if let Err(e) = uncapped {
        eprintln!("herdless: cannot lift this subtree's cap: {e}");
    }
    if args.stats {
        eprintln!(
            "herdless: joined the pool at {}; -j {} capped this subtree",
            outer.display(),
            args.jobs
        );
        if let Some((status, figures)) = &report {
            let mut shown = status.clone();
            shown.capacity = args.jobs - 1;
            print_report(&shown);
            if let Some(f) = figures {
                print_outer(f);
            }
        }
    }
    if let Some((_, Some(f))) = &report {
        let lost = f.lost.load(Ordering::Relaxed);
        if lost != 0 {
            eprintln!("herdless: {lost} token(s) could not be given back to the outer pool");
        }
    }
    Ok(child::end(match stop_signal {
        Some(sig) => child::Exit::Signal(sig),
        None => outcome.exit(),
    }))
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
            let native = r.grants.saturating_sub(classic);
            format!(
                "grants        {} to native clients ({} at once, {} after a wait){}",
                native,
                native.saturating_sub(r.wakeups),
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
        format!(
            "stop          {} acquire(s) refused after it, {} token(s) held at shutdown",
            r.refused_after_stop, r.held_at_shutdown
        ),
    ];
    let classic = r.classic.as_ref().map(|c| {
        format!(
            "classic       {} {} jobserver: {} offered, {} returned, {} taken back, {} lost",
            c.flavor, c.style, c.offered, c.returned, c.taken_back, c.lost
        )
    });
    // What the broker learnt of who reads the pipe (docs/ARCHITECTURE.md).
    let readers = r.classic.as_ref().map(|c| {
        format!(
            "pipe readers  command {}, classic clients {}, back-off {}",
            if c.command_native {
                "native"
            } else {
                "not native"
            },
            if c.classic_seen { "seen" } else { "not seen" },
            c.backoff
        )
    });
    let aborted = r
        .aborted
        .as_ref()
        .map(|a| format!("aborted       {a} (every client was told)"));
    let lines = lines
        .into_iter()
        .chain(classic)
        .chain(readers)
        .chain(aborted);
    for line in lines {
        eprintln!("herdless: {line}");
    }
}

/// Tests only: the milliseconds `run` waits, once its command is spawned,
/// before it names the command's process id to its broker (the window in
/// which a make behind a wrapper may connect first).
pub const NAMING_DELAY_ENV: &str = "HERDLESS_TEST_NAMING_DELAY_MS";

fn naming_delay() {
    let ms = std::env::var(NAMING_DELAY_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = ms {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}
