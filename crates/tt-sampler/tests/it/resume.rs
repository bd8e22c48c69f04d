//! Interruption and resumption: what a killed run relies on.

use std::collections::BTreeSet;

use tt_sampler::{BatchSampler, DistributedSampler, Error, Reshard, SamplerState};

fn sampler(len: u64, replicas: u64, rank: u64) -> DistributedSampler {
    DistributedSampler::new(len, replicas, rank)
        .unwrap()
        .with_seed(7)
}

fn whole_epoch(len: u64, replicas: u64, rank: u64, epoch: u64) -> Vec<u64> {
    let mut s = sampler(len, replicas, rank);
    s.set_epoch(epoch);
    s.collect()
}

/// Saves mid-epoch as JSON (as a checkpoint would), "restarts", and continues.
fn roundtrip(s: &DistributedSampler, fresh: DistributedSampler) -> DistributedSampler {
    let json = serde_json::to_string(&s.state()).unwrap();
    let state: SamplerState = serde_json::from_str(&json).unwrap();
    let mut resumed = fresh;
    resumed.load_state(&state, Reshard::Refuse).unwrap();
    resumed
}

#[test]
fn resuming_after_any_position_yields_exactly_the_rest() {
    let (len, replicas, rank, epoch) = (1003, 3, 2, 4);
    let whole = whole_epoch(len, replicas, rank, epoch);
    for stop in [0, 1, 2, 100, whole.len() - 1, whole.len()] {
        let mut s = sampler(len, replicas, rank);
        s.set_epoch(epoch);
        let head: Vec<u64> = s.by_ref().take(stop).collect();
        assert_eq!(s.progress(), stop as u64, "iterating counts what it yields");
        assert_eq!(s.remaining(), (whole.len() - stop) as u64);
        // The fresh sampler is built with another seed: the state's seed wins.
        let resumed = roundtrip(&s, DistributedSampler::new(len, replicas, rank).unwrap());
        assert_eq!(resumed.remaining(), (whole.len() - stop) as u64);
        let tail: Vec<u64> = resumed.collect();
        assert_eq!([head, tail].concat(), whole, "stopped after {stop}");
    }
}

#[test]
fn advance_skips_and_is_saved() {
    let whole = whole_epoch(500, 2, 0, 1);
    let mut s = sampler(500, 2, 0);
    s.set_epoch(1);
    s.advance(40).unwrap();
    assert_eq!(s.progress(), 40);
    let resumed = roundtrip(&s, sampler(500, 2, 0));
    assert_eq!(resumed.collect::<Vec<_>>(), whole[40..]);
    // Up to the very end is fine.
    s.advance(210).unwrap();
    assert_eq!((s.remaining(), s.next()), (0, None));
}

#[test]
fn advancing_past_the_end_is_an_error_that_changes_nothing() {
    let whole = whole_epoch(500, 2, 0, 1);
    let mut s = sampler(500, 2, 0);
    s.set_epoch(1);
    // cycling_utils' pattern: iterate a batch, then advance by its length. Every
    // sample is counted twice; the second half of the epoch must not vanish silently.
    let mut seen = Vec::new();
    let error = loop {
        let batch: Vec<u64> = s.by_ref().take(32).collect();
        if batch.is_empty() {
            panic!("the double count ran to the end of the epoch without an error");
        }
        seen.extend_from_slice(&batch);
        let before = s.state();
        match s.advance(batch.len() as u64) {
            Ok(()) => {}
            Err(e) => {
                assert_eq!(s.state(), before, "a refused advance changes nothing");
                break e;
            }
        }
    };
    assert!(seen.len() < whole.len(), "the error comes before the end");
    assert_eq!(
        error,
        Error::AdvancePastEnd {
            n: 32,
            remaining: 250 - 224,
            num_samples: 250
        }
    );
    let text = error.to_string();
    assert!(text.contains("26 of its 250 samples left"), "{text}");
    assert!(text.contains("already counts what it yields"), "{text}");
    // The state at the error still loads and yields exactly what was left.
    let left = s.remaining() as usize;
    let resumed = roundtrip(&s, sampler(500, 2, 0));
    assert_eq!(resumed.collect::<Vec<_>>(), whole[whole.len() - left..]);
}

