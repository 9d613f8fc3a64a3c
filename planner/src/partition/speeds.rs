//! A layer split for pipeline ranks that run at different speeds: rank `r` takes `speed_r`
//! times as long as the profile says (a straggler: `speed > 1`), so a stage's time is
//! `speed_r x Σ` its layers' costs. Contiguous stages in rank order, one per rank (a loop
//! placement with one stage per rank), minimising the slowest stage: the bottleneck
//! partition of a chain (Bokhari 1988), solved exactly by dynamic programming over (rank,
//! layers taken so far) in `O(p n^2)`: a greedy probe that gives each rank as many layers as
//! fit is not exact here, since a layer a slow rank cannot take cheaply may be better left to
//! a faster rank after it.

use std::ops::Range;

/// The split of layers of `costs` (seconds each, any positive unit) over ranks of `speeds`
/// (`speeds.len()` ranks, each a factor > 0 on its stage's time, each stage at least one
/// layer) that minimises the slowest stage's time `max_r speeds[r] Σ costs[stage r]`, and that
/// time. `None` for fewer layers than ranks, no rank, or a cost or speed that is not finite
/// (or a speed <= 0, a cost < 0).
pub fn split_for_speeds(costs: &[f64], speeds: &[f64]) -> Option<(Vec<Range<usize>>, f64)> {
    let (n, p) = (costs.len(), speeds.len());
    if p == 0
        || n < p
        || costs.iter().any(|c| !c.is_finite() || *c < 0.0)
        || speeds.iter().any(|s| !s.is_finite() || *s <= 0.0)
    {
        return None;
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    // best[r][j]: the least bottleneck of layers 0..j on ranks 0..=r; from[r][j] its split point.
    let mut best = vec![vec![f64::INFINITY; n + 1]; p];
    let mut from = vec![vec![0usize; n + 1]; p];
    for j in 1..=n {
        best[0][j] = speeds[0] * prefix[j];
    }
    for r in 1..p {
        for j in r + 1..=n {
            for i in r..j {
                let t = best[r - 1][i].max(speeds[r] * (prefix[j] - prefix[i]));
                if t < best[r][j] {
                    best[r][j] = t;
                    from[r][j] = i;
                }
            }
        }
    }
    let mut stages = vec![0..0; p];
    let mut end = n;
    for r in (0..p).rev() {
        let start = if r == 0 { 0 } else { from[r][end] };
        stages[r] = start..end;
        end = start;
    }
    Some((stages, best[p - 1][n]))
}

/// A rank that stays slower than the fastest by more than this ratio gets a layer split
/// proposed ([`propose_split`]).
pub const SLOW_RATIO: f64 = 1.1;

/// A layer split for ranks measured at `speeds` (one per pipeline rank, time factors against
/// `profile`, one stage per rank on `stages`): each layer's F + I + W at a microbatch of
/// `tokens` tokens and `pairs` causal pairs, each rank's stage times its factor
/// ([`split_for_speeds`]). `None` when no rank is slower than another by more than
/// [`SLOW_RATIO`], there is not one stage per rank, or the split found is the current one or
/// no faster. Returns the proposed stages, the current and the proposed bottleneck (seconds
/// per microbatch).
pub fn propose_split(
    profile: &flatpipe_profiles::Profile,
    stages: &[Range<usize>],
    speeds: &[f64],
    (tokens, pairs): (f64, f64),
) -> Option<(Vec<Range<usize>>, f64, f64)> {
    use flatpipe_profiles::Phase;
    let (lo, hi) = speeds
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
    if speeds.len() != stages.len() || hi < SLOW_RATIO * lo {
        return None;
    }
    let costs: Vec<f64> = profile
        .layers
        .iter()
        .map(|l| {
            [Phase::F, Phase::I, Phase::W]
                .iter()
                .map(|&ph| l.coeffs(ph).time_s(tokens, pairs))
                .sum()
        })
        .collect();
    let now = stages
        .iter()
        .zip(speeds)
        .map(|(r, s)| s * costs.get(r.clone()).map_or(0.0, |c| c.iter().sum::<f64>()))
        .fold(0.0, f64::max);
    let (proposed, t) = split_for_speeds(&costs, speeds)?;
    (proposed != stages && t < now).then_some((proposed, now, t))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten equal layers on two ranks, the second 1.5x slower: 6 and 4 layers (6 vs 4 x 1.5 =
    /// 6), against 5 and 5 at equal speed.
    #[test]
    fn a_slower_rank_gets_fewer_layers() {
        let costs = [1.0; 10];
        let (split, t) = split_for_speeds(&costs, &[1.0, 1.5]).unwrap();
        assert_eq!(split, vec![0..6, 6..10]);
        assert!((t - 6.0).abs() < 1e-9);
        let (even, t) = split_for_speeds(&costs, &[1.0, 1.0]).unwrap();
        assert_eq!(even, vec![0..5, 5..10]);
        assert!((t - 5.0).abs() < 1e-9);
        assert!(split_for_speeds(&costs[..1], &[1.0, 1.0]).is_none());
        assert!(split_for_speeds(&costs, &[1.0, 0.0]).is_none());
    }

    /// Against every split of a small chain: the bisection finds the optimal bottleneck.
    #[test]
    fn the_bottleneck_is_the_best_of_every_split() {
        let costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0];
        for speeds in [[1.0, 1.0, 1.0], [1.0, 2.0, 1.0], [1.7, 1.0, 1.2]] {
            let (_, t) = split_for_speeds(&costs, &speeds).unwrap();
            let mut best = f64::INFINITY;
            for a in 1..costs.len() - 1 {
                for b in a + 1..costs.len() {
                    let stage = |r: Range<usize>, s: f64| s * costs[r].iter().sum::<f64>();
                    let m = stage(0..a, speeds[0])
                        .max(stage(a..b, speeds[1]))
                        .max(stage(b..costs.len(), speeds[2]));
                    best = best.min(m);
                }
            }
            assert!((t - best).abs() <= 1e-9 * best, "{speeds:?}: {t} vs {best}");
        }
    }
}
