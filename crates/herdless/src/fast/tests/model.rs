//! The hand-off step by step: waiters that register, look, sleep and are
//! woken; givers that stop (or die) between their three steps (claim,
//! gift, wake); a broker
//! that moves waiters to its queue, grants over the socket, reopens the
//! table and repairs what dead clients left. Every instruction the real
//! code runs between two steps is the table's own; the model drives the
//! order. After every step no token is lost or counted twice, and after
//! everything settles nobody sleeps in the table while a token is free,
//! and every token comes back.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

const CLIENTS: u32 = 5;
const WORDS: u32 = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Take a free word (the fast path).
    Take(u32),
    /// Start a wait: mark the slot waiting; once it is, draw a ticket.
    Register(u32),
    /// A registered waiter runs once through its checks (or after a wake).
    Look(u32),
    /// A waiter's deadline passes.
    Timeout(u32),
    /// A whole give-back (the table's `give_back`).
    Give(u32),
    /// A giver's step 1 only: it claims the oldest waiter's ticket.
    Step1(u32),
    /// A giver's step 2: its word becomes the gift to the heir it claimed.
    Step2(u32),
    /// A giver's step 3: the heir's state woken (and, when that fails, the
    /// gift taken back and the give-back started over).
    Step3(u32),
    /// The client dies wherever it is; the broker repairs.
    Kill(u32),
    /// A new client in a dead client's slot.
    Respawn(u32),
    /// A client kept to the socket asks: the table closes and its waiters
    /// move to the queue.
    SocketAsk,
    /// A token held over the socket goes back.
    SocketRelease(u32),
}

