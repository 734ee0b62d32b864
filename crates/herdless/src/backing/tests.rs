//! The rules of a backed pool, on an in-memory outer jobserver shared with
//! sibling jobs: nothing lost, nothing idle, the inner `-j` never passed.

use super::*;
use crate::pool::test_support::{native, t};
use crate::pool::{ClientId, Effect, SlotKey, Source};
use proptest::prelude::*;

/// An outer jobserver: `total` bytes, in its pipe or held by siblings.
#[derive(Debug)]
struct Memory {
    pipe: Vec<u8>,
    total: usize,
}

impl Memory {
    fn new(total: usize) -> Memory {
        Memory {
            pipe: vec![b'+'; total],
            total,
        }
    }
}

impl Outer for Memory {
    fn take(&mut self) -> Taken {
        match self.pipe.pop() {
            Some(b) => Taken::Byte(b),
            None => Taken::Empty,
        }
    }
    fn put(&mut self, byte: u8) -> io::Result<()> {
        self.pipe.push(byte);
        Ok(())
    }
}

const TOP: SlotKey = SlotKey::Minted(0x70b);

/// A backed pool starts with no shared token, as `Broker::with_backing`
/// makes it.
fn backed_pool() -> Pool {
    let mut p = Pool::new(0);
    p.add_slot(TOP, None, true);
    p
}

#[test]
fn borrows_on_demand_and_gives_back_at_once() {
    let mut outer = Memory::new(2);
    let mut ledger = Ledger::new(Flavor::Gnu, 4);
    let mut p = backed_pool();
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    ledger.balance(&mut p, &mut outer, t(0));
    assert_eq!(ledger.held(), 0, "nobody waits: nothing borrowed");
    p.acquire(a, t(1)).unwrap();
    ledger.balance(&mut p, &mut outer, t(1));
    assert_eq!(
        p.take_effects(),
        vec![Effect::Grant {
            client: a,
            source: Source::Pool,
            waited: true
        }]
    );
    assert_eq!((ledger.held(), outer.pipe.len()), (1, 1));
    p.acquire(b, t(2)).unwrap();
    ledger.balance(&mut p, &mut outer, t(2));
    assert_eq!((ledger.held(), outer.pipe.len()), (2, 0));
    // A third waiter finds the outer pipe empty and waits.
    let c = p.connect(native(12));
    p.acquire(c, t(3)).unwrap();
    ledger.balance(&mut p, &mut outer, t(3));
    assert_eq!(p.waiting(), 1);
    // a's token goes to c, not back to the outer pipe.
    p.release(a, t(4)).unwrap();
    ledger.balance(&mut p, &mut outer, t(4));
    assert_eq!((ledger.held(), outer.pipe.len(), p.waiting()), (2, 0, 0));
    // Released with nobody waiting: back at once.
    p.release(b, t(5)).unwrap();
    ledger.balance(&mut p, &mut outer, t(5));
    assert_eq!((ledger.held(), outer.pipe.len()), (1, 1));
    p.disconnect(c, t(6));
    ledger.balance(&mut p, &mut outer, t(6));
    assert_eq!((ledger.held(), outer.pipe.len(), p.capacity()), (0, 2, 0));
    p.check_invariants().unwrap();
}

#[test]
fn the_inner_limit_caps_what_is_borrowed() {
    let mut outer = Memory::new(10);
    let mut ledger = Ledger::new(Flavor::Gnu, 3);
    let mut p = backed_pool();
    let ids: Vec<ClientId> = (0..6).map(|i| p.connect(native(10 + i))).collect();
    for &id in &ids {
        p.acquire(id, t(0)).unwrap();
    }
    ledger.balance(&mut p, &mut outer, t(0));
    assert_eq!(
        ledger.held(),
        2,
        "-j3: two borrowed, the third is the top's"
    );
    assert_eq!(p.waiting(), 4);
    assert_eq!(outer.pipe.len(), 8);
}

