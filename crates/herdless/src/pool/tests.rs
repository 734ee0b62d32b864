//! Unit and property tests of the pool's invariants (ARCHITECTURE §4: 1, 3, 4, 5).

use super::*;
use proptest::prelude::*;

fn t(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

fn native(pid: u32) -> ClientInfo {
    ClientInfo {
        pid,
        ppid: 1,
        label: "native",
        ..ClientInfo::default()
    }
}

fn job(pid: u32, ppid: u32) -> ClientInfo {
    ClientInfo {
        pid,
        ppid,
        job_of_parent: true,
        label: "native",
        ..ClientInfo::default()
    }
}

fn grant(client: ClientId, source: Source, waited: bool) -> Effect {
    Effect::Grant {
        client,
        source,
        waited,
    }
}

#[test]
fn grants_then_queues_in_fifo_order() {
    let mut p = Pool::new(1);
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    let c = p.connect(native(12));
    p.acquire(a, t(0)).unwrap();
    p.acquire(b, t(1)).unwrap();
    p.acquire(c, t(2)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(a, Source::Pool, false)]);
    assert_eq!(p.waiting(), 2);
    p.release(a, t(5)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(b, Source::Pool, true)]);
    p.release(b, t(6)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(c, Source::Pool, true)]);
    assert_eq!(p.stats().wakeups, 2);
    assert_eq!(p.stats().wait_ns.count(), 2);
    assert_eq!(p.stats().max_in_use, 1);
    p.check_invariants().unwrap();
}

#[test]
fn release_without_token_is_an_error() {
    let mut p = Pool::new(2);
    let a = p.connect(native(10));
    assert_eq!(p.release(a, t(0)), Err(PoolError::NotHolding(a)));
    assert_eq!(p.free(), 2);
}

#[test]
fn disconnect_reclaims_and_hands_on() {
    let mut p = Pool::new(2);
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    p.acquire(a, t(0)).unwrap();
    p.acquire(a, t(0)).unwrap();
    p.acquire(b, t(1)).unwrap();
    p.take_effects();
    assert_eq!(p.disconnect(a, t(2)), 2);
    assert_eq!(p.take_effects(), vec![grant(b, Source::Pool, true)]);
    assert_eq!(p.free(), 1);
    assert_eq!(p.stats().reclaimed, 2);
    p.check_invariants().unwrap();
}

#[test]
fn jobs_progress_with_zero_spare_tokens() {
    // -j1: no shared token at all; each job runs in its parent's slot.
    let mut p = Pool::new(0);
    let a = p.connect(job(20, 5));
    let nested = p.connect(job(21, 20));
    let sibling = p.connect(job(22, 5));
    p.acquire(a, t(0)).unwrap();
    p.acquire(nested, t(0)).unwrap();
    p.acquire(sibling, t(0)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![
            grant(a, Source::ParentSlot, false),
            grant(nested, Source::ParentSlot, false)
        ]
    );
    // The sibling waits for its parent's slot and gets it on release.
    p.release(a, t(3)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![grant(sibling, Source::ParentSlot, true)]
    );
    p.check_invariants().unwrap();
}

#[test]
fn try_cancel_and_abort() {
    let mut p = Pool::new(1);
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    p.try_acquire(a).unwrap();
    p.try_acquire(b).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![grant(a, Source::Pool, false), Effect::Denied { client: b }]
    );
    p.acquire(b, t(0)).unwrap();
    p.cancel(b).unwrap();
    p.cancel(b).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![
            Effect::Cancelled {
                client: b,
                cancelled: true
            },
            Effect::Cancelled {
                client: b,
                cancelled: false
            }
        ]
    );
    p.acquire(b, t(0)).unwrap();
    assert!(p.abort(AbortReason::Error));
    assert!(!p.abort(AbortReason::Interrupt));
    let effects = p.take_effects();
    assert!(effects.contains(&Effect::Aborted {
        client: a,
        reason: AbortReason::Error
    }));
    assert!(effects.contains(&Effect::Aborted {
        client: b,
        reason: AbortReason::Error
    }));
    // No grant after an abort, but releases still count.
    p.release(a, t(1)).unwrap();
    assert_eq!(p.take_effects(), vec![]);
    assert_eq!(p.free(), 1);
    let late = p.connect(native(12));
    assert_eq!(
        p.take_effects(),
        vec![Effect::Aborted {
            client: late,
            reason: AbortReason::Error
        }]
    );
    p.check_invariants().unwrap();
}

