//! Command-line interface: `herdless run | serve | exec | status | ctl`.
//!
//! Exit codes are set here and only here: a command's own status for `run`
//! and `exec` (128 + N when it was killed by signal N), 125 when herdless
//! itself fails, 126 when the command cannot be executed, 127 when it is
//! not found, 2 for a usage error.

mod admission;
mod bench;
mod child;
mod ctl;
mod exec;
mod probe;
mod run;
mod serve;
mod status;
mod stress;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};
use herdless::classic::{Flavor, Style};

/// The descriptor limits, once `run` or `serve` has raised its own: the
/// commands it runs get the original soft limit back.
static NOFILE: std::sync::OnceLock<herdless_platform::NofileLimit> = std::sync::OnceLock::new();

/// Raises the soft descriptor limit to the hard one, for a process that
/// will serve a connection per job (see `herdless_platform::nofile`).
fn raise_nofile_limit() {
    match herdless_platform::raise_nofile_limit() {
        Ok(limit) => {
            let _ = NOFILE.set(limit);
        }
        Err(e) => eprintln!("herdless: cannot raise the descriptor limit: {e}"),
    }
}

/// Exit code when herdless itself fails.
pub const EXIT_FAILURE: u8 = 125;

#[derive(Parser, Debug)]
#[command(
    name = "herdless",
    version,
    about = "A jobserver that wakes exactly one waiter per job token",
    long_about = "herdless hands each job token of a parallel build to exactly one waiting \
                  process, instead of waking every process that polls a shared pipe."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run CMD under a new broker allowing at most N jobs at once.
    Run(RunArgs),
    /// Run a standalone broker until SIGINT or SIGTERM.
    Serve(ServeArgs),
    /// Take one job token, run CMD, give the token back.
    Exec(ExecArgs),
    /// Show the broker's tokens, waiters and clients.
    Status(StatusArgs),
    /// Change a running broker: its -j, a cap on a process subtree, or
    /// abort the build.
    Ctl(ctl::CtlArgs),
    /// Measure the thundering herd: wait modes side by side, or a model
    /// build.
    Bench(bench::BenchArgs),
    /// Show what this kernel does when many processes wait on one pipe.
    Probe(probe::ProbeArgs),
    /// Misbehave against a running broker and measure a well-behaved
    /// client beside it (the figures of docs/RELIABILITY.md).
    #[command(hide = true)]
    Stress(stress::StressArgs),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// At most N jobs at once in the whole tree (as make's -j).
    #[arg(short = 'j', long = "jobs", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(herdless::broker::MAX_JOBS)))]
    jobs: u32,
    /// Print the broker's statistics to stderr when CMD ends.
    #[arg(long)]
    stats: bool,
    /// How classic jobserver clients (make, cargo, …) reach the pool:
    /// inherited descriptors (every classic client reads these) or a named
    /// FIFO (GNU make 4.4 and later).
    #[arg(long, default_value = "pipe", value_parser = style_parser())]
    style: Style,
    /// Whose flags to export: GNU make's MAKEFLAGS and CARGO_MAKEFLAGS, or
    /// bmake's -J (default: bmake when CMD is bmake or bsdmake, also behind
    /// a wrapper such as timeout, nice, env or unshare, or in an `sh -c`
    /// string that runs a bmake and no other jobserver reader).
    #[arg(long, value_parser = flavor_parser())]
    flavor: Option<Flavor>,
    /// Export no classic jobserver: only native clients take tokens.
    #[arg(long)]
    no_classic: bool,
    /// Start a pool of its own even under another herdless broker
    /// (HERDLESS_SOCKET) or an outer make's classic jobserver (MAKEFLAGS):
    /// the outer -j then no longer bounds this subtree (a warning says so,
    /// as make's "-jN forced in submake" does).
    #[arg(long)]
    new_pool: bool,
    #[command(flatten)]
    admission: admission::AdmissionArgs,
    /// The command to run, and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// At most N jobs at once (as make's -j).
    #[arg(short = 'j', long = "jobs", value_name = "N", value_parser = clap::value_parser!(u32).range(1..=i64::from(herdless::broker::MAX_JOBS)))]
    jobs: u32,
    /// Listen on this path (its directory must be private: mode 0700).
    /// Under socket activation (LISTEN_FDS) the passed socket is used and
    /// this path is only printed.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    #[command(flatten)]
    admission: admission::AdmissionArgs,
}

#[derive(clap::Args, Debug)]
struct ExecArgs {
    /// When CMD fails, abort the whole tree: every native client is told,
    /// and bmakes find an `E` token in their pipe (`I` when CMD was
    /// interrupted by SIGINT).
    #[arg(long)]
    abort_on_failure: bool,
    /// The command to run, and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(clap::Args, Debug)]
struct StatusArgs {
    /// Print the report as JSON (the same as --format json).
    #[arg(long, conflicts_with = "format")]
    json: bool,
    /// How to print the report: a table, JSON, or OpenMetrics text (for
    /// Prometheus and other scrapers).
    #[arg(long, value_parser = ["table", "json", "openmetrics"])]
    format: Option<String>,
    /// The broker's socket (default: $HERDLESS_SOCKET).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
}

/// Parses the command line, runs the subcommand and turns its outcome into
/// the process's exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Serve(args) => serve::serve(args),
        Command::Exec(args) => exec::exec(args),
        Command::Status(args) => status::status(args),
        Command::Ctl(args) => ctl::ctl(args),
        Command::Bench(args) => bench::bench(args),
        Command::Probe(args) => probe::probe(args),
        Command::Stress(args) => stress::stress(args),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("herdless: {}", error_chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// An error and its causes, `: `-separated, each cause said once: the
/// library's errors already end with their source (`… does not exist: No
/// such file or directory`), which the chain would repeat.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if text.ends_with(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

/// `--style`: the library's names, listed in `--help`.
fn style_parser() -> impl TypedValueParser<Value = Style> {
    PossibleValuesParser::new(Style::ALL.map(Style::name))
        .map(|s| s.parse::<Style>().expect("a listed style"))
}

/// `--flavor`: the library's names, listed in `--help`.
fn flavor_parser() -> impl TypedValueParser<Value = Flavor> {
    PossibleValuesParser::new(Flavor::ALL.map(Flavor::name))
        .map(|s| s.parse::<Flavor>().expect("a listed flavour"))
}