#[test]
fn an_outer_bmake_abort_token_is_put_back_and_aborts() {
    let mut outer = Memory::new(0);
    outer.pipe.push(b'E');
    outer.total = 1;
    let mut ledger = Ledger::new(Flavor::Bmake, 4);
    let mut p = backed_pool();
    let a = p.connect(native(10));
    p.acquire(a, t(0)).unwrap();
    ledger.balance(&mut p, &mut outer, t(0));
    assert_eq!(outer.pipe, vec![b'E'], "the stopper stays for the others");
    assert_eq!(p.aborted(), Some(AbortReason::Error));
    assert_eq!(ledger.held(), 0);
    // Under GNU make the same byte is just a token.
    let mut outer = Memory::new(0);
    outer.pipe.push(b'E');
    let mut ledger = Ledger::new(Flavor::Gnu, 4);
    let mut p = backed_pool();
    let a = p.connect(native(10));
    p.acquire(a, t(0)).unwrap();
    ledger.balance(&mut p, &mut outer, t(0));
    assert_eq!(ledger.held(), 1);
    p.release(a, t(1)).unwrap();
    ledger.balance(&mut p, &mut outer, t(1));
    assert_eq!(outer.pipe, vec![b'E'], "the byte read goes back");
}

#[test]
fn a_grow_after_a_shrink_borrows_again_at_once() {
    // -j4 under an outer jobserver of 5 bytes: a and b run on two.
    let mut outer = Memory::new(5);
    let mut ledger = Ledger::new(Flavor::Gnu, 4);
    let mut p = backed_pool();
    let a = p.connect(native(10));
    let b = p.connect(native(11));
    p.acquire(a, t(0)).unwrap();
    p.acquire(b, t(0)).unwrap();
    ledger.balance(&mut p, &mut outer, t(0));
    assert_eq!((ledger.held(), outer.pipe.len()), (2, 3));
    // -j1: both tokens retire as they come back; nothing is taken.
    ledger.resize(&mut p, 1, t(1));
    ledger.balance(&mut p, &mut outer, t(1));
    assert_eq!((p.capacity(), p.retiring(), ledger.held()), (0, 2, 2));
    // -j4 again: the shrink is called off, no byte moves.
    ledger.resize(&mut p, 4, t(2));
    ledger.balance(&mut p, &mut outer, t(2));
    assert_eq!((p.capacity(), p.retiring(), ledger.held()), (2, 0, 2));
    assert_eq!(outer.pipe.len(), 3);
    // a's token goes back to the outer pipe (nobody waits here) ...
    p.release(a, t(3)).unwrap();
    ledger.balance(&mut p, &mut outer, t(3));
    assert_eq!((ledger.held(), outer.pipe.len()), (1, 4));
    p.take_effects();
    // ... and a new waiter is served at once from it: -j4 allows 3.
    let c = p.connect(native(12));
    p.acquire(c, t(4)).unwrap();
    ledger.balance(&mut p, &mut outer, t(4));
    assert_eq!(
        p.take_effects(),
        vec![Effect::Grant {
            client: c,
            source: Source::Pool,
            waited: true
        }]
    );
    assert_eq!((p.waiting(), ledger.held(), outer.pipe.len()), (0, 2, 3));
    assert_eq!(ledger.held(), p.capacity() + p.retiring());
    // Growing above what an earlier shrink kept adds no token by itself.
    ledger.resize(&mut p, 2, t(5));
    assert_eq!((p.capacity(), p.retiring()), (1, 1));
    ledger.resize(&mut p, 6, t(6));
    ledger.balance(&mut p, &mut outer, t(6));
    assert_eq!((p.capacity(), p.retiring(), p.free()), (2, 0, 0));
    assert_eq!((ledger.held(), outer.pipe.len()), (2, 3));
    p.check_invariants().unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Connect,
    Acquire(usize),
    Release(usize),
    Disconnect(usize),
    /// A sibling job of the outer make takes a byte, or gives one back.
    SiblingTakes,
    SiblingGives,
    SetJobs(u32),
    Stop(bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Connect),
        6 => any::<usize>().prop_map(Op::Acquire),
        5 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Disconnect),
        2 => Just(Op::SiblingTakes),
        2 => Just(Op::SiblingGives),
        1 => (1u32..6).prop_map(Op::SetJobs),
        1 => (0u8..30).prop_map(|n| Op::Stop(n == 0)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// After every event and step: every outer byte is in the outer pipe,
    /// with a sibling, or counted by one inner token; the inner pool holds
    /// no free token (it would be idle); a waiter that may take a shared
    /// token waits only while the inner limit is reached or the outer pipe
    /// is empty; and at the end every byte is back.
    #[test]
    fn nothing_lost_nothing_idle(
        total in 0usize..6,
        jobs in 1u32..6,
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut outer = Memory::new(total);
        let mut siblings = 0usize;
        let mut ledger = Ledger::new(Flavor::Gnu, jobs);
        let mut p = backed_pool();
        let mut live: Vec<(ClientId, u32)> = Vec::new();
        let mut now = 0;
        for op in ops {
            now += 1;
            let at = t(now);
            match op {
                Op::Connect => live.push((p.connect(native(100 + now as u32)), 0)),
                Op::Acquire(i) if !live.is_empty() => {
                    let id = live[i % live.len()].0;
                    p.acquire(id, at).unwrap();
                }
                Op::Release(i) if !live.is_empty() => {
                    let (id, _) = live[i % live.len()];
                    if p.held_by(id).unwrap_or(0) > 0 {
                        p.release(id, at).unwrap();
                    }
                }
                Op::Disconnect(i) if !live.is_empty() => {
                    let (id, _) = live.remove(i % live.len());
                    p.disconnect(id, at);
                }
                Op::SiblingTakes if outer.pipe.pop().is_some() => siblings += 1,
                Op::SiblingGives if siblings > 0 => {
                    siblings -= 1;
                    outer.pipe.push(b'+');
                }
                Op::SetJobs(j) => ledger.resize(&mut p, j, at),
                Op::Stop(true) => {
                    p.stop();
                }
                _ => {}
            }
            let _ = p.take_effects();
            ledger.balance(&mut p, &mut outer, at);
            let _ = p.take_effects();
            prop_assert_eq!(p.check_invariants(), Ok(()));
            prop_assert_eq!(outer.pipe.len() + siblings + ledger.held() as usize, outer.total);
            prop_assert_eq!(ledger.held(), p.capacity() + p.retiring());
            prop_assert_eq!(p.free(), 0, "a borrowed token idles in the inner pool");
            prop_assert!(p.capacity() <= ledger.limit());
            // No cap here and admission open: any waiter may take a
            // shared token, a shrink's pending one included.
            if p.waiting() > 0 && p.aborted().is_none() {
                prop_assert!(
                    p.capacity() >= ledger.limit() || outer.pipe.is_empty(),
                    "a waiter waits while a byte could be borrowed"
                );
            }
        }
        p.stop();
        for (id, _) in live.drain(..) {
            p.close_at_shutdown(id, t(now + 1));
        }
        ledger.give_back_all(&mut outer);
        prop_assert_eq!(outer.pipe.len() + siblings, outer.total);
        prop_assert_eq!(ledger.held(), 0);
    }
}

