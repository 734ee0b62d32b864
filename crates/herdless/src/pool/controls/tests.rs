//! Resize, caps and admission: unit tests and a property test that
//! interleaves them with every other pool event.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use crate::pool::test_support::native;
use crate::pool::{ClientId, ClientInfo, Effect, Pool, SlotKey, Source};
use crate::protocol::AbortReason;

fn grants(effects: &[Effect]) -> Vec<ClientId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Grant { client, .. } => Some(*client),
            _ => None,
        })
        .collect()
}

const NOW: Duration = Duration::ZERO;

#[test]
fn a_shrink_takes_free_tokens_at_once_and_held_ones_as_they_return() {
    let mut p = Pool::new(4);
    let a = p.connect(native(10));
    for _ in 0..3 {
        p.acquire(a, NOW).unwrap();
    }
    assert_eq!(p.free(), 1);
    p.resize(1, NOW);
    // The free one at once; two of a's three when they come back.
    assert_eq!((p.capacity(), p.free(), p.retiring()), (1, 0, 2));
    assert_eq!(p.held_by(a), Some(3), "nothing taken from a holder");
    let b = p.connect(native(11));
    p.acquire(b, NOW).unwrap();
    p.take_effects();
    p.release(a, NOW).unwrap();
    p.release(a, NOW).unwrap();
    assert!(grants(&p.take_effects()).is_empty(), "retired, not granted");
    assert_eq!((p.free(), p.retiring(), p.shared_in_use()), (0, 0, 1));
    p.release(a, NOW).unwrap();
    assert_eq!(grants(&p.take_effects()), vec![b]);
    p.check_invariants().unwrap();
}

#[test]
fn a_grow_cancels_a_pending_shrink_first_then_grants() {
    let mut p = Pool::new(2);
    let a = p.connect(native(10));
    p.acquire(a, NOW).unwrap();
    p.acquire(a, NOW).unwrap();
    p.resize(0, NOW);
    assert_eq!(p.retiring(), 2);
    let b = p.connect(native(11));
    p.acquire(b, NOW).unwrap();
    p.take_effects();
    p.resize(3, NOW);
    assert_eq!((p.retiring(), p.free()), (0, 0));
    assert_eq!(grants(&p.take_effects()), vec![b]);
    p.check_invariants().unwrap();
}

#[test]
fn a_backed_grow_cancels_a_pending_shrink_and_adds_no_token() {
    // A backed pool of three tokens, all held by a.
    let mut p = Pool::new(3);
    let a = p.connect(native(10));
    for _ in 0..3 {
        p.acquire(a, NOW).unwrap();
    }
    p.bound_backed(0, NOW);
    assert_eq!((p.capacity(), p.retiring()), (0, 3));
    p.release(a, NOW).unwrap();
    assert_eq!((p.capacity(), p.retiring(), p.free()), (0, 2, 0));
    let b = p.connect(native(11));
    p.acquire(b, NOW).unwrap();
    p.take_effects();
    assert!(!p.short_of_shared(), "a shrink still waits for tokens");
    // Up to one token: one of a's stays in the pool, one still retires.
    p.bound_backed(1, NOW);
    assert_eq!((p.capacity(), p.retiring(), p.free()), (1, 1, 0));
    // Up to three: the shrink is off, and b waits for a token the
    // backing adds, not one the pool makes up.
    p.bound_backed(3, NOW);
    assert_eq!((p.capacity(), p.retiring(), p.free()), (2, 0, 0));
    assert!(grants(&p.take_effects()).is_empty());
    assert!(p.short_of_shared(), "b may be served by a new token");
    // Down again, below what is held: a shrink as `resize` makes it.
    p.bound_backed(1, NOW);
    assert_eq!((p.capacity(), p.retiring(), p.free()), (1, 1, 0));
    p.check_invariants().unwrap();
}

