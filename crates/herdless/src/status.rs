//! The status document: what `herdless status` shows, what a client gets
//! for a `Status` request, and what the broker reports when it stops.
//!
//! The broker writes it as one JSON object ([`Status::to_json`]) without a
//! serialisation library, so the library an embedder links carries none.
//! With the `serde` feature the types also derive `serde::Deserialize` (and
//! `Serialize`), which is how the command-line tool and the benchmarks read
//! it back. A unit test checks that both agree.

use std::fmt::Write;

mod openmetrics;

/// The most client lines a status document lists. With more clients
/// connected, it lists those holding the most tokens, then those with the
/// most acquires waiting, and counts all of them in
/// [`Status::clients_total`], so the document stays a few tens of kilobytes
/// (far below a reply frame's limit) however many clients there are.
pub const MAX_STATUS_CLIENTS: usize = 256;

/// One client's line in a status report.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClientStatus {
    /// The broker's number for the connection (never reused while it runs).
    pub id: u64,
    /// The client's process id, from the kernel where it tells.
    pub pid: u32,
    /// What kind of client: `native`, `job` (a job of the runner above, such as
    /// `herdless exec`) or `classic` (the bridge's side of the pool).
    pub kind: String,
    /// Shared tokens the client holds now (a borrowed slot counts).
    pub held: u32,
    /// Acquires the client has waiting in the queue.
    pub waiting: u32,
}

/// The classic side of the pool: the pipe or fifo that make, cargo and
/// gcc read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClassicStatus {
    /// `pipe` (inherited `R,W`) or `fifo` (`fifo:PATH`).
    pub style: String,
    /// `gnu` or `bmake`: whose conventions the exported flags follow.
    pub flavor: String,
    /// Tokens on the classic side: in the pipe plus held by classic clients.
    pub tokens: u32,
    /// Tokens unread in the pipe.
    pub in_pipe: u32,
    /// Tokens classic clients have taken and not given back.
    pub held: u32,
    /// Tokens written into the pipe, in all.
    pub offered: u64,
    /// Tokens classic clients wrote back.
    pub returned: u64,
    /// Unread tokens the bridge read back out of the pipe for natives.
    pub taken_back: u64,
    /// At exit: classic tokens that never came back.
    pub lost: u32,
    /// The command at the top connected as a native client (the broker
    /// saw its process id).
    #[cfg_attr(feature = "serde", serde(default))]
    pub command_native: bool,
    /// A classic client was seen at work (read an offer, wrote a token
    /// back).
    #[cfg_attr(feature = "serde", serde(default))]
    pub classic_seen: bool,
    /// The bridge's back-off: after an offer nobody reads, the next comes
    /// 2^backoff − 1 rounds of native grants later.
    #[cfg_attr(feature = "serde", serde(default))]
    pub backoff: u32,
}

