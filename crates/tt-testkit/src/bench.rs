//! The benchmarks' protocol for a ratio: pairs of runs in one process, ours and the
//! baseline back to back with the order alternating, and the median pair with the
//! spread of all pairs' ratios beside it. A machine whose speed drifts (other tenants,
//! clocks, a GPU's boost) moves both runs of a pair together; medians of each side's
//! runs would compare runs from different phases.

use std::fmt;

/// `rounds` pairs of `(ours, baseline)` measurements of a quantity where lower is
/// better (seconds per step, say), in the order they were taken.
#[derive(Debug, Clone, PartialEq)]
pub struct Pairs {
    pairs: Vec<(f64, f64)>,
}

/// Runs `rounds` pairs: round `i` runs `ours` first when `i` is even, `baseline` first
/// when it is odd. An error of either stops at once.
pub fn paired<E>(
    rounds: usize,
    mut ours: impl FnMut() -> Result<f64, E>,
    mut baseline: impl FnMut() -> Result<f64, E>,
) -> Result<Pairs, E> {
    let mut pairs = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let pair = if round % 2 == 0 {
            let a = ours()?;
            (a, baseline()?)
        } else {
            let b = baseline()?;
            (ours()?, b)
        };
        pairs.push(pair);
    }
    Ok(Pairs { pairs })
}

impl Pairs {
    /// Pairs measured some other way (several variants sharing one baseline run).
    pub fn from_pairs(pairs: Vec<(f64, f64)>) -> Pairs {
        Pairs { pairs }
    }

    /// Each pair's ratio `baseline / ours` (above 1: ours is faster), sorted.
    pub fn ratios(&self) -> Vec<f64> {
        let mut r: Vec<f64> = self.pairs.iter().map(|(o, b)| b / o).collect();
        r.sort_by(f64::total_cmp);
        r
    }

    /// The pair whose ratio is the median (the upper one of an even count).
    pub fn median(&self) -> (f64, f64) {
        let mut sorted = self.pairs.clone();
        sorted.sort_by(|x, y| (x.1 / x.0).total_cmp(&(y.1 / y.0)));
        sorted
            .get(sorted.len() / 2)
            .copied()
            .unwrap_or((f64::NAN, f64::NAN))
    }

    /// The median pair's ratio.
    pub fn ratio(&self) -> f64 {
        let (o, b) = self.median();
        b / o
    }

    /// The lowest and highest ratios.
    pub fn spread(&self) -> (f64, f64) {
        let r = self.ratios();
        match (r.first(), r.last()) {
            (Some(lo), Some(hi)) => (*lo, *hi),
            _ => (f64::NAN, f64::NAN),
        }
    }
}

/// `1.012 (5 pairs, 0.981–1.030)`: the median ratio and the spread, for a table.
impl fmt::Display for Pairs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (lo, hi) = self.spread();
        write!(
            f,
            "{:.3} ({} pairs, {lo:.3}–{hi:.3})",
            self.ratio(),
            self.pairs.len()
        )
    }
}

/// The median of `values` (the upper one of an even count): seconds, durations,
/// counts. Every benchmark's median is this one.
///
/// # Panics
/// With no values: a benchmark that measured nothing.
pub fn median<T: PartialOrd + Copy>(mut values: Vec<T>) -> T {
    assert!(!values.is_empty(), "the median of no measurements");
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values[values.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_alternate_their_order_and_report_the_median_and_spread() {
        let order = std::cell::RefCell::new(Vec::new());
        let times = [
            (10.0, 11.0),
            (10.0, 10.0),
            (10.0, 12.0),
            (10.0, 9.0),
            (10.0, 10.5),
        ];
        let (mut i, mut j) = (0, 0);
        let pairs = paired::<()>(
            5,
            || {
                order.borrow_mut().push('o');
                i += 1;
                Ok(times[i - 1].0)
            },
            || {
                order.borrow_mut().push('b');
                j += 1;
                Ok(times[j - 1].1)
            },
        )
        .unwrap_or_else(|()| unreachable!());
        assert_eq!(order.into_inner().iter().collect::<String>(), "obboobboob");
        assert_eq!(pairs.ratios(), vec![0.9, 1.0, 1.05, 1.1, 1.2]);
        assert_eq!(pairs.median(), (10.0, 10.5));
        assert_eq!(pairs.spread(), (0.9, 1.2));
        assert_eq!(pairs.to_string(), "1.050 (5 pairs, 0.900–1.200)");
    }

    #[test]
    fn an_error_stops_the_pairs() {
        let mut calls = 0;
        let result = paired(
            5,
            || {
                calls += 1;
                if calls == 2 {
                    Err("no GPU")
                } else {
                    Ok(1.0)
                }
            },
            || Ok(1.0),
        );
        assert_eq!(result, Err("no GPU"));
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4, 1, 3, 2]), 3);
        let d = std::time::Duration::from_millis;
        assert_eq!(median(vec![d(5), d(1), d(9)]), d(5));
    }
}
