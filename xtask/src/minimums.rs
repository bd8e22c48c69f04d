//! The tests each step of `cargo xtask test`, and each of its test binaries, must pass
//! at least: recorded from a whole run that passed (`cargo xtask test
//! --record-minimums`) into `xtask/minimums.tsv`, never kept by hand. A step or binary
//! that passes fewer (a test file lost, a target left out by its features, tests that
//! stopped being selected) fails even when it reads ok, and one without a figure fails
//! too, so that every new step and binary gets one. A test skipped knowingly (a
//! `SKIPPED: ` line) is not a pass and never counts toward a figure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::steps::StepResult;

/// The file that holds the figures.
pub(crate) fn path() -> PathBuf {
    crate::root().join("xtask").join("minimums.tsv")
}

/// What the file holds: each step's figure and each of its binaries'.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Minimums {
    /// Step name to the tests it must pass at least.
    pub(crate) steps: BTreeMap<String, u64>,
    /// (step, binary) to the tests that binary must pass at least in that step.
    pub(crate) binaries: BTreeMap<(String, String), u64>,
}

/// The figure lines' header, and how to change them.
const HEADER: &str = "\
# The tests each step of `cargo xtask test` (binary `*`) and each of its test binaries
# passed in the last run recorded with `cargo xtask test --record-minimums`: a run that
# passes fewer fails. Not edited by hand: record again after adding, moving or removing
# tests. Knowingly skipped tests are not counted.
# step\tbinary\tpassed
";

impl Minimums {
    /// Reads the file; a missing or damaged one is an error that says how to make it.
    pub(crate) fn read() -> Result<Minimums> {
        let path = path();
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read the tests' minimums {}: record them with `cargo xtask test \
                 --record-minimums`",
                path.display()
            )
        })?;
        Minimums::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    /// The figures in `text` (lines `step<TAB>binary<TAB>passed`, `*` for the step).
    pub(crate) fn parse(text: &str) -> Result<Minimums> {
        let mut minimums = Minimums::default();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split('\t').collect();
            let [step, binary, passed] = fields.as_slice() else {
                bail!(
                    "line {}: {line:?} is not `step<TAB>binary<TAB>passed`: record the \
                     figures again with `cargo xtask test --record-minimums`",
                    n + 1
                );
            };
            let Ok(passed) = passed.parse::<u64>() else {
                bail!("line {}: {passed:?} is not a number of tests", n + 1);
            };
            if *binary == "*" {
                minimums.steps.insert((*step).to_owned(), passed);
            } else {
                minimums
                    .binaries
                    .insert(((*step).to_owned(), (*binary).to_owned()), passed);
            }
        }
        Ok(minimums)
    }

    /// The figures of a run: what each test step and each of its binaries passed.
    pub(crate) fn of(results: &[StepResult]) -> Minimums {
        let mut minimums = Minimums::default();
        for r in results.iter().filter(|r| is_test_step(&r.name)) {
            let passed = r.counts.map_or(0, |c| c.passed);
            minimums.steps.insert(r.name.clone(), passed);
            for (binary, c) in &r.binaries {
                minimums
                    .binaries
                    .insert((r.name.clone(), binary.clone()), c.passed);
            }
        }
        minimums
    }

    /// The file's text, steps in the order they ran.
    pub(crate) fn render(&self, order: &[String]) -> String {
        let mut text = HEADER.to_owned();
        let mut steps: Vec<&String> = self.steps.keys().collect();
        steps.sort_by_key(|s| order.iter().position(|o| o == *s).unwrap_or(usize::MAX));
        for step in steps {
            text.push_str(&format!("{step}\t*\t{}\n", self.steps[step]));
            for ((s, binary), passed) in &self.binaries {
                if s == step {
                    text.push_str(&format!("{step}\t{binary}\t{passed}\n"));
                }
            }
        }
        text
    }

    /// What is wrong with a test step against its figures: the step or a binary below
    /// its figure or gone, or one without a figure (record them).
    pub(crate) fn problems(&self, result: &StepResult) -> Vec<String> {
        const RECORD: &str = "record the figures with `cargo xtask test --record-minimums`";
        let mut problems = Vec::new();
        let passed = result.counts.map_or(0, |c| c.passed);
        match self.steps.get(&result.name) {
            None => problems.push(format!("the step has no recorded minimum: {RECORD}")),
            Some(&minimum) if passed < minimum => problems.push(format!(
                "passed {passed} tests, expected at least {minimum} (skipped tests do not \
                 count)"
            )),
            _ => {}
        }
        let of = |binary: &str| {
            result
                .binaries
                .iter()
                .find(|(b, _)| b == binary)
                .map(|(_, c)| c.passed)
        };
        for ((step, binary), &minimum) in &self.binaries {
            if *step != result.name {
                continue;
            }
            match of(binary) {
                None if minimum > 0 => problems.push(format!(
                    "the test binary {binary} did not run (expected at least {minimum} tests)"
                )),
                Some(n) if n < minimum => problems.push(format!(
                    "the test binary {binary} passed {n} tests, expected at least {minimum}"
                )),
                _ => {}
            }
        }
        for (binary, _) in &result.binaries {
            if !self
                .binaries
                .contains_key(&(result.name.clone(), binary.clone()))
            {
                problems.push(format!(
                    "the test binary {binary} has no recorded minimum: {RECORD}"
                ));
            }
        }
        problems
    }
}

