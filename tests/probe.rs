//! `herdless probe`: what this kernel does, and herdless beside it.

use std::process::Command;

use herdless_bench::probe::ProbeReport;

#[test]
fn probe_reports_every_mode_and_herdless_wakes_one_in_order() {
    let out = Command::new(env!("CARGO_BIN_EXE_herdless"))
        .args(["probe", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: ProbeReport = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!r.os.is_empty() && !r.release.is_empty());
    let mode = |name: &str| {
        r.modes
            .iter()
            .find(|m| m.mode == name)
            .unwrap_or_else(|| panic!("no {name} in {r:#?}"))
    };
    let h = mode("herdless");
    assert_eq!(h.woken, Some(1), "{h:?}");
    assert_eq!(h.order.as_deref(), Some("FIFO"), "{h:?}");
    assert_eq!(h.served.as_ref().map(|s| s.len()), Some(8));

    let table = herdless_bench::probe::table(&r);
    assert!(table.contains("capabilities"), "{table}");
    assert!(table.contains("herdless"), "{table}");

    // The relay: every hop after the first lap measured, for each
    // primitive this OS has (the pipe everywhere).
    let names: Vec<&str> = r.relay.iter().map(|x| x.wake.as_str()).collect();
    assert_eq!(names, ["futex", "pipe"], "{r:#?}");
    for x in &r.relay {
        if !x.available {
            assert!(x.wake != "pipe" && x.reason.is_some(), "{x:?}");
            continue;
        }
        assert_eq!(x.processes, herdless_bench::relay::RELAY_PROCESSES, "{x:?}");
        assert_eq!(x.hops, herdless_bench::relay::RELAY_HOPS, "{x:?}");
        assert_eq!(x.deciles_us.len(), 9, "{x:?}");
        assert!(
            x.deciles_us.windows(2).all(|w| w[0] <= w[1]) && x.deciles_us[8] <= x.p99_us,
            "{x:?}"
        );
        assert!(x.deciles_us[0] > 0.0, "{x:?}");
    }
    assert!(table.contains("relay of 64 processes"), "{table}");

    #[cfg(target_os = "linux")]
    {
        assert_eq!(mode("poll").woken, Some(32));
        // Among sleeping readers, Linux ≥ 5.6 serves a blocking read and a
        // futex first come, first served.
        if r.capabilities.exclusive_pipe_read {
            assert_eq!(mode("blocking-read").order.as_deref(), Some("FIFO"));
        }
        assert_eq!(mode("futex").order.as_deref(), Some("FIFO"));
        assert!(r.relay.iter().all(|x| x.available), "{r:#?}");
        let kq = mode("kqueue");
        assert!(!kq.available && kq.reason.is_some(), "{kq:?}");
        assert!(r.capabilities.epoll_exclusive && !r.capabilities.kqueue);
    }
    #[cfg(any(target_os = "freebsd", target_os = "netbsd", target_vendor = "apple"))]
    {
        assert_eq!(mode("kqueue").woken, Some(32));
        assert!(!mode("epoll").available);
    }
}
