//! The status document as OpenMetrics text (`herdless status --format
//! openmetrics`), for Prometheus and other scrapers.
//!
//! Names follow the OpenMetrics conventions: a `herdless_` prefix, the
//! unit as a suffix (`_seconds`, `_bytes`) with a `# UNIT` line, counters
//! sampled as `NAME_total`, the wait histogram as cumulative `_bucket`
//! samples ending in `le="+Inf"` with `_count` and `_sum`, and `# EOF` last.

use std::fmt::Write;

use super::Status;

/// One metric family being written.
struct Out {
    text: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, unit: Option<&str>, help: &str) {
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
        if let Some(unit) = unit {
            let _ = writeln!(self.text, "# UNIT {name} {unit}");
        }
        let _ = writeln!(self.text, "# HELP {name} {help}");
    }

    fn gauge(&mut self, name: &str, unit: Option<&str>, help: &str, value: impl Into<f64>) {
        self.family(name, "gauge", unit, help);
        let _ = writeln!(self.text, "{name} {}", number(value.into()));
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.family(name, "counter", None, help);
        let _ = writeln!(self.text, "{name}_total {value}");
    }
}

/// A float as OpenMetrics writes one: integers without a fraction,
/// infinities as `+Inf`/`-Inf`, NaN as `NaN`.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