/// The whole pool at one moment.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Status {
    /// The broker's process id.
    pub pid: u32,
    /// The `-j` figure.
    pub jobs: u32,
    /// Shared tokens (`jobs - 1`).
    pub capacity: u32,
    /// Shared tokens nobody holds.
    pub free: u32,
    /// Tokens in use now, the top slot included.
    pub in_use: u32,
    /// Acquires waiting in the queue.
    pub waiting: u32,
    /// `"E"` or `"I"` once the tree has aborted.
    pub aborted: Option<String>,
    /// Tokens granted, in all (`immediate + waits`).
    pub grants: u64,
    /// Grants made at once, without a wait.
    pub immediate: u64,
    /// Grants made after a wait.
    pub waits: u64,
    /// Native clients woken to take a grant: one per grant that waited.
    pub wakeups: u64,
    /// Try-acquires refused because no token was free.
    pub denied: u64,
    /// Waiting acquires withdrawn by their client.
    pub cancelled: u64,
    /// Tokens taken back for a withdrawal that came after its grant was
    /// sent (`CancelNowait`): each went to the next waiter at once.
    #[cfg_attr(feature = "serde", serde(default))]
    pub raced_grants: u64,
    /// Tokens taken back from clients that closed while holding them.
    pub reclaimed: u64,
    /// Connections that completed the handshake, in all.
    pub connections: u64,
    /// Whether the broker has stopped granting (its command ended, or a
    /// stop signal came).
    #[cfg_attr(feature = "serde", serde(default))]
    pub stopped: bool,
    /// Acquires refused because the broker had stopped.
    #[cfg_attr(feature = "serde", serde(default))]
    pub refused_after_stop: u64,
    /// Clients turned away to leave the process the broker runs in the
    /// descriptors it keeps free
    /// ([`crate::broker::Stopper::keep_fds_free`]).
    #[cfg_attr(feature = "serde", serde(default))]
    pub refused_no_room: u64,
    /// Tokens clients still held when the broker closed them at shutdown.
    #[cfg_attr(feature = "serde", serde(default))]
    pub held_at_shutdown: u64,
    /// Slots (implicit tokens of job runners) the broker knows now.
    #[cfg_attr(feature = "serde", serde(default))]
    pub slots: u32,
    /// The most tokens in use at once (the top slot included).
    pub max_in_use: u32,
    /// Median wait of the grants that waited, in microseconds.
    pub wait_p50_us: f64,
    /// 99th percentile of those waits, in microseconds.
    pub wait_p99_us: f64,
    /// The longest of those waits, in microseconds.
    pub wait_max_us: f64,
    /// Tokens the broker cannot account for, classic ones included. Must
    /// be 0.
    pub lost: i64,
    /// One line per connected client, at most [`MAX_STATUS_CLIENTS`] of
    /// them (see [`Status::list_clients`]), in connection order.
    pub clients: Vec<ClientStatus>,
    /// Connected clients (observers excepted), listed or not.
    #[cfg_attr(feature = "serde", serde(default))]
    pub clients_total: u64,
    /// Connections accepted that have not yet sent their `Hello`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub handshaking: u32,
    /// The classic bridge, when there is one.
    #[cfg_attr(feature = "serde", serde(default))]
    pub classic: Option<ClassicStatus>,
    /// Admission limits, caps and a pending shrink (`None` from a broker
    /// that predates them).
    #[cfg_attr(feature = "serde", serde(default))]
    pub controls: Option<ControlsStatus>,
    /// The waits of native grants, bucketed (`None` from a broker that
    /// predates it).
    #[cfg_attr(feature = "serde", serde(default))]
    pub wait_histogram: Option<WaitHistogram>,
    /// The shared token table, when the broker has one.
    #[cfg_attr(feature = "serde", serde(default))]
    pub fast: Option<FastStatus>,
    /// Voluntary context switches of the broker's own thread so far: each
    /// is one sleep of its event loop, so one wake-up (`None` where the
    /// OS does not count them per thread). Apart from the host's threads
    /// when the broker runs inside a program (a make that started it).
    #[cfg_attr(feature = "serde", serde(default))]
    pub broker_vcsw: Option<u64>,
}

/// The shared token table (the fast path for native clients on the host).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct FastStatus {
    /// Whether clients may take tokens from it now.
    pub open: bool,
    /// Clients that map it.
    pub clients: u64,
    /// Tokens lent to it now (free or held there).
    pub lent: u32,
    /// Of those, free.
    pub free: u32,
    /// Of those, held by its clients.
    pub held: u32,
    /// Tokens taken from it by its clients (counted in `grants`).
    pub grants: u64,
    /// Tokens lent to it over the broker's life.
    pub lends: u64,
    /// Tokens freed in it from connections that closed holding them
    /// (counted in `reclaimed`).
    pub reclaimed: u64,
    /// Clients cut off for holding a word the broker never lent.
    pub cut_off: u64,
    /// Whether clients wait in the table, each token handed by its giver
    /// straight to the oldest waiter.
    #[cfg_attr(feature = "serde", serde(default))]
    pub handoff: bool,
    /// Clients waiting in the table now (counted in `waiting`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub waiting: u32,
    /// Waits in the table moved to the broker's queue when it closed.
    #[cfg_attr(feature = "serde", serde(default))]
    pub moved: u64,
}

/// What the operator controls: admission by load and memory, caps per
/// process subtree, and a shrink still waiting for tokens.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ControlsStatus {
    /// `open`, or why grants are held back (`load 5.20 above 4`).
    pub admission: String,
    /// `--max-load`, when set.
    pub max_load: Option<f64>,
    /// The 1-minute load average last sampled (when a load limit is set).
    pub load: Option<f64>,
    /// `--min-free-memory` in bytes, when set.
    pub min_free_memory: Option<u64>,
    /// Memory available last sampled, in bytes (when a memory limit is set).
    pub free_memory: Option<u64>,
    /// `--min-jobs`: jobs that may run whatever the limits say.
    pub min_jobs: u32,
    /// How many times admission closed.
    pub held_back: u64,
    /// Shared tokens a shrink still waits for.
    pub retiring: u32,
    /// Caps in force.
    pub caps: Vec<CapStatus>,
}

/// One cap: the subtree of `pid` holds at most `max` shared tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct CapStatus {
    /// The process whose subtree is capped.
    pub pid: u32,
    /// The most shared tokens at once.
    pub max: u32,
    /// Shared tokens the subtree holds now.
    pub held: u32,
}