impl Minimums {
    /// The figures `new` lowers or drops: `(step, binary, old, new)`, `*` as the
    /// binary for a step's own figure, 0 for a figure gone.
    pub(crate) fn lowered_by(&self, new: &Minimums) -> Vec<(String, String, u64, u64)> {
        let mut lowered = Vec::new();
        for (step, &old) in &self.steps {
            let now = new.steps.get(step).copied().unwrap_or(0);
            if now < old {
                lowered.push((step.clone(), "*".to_owned(), old, now));
            }
        }
        for ((step, binary), &old) in &self.binaries {
            let now = new
                .binaries
                .get(&(step.clone(), binary.clone()))
                .copied()
                .unwrap_or(0);
            if now < old {
                lowered.push((step.clone(), binary.clone(), old, now));
            }
        }
        lowered
    }

    /// An error naming each figure `new` would lower that `allowed` does not name (a
    /// test binary's name, or a step's for its own figure and all its binaries'): a
    /// recording where tests were skipped or lost must not lower the minimums silently.
    pub(crate) fn check_lowering(&self, new: &Minimums, allowed: &[String]) -> Result<()> {
        let refused: Vec<String> = self
            .lowered_by(new)
            .into_iter()
            .filter(|(step, binary, _, _)| !allowed.iter().any(|a| a == binary || a == step))
            .map(|(step, binary, old, now)| format!("{step} / {binary}: {old} -> {now}"))
            .collect();
        if refused.is_empty() {
            return Ok(());
        }
        bail!(
            "recording would lower {} figure(s), not written:\n  {}\nif the tests were \
             removed or moved on purpose, record again naming each binary (or step) with \
             `cargo xtask test --record-minimums --lower NAME`",
            refused.len(),
            refused.join("\n  ")
        )
    }
}