/// The ops; `deaths`: with kills and new clients in dead clients' slots.
fn op(deaths: bool) -> impl Strategy<Value = Op> {
    let k = 1..=CLIENTS;
    prop_oneof![
        3 => k.clone().prop_map(Op::Take),
        4 => k.clone().prop_map(Op::Register),
        5 => k.clone().prop_map(Op::Look),
        1 => k.clone().prop_map(Op::Timeout),
        3 => k.clone().prop_map(Op::Give),
        3 => k.clone().prop_map(Op::Step1),
        3 => k.clone().prop_map(Op::Step2),
        3 => k.clone().prop_map(Op::Step3),
        1 => k.clone().prop_map(move |k| if deaths { Op::Kill(k) } else { Op::Look(k) }),
        1 => k.clone().prop_map(move |k| if deaths { Op::Respawn(k) } else { Op::Timeout(k) }),
        1 => Just(Op::SocketAsk),
        2 => (0..=CLIENTS).prop_map(Op::SocketRelease),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    /// Its state says waiting; no ticket drawn yet.
    Registering,
    /// Waiting in the table with this ticket (asleep, looking, or waiting
    /// for the giver that claimed it).
    Waiting(u32),
    /// Moved to the broker's queue: a socket grant is its token.
    Queued,
}

#[derive(Debug, Clone)]
struct Cl {
    alive: bool,
    phase: Phase,
    /// Table words it believes it holds.
    held: u32,
    /// Tokens granted over the socket and held.
    socket: u32,
    /// Grants sent over the socket and not yet read.
    inbox: u32,
    /// Grants it never asked for, kept as spares (what the real client
    /// does with one).
    spare: u32,
    /// A give-back stopped between its steps: (word, heir, whether the
    /// gift is written).
    pending: Option<(u32, u32, bool)>,
    /// Its wait's ring entry is written (a waiter writes it after its
    /// ticket, before it looks).
    noted: bool,
}

struct World {
    /// Dropped before the table: its end marks the table's words.
    _guard: DeathGuard,
    t: Table,
    tid: u32,
    cl: Vec<Cl>,
    /// The broker's pool: free tokens not lent.
    pool: u32,
    lent: Vec<bool>,
    /// The broker's queue: client slots, 0 for the socket-only client.
    queue: VecDeque<u32>,
    /// Tokens the socket-only client holds.
    socket_only: u32,
    /// Grants to clients that had not asked.
    unsolicited: u32,
    /// Whether a giver's steps may come as late as the schedule says. When
    /// not, a stopped giver's steps are run before its heir's next move.
    stale_steps: bool,
    /// Dead givers finished once (`FastState::finished_givers`): a later
    /// sweep finishes them again without waking their heirs again.
    finished: Vec<bool>,
    log: Vec<String>,
}

impl World {
    fn new(stale_steps: bool) -> World {
        let t = Table::create(WORDS, CLIENTS).expect("a table");
        let guard = t.guard().expect("a guard (Linux)");
        let tid = guard.tid();
        t.set_hi(CLIENTS);
        // The broker clears each slot as it admits its client.
        for k in 1..=CLIENTS {
            t.clear_slot(k, false);
        }
        let idle = Cl {
            alive: true,
            phase: Phase::Idle,
            held: 0,
            socket: 0,
            inbox: 0,
            spare: 0,
            pending: None,
            noted: true,
        };
        let mut w = World {
            t,
            _guard: guard,
            tid,
            cl: vec![idle; CLIENTS as usize + 1],
            pool: WORDS,
            lent: vec![false; WORDS as usize],
            queue: VecDeque::new(),
            socket_only: 0,
            unsolicited: 0,
            stale_steps,
            finished: vec![false; CLIENTS as usize + 1],
            log: Vec::new(),
        };
        w.reopen();
        w
    }

    fn waiting(&self) -> u32 {
        self.tid | FUTEX_WAITERS
    }

    fn c(&mut self, k: u32) -> &mut Cl {
        &mut self.cl[k as usize]
    }

    /// The broker: while nobody is queued, lend the pool and open.
    fn reopen(&mut self) {
        if !self.queue.is_empty() {
            return;
        }
        self.t.open_gate();
        for i in 0..WORDS {
            if self.pool > 0 && !self.lent[i as usize] {
                self.lent[i as usize] = true;
                self.pool -= 1;
                self.t.lend(i);
            }
        }
    }

    /// The broker closes the table: moves its waiters in ticket order,
    /// then takes back the free words.
    fn close(&mut self) {
        self.t.close_gate();
        for (k, tk) in self.t.waiters() {
            if self.cl[k as usize].alive && self.t.move_waiter(k, tk) {
                self.log.push(format!("  moved slot {k}"));
                self.queue.push_back(k);
            }
        }
        self.sweep();
    }

    /// The broker repairs what dead giver `g` left half done: the waits
    /// it claimed without a gift join the queue; freed words are handed
    /// on by the sweep.
    fn finish_giver(&mut self, g: u32) -> bool {
        let again = std::mem::replace(&mut self.finished[g as usize], true);
        let (moved, freed) = if again {
            self.t.finish_giver_again(g)
        } else {
            self.t.finish_giver(g)
        };
        if !moved.is_empty() || !freed.is_empty() {
            self.log.push(format!(
                "  finish_giver({g}): moved {moved:?} freed {freed:?}"
            ));
        }
        for k in moved {
            if self.cl[k as usize].alive {
                self.queue.push_back(k);
            }
        }
        !freed.is_empty()
    }

    /// The broker's sweep (`fast_sweep`): gifts whose heir is gone
    /// reclaimed, those whose giver is gone finished, free words taken
    /// back when closed or handed on when open.
    fn sweep(&mut self) {
        let mut dead_givers = Vec::new();
        for i in 0..WORDS {
            if !self.lent[i as usize] {
                continue;
            }
            let v = self.t.word(i).load(SeqCst);
            if let Some((g, h)) = as_gift(v) {
                if !self.cl[h as usize].alive {
                    self.t.reclaim(i, v);
                } else if g != BROKER_GIVER && !self.cl[g as usize].alive {
                    dead_givers.push(g);
                }
            }
            let v = self.t.word(i).load(SeqCst);
            if v == FREE {
                if self.t.is_open() {
                    self.t.hand_on(i, FREE, BROKER_GIVER);
                } else if self.t.take_back(i) {
                    self.lent[i as usize] = false;
                    self.pool += 1;
                }
            }
        }
        let mut freed = false;
        for g in dead_givers {
            freed |= self.finish_giver(g);
        }
        if freed {
            self.sweep();
        }
    }

    /// The broker grants its pool to its queue, in order.
    fn grant(&mut self) {
        while self.pool > 0 {
            let Some(k) = self.queue.pop_front() else {
                break;
            };
            self.pool -= 1;
            if k == 0 {
                self.socket_only += 1;
                continue;
            }
            self.c(k).inbox += 1;
        }
    }

    /// Clients read their sockets: a grant answers a queued ask; one that
    /// comes to a client that asked for nothing is a spare.
    fn read_sockets(&mut self) {
        for k in 1..=CLIENTS {
            let c = &mut self.cl[k as usize];
            if c.inbox == 0 {
                continue;
            }
            match c.phase {
                Phase::Queued => {
                    c.inbox -= 1;
                    c.socket += 1;
                    c.phase = Phase::Idle;
                }
                Phase::Idle => {
                    c.spare += c.inbox;
                    self.unsolicited += c.inbox;
                    c.inbox = 0;
                }
                // Reads its socket once the wait in the table ends.
                Phase::Waiting(_) | Phase::Registering => {}
            }
        }
    }

    /// A wait that ended: what the client does with the answer.
    fn ended(&mut self, k: u32, end: WaitEnd) {
        self.log.push(format!("  slot {k} wait ended {end:?}"));
        let c = self.c(k);
        match end {
            WaitEnd::Got(n) => {
                assert_eq!(n, 1, "one token per wait");
                c.held += 1;
                c.phase = Phase::Idle;
            }
            WaitEnd::Moved => c.phase = Phase::Queued,
            WaitEnd::TimedOut | WaitEnd::Closed => c.phase = Phase::Idle,
            WaitEnd::Gone => {
                panic!("slot {k}: {end:?} while the guard lives: {}", self.dump())
            }
        }
    }

    /// What `wait_from` makes of a claimed wait's end (`Again`: it
    /// registers again, as `again` says: `None` for the end `otherwise`).
    fn finish(&mut self, k: u32, e: Ended, otherwise: Option<WaitEnd>) {
        let end = match e {
            Ended::Got => WaitEnd::Got(1),
            Ended::Moved => WaitEnd::Moved,
            Ended::Gone => WaitEnd::Gone,
            Ended::Again => match otherwise {
                Some(end) => end,
                None => {
                    self.log.push(format!("  slot {k} woken with nothing"));
                    self.c(k).phase = Phase::Idle;
                    self.register(k, true);
                    return;
                }
            },
        };
        self.ended(k, end);
    }

    /// Whether slot `k`'s wait was claimed and its claimer has not yet
    /// woken it: `ended` sleeps until it does.
    fn blocked(&self, k: u32, tk: u32) -> bool {
        self.t.ticket(k).load(SeqCst) != tk && self.t.state(k).load(SeqCst) == self.waiting()
    }

    /// `wait_from`'s registration, its first half: the state (`again`: a
    /// wait that goes round its loop, which ends `Closed` in a closed
    /// table, and the client asks the broker).
    fn register(&mut self, k: u32, again: bool) {
        if !self.t.is_open() {
            if again {
                self.ended(k, WaitEnd::Closed);
                self.c(k).phase = Phase::Queued;
                self.queue.push_back(k);
            }
            return;
        }
        if self
            .t
            .state(k)
            .compare_exchange(IDLE, self.waiting(), SeqCst, SeqCst)
            .is_err()
        {
            self.ended(k, WaitEnd::Gone);
        } else {
            self.c(k).phase = Phase::Registering;
        }
    }

    /// One step, then what the broker does after the event: grant from
    /// its pool to its queue, and reopen the table when nobody is queued.
    fn step(&mut self, op: &Op) {
        self.log.push(format!("{op:?}"));
        self.act(op);
        self.grant();
        self.reopen();
        self.read_sockets();
    }

    /// Runs every stopped step of the givers whose heir is `h`.
    fn run_pending_to(&mut self, h: u32) {
        for g in 1..=CLIENTS {
            while self.cl[g as usize].alive
                && self.cl[g as usize]
                    .pending
                    .is_some_and(|(_, to, _)| to == h)
            {
                let gifted = self.cl[g as usize].pending.is_some_and(|p| p.2);
                let op = if gifted { Op::Step3(g) } else { Op::Step2(g) };
                self.log.push(format!("  first {op:?}"));
                self.act(&op);
            }
        }
    }

    fn act(&mut self, op: &Op) {
        let waiting = self.waiting();
        if !self.stale_steps {
            if let Op::Look(h) | Op::Timeout(h) | Op::Register(h) = *op {
                self.run_pending_to(h);
            }
        }
        match *op {
            Op::Take(k) => {
                let c = &self.cl[k as usize];
                if c.alive
                    && c.phase == Phase::Idle
                    && c.pending.is_none()
                    && self.t.take(k, k).is_some()
                {
                    self.c(k).held += 1;
                }
            }
            Op::Register(k) => {
                let c = &self.cl[k as usize];
                if !c.alive || c.pending.is_some() {
                    return;
                }
                match c.phase {
                    Phase::Idle => self.register(k, false),
                    Phase::Registering => self.draw(k),
                    _ => {
                        self.note(k);
                    }
                }
            }
            Op::Look(k) => {
                let c = &self.cl[k as usize];
                if !c.alive || self.note(k) {
                    return;
                }
                let c = &self.cl[k as usize];
                let tk = match c.phase {
                    Phase::Registering => return self.draw(k),
                    Phase::Waiting(tk) => tk,
                    _ => return,
                };
                // One pass of `wait_from`'s loop.
                let closed = !self.t.is_open();
                let free = !closed && (0..WORDS).any(|i| self.t.word(i).load(SeqCst) == FREE);
                if closed || free {
                    if self.blocked(k, tk) {
                        return;
                    }
                    match self.t.leave(k, self.tid, tk, true) {
                        Leave::Withdrawn if closed => {
                            self.ended(k, WaitEnd::Closed);
                            // The client asks the broker.
                            self.c(k).phase = Phase::Queued;
                            self.queue.push_back(k);
                        }
                        Leave::Withdrawn | Leave::InFlight => {
                            if self.t.take(k, 0).is_some() {
                                self.ended(k, WaitEnd::Got(1));
                            } else {
                                // Registers again at once.
                                self.c(k).phase = Phase::Idle;
                                self.register(k, true);
                            }
                        }
                        Leave::Ended(e) => self.finish(k, e, None),
                    }
                } else if self.t.state(k).load(SeqCst) != waiting
                    || self.t.ticket(k).load(SeqCst) != tk
                {
                    if self.blocked(k, tk) {
                        return;
                    }
                    let e = self.t.ended(k, self.tid);
                    self.finish(k, e, None);
                }
            }
            Op::Timeout(k) => {
                let c = &self.cl[k as usize];
                if !c.alive || self.note(k) {
                    return;
                }
                let c = &self.cl[k as usize];
                match c.phase {
                    // Between the state and the ticket a waiter makes no
                    // call that sleeps: it draws its ticket first.
                    Phase::Registering => self.draw(k),
                    Phase::Waiting(tk) if !self.blocked(k, tk) => {
                        match self.t.leave(k, self.tid, tk, true) {
                            Leave::Withdrawn | Leave::InFlight => self.ended(k, WaitEnd::TimedOut),
                            Leave::Ended(e) => self.finish(k, e, Some(WaitEnd::TimedOut)),
                        }
                    }
                    _ => {}
                }
            }
            Op::Give(k) => {
                let c = &self.cl[k as usize];
                if c.alive && c.held > 0 && c.pending.is_none() {
                    self.c(k).held -= 1;
                    let r = self.t.give_back(k, None);
                    assert!(r.is_some(), "slot {k} held a word: {}", self.dump());
                    if r == Some(true) {
                        self.sweep();
                    }
                }
            }
            Op::Step1(k) => {
                let c = &self.cl[k as usize];
                if !c.alive || c.held == 0 || c.pending.is_some() || !self.t.is_open() {
                    return;
                }
                let Some((h, tk)) = self.t.heir(self.tid) else {
                    return;
                };
                // The heir is the oldest waiter.
                let oldest = self.t.waiters()[0];
                assert_eq!((h, tk), oldest, "FIFO: {}", self.dump());
                let i = self.t.held_word(k).expect("a word it holds");
                self.t
                    .ticket(h)
                    .compare_exchange(tk, CLAIMED | k, SeqCst, SeqCst)
                    .expect("one step: nobody claims between the look and the swap");
                self.c(k).pending = Some((i, h, false));
            }
            Op::Step2(k) => {
                let c = &self.cl[k as usize];
                let Some((i, h, false)) = c.pending.filter(|_| c.alive) else {
                    return;
                };
                let gifted = self
                    .t
                    .word(i)
                    .compare_exchange(k, gift(k, h), SeqCst, SeqCst)
                    .is_ok();
                assert!(gifted, "giver {k} lost word {i}: {}", self.dump());
                let c = self.c(k);
                c.held -= 1;
                c.pending = Some((i, h, true));
            }
            Op::Step3(k) => {
                let c = &self.cl[k as usize];
                let Some((i, h, true)) = c.pending.filter(|_| c.alive) else {
                    return;
                };
                self.c(k).pending = None;
                if self
                    .t
                    .state(h)
                    .compare_exchange(waiting, waiting | FUTEX_OWNER_DIED, SeqCst, SeqCst)
                    .is_ok()
                {
                    self.t.header64(H_HANDOFFS).fetch_add(1, SeqCst);
                    let _ = self.t.seg.wake_one(self.t.state_index(h));
                    return;
                }
                // The heir's slot was reset: the gift goes back, and on
                // (`hand_on`'s loop; if the broker freed it first, it
                // hands it on itself).
                if self
                    .t
                    .word(i)
                    .compare_exchange(gift(k, h), k, SeqCst, SeqCst)
                    .is_ok()
                {
                    self.log.push(format!("  giver {k} took its gift back"));
                    match self.t.hand_on(i, k, k) {
                        HandOn::Handed => {}
                        HandOn::Freed | HandOn::Taken => {
                            if !self.t.is_open() {
                                self.sweep();
                            }
                        }
                        HandOn::Lost => panic!("giver {k} lost word {i}: {}", self.dump()),
                    }
                }
            }
            Op::Kill(k) => {
                if !self.cl[k as usize].alive {
                    return;
                }
                let c = self.c(k);
                c.alive = false;
                c.pending = None;
                c.held = 0;
                let back = c.socket + c.spare + c.inbox;
                c.socket = 0;
                c.spare = 0;
                c.inbox = 0;
                c.phase = Phase::Idle;
                self.queue.retain(|&q| q != k);
                self.pool += back;
                // `fast_forget`.
                self.t.clear_slot(k, false);
                for i in 0..WORDS {
                    if !self.lent[i as usize] {
                        continue;
                    }
                    let v = self.t.word(i).load(SeqCst);
                    match as_gift(v) {
                        Some((_, h)) if h == k => {
                            self.t.reclaim(i, v);
                        }
                        Some((g, _)) if g == k => {}
                        _ => {
                            self.t.reclaim(i, k);
                        }
                    }
                }
                self.finish_giver(k);
                self.sweep();
            }
            Op::Respawn(k) => {
                if self.cl[k as usize].alive {
                    return;
                }
                // `fast_admit`.
                self.t.clear_slot(k, false);
                self.finished[k as usize] = false;
                let c = self.c(k);
                c.alive = true;
            }
            Op::SocketAsk => {
                // `fast_take_back_for_socket`, then the ask queues behind
                // the moved waiters.
                self.close();
                self.queue.push_back(0);
            }
            Op::SocketRelease(k) => {
                if k == 0 {
                    if self.socket_only > 0 {
                        self.socket_only -= 1;
                        self.pool += 1;
                    }
                    return;
                }
                let c = self.c(k);
                if c.alive && c.socket > 0 {
                    c.socket -= 1;
                    self.pool += 1;
                }
            }
        }
    }

    /// `wait_from`'s registration, its second step: the ticket.
    fn draw(&mut self, k: u32) {
        let tk = self.t.draw_ticket(k);
        self.c(k).phase = Phase::Waiting(tk);
        self.c(k).noted = false;
    }

    /// The registration's last step, the wait's ring entry, if it is still
    /// to do: whether it was.
    fn note(&mut self, k: u32) -> bool {
        let c = &self.cl[k as usize];
        match c.phase {
            Phase::Waiting(tk) if !c.noted => {
                self.t.note_wait(k, tk);
                self.c(k).noted = true;
                true
            }
            _ => false,
        }
    }

    /// Tokens everywhere: lent words not free are held or gifts; with the
    /// pool and what the socket holds, the capacity, once each.
    fn check(&self) -> Result<(), TestCaseError> {
        let mut in_words = 0;
        for i in 0..WORDS {
            let v = self.t.word(i).load(SeqCst);
            if !self.lent[i as usize] {
                prop_assert_eq!(v, OUT, "word {} not lent: {}", i, self.dump());
                continue;
            }
            prop_assert_ne!(v, OUT, "lent word {}: {}", i, self.dump());
            in_words += 1;
            if v != FREE && as_gift(v).is_none() {
                prop_assert!(
                    self.cl[v as usize].alive,
                    "word {} held by dead slot {}: {}",
                    i,
                    v,
                    self.dump()
                );
            }
        }
        let socket: u32 = self.cl.iter().map(|c| c.socket + c.spare + c.inbox).sum();
        prop_assert_eq!(
            in_words + self.pool + socket + self.socket_only,
            WORDS,
            "conservation: {}",
            self.dump()
        );
        for k in 1..=CLIENTS {
            let c = &self.cl[k as usize];
            let words = (0..WORDS)
                .filter(|&i| self.t.word(i).load(SeqCst) == k)
                .count() as u32;
            prop_assert_eq!(words, c.held, "slot {} holds: {}", k, self.dump());
            if c.alive && c.phase == Phase::Queued {
                prop_assert!(
                    self.queue.contains(&k) || c.inbox > 0,
                    "slot {} waits for a grant the broker never queued: {}",
                    k,
                    self.dump()
                );
            }
        }
        if !self.queue.is_empty() {
            prop_assert_eq!(self.pool, 0, "a free token while {:?} queue", self.queue);
        }
        Ok(())
    }

    /// Runs every stopped step to its end, every waiter through its checks
    /// until nothing changes: then nobody sleeps while a token is free.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..50 {
            for k in 1..=CLIENTS {
                self.step(&Op::Step2(k));
                self.step(&Op::Step3(k));
                self.step(&Op::Look(k));
            }
            self.check()?;
        }
        // Every gift was claimed, taken back or repaired, and every claim
        // ended.
        for k in 1..=CLIENTS {
            let c = &self.cl[k as usize];
            if let (true, Phase::Waiting(tk)) = (c.alive, c.phase) {
                prop_assert_eq!(
                    self.t.ticket(k).load(SeqCst),
                    tk,
                    "slot {} sleeps claimed: {}",
                    k,
                    self.dump()
                );
            }
        }
        for i in 0..WORDS {
            let v = self.t.word(i).load(SeqCst);
            prop_assert!(
                as_gift(v).is_none(),
                "word {} left a gift: {}",
                i,
                self.dump()
            );
        }
        let asleep: Vec<u32> = (1..=CLIENTS)
            .filter(|&k| {
                matches!(
                    self.cl[k as usize].phase,
                    Phase::Waiting(_) | Phase::Registering
                )
            })
            .collect();
        if !asleep.is_empty() {
            prop_assert!(
                self.t.is_open(),
                "asleep in a closed table: {}",
                self.dump()
            );
            for i in 0..WORDS {
                prop_assert_ne!(
                    self.t.word(i).load(SeqCst),
                    FREE,
                    "{:?} asleep with word {} free: {}",
                    asleep,
                    i,
                    self.dump()
                );
            }
            prop_assert_eq!(
                self.pool,
                0,
                "asleep with tokens in the pool: {}",
                self.dump()
            );
        }
        Ok(())
    }

    fn dump(&self) -> String {
        let words: Vec<String> = (0..WORDS)
            .map(|i| format!("{:#x}", self.t.word(i).load(SeqCst)))
            .collect();
        let states: Vec<String> = (1..=CLIENTS)
            .map(|k| {
                format!(
                    "{k}:{:#x}/{:#x}",
                    self.t.state(k).load(SeqCst),
                    self.t.ticket(k).load(SeqCst)
                )
            })
            .collect();
        let tail: Vec<&String> = self.log.iter().rev().take(30).rev().collect();
        format!(
            "words {words:?} states {states:?} gate {} pool {} queue {:?} socket-only {} \
             clients {:?}\nlast steps {tail:#?}",
            u8::from(!self.t.is_open()),
            self.pool,
            self.queue,
            self.socket_only,
            &self.cl[1..]
        )
    }
}

