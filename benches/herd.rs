//! The standard thundering-herd matrix: every wait mode this OS offers,
//! and herdless, at W = 1, 8, 64, 256 and 1024 waiting processes, printed
//! as a table of figures and a table of ratios to herdless.
//!
//! ```text
//! cargo bench --bench herd
//! cargo bench --bench herd -- --grants 500 --plot docs/herd.svg
//! cargo bench --bench herd -- --modes poll,herdless --waiters 1,64 --json
//! ```
//!
//! It reports; it asserts nothing about timings. The waiters are the
//! `herdless` binary built beside this benchmark.

use std::path::PathBuf;
use std::process::ExitCode;

use herdless_bench::herd::{run_matrix, STANDARD_WAITERS};
use herdless_bench::{kernel_label, plot, report, BenchMode};

struct Args {
    modes: Vec<BenchMode>,
    waiters: Vec<u32>,
    grants: u64,
    tokens: u32,
    plot: Option<PathBuf>,
    json: bool,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|v| v.parse().map_err(|_| format!("bad value {v:?}")))
        .collect()
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        modes: BenchMode::available_modes(),
        waiters: STANDARD_WAITERS.to_vec(),
        grants: 300,
        tokens: 1,
        plot: None,
        json: false,
    };
    // `cargo bench` passes --bench; libtest-style filters are ignored.
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--bench" => {}
            "--modes" | "--mode" => a.modes = list(&value()?)?,
            "--waiters" => a.waiters = list(&value()?)?,
            "--grants" => a.grants = value()?.parse().map_err(|e| format!("--grants: {e}"))?,
            "--tokens" => a.tokens = value()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--plot" => a.plot = Some(value()?.into()),
            "--json" => a.json = true,
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            _ => {}
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("herd bench: {e}");
            return ExitCode::from(2);
        }
    };
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_herdless"));
    let cells = match run_matrix(&exe, &args.modes, &args.waiters, args.grants, args.tokens) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("herd bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.json {
        let rows: Vec<_> = cells.iter().map(|c| c.row()).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).expect("rows serialize")
        );
    } else {
        println!(
            "{} · {cpus} CPUs · {} grants per cell, {} token(s) at a time\n",
            kernel_label(),
            args.grants,
            args.tokens
        );
        println!("{}", report::herd_table(&cells));
        println!("{}", report::ratio_table(&cells));
    }
    if let Some(path) = &args.plot {
        let caption = format!(
            "{} · {cpus} CPUs · {} grants per point, {} token(s) at a time · cargo bench --bench herd",
            kernel_label(),
            args.grants,
            args.tokens
        );
        if let Err(e) = std::fs::write(path, plot::svg(&cells, &caption)) {
            eprintln!("herd bench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("plot written to {}", path.display());
    }
    ExitCode::SUCCESS
}
