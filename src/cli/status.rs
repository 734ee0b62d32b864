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
    // Checked before printing, even as JSON: an invalid document is an
    // error (exit 125), never printed as if it were the answer.
    let s: Status = serde_json::from_str(&json).with_context(|| {
        format!(
            "the broker's status ({} bytes) is not a valid document",
            json.len()
        )
    })?;
    let format = args
        .format
        .as_deref()
        .unwrap_or(if args.json { "json" } else { "table" });
    if format == "json" {
        println!("{json}");
        return Ok(0);
    }
    if format == "openmetrics" {
        print!("{}", s.to_openmetrics());
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
    if let Some(n) = s.broker_vcsw {
        println!("broker    {n} wake-ups of its thread");
    }
    if let Some(c) = &s.controls {
        let mut limits = Vec::new();
        if let Some(l) = c.max_load {
            limits.push(format!("load ≤ {l}"));
        }
        if let Some(m) = c.min_free_memory {
            limits.push(format!("free memory ≥ {m} bytes"));
        }
        if !limits.is_empty() {
            let state = if c.admission == "open" {
                "open".to_string()
            } else {
                format!("held ({})", c.admission)
            };
            println!(
                "admission {state}; limits {}, at least {} job(s) whatever they say; held {} time(s)",
                limits.join(", "),
                c.min_jobs,
                c.held_back
            );
        }
        if c.retiring > 0 {
            println!("shrink    {} tokens still to come back", c.retiring);
        }
        for cap in &c.caps {
            println!(
                "cap       pid {} and its children: at most {} ({} held)",
                cap.pid, cap.max, cap.held
            );
        }
    }
    if let Some(f) = &s.fast {
        println!(
            "table     {}, {} client(s); {} lent ({} free, {} held); {} grant(s) from it; {}",
            if f.open { "open" } else { "closed" },
            f.clients,
            f.lent,
            f.free,
            f.held,
            f.grants,
            if f.handoff {
                format!(
                    "{} waiting there, {} moved to the queue",
                    f.waiting, f.moved
                )
            } else {
                "waits go to the broker".to_owned()
            }
        );
    }
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
