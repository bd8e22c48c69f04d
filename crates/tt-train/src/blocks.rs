//! Pieces of a training step that a hand-written loop can use as the trainer does.

use tch::Tensor;

/// `indices` split into `k` contiguous micro-batches (at most one per sample), sizes
/// differing by at most one: how [`TrainConfig::accumulate`](crate::TrainConfig::accumulate)
/// splits each rank's batch.
///
/// ```
/// let parts = tt_train::micro_batches(&[10, 11, 12, 13, 14], 2);
/// assert_eq!(parts, vec![&[10, 11, 12][..], &[13, 14][..]]);
/// ```
pub fn micro_batches(indices: &[u64], k: usize) -> Vec<&[u64]> {
    let k = k.clamp(1, indices.len().max(1));
    let (base, extra) = (indices.len() / k, indices.len() % k);
    let mut parts = Vec::with_capacity(k);
    let mut start = 0;
    for i in 0..k {
        let len = base + usize::from(i < extra);
        parts.push(&indices[start..start + len]);
        start += len;
    }
    parts
}

/// The seed the trainer gives libtorch's generators before step `step` of rank `rank`
/// ([`TrainConfig::seed_every_step`](crate::TrainConfig::seed_every_step)): splitmix64
/// of the three, so that neighbouring steps and ranks get unrelated streams. Pass it to
/// `tch::manual_seed` for a resumed run to draw as an uninterrupted one.
pub fn step_seed(seed: u64, rank: u64, step: u64) -> i64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(rank.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(step.wrapping_mul(0x94D0_49BB_1331_11EB));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 1) as i64
}

/// PyTorch's `torch.nn.utils.clip_grad_norm_`: scales every gradient of `params` by
/// `max_norm / (norm + 1e-6)` when that is below 1; returns the global L2 norm before
/// clipping as a 0-dim double tensor on the gradients' device (reading it is a host
/// sync: the trainer reads it only at log steps).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Tensor, tch::TchError> {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params
        .iter()
        .map(Tensor::grad)
        .filter(Tensor::defined)
        .collect();
    if grads.is_empty() {
        return Tensor::f_zeros([], (tch::Kind::Double, tch::Device::Cpu));
    }
    let norms = grads
        .iter()
        .map(|g| g.f_norm().and_then(|n| n.f_to_kind(tch::Kind::Double)))
        .collect::<Result<Vec<_>, _>>()?;
    let total = Tensor::f_stack(&norms, 0)?.f_norm()?;
    // A 0-dim tensor on the gradients' device: each in-place product keeps the
    // gradient's dtype.
    let coef = (max_norm / (&total + 1e-6)).f_clamp_max(1.0)?;
    for g in &grads {
        let _ = g.shallow_clone().f_mul_(&coef)?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::{micro_batches, step_seed};

    #[test]
    fn micro_batches_cover_the_batch_in_order_with_sizes_differing_by_one() {
        let idx: Vec<u64> = (10..17).collect();
        let parts = micro_batches(&idx, 3);
        assert_eq!(parts, vec![&idx[0..3], &idx[3..5], &idx[5..7]]);
        assert_eq!(micro_batches(&idx, 1), vec![&idx[..]]);
        assert_eq!(
            micro_batches(&idx[..2], 5).len(),
            2,
            "at most one part per sample"
        );
    }

    #[test]
    fn step_seeds_differ_by_step_rank_and_seed() {
        let a = step_seed(7, 0, 3);
        assert_eq!(a, step_seed(7, 0, 3));
        assert!(a >= 0);
        assert_ne!(a, step_seed(7, 0, 4));
        assert_ne!(a, step_seed(7, 1, 3));
        assert_ne!(a, step_seed(8, 0, 3));
    }
}
