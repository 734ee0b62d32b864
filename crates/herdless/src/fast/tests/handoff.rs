//! Waiting in the table and the direct hand-off, with threads as clients
//! of a guarded table: at most the lent tokens held at once, every wait
//! ends, in ticket order, and a giver that stops between its steps,
//! a move to the broker, a deadline or the guard's end leave nothing
//! behind.

use std::sync::atomic::AtomicU32;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::*;

/// How long a test waits for what must happen before it calls it a hang
/// (a lost wake-up: no wait in the table has a timer).
const PATIENCE: Duration = Duration::from_secs(30);

/// A guarded table of `words` lent, open words and `slots` slots.
fn guarded(words: u32, slots: u32) -> (Arc<Table>, DeathGuard) {
    let t = Table::create(words, slots).expect("a table");
    let g = t.guard().expect("a guard (Linux)");
    t.set_hi(slots);
    // The broker clears each slot as it admits its client.
    for k in 1..=slots {
        t.clear_slot(k, false);
    }
    for i in 0..words {
        t.lend(i);
    }
    t.open_gate();
    (Arc::new(t), g)
}

/// What every word and slot of `t` reads, for a failure's message.
fn dump(t: &Table) -> String {
    let words: Vec<String> = (0..t.words())
        .map(|i| format!("{:#x}", t.word(i).load(SeqCst)))
        .collect();
    let slots: Vec<String> = (0..=t.slots())
        .map(|k| {
            format!(
                "{k}:{:#x}/{}",
                t.state(k).load(SeqCst),
                t.ticket(k).load(SeqCst)
            )
        })
        .collect();
    format!("words {words:?} slots {slots:?}")
}

