//! The layer split of one candidate ([`plan_candidate`]): the partition problem from the
//! profile, the sampled steps' statistics and the schedule's in-flight microbatches, solved
//! by [`crate::partition::solve_with`].

use super::stats::BatchStats;
use super::{SearchConfig, SearchSpace};
use crate::partition::{LayerCost, Partition, PartitionProblem, solve_with};
use crate::{Error, Result};
use flatpipe_profiles::Profile;
use flatpipe_simulator::costs::sharding::StateBytes;
use flatpipe_simulator::costs::{
    Recompute, UniformCostSpec, UniformCosts, input_bytes_per_token, recompute_effect,
};
use flatpipe_simulator::replay::metrics::stage_inflight_peaks;
use flatpipe_simulator::{ScheduleKind, replay};

/// Peak in-flight microbatches per stage, computed once per (kind, pp, v, m) within a search.
pub(super) type InflightCache =
    std::sync::Mutex<std::collections::HashMap<(ScheduleKind, u32, u32, u32), Vec<f64>>>;

/// The peak in-flight microbatches of every stage of `kind` on `pp` ranks with `v` stages each
/// and `m` microbatches, from a replay under uniform costs; the same for every candidate of
/// that shape, so computed once per shape in `cache` (a 512-rank schedule is not rebuilt per
/// budget and sharding mode).
fn inflight_peaks(
    cache: &InflightCache,
    kind: ScheduleKind,
    pp: u32,
    v: u32,
    m: u32,
) -> Result<Vec<f64>> {
    if let Some(p) = cache
        .lock()
        .ok()
        .and_then(|c| c.get(&(kind, pp, v, m)).cloned())
    {
        return Ok(p);
    }
    let schedule = kind.generate(pp, v, m)?;
    let uniform = replay::replay(
        &schedule,
        &UniformCosts::new(&UniformCostSpec::default(), v),
    )?;
    let peaks: Vec<f64> = stage_inflight_peaks(&schedule, &uniform)
        .into_iter()
        .map(f64::from)
        .collect();
    if let Ok(mut c) = cache.lock() {
        c.insert((kind, pp, v, m), peaks.clone());
    }
    Ok(peaks)
}

/// The split of a candidate's layers into its `pp * v` stages with recomputation, under the
/// memory limit: per-layer costs of the representative microbatch (`stats`' mean tokens and
/// attention pairs), activations reserved for microbatches of `act_tokens` tokens, in-flight
/// counts of the schedule's replay at the most microbatches sampled ([`inflight_peaks`]).
///
/// # Errors
/// [`Error::InfeasibleMemory`] when the static state alone, spread over pp ranks, or any split
/// exceeds the limit; generation and replay errors.
pub(super) fn plan_candidate(
    profile: &Profile,
    space: &SearchSpace,
    config: &SearchConfig,
    stats: &BatchStats,
    (pp, v, kind, act_tokens): (u32, u32, ScheduleKind, f64),
    (state, expert_state): (StateBytes, StateBytes),
    cache: &InflightCache,
) -> Result<Partition> {
    // A layer's routed experts hold `expert_state` bytes per parameter (sharded over fewer
    // replicas), counted as the parameters that would hold as much at `state`.
    let ratio = expert_state.total() / state.total();
    let equivalent = |l: &flatpipe_profiles::LayerProfile| -> f64 {
        let e = l.shape.expert_params as f64;
        l.param_count as f64 - e + e * ratio
    };
    // Quick reject, before the schedule is built: the static memory alone, spread perfectly
    // over pp ranks, must fit.
    let static_total: f64 = profile.layers.iter().map(equivalent).sum::<f64>() * state.total();
    if static_total / pp as f64 > config.memory_limit_bytes {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        return Err(Error::InfeasibleMemory {
            layers: profile.layers.len(),
            stages: (pp * v) as usize,
            limit_gib: gib(config.memory_limit_bytes),
            explanation: format!(
                "parameters, gradients and optimizer state alone need {:.1} GiB per rank over {pp} ranks; limit {:.1} GiB",
                gib(static_total / pp as f64),
                gib(config.memory_limit_bytes)
            ),
        });
    }
    let inflight = inflight_peaks(cache, kind, pp, v, stats.max_count)?;
    let layers = profile
        .layers
        .iter()
        .enumerate()
        .map(|(j, l)| {
            let input = input_bytes_per_token(profile, j);
            let mut time_s = [0.0; 3];
            let mut act_bytes = [0.0; 3];
            for (mi, &m) in Recompute::ALL.iter().enumerate() {
                let e = recompute_effect(l, input, m, stats.mean_tokens, stats.mean_pairs);
                time_s[mi] = l.f.time_s(stats.mean_tokens, stats.mean_pairs)
                    + l.i.time_s(stats.mean_tokens, stats.mean_pairs)
                    + l.w.time_s(stats.mean_tokens, stats.mean_pairs)
                    + e.extra_i_s;
                // An in-flight microbatch holds at most its peak (after F, or after I with
                // what I recomputed); the simulated peak, which decides, is exact.
                act_bytes[mi] = recompute_effect(l, input, m, act_tokens, 0.0).peak();
            }
            LayerCost {
                time_s,
                act_bytes,
                params: equivalent(l).round() as u64,
            }
        })
        .collect();
    let placement = kind.placement_on(pp, v)?;
    let problem = PartitionProblem {
        layers,
        placement,
        inflight,
        memory_limit_bytes: config.memory_limit_bytes,
        static_bytes: state,
        modes: space.recompute.clone(),
    };
    solve_with(&problem, config.exact_split)
}
