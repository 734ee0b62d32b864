//! Unit and property tests of the pool's invariants (ARCHITECTURE §4: 1, 3, 4, 5).

use super::test_support::{native, t};
use super::*;
use proptest::prelude::*;

fn job(pid: u32, slot: SlotKey) -> ClientInfo {
    ClientInfo {
        pid,
        borrows: Some(slot),
        label: "native",
        ..ClientInfo::default()
    }
}

const TOP: SlotKey = SlotKey::Minted(0x70b);

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
    // -j1: no shared token at all; each job runs in its runner's slot.
    let mut p = Pool::new(0);
    assert!(p.add_slot(TOP, None, true));
    let a = p.connect(job(20, TOP));
    let a_slot = SlotKey::Minted(0xa);
    assert!(p.add_slot(a_slot, Some(a), false));
    assert!(!p.add_slot(a_slot, Some(a), false), "a key is never reused");
    let nested = p.connect(job(21, a_slot));
    let sibling = p.connect(job(22, TOP));
    p.acquire(a, t(0)).unwrap();
    p.acquire(nested, t(0)).unwrap();
    p.acquire(sibling, t(0)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![
            grant(a, Source::Slot, false),
            grant(nested, Source::Slot, false)
        ]
    );
    // The nested job runs on its runner's token: one token in use.
    assert_eq!(p.stats().max_in_use, 1);
    // The sibling waits for the top's slot and gets it on release.
    p.release(a, t(3)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(sibling, Source::Slot, true)]);
    // `a` leaves: its slot stays while lent, and goes when given back.
    p.disconnect(a, t(4));
    assert!(p.has_slot(a_slot));
    p.release(nested, t(5)).unwrap();
    assert!(!p.has_slot(a_slot));
    p.check_invariants().unwrap();
}

#[test]
fn any_number_of_processes_share_one_slot() {
    // Twenty jobs of one runner, whatever lies between: one at a time in
    // the slot, the rest on shared tokens.
    let mut p = Pool::new(1);
    assert!(p.add_slot(TOP, None, true));
    let jobs: Vec<ClientId> = (0..20).map(|i| p.connect(job(30 + i, TOP))).collect();
    for &j in &jobs {
        p.acquire(j, t(0)).unwrap();
    }
    let granted = p.take_effects().len();
    assert_eq!(granted, 2, "-j2: the slot and one shared token");
    assert_eq!(p.stats().max_in_use, 2);
    assert_eq!(p.waiting(), 18);
    p.check_invariants().unwrap();
}

#[test]
fn unknown_minted_slot_is_not_borrowed_and_recipe_slots_come_and_go() {
    let mut p = Pool::new(0);
    let stranger = p.connect(job(40, SlotKey::Minted(77)));
    assert_eq!(p.borrows(stranger), None);
    let r = SlotKey::Recipe(500);
    let a = p.connect(job(41, r));
    let b = p.connect(job(42, r));
    assert!(p.has_slot(r));
    p.acquire(a, t(0)).unwrap();
    p.acquire(b, t(0)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(a, Source::Slot, false)]);
    assert_eq!(p.stats().max_in_use, 0, "a recipe runs on its make's token");
    p.disconnect(a, t(1));
    assert_eq!(p.take_effects(), vec![grant(b, Source::Slot, true)]);
    p.disconnect(b, t(2));
    assert!(!p.has_slot(r));
    p.check_invariants().unwrap();
}