/// Polls `done` until it holds, or fails with the table's state.
fn until(t: &Table, what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < PATIENCE,
            "timed out waiting for {what}: {}",
            dump(t)
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Slot `me` waits in `t` in a thread (no deadline); the channel gets
/// the thread's id, then how the wait ended.
fn waiter(t: &Arc<Table>, me: u32) -> (i32, mpsc::Receiver<WaitEnd>) {
    let (tx, rx) = mpsc::channel();
    let (tid_tx, tid_rx) = mpsc::channel();
    let t = t.clone();
    thread::spawn(move || {
        let _ = tid_tx.send(nix::unistd::gettid().as_raw());
        let _ = tx.send(t.wait(me, None).expect("wait"));
    });
    (tid_rx.recv().expect("the waiter's id"), rx)
}

/// Whether thread `tid` of this process is asleep (between registering
/// and its futex wait a waiter makes no call that sleeps).
fn asleep(tid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    stat.rfind(')')
        .and_then(|at| stat[at + 1..].split_whitespace().next())
        .is_some_and(|state| state == "S")
}

/// Starts a waiter for `me` and returns once its wait shows in the table
/// and it sleeps on it.
fn registered(t: &Arc<Table>, me: u32) -> mpsc::Receiver<WaitEnd> {
    let (tid, rx) = waiter(t, me);
    until(t, &format!("slot {me} asleep in the table"), || {
        t.waiters().iter().any(|&(k, _)| k == me) && asleep(tid)
    });
    rx
}

fn ended(t: &Table, rx: &mpsc::Receiver<WaitEnd>) -> WaitEnd {
    rx.recv_timeout(PATIENCE)
        .unwrap_or_else(|_| panic!("a wait in the table never ended: {}", dump(t)))
}

/// The slots waiting in `t`, oldest ticket first.
fn slots(t: &Table) -> Vec<u32> {
    t.waiters().into_iter().map(|(k, _)| k).collect()
}

/// A giver's step 1, as `hand_on` runs it (after `give_back` counted its
/// token out): claims the oldest waiter's ticket for `giver`. The heir
/// and its ticket.
fn claim(t: &Table, giver: u32) -> (u32, u32) {
    let (h, tk) = t.heir(t.tid().expect("a guard")).expect("a waiter");
    assert_eq!(t.waiters()[0], (h, tk), "the heir is the oldest waiter");
    t.header(H_IN_USE).fetch_sub(1, SeqCst);
    t.ticket(h)
        .compare_exchange(tk, CLAIMED | giver, SeqCst, SeqCst)
        .expect("an unclaimed ticket");
    (h, tk)
}

/// A giver's step 2: word `i`, which it holds, becomes its gift to `heir`.
fn gift_step(t: &Table, i: u32, giver: u32, heir: u32) {
    t.word(i)
        .compare_exchange(giver, gift(giver, heir), SeqCst, SeqCst)
        .expect("the giver's word");
}

/// A giver's step 3: the heir's state *waiting → woken*, counted, and its
/// wake-up (`wake`: the `FUTEX_WAKE` too). Whether the swap was made.
fn wake_step(t: &Table, heir: u32, wake: bool) -> bool {
    let waiting = t.tid().expect("a guard") | FUTEX_WAITERS;
    let woke = t
        .state(heir)
        .compare_exchange(waiting, waiting | FUTEX_OWNER_DIED, SeqCst, SeqCst)
        .is_ok();
    if woke {
        t.header64(H_HANDOFFS).fetch_add(1, SeqCst);
        if wake {
            let _ = t.seg.wake_one(t.state_index(heir));
        }
    }
    woke
}

/// The lent words are all free, nobody waits, and no gift is left.
fn all_free(t: &Table) {
    for i in 0..t.words() {
        assert_eq!(t.word(i).load(SeqCst), FREE, "word {i}: {}", dump(t));
    }
    assert!(t.waiters().is_empty(), "{}", dump(t));
}

#[test]
fn many_threads_waiting_in_the_table_never_hold_more_than_was_lent() {
    const WORDS: u32 = 3;
    const CLIENTS: u32 = 10;
    const ROUNDS: u32 = 1500;
    let (t, _guard) = guarded(WORDS, CLIENTS);
    let holding = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let waits = Arc::new(AtomicU32::new(0));
    let (done_tx, done_rx) = mpsc::channel();
    for me in 1..=CLIENTS {
        let (t, holding, most, waits, done) = (
            t.clone(),
            holding.clone(),
            most.clone(),
            waits.clone(),
            done_tx.clone(),
        );
        thread::spawn(move || {
            for round in 0..ROUNDS {
                let hint = match t.take(me, me) {
                    Some(i) => Some(i),
                    None => {
                        waits.fetch_add(1, SeqCst);
                        match t.wait(me, None).expect("wait") {
                            // Nobody dies here: one gift at a time.
                            WaitEnd::Got(1) => None,
                            other => panic!("slot {me} round {round}: wait ended {other:?}"),
                        }
                    }
                };
                let now = holding.fetch_add(1, SeqCst) + 1;
                most.fetch_max(now, SeqCst);
                assert_eq!(
                    (0..t.words())
                        .filter(|&i| t.word(i).load(SeqCst) == me)
                        .count(),
                    1,
                    "slot {me} holds exactly one word"
                );
                if round % 7 == 0 {
                    thread::yield_now();
                }
                holding.fetch_sub(1, SeqCst);
                assert_eq!(t.give_back(me, hint), Some(false), "slot {me}");
            }
            let _ = done.send(me);
        });
    }
    let start = Instant::now();
    let mut finished = 0;
    while finished < CLIENTS {
        // Conservation while they run: every word is free, held by a
        // client, or a gift to one; none went back out.
        for i in 0..WORDS {
            let v = t.word(i).load(SeqCst);
            assert!(
                v == FREE || (1..=CLIENTS).contains(&v) || as_gift(v).is_some(),
                "word {i} reads {v:#x}"
            );
        }
        match done_rx.recv_timeout(Duration::from_millis(20)) {
            Ok(_) => finished += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => assert!(
                start.elapsed() < PATIENCE * 4,
                "clients stalled ({finished} of {CLIENTS} done): {}",
                dump(&t)
            ),
            Err(e) => panic!("a client thread died: {e}"),
        }
    }
    assert!(
        most.load(SeqCst) <= WORDS,
        "{} held at once",
        most.load(SeqCst)
    );
    all_free(&t);
    assert!(waits.load(SeqCst) > 0, "clients waited in the table");
    assert!(t.handoffs() > 0, "tokens were handed straight to waiters");
    assert_eq!(
        t.waits_got(),
        u64::from(waits.load(SeqCst)),
        "every wait counted"
    );
    assert_eq!(t.waits_cancelled(), 0);
    assert_eq!(t.header(H_IN_USE).load(SeqCst), 0, "in use: {}", dump(&t));
    assert!(t.peak() <= WORDS, "peak {}", t.peak());
}

#[test]
fn waiters_are_served_in_ticket_order_and_a_taker_cannot_jump_the_queue() {
    let (t, _guard) = guarded(1, 8);
    assert_eq!(t.take(1, 0), Some(0));
    // Five waiters, each registered after the one before shows.
    let (tx, rx) = mpsc::channel();
    for me in 2..=6u32 {
        let (t2, tx) = (t.clone(), tx.clone());
        thread::spawn(move || {
            let end = t2.wait(me, None).expect("wait");
            tx.send((me, end)).unwrap();
            // Held: passed on to the next in line.
            assert_eq!(t2.give_back(me, Some(0)), Some(false));
        });
        until(&t, "the next waiter", || {
            t.waiters().len() == me as usize - 1
        });
    }
    assert_eq!(slots(&t), vec![2, 3, 4, 5, 6]);
    // A client that did not wait tries to take, all the while.
    let barged = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(AtomicU32::new(0));
    let barger = {
        let (t, barged, stop) = (t.clone(), barged.clone(), stop.clone());
        thread::spawn(move || {
            while stop.load(SeqCst) == 0 {
                if t.take(7, 0).is_some() {
                    barged.fetch_add(1, SeqCst);
                    t.give_back(7, Some(0));
                }
            }
        })
    };
    assert_eq!(t.give_back(1, Some(0)), Some(false));
    let order: Vec<u32> = (0..5)
        .map(|_| {
            let (me, end) = rx
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|_| panic!("a waiter was never served: {}", dump(&t)));
            assert_eq!(end, WaitEnd::Got(1), "slot {me}");
            me
        })
        .collect();
    stop.store(1, SeqCst);
    barger.join().unwrap();
    assert_eq!(order, vec![2, 3, 4, 5, 6], "served in ticket order");
    // The word was never free while anybody waited; it is free now.
    all_free(&t);
    assert_eq!(t.handoffs(), 5);
    let _ = barged;
}