/// Waits of native grants by upper bound, cumulative (as an OpenMetrics
/// histogram has them).
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WaitHistogram {
    /// Upper bounds in microseconds, ascending; the last bucket (`+Inf`)
    /// is `count`.
    pub le_us: Vec<f64>,
    /// Waits at most each bound.
    pub cumulative: Vec<u64>,
    /// Waits in all.
    pub count: u64,
    /// The sum of every wait, in microseconds.
    pub sum_us: f64,
}

impl WaitHistogram {
    /// Upper bounds, in nanoseconds: 10 µs to 10 s by powers of ten.
    const BOUNDS_NS: [u64; 7] = [
        10_000,
        100_000,
        1_000_000,
        10_000_000,
        100_000_000,
        1_000_000_000,
        10_000_000_000,
    ];

    /// The buckets of a histogram of nanoseconds.
    pub fn of(h: &crate::stats::Histogram) -> WaitHistogram {
        WaitHistogram {
            le_us: Self::BOUNDS_NS.iter().map(|&b| b as f64 / 1000.0).collect(),
            cumulative: Self::BOUNDS_NS
                .iter()
                .map(|&b| h.count_at_most(b))
                .collect(),
            count: h.count(),
            sum_us: h.sum() as f64 / 1000.0,
        }
    }
}

impl Status {
    /// The document as one line of JSON, the form the broker sends.
    pub fn to_json(&self) -> String {
        let mut o = Object::new();
        o.num("pid", self.pid);
        o.num("jobs", self.jobs);
        o.num("capacity", self.capacity);
        o.num("free", self.free);
        o.num("in_use", self.in_use);
        o.num("waiting", self.waiting);
        match &self.aborted {
            Some(r) => o.str("aborted", r),
            None => o.raw("aborted", "null"),
        }
        o.num("grants", self.grants);
        o.num("immediate", self.immediate);
        o.num("waits", self.waits);
        o.num("wakeups", self.wakeups);
        o.num("denied", self.denied);
        o.num("cancelled", self.cancelled);
        o.num("raced_grants", self.raced_grants);
        o.num("reclaimed", self.reclaimed);
        o.num("connections", self.connections);
        o.raw("stopped", if self.stopped { "true" } else { "false" });
        o.num("refused_after_stop", self.refused_after_stop);
        o.num("refused_no_room", self.refused_no_room);
        o.num("held_at_shutdown", self.held_at_shutdown);
        o.num("slots", self.slots);
        o.num("max_in_use", self.max_in_use);
        o.float("wait_p50_us", self.wait_p50_us);
        o.float("wait_p99_us", self.wait_p99_us);
        o.float("wait_max_us", self.wait_max_us);
        o.num("lost", self.lost);
        let clients: Vec<String> = self.clients.iter().map(ClientStatus::to_json).collect();
        o.raw("clients", &format!("[{}]", clients.join(",")));
        o.num("clients_total", self.clients_total);
        o.num("handshaking", self.handshaking);
        match &self.classic {
            Some(c) => o.raw("classic", &c.to_json()),
            None => o.raw("classic", "null"),
        }
        match &self.controls {
            Some(c) => o.raw("controls", &c.to_json()),
            None => o.raw("controls", "null"),
        }
        match &self.wait_histogram {
            Some(h) => o.raw("wait_histogram", &h.to_json()),
            None => o.raw("wait_histogram", "null"),
        }
        match &self.fast {
            Some(f) => {
                let mut t = Object::new();
                t.raw("open", if f.open { "true" } else { "false" });
                t.num("clients", f.clients);
                t.num("lent", f.lent);
                t.num("free", f.free);
                t.num("held", f.held);
                t.num("grants", f.grants);
                t.num("lends", f.lends);
                t.num("reclaimed", f.reclaimed);
                t.num("cut_off", f.cut_off);
                t.raw("handoff", if f.handoff { "true" } else { "false" });
                t.num("waiting", f.waiting);
                t.num("moved", f.moved);
                o.raw("fast", &t.finish());
            }
            None => o.raw("fast", "null"),
        }
        o.opt_num("broker_vcsw", self.broker_vcsw);
        o.finish()
    }
}