#[test]
fn observers_cannot_take_tokens() {
    let mut p = Pool::new(1);
    let o = p.connect(ClientInfo {
        observer: true,
        ..native(9)
    });
    assert_eq!(p.acquire(o, t(0)), Err(PoolError::Observer(o)));
    assert!(p.holdings().is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    Connect { job: bool, ppid: u32 },
    Acquire(usize),
    TryAcquire(usize),
    Cancel(usize),
    Release(usize),
    Disconnect(usize),
    Abort(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (any::<bool>(), 0u32..3).prop_map(|(job, ppid)| Op::Connect { job, ppid }),
        6 => any::<usize>().prop_map(Op::Acquire),
        2 => any::<usize>().prop_map(Op::TryAcquire),
        1 => any::<usize>().prop_map(Op::Cancel),
        6 => any::<usize>().prop_map(Op::Release),
        2 => any::<usize>().prop_map(Op::Disconnect),
        // Rare: an abort ends the interesting part of a run.
        1 => (0u8..20).prop_map(|n| Op::Abort(n == 0)),
    ]
}

/// The test's own picture of the pool, built only from effects.
#[derive(Default)]
struct Model {
    live: Vec<(ClientId, ClientInfo)>,
    held: HashMap<ClientId, (u32, bool)>,
    queue: Vec<ClientId>,
    slot_owner: HashMap<u32, ClientId>,
}

impl Model {
    fn pick(&self, i: usize) -> Option<ClientId> {
        (!self.live.is_empty()).then(|| self.live[i % self.live.len()].0)
    }
    fn info(&self, id: ClientId) -> &ClientInfo {
        &self.live.iter().find(|(c, _)| *c == id).unwrap().1
    }
    fn slot_free_for(&self, id: ClientId) -> bool {
        let info = self.info(id);
        info.job_of_parent && !self.held[&id].1 && !self.slot_owner.contains_key(&info.ppid)
    }

    /// Applies effects, checking FIFO order (4) for every waited grant.
    fn apply(&mut self, effects: Vec<Effect>) -> Result<(), TestCaseError> {
        for e in effects {
            if let Effect::Grant {
                client,
                source,
                waited,
            } = e
            {
                if waited {
                    let pos = self.queue.iter().position(|&c| c == client);
                    prop_assert!(pos.is_some(), "{} woken but not waiting", client);
                    let pos = pos.unwrap();
                    match source {
                        Source::Pool => {
                            prop_assert_eq!(pos, 0, "pool grant skipped earlier waiters")
                        }
                        Source::ParentSlot => {
                            let ppid = self.info(client).ppid;
                            let earlier = self.queue[..pos].iter().any(|&c| {
                                let i = self.info(c);
                                i.job_of_parent && i.ppid == ppid && !self.held[&c].1
                            });
                            prop_assert!(!earlier, "slot grant skipped an earlier sibling");
                        }
                    }
                    self.queue.remove(pos);
                }
                let h = self.held.get_mut(&client).unwrap();
                match source {
                    Source::Pool => h.0 += 1,
                    Source::ParentSlot => {
                        prop_assert!(!h.1, "second slot for one client");
                        h.1 = true;
                        let ppid = self.info(client).ppid;
                        prop_assert!(
                            self.slot_owner.insert(ppid, client).is_none(),
                            "parent slot {} lent twice",
                            ppid
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_interleavings(
        capacity in 0u32..5,
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        let mut pool = Pool::new(capacity);
        let mut m = Model::default();
        let mut now = Duration::ZERO;
        for op in ops {
            now += Duration::from_micros(7);
            match op {
                Op::Connect { job, ppid } => {
                    let info = ClientInfo { pid: 100 + m.live.len() as u32, ppid, job_of_parent: job, observer: false, label: "native", internal: false };
                    let id = pool.connect(info.clone());
                    m.live.push((id, info));
                    m.held.insert(id, (0, false));
                }
                Op::Acquire(i) | Op::TryAcquire(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let is_try = matches!(op, Op::TryAcquire(_));
                    let slot_free = m.slot_free_for(id);
                    let grants_before = pool.stats().grants;
                    if is_try { pool.try_acquire(id).unwrap() } else { pool.acquire(id, now).unwrap() }
                    let effects = pool.take_effects();
                    let granted = pool.stats().grants > grants_before;
                    // 5: a job whose parent slot is free never waits, even with no shared token.
                    if slot_free && pool.aborted().is_none() {
                        prop_assert!(granted, "job not granted its free parent slot");
                    }
                    if !granted && !is_try && pool.aborted().is_none() {
                        m.queue.push(id);
                    }
                    m.apply(effects)?;
                }
                Op::Cancel(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    pool.cancel(id).unwrap();
                    let effects = pool.take_effects();
                    if let [Effect::Cancelled { cancelled: true, .. }] = effects.as_slice() {
                        let pos = m.queue.iter().rposition(|&c| c == id);
                        prop_assert!(pos.is_some());
                        m.queue.remove(pos.unwrap());
                    } else {
                        prop_assert!(!m.queue.contains(&id), "cancel missed a pending acquire");
                    }
                }
                Op::Release(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let (pool_held, slot) = m.held[&id];
                    let r = pool.release(id, now);
                    if pool_held > 0 {
                        prop_assert!(r.is_ok());
                        m.held.get_mut(&id).unwrap().0 -= 1;
                    } else if slot {
                        prop_assert!(r.is_ok());
                        m.held.get_mut(&id).unwrap().1 = false;
                        let ppid = m.info(id).ppid;
                        m.slot_owner.remove(&ppid);
                    } else {
                        prop_assert_eq!(r, Err(PoolError::NotHolding(id)));
                    }
                    m.apply(pool.take_effects())?;
                }
                Op::Disconnect(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let (pool_held, slot) = m.held.remove(&id).unwrap();
                    let ppid = m.info(id).ppid;
                    if slot { m.slot_owner.remove(&ppid); }
                    m.queue.retain(|&c| c != id);
                    m.live.retain(|(c, _)| *c != id);
                    let reclaimed = pool.disconnect(id, now);
                    prop_assert_eq!(reclaimed, pool_held + u32::from(slot));
                    m.apply(pool.take_effects())?;
                }
                Op::Abort(go) => {
                    if !go { continue; }
                    pool.abort(AbortReason::Interrupt);
                    m.queue.clear();
                    pool.take_effects();
                }
            }
            // 1, 3, 5 from the pool's side...
            if let Err(e) = pool.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
            // ...and conservation from the model's side, built only from effects.
            let held: u32 = m.held.values().map(|h| h.0).sum();
            prop_assert_eq!(pool.free() + held, capacity);
            prop_assert_eq!(pool.unaccounted(), 0);
            for (&id, &(n, slot)) in &m.held {
                prop_assert_eq!(pool.held_by(id), Some(n + u32::from(slot)));
            }
            prop_assert_eq!(pool.waiting(), m.queue.len());
            prop_assert!(pool.stats().max_in_use <= capacity + 3);
        }
    }
}