#[test]
fn a_giver_stopped_between_its_steps_is_finished_by_the_broker() {
    let (t, _guard) = guarded(2, 4);
    assert_eq!(t.take(1, 0), Some(0));
    assert_eq!(t.take(2, 1), Some(1));
    let rx = registered(&t, 3);
    // Giver 1's steps 1 and 2, then it is killed: the word is the heir's.
    assert_eq!(claim(&t, 1).0, 3);
    gift_step(&t, 0, 1, 3);
    // The broker sees giver 1 gone and wakes the heir of its gift.
    assert_eq!(
        t.finish_giver(1),
        (vec![], vec![]),
        "nothing moved or freed"
    );
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1));
    assert_eq!(t.word(0).load(SeqCst), 3, "the heir holds the word");
    assert_eq!(t.give_back(3, None), Some(false));
    assert_eq!(t.give_back(2, None), Some(false));
    all_free(&t);
}

#[test]
fn a_giver_killed_after_waking_but_before_the_wake_call_is_finished_by_the_broker() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let rx = registered(&t, 2);
    // All three swaps, and no FUTEX_WAKE: the heir may sleep on.
    assert_eq!(claim(&t, 1).0, 2);
    gift_step(&t, 0, 1, 2);
    assert!(wake_step(&t, 2, false));
    assert_eq!(t.finish_giver(1), (vec![], vec![]));
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1));
    assert_eq!(t.word(0).load(SeqCst), 2);
}

#[test]
fn a_dead_givers_claim_without_a_gift_moves_the_wait_to_the_broker() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let rx = registered(&t, 2);
    let rx3 = registered(&t, 3);
    // Giver 1 claims slot 2 and is killed before its gift: the broker
    // reclaims its word, and queues the wait it claimed.
    assert_eq!(claim(&t, 1).0, 2);
    assert!(t.reclaim(0, 1));
    let (moved, freed) = t.finish_giver(1);
    assert_eq!(moved, vec![2], "the broker queues slot 2");
    assert!(freed.is_empty());
    assert_eq!(ended(&t, &rx), WaitEnd::Moved);
    assert_eq!(t.held_word(2), None);
    assert_eq!(t.state(2).load(SeqCst), IDLE, "{}", dump(&t));
    // Finished once: a second repair finds nothing.
    assert_eq!(t.finish_giver(1), (vec![], vec![]));
    // The reclaimed word goes to the next waiter, not to the moved one.
    assert_eq!(slots(&t), vec![3]);
    assert_eq!(t.hand_on(0, FREE, BROKER_GIVER), HandOn::Handed);
    assert_eq!(ended(&t, &rx3), WaitEnd::Got(1));
    assert_eq!(t.word(0).load(SeqCst), 3);
}

