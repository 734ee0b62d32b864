//! `herdless status`: what the broker is doing now.

use anyhow::{anyhow, Context, Result};

use herdless::client::{socket_from_env, Client};
use herdless::status::Status;

use super::StatusArgs;

/// Prints the broker's report, as a table or as JSON.
pub fn status(args: StatusArgs) -> Result<u8> {
    let path = args
        .socket
        .or_else(socket_from_env)
        .ok_or_else(|| anyhow!("no broker named: pass --socket or set HERDLESS_SOCKET"))?;
    let json = Client::observe(&path)?.json()?;
    // Checked before printing, even for --json: an invalid document is an
    // error (exit 125), never printed as if it were the answer.
    let s: Status = serde_json::from_str(&json).with_context(|| {
        format!(
            "the broker's status ({} bytes) is not a valid document",
            json.len()
        )
    })?;
    if args.json {
        println!("{json}");
        return Ok(0);
    }
    println!(
        "broker    pid {}, -j {} ({} shared tokens)",
        s.pid, s.jobs, s.capacity
    );
    println!(
        "tokens    {} free, {} in use, {} waiting{}",
        s.free,
        s.in_use,
        s.waiting,
        s.aborted
            .as_deref()
            .map(|r| format!(", aborted ({r})"))
            .unwrap_or_default()
    );
    println!(
        "grants    {} ({} after a wait), {} wake-ups, max in use {}",
        s.grants, s.waits, s.wakeups, s.max_in_use
    );
    println!(
        "wait      p50 {:.0} µs, p99 {:.0} µs",
        s.wait_p50_us, s.wait_p99_us
    );
    if s.clients_total > s.clients.len() as u64 {
        println!(
            "clients   {} ({} listed: the busiest)",
            s.clients_total,
            s.clients.len()
        );
    } else {
        println!("clients   {}", s.clients.len());
    }
    if s.handshaking > 0 {
        println!("          {} connecting", s.handshaking);
    }
    if !s.clients.is_empty() {
        println!("  {:>8}  {:>4}  {:>7}  kind", "pid", "held", "waiting");
        for c in &s.clients {
            println!(
                "  {:>8}  {:>4}  {:>7}  {}",
                c.pid, c.held, c.waiting, c.kind
            );
        }
    }
    Ok(0)
}