impl ControlsStatus {
    fn to_json(&self) -> String {
        let mut o = Object::new();
        o.str("admission", &self.admission);
        o.opt_float("max_load", self.max_load);
        o.opt_float("load", self.load);
        o.opt_num("min_free_memory", self.min_free_memory);
        o.opt_num("free_memory", self.free_memory);
        o.num("min_jobs", self.min_jobs);
        o.num("held_back", self.held_back);
        o.num("retiring", self.retiring);
        let caps: Vec<String> = self
            .caps
            .iter()
            .map(|c| {
                let mut o = Object::new();
                o.num("pid", c.pid);
                o.num("max", c.max);
                o.num("held", c.held);
                o.finish()
            })
            .collect();
        o.raw("caps", &format!("[{}]", caps.join(",")));
        o.finish()
    }
}

impl WaitHistogram {
    fn to_json(&self) -> String {
        let mut o = Object::new();
        let le: Vec<String> = self.le_us.iter().map(|v| format!("{v:?}")).collect();
        o.raw("le_us", &format!("[{}]", le.join(",")));
        let c: Vec<String> = self.cumulative.iter().map(u64::to_string).collect();
        o.raw("cumulative", &format!("[{}]", c.join(",")));
        o.num("count", self.count);
        o.float("sum_us", self.sum_us);
        o.finish()
    }
}

impl Status {
    /// Chooses the client lines to list out of `all`: every one when they
    /// are at most [`MAX_STATUS_CLIENTS`], else those holding the most
    /// tokens, then those waiting for the most, then the oldest. Returns
    /// them in connection order with the count of all.
    pub fn list_clients(mut all: Vec<ClientStatus>) -> (Vec<ClientStatus>, u64) {
        let total = all.len() as u64;
        if all.len() > MAX_STATUS_CLIENTS {
            all.select_nth_unstable_by_key(MAX_STATUS_CLIENTS - 1, |c| {
                (
                    std::cmp::Reverse(c.held),
                    std::cmp::Reverse(c.waiting),
                    c.id,
                )
            });
            all.truncate(MAX_STATUS_CLIENTS);
        }
        all.sort_unstable_by_key(|c| c.id);
        (all, total)
    }
}

impl ClientStatus {
    fn to_json(&self) -> String {
        let mut o = Object::new();
        o.num("id", self.id);
        o.num("pid", self.pid);
        o.str("kind", &self.kind);
        o.num("held", self.held);
        o.num("waiting", self.waiting);
        o.finish()
    }
}

impl ClassicStatus {
    fn to_json(&self) -> String {
        let mut o = Object::new();
        o.str("style", &self.style);
        o.str("flavor", &self.flavor);
        o.num("tokens", self.tokens);
        o.num("in_pipe", self.in_pipe);
        o.num("held", self.held);
        o.num("offered", self.offered);
        o.num("returned", self.returned);
        o.num("taken_back", self.taken_back);
        o.num("lost", self.lost);
        o.raw("command_native", bool_str(self.command_native));
        o.raw("classic_seen", bool_str(self.classic_seen));
        o.num("backoff", self.backoff);
        o.finish()
    }
}

/// A JSON object written field by field.
struct Object {
    out: String,
}

impl Object {
    fn new() -> Object {
        Object {
            out: String::from("{"),
        }
    }

    fn key(&mut self, key: &str) {
        if self.out.len() > 1 {
            self.out.push(',');
        }
        push_string(&mut self.out, key);
        self.out.push(':');
    }

    fn raw(&mut self, key: &str, value: &str) {
        self.key(key);
        self.out.push_str(value);
    }

    fn num(&mut self, key: &str, value: impl Into<i128>) {
        self.key(key);
        let _ = write!(self.out, "{}", value.into());
    }

    /// A finite number; JSON has no infinity or NaN, and the figures
    /// written here (quantiles of a histogram) never are.
    fn float(&mut self, key: &str, value: f64) {
        self.key(key);
        if value.is_finite() {
            let _ = write!(self.out, "{value:?}");
        } else {
            self.out.push_str("null");
        }
    }

    fn opt_float(&mut self, key: &str, value: Option<f64>) {
        match value {
            Some(v) => self.float(key, v),
            None => self.raw(key, "null"),
        }
    }

    fn opt_num(&mut self, key: &str, value: Option<u64>) {
        match value {
            Some(v) => self.num(key, v),
            None => self.raw(key, "null"),
        }
    }

    fn str(&mut self, key: &str, value: &str) {
        self.key(key);
        push_string(&mut self.out, value);
    }

    fn finish(mut self) -> String {
        self.out.push('}');
        self.out
    }
}