#[test]
fn a_gift_to_a_slot_its_giver_did_not_claim_is_freed_by_the_broker_and_goes_to_the_next() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    // A gift of giver 1's to slot 2, which nothing of giver 1's claimed
    // (slot 2 does not wait): freed.
    t.word(0).store(gift(1, 2), SeqCst);
    assert_eq!(
        t.finish_giver(1),
        (vec![], vec![0]),
        "nobody claimed: freed"
    );
    assert_eq!(t.word(0).load(SeqCst), FREE);
    // A gift to a waiter that another giver claimed, or nobody: freed
    // too, and the waiter waits on for its own claimer.
    assert_eq!(t.take(1, 0), Some(0));
    let rx = registered(&t, 3);
    t.word(0).store(gift(1, 3), SeqCst);
    assert_eq!(t.finish_giver(1), (vec![], vec![0]));
    assert_eq!(slots(&t), vec![3], "slot 3 still waits: {}", dump(&t));
    // The broker hands the freed word on to the oldest waiter.
    assert_eq!(
        t.hand_on(0, FREE, BROKER_GIVER),
        HandOn::Handed,
        "{}",
        dump(&t)
    );
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1));
    assert_eq!(t.word(0).load(SeqCst), 3);
}

#[test]
fn one_heir_gets_one_gift_however_many_givers_die() {
    // Two givers killed between their steps: each claimed its own heir,
    // so each heir gets one token, and a claim without a gift is moved.
    let (t, _guard) = guarded(2, 5);
    assert_eq!(t.take(1, 0), Some(0));
    assert_eq!(t.take(2, 1), Some(1));
    let a = registered(&t, 3);
    let b = registered(&t, 4);
    assert_eq!(claim(&t, 1).0, 3);
    assert_eq!(claim(&t, 2).0, 4, "a claimed wait is no giver's heir");
    gift_step(&t, 0, 1, 3);
    // Giver 2 dies before its gift: the broker reclaims its word.
    assert!(t.reclaim(1, 2));
    assert_eq!(t.finish_giver(1), (vec![], vec![]));
    assert_eq!(t.finish_giver(2), (vec![4], vec![]));
    assert_eq!(ended(&t, &a), WaitEnd::Got(1));
    assert_eq!(ended(&t, &b), WaitEnd::Moved);
    assert_eq!(t.give_back(3, None), Some(false));
    assert_eq!(t.give_back(3, None), None, "slot 3 held one");
    all_free(&t);
}

#[test]
fn a_moved_wait_ends_moved_holding_nothing() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let a = registered(&t, 2);
    let b = registered(&t, 3);
    t.close_gate();
    let w = t.waiters();
    assert_eq!(slots(&t), vec![2, 3], "the broker moves in ticket order");
    assert!(t.move_waiter(2, w[0].1));
    assert!(t.move_waiter(3, w[1].1));
    assert!(!t.move_waiter(3, w[1].1), "a wait is moved once");
    assert!(!t.move_waiter(4, 0), "slot 4 never waited");
    assert_eq!(ended(&t, &a), WaitEnd::Moved);
    assert_eq!(ended(&t, &b), WaitEnd::Moved);
    assert_eq!(t.held_word(2), None);
    assert_eq!(t.held_word(3), None);
    // The closed table tells its giver to tell the broker.
    assert_eq!(t.give_back(1, Some(0)), Some(true));
    // The slots are idle again: a later wait in a closed table is sent to
    // the broker at once.
    assert_eq!(t.wait(2, None).unwrap(), WaitEnd::Closed);
}

/// A giver stopped after its claim (step 1) while the broker closes the
/// table and moves its waiters: the claimed wait is no longer the
/// broker's to move (the broker queues nothing for it), and the giver's
/// gift, whenever it comes, ends it `Got(1)`: one token in all.
#[test]
fn a_move_cannot_overtake_a_claimed_gift_the_heir_gets_one_token_in_all() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let rx = registered(&t, 2);
    let rx3 = registered(&t, 3);
    // Giver 1's step 1 only.
    let (h, tk) = claim(&t, 1);
    assert_eq!(h, 2);
    // The broker closes the table and moves its waiters.
    t.close_gate();
    assert_eq!(slots(&t), vec![3], "a claimed wait is not the broker's");
    assert!(!t.move_waiter(2, tk), "the claim came first");
    assert!(t.move_waiter(3, t.waiters()[0].1));
    assert_eq!(ended(&t, &rx3), WaitEnd::Moved);
    // Giver 1 goes on: its gift ends the claimed wait with the token.
    gift_step(&t, 0, 1, 2);
    assert!(wake_step(&t, 2, true));
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1), "{}", dump(&t));
    assert_eq!(t.word(0).load(SeqCst), 2);
    // In the closed table its give-back is told to the broker.
    assert_eq!(t.give_back(2, Some(0)), Some(true));
    assert_eq!(t.word(0).load(SeqCst), FREE);
}