#[test]
fn set_epoch_of_the_resumed_epoch_keeps_its_progress() {
    // Epoch 2 of 3 stopped after 600 of 1000 samples; the usual torch loop
    // `for e in start.. { set_epoch(e); for i in sampler {..} }` resumes it.
    let (len, epochs) = (1000u64, 4u64);
    let mut s = sampler(len, 1, 0);
    s.set_epoch(2);
    let head: Vec<u64> = s.by_ref().take(600).collect();
    let state = s.state();
    let mut resumed = sampler(len, 1, 0);
    resumed.load_state(&state, Reshard::Refuse).unwrap();
    let mut per_epoch = Vec::new();
    for e in state.epoch..epochs {
        resumed.set_epoch(e);
        per_epoch.push(resumed.by_ref().collect::<Vec<u64>>());
    }
    assert_eq!(
        per_epoch[0].len(),
        400,
        "the rest of the epoch, not all of it"
    );
    assert_eq!(
        [head, per_epoch[0].clone()].concat(),
        whole_epoch(len, 1, 0, 2)
    );
    assert_eq!(per_epoch[1], whole_epoch(len, 1, 0, 3), "then whole epochs");
    // Moving to another epoch (even back) starts it from the beginning...
    resumed.set_epoch(2);
    assert_eq!(
        resumed.by_ref().collect::<Vec<_>>(),
        whole_epoch(len, 1, 0, 2)
    );
    // ...and going through the same epoch again is asked for explicitly.
    assert_eq!(resumed.next(), None);
    resumed.set_epoch(2);
    assert_eq!(
        resumed.next(),
        None,
        "set_epoch of the current epoch keeps it"
    );
    resumed.restart_epoch();
    assert_eq!(resumed.collect::<Vec<_>>(), whole_epoch(len, 1, 0, 2));
}

#[test]
fn another_dataset_length_is_never_resharded_silently() {
    // 2 ranks consumed 250 samples each of an epoch of 1000; the dataset grew to 1001.
    let mut saved = sampler(1000, 2, 0);
    saved.set_epoch(3);
    saved.advance(250).unwrap();
    let state = saved.state();
    for replicas in [2, 4] {
        let mut other = sampler(1001, replicas, 0);
        let before = other.state();
        let e = other.load_state(&state, Reshard::Allow).unwrap_err();
        assert_eq!(
            e,
            Error::LengthChanged {
                state_len: 1000,
                len: 1001
            }
        );
        assert!(e.to_string().contains("Reshard::RestartEpoch"), "{e}");
        assert_eq!(other.state(), before, "a refused state changes nothing");
    }
    // Asked explicitly: the saved epoch starts again over the new dataset.
    let restarted: Vec<u64> = (0..2)
        .flat_map(|r| {
            let mut s = sampler(1001, 2, r);
            s.load_state(&state, Reshard::RestartEpoch).unwrap();
            assert_eq!((s.epoch(), s.progress()), (3, 0));
            s.collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        restarted,
        [whole_epoch(1001, 2, 0, 3), whole_epoch(1001, 2, 1, 3)].concat()
    );
    // The same shape resumes exactly whatever the choice.
    let mut same = sampler(1000, 2, 0);
    same.load_state(&state, Reshard::RestartEpoch).unwrap();
    assert_eq!(same.progress(), 250);
}

#[test]
fn set_epoch_reshuffles_and_restarts() {
    let (e0, e1) = (whole_epoch(1000, 2, 1, 0), whole_epoch(1000, 2, 1, 1));
    assert_ne!(e0, e1, "a new epoch is a new order");
    assert_eq!(e0.iter().collect::<BTreeSet<_>>().len(), e0.len());
    let mut s = sampler(1000, 2, 1);
    s.by_ref().take(10).for_each(drop);
    s.set_epoch(1);
    assert_eq!((s.progress(), s.epoch()), (0, 1));
    assert_eq!(s.collect::<Vec<_>>(), e1);
    // Without shuffle every epoch is the same.
    let plain = |e| {
        let mut s = sampler(10, 3, 0).with_shuffle(false);
        s.set_epoch(e);
        s.collect::<Vec<_>>()
    };
    assert_eq!(plain(0), [0, 3, 6, 9]);
    assert_eq!(plain(5), plain(0));
}

#[test]
fn every_rank_together_covers_the_epoch() {
    for (len, replicas, drop_last) in [
        (10u64, 4u64, false),
        (10, 4, true),
        (3, 5, false),
        (0, 2, false),
    ] {
        let all: Vec<u64> = (0..replicas)
            .flat_map(|r| {
                let mut s = sampler(len, replicas, r).with_drop_last(drop_last);
                s.set_epoch(2);
                s.collect::<Vec<_>>()
            })
            .collect();
        let distinct: BTreeSet<u64> = all.iter().copied().collect();
        if drop_last {
            assert_eq!(all.len() as u64, len / replicas * replicas);
            assert_eq!(
                distinct.len(),
                all.len(),
                "no repeats when the tail is dropped"
            );
        } else {
            assert_eq!(all.len() as u64, len.div_ceil(replicas) * replicas);
            assert_eq!(
                distinct,
                (0..len).collect(),
                "padding repeats, nothing is missed"
            );
        }
    }
}

#[test]
fn states_of_another_shape_are_refused_unless_resharding() {
    let mut four = sampler(1000, 4, 0);
    four.by_ref().take(50).for_each(drop);
    let state = four.state();
    let mut errors = String::new();
    for mut other in [sampler(999, 4, 0), sampler(1000, 2, 0)] {
        let e = other.load_state(&state, Reshard::Refuse).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }));
        errors.push_str(&format!("{e}\n"));
    }
    let corrupt = SamplerState {
        progress: 251,
        ..state.clone()
    };
    errors.push_str(&format!(
        "{}\n",
        sampler(1000, 4, 0)
            .load_state(&corrupt, Reshard::Refuse)
            .unwrap_err()
    ));
    let zero = SamplerState {
        num_replicas: 0,
        ..state.clone()
    };
    errors.push_str(&format!(
        "{}\n",
        sampler(1000, 4, 0)
            .load_state(&zero, Reshard::Allow)
            .unwrap_err()
    ));
    insta::assert_snapshot!(errors);
}

