//! Single wake-up (ARCHITECTURE §4.2), FIFO order (§4.4) and no idle-while-free
//! (§4.3), with real client processes blocked in `acquire`.

mod common;

use std::thread;
use std::time::Duration;

use common::{Helper, Serve};

#[test]
fn helper_process() {
    common::helper_main();
}

/// Voluntary + involuntary context switches of every thread of `pid`.
#[cfg(target_os = "linux")]
fn switches(pid: u32) -> u64 {
    let c = herdless_platform::process_ctx_switches_all_threads(pid as i32).unwrap();
    c.voluntary + c.involuntary
}

#[test]
fn one_release_wakes_exactly_one_of_32_waiters() {
    let serve = Serve::start(2); // one shared token
    let mut holder = Helper::spawn(&serve.socket, "hold", 1);
    assert_eq!(holder.line(), "held 1");
    let mut waiters: Vec<Helper> = (0..32)
        .map(|_| {
            let mut w = Helper::spawn(&serve.socket, "acquire", 1);
            assert_eq!(w.line(), "waiting");
            w
        })
        .collect();
    serve.wait_for("32 waiters", |s| s.waiting == 32);
    // Let the waiters settle into their wait before sampling.
    thread::sleep(Duration::from_millis(200));
    #[cfg(target_os = "linux")]
    let before: Vec<u64> = waiters.iter().map(|w| switches(w.pid())).collect();

    holder.finish();
    // The first waiter gets it (FIFO), and says so.
    assert_eq!(waiters[0].line(), "got");
    let s = serve.wait_for("the hand-off", |s| s.waiting == 31);
    assert_eq!(s.wakeups, 1);
    // Give any spurious wake-up time to show.
    thread::sleep(Duration::from_millis(300));
    let s = serve.status();
    assert_eq!((s.waiting, s.free), (31, 0));

    #[cfg(target_os = "linux")]
    {
        let after: Vec<u64> = waiters.iter().map(|w| switches(w.pid())).collect();
        let woken: Vec<usize> = (0..32).filter(|&i| after[i] > before[i]).collect();
        assert_eq!(
            woken,
            vec![0],
            "only the granted waiter may run: {before:?} -> {after:?}"
        );
    }
    for w in waiters {
        w.kill();
    }
}

#[test]
fn bursts_of_releases_serve_waiters_in_fifo_order_and_none_idles() {
    // -j 6: five shared tokens, all held by one client to begin with.
    let serve = Serve::start(6);
    let mut holders: Vec<Helper> = (0..5)
        .map(|_| {
            let mut h = Helper::spawn(&serve.socket, "hold", 1);
            assert_eq!(h.line(), "held 1");
            h
        })
        .collect();
    // Twelve waiters queue in a known order.
    let mut waiters = Vec::new();
    for i in 0..12 {
        let mut w = Helper::spawn(&serve.socket, "acquire", 1);
        assert_eq!(w.line(), "waiting");
        serve.wait_for("the waiter to queue", |s| s.waiting == i + 1);
        waiters.push(w);
    }
    let order: Vec<u32> = waiters.iter().map(|w| w.pid()).collect();
    let mut served = 0usize;
    // Bursts: release 3 tokens at once, then 2, then the 5 new holders'.
    let release = |hs: Vec<Helper>| {
        for h in hs {
            h.finish();
        }
    };
    for burst in [3usize, 2] {
        let batch: Vec<Helper> = holders.drain(..burst).collect();
        release(batch);
        served += burst;
        let s = serve.wait_for("the burst to be handed on", |s| {
            s.waiting as usize == 12 - served
        });
        // No waiter waits while a token is free.
        assert_eq!(s.free, 0, "{s:#?}");
        // Exactly the first `served` waiters hold a token: FIFO.
        let holding: Vec<u32> = s
            .clients
            .iter()
            .filter(|c| c.held > 0)
            .map(|c| c.pid)
            .collect();
        for (i, pid) in order.iter().enumerate() {
            assert_eq!(
                holding.contains(pid),
                i < served,
                "waiter {i} after {served} grants: {s:#?}"
            );
        }
    }
    // Now the first five waiters hold everything; let them go together.
    for w in waiters.iter_mut().take(5) {
        assert_eq!(w.line(), "got");
    }
    for w in waiters.drain(..5) {
        w.finish();
    }
    let s = serve.wait_for("the second wave", |s| s.waiting == 2);
    assert_eq!(s.free, 0);
    let holding: Vec<u32> = s
        .clients
        .iter()
        .filter(|c| c.held > 0)
        .map(|c| c.pid)
        .collect();
    for (i, pid) in order.iter().enumerate().skip(5) {
        assert_eq!(holding.contains(pid), i < 10, "waiter {i}: {s:#?}");
    }
    for w in waiters {
        w.kill();
    }
    let s = serve.wait_for("everyone gone", |s| s.clients.is_empty());
    assert_eq!((s.free, s.lost), (s.capacity, 0));
}