#[test]
fn the_guards_end_ends_every_wait_gone() {
    let (t, guard) = guarded(1, 8);
    assert_eq!(t.take(1, 0), Some(0));
    let rxs: Vec<_> = (2..=8).map(|me| registered(&t, me)).collect();
    drop(guard);
    for rx in &rxs {
        assert_eq!(ended(&t, rx), WaitEnd::Gone);
    }
    // A wait begun after the guard ended never sleeps.
    assert_eq!(t.wait(2, None).unwrap(), WaitEnd::Gone);
    // The holder still holds its word, and may give it back.
    assert_eq!(t.word(0).load(SeqCst), 1);
}

#[test]
fn a_deadline_ends_a_wait_and_leaves_nothing_behind() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let deadline = Instant::now() + Duration::from_millis(20);
    assert_eq!(t.wait(2, Some(deadline)).unwrap(), WaitEnd::TimedOut);
    assert!(t.waiters().is_empty(), "{}", dump(&t));
    assert_eq!(t.state(2).load(SeqCst), IDLE);
    assert_eq!((t.waits_got(), t.waits_cancelled()), (0, 1));
    // The word goes free, not to the slot that left.
    assert_eq!(t.give_back(1, Some(0)), Some(false));
    all_free(&t);
    // A deadline already past: no sleep, nothing left.
    assert_eq!(
        t.wait(2, Some(Instant::now())).unwrap(),
        WaitEnd::Got(1),
        "a free word is taken before the deadline is looked at"
    );
    assert_eq!(t.give_back(2, None), Some(false));
}

#[test]
fn waits_with_deadlines_racing_givers_lose_no_token() {
    // Waits that time out race the givers' claims: a wait either
    // withdraws first (no giver picks it) or is claimed first (its
    // withdrawal waits for the gift), and no token stays behind.
    const WORDS: u32 = 2;
    const CLIENTS: u32 = 8;
    let (t, _guard) = guarded(WORDS, CLIENTS);
    let holding = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let threads: Vec<_> = (1..=CLIENTS)
        .map(|me| {
            let (t, holding, most) = (t.clone(), holding.clone(), most.clone());
            thread::spawn(move || {
                let mut got = 0u32;
                for round in 0..1500u32 {
                    let held = match t.take(me, me) {
                        Some(_) => true,
                        None => {
                            // Deadlines from 0 to 200 µs: many expire.
                            let d = Duration::from_micros(u64::from(round % 5) * 50);
                            match t.wait(me, Some(Instant::now() + d)).expect("wait") {
                                WaitEnd::Got(1) => true,
                                WaitEnd::TimedOut => false,
                                other => panic!("slot {me}: {other:?}"),
                            }
                        }
                    };
                    if held {
                        got += 1;
                        let now = holding.fetch_add(1, SeqCst) + 1;
                        most.fetch_max(now, SeqCst);
                        holding.fetch_sub(1, SeqCst);
                        assert_eq!(t.give_back(me, None), Some(false));
                    }
                }
                got
            })
        })
        .collect();
    let got: u32 = threads.into_iter().map(|th| th.join().unwrap()).sum();
    assert!(got > 0);
    assert!(most.load(SeqCst) <= WORDS);
    all_free(&t);
    assert_eq!(t.header(H_IN_USE).load(SeqCst), 0, "{}", dump(&t));
}

