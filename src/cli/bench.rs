//! `herdless bench herd | build`: the thundering-herd benchmarks.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use herdless_bench::build::{self, BuildConfig, Variant};
use herdless_bench::progress::Progress;
use herdless_bench::{herd, plot, report, BenchMode};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// W processes wait for tokens in each mode: wake-ups, CPU and hand-off
    /// latency per grant, side by side.
    Herd(HerdArgs),
    /// A recursive build on a classic pipe (each P, C, R combination of the
    /// bmake report) and on the broker.
    Build(BuildArgs),
    /// One recursive tree run by real makes, side by side: stock GNU make
    /// 4.4.1, the same under `herdless run`'s classic bridge, GNU make with
    /// herdless inside, Debian's bmake, bmake polling its pipe and bmake
    /// with herdless inside (those built are included).
    Make(MakeArgs),
    /// A waiter or make process of a benchmark (internal).
    #[command(hide = true)]
    Worker(WorkerArgs),
}

#[derive(clap::Args, Debug)]
struct HerdArgs {
    /// Wait modes, comma-separated: poll, select, epoll, epoll-exclusive,
    /// blocking-read, kqueue, kqueue-dispatch, futex, herdless [default:
    /// every mode this OS offers].
    #[arg(long = "mode", value_name = "M[,M…]", value_delimiter = ',', value_parser = parse_mode)]
    modes: Vec<BenchMode>,
    /// Numbers of waiting processes, comma-separated.
    #[arg(long, value_name = "W[,W…]", value_delimiter = ',', default_value = "1,8,64,256",
          value_parser = clap::value_parser!(u32).range(1..=i64::from(herdless::broker::MAX_JOBS)))]
    waiters: Vec<u32>,
    /// Tokens handed out per mode and W.
    #[arg(long, value_name = "G", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(1..))]
    grants: u64,
    /// Tokens in circulation at once.
    #[arg(long, value_name = "T", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=255))]
    tokens: u32,
    /// Print a JSON list, one object per mode and W.
    #[arg(long)]
    json: bool,
    /// Also draw wake-ups and CPU per grant against W into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct BuildArgs {
    /// Sub-makes the top make runs (M).
    #[arg(long, value_name = "M", default_value_t = 40,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    makes: u32,
    /// Jobs each sub-make runs (K).
    #[arg(long, value_name = "K", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    jobs_per_make: u32,
    /// CPU time of one job in µs, a busy loop (X).
    #[arg(long, value_name = "X", default_value_t = 5000)]
    job_us: u64,
    /// At most N jobs at once, as make's -j; the pool holds N − 1 tokens
    /// (at most 4096, which a FIFO holds on every supported system).
    #[arg(short = 'j', long = "jobs", value_name = "N", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    jobs: u32,
    /// Variants, comma-separated: P0C0R0 … P1C1R1 (P: poll the pipe, C:
    /// implicit-token check, R: sleep 1 s after a failed read), herdless
    /// [default: all nine].
    #[arg(long, value_name = "V[,V…]", value_delimiter = ',', value_parser = parse_variant)]
    variants: Vec<Variant>,
    /// Report a run still going after this many seconds as stalled, and
    /// stop it.
    #[arg(long, value_name = "SECS", default_value_t = 120.0)]
    stall_after: f64,
    /// Print a JSON list, one object per variant.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct MakeArgs {
    /// Sub-makes the top make runs.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    subs: u32,
    /// Jobs per sub-make.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    per: u32,
    /// How long each job sleeps, in milliseconds.
    #[arg(long, default_value_t = 5)]
    job_ms: u32,
    /// Jobs of mixed lengths: each sub-make's jobs sleep 1, 1, 1, 2, 2, 4,
    /// 10 and 20 times --job-ms in turn.
    #[arg(long)]
    mix: bool,
    /// At most N jobs at once, as make's -j.
    #[arg(short = 'j', long = "jobs", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(2..=4096))]
    jobs: u32,
    /// Runs per variant, interleaved; the median run by wall time is shown.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Stock GNU make 4.4.1 (ci/build-gnu-make-4.4.1.sh).
    #[arg(
        long,
        env = "HERDLESS_GNU_MAKE_44",
        default_value = "target/tools/gnu-make-4.4.1/bin/make"
    )]
    stock_make: PathBuf,
    /// GNU make 4.4.1 with herdless inside (embed/gnu-make/build.sh).
    #[arg(
        long,
        env = "HERDLESS_EMBED_GNU_MAKE",
        default_value = "target/embed/gnu-make/bin/make"
    )]
    herdless_make: PathBuf,
    /// Debian's bmake; left out when missing.
    #[arg(long, default_value = "/usr/bin/bmake")]
    bmake: PathBuf,
    /// bmake polling its token pipe (embed/bmake/build.sh); left out when
    /// missing.
    #[arg(long, default_value = "target/embed/bmake-polling/bin/bmake")]
    polling_bmake: PathBuf,
    /// bmake with herdless inside (embed/bmake/build.sh); left out when
    /// missing.
    #[arg(long, default_value = "target/embed/bmake/bin/bmake")]
    herdless_bmake: PathBuf,
    /// Print a JSON list, one object per variant.
    #[arg(long)]
    json: bool,
    /// Also draw the makes' context switches per job into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct WorkerArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    args: Vec<OsString>,
}

fn parse_mode(s: &str) -> Result<BenchMode, String> {
    s.parse()
}

fn parse_variant(s: &str) -> Result<Variant, String> {
    s.parse()
}

