//! The statistics behind `syncopate ab --repeat`: medians with distribution-free confidence
//! intervals, and the exact rank test behind every verdict. Pure functions of the samples, with
//! no randomness of their own, so the same runs always give the same intervals.
//!
//! - **Median and its interval.** The interval is the pair of order statistics
//!   `[x_(k), x_(n+1-k)]` with the largest `k` whose coverage `1 - 2·P(B ≤ k-1)`, with
//!   `B ~ Binomial(n, 1/2)`, is still at least 95%. It assumes nothing about the distribution
//!   (run times are skewed and bounded below), and it is honest about small samples: with 5 runs
//!   the best it can do is `[min, max]` at 93.8%, which [`Estimate::confidence`] reports.
//! - **Verdicts.** The two-sided Wilcoxon-Mann-Whitney rank-sum test, exact: the p-value counts,
//!   over every way of splitting the pooled runs into two groups of the same sizes, the splits
//!   whose rank sum lies at least as far from its mean as the one observed. Ties (time to target
//!   is read at the watcher's ticks, and runs that never reach it tie at "not reached") get
//!   mid-ranks, and the exact count still holds. Beyond [`EXACT_LIMIT`] runs in all it falls back
//!   to the normal approximation with the tie correction.
//!
//! - **How many times.** A verdict's ratio comes with Bauer's (1972) distribution-free interval
//!   for a ratio of scales: the pairwise ratios `a_i / b_j`, sorted, and the pair of order
//!   statistics `[r_(k), r_(mn+1-k)]` with the largest `k` whose coverage `1 - 2·P(U ≤ k-1)`,
//!   with `U` the Mann-Whitney statistic under no difference, is still at least 95% (the
//!   rank test's interval for a shift, taken on a log scale). It assumes the two policies' runs
//!   differ by a factor; it exists only where every run is finite and positive.
//!
//! Values may be `f64::INFINITY`: a run that did not reach the target is slower than any that did.

use serde::{Deserialize, Serialize};

/// The significance level of every verdict, and `1 -` the confidence the intervals aim for.
pub const ALPHA: f64 = 0.05;

/// Pooled sample sizes up to this get the exact rank test; larger ones the normal approximation.
pub const EXACT_LIMIT: usize = 60;

/// A median and its confidence interval. `None` stands for infinity ("not reached").
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The sample median.
    pub median: Option<f64>,
    /// The interval's lower end.
    pub lo: Option<f64>,
    /// The interval's upper end.
    pub hi: Option<f64>,
    /// The interval's exact coverage (0.95 or a little more; less only for fewer than 6 runs).
    pub confidence: f64,
    /// How many runs.
    pub n: usize,
}

fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

fn sorted(xs: &[f64]) -> Vec<f64> {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The median of a sorted, non-empty sample.
pub fn median_of_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `P(B ≤ j)` for `B ~ Binomial(n, 1/2)`.
fn binomial_cdf_half(n: usize, j: usize) -> f64 {
    let mut c = 1.0f64; // C(n, 0)
    let mut sum = 0.0;
    for i in 0..=j.min(n) {
        if i > 0 {
            c = c * (n + 1 - i) as f64 / i as f64;
        }
        sum += c;
    }
    sum * 0.5f64.powi(n as i32)
}

/// The median of `xs` and its distribution-free confidence interval.
///
/// # Panics
/// If `xs` is empty or holds a NaN.
pub fn median_ci(xs: &[f64]) -> Estimate {
    assert!(!xs.is_empty() && xs.iter().all(|x| !x.is_nan()), "samples: {xs:?}");
    let v = sorted(xs);
    let n = v.len();
    let median = median_of_sorted(&v);
    // The largest k (1-based) whose interval still covers with at least 1 - ALPHA.
    let mut k = 1;
    while k < n.div_ceil(2) && 1.0 - 2.0 * binomial_cdf_half(n, k) >= 1.0 - ALPHA {
        k += 1;
    }
    let confidence = 1.0 - 2.0 * binomial_cdf_half(n, k - 1);
    Estimate { median: finite(median), lo: finite(v[k - 1]), hi: finite(v[n - k]), confidence, n }
}

/// Mid-ranks (1-based) of `xs`, ties sharing the mean of their ranks.
fn midranks(xs: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..xs.len()).collect();
    idx.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let mut ranks = vec![0.0; xs.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && xs[idx[j + 1]] == xs[idx[i]] {
            j += 1;
        }
        let r = (i + j) as f64 / 2.0 + 1.0;
        for &t in &idx[i..=j] {
            ranks[t] = r;
        }
        i = j + 1;
    }
    ranks
}