/// Giver 2 claims the only waiter and stops before its gift; giver 1
/// finds nobody unclaimed and frees its word, which another client takes.
/// Giver 2's late steps still end that wait with its own token, and once
/// the heir waits again (a new ticket), nothing of giver 2's old claim
/// can touch the new wait: the old claim's swap fails, and the new wait
/// ends with the next token given back.
#[test]
fn a_late_step_two_does_not_end_the_heirs_next_wait() {
    let (t, _guard) = guarded(2, 4);
    assert_eq!(t.take(1, 0), Some(0));
    assert_eq!(t.take(2, 1), Some(1));
    let rx = registered(&t, 3);
    // Giver 2's step 1, then it stops.
    let (h, old) = claim(&t, 2);
    assert_eq!(h, 3);
    // Giver 1 finds no unclaimed waiter: its word goes free.
    assert_eq!(t.give_back(1, Some(0)), Some(false));
    assert_eq!(t.word(0).load(SeqCst), FREE, "{}", dump(&t));
    assert_eq!(t.handoffs(), 0);
    assert_eq!(t.take(4, 0), Some(0), "another client takes it");
    // Giver 2 goes on with its steps 2 and 3.
    gift_step(&t, 1, 2, 3);
    assert!(wake_step(&t, 3, true));
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1), "one gift claimed");
    assert_eq!(t.word(1).load(SeqCst), 3);
    // The heir gives its token back (nobody waits: freed); client 4 takes it.
    assert_eq!(t.give_back(3, None), Some(false));
    assert_eq!(t.take(4, 1), Some(1));
    // The heir waits again, for a second token.
    let rx = registered(&t, 3);
    // Giver 2's old claim is spent: its swap on the old ticket fails, so
    // no step of it reaches the new wait.
    assert!(t
        .ticket(3)
        .compare_exchange(old, CLAIMED | 2, SeqCst, SeqCst)
        .is_err());
    assert_eq!(slots(&t), vec![3]);
    // Nothing moved the heir: its wait goes on until a token comes.
    assert_eq!(t.give_back(4, Some(0)), Some(false));
    assert_eq!(
        ended(&t, &rx),
        WaitEnd::Got(1),
        "the wait ends with the token given back, not Moved: {}",
        dump(&t)
    );
    assert_eq!(t.give_back(3, None), Some(false));
    assert_eq!(t.give_back(4, None), Some(false));
    all_free(&t);
}

/// Giver 1 hands its token to slot 2; slot 2's ticket word keeps the
/// claim `CLAIMED | 1` after that wait ends. Slot 2 starts its next wait
/// (its state says waiting; its new ticket is not yet stored) and giver 1
/// dies: `finish_giver(1)` must not take the old claim for one of its
/// live hand-offs, nor move a wait nobody claimed.
#[test]
fn a_dead_givers_claim_on_an_earlier_wait_moves_nothing() {
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    let rx = registered(&t, 2);
    assert_eq!(t.give_back(1, Some(0)), Some(false));
    assert_eq!(ended(&t, &rx), WaitEnd::Got(1));
    // Slot 2's next wait, its first instruction (`wait_from`).
    let waiting = t.tid().unwrap() | FUTEX_WAITERS;
    t.state(2)
        .compare_exchange(IDLE, waiting, SeqCst, SeqCst)
        .expect("slot 2 idle");
    // Giver 1 dies: the broker finishes what it left.
    assert_eq!(
        t.finish_giver(1),
        (vec![], vec![]),
        "nothing of giver 1's is half done: {}",
        dump(&t)
    );
}

/// A process that counts the wake signals it gets: each appends a line
/// to `file` (its shell handles one signal at a time, between sleeps).
fn signal_counter(file: &std::path::Path) -> std::process::Child {
    let script = format!(
        "trap 'echo u >> {}' URG; echo ready >> {0}; while :; do sleep 0.01; done",
        file.display()
    );
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .spawn()
        .expect("sh");
    let start = Instant::now();
    while signals_counted(file).is_none() {
        assert!(start.elapsed() < PATIENCE, "the counter never started");
        thread::sleep(Duration::from_millis(5));
    }
    child
}

/// The wake signals counted so far, once the counter has started.
fn signals_counted(file: &std::path::Path) -> Option<usize> {
    let text = std::fs::read_to_string(file).ok()?;
    let mut lines = text.lines();
    (lines.next() == Some("ready")).then(|| lines.count())
}