pub fn bench(args: BenchArgs) -> Result<u8> {
    match args.command {
        BenchCommand::Herd(a) => bench_herd(a),
        BenchCommand::Build(a) => bench_build(a),
        BenchCommand::Make(a) => bench_make(a),
        BenchCommand::Worker(a) => {
            herdless_bench::worker_main(a.args)?;
            Ok(0)
        }
    }
}

fn this_exe() -> Result<PathBuf> {
    std::env::current_exe().context("cannot find the herdless binary to run as a worker")
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn bench_herd(args: HerdArgs) -> Result<u8> {
    let exe = this_exe()?;
    let modes = if args.modes.is_empty() {
        BenchMode::available_modes()
    } else {
        args.modes.clone()
    };
    if !modes.iter().any(|m| m.available().is_ok()) {
        for m in &modes {
            if let Err(why) = m.available() {
                eprintln!("herdless: skipping {m}: {why}");
            }
        }
        bail!("none of the modes asked for is available on this OS");
    }
    let cells = herd::run_matrix(&exe, &modes, &args.waiters, args.grants, args.tokens)?;
    if args.json {
        let rows: Vec<_> = cells.iter().map(|c| c.row()).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("{}", report::herd_table(&cells));
        let ratios = report::ratio_table(&cells);
        if !ratios.is_empty() {
            println!("{ratios}");
        }
    }
    if let Some(path) = &args.plot {
        let caption = format!(
            "{} · {} CPUs · {} grants per point, {} token(s) at a time · herdless bench herd",
            herdless_bench::kernel_label(),
            cpus(),
            args.grants,
            args.tokens
        );
        std::fs::write(path, plot::svg(&cells, &caption))
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("herdless: plot written to {}", path.display());
    }
    Ok(0)
}

fn bench_build(args: BuildArgs) -> Result<u8> {
    if !(args.stall_after.is_finite() && args.stall_after > 0.0) {
        bail!("--stall-after must be a positive number of seconds");
    }
    let cfg = BuildConfig {
        exe: this_exe()?,
        makes: args.makes,
        jobs_per_make: args.jobs_per_make,
        job_us: args.job_us,
        jobs: args.jobs,
        stall_after: Duration::from_secs_f64(args.stall_after),
    };
    let variants = if args.variants.is_empty() {
        Variant::all()
    } else {
        args.variants.clone()
    };
    let iters_per_us = build::calibrate();
    let mut progress = Progress::new(variants.len());
    let mut results = Vec::new();
    for v in variants {
        progress.update(&format!(
            "{v} (stalls are cut off after {:.0} s)",
            args.stall_after
        ));
        let r =
            build::run_variant(&cfg, v, iters_per_us).with_context(|| format!("variant {v}"))?;
        progress.step();
        results.push(r);
    }
    progress.finish();
    if args.json {
        let rows: Vec<_> = results.iter().map(|r| r.row()).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{} sub-makes × {} jobs of {} µs, -j {} ({} tokens in the pool), {} · {} CPUs",
            cfg.makes,
            cfg.jobs_per_make,
            cfg.job_us,
            cfg.jobs,
            cfg.jobs - 1,
            herdless_bench::kernel_label(),
            cpus()
        );
        println!("{}", report::build_table(&results));
    }
    Ok(0)
}

fn bench_make(args: MakeArgs) -> Result<u8> {
    use herdless_bench::realmake::{self, MakeConfig, MakeVariant};
    for (what, path) in [
        ("stock GNU make 4.4.1 (--stock-make)", &args.stock_make),
        (
            "GNU make with herdless (--herdless-make)",
            &args.herdless_make,
        ),
    ] {
        if !path.exists() {
            bail!("{what} not found at {}", path.display());
        }
    }
    let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
    let variant = |name: &str, make: &PathBuf, under_run: bool, env: &[(&str, &str)]| MakeVariant {
        name: name.to_string(),
        make: abs(make),
        under_run,
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    let mut variants = vec![
        variant("GNU make (stock)", &args.stock_make, false, &[]),
        variant("GNU make (stock) in run", &args.stock_make, true, &[]),
        variant("GNU make (herdless)", &args.herdless_make, false, &[]),
    ];
    for (name, path) in [
        ("bmake (Debian)", &args.bmake),
        ("bmake (polling)", &args.polling_bmake),
        ("bmake (herdless)", &args.herdless_bmake),
    ] {
        if path.exists() {
            variants.push(variant(name, path, false, &[]));
        } else {
            eprintln!("herdless: no {name} at {}: left out", path.display());
        }
    }
    let cfg = MakeConfig {
        exe: this_exe()?,
        subs: args.subs,
        per: args.per,
        job_ms: args.job_ms,
        jobs: args.jobs,
        repeat: args.repeat,
        mix: args.mix,
    };
    let mut progress = Progress::new(variants.len() * args.repeat as usize);
    let results = realmake::run_all(&cfg, &variants, |what| {
        progress.update(what);
        progress.step();
    })
    .context("the make benchmark")?;
    progress.finish();
    let caption = format!(
        "{} sub-makes × {} jobs of {}{} ms, -j {} · {} · {} CPUs · herdless bench make",
        cfg.subs,
        cfg.per,
        if cfg.mix { "1–20 × " } else { "" },
        cfg.job_ms,
        cfg.jobs,
        herdless_bench::kernel_label(),
        cpus()
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        println!("{caption}");
        println!("{}", realmake::table(&results));
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, realmake::svg(&results, &caption))
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("herdless: plot written to {}", path.display());
    }
    Ok(if results.iter().all(|r| r.ok) { 0 } else { 1 })
}