#[test]
fn a_cap_holds_for_a_subtree_and_passes_capped_waiters_over() {
    let mut p = Pool::new(4);
    // 20 is the capped process; 21 its child, 22 its grandchild; 30 apart.
    let a = p.connect(native(21));
    p.set_ancestry(a, vec![20, 1]);
    let b = p.connect(native(22));
    p.set_ancestry(b, vec![21, 20, 1]);
    let c = p.connect(native(30));
    p.set_ancestry(c, vec![1]);
    p.set_cap(20, Some(2), NOW);
    p.acquire(a, NOW).unwrap();
    p.acquire(b, NOW).unwrap();
    p.acquire(b, NOW).unwrap(); // capped: waits though 2 tokens are free
    assert_eq!(grants(&p.take_effects()), vec![a, b]);
    assert_eq!(p.waiting(), 1);
    p.acquire(c, NOW).unwrap(); // not capped: passes the capped waiter
    assert_eq!(grants(&p.take_effects()), vec![c]);
    p.check_invariants().unwrap();
    p.release(a, NOW).unwrap(); // the subtree drops to 1: b's waiter goes
    assert_eq!(grants(&p.take_effects()), vec![b]);
    assert_eq!(
        p.caps(),
        vec![super::Cap {
            pid: 20,
            max: 2,
            held: 2
        }]
    );
    p.check_invariants().unwrap();
}

#[test]
fn waiters_a_cap_holds_back_are_not_counted_as_grantable() {
    let mut p = Pool::new(2);
    let a = p.connect(native(21));
    p.set_ancestry(a, vec![20, 1]);
    let b = p.connect(native(22));
    p.set_ancestry(b, vec![20, 1]);
    let c = p.connect(native(30));
    p.set_ancestry(c, vec![1]);
    let d = p.connect(native(31));
    p.set_ancestry(d, vec![1]);
    p.set_cap(20, Some(1), NOW);
    p.acquire(a, NOW).unwrap();
    p.acquire(b, NOW).unwrap(); // capped: waits
    p.acquire(c, NOW).unwrap();
    p.acquire(d, NOW).unwrap(); // no token left: waits
    assert_eq!(grants(&p.take_effects()), vec![a, c]);
    assert_eq!(p.waiting(), 2);
    assert_eq!(p.waiting_grantable(None), 1, "d only");
    assert_eq!(p.waiting_grantable(Some(d)), 0);
    p.release(a, NOW).unwrap(); // the subtree drops to 0: b's waiter goes
    assert_eq!(grants(&p.take_effects()), vec![b]);
    assert_eq!(p.waiting_grantable(None), 1);
    p.set_cap(20, None, NOW);
    assert_eq!(p.waiting_grantable(None), 1);
    p.check_invariants().unwrap();
}

#[test]
fn lifting_a_cap_grants_to_the_waiters_it_held_back() {
    let mut p = Pool::new(3);
    let a = p.connect(native(20));
    p.set_cap(20, Some(0), NOW);
    p.acquire(a, NOW).unwrap();
    assert!(grants(&p.take_effects()).is_empty());
    p.set_cap(20, None, NOW);
    assert_eq!(grants(&p.take_effects()), vec![a]);
}

#[test]
fn held_admission_grants_only_below_the_floor() {
    let mut p = Pool::new(4);
    let a = p.connect(native(10));
    p.set_admission(false, 1, NOW);
    p.acquire(a, NOW).unwrap();
    p.acquire(a, NOW).unwrap();
    assert_eq!(grants(&p.take_effects()), vec![a], "the floor: one in use");
    assert!(p.held_by_admission());
    p.check_invariants().unwrap();
    p.set_admission(true, 1, NOW);
    assert_eq!(grants(&p.take_effects()), vec![a]);
    assert!(!p.held_by_admission());
}

