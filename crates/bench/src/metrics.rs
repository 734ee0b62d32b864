//! Figures computed from the release and claim times of one run.

/// Hand-off latencies in nanoseconds: the k-th claim (in time order) is
/// paired with the k-th release. Tokens are interchangeable, so this is
/// the only pairing the times define; it never pairs a claim with a later
/// release, because no more tokens can have been claimed than released by
/// any moment.
pub(crate) fn handoffs(releases: &[u64], claims: &[u64]) -> Vec<u64> {
    let mut r = releases.to_vec();
    let mut c = claims.to_vec();
    r.sort_unstable();
    c.sort_unstable();
    let mut lat: Vec<u64> = r
        .iter()
        .zip(&c)
        .map(|(rel, got)| got.saturating_sub(*rel))
        .collect();
    lat.sort_unstable();
    lat
}

/// The value at quantile `q` of sorted `values` (nearest rank); 0 when
/// empty.
pub(crate) fn quantile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Total time during which a token was free while at least one waiter
/// waited for one, in nanoseconds.
///
/// `releases` and `claims` are token events; `waits` are `(start, end)`
/// spans during which one waiter wanted a token. Only `[from, to]` counts.
pub(crate) fn idle_while_free(
    releases: &[u64],
    claims: &[u64],
    waits: &[(u64, u64)],
    from: u64,
    to: u64,
) -> u64 {
    // (time, change in free tokens, change in waiting waiters)
    let mut events: Vec<(u64, i64, i64)> = Vec::new();
    events.extend(releases.iter().map(|&t| (t, 1, 0)));
    events.extend(claims.iter().map(|&t| (t, -1, 0)));
    for &(start, end) in waits {
        events.push((start, 0, 1));
        events.push((end.max(start), 0, -1));
    }
    events.sort_unstable();
    let (mut free, mut waiting) = (0i64, 0i64);
    let mut last = from;
    let mut total = 0u64;
    for (t, df, dw) in events {
        let t = t.clamp(from, to);
        if free > 0 && waiting > 0 {
            total += t.saturating_sub(last);
        }
        last = last.max(t);
        free += df;
        waiting += dw;
    }
    if free > 0 && waiting > 0 {
        total += to.saturating_sub(last);
    }
    total
}

/// In what order waiters were served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Order {
    /// Nearly every grant (90 % or more) went to the waiter that had waited
    /// longest: first come, first served.
    Fifo,
    /// Nearly every grant went to the waiter that began waiting last: the
    /// one just served is served again while the others starve.
    Lifo,
    /// Neither: how many grants each waiter got.
    Mixed(Vec<u64>),
}

impl Order {
    /// "FIFO", "LIFO" or "mixed".
    pub fn name(&self) -> &'static str {
        match self {
            Order::Fifo => "FIFO",
            Order::Lifo => "LIFO",
            Order::Mixed(_) => "mixed",
        }
    }
}

/// Classifies who got each token. `grants` are (waiter, wait start, grant
/// time) in grant-time order; `open_waits[w]` is when waiter `w` began the
/// wait no grant ended. At each grant the winner's wait is compared with
/// those of the other waiters waiting at that moment.
pub(crate) fn classify(grants: &[(u32, u64, u64)], open_waits: &[u64]) -> Order {
    let n = open_waits.len();
    // Each waiter's waits, in order: the ones grants ended, then the open one.
    let mut waits: Vec<Vec<u64>> = vec![Vec::new(); n];
    for &(w, t_want, _) in grants {
        if let Some(v) = waits.get_mut(w as usize) {
            v.push(t_want);
        }
    }
    for (v, &open) in waits.iter_mut().zip(open_waits) {
        v.push(open);
    }
    let mut next = vec![0usize; n];
    let mut counts = vec![0u64; n];
    let (mut judged, mut fifo, mut lifo) = (0usize, 0usize, 0usize);
    for &(w, t_want, t_got) in grants {
        let w = w as usize;
        if w >= n {
            continue;
        }
        let others: Vec<u64> = (0..n)
            .filter(|&j| j != w)
            .map(|j| waits[j][next[j]])
            .filter(|&t| t <= t_got)
            .collect();
        if !others.is_empty() {
            judged += 1;
            fifo += usize::from(others.iter().all(|&t| t_want <= t));
            lifo += usize::from(others.iter().all(|&t| t_want >= t));
        }
        next[w] = (next[w] + 1).min(waits[w].len() - 1);
        counts[w] += 1;
    }
    if judged > 0 && fifo * 10 >= judged * 9 {
        Order::Fifo
    } else if judged > 0 && lifo * 10 >= judged * 9 {
        Order::Lifo
    } else {
        Order::Mixed(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoffs_pair_in_time_order() {
        let lat = handoffs(&[30, 10, 20], &[35, 12, 26]);
        assert_eq!(lat, vec![2, 5, 6]);
        // A release with no claim yet is left over.
        assert_eq!(handoffs(&[10, 20], &[15]), vec![5]);
        assert_eq!(quantile(&lat, 0.5), 5);
        assert_eq!(quantile(&lat, 0.99), 6);
        assert_eq!(quantile(&lat, 0.0), 2);
        assert_eq!(quantile(&[], 0.5), 0);
    }

    #[test]
    fn idle_counts_only_free_and_wanted_time() {
        // One waiter waits 0..100; the token is free 40..60 (claimed at 60
        // by that waiter).
        let idle = idle_while_free(&[40], &[60], &[(0, 60)], 0, 100);
        assert_eq!(idle, 20);
        // Free but nobody waits: not idle.
        assert_eq!(idle_while_free(&[40], &[60], &[], 0, 100), 0);
        // A token left free until the end while someone waits.
        assert_eq!(idle_while_free(&[90], &[], &[(0, 100)], 0, 100), 10);
        // Clipped to the window.
        assert_eq!(idle_while_free(&[0], &[50], &[(0, 50)], 20, 100), 30);
    }

    /// `order[k]` wins grant k at time 10k+10; each waiter starts waiting
    /// again right after its grant, at 10k+11, and first at `starts[w]`.
    fn history(order: &[u32], starts: &[u64]) -> (Vec<(u32, u64, u64)>, Vec<u64>) {
        let mut open = starts.to_vec();
        let mut grants = Vec::new();
        for (k, &w) in order.iter().enumerate() {
            let t = 10 * k as u64 + 10;
            grants.push((w, open[w as usize], t));
            open[w as usize] = t + 1;
        }
        (grants, open)
    }

    #[test]
    fn orders() {
        let starts = [0, 1, 2, 3];
        let fifo: Vec<u32> = (0..40).map(|i| i % 4).collect();
        let (g, open) = history(&fifo, &starts);
        assert_eq!(classify(&g, &open), Order::Fifo);
        let (g, open) = history(&[2u32; 40], &starts);
        assert_eq!(classify(&g, &open), Order::Lifo);
        let mixed = [
            0u32, 1, 1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 0, 0, 1, 3, 2, 1, 0, 3,
        ];
        let (g, open) = history(&mixed, &starts);
        match classify(&g, &open) {
            Order::Mixed(counts) => assert_eq!(counts, vec![7, 6, 4, 3]),
            other => panic!("{other:?}"),
        }
        assert_eq!(Order::Fifo.name(), "FIFO");
        assert_eq!(classify(&[], &[0, 0]), Order::Mixed(vec![0, 0]));
    }
}