#[test]
fn resharding_continues_the_epoch_where_the_whole_job_was() {
    // 4 ranks consumed 50 samples each of epoch 3 (200 positions); resume on 2 ranks.
    let (len, epoch) = (1000u64, 3u64);
    let consumed: BTreeSet<u64> = (0..4)
        .flat_map(|r| {
            let mut s = sampler(len, 4, r);
            s.set_epoch(epoch);
            s.take(50).collect::<Vec<_>>()
        })
        .collect();
    let mut saved = sampler(len, 4, 0);
    saved.set_epoch(epoch);
    saved.advance(50).unwrap();
    let state = saved.state();
    let rest: Vec<u64> = (0..2)
        .flat_map(|r| {
            let mut s = sampler(len, 2, r);
            s.load_state(&state, Reshard::Allow).unwrap();
            assert_eq!(s.epoch(), epoch);
            assert_eq!(s.num_samples(), 400);
            s.collect::<Vec<_>>()
        })
        .collect();
    let rest_set: BTreeSet<u64> = rest.iter().copied().collect();
    assert_eq!(rest.len(), 800);
    assert!(
        consumed.is_disjoint(&rest_set),
        "nothing already seen comes again"
    );
    assert_eq!(
        consumed.len() + rest_set.len(),
        len as usize,
        "and nothing is missed"
    );
    // The re-sharded state itself round-trips in its new shape.
    let mut two = sampler(len, 2, 1);
    two.load_state(&state, Reshard::Allow).unwrap();
    two.advance(100).unwrap();
    let expected: Vec<u64> = {
        let mut t = two.clone();
        t.by_ref().collect()
    };
    let mut again = sampler(len, 2, 1);
    again.load_state(&two.state(), Reshard::Refuse).unwrap();
    assert_eq!(again.collect::<Vec<_>>(), expected);
    // Its progress is checked against its own, shorter, epoch: one past the end of
    // what it covers is refused.
    let mut past = two.state();
    assert!(past.offset > 0, "{past:?}");
    past.progress = two.num_samples() + 1;
    assert!(matches!(
        sampler(len, 2, 1).load_state(&past, Reshard::Refuse),
        Err(tt_sampler::Error::ProgressPastEnd { .. })
    ));
    past.progress = two.num_samples();
    assert!(sampler(len, 2, 1)
        .load_state(&past, Reshard::Refuse)
        .is_ok());
    // A new epoch after a re-shard is a whole epoch again.
    two.set_epoch(epoch + 1);
    assert_eq!(two.num_samples(), 500);
}