#[test]
fn a_stop_is_a_stop() {
    let mut p = Pool::new(1);
    assert!(p.add_slot(TOP, None, true));
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    let c = p.connect(job(12, TOP));
    let d = p.connect(job(13, TOP));
    p.acquire(a, t(0)).unwrap();
    p.acquire(c, t(0)).unwrap();
    p.acquire(b, t(0)).unwrap();
    p.acquire(b, t(0)).unwrap();
    p.acquire(d, t(0)).unwrap();
    p.take_effects();
    assert!(p.stop());
    assert!(!p.stop());
    assert_eq!(
        p.take_effects(),
        vec![Effect::Stopped { client: b }, Effect::Stopped { client: d }]
    );
    // Tokens coming back are not granted to anyone.
    p.release(a, t(1)).unwrap();
    p.release(c, t(1)).unwrap();
    assert_eq!(p.take_effects(), vec![]);
    p.acquire(b, t(2)).unwrap();
    p.try_acquire(d).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![Effect::Stopped { client: b }, Effect::Stopped { client: d }]
    );
    assert_eq!(p.stats().refused_after_stop, 5);
    assert_eq!(p.stats().grants, 2);
    assert_eq!(
        p.stats().wait_ns.count(),
        0,
        "nobody was granted after waiting"
    );
    // Closing at shutdown is not a crash.
    p.acquire(a, t(3)).unwrap();
    assert_eq!(p.close_at_shutdown(a, t(3)), 0);
    assert_eq!(p.stats().reclaimed, 0);
    assert_eq!(p.free(), 1);
    p.check_invariants().unwrap();
}

#[test]
fn a_cancel_that_comes_after_its_grant_takes_the_token_back_for_the_next_waiter() {
    let mut p = Pool::new(1);
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    p.acquire(a, t(0)).unwrap();
    p.acquire(b, t(1)).unwrap();
    assert_eq!(p.take_effects(), vec![grant(a, Source::Pool, false)]);
    // b's request is still queued: withdrawn as by a cancel.
    p.cancel_or_take_back(b, t(2)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![Effect::Cancelled {
            client: b,
            cancelled: true
        }]
    );
    // a's was granted before its withdrawal came: the token goes on to the
    // next waiter at once, and a is told.
    p.acquire(b, t(3)).unwrap();
    p.cancel_or_take_back(a, t(4)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![
            grant(b, Source::Pool, true),
            Effect::TakenBack { client: a }
        ]
    );
    assert_eq!(p.held_by(a), Some(0));
    assert_eq!(p.held_by(b), Some(1));
    assert_eq!(p.stats().raced_grants, 1);
    // Holding nothing, a has nothing taken back.
    p.cancel_or_take_back(a, t(5)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![Effect::Cancelled {
            client: a,
            cancelled: false
        }]
    );
    // After an abort the acquire was answered by it: nothing is taken back.
    assert!(p.abort(AbortReason::Error));
    p.take_effects();
    p.cancel_or_take_back(b, t(6)).unwrap();
    assert_eq!(
        p.take_effects(),
        vec![Effect::Cancelled {
            client: b,
            cancelled: false
        }]
    );
    assert_eq!(p.held_by(b), Some(1));
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
    assert_eq!(p.holdings_for_status(10), (Vec::new(), 0));
    p.check_invariants().unwrap();
    p.disconnect(o, t(1));
    p.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    /// A client naming slot choice `slot` (see `Model::slot_choice`).
    Connect {
        slot: u8,
    },
    /// A slot minted for a client's job.
    MintFor(usize),
    Acquire(usize),
    TryAcquire(usize),
    Cancel(usize),
    CancelOrTakeBack(usize),
    Release(usize),
    Disconnect(usize),
    Abort(bool),
    Stop(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..6).prop_map(|slot| Op::Connect { slot }),
        1 => any::<usize>().prop_map(Op::MintFor),
        6 => any::<usize>().prop_map(Op::Acquire),
        2 => any::<usize>().prop_map(Op::TryAcquire),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::CancelOrTakeBack),
        6 => any::<usize>().prop_map(Op::Release),
        2 => any::<usize>().prop_map(Op::Disconnect),
        // Rare: an abort or a stop ends the interesting part of a run.
        1 => (0u8..20).prop_map(|n| Op::Abort(n == 0)),
        1 => (0u8..20).prop_map(|n| Op::Stop(n == 0)),
    ]
}

/// The test's own picture of the pool, built only from effects.
#[derive(Default)]
struct Model {
    live: Vec<(ClientId, ClientInfo)>,
    held: HashMap<ClientId, (u32, bool)>,
    queue: Vec<ClientId>,
    /// Who each slot is lent to, from grants and releases.
    lent: HashMap<SlotKey, ClientId>,
    minted: Vec<SlotKey>,
}