/// An outer pool that answers later (a herdless broker): one request at
/// a time, withdrawn once nobody here wants it; its abort aborts here.
struct Later {
    pending: bool,
    grant_ready: bool,
    withdrawn: u32,
    aborted: bool,
}

impl Outer for Later {
    fn take(&mut self) -> Taken {
        if self.aborted {
            return Taken::Aborted(AbortReason::Interrupt);
        }
        if self.grant_ready {
            self.grant_ready = false;
            self.pending = false;
            return Taken::Byte(b'+');
        }
        self.pending = true;
        Taken::Empty
    }
    fn put(&mut self, _byte: u8) -> io::Result<()> {
        Ok(())
    }
    fn settle(&mut self, wanted: bool) {
        if !wanted && self.pending {
            self.pending = false;
            self.grant_ready = false;
            self.withdrawn += 1;
        }
    }
}

#[test]
fn a_request_nobody_wants_any_more_is_withdrawn() {
    let mut outer = Later {
        pending: false,
        grant_ready: false,
        withdrawn: 0,
        aborted: false,
    };
    let mut ledger = Ledger::new(Flavor::Gnu, 3);
    let mut p = backed_pool();
    let a = p.connect(native(10));
    p.acquire(a, t(0)).unwrap();
    ledger.balance(&mut p, &mut outer, t(0));
    assert!(outer.pending, "asked the outer pool");
    // The grant arrives: the waiter gets it.
    outer.grant_ready = true;
    ledger.balance(&mut p, &mut outer, t(1));
    assert_eq!((ledger.held(), p.waiting()), (1, 0));
    // A second waiter asks, then leaves before the answer.
    let b = p.connect(native(11));
    p.acquire(b, t(2)).unwrap();
    ledger.balance(&mut p, &mut outer, t(2));
    assert!(outer.pending);
    p.disconnect(b, t(3));
    ledger.balance(&mut p, &mut outer, t(3));
    assert!(!outer.pending, "withdrawn");
    assert_eq!(outer.withdrawn, 1);
    // The outer pool aborts: so does this one.
    outer.aborted = true;
    let c = p.connect(native(12));
    p.acquire(c, t(4)).unwrap();
    ledger.balance(&mut p, &mut outer, t(4));
    assert_eq!(p.aborted(), Some(AbortReason::Interrupt));
    assert_eq!(ledger.aborted(), Some(AbortReason::Interrupt));
    p.release(a, t(5)).unwrap();
    ledger.balance(&mut p, &mut outer, t(5));
    assert_eq!(ledger.held(), 0, "given back after the abort too");
}

