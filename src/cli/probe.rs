//! `herdless probe`: what this kernel does when many processes wait on one
//! pipe, and what herdless does instead.

use anyhow::{Context, Result};

use herdless_bench::probe;
use herdless_bench::progress::Progress;

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn probe(args: ProbeArgs) -> Result<u8> {
    let exe = std::env::current_exe().context("cannot find the herdless binary")?;
    let modes =
        herdless_bench::BenchMode::available_modes().len() + herdless_bench::relay::Wake::ALL.len();
    let mut progress = Progress::new(modes);
    let report = probe::probe(exe, &mut |mode| {
        progress.update(&format!("probing {mode}"));
        progress.step();
    })?;
    progress.finish();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", probe::table(&report));
    }
    Ok(0)
}