#[test]
fn slots_are_never_held_back() {
    let mut p = Pool::new(0);
    assert!(p.add_slot(SlotKey::Minted(10), None, true));
    let j = p.connect(ClientInfo {
        pid: 11,
        borrows: Some(SlotKey::Minted(10)),
        label: "native",
        ..ClientInfo::default()
    });
    p.set_admission(false, 0, NOW);
    p.set_cap(11, Some(0), NOW);
    p.acquire(j, NOW).unwrap();
    assert!(matches!(
        p.take_effects().as_slice(),
        [Effect::Grant {
            source: Source::Slot,
            ..
        }]
    ));
}

#[test]
fn the_top_slot_counts_against_a_cap() {
    // Under `serve`, jobs that name no runner borrow the top slot, the
    // N-th token: it must not let a capped subtree run one job more.
    const TOP: SlotKey = SlotKey::Minted(0x70b);
    let mut p = Pool::new(4);
    assert!(p.add_slot(TOP, None, true));
    let top_job = |p: &mut Pool, pid| {
        let id = p.connect(ClientInfo {
            pid,
            borrows: Some(TOP),
            label: "native",
            ..ClientInfo::default()
        });
        p.set_ancestry(id, vec![20, 1]);
        id
    };
    let a = top_job(&mut p, 21);
    let b = top_job(&mut p, 22);
    p.set_cap(20, Some(1), NOW);
    p.acquire(a, NOW).unwrap(); // the top slot
    p.acquire(b, NOW).unwrap(); // capped: neither a shared token nor a slot
    assert_eq!(grants(&p.take_effects()), vec![a]);
    assert_eq!(p.waiting(), 1);
    p.check_invariants().unwrap();
    p.release(a, NOW).unwrap(); // the subtree drops to 0: b goes
    assert_eq!(grants(&p.take_effects()), vec![b]);
    p.release(b, NOW).unwrap();
    // Held back from the slot while a shared token holds the subtree at
    // its cap, lent it as soon as that token comes back.
    let c = p.connect(native(23));
    p.set_ancestry(c, vec![20, 1]);
    p.acquire(c, NOW).unwrap();
    p.acquire(a, NOW).unwrap();
    assert_eq!(grants(&p.take_effects()), vec![c]);
    p.check_invariants().unwrap();
    p.release(c, NOW).unwrap();
    assert_eq!(grants(&p.take_effects()), vec![a]);
    p.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    /// A client of pid 100 + n, child of the process `parent` picks (one of
    /// the live clients, or the outside process 1).
    Connect {
        parent: usize,
        job: bool,
    },
    Acquire(usize),
    TryAcquire(usize),
    Cancel(usize),
    Release(usize),
    Disconnect(usize),
    Resize(u32),
    /// Cap the subtree of a live client's pid (`None`: lift it).
    Cap(usize, Option<u32>),
    Admission {
        open: bool,
        floor: u32,
    },
    Abort(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (any::<usize>(), any::<bool>()).prop_map(|(parent, job)| Op::Connect { parent, job }),
        6 => any::<usize>().prop_map(Op::Acquire),
        1 => any::<usize>().prop_map(Op::TryAcquire),
        1 => any::<usize>().prop_map(Op::Cancel),
        6 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Disconnect),
        2 => (0u32..6).prop_map(Op::Resize),
        2 => (any::<usize>(), proptest::option::of(0u32..3)).prop_map(|(i, m)| Op::Cap(i, m)),
        2 => (any::<bool>(), 0u32..3).prop_map(|(open, floor)| Op::Admission { open, floor }),
        1 => (0u8..30).prop_map(|n| Op::Abort(n == 0)),
    ]
}

/// The test's own picture, built from the operations and the effects.
#[derive(Default)]
struct Model {
    live: Vec<ClientId>,
    pid: HashMap<ClientId, u32>,
    ancestors: HashMap<ClientId, Vec<u32>>,
    /// Shared tokens held by each client (slots apart).
    held: HashMap<ClientId, u32>,
    /// Whether each client holds a slot.
    slot: HashMap<ClientId, bool>,
    queue: Vec<ClientId>,
    capacity: u32,
    retiring: u32,
    caps: HashMap<u32, u32>,
    open: bool,
    floor: u32,
}

