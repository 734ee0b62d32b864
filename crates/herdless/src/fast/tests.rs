//! The shared table's rules under random interleavings of takers, givers,
//! kills, corruption and a broker that lends, closes and reclaims.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Take(u32),
    Give(u32),
    /// The owner is killed: the broker reclaims its words.
    Kill(u32),
    Open,
    /// Close the gate and take back every free word.
    Close,
    /// Lend one more token from the pool if there is one.
    Lend,
    /// Another process writes `value` into word `i`.
    Corrupt(u32, u32),
}

const OWNERS: u32 = 5;
const WORDS: u32 = 6;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=OWNERS).prop_map(Op::Take),
        4 => (1..=OWNERS).prop_map(Op::Give),
        1 => (1..=OWNERS).prop_map(Op::Kill),
        1 => Just(Op::Open),
        1 => Just(Op::Close),
        2 => Just(Op::Lend),
        1 => (0..WORDS, prop_oneof![Just(FREE), Just(OUT), 1..=OWNERS + 2])
            .prop_map(|(i, v)| Op::Corrupt(i, v)),
    ]
}

/// A model broker: what it lent, what its pool has.
struct Broker {
    table: Table,
    lent: Vec<bool>,
    pool_free: u32,
    capacity: u32,
}

impl Broker {
    fn new(capacity: u32) -> Broker {
        Broker {
            table: Table::create(WORDS, OWNERS + 2).expect("a table"),
            lent: vec![false; WORDS as usize],
            pool_free: capacity,
            capacity,
        }
    }

    fn lend(&mut self) {
        if self.pool_free == 0 {
            return;
        }
        if let Some(i) = self.lent.iter().position(|l| !l) {
            self.lent[i] = true;
            self.pool_free -= 1;
            self.table.lend(i as u32);
        }
    }