#[test]
fn a_dead_givers_heir_is_woken_once_however_often_the_broker_looks_again() {
    let dir = std::env::temp_dir().join(format!("herdless-rewake-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let file = dir.join("signals");
    let mut counter = signal_counter(&file);
    let (t, _guard) = guarded(1, 4);
    assert_eq!(t.take(1, 0), Some(0));
    // Slot 2 waits in a poll loop: its giver wakes it with a signal to
    // the counting process.
    let pid = counter.id();
    let w = match t.poll_start(2, pid, &|| {}) {
        PollStep::Waiting(w) => w,
        other => panic!("slot 2 should wait: {other:?}"),
    };
    // Giver 1 claims, gifts and marks the heir woken, then dies before
    // its signal.
    assert_eq!(claim(&t, 1).0, 2);
    gift_step(&t, 0, 1, 2);
    assert!(wake_step(&t, 2, false));
    assert_eq!(t.finish_giver(1), (vec![], vec![]));
    let start = Instant::now();
    while signals_counted(&file) != Some(1) {
        assert!(start.elapsed() < PATIENCE, "the heir was never woken");
        thread::sleep(Duration::from_millis(5));
    }
    // The heir is busy and has not taken its gift yet: the broker's later
    // sweeps find the dead giver's gift again, and wake nobody.
    for _ in 0..3 {
        assert_eq!(t.finish_giver_again(1), (vec![], vec![]));
        thread::sleep(Duration::from_millis(300));
    }
    let woken = signals_counted(&file);
    let _ = counter.kill();
    let _ = counter.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(woken, Some(1), "one wake-up for one gift");
    // The heir takes its gift when it looks.
    match t.poll_check(2, w, &|| {}) {
        PollStep::Ended(WaitEnd::Got(1)) => {}
        other => panic!("the heir's gift: {other:?}, {}", dump(&t)),
    }
    assert_eq!(t.word(0).load(SeqCst), 2, "the heir holds the word");
    assert_eq!(t.give_back(2, None), Some(false));
    all_free(&t);
}

/// Slot `me` starts a wait without sleeping (a poll loop's registration):
/// its ticket.
fn start_wait(t: &Table, me: u32) -> u32 {
    t.register(me, t.tid().expect("a guard"), 0)
        .unwrap_or_else(|e| panic!("slot {me} could not wait: {e:?}, {}", dump(t)))
}

/// The heir the ring names by itself, without the look at every slot.
fn ring_says(t: &Table) -> Option<(u32, u32)> {
    let head = t.ring_head().load(SeqCst) & TICKET_MASK;
    let next = t.ticket(0).load(SeqCst) & TICKET_MASK;
    t.ring_heir(t.tid().expect("a guard"), head, next)
}

#[test]
fn the_ring_names_the_oldest_waiter_past_ended_waits_and_round_its_end() {
    let (t, _guard) = guarded(1, 8);
    let tid = t.tid().expect("a guard");
    let r = ring_len(t.slots());
    // Slot 2 waits first and stays; slots 3 to 8 start and withdraw waits,
    // many times round the ring.
    let first = start_wait(&t, 2);
    for round in 0..3 * r {
        let me = 3 + round % 6;
        let tk = start_wait(&t, me);
        assert_eq!(t.heir(tid), Some((2, first)), "round {round}: {}", dump(&t));
        assert!(matches!(t.leave(me, tid, tk, true), Leave::Withdrawn));
    }
    // The oldest waiter's entry was overwritten: the look at every slot
    // found it each time, and the head stayed at its ticket.
    assert_eq!(t.ring_head().load(SeqCst) & TICKET_MASK, first);
    // Waits that start now are in the ring, in their order, once the ones
    // before them end.
    let tickets: Vec<(u32, u32)> = (3..=8).map(|me| (me, start_wait(&t, me))).collect();
    assert_eq!(t.heir(tid), Some((2, first)));
    t.ticket(2)
        .compare_exchange(first, CLAIMED | 1, SeqCst, SeqCst)
        .expect("slot 2's wait");
    assert!(wake_step(&t, 2, false));
    for (n, &(me, tk)) in tickets.iter().enumerate() {
        assert_eq!(t.waiters()[0], (me, tk));
        if n == 0 {
            // The head is further behind than the ring is long: the ring
            // cannot say, and the look at every slot moves the head.
            assert_eq!(ring_says(&t), None);
        } else {
            // The walk moves the head past the claimed wait to this one.
            assert_eq!(ring_says(&t), Some((me, tk)), "{}", dump(&t));
        }
        assert_eq!(t.heir(tid), Some((me, tk)));
        assert_eq!(t.ring_head().load(SeqCst) & TICKET_MASK, tk);
        t.ticket(me)
            .compare_exchange(tk, CLAIMED | 1, SeqCst, SeqCst)
            .expect("the heir's wait");
        assert!(wake_step(&t, me, false));
    }
    assert_eq!(t.heir(tid), None, "{}", dump(&t));
}

#[test]
fn a_wait_whose_ring_entry_is_not_written_keeps_its_place() {
    let (t, _guard) = guarded(1, 8);
    let tid = t.tid().expect("a guard");
    assert_eq!(t.take(1, 0), Some(0));
    // Slot 2 between its ticket and its ring entry (stopped there, or
    // killed), slot 3 behind it.
    assert!(t
        .state(2)
        .compare_exchange(IDLE, tid | FUTEX_WAITERS, SeqCst, SeqCst)
        .is_ok());
    let t2 = t.draw_ticket(2);
    let t3 = start_wait(&t, 3);
    // The ring cannot say; the look at every slot finds slot 2.
    assert_eq!(ring_says(&t), None);
    assert_eq!(t.heir(tid), Some((2, t2)));
    // Slot 2 between its state and its ticket: nobody knows its ticket yet,
    // so the head stays where it is.
    let (t4, stay) = {
        assert!(t
            .state(4)
            .compare_exchange(IDLE, tid | FUTEX_WAITERS, SeqCst, SeqCst)
            .is_ok());
        let head = t.ring_head().load(SeqCst);
        t.clear_slot(2, false);
        assert_eq!(t.heir(tid), Some((3, t3)));
        (t.draw_ticket(4), head)
    };
    assert_eq!(t.ring_head().load(SeqCst), stay, "{}", dump(&t));
    t.note_wait(4, t4);
    // Slot 2 died and the broker reset its slot: the head moves to slot
    // 3, and the ring names it, then slot 4.
    assert_eq!(t.heir(tid), Some((3, t3)));
    assert_eq!(ring_says(&t), Some((3, t3)));
    assert_eq!(t.give_back(1, Some(0)), Some(false));
    assert_eq!(t.word(0).load(SeqCst), gift(1, 3));
    assert_eq!(ring_says(&t), Some((4, t4)));
}

#[test]
fn a_scribbled_ring_crashes_no_giver_and_the_look_at_every_slot_still_finds_the_waiter() {
    let (t, _guard) = guarded(1, 8);
    let tid = t.tid().expect("a guard");
    let base = ring_base(t.words(), t.slots());
    let len = ring_len(t.slots());
    let values = [
        0,
        u32::MAX,
        TICKET_MASK,
        ring_entry(0, 9),
        ring_entry(0, RING_SLOT_MASK),
        ring_entry(1, 2),
        CLAIMED,
    ];
    for (round, &v) in values.iter().enumerate() {
        let round = round as u32;
        assert_eq!(t.take(1, 0), Some(0));
        let tk = start_wait(&t, 2);
        let other = start_wait(&t, 3);
        // Every ring word and the head scribbled over.
        for i in 0..=len {
            t.raw_word(base + i)
                .expect("a ring word")
                .store(v.rotate_left(i + round), SeqCst);
        }
        assert_eq!(t.heir(tid), Some((2, tk)), "value {v:#x}: {}", dump(&t));
        assert_eq!(t.give_back(1, Some(0)), Some(false));
        assert_eq!(t.word(0).load(SeqCst), gift(1, 2));
        // The heir takes its gift, the other waiter gets it next.
        assert!(t.claim_gift(2, 1));
        assert!(matches!(t.ended(2, tid), Ended::Got) || t.word(0).load(SeqCst) == 2);
        assert_eq!(t.heir(tid), Some((3, other)), "value {v:#x}: {}", dump(&t));
        assert!(matches!(t.leave(3, tid, other, true), Leave::Withdrawn));
        t.state(2).store(IDLE, SeqCst);
        t.ticket(2).store(WITHDRAWN, SeqCst);
        assert_eq!(t.give_back(2, Some(0)), Some(false));
        all_free(&t);
    }
}

#[test]
fn the_look_at_every_slot_never_moves_the_head_past_a_wait_it_saw_drawn_late() {
    let (t, _guard) = guarded(1, 8);
    let tid = t.tid().expect("a guard");
    // Nobody waits: the head is at the counter.
    let head = t.ring_head().load(SeqCst);
    let next = t.ticket(0).load(SeqCst) & TICKET_MASK;
    assert_eq!(head & TICKET_MASK, next);
    // Two waits start after a giver read the counter, the higher slot
    // first: to the look both are younger than its read, and it names the
    // lower slot.
    let t7 = start_wait(&t, 7);
    let t2 = start_wait(&t, 2);
    assert_eq!(t.scan_heir(tid, head, next), Some((2, t2)));
    // The head stays at the counter it read, so the ring still names the
    // older wait first.
    assert_eq!(t.ring_head().load(SeqCst) & TICKET_MASK, next);
    assert_eq!(ring_says(&t), Some((7, t7)), "{}", dump(&t));
    // A head scribbled on (a bit above the ticket's) is put back by the
    // next look.
    t.ring_head().store(CLAIMED | 12345, SeqCst);
    assert_eq!(ring_says(&t), None);
    assert_eq!(t.heir(tid), Some((7, t7)));
    assert_eq!(t.ring_head().load(SeqCst), t7);
    assert_eq!(ring_says(&t), Some((7, t7)));
}