fn bool_str(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

/// `s` as a JSON string literal.
fn push_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(classic: bool) -> Status {
        Status {
            pid: 42,
            jobs: 4,
            capacity: 3,
            free: 1,
            in_use: 3,
            waiting: 2,
            aborted: Some("E".into()),
            grants: 10,
            immediate: 4,
            waits: 6,
            wakeups: 6,
            denied: 1,
            cancelled: 0,
            raced_grants: 1,
            reclaimed: 2,
            connections: 7,
            stopped: true,
            refused_after_stop: 3,
            refused_no_room: 2,
            held_at_shutdown: 1,
            slots: 2,
            max_in_use: 4,
            wait_p50_us: 251.7,
            wait_p99_us: 0.0,
            wait_max_us: 1e-3,
            lost: -1,
            clients: vec![ClientStatus {
                id: 1,
                pid: 99,
                kind: "na\"ti\\ve\n\u{1}é".into(),
                held: 1,
                waiting: 2,
            }],
            clients_total: 1,
            handshaking: 3,
            classic: classic.then(|| ClassicStatus {
                style: "fifo".into(),
                flavor: "gnu".into(),
                tokens: 2,
                in_pipe: 1,
                held: 1,
                offered: 5,
                returned: 3,
                taken_back: 1,
                lost: 0,
                command_native: true,
                classic_seen: false,
                backoff: 2,
            }),
            controls: classic.then(|| ControlsStatus {
                admission: "load 5.5 above 4".into(),
                max_load: Some(4.0),
                load: Some(5.5),
                min_free_memory: None,
                free_memory: None,
                min_jobs: 1,
                held_back: 2,
                retiring: 1,
                caps: vec![CapStatus {
                    pid: 7,
                    max: 2,
                    held: 1,
                }],
            }),
            fast: classic.then_some(FastStatus {
                open: true,
                clients: 2,
                lent: 3,
                free: 1,
                held: 2,
                grants: 40,
                lends: 5,
                reclaimed: 1,
                cut_off: 0,
                handoff: true,
                waiting: 1,
                moved: 2,
            }),
            broker_vcsw: classic.then_some(17),
            wait_histogram: classic.then(|| WaitHistogram {
                le_us: vec![10.0, 100.0],
                cumulative: vec![1, 3],
                count: 4,
                sum_us: 12.5,
            }),
        }
    }

    #[test]
    fn json_is_valid_and_complete() {
        for classic in [false, true] {
            let s = sample(classic);
            let v: serde_json::Value = serde_json::from_str(&s.to_json()).expect("valid JSON");
            assert_eq!(v["pid"], 42);
            assert_eq!(v["lost"], -1);
            assert_eq!(v["aborted"], "E");
            assert_eq!(v["wait_p50_us"], 251.7);
            assert_eq!(v["clients"][0]["kind"], "na\"ti\\ve\n\u{1}é");
            assert_eq!(v["classic"].is_null(), !classic);
            if classic {
                assert_eq!(v["classic"]["taken_back"], 1);
                assert_eq!(v["classic"]["command_native"], true);
                assert_eq!(v["classic"]["classic_seen"], false);
                assert_eq!(v["classic"]["backoff"], 2);
            }
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_reads_what_the_broker_writes() {
        for classic in [false, true] {
            let s = sample(classic);
            let back: Status = serde_json::from_str(&s.to_json()).expect("deserializes");
            assert_eq!(back, s);
        }
    }

    #[test]
    fn a_status_of_any_number_of_clients_fits_a_reply() {
        let all: Vec<ClientStatus> = (0..20_000u64)
            .map(|i| ClientStatus {
                id: u64::MAX - i,
                pid: u32::MAX,
                kind: "observer".into(),
                held: if i % 1000 == 7 { u32::MAX } else { 0 },
                waiting: if i % 500 == 3 { u32::MAX } else { 0 },
            })
            .collect();
        let (listed, total) = Status::list_clients(all);
        assert_eq!(total, 20_000);
        assert_eq!(listed.len(), MAX_STATUS_CLIENTS);
        // The holders and the waiters are all listed.
        assert_eq!(listed.iter().filter(|c| c.held > 0).count(), 20);
        assert_eq!(listed.iter().filter(|c| c.waiting > 0).count(), 40);
        assert!(listed.windows(2).all(|w| w[0].id < w[1].id));
        let mut s = sample(true);
        s.clients = listed;
        s.clients_total = total;
        let json = s.to_json();
        assert!(
            json.len() < crate::protocol::MAX_REPLY_PAYLOAD / 16,
            "{}",
            json.len()
        );
        let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
        assert_eq!(v["clients_total"], 20_000);
    }

    #[test]
    fn a_non_finite_figure_is_null() {
        let mut s = sample(false);
        s.wait_max_us = f64::INFINITY;
        let v: serde_json::Value = serde_json::from_str(&s.to_json()).expect("valid JSON");
        assert!(v["wait_max_us"].is_null());
    }
}
