//! An SVG plot of a herd run: wake-ups per grant and CPU per grant against
//! the number of waiters, one line per mode, on log–log axes. Written by
//! hand: a small, self-contained file any browser shows.

use std::fmt::Write as _;

use super::herd::CellResult;
use super::BenchMode;

const WIDTH: f64 = 980.0;
const HEIGHT: f64 = 490.0;
const PANEL_W: f64 = 360.0;
const PANEL_H: f64 = 320.0;
const TOP: f64 = 88.0;
const LEFTS: [f64; 2] = [80.0, 520.0];

/// Colours that stay apart for the usual eight modes (Okabe–Ito, then
/// greys).
const PALETTE: [&str; 10] = [
    "#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#0072B2", "#D55E00", "#F0E442", "#999999",
    "#555555", "#000000",
];

fn colour(mode: BenchMode) -> &'static str {
    if mode == BenchMode::Herdless {
        return "#000000";
    }
    let i = BenchMode::all()
        .iter()
        .position(|m| *m == mode)
        .unwrap_or(0);
    PALETTE[i % PALETTE.len()]
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A log-scale axis from `lo` to `hi` (both > 0) onto `[a, b]`.
struct LogAxis {
    lo: f64,
    hi: f64,
    a: f64,
    b: f64,
}

impl LogAxis {
    fn at(&self, v: f64) -> f64 {
        let v = v.clamp(self.lo, self.hi);
        let f = (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln());
        self.a + f * (self.b - self.a)
    }
}

/// Powers of ten around `[min, max]`.
fn decades(min: f64, max: f64) -> (f64, f64) {
    let min = if min > 0.0 && min.is_finite() {
        min
    } else {
        1.0
    };
    let max = max.max(min);
    let lo = 10f64.powf(min.log10().floor());
    let mut hi = 10f64.powf(max.log10().ceil());
    if hi <= lo {
        hi = lo * 10.0;
    }
    (lo, hi)
}