/// The result of comparing two samples.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankTest {
    /// Two-sided p-value.
    pub p: f64,
    /// Whether the first sample tends to be lower (its rank sum is below the mean).
    pub first_lower: bool,
    /// Whether `p` was computed exactly (false: the normal approximation).
    pub exact: bool,
    /// The smallest p-value these sample sizes can give at all (a study with too few runs can
    /// never reach significance; this says so).
    pub min_p: f64,
}

/// The two-sided Wilcoxon-Mann-Whitney test of `a` against `b`.
///
/// # Panics
/// If either sample is empty or holds a NaN.
pub fn rank_sum_test(a: &[f64], b: &[f64]) -> RankTest {
    assert!(!a.is_empty() && !b.is_empty(), "both samples need runs");
    let pooled: Vec<f64> = a.iter().chain(b).copied().collect();
    assert!(pooled.iter().all(|x| !x.is_nan()), "samples: {pooled:?}");
    let ranks = midranks(&pooled);
    let (m, n) = (a.len(), pooled.len());
    // Mid-ranks are multiples of 1/2: work in half-ranks, which are integers.
    let half: Vec<usize> = ranks.iter().map(|r| (r * 2.0).round() as usize).collect();
    let observed: usize = half[..m].iter().sum();
    let mean2 = (m * (n + 1)) as f64; // twice the rank sum's mean, m(n+1)/2
    let dev = (observed as f64 - mean2).abs();
    let first_lower = (observed as f64) < mean2;
    if n <= EXACT_LIMIT {
        // counts[j][s]: the ways to choose j of the items seen so far with half-rank sum s.
        let max: usize = half.iter().sum();
        let mut counts = vec![vec![0.0f64; max + 1]; m + 1];
        counts[0][0] = 1.0;
        for (i, &h) in half.iter().enumerate() {
            for j in (1..=m.min(i + 1)).rev() {
                let (lower, upper) = counts.split_at_mut(j);
                for s in (h..=max).rev() {
                    upper[0][s] += lower[j - 1][s - h];
                }
            }
        }
        let total: f64 = counts[m].iter().sum();
        let far = |s: usize| (s as f64 - mean2).abs() >= dev - 1e-9;
        let p: f64 =
            counts[m].iter().enumerate().filter(|(s, _)| far(*s)).map(|(_, c)| c).sum::<f64>() / total;
        // The most extreme split: the m smallest half-ranks.
        let mut by = half.clone();
        by.sort_unstable();
        let extreme: usize = by[..m].iter().sum();
        let ext_dev = (extreme as f64 - mean2).abs();
        let min_p = counts[m]
            .iter()
            .enumerate()
            .filter(|(s, _)| (*s as f64 - mean2).abs() >= ext_dev - 1e-9)
            .map(|(_, c)| c)
            .sum::<f64>()
            / total;
        return RankTest { p: p.min(1.0), first_lower, exact: true, min_p: min_p.min(1.0) };
    }
    // Normal approximation with the tie correction, in rank units.
    let (mf, nf) = (m as f64, n as f64);
    let k = nf - mf;
    let mut ties = 0.0;
    let mut v = sorted(&ranks);
    v.dedup();
    for r in v {
        let t = ranks.iter().filter(|x| **x == r).count() as f64;
        ties += t * t * t - t;
    }
    let var = mf * k / 12.0 * ((nf + 1.0) - ties / (nf * (nf - 1.0)));
    let z = (dev / 2.0 - 0.5).max(0.0) / var.sqrt().max(f64::MIN_POSITIVE);
    RankTest { p: (2.0 * normal_sf(z)).min(1.0), first_lower, exact: false, min_p: 0.0 }
}