fn run(ops: &[Op], strict: bool) -> Result<(), TestCaseError> {
    let mut w = World::new(strict);
    for op in ops {
        w.step(op);
        w.check()?;
        if strict {
            prop_assert_eq!(w.unsolicited, 0, "a grant nobody asked for: {}", w.dump());
        }
    }
    w.settle()?;
    if strict {
        prop_assert_eq!(w.unsolicited, 0, "a grant nobody asked for: {}", w.dump());
    }
    // Every client dies: every token comes back to the pool or lies free
    // in the open table.
    for k in 1..=CLIENTS {
        w.step(&Op::Kill(k));
    }
    while w.socket_only > 0 {
        w.step(&Op::SocketRelease(0));
    }
    w.check()?;
    w.close();
    prop_assert_eq!(w.pool, WORDS, "every token back: {}", w.dump());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    #[test]
    fn step_by_step_hand_offs_lose_nothing_and_leave_nobody_asleep(
        ops in proptest::collection::vec(op(false), 1..150)
    ) {
        run(&ops, false)?;
    }

    #[test]
    fn step_by_step_with_stale_steps_every_wait_ends_and_no_grant_is_unasked(
        ops in proptest::collection::vec(op(false), 1..150)
    ) {
        run(&ops, true)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn step_by_step_with_deaths_hand_offs_lose_nothing_and_leave_nobody_asleep(
        ops in proptest::collection::vec(op(true), 1..150)
    ) {
        run(&ops, false)?;
    }

    #[test]
    fn step_by_step_with_deaths_and_stale_steps_no_grant_is_unasked(
        ops in proptest::collection::vec(op(true), 1..150)
    ) {
        run(&ops, true)?;
    }
}

/// A giver claims slot 4's wait and stops before its gift; slot 4's
/// client dies, the broker clears the slot, and a new client is admitted
/// to it and starts a wait. The giver goes on: its gift names slot 4,
/// and its wake-up swap (`waiting → woken`) succeeds on the new client's
/// wait, whose ticket nobody claimed. The new client wakes to nothing
/// and waits again; the gift stays in the word with a live giver and a
/// live heir, which nobody claims or repairs.
#[test]
fn a_giver_stopped_across_its_heirs_death_and_a_new_client_in_the_slot_loses_no_token() {
    use self::Op::*;
    let ops = [
        Take(1),
        Take(2),
        Take(3),
        Register(4),
        Look(4),
        Step1(1),
        Kill(4),
        Respawn(4),
        Step2(1),
        Register(4),
        Step3(1),
    ];
    run(&ops, true).unwrap();
}

/// Giver 2 hands its token to slot 4, whose ticket word keeps the claim
/// `CLAIMED | 2` after that wait ends. Slot 4 starts its next wait: its
/// state says waiting, and before it stores its new ticket, giver 2 dies.
/// The broker's `finish_giver(2)` takes the old claim for a live one
/// without a gift: it moves slot 4 (ticket `MOVED`, state woken) and
/// queues an acquire for it. Slot 4 then stores its ticket over `MOVED`,
/// finds its state woken with its own ticket, and waits again in the
/// table; the broker's grant comes to a client that asked for nothing.
#[test]
fn a_dead_givers_claim_from_an_earlier_wait_does_not_move_the_next_one() {
    use self::Op::*;
    let ops = [
        Register(4),
        Take(2),
        Take(2),
        SocketAsk,
        Take(1),
        Look(4),
        Give(2),
        Look(4),
        Register(4),
        Kill(2),
        SocketRelease(0),
        Take(1),
        Look(1),
        Give(4),
    ];
    run(&ops, true).unwrap();
}

/// What follows the wrong move above: slot 4 stored its new ticket over
/// `MOVED` and was woken with nothing, so it registers again with its own
/// old, unclaimed ticket still in its ticket word. Between its state and
/// its new ticket, giver 1 finds it waiting with that ticket, claims it,
/// gifts and wakes it; slot 4 then stores its new ticket over the claim,
/// wakes to its own ticket, and waits again: giver 1's gift stays in the
/// word, claimed by nobody, while both live.
#[test]
fn a_wait_woken_with_nothing_registers_again_without_a_stale_ticket() {
    use self::Op::*;
    let ops = [
        Register(4),
        Register(4),
        Take(2),
        Give(2),
        Take(3),
        Take(1),
        Look(4),
        SocketAsk,
        Give(3),
        Register(4),
        Kill(2),
        Look(4),
        Take(1),
        Look(4),
        Give(1),
    ];
    run(&ops, false).unwrap();
}

/// The cases proptest once shrank to under the two-step hand-off, in the
/// three steps: a giver stopped while another gives, the table closed and
/// a waiter moved; a giver stopped while its heir's slot is reused and a
/// third client dies.
#[test]
fn saved_cases_of_stopped_givers_close_and_reuse_pass_in_both_modes() {
    use self::Op::*;
    let cases: [&[Op]; 2] = [
        &[
            Take(5),
            Take(1),
            Take(2),
            Register(5),
            Register(5),
            Step3(1),
            Step1(5),
            Step2(5),
            Register(1),
            Register(1),
            Give(1),
            SocketAsk,
            Look(5),
        ],
        &[
            Look(1),
            Take(4),
            Take(3),
            Step1(1),
            Step2(1),
            Respawn(1),
            Register(3),
            Register(3),
            Step1(4),
            Step2(4),
            Kill(2),
            Look(3),
            Take(1),
            SocketAsk,
            Give(3),
            Register(3),
            Register(3),
        ],
    ];
    for ops in cases {
        run(ops, false).unwrap();
        run(ops, true).unwrap();
    }
}

/// Giver 2 claims slot 1's wait and stops; slot 1's client dies, and a
/// new client in the slot sets its state to waiting before giver 2 gifts
/// and wakes it. The new client then finds a free word and withdraws its
/// own wait, whose ticket nobody claimed: the gift addressed to the slot
/// is its, not a stray left for the broker's next sweep.
#[test]
fn a_wait_withdrawn_after_a_wake_up_meant_for_the_slots_previous_client_keeps_its_gift() {
    use self::Op::*;
    let ops = [
        Register(1),
        Register(1),
        Take(2),
        Step1(2),
        Kill(1),
        Respawn(1),
        Register(1),
    ];
    run(&ops, true).unwrap();
}