/// [`Memory`] shared between the test and the [`Backing`] that owns it,
/// so that the test can count its pipe after the backing is dropped.
#[derive(Clone, Debug)]
struct Shared(std::sync::Arc<std::sync::Mutex<Memory>>);

impl Shared {
    fn pipe(&self) -> Vec<u8> {
        self.0.lock().unwrap().pipe.clone()
    }
}

impl Outer for Shared {
    fn take(&mut self) -> Taken {
        self.0.lock().unwrap().take()
    }
    fn put(&mut self, byte: u8) -> io::Result<()> {
        self.0.lock().unwrap().put(byte)
    }
}

impl crate::backing::Source for Shared {
    fn fd(&self) -> std::os::fd::RawFd {
        -1
    }
    fn what(&self) -> String {
        "test's pipe".into()
    }
}

/// A backing of `-j4` on 5 outer bytes that has borrowed 3 for its
/// waiters.
fn borrowing() -> (Backing, Pool, Shared) {
    let outer = Shared(std::sync::Arc::new(std::sync::Mutex::new(Memory::new(5))));
    let mut backing = Backing {
        ledger: Ledger::new(Flavor::Gnu, 4),
        outer: Box::new(outer.clone()),
    };
    let mut pool = backed_pool();
    for i in 0..4 {
        let id = pool.connect(native(10 + i));
        pool.acquire(id, t(0)).unwrap();
    }
    backing.balance(&mut pool, t(0));
    assert_eq!((backing.ledger().held(), outer.pipe().len()), (3, 2));
    (backing, pool, outer)
}

#[test]
fn a_backing_dropped_holding_bytes_gives_them_back() {
    let (backing, _pool, outer) = borrowing();
    drop(backing);
    assert_eq!(outer.pipe().len(), 5);
}

#[test]
fn a_backing_dropped_after_giving_back_gives_nothing_twice() {
    let (mut backing, _pool, outer) = borrowing();
    assert_eq!(backing.give_back_all(), 3);
    drop(backing);
    assert_eq!(outer.pipe(), vec![b'+'; 5]);
}

#[test]
fn a_panicking_owner_gives_the_bytes_back() {
    let (backing, _pool, outer) = borrowing();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _owned = backing;
        panic!("the broker's thread panics");
    }));
    assert!(unwound.is_err());
    assert_eq!(outer.pipe().len(), 5);
}