/// An interval for how many times one sample's values are another's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RatioInterval {
    /// The interval's lower end.
    pub lo: f64,
    /// The interval's upper end.
    pub hi: f64,
    /// The interval's exact coverage (at least 0.95 where the sample sizes allow it).
    pub confidence: f64,
}

/// `P(U ≤ u)` for each `u` in `0..=m·n`, `U` the Mann-Whitney statistic of samples of sizes `m`
/// and `n` with no ties and no difference.
fn mann_whitney_cdf(m: usize, n: usize) -> Vec<f64> {
    // An arrangement of the two samples is, for each of the first sample's m items, how many
    // of the second's precede it (0 to n), and U is their sum; as a multiset, a partition of U
    // into m parts of 0 to n. ways[j][u]: multisets of j such parts summing to u, built a part
    // size at a time.
    let max = m * n;
    let mut ways = vec![vec![0.0f64; max + 1]; m + 1];
    ways[0][0] = 1.0;
    for size in 0..=n {
        // Parts of this size, any number of them (unbounded knapsack over j).
        for j in 1..=m {
            for u in size..=max {
                let add = ways[j - 1][u - size];
                ways[j][u] += add;
            }
        }
    }
    let total: f64 = ways[m].iter().sum();
    let mut acc = 0.0;
    ways[m]
        .iter()
        .map(|c| {
            acc += c;
            acc / total
        })
        .collect()
}

/// Bauer's interval for the factor between `a` and `b`: where `a`'s values are about `r`
/// times `b`'s, an interval for `r`. `None` unless every value is finite and positive.
pub fn ratio_interval(a: &[f64], b: &[f64]) -> Option<RatioInterval> {
    let ok = |x: &f64| x.is_finite() && *x > 0.0;
    if a.is_empty() || b.is_empty() || !a.iter().all(ok) || !b.iter().all(ok) {
        return None;
    }
    let mut ratios: Vec<f64> = a.iter().flat_map(|x| b.iter().map(move |y| x / y)).collect();
    ratios.sort_by(f64::total_cmp);
    let big = ratios.len();
    // The largest k (1-based) whose interval still covers with at least 1 - ALPHA, and its
    // coverage: exact up to EXACT_LIMIT runs in all, as the rank test is, then from the normal
    // approximation of U (mean mn/2, variance mn(m+n+1)/12, continuity-corrected).
    let (k, confidence) = if a.len() + b.len() <= EXACT_LIMIT {
        let cdf = mann_whitney_cdf(a.len(), b.len());
        let mut k = 1;
        while k < big.div_ceil(2) && 1.0 - 2.0 * cdf[k] >= 1.0 - ALPHA {
            k += 1;
        }
        (k, 1.0 - 2.0 * cdf[k - 1])
    } else {
        let (m, n) = (a.len() as f64, b.len() as f64);
        let (mean, sd) = (m * n / 2.0, (m * n * (m + n + 1.0) / 12.0).sqrt());
        let below = |k: usize| normal_sf((mean - (k as f64 - 1.0) - 0.5) / sd); // P(U <= k - 1)
        let mut k = 1;
        while k < big.div_ceil(2) && 1.0 - 2.0 * below(k + 1) >= 1.0 - ALPHA {
            k += 1;
        }
        (k, 1.0 - 2.0 * below(k))
    };
    Some(RatioInterval { lo: ratios[k - 1], hi: ratios[big - k], confidence })
}

