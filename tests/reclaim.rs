//! Crash reclamation (ARCHITECTURE §4.6) and conservation (§4.1) with real
//! processes: clients killed with SIGKILL while holding tokens.

mod common;

use common::{Helper, Serve};

#[test]
fn helper_process() {
    common::helper_main();
}

#[test]
fn tokens_of_killed_clients_reach_the_next_waiters() {
    // -j 4: three shared tokens.
    let serve = Serve::start(4);
    let mut a = Helper::spawn(&serve.socket, "hold", 2);
    assert_eq!(a.line(), "held 2");
    let mut b = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(b.line(), "held 1");
    let mut waiters: Vec<Helper> = (0..4)
        .map(|_| {
            let mut w = Helper::spawn(&serve.socket, "acquire", 1);
            assert_eq!(w.line(), "waiting");
            w
        })
        .collect();
    let s = serve.wait_for("4 waiters", |s| s.waiting == 4);
    assert_eq!(s.free, 0);

    // kill -9 the holder of two tokens: exactly two waiters get them.
    a.kill();
    let s = serve.wait_for("two tokens handed on", |s| s.waiting == 2);
    assert_eq!(s.reclaimed, 2);
    assert_eq!(s.free, 0);
    let held: u32 = s.clients.iter().map(|c| c.held).sum();
    assert_eq!(held + s.free, s.capacity, "conservation: {s:#?}");
    let mut got = 0;
    for w in waiters.iter_mut().take(2) {
        assert_eq!(w.line(), "got", "FIFO: the first two waiters are served");
        got += 1;
    }
    assert_eq!(got, 2);

    // Kill one of the new holders too: its token goes to the next waiter.
    let w0 = waiters.remove(0);
    w0.kill();
    let s = serve.wait_for("third hand-on", |s| s.waiting == 1);
    assert_eq!(s.reclaimed, 3);
    assert_eq!(waiters[1].line(), "got");

    // Everyone leaves: every token is free again, none lost.
    b.kill();
    for w in waiters {
        w.kill();
    }
    let s = serve.wait_for("all free", |s| s.clients.is_empty());
    assert_eq!(s.free, s.capacity);
    assert_eq!(s.lost, 0);
    let (status, log) = serve.stop();
    assert!(status.success(), "{log}");
    assert!(log.contains("tokens lost   0"), "{log}");
    assert!(
        log.contains("closed holding 2 token(s); taken back"),
        "{log}"
    );
}
