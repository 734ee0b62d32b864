//! Tables of results, for people.
//!
//! Absolute times on a shared machine move from run to run; the ratio
//! tables set each mode beside herdless measured in the same run, which is
//! what stays comparable.

use std::fmt::Write as _;

use super::build::BuildResult;
use super::herd::CellResult;
use super::BenchMode;
use herdless_platform::wait::Mode;

/// The modes the ratio table compares herdless with (ARCHITECTURE §5), where
/// measured.
pub const RATIO_MODES: [BenchMode; 4] = [
    BenchMode::Kernel(Mode::Poll),
    BenchMode::Kernel(Mode::BlockingRead),
    BenchMode::Kernel(Mode::EpollExclusive),
    BenchMode::Kernel(Mode::Futex),
];

fn us(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0} ms", v / 1000.0)
    } else if v >= 10_000.0 {
        format!("{:.1} ms", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0} µs")
    } else {
        format!("{v:.1} µs")
    }
}

/// One row per cell: the five measures of `bench herd`.
pub fn herd_table(cells: &[CellResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>5} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "mode", "W", "grants", "wake/grant", "CPU/grant", "p50", "p99", "grants/s", "idle-free"
    );
    for c in cells {
        let _ = writeln!(
            out,
            "{:<16} {:>5} {:>6} {:>10.2} {:>10} {:>10} {:>10} {:>10.0} {:>12}",
            c.mode.name(),
            c.waiters,
            c.grants,
            c.wakeups_per_grant(),
            us(c.cpu_us_per_grant()),
            us(c.handoff_p50_us()),
            us(c.handoff_p99_us()),
            c.grants_per_s(),
            us(c.idle_while_free.as_secs_f64() * 1e6),
        );
    }
    out
}

fn div(a: f64, b: f64) -> String {
    if b > 0.0 && a.is_finite() {
        let r = a / b;
        if r >= 100.0 {
            format!("{r:.0}×")
        } else if r >= 10.0 {
            format!("{r:.1}×")
        } else if r >= 0.1 {
            format!("{r:.2}×")
        } else {
            format!("{r:.3}×")
        }
    } else {
        "–".to_owned()
    }
}

/// For each W and each of [`RATIO_MODES`] measured beside herdless: the
/// mode's figure divided by herdless's. Above 1× the mode wakes more, burns
/// more, waits longer — or, for grants/s, hands out more per second.
pub fn ratio_table(cells: &[CellResult]) -> String {
    let mut out = String::new();
    let mut ws: Vec<u32> = cells.iter().map(|c| c.waiters).collect();
    ws.sort_unstable();
    ws.dedup();
    let find = |m: BenchMode, w: u32| cells.iter().find(|c| c.mode == m && c.waiters == w);
    let mut any = false;
    for w in ws {
        let Some(h) = find(BenchMode::Herdless, w) else {
            continue;
        };
        for m in RATIO_MODES {
            let Some(c) = find(m, w) else { continue };
            if !any {
                let _ = writeln!(
                    out,
                    "{:<16} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10}",
                    "mode ÷ herdless", "W", "wake/grant", "CPU/grant", "p50", "p99", "grants/s"
                );
                any = true;
            }
            let _ = writeln!(
                out,
                "{:<16} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10}",
                m.name(),
                w,
                div(c.wakeups_per_grant(), h.wakeups_per_grant()),
                div(c.cpu_us_per_grant(), h.cpu_us_per_grant()),
                div(c.handoff_p50_us(), h.handoff_p50_us()),
                div(c.handoff_p99_us(), h.handoff_p99_us()),
                div(c.grants_per_s(), h.grants_per_s()),
            );
        }
    }
    out
}

/// One row per variant of `bench build`, with wall and system time beside
/// herdless's.
pub fn build_table(results: &[BuildResult]) -> String {
    let mut out = String::new();
    let herdless = results
        .iter()
        .find(|r| r.variant == super::build::Variant::Herdless && !r.stalled);
    let _ = writeln!(
        out,
        "{:<9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>11} {:>13}",
        "variant",
        "wall",
        "user",
        "system",
        "vol ctx",
        "invol ctx",
        "tokens",
        "wall ÷ hl",
        "system ÷ hl"
    );
    let secs = |d: Option<std::time::Duration>| {
        d.map(|d| format!("{:.2} s", d.as_secs_f64()))
            .unwrap_or_else(|| "–".to_owned())
    };
    for r in results {
        let cap = r.config.jobs - 1;
        let wall = if r.stalled {
            format!("> {:.0} s", r.config.stall_after.as_secs_f64())
        } else {
            format!("{:.2} s", r.wall.as_secs_f64())
        };
        let (wall_ratio, sys_ratio) = match (herdless, r.stalled) {
            (Some(h), false) => (
                div(r.wall.as_secs_f64(), h.wall.as_secs_f64()),
                div(
                    r.system.unwrap_or_default().as_secs_f64(),
                    h.system.unwrap_or_default().as_secs_f64(),
                ),
            ),
            _ => ("–".to_owned(), "–".to_owned()),
        };
        let _ = writeln!(
            out,
            "{:<9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>11} {:>13}{}",
            r.variant.name(),
            wall,
            secs(r.user),
            secs(r.system),
            r.voluntary_ctx.map_or("–".to_owned(), |v| v.to_string()),
            r.involuntary_ctx.map_or("–".to_owned(), |v| v.to_string()),
            format!("{}/{cap}", r.tokens_back),
            wall_ratio,
            sys_ratio,
            if r.stalled { "  stalled" } else { "" },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cell(mode: BenchMode, w: u32, wakeups: u64) -> CellResult {
        CellResult {
            mode,
            waiters: w,
            tokens: 1,
            grants: 10,
            wakeups,
            wakeups_by_waiter: vec![],
            grants_by_waiter: vec![],
            winners: vec![],
            grant_times: vec![],
            open_waits: vec![],
            waiter_cpu: Duration::from_micros(100),
            releaser_cpu: Duration::from_micros(100),
            handoffs_ns: vec![10_000; 10],
            elapsed: Duration::from_millis(1),
            idle_while_free: Duration::from_micros(100),
            kernel: "Linux 6.18".into(),
        }
    }

    #[test]
    fn ratios_set_modes_beside_herdless() {
        let cells = [
            cell(BenchMode::Kernel(Mode::Poll), 8, 80),
            cell(BenchMode::Herdless, 8, 10),
            cell(BenchMode::Kernel(Mode::Select), 8, 80),
        ];
        let t = ratio_table(&cells);
        assert!(t.contains("poll"), "{t}");
        assert!(t.contains("8.00×"), "{t}");
        // Only the modes ARCHITECTURE §5 names.
        assert!(!t.contains("select"), "{t}");
        let h = herd_table(&cells);
        assert_eq!(h.lines().count(), 4);
        assert!(h.contains("10.0 µs"), "{h}");
        assert!(ratio_table(&cells[..1]).is_empty());
    }
}