    /// Takes back free words, and words held by ids nobody has (garbage),
    /// and repairs unlent words. Returns the owners cut off for holding an
    /// unlent word.
    fn sweep(&mut self, live: &[u32]) -> Vec<u32> {
        let mut cut = Vec::new();
        for i in 0..WORDS {
            let v = self.table.word(i).load(SeqCst);
            if self.lent[i as usize] {
                if v != FREE && v != OUT && !live.contains(&v) {
                    self.table.reclaim(i, v);
                }
                if !self.table.is_open() || v == OUT {
                    let v = self.table.word(i).load(SeqCst);
                    if v == OUT || self.table.take_back(i) {
                        self.table.word(i).store(OUT, SeqCst);
                        self.lent[i as usize] = false;
                        self.pool_free += 1;
                    }
                }
            } else if v != OUT {
                if live.contains(&v) {
                    cut.push(v);
                }
                self.table.restore_out(i, v);
            }
        }
        cut
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn tokens_are_never_lost_or_duplicated(ops in proptest::collection::vec(op(), 1..120)) {
        let mut b = Broker::new(4);
        // What each owner believes it holds.
        let mut held = vec![0u32; OWNERS as usize + 1];
        let mut live: Vec<u32> = (1..=OWNERS).collect();
        let mut corrupted = false;
        for op in ops {
            match op {
                Op::Take(o) if live.contains(&o) && b.table.take(o, o).is_some() => {
                    held[o as usize] += 1;
                }
                Op::Give(o) if live.contains(&o) && held[o as usize] > 0 => {
                    held[o as usize] -= 1;
                    let r = b.table.give_back(o, None);
                    if !corrupted {
                        prop_assert!(r.is_some(), "owner {} lost a word it held", o);
                    }
                    if r == Some(true) {
                        b.sweep(&live);
                    }
                }
                Op::Kill(o) if live.contains(&o) => {
                    live.retain(|&x| x != o);
                    for i in 0..WORDS {
                        if b.lent[i as usize] {
                            b.table.reclaim(i, o);
                        }
                    }
                    held[o as usize] = 0;
                    b.sweep(&live);
                }
                Op::Open => b.table.open_gate(),
                Op::Close => {
                    b.table.close_gate();
                    for o in b.sweep(&live) {
                        live.retain(|&x| x != o);
                        held[o as usize] = 0;
                    }
                }
                Op::Lend => b.lend(),
                Op::Corrupt(i, v) => {
                    b.table.word(i).store(v, SeqCst);
                    corrupted = true;
                }
                _ => {}
            }
            // Conservation, from the broker's books alone: whatever the
            // words say, lent + free in the pool = capacity.
            let lent = b.lent.iter().filter(|&&l| l).count() as u32;
            prop_assert_eq!(lent + b.pool_free, b.capacity);
            if !corrupted {
                // Every word an owner holds is one the broker lent, and
                // each owner holds exactly what it believes.
                for o in 1..=OWNERS {
                    let words: Vec<u32> = (0..WORDS)
                        .filter(|&i| b.table.word(i).load(SeqCst) == o)
                        .collect();
                    prop_assert_eq!(words.len() as u32, held[o as usize]);
                    for i in words {
                        prop_assert!(b.lent[i as usize]);
                    }
                }
                // A closed table, once swept, keeps no free word.
                if !b.table.is_open() {
                    b.sweep(&live);
                    for i in 0..WORDS {
                        prop_assert_ne!(b.table.word(i).load(SeqCst), FREE);
                    }
                }
            }
            // At most `capacity` words are held or free, corrupt or not,
            // once the broker has swept.
            b.sweep(&live);
            let in_table = (0..WORDS)
                .filter(|&i| b.table.word(i).load(SeqCst) != OUT)
                .count() as u32;
            prop_assert!(in_table <= b.capacity);
        }
    }
}

#[test]
fn a_closed_table_gives_nothing_and_asks_for_the_broker() {
    let t = Table::create(2, 8).expect("a table");
    t.lend(0);
    assert_eq!(t.take(7, 0), None, "a new table is closed");
    t.open_gate();
    assert_eq!(t.take(7, 0), Some(0));
    assert_eq!(t.take(8, 0), None, "one word lent, one taken");
    assert_eq!(t.give_back(7, None), Some(false));
    assert_eq!(t.take(8, 1), Some(0));
    t.close_gate();
    assert_eq!(t.give_back(8, Some(0)), Some(true));
    assert!(t.take_back(0));
    assert_eq!(t.give_back(8, None), None);
    assert_eq!(t.grant_count(), 2);
    assert_eq!(t.peak(), 1);
}

#[test]
fn the_notify_word_counts_what_the_broker_asked_for() {
    use std::cell::Cell;
    let t = Table::create(2, 8).expect("a table");
    let told = Cell::new(0);
    let nudge = || told.set(told.get() + 1);
    // Takes and waits count down; the one that reaches 0 tells.
    t.set_notify(Notify::After(3));
    t.nudge_if_asked(false, &nudge);
    t.nudge_if_asked(true, &nudge);
    assert_eq!(told.get(), 0);
    t.nudge_if_asked(false, &nudge);
    assert_eq!(told.get(), 1);
    t.nudge_if_asked(true, &nudge);
    assert_eq!(told.get(), 1, "told once");
    // The standing offer: takes are not told, the first wait is, once.
    t.set_notify(Notify::FirstWait);
    for _ in 0..5 {
        t.nudge_if_asked(false, &nudge);
    }
    assert_eq!(told.get(), 1);
    t.nudge_if_asked(true, &nudge);
    assert_eq!(told.get(), 2);
    t.nudge_if_asked(true, &nudge);
    t.nudge_if_asked(false, &nudge);
    assert_eq!(told.get(), 2, "told once");
    t.set_notify(Notify::Never);
    t.nudge_if_asked(true, &nudge);
    assert_eq!(told.get(), 2);
}

#[test]
fn the_first_give_back_that_leaves_a_word_free_tells_the_broker_when_asked() {
    use std::cell::Cell;
    let t = Table::create(2, 8).expect("a table");
    t.lend(0);
    t.open_gate();
    let told = Cell::new(0);
    let nudge = || told.set(told.get() + 1);
    t.set_notify(Notify::AfterOrFree(2));
    // A take counts down and leaves the free bit alone.
    assert_eq!(t.take(7, 0), Some(0));
    t.nudge_if_asked(false, &nudge);
    assert_eq!(told.get(), 0);
    // The give-back that frees the word is told, once.
    assert_eq!(t.give_back(7, Some(0)), Some(true));
    assert_eq!(t.take(7, 0), Some(0));
    assert_eq!(t.give_back(7, Some(0)), Some(false), "told once");
    // The count goes on as before: the take after reaches 0 and tells.
    assert_eq!(t.take(8, 0), Some(0));
    t.nudge_if_asked(false, &nudge);
    assert_eq!(told.get(), 1);
    // Without the bit a freed word tells nobody.
    t.set_notify(Notify::After(5));
    assert_eq!(t.give_back(8, Some(0)), Some(false));
}

#[test]
fn threads_racing_on_the_table_never_hold_more_than_was_lent() {
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;
    let t = Arc::new(Table::create(8, 8).expect("a table"));
    for i in 0..3 {
        t.lend(i);
    }
    t.open_gate();
    let holding = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let threads: Vec<_> = (1..=8u32)
        .map(|me| {
            let (t, holding, most) = (t.clone(), holding.clone(), most.clone());
            std::thread::spawn(move || {
                for _ in 0..5000 {
                    if let Some(i) = t.take(me, me) {
                        let now = holding.fetch_add(1, SeqCst) + 1;
                        most.fetch_max(now, SeqCst);
                        holding.fetch_sub(1, SeqCst);
                        assert_eq!(t.give_back(me, Some(i)), Some(false));
                    }
                }
            })
        })
        .collect();
    for th in threads {
        th.join().expect("no panic");
    }
    assert!(most.load(SeqCst) <= 3);
    assert_eq!(
        (0..8).filter(|&i| t.word(i).load(SeqCst) == FREE).count(),
        3
    );
}

// Waiting in the table needs the broker's guard: Linux only.
#[cfg(target_os = "linux")]
mod handoff;
#[cfg(target_os = "linux")]
mod model;
