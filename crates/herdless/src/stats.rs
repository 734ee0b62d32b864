//! A small log-linear histogram for latency figures.
//!
//! Values are bucketed by their power of two and, inside it, by 16 linear
//! sub-buckets, so a quantile is exact to within 1/16 (about 6 %) of its
//! value whatever the range — enough to tell a 20 µs hand-off from a 2 ms
//! one without keeping every sample.

const SUB_BITS: u32 = 4;
const SUB: u64 = 1 << SUB_BITS;
/// The number of buckets.
pub(crate) const BUCKETS: usize = ((64 - SUB_BITS as usize) + 1) * SUB as usize;

/// Counts of values (any `u64` unit the caller chooses).
#[derive(Clone, PartialEq, Eq)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            max: 0,
            sum: 0,
        }
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram")
            .field("count", &self.total)
            .field("p50", &self.quantile(0.5))
            .field("p99", &self.quantile(0.99))
            .field("max", &self.max)
            .finish()
    }
}

/// The bucket of value `v`.
pub(crate) fn index(v: u64) -> usize {
    if v < SUB {
        return v as usize;
    }
    let exp = 63 - v.leading_zeros(); // >= SUB_BITS
    let shift = exp - SUB_BITS;
    let sub = (v >> shift) - SUB; // 0..SUB
    ((shift as u64 + 1) * SUB + sub) as usize
}

/// The smallest value that falls in bucket `i`.
fn lower_bound(i: usize) -> u64 {
    let i = i as u64;
    if i < SUB {
        return i;
    }
    let shift = i / SUB - 1;
    let sub = i % SUB;
    (SUB + sub) << shift
}

impl Histogram {
    /// Adds one value.
    pub fn record(&mut self, v: u64) {
        self.counts[index(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
        self.sum += u128::from(v);
    }

    /// Adds values known only by their buckets: `counts[i]` values in
    /// bucket `i`, summing to `sum`, the largest `max`.
    pub(crate) fn add_buckets(&mut self, counts: &[u64], sum: u128, max: u64) {
        for (a, b) in self.counts.iter_mut().zip(counts) {
            *a = a.saturating_add(*b);
            self.total = self.total.saturating_add(*b);
        }
        self.max = self.max.max(max);
        self.sum = self.sum.saturating_add(sum);
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    /// How many values were recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The sum of every value recorded.
    pub fn sum(&self) -> u128 {
        self.sum
    }

    /// How many values recorded are at most `v`, counting whole buckets
    /// only: a bucket that also holds values above `v` is left out, so the
    /// count is exact whenever `v + 1` starts a bucket (every value below
    /// 16 times a power of two does) and otherwise errs low by at most one
    /// bucket (1/16 of `v`).
    pub fn count_at_most(&self, v: u64) -> u64 {
        let mut n = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            let whole = if i + 1 < BUCKETS {
                lower_bound(i + 1) - 1 <= v
            } else {
                v == u64::MAX
            };
            if !whole {
                break;
            }
            n += c;
        }
        n
    }

    /// The largest value recorded (0 when empty).
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The mean (0 when empty).
    pub fn mean(&self) -> u64 {
        if self.total == 0 {
            0
        } else {
            (self.sum / u128::from(self.total)) as u64
        }
    }

    /// The value at quantile `q` (0.0 ..= 1.0), as the lower bound of its
    /// bucket, never above the maximum; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return lower_bound(i).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_tight() {
        for v in (0..5000u64).chain([u64::MAX / 3, u64::MAX]) {
            let i = index(v);
            assert!(lower_bound(i) <= v, "{v} below its bucket");
            if i + 1 < BUCKETS {
                assert!(lower_bound(i + 1) > v, "{v} above its bucket");
            }
            // Within 1/16 of the value.
            assert!(v - lower_bound(i) <= v / SUB, "{v}");
        }
    }

    #[test]
    fn quantiles() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile(0.5), 0);
        for v in 1..=1000 {
            h.record(v);
        }
        let p50 = h.quantile(0.5);
        assert!((470..=500).contains(&p50), "{p50}");
        let p99 = h.quantile(0.99);
        assert!((930..=990).contains(&p99), "{p99}");
        assert_eq!(h.quantile(1.0), 992);
        assert_eq!(h.max(), 1000);
        assert_eq!(h.mean(), 500);
        let mut g = Histogram::default();
        g.merge(&h);
        assert_eq!(g, h);
        assert_eq!(h.count_at_most(0), 0);
        assert_eq!(h.count_at_most(15), 15);
        assert_eq!(h.count_at_most(1023), 1000);
        assert_eq!(h.count_at_most(u64::MAX), 1000);
        assert!((900..=1000).contains(&h.count_at_most(999)));
        assert_eq!(h.sum(), 500_500);
    }
}