fn fmt_tick(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The SVG document for `cells`. `caption` goes under the title (the
/// kernel, the grants, the machine).
pub fn svg(cells: &[CellResult], caption: &str) -> String {
    let mut modes: Vec<BenchMode> = Vec::new();
    for c in cells {
        if !modes.contains(&c.mode) {
            modes.push(c.mode);
        }
    }
    let mut ws: Vec<u32> = cells.iter().map(|c| c.waiters).collect();
    ws.sort_unstable();
    ws.dedup();
    let wmin = f64::from(*ws.first().unwrap_or(&1)).max(1.0);
    let mut wmax = f64::from(*ws.last().unwrap_or(&1)).max(1.0);
    if wmax <= wmin {
        wmax = wmin * 2.0;
    }

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r##"<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" font-size="16" font-weight="bold" text-anchor="middle">Thundering herd: cost of one token grant against the number of waiting processes</text>
<text x="{}" y="44" fill="#444" text-anchor="middle">{}</text>"##,
        WIDTH / 2.0,
        WIDTH / 2.0,
        esc(caption)
    );

    type Metric = fn(&CellResult) -> f64;
    let panels: [(&str, Metric); 2] = [
        ("wake-ups per grant", CellResult::wakeups_per_grant),
        (
            "CPU per grant (µs, all processes)",
            CellResult::cpu_us_per_grant,
        ),
    ];
    for (p, (title, metric)) in panels.iter().enumerate() {
        let left = LEFTS[p];
        let values: Vec<f64> = cells.iter().map(metric).filter(|v| *v > 0.0).collect();
        let (ylo, yhi) = decades(
            values.iter().copied().fold(f64::INFINITY, f64::min),
            values.iter().copied().fold(0.0, f64::max),
        );
        let x = LogAxis {
            lo: wmin,
            hi: wmax,
            a: left,
            b: left + PANEL_W,
        };
        let y = LogAxis {
            lo: ylo,
            hi: yhi,
            a: TOP + PANEL_H,
            b: TOP,
        };
        let _ = writeln!(
            out,
            r#"<g><text x="{}" y="{}" font-size="14" text-anchor="middle">{}</text>"#,
            left + PANEL_W / 2.0,
            TOP - 12.0,
            esc(title)
        );
        // Horizontal grid at each power of ten.
        let mut d = ylo;
        while d <= yhi * 1.0001 {
            let yy = y.at(d);
            let _ = writeln!(
                out,
                r##"<line x1="{left}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                left + PANEL_W,
                left - 6.0,
                yy + 4.0,
                fmt_tick(d)
            );
            d *= 10.0;
        }
        for &w in &ws {
            let xx = x.at(f64::from(w));
            let _ = writeln!(
                out,
                r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{}" stroke="#eee"/><text x="{xx:.1}" y="{}" text-anchor="middle">{w}</text>"##,
                TOP + PANEL_H,
                TOP + PANEL_H + 16.0
            );
        }
        let _ = writeln!(
            out,
            r##"<rect x="{left}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#333"/><text x="{}" y="{}" text-anchor="middle">waiting processes (W)</text>"##,
            left + PANEL_W / 2.0,
            TOP + PANEL_H + 36.0
        );
        for &m in &modes {
            let mut pts: Vec<(u32, f64)> = cells
                .iter()
                .filter(|c| c.mode == m)
                .map(|c| (c.waiters, metric(c)))
                .collect();
            pts.sort_by_key(|p| p.0);
            let col = colour(m);
            let width = if m == BenchMode::Herdless { 3 } else { 2 };
            let line: Vec<String> = pts
                .iter()
                .map(|(w, v)| format!("{:.1},{:.1}", x.at(f64::from(*w)), y.at(*v)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{col}" stroke-width="{width}" points="{}"/>"#,
                line.join(" ")
            );
            for (w, v) in &pts {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{col}"><title>{} W={w}: {v:.2}</title></circle>"#,
                    x.at(f64::from(*w)),
                    y.at(*v),
                    m.name()
                );
            }
        }
        let _ = writeln!(out, "</g>");
    }

    // Legend, under the panels, each entry as wide as its name.
    let legend_y = TOP + PANEL_H + 62.0;
    let mut lx = LEFTS[0];
    for &m in &modes {
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{legend_y}" x2="{:.1}" y2="{legend_y}" stroke="{}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 22.0,
            colour(m),
            lx + 28.0,
            legend_y + 4.0,
            esc(m.name())
        );
        lx += 48.0 + 7.0 * m.name().len() as f64;
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use herdless_platform::wait::Mode;
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
            waiter_cpu: Duration::from_micros(50 * u64::from(w)),
            releaser_cpu: Duration::from_micros(100),
            handoffs_ns: vec![],
            elapsed: Duration::from_millis(1),
            idle_while_free: Duration::ZERO,
            kernel: String::new(),
        }
    }

    #[test]
    fn draws_one_line_per_mode() {
        let cells = [
            cell(BenchMode::Kernel(Mode::Poll), 1, 10),
            cell(BenchMode::Kernel(Mode::Poll), 64, 640),
            cell(BenchMode::Herdless, 1, 10),
            cell(BenchMode::Herdless, 64, 10),
        ];
        let s = svg(&cells, "Linux <test> & co");
        assert!(s.starts_with("<svg"));
        assert!(s.trim_end().ends_with("</svg>"));
        // Two panels × two modes.
        assert_eq!(s.matches("<polyline").count(), 4);
        assert!(s.contains("&lt;test&gt; &amp; co"));
        assert!(s.contains(">herdless</text>"));
        assert!(!s.contains("NaN") && !s.contains("inf"));
    }

    #[test]
    fn decades_cover_the_values() {
        assert_eq!(decades(1.0, 1.0), (1.0, 10.0));
        assert_eq!(decades(0.5, 300.0), (0.1, 1000.0));
        assert_eq!(decades(0.0, 0.0), (1.0, 10.0));
        assert_eq!(decades(f64::INFINITY, 0.0), (1.0, 10.0));
    }
}