/// The standard normal's upper tail, `P(Z > z)` (Abramowitz and Stegun 7.1.26, error < 1.5e-7).
fn normal_sf(z: f64) -> f64 {
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    0.5 * poly * (-x * x).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_interval_is_the_textbook_order_statistic_pair() {
        // n = 5: no pair reaches 95%; [min, max] covers 1 - 2/32.
        let e = median_ci(&[5.0, 1.0, 4.0, 2.0, 3.0]);
        assert_eq!((e.median, e.lo, e.hi), (Some(3.0), Some(1.0), Some(5.0)));
        assert!((e.confidence - 0.9375).abs() < 1e-12);
        // n = 6: [x(1), x(6)] at 96.9%. n = 10: [x(2), x(9)] at 97.9%. n = 20: [x(6), x(15)] at 95.9%.
        let e = median_ci(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!((e.median, e.lo, e.hi), (Some(3.5), Some(1.0), Some(6.0)));
        assert!((e.confidence - 0.96875).abs() < 1e-12);
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        let e = median_ci(&ten);
        assert_eq!((e.lo, e.hi), (Some(2.0), Some(9.0)));
        assert!((e.confidence - (1.0 - 2.0 * 11.0 / 1024.0)).abs() < 1e-12);
        let twenty: Vec<f64> = (1..=20).map(f64::from).collect();
        let e = median_ci(&twenty);
        assert_eq!((e.lo, e.hi), (Some(6.0), Some(15.0)));
        assert!(e.confidence >= 0.95 && e.confidence < 0.96, "{}", e.confidence);
        // Runs that never reached the target are infinite: the interval stays open above.
        let e = median_ci(&[3.0, 4.0, f64::INFINITY, f64::INFINITY, f64::INFINITY]);
        assert_eq!((e.median, e.lo, e.hi), (None, Some(3.0), None));
    }

    #[test]
    fn the_rank_test_matches_hand_counted_exact_p_values() {
        // Complete separation of 5 and 5: 2 of the C(10,5) = 252 splits are as extreme.
        let t = rank_sum_test(&[1.0, 2.0, 3.0, 4.0, 5.0], &[6.0, 7.0, 8.0, 9.0, 10.0]);
        assert!((t.p - 2.0 / 252.0).abs() < 1e-12 && t.first_lower && t.exact, "{t:?}");
        assert!((t.min_p - 2.0 / 252.0).abs() < 1e-12);
        // Three against three can never be significant: the best p is 2/20.
        let t = rank_sum_test(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]);
        assert!((t.p - 0.1).abs() < 1e-12 && (t.min_p - 0.1).abs() < 1e-12);
        // Identical samples: p = 1.
        assert!((rank_sum_test(&[1.0, 2.0], &[1.0, 2.0]).p - 1.0).abs() < 1e-12);
        // a = {1, 3}, b = {2, 4}: rank sums of a over the 6 splits are 3,4,5,5,6,7 (mean 5);
        // observed 4 is 1 away, and 4 of 6 splits are at least that far.
        let t = rank_sum_test(&[1.0, 3.0], &[2.0, 4.0]);
        assert!((t.p - 4.0 / 6.0).abs() < 1e-12, "{t:?}");
        // Ties: a = {1, 1}, b = {1, 2}: mid-ranks 2, 2, 2, 4; of the 6 splits the sums are
        // 4 (x3) and 6 (x3), mean 5: every split is as extreme as the observed 4.
        let t = rank_sum_test(&[1.0, 1.0], &[1.0, 2.0]);
        assert!((t.p - 1.0).abs() < 1e-12, "{t:?}");
        // Not reached (infinite) is the worst rank.
        let t = rank_sum_test(&[f64::INFINITY; 5], &[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(!t.first_lower && t.p < 0.01, "{t:?}");
    }

    #[test]
    fn the_mann_whitney_distribution_matches_a_count_of_every_split() {
        // Count U over all C(m+n, m) splits of 1..=m+n, against the recursion.
        for (m, n) in [(1, 1), (2, 3), (4, 4), (6, 6), (3, 7)] {
            let total = m + n;
            let mut counts = vec![0usize; m * n + 1];
            for mask in 0u32..(1 << total) {
                if mask.count_ones() as usize != m {
                    continue;
                }
                // U: pairs (first-sample item, second-sample item) with the second below.
                let mut seen_second = 0;
                let mut u = 0;
                for i in 0..total {
                    if mask & (1 << i) != 0 {
                        u += seen_second;
                    } else {
                        seen_second += 1;
                    }
                }
                counts[u] += 1;
            }
            let all: usize = counts.iter().sum();
            let cdf = mann_whitney_cdf(m, n);
            let mut acc = 0;
            for (u, c) in counts.iter().enumerate() {
                acc += c;
                assert!((cdf[u] - acc as f64 / all as f64).abs() < 1e-12, "m={m} n={n} u={u}");
            }
        }
        // The textbook critical value: 6 against 6, two-sided 5%, is U ≤ 5 (P = 0.0206 a side).
        let cdf = mann_whitney_cdf(6, 6);
        assert!((cdf[5] - 19.0 / 924.0).abs() < 1e-12 && cdf[6] > 0.025, "{}", cdf[5]);
    }

    #[test]
    fn the_ratio_interval_brackets_the_factor_between_two_samples() {
        // b's values are exactly 4 times a's: every pairwise ratio's order statistics are
        // taken from a spread around 0.25, and the interval holds 0.25.
        let a = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5];
        let b: Vec<f64> = a.iter().map(|x| x * 4.0).collect();
        let r = ratio_interval(&a, &b).unwrap();
        assert!(r.lo < 0.25 && 0.25 < r.hi && r.hi < 0.4, "{r:?}");
        // 6 against 6: k = 6 of the 36 ratios, coverage 1 - 2·19/924.
        let mut ratios: Vec<f64> = a.iter().flat_map(|x| b.iter().map(move |y| x / y)).collect();
        ratios.sort_by(f64::total_cmp);
        assert_eq!((r.lo, r.hi), (ratios[5], ratios[30]));
        assert!((r.confidence - (1.0 - 38.0 / 924.0)).abs() < 1e-12);
        // Swapped, the interval is the reciprocal one.
        let s = ratio_interval(&b, &a).unwrap();
        assert!((s.lo - 1.0 / r.hi).abs() < 1e-12 && (s.hi - 1.0 / r.lo).abs() < 1e-12);
        // Two runs a side: the only interval is [min, max] of the 4 ratios, at 1 - 2/6.
        let r = ratio_interval(&[1.0, 2.0], &[4.0, 8.0]).unwrap();
        assert_eq!((r.lo, r.hi), (0.125, 0.5));
        assert!((r.confidence - (1.0 - 2.0 / 6.0)).abs() < 1e-12);
        // Beyond the exact limit the normal approximation picks k: 40 runs a side, twice
        // as large, still brackets 2 at about 95%, and agrees with the exact count where both
        // apply (30 a side, the last exact size).
        let small: Vec<f64> = (0..40).map(|i| 1.0 + f64::from(i) / 40.0).collect();
        let large: Vec<f64> = small.iter().map(|x| x * 2.0).collect();
        let r = ratio_interval(&large, &small).unwrap();
        assert!(r.lo < 2.0 && 2.0 < r.hi && (0.94..0.97).contains(&r.confidence), "{r:?}");
        let exact = ratio_interval(&large[..30], &small[..30]).unwrap();
        let approx = ratio_interval(&large[..31], &small[..31]).unwrap();
        assert!((exact.confidence - approx.confidence).abs() < 0.01, "{exact:?} {approx:?}");
        // A run that never reached the target has no ratio.
        assert_eq!(ratio_interval(&[1.0, f64::INFINITY], &[1.0, 2.0]), None);
        assert_eq!(ratio_interval(&[0.0, 1.0], &[1.0, 2.0]), None);
    }

    #[test]
    fn the_normal_approximation_agrees_with_the_exact_count_where_both_apply() {
        let a: Vec<f64> = (0..31).map(|i| f64::from(i) * 1.3).collect();
        let b: Vec<f64> = (0..31).map(|i| f64::from(i) * 1.3 + 9.0).collect();
        let exact = rank_sum_test(&a[..30], &b[..30]);
        assert!(exact.exact);
        let approx = rank_sum_test(&a, &b);
        assert!(!approx.exact);
        assert!(exact.p < 0.05 && approx.p < 0.05 && approx.first_lower, "{exact:?} {approx:?}");
        assert!((normal_sf(1.959_964) - 0.025).abs() < 1e-6);
    }
}