impl Model {
    fn pick(&self, i: usize) -> Option<ClientId> {
        (!self.live.is_empty()).then(|| self.live[i % self.live.len()])
    }
    fn in_subtree(&self, id: ClientId, pid: u32) -> bool {
        self.pid[&id] == pid || self.ancestors[&id].contains(&pid)
    }
    fn subtree_held(&self, pid: u32) -> u32 {
        self.live
            .iter()
            .filter(|&&c| self.in_subtree(c, pid))
            .map(|c| self.held[c] + u32::from(self.slot[c]))
            .sum()
    }
    fn in_use(&self) -> u32 {
        self.held.values().sum()
    }
    fn eligible(&self, id: ClientId) -> bool {
        (self.open || self.in_use() < self.floor)
            && self
                .caps
                .iter()
                .all(|(&pid, &max)| !self.in_subtree(id, pid) || self.subtree_held(pid) < max)
    }
    /// A shared token came back: a shrink takes it first.
    fn returned(&mut self, n: u32) {
        let retired = n.min(self.retiring);
        self.retiring -= retired;
    }

    fn apply(&mut self, effects: Vec<Effect>) -> Result<(), TestCaseError> {
        for e in effects {
            if let Effect::Swapped { client, .. } = e {
                // The slot in place of a shared token, which came back.
                let held = self.held.get_mut(&client).unwrap();
                prop_assert!(*held > 0, "{} swapped a token it did not hold", client);
                *held -= 1;
                prop_assert!(!self.slot[&client], "{} lent its slot twice", client);
                self.slot.insert(client, true);
                self.returned(1);
                continue;
            }
            let Effect::Grant {
                client,
                source,
                waited,
            } = e
            else {
                continue;
            };
            if waited {
                let pos = self.queue.iter().position(|&c| c == client);
                prop_assert!(pos.is_some(), "{} woken but not waiting", client);
                let pos = pos.unwrap();
                if source == Source::Pool {
                    for &earlier in &self.queue[..pos] {
                        prop_assert!(
                            !self.eligible(earlier),
                            "a pool grant passed over {}, which could take it",
                            earlier
                        );
                    }
                }
                self.queue.remove(pos);
            }
            if source == Source::Slot {
                self.slot.insert(client, true);
            }
            if source == Source::Pool {
                prop_assert!(
                    self.eligible(client),
                    "{} granted a shared token past a cap or closed admission",
                    client
                );
                *self.held.get_mut(&client).unwrap() += 1;
                prop_assert!(
                    self.caps
                        .iter()
                        .all(|(&pid, &max)| !self.in_subtree(client, pid)
                            || self.subtree_held(pid) <= max),
                    "a grant took a subtree past its cap"
                );
                prop_assert!(
                    self.in_use() <= self.capacity,
                    "more shared tokens out than the capacity"
                );
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn resize_caps_and_admission_keep_every_invariant(
        capacity in 0u32..5,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let mut pool = Pool::new(capacity);
        let mut m = Model { capacity, open: true, ..Model::default() };
        let mut now = Duration::ZERO;
        let mut next_pid = 100;
        for op in ops {
            now += Duration::from_micros(7);
            match op {
                Op::Connect { parent, job } => {
                    // The parent: a live client, or the outside process 1.
                    let (ppid, mut ancestors) = match m.pick(parent) {
                        Some(p) if parent % 3 != 0 => (m.pid[&p], {
                            let mut a = vec![m.pid[&p]];
                            a.extend(&m.ancestors[&p]);
                            a
                        }),
                        _ => (1, vec![1]),
                    };
                    ancestors.dedup();
                    let pid = next_pid;
                    next_pid += 1;
                    let id = pool.connect(ClientInfo {
                        pid,
                        // A job shares the slot of its parent's recipe.
                        borrows: job.then_some(SlotKey::Recipe(ppid)),
                        label: "native",
                        ..ClientInfo::default()
                    });
                    pool.set_ancestry(id, ancestors.clone());
                    m.live.push(id);
                    m.pid.insert(id, pid);
                    m.ancestors.insert(id, ancestors);
                    m.held.insert(id, 0);
                    m.slot.insert(id, false);
                    pool.take_effects();
                }
                Op::Acquire(i) | Op::TryAcquire(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let is_try = matches!(op, Op::TryAcquire(_));
                    let before = pool.stats().grants;
                    if is_try { pool.try_acquire(id).unwrap() } else { pool.acquire(id, now).unwrap() }
                    let granted = pool.stats().grants > before;
                    if !granted && !is_try && pool.aborted().is_none() {
                        m.queue.push(id);
                    }
                    m.apply(pool.take_effects())?;
                }
                Op::Cancel(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    pool.cancel(id).unwrap();
                    if let [Effect::Cancelled { cancelled: true, .. }] = pool.take_effects().as_slice() {
                        let pos = m.queue.iter().rposition(|&c| c == id).unwrap();
                        m.queue.remove(pos);
                    }
                }
                Op::Release(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let shared = m.held[&id];
                    if pool.release(id, now).is_err() { continue; }
                    if shared > 0 {
                        *m.held.get_mut(&id).unwrap() -= 1;
                        m.returned(1);
                    } else {
                        m.slot.insert(id, false);
                    }
                    m.apply(pool.take_effects())?;
                }
                Op::Disconnect(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let shared = m.held.remove(&id).unwrap();
                    m.slot.remove(&id);
                    m.queue.retain(|&c| c != id);
                    m.live.retain(|&c| c != id);
                    pool.disconnect(id, now);
                    m.returned(shared);
                    m.apply(pool.take_effects())?;
                }
                Op::Resize(n) => {
                    let in_use_before = m.in_use();
                    if n >= m.capacity {
                        let kept = (n - m.capacity).min(m.retiring);
                        m.retiring -= kept;
                    } else {
                        let free = m.capacity + m.retiring - m.in_use();
                        let fewer = m.capacity - n;
                        m.retiring += fewer - fewer.min(free);
                    }
                    m.capacity = n;
                    pool.resize(n, now);
                    m.apply(pool.take_effects())?;
                    // A shrink never takes a held token.
                    prop_assert!(m.in_use() >= in_use_before);
                }
                Op::Cap(i, max) => {
                    let Some(id) = m.pick(i) else { continue };
                    let pid = m.pid[&id];
                    match max {
                        Some(max) => { m.caps.insert(pid, max); }
                        None => { m.caps.remove(&pid); }
                    }
                    pool.set_cap(pid, max, now);
                    m.apply(pool.take_effects())?;
                }
                Op::Admission { open, floor } => {
                    m.open = open;
                    m.floor = floor;
                    pool.set_admission(open, floor, now);
                    m.apply(pool.take_effects())?;
                }
                Op::Abort(go) => {
                    if !go { continue; }
                    pool.abort(AbortReason::Interrupt);
                    m.queue.clear();
                    pool.take_effects();
                }
            }
            if let Err(e) = pool.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
            // Conservation, from the model's side.
            prop_assert_eq!(pool.free() + m.in_use(), m.capacity + m.retiring);
            prop_assert_eq!(pool.retiring(), m.retiring);
            prop_assert_eq!(pool.unaccounted(), 0);
            // Once a shrink's tokens are back, at most the new capacity is out.
            if m.retiring == 0 {
                prop_assert!(m.in_use() <= m.capacity);
            }
            // No waiter that may take a free token is left waiting.
            if pool.free() > 0 && pool.aborted().is_none() {
                for &w in &m.queue {
                    prop_assert!(!m.eligible(w), "{} waits while a token it may take is free", w);
                }
            }
            prop_assert_eq!(pool.waiting(), m.queue.len());
        }
    }
}