impl Model {
    fn pick(&self, i: usize) -> Option<ClientId> {
        (!self.live.is_empty()).then(|| self.live[i % self.live.len()].0)
    }
    fn info(&self, id: ClientId) -> &ClientInfo {
        &self.live.iter().find(|(c, _)| *c == id).unwrap().1
    }
    /// None, the top's slot, one of two recipes, or a minted one.
    fn slot_choice(&self, n: u8) -> Option<SlotKey> {
        match n {
            0 => None,
            1 => Some(TOP),
            2 => Some(SlotKey::Recipe(7)),
            3 => Some(SlotKey::Recipe(8)),
            _ => self.minted.last().copied().or(Some(SlotKey::Minted(999))),
        }
    }

    /// Applies effects, checking FIFO order (4) for every waited grant.
    fn apply(&mut self, effects: Vec<Effect>) -> Result<(), TestCaseError> {
        for e in effects {
            match e {
                Effect::Grant {
                    client,
                    source,
                    waited,
                } => {
                    if waited {
                        let pos = self.queue.iter().position(|&c| c == client);
                        prop_assert!(pos.is_some(), "{} woken but not waiting", client);
                        let pos = pos.unwrap();
                        match source {
                            Source::Pool => {
                                prop_assert_eq!(pos, 0, "pool grant skipped earlier waiters")
                            }
                            Source::Slot => {
                                let key = self.info(client).borrows;
                                let earlier = self.queue[..pos]
                                    .iter()
                                    .any(|&c| self.info(c).borrows == key && !self.held[&c].1);
                                prop_assert!(!earlier, "slot grant skipped an earlier sibling");
                            }
                        }
                        self.queue.remove(pos);
                    }
                    let key = self.info(client).borrows;
                    let h = self.held.get_mut(&client).unwrap();
                    match source {
                        Source::Pool => h.0 += 1,
                        Source::Slot => {
                            prop_assert!(!h.1, "second slot for one client");
                            h.1 = true;
                            let key = key.expect("a slot grant goes to a borrower");
                            prop_assert!(
                                self.lent.insert(key, client).is_none(),
                                "{} lent twice",
                                key
                            );
                        }
                    }
                }
                Effect::Stopped { client } => {
                    self.queue.retain(|&c| c != client);
                }
                Effect::Swapped { client, key } => {
                    prop_assert_eq!(self.info(client).borrows, Some(key));
                    let h = self.held.get_mut(&client).unwrap();
                    prop_assert!(h.0 > 0 && !h.1, "{} swapped what it did not hold", client);
                    h.0 -= 1;
                    h.1 = true;
                    prop_assert!(
                        self.lent.insert(key, client).is_none(),
                        "{} lent twice",
                        key
                    );
                }
                _ => {}
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
        prop_assert!(pool.add_slot(TOP, None, true));
        let mut m = Model::default();
        let mut now = Duration::ZERO;
        let mut next_key = 1000u64;
        let mut granted_after_stop = false;
        for op in ops {
            now += Duration::from_micros(7);
            let grants_before = pool.stats().grants;
            match op {
                Op::Connect { slot } => {
                    let info = ClientInfo {
                        pid: 100 + m.live.len() as u32,
                        borrows: m.slot_choice(slot),
                        observer: false,
                        label: "native",
                        internal: false,
                    };
                    let id = pool.connect(info.clone());
                    // A minted slot that is gone is not borrowed.
                    let info = ClientInfo { borrows: pool.borrows(id), ..info };
                    m.live.push((id, info));
                    m.held.insert(id, (0, false));
                }
                Op::MintFor(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let key = SlotKey::Minted(next_key);
                    next_key += 1;
                    prop_assert!(pool.add_slot(key, Some(id), false));
                    m.minted.push(key);
                }
                Op::Acquire(i) | Op::TryAcquire(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let is_try = matches!(op, Op::TryAcquire(_));
                    let slot_free = pool.slot_free_for(id);
                    if slot_free {
                        let key = m.info(id).borrows.unwrap();
                        prop_assert!(!m.lent.contains_key(&key), "pool lends {} that is lent", key);
                    }
                    if is_try { pool.try_acquire(id).unwrap() } else { pool.acquire(id, now).unwrap() }
                    let effects = pool.take_effects();
                    let granted = pool.stats().grants > grants_before;
                    let open = pool.aborted().is_none() && !pool.stopped();
                    // 5: a job whose slot is free never waits, even with no shared token.
                    if slot_free && open {
                        prop_assert!(granted, "job not lent its free slot");
                    }
                    if !granted && !is_try && open {
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
                Op::CancelOrTakeBack(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    // What an earlier op left (an abort told at connect).
                    m.apply(pool.take_effects())?;
                    let (pool_held, slot) = m.held[&id];
                    let open = pool.aborted().is_none() && !pool.stopped();
                    let pending = m.queue.contains(&id);
                    pool.cancel_or_take_back(id, now).unwrap();
                    let mut effects = pool.take_effects();
                    let answer = effects.pop();
                    if pending {
                        // As a cancel: the youngest pending acquire goes.
                        prop_assert_eq!(answer, Some(Effect::Cancelled { client: id, cancelled: true }));
                        prop_assert!(effects.is_empty());
                        let pos = m.queue.iter().rposition(|&c| c == id).unwrap();
                        m.queue.remove(pos);
                    } else if open && (pool_held > 0 || slot) {
                        // Taken back as a release: a shared token first,
                        // and it goes on to the next waiter at once.
                        prop_assert_eq!(answer, Some(Effect::TakenBack { client: id }));
                        if pool_held > 0 {
                            m.held.get_mut(&id).unwrap().0 -= 1;
                        } else {
                            m.held.get_mut(&id).unwrap().1 = false;
                            let key = m.info(id).borrows.unwrap();
                            m.lent.remove(&key);
                        }
                        m.apply(effects)?;
                    } else {
                        // Nothing to take back: an abort or a stop answered
                        // the acquire, or the client holds nothing.
                        prop_assert_eq!(answer, Some(Effect::Cancelled { client: id, cancelled: false }));
                        prop_assert!(effects.is_empty());
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
                        let key = m.info(id).borrows.unwrap();
                        m.lent.remove(&key);
                    } else {
                        prop_assert_eq!(r, Err(PoolError::NotHolding(id)));
                    }
                    m.apply(pool.take_effects())?;
                }
                Op::Disconnect(i) => {
                    let Some(id) = m.pick(i) else { continue };
                    let (pool_held, slot) = m.held.remove(&id).unwrap();
                    if slot { m.lent.remove(&m.info(id).borrows.unwrap()); }
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
                Op::Stop(go) => {
                    if !go { continue; }
                    pool.stop();
                    m.apply(pool.take_effects())?;
                    prop_assert!(m.queue.is_empty(), "a waiter was not told of the stop");
                }
            }
            // 10: nothing is granted once stopped.
            if pool.stopped() && pool.stats().grants > grants_before && !matches!(op, Op::Stop(_)) {
                granted_after_stop = true;
            }
            prop_assert!(!granted_after_stop, "a grant after the stop");
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
            // A status document chooses from every busy client and the
            // oldest idle ones: the same as picking from all of them.
            let all = pool.holdings();
            let (some, total) = pool.holdings_for_status(2);
            prop_assert_eq!(total, all.len());
            let mut idle = 0;
            let expected: Vec<_> = all
                .into_iter()
                .filter(|h| {
                    h.held > 0 || h.waiting > 0 || {
                        idle += 1;
                        idle <= 2
                    }
                })
                .collect();
            prop_assert_eq!(some, expected);
            // -jN: the shared tokens and the top's implicit one, no more.
            prop_assert!(pool.stats().max_in_use <= capacity + 1);
        }
    }
}