/// Whether a step runs tests (and so has figures): its name starts with "test ".
pub(crate) fn is_test_step(name: &str) -> bool {
    name.starts_with("test ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::steps::Counts;

    fn result(binaries: &[(&str, u64)], skipped: u64) -> StepResult {
        let counts = |passed| Counts {
            passed,
            ..Counts::default()
        };
        StepResult {
            name: "test -p k".into(),
            ok: true,
            time: std::time::Duration::ZERO,
            counts: Some(Counts {
                passed: binaries.iter().map(|(_, n)| n).sum(),
                not_run: skipped,
                ..Counts::default()
            }),
            binaries: binaries
                .iter()
                .map(|(b, n)| ((*b).to_owned(), counts(*n)))
                .collect(),
            skipped: Vec::new(),
        }
    }

    #[test]
    fn recording_refuses_to_lower_a_figure_that_is_not_named() {
        let old = figures();
        let mut new = figures();
        new.binaries
            .insert(("test -p k".into(), "tests/a.rs".into()), 1);
        new.steps.insert("test -p k".into(), 4);
        new.binaries
            .remove(&("test -p other".into(), "tests/b.rs".into()));
        let e = old
            .check_lowering(&new, &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("lower 3 figure(s)")
                && e.contains("test -p k / tests/a.rs: 2 -> 1")
                && e.contains("test -p other / tests/b.rs: 9 -> 0")
                && e.contains("--lower NAME"),
            "{e}"
        );
        // Named, each by its binary or its step: allowed.
        let named = [
            "tests/a.rs".to_owned(),
            "test -p k".to_owned(),
            "tests/b.rs".to_owned(),
        ];
        assert!(old.check_lowering(&new, &named).is_ok());
        assert!(old.check_lowering(&new, &named[..2]).is_err());
        // Raising or keeping a figure needs no name.
        assert!(old.check_lowering(&figures(), &[]).is_ok());
    }

    fn figures() -> Minimums {
        Minimums::parse(
            "# comment\ntest -p k\t*\t5\ntest -p k\tk src/lib.rs\t3\ntest -p k\ttests/a.rs\t2\n\
             test -p other\ttests/b.rs\t9\n",
        )
        .unwrap()
    }

    #[test]
    fn a_step_or_binary_gone_below_its_figure_or_without_one_is_a_problem() {
        let minimums = figures();
        let all = result(&[("k src/lib.rs", 3), ("tests/a.rs", 5)], 0);
        assert_eq!(minimums.problems(&all), Vec::<String>::new());
        // tests/a.rs vanished: the step's own count could still be high.
        let gone = result(&[("k src/lib.rs", 30)], 0);
        let p = minimums.problems(&gone);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("tests/a.rs did not run"), "{p:?}");
        let below = result(&[("k src/lib.rs", 2), ("tests/a.rs", 2)], 0);
        let p = minimums.problems(&below);
        assert!(
            p[0].contains("passed 4 tests, expected at least 5"),
            "{p:?}"
        );
        assert!(
            p[1].contains("passed 2 tests, expected at least 3"),
            "{p:?}"
        );
        let new = result(
            &[("k src/lib.rs", 3), ("tests/a.rs", 2), ("tests/c.rs", 1)],
            0,
        );
        let p = minimums.problems(&new);
        assert!(p[0].contains("tests/c.rs has no recorded minimum"), "{p:?}");
        let mut unknown = all;
        unknown.name = "test -p new".into();
        assert!(minimums.problems(&unknown)[0].contains("the step has no recorded minimum"));
    }

    #[test]
    fn a_skipped_test_never_counts_toward_a_figure() {
        // Three of tests/a.rs's five skipped knowingly: two passes, one short.
        let mut skipping = result(&[("k src/lib.rs", 3), ("tests/a.rs", 1)], 3);
        skipping.binaries[1].1.not_run = 3;
        let p = figures().problems(&skipping);
        assert!(
            p.iter().any(|p| p.contains("tests/a.rs passed 1 tests")),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|p| p.contains("passed 4 tests, expected at least 5")),
            "{p:?}"
        );
    }

    #[test]
    fn recorded_figures_read_back_as_they_were_and_damage_is_named() {
        let run = [result(&[("k src/lib.rs", 3), ("tests/a.rs", 2)], 0)];
        let recorded = Minimums::of(&run);
        let text = recorded.render(&["test -p k".to_owned()]);
        assert!(text.starts_with("# The tests each step"), "{text}");
        assert_eq!(Minimums::parse(&text).unwrap(), recorded);
        assert_eq!(recorded.steps["test -p k"], 5);
        let e = Minimums::parse("test -p k\t*\n").unwrap_err().to_string();
        assert!(
            e.contains("line 1") && e.contains("--record-minimums"),
            "{e}"
        );
        let e = Minimums::parse("test -p k\t*\tmany\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"many\" is not a number"), "{e}");
    }

    /// The figures in the repository read, and name every step `cargo xtask test` runs
    /// with its binaries: a step added without recording fails here first.
    #[test]
    fn the_recorded_figures_read_and_cover_the_matrixs_steps() {
        let minimums = Minimums::read().unwrap();
        for step in crate::test::test_step_names() {
            assert!(
                minimums.steps.contains_key(&step),
                "{step} has no recorded minimum: record them with `cargo xtask test \
                 --record-minimums`"
            );
            assert!(
                minimums.binaries.keys().any(|(s, _)| *s == step),
                "{step} has no test binary recorded: {minimums:?}"
            );
        }
    }
}