impl Status {
    /// The report as an OpenMetrics text exposition, ending in `# EOF`.
    pub fn to_openmetrics(&self) -> String {
        let mut o = Out {
            text: String::new(),
        };
        o.gauge(
            "herdless_jobs",
            None,
            "The -j figure: jobs allowed at once.",
            self.jobs,
        );
        o.gauge(
            "herdless_tokens_free",
            None,
            "Shared tokens nobody holds.",
            self.free,
        );
        o.gauge(
            "herdless_tokens_in_use",
            None,
            "Tokens running jobs now, slots included.",
            self.in_use,
        );
        o.gauge(
            "herdless_tokens_max_in_use",
            None,
            "The most tokens in use at once so far.",
            self.max_in_use,
        );
        o.gauge(
            "herdless_waiters",
            None,
            "Acquires waiting in the queue.",
            self.waiting,
        );
        o.gauge(
            "herdless_clients",
            None,
            "Connected clients that take tokens.",
            self.clients_total.max(self.clients.len() as u64) as f64,
        );
        o.counter("herdless_grants", "Tokens granted.", self.grants);
        o.counter(
            "herdless_waits",
            "Grants made after the client waited in the queue.",
            self.waits,
        );
        o.counter(
            "herdless_wakeups",
            "Native clients woken to take a grant, one per grant that waited.",
            self.wakeups,
        );
        o.counter(
            "herdless_denied",
            "Try-acquires refused because no token was free.",
            self.denied,
        );
        o.counter(
            "herdless_tokens_reclaimed",
            "Tokens taken back from clients that closed while holding them.",
            self.reclaimed,
        );
        o.counter(
            "herdless_connections",
            "Connections that completed the handshake.",
            self.connections,
        );
        if let Some(n) = self.broker_vcsw {
            o.counter(
                "herdless_broker_wakeups",
                "Voluntary context switches of the broker's own thread: one per wake-up of its event loop.",
                n,
            );
        }
        o.gauge(
            "herdless_tokens_lost",
            None,
            "Tokens the broker cannot account for (classic ones included); 0 when all is well.",
            self.lost as f64,
        );
        if let Some(h) = &self.wait_histogram {
            let name = "herdless_wait_seconds";
            o.family(
                name,
                "histogram",
                Some("seconds"),
                "How long native grants waited in the queue.",
            );
            for (le, n) in h.le_us.iter().zip(&h.cumulative) {
                let _ = writeln!(
                    o.text,
                    "{name}_bucket{{le=\"{}\"}} {n}",
                    number_le(le / 1e6)
                );
            }
            let _ = writeln!(o.text, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(o.text, "{name}_count {}", h.count);
            let _ = writeln!(o.text, "{name}_sum {}", number(h.sum_us / 1e6));
        }
        if let Some(c) = &self.controls {
            o.gauge(
                "herdless_admission_open",
                None,
                "1 while no load or memory limit holds grants back, else 0.",
                if c.admission == "open" { 1.0 } else { 0.0 },
            );
            o.counter(
                "herdless_admission_held",
                "Times a load or memory limit started holding grants back.",
                c.held_back,
            );
            if let Some(load) = c.load {
                o.gauge(
                    "herdless_load_average",
                    None,
                    "The 1-minute load average last sampled.",
                    load,
                );
            }
            if let Some(bytes) = c.free_memory {
                o.gauge(
                    "herdless_memory_available_bytes",
                    Some("bytes"),
                    "Memory available last sampled.",
                    bytes as f64,
                );
            }
            o.gauge(
                "herdless_tokens_retiring",
                None,
                "Shared tokens a shrink still waits for.",
                c.retiring,
            );
            if !c.caps.is_empty() {
                let name = "herdless_cap_tokens";
                o.family(
                    name,
                    "gauge",
                    None,
                    "Shared tokens a capped process subtree may hold.",
                );
                for cap in &c.caps {
                    let _ = writeln!(o.text, "{name}{{pid=\"{}\"}} {}", cap.pid, cap.max);
                }
                let name = "herdless_cap_held_tokens";
                o.family(
                    name,
                    "gauge",
                    None,
                    "Shared tokens a capped process subtree holds now.",
                );
                for cap in &c.caps {
                    let _ = writeln!(o.text, "{name}{{pid=\"{}\"}} {}", cap.pid, cap.held);
                }
            }
        }
        if let Some(c) = &self.classic {
            o.gauge(
                "herdless_classic_tokens_held",
                None,
                "Tokens classic clients have taken from the pipe and not given back.",
                c.held,
            );
            o.counter(
                "herdless_classic_offered",
                "Tokens written into the classic pipe.",
                c.offered,
            );
            o.counter(
                "herdless_classic_returned",
                "Tokens classic clients wrote back.",
                c.returned,
            );
        }
        o.text.push_str("# EOF\n");
        o.text
    }
}

/// A bucket bound: always with a fraction or exponent, as the
/// OpenMetrics canonical form of `le` wants (`1.0`, not `1`).
fn number_le(v: f64) -> String {
    let s = format!("{v:?}");
    if s.contains(['.', 'e', 'E']) {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use crate::status::{Status, WaitHistogram};

    #[test]
    fn exposition_ends_in_eof_and_counters_in_total() {
        let mut s = Status {
            pid: 1,
            jobs: 4,
            capacity: 3,
            free: 3,
            in_use: 0,
            waiting: 0,
            aborted: None,
            grants: 5,
            immediate: 2,
            waits: 3,
            wakeups: 3,
            denied: 0,
            cancelled: 0,
            raced_grants: 0,
            reclaimed: 0,
            connections: 2,
            stopped: false,
            refused_after_stop: 0,
            refused_no_room: 0,
            held_at_shutdown: 0,
            slots: 1,
            max_in_use: 3,
            wait_p50_us: 0.0,
            wait_p99_us: 0.0,
            wait_max_us: 0.0,
            lost: 0,
            clients: vec![],
            clients_total: 0,
            handshaking: 0,
            classic: None,
            controls: None,
            wait_histogram: None,
            fast: None,
            broker_vcsw: Some(9),
        };
        s.wait_histogram = Some(WaitHistogram {
            le_us: vec![10.0, 1e6],
            cumulative: vec![1, 3],
            count: 3,
            sum_us: 1500.0,
        });
        let text = s.to_openmetrics();
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert!(text.contains("\nherdless_grants_total 5\n"), "{text}");
        assert!(
            text.contains("herdless_wait_seconds_bucket{le=\"1e-5\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("herdless_wait_seconds_bucket{le=\"1.0\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("herdless_wait_seconds_bucket{le=\"+Inf\"} 3"),
            "{text}"
        );
        assert!(text.contains("herdless_wait_seconds_sum 0.0015"), "{text}");
    }
}