#[test]
fn batches_count_samples_and_resume_at_the_next_batch() {
    let whole = whole_epoch(103, 1, 0, 0);
    let mut b = BatchSampler::new(sampler(103, 1, 0), 10, false).unwrap();
    assert_eq!(b.sampler().dataset_len(), 103);
    assert_eq!(b.remaining_batches(), 11);
    // The iterator knows its length exactly (collect reserves once; `len`-based code
    // relies on it).
    assert_eq!(b.size_hint(), (11, Some(11)));
    let first: Vec<Vec<u64>> = b.by_ref().take(3).collect();
    assert_eq!(b.size_hint(), (8, Some(8)));
    assert_eq!(b.state().progress, 30, "progress is in samples");
    // Resume with another batch size: still at sample 30.
    let mut s = sampler(103, 1, 0);
    s.load_state(&b.state(), Reshard::Refuse).unwrap();
    let mut b2 = BatchSampler::new(s, 25, false).unwrap();
    let rest: Vec<Vec<u64>> = b2.by_ref().collect();
    assert_eq!(rest.iter().map(Vec::len).collect::<Vec<_>>(), [25, 25, 23]);
    assert_eq!([first.concat(), rest.concat()].concat(), whole);
    // drop_last drops the short batch only.
    let mut b3 = BatchSampler::new(sampler(103, 1, 0), 10, true).unwrap();
    assert_eq!(b3.remaining_batches(), 10);
    assert_eq!(b3.by_ref().count(), 10);
    assert_eq!(b3.sampler().remaining(), 3);
    // ... and never a last batch that is exactly full.
    let mut b4 = BatchSampler::new(sampler(100, 1, 0), 10, true).unwrap();
    let all: Vec<Vec<u64>> = b4.by_ref().collect();
    assert_eq!(all.len(), 10, "the tenth batch of 10 is full: kept");
    assert_eq!(all.concat(), whole_epoch(100, 1, 0, 0));
    assert_eq!(b4.sampler().remaining(), 0);
    assert_eq!(
        BatchSampler::new(sampler(1, 1, 0), 0, false).unwrap_err(),
        Error::ZeroBatchSize
    );
}

#[test]
fn bad_arguments_are_clear_errors() {
    let msg = |r: Result<DistributedSampler, Error>| r.unwrap_err().to_string();
    insta::assert_snapshot!([
        msg(DistributedSampler::new(10, 0, 0)),
        msg(DistributedSampler::new(10, 4, 4))
    ]
    .join("\n"));
    let mut s = DistributedSampler::new(10, 1, 0)
        .unwrap()
        .with_seed(u64::MAX);
    s.set_epoch(1);
    assert!(matches!(s.next_index(), Err(Error::SeedOverflow { .. })));
}

#[test]
fn from_env_reads_torchrun_variables_in_a_real_process() {
    if let Ok(expect) = std::env::var("TT_SAMPLER_CHILD") {
        let got = match DistributedSampler::from_env(100) {
            Ok(s) => format!("{} {}", s.num_replicas(), s.rank()),
            Err(e) => e.to_string(),
        };
        assert_eq!(got, expect);
        return;
    }
    let slurm = |procid| {
        vec![
            ("SLURM_PROCID", procid),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
        ]
    };
    for (vars, expect) in [
        (vec![], "1 0"),
        (vec![("WORLD_SIZE", "8"), ("RANK", "5")], "8 5"),
        (
            vec![("WORLD_SIZE", "2"), ("RANK", "2")],
            "inconsistent distributed environment: RANK=2 but WORLD_SIZE=2: ranks go from 0 to 1",
        ),
        (
            vec![("WORLD_SIZE", "2"), ("RANK", "1O")],
            "RANK=\"1O\" is not a non-negative integer",
        ),
        // Under srun: Slurm's variables, no RANK; each task its own shard.
        (slurm("3"), "4 3"),
        (slurm("0"), "4 0"),
    ] {
        let out = tt_testkit::rerun("from_env_reads_torchrun_variables_in_a_real_process")
            .env_remove("WORLD_SIZE")
            .env_remove("RANK")
            .env_remove("LOCAL_RANK")
            .env_remove("SLURM_PROCID")
            .env_remove("SLURM_NTASKS")
            .env_remove("SLURM_LOCALID")
            .envs(vars)
            .env("TT_SAMPLER_CHILD", expect)
            .output()
            .unwrap();
        tt_testkit::assert_ran_one(&out);
    }
}

#[test]
fn peeking_shows_the_rest_of_the_epoch_without_taking_it() {
    let whole = whole_epoch(50, 2, 1, 0);
    let mut s = sampler(50, 2, 1);
    assert_eq!(s.size_hint(), (25, Some(25)));
    let head: Vec<u64> = s.by_ref().take(10).collect();
    assert_eq!(s.size_hint(), (15, Some(15)));
    let peeked = s.peek_remaining().unwrap();
    assert_eq!(peeked, whole[10..]);
    // Nothing was taken: the iteration goes on from the same place.
    assert_eq!(s.remaining(), 15);
    let rest: Vec<u64> = s.collect();
    assert_eq!([head, rest.clone()].concat(), whole);
    assert_eq!(peeked, rest);
}
