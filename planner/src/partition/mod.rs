//! Contiguous layer partition into `S = p * v` stages under per-rank memory limits.
//!
//! Every layer goes to exactly one stage and stages are contiguous, non-empty ranges in model
//! order (an embedding-only or head-only stage is allowed). Each stage picks an activation
//! recomputation mode ([`Recompute`]). The objective is the bottleneck: the largest stage time
//! (F + I + W of a representative microbatch, plus recomputation). Memory of rank r:
//! `Σ_{s on r} Σ_{l in s} (static_l + k_s * act_l(mode_s))`, with `k_s` the stage's peak
//! in-flight microbatches from the simulator's replay of the schedule.
//!
//! Three exact solvers:
//! - [`solve_dp`]: dynamic program over (stage, last layer), `O(S L² modes)`, exact when every
//!   rank holds one stage (then memory is per stage) or no memory limit binds.
//! - branch and bound ([`crate::partition::bnb`], the default for several stages per rank under a binding
//!   limit): a binary search over candidate bottlenecks with a depth-first feasibility search,
//!   pure Rust, deterministic node budget.
//! - [`solve_milp`]: a MILP (good_lp; HiGHS with the `highs` feature, which needs cmake and
//!   libclang to build; otherwise the pure-Rust microlp, for small instances only) in the
//!   cumulative formulation: `u[l][s] = 1` iff layer l is in a stage `<= s`;
//!   `x[l][s] = u[l][s] - u[l][s-1]` is membership, contiguity is `u[l+1][s] <= u[l][s]`, and the
//!   order of stages leaves no symmetry to break. Modes use `z[l][s][m] = x[l][s] AND r[s][m]`.
//!
//! [`solve`] runs the DP without memory limits first: its optimum is a lower bound on every
//! split; when it fits every rank it is optimal and nothing else runs.

pub mod bnb;
mod milp;
pub mod speeds;

pub use milp::{solve_milp, solve_milp_within};

use crate::{Error, Result};
use flatpipe_simulator::Placement;
use flatpipe_simulator::costs::Recompute;
use std::ops::Range;

/// Bytes per parameter kept for the whole step (the simulator's
/// [`flatpipe_simulator::costs::sharding::StateBytes`]), split as the infeasibility report shows it.
pub use flatpipe_simulator::costs::sharding::StateBytes as StaticBytes;

/// One layer's costs for the partition.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCost {
    /// Time of F + I + W of a representative microbatch per [`Recompute`] mode (indexed like
    /// `Recompute::ALL`), seconds.
    pub time_s: [f64; 3],
    /// Activation bytes one microbatch keeps per mode, bytes.
    pub act_bytes: [f64; 3],
    /// Parameter count.
    pub params: u64,
}

/// A partition problem.
#[derive(Debug, Clone)]
pub struct PartitionProblem {
    /// Layers in model order.
    pub layers: Vec<LayerCost>,
    /// Stage -> rank (`S` stages).
    pub placement: Placement,
    /// Peak in-flight microbatches of every stage (`k_s`).
    pub inflight: Vec<f64>,
    /// Memory limit per rank, bytes (`f64::INFINITY` for none).
    pub memory_limit_bytes: f64,
    /// Bytes per parameter.
    pub static_bytes: StaticBytes,
    /// Allowed recomputation modes.
    pub modes: Vec<Recompute>,
}

/// A solution.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// Layer range of every stage.
    pub stages: Vec<Range<usize>>,
    /// Recomputation of every stage.
    pub recompute: Vec<Recompute>,
    /// The largest stage time, seconds.
    pub bottleneck_s: f64,
    /// Memory of every rank under the model, bytes.
    pub rank_memory_bytes: Vec<f64>,
    /// Which solver produced it (`dp`, `dp (memory not binding)`, `milp`, `milp (time
    /// limit)`, `dp (per-stage memory shares)`).
    pub solver: &'static str,
    /// A certified lower bound on the optimal bottleneck (the memory-free optimum), seconds:
    /// `bottleneck_s / lower_bound_s - 1` bounds how far from optimal this split can be.
    pub lower_bound_s: f64,
    /// Whether the split is proven optimal.
    pub optimal: bool,
}

pub(crate) fn mode_index(m: Recompute) -> usize {
    Recompute::ALL
        .iter()
        .position(|x| *x == m)
        .expect("every mode is in ALL")
}

impl PartitionProblem {
    fn s_count(&self) -> usize {
        self.placement.num_stages() as usize
    }

    fn check(&self) -> Result<()> {
        let (l, s) = (self.layers.len(), self.s_count());
        if s == 0 || s > l {
            return Err(Error::invalid(
                "stages (pp x vpp)",
                s,
                format!(
                    "between 1 and the model's {l} layers (each stage holds at least one layer)"
                ),
            ));
        }
        if self.inflight.len() != s {
            return Err(Error::invalid(
                "inflight",
                self.inflight.len(),
                format!("one per stage ({s})"),
            ));
        }
        if self.modes.is_empty() {
            return Err(Error::invalid(
                "recompute modes",
                "none",
                "at least one mode",
            ));
        }
        Ok(())
    }

    /// Time of layers `r` in `mode`, seconds.
    fn time(&self, r: Range<usize>, mode: Recompute) -> f64 {
        self.layers[r]
            .iter()
            .map(|l| l.time_s[mode_index(mode)])
            .sum()
    }

    /// Memory of stage `s` holding layers `r` in `mode`, bytes.
    fn stage_memory(&self, s: usize, r: Range<usize>, mode: Recompute) -> f64 {
        let k = self.inflight[s];
        self.layers[r]
            .iter()
            .map(|l| {
                l.params as f64 * self.static_bytes.total() + k * l.act_bytes[mode_index(mode)]
            })
            .sum()
    }

    /// Memory of every rank for a partition, bytes.
    pub fn rank_memory(&self, stages: &[Range<usize>], recompute: &[Recompute]) -> Vec<f64> {
        let mut mem = vec![0.0; self.placement.num_ranks as usize];
        for (s, r) in stages.iter().enumerate() {
            mem[self.placement.rank_of[s].idx()] += self.stage_memory(s, r.clone(), recompute[s]);
        }
        mem
    }

    /// The heaviest rank of a partition as text: "rank 0 needs 151.2 GiB: params 15.0, grads
    /// 15.0, optimizer 90.1, activations 31.1".
    pub fn explain_rank(&self, stages: &[Range<usize>], recompute: &[Recompute]) -> String {
        let p = self.placement.num_ranks as usize;
        let mut params = vec![0.0; p];
        let mut act = vec![0.0; p];
        for (s, r) in stages.iter().enumerate() {
            let rank = self.placement.rank_of[s].idx();
            params[rank] += self.layers[r.clone()]
                .iter()
                .map(|l| l.params as f64)
                .sum::<f64>();
            act[rank] += self.inflight[s]
                * self.layers[r.clone()]
                    .iter()
                    .map(|l| l.act_bytes[mode_index(recompute[s])])
                    .sum::<f64>();
        }
        let total: Vec<f64> = (0..p)
            .map(|r| params[r] * self.static_bytes.total() + act[r])
            .collect();
        // The heaviest rank; the lowest index among equals.
        let r = (0..p).fold(0, |best, r| if total[r] > total[best] { r } else { best });
        let g = |b: f64| b / (1u64 << 30) as f64;
        format!(
            "rank {r} needs {:.1} GiB: params {:.1}, grads {:.1}, optimizer {:.1}, activations {:.1}",
            g(total[r]),
            g(params[r] * self.static_bytes.params),
            g(params[r] * self.static_bytes.grads),
            g(params[r] * self.static_bytes.optimizer),
            g(act[r])
        )
    }
}

/// Exact dynamic program: the contiguous split minimising the bottleneck with every stage in
/// its fastest mode that fits, where each stage's memory must fit the limit on its own (exact
/// when every rank holds one stage; with `ignore_memory` a lower bound for any placement).
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty problem or more stages than layers;
/// [`Error::InfeasibleMemory`] when no split fits.
pub fn solve_dp(problem: &PartitionProblem, ignore_memory: bool) -> Result<Partition> {
    let limits = vec![
        if ignore_memory {
            f64::INFINITY
        } else {
            problem.memory_limit_bytes
        };
        problem.s_count()
    ];
    dp_with_stage_limits(problem, &limits)
}

/// The DP with a memory limit per stage, bytes.
fn dp_with_stage_limits(problem: &PartitionProblem, stage_limit: &[f64]) -> Result<Partition> {
    problem.check()?;
    let (l_count, s_count) = (problem.layers.len(), problem.s_count());
    // Prefix sums per mode for O(1) range time and activation; params prefix.
    let nm = Recompute::ALL.len();
    let mut t_pre = vec![vec![0.0; l_count + 1]; nm];
    let mut a_pre = vec![vec![0.0; l_count + 1]; nm];
    let mut p_pre = vec![0.0; l_count + 1];
    for (i, l) in problem.layers.iter().enumerate() {
        for m in 0..nm {
            t_pre[m][i + 1] = t_pre[m][i] + l.time_s[m];
            a_pre[m][i + 1] = a_pre[m][i] + l.act_bytes[m];
        }
        p_pre[i + 1] = p_pre[i] + l.params as f64 * problem.static_bytes.total();
    }
    let best_mode = |s: usize, j: usize, l: usize| -> Option<(f64, Recompute)> {
        problem
            .modes
            .iter()
            .filter_map(|&m| {
                let mi = mode_index(m);
                let mem = p_pre[l] - p_pre[j] + problem.inflight[s] * (a_pre[mi][l] - a_pre[mi][j]);
                (mem <= stage_limit[s]).then_some((t_pre[mi][l] - t_pre[mi][j], m))
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
    };
    const INF: f64 = f64::INFINITY;
    // f[s][l]: best bottleneck of layers 0..l in stages 0..=s (stage s ends at l).
    let mut f = vec![vec![INF; l_count + 1]; s_count];
    let mut arg = vec![vec![(0usize, Recompute::None); l_count + 1]; s_count];
    for l in 1..=l_count {
        if let Some((t, m)) = best_mode(0, 0, l) {
            f[0][l] = t;
            arg[0][l] = (0, m);
        }
    }
    for s in 1..s_count {
        // Stage s ends at l >= s + 1 and leaves at least one layer per later stage.
        for l in s + 1..=l_count - (s_count - 1 - s) {
            for j in s..l {
                let prev = f[s - 1][j];
                if prev >= f[s][l] {
                    continue;
                }
                if let Some((t, m)) = best_mode(s, j, l) {
                    let v = prev.max(t);
                    if v < f[s][l] {
                        f[s][l] = v;
                        arg[s][l] = (j, m);
                    }
                }
            }
        }
    }
    let bottleneck = f[s_count - 1][l_count];
    if !bottleneck.is_finite() {
        return Err(infeasible(problem));
    }
    let mut stages = vec![0..0; s_count];
    let mut recompute = vec![Recompute::None; s_count];
    let mut end = l_count;
    for s in (0..s_count).rev() {
        let (j, m) = arg[s][end];
        stages[s] = j..end;
        recompute[s] = m;
        end = j;
    }
    let rank_memory_bytes = problem.rank_memory(&stages, &recompute);
    Ok(Partition {
        stages,
        recompute,
        bottleneck_s: bottleneck,
        rank_memory_bytes,
        solver: "dp",
        lower_bound_s: bottleneck,
        optimal: true,
    })
}

/// The infeasibility report: the heaviest rank of the split that needs the least memory (every
/// stage in its most memory-saving allowed mode, layers split to minimise the largest stage's
/// memory).
fn infeasible(problem: &PartitionProblem) -> Error {
    let lean = *problem
        .modes
        .iter()
        .min_by(|a, b| {
            let act = |m: Recompute| {
                problem
                    .layers
                    .iter()
                    .map(|l| l.act_bytes[mode_index(m)])
                    .sum::<f64>()
            };
            act(**a).total_cmp(&act(**b))
        })
        .expect("checked: at least one mode");
    let s_count = problem.s_count();
    // Min-max memory split by binary search over a greedy fill (memory is additive per stage).
    let mem_of = |s: usize, r: Range<usize>| problem.stage_memory(s, r, lean);
    let fits = |cap: f64| -> Option<Vec<Range<usize>>> {
        let mut stages = Vec::with_capacity(s_count);
        let mut start = 0;
        for s in 0..s_count {
            let left_stages = s_count - s - 1;
            let mut end = start + 1;
            if mem_of(s, start..end) > cap {
                return None;
            }
            while end < problem.layers.len() - left_stages && mem_of(s, start..end + 1) <= cap {
                end += 1;
            }
            if s == s_count - 1 {
                end = problem.layers.len();
                if mem_of(s, start..end) > cap {
                    return None;
                }
            }
            stages.push(start..end);
            start = end;
        }
        Some(stages)
    };
    let (mut lo, mut hi) = (
        0.0,
        problem
            .layers
            .iter()
            .enumerate()
            .map(|(i, _)| mem_of(0, i..i + 1))
            .sum::<f64>()
            * 4.0
            + 1.0,
    );
    for _ in 0..100 {
        let mid = (lo + hi) / 2.0;
        if fits(mid).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let stages = fits(hi).unwrap_or_default();
    let recompute = vec![lean; stages.len()];
    let explanation = if stages.len() == s_count {
        format!(
            "{}; limit {:.1} GiB",
            problem.explain_rank(&stages, &recompute),
            problem.memory_limit_bytes / (1u64 << 30) as f64
        )
    } else {
        "no split found".into()
    };
    Error::InfeasibleMemory {
        layers: problem.layers.len(),
        stages: s_count,
        limit_gib: problem.memory_limit_bytes / (1u64 << 30) as f64,
        explanation,
    }
}

/// Time limit of the HiGHS MILP ([`ExactSplit::Highs`]), seconds.
pub const MILP_TIME_LIMIT_S: f64 = 0.5;

/// Certified gap below which [`ExactSplit::Highs`] keeps the fast split without the MILP.
pub const ACCEPT_GAP: f64 = 0.02;

/// How [`solve_with`] improves on the fast split when memory forces a split away from the
/// fastest one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExactSplit {
    /// Keep the DP-based split with its certified gap; search only when the DP finds none.
    Off,
    /// Branch and bound ([`crate::partition::bnb`]), pure Rust, `node_budget` search nodes per
    /// feasibility question (deterministic).
    BranchAndBound {
        /// Search nodes per feasibility question.
        node_budget: u64,
    },
    /// HiGHS's MILP within a time limit, stopping at a 1% gap. Needs the `highs` feature
    /// (cmake and libclang to build); without it [`solve_with`] returns [`Error::Solver`].
    Highs {
        /// Time limit, seconds.
        time_limit_s: f64,
    },
}

impl ExactSplit {
    /// Branch and bound with the default budget ([`crate::partition::bnb::NODE_BUDGET`]).
    pub const DEFAULT: ExactSplit = ExactSplit::BranchAndBound {
        node_budget: crate::partition::bnb::NODE_BUDGET,
    };
}

/// The best partition:
/// 1. one stage per rank: the DP, exact;
/// 2. otherwise the DP without memory limits gives a certified lower bound; when its split
///    fits every rank it is optimal; a DP where each stage may use the rank's limit less one
///    layer's memory for each other stage of its rank (a relaxation) tightens the bound;
/// 3. if even a perfect spread of the leanest memory over the ranks exceeds the limit, no
///    split fits;
/// 4. otherwise a feasible split from the DP with per-stage shares of each rank's limit; if it
///    reaches the lower bound it is optimal, else the branch and bound
///    ([`ExactSplit::DEFAULT`]) looks for a better or proven-optimal one.
///    The result carries the lower bound, so its gap to optimal is certified either way.
///
/// # Errors
/// As [`solve_dp`]; [`Error::InfeasibleMemory`] when no split fits.
pub fn solve(problem: &PartitionProblem) -> Result<Partition> {
    solve_with(problem, ExactSplit::DEFAULT)
}

/// [`solve`] with the choice of exact search (see [`ExactSplit`]).
///
/// # Errors
/// As [`solve`]; [`Error::Solver`] for [`ExactSplit::Highs`] without the `highs` feature or
/// on a HiGHS failure.
pub fn solve_with(problem: &PartitionProblem, exact: ExactSplit) -> Result<Partition> {
    problem.check()?;
    let one_stage_per_rank = problem.s_count() == problem.placement.num_ranks as usize;
    if one_stage_per_rank {
        return solve_dp(problem, false);
    }
    let free = solve_dp(problem, true)?;
    let lb = free.bottleneck_s;
    if free
        .rank_memory_bytes
        .iter()
        .all(|&m| m <= problem.memory_limit_bytes)
    {
        return Ok(Partition {
            solver: "dp (memory not binding)",
            ..free
        });
    }
    let lean = problem
        .modes
        .iter()
        .map(|&m| {
            problem
                .layers
                .iter()
                .map(|l| {
                    l.params as f64 * problem.static_bytes.total()
                        + problem.inflight.iter().copied().fold(f64::MAX, f64::min)
                            * l.act_bytes[mode_index(m)]
                })
                .sum::<f64>()
        })
        .fold(f64::MAX, f64::min);
    if lean / problem.placement.num_ranks as f64 > problem.memory_limit_bytes {
        return Err(infeasible(problem));
    }
    // A tighter certified bound: every other stage of a rank holds at least one layer, so stage
    // s may use at most the limit minus the least one-layer memory of each of them. The DP
    // with those per-stage limits is a relaxation of the real problem: its optimum bounds
    // every feasible split from below, and when it has no split, nothing fits.
    let one_layer = |s: usize| {
        problem
            .layers
            .iter()
            .map(|l| {
                l.params as f64 * problem.static_bytes.total()
                    + problem.inflight[s]
                        * problem
                            .modes
                            .iter()
                            .map(|&m| l.act_bytes[mode_index(m)])
                            .fold(f64::INFINITY, f64::min)
            })
            .fold(f64::INFINITY, f64::min)
    };
    let relaxed: Vec<f64> = (0..problem.s_count())
        .map(|s| {
            let others: f64 = problem
                .placement
                .stages_of(problem.placement.rank_of[s])
                .iter()
                .filter(|o| o.idx() != s)
                .map(|o| one_layer(o.idx()))
                .sum();
            problem.memory_limit_bytes - others
        })
        .collect();
    let lb = match dp_with_stage_limits(problem, &relaxed) {
        Ok(r) => lb.max(r.bottleneck_s),
        Err(Error::InfeasibleMemory { .. }) => return Err(infeasible(problem)),
        Err(e) => return Err(e),
    };
    let shares: Vec<f64> = (0..problem.s_count())
        .map(|s| {
            let on_rank = problem
                .placement
                .stages_of(problem.placement.rank_of[s])
                .len() as f64;
            problem.memory_limit_bytes / on_rank
        })
        .collect();
    let heuristic = dp_with_stage_limits(problem, &shares)
        .ok()
        .map(|h| Partition {
            solver: "dp (per-stage memory shares)",
            lower_bound_s: lb,
            optimal: h.bottleneck_s <= lb * (1.0 + 1e-9),
            ..h
        });
    // The fast split is kept when it is proven optimal, when no search is asked for, or, for
    // the (slower) HiGHS, within ACCEPT_GAP of the bound.
    if let Some(h) = &heuristic
        && (h.optimal
            || exact == ExactSplit::Off
            || (matches!(exact, ExactSplit::Highs { .. })
                && h.bottleneck_s <= lb * (1.0 + ACCEPT_GAP)))
    {
        return Ok(h.clone());
    }
    let t0 = std::time::Instant::now();
    let result = match exact {
        ExactSplit::Highs { time_limit_s } => {
            highs_or_heuristic(problem, lb, time_limit_s, heuristic.clone())
        }
        // Without a split from the DP, the search runs even when not asked for.
        ExactSplit::Off => branch_and_bound(
            problem,
            lb,
            heuristic.as_ref(),
            crate::partition::bnb::NODE_BUDGET,
        ),
        ExactSplit::BranchAndBound { node_budget } => {
            branch_and_bound(problem, lb, heuristic.as_ref(), node_budget)
        }
    };
    tracing::debug!(
        "partition {exact:?}: {} layers, {} stages, {:.3} s, heuristic {:?}, result {:?}",
        problem.layers.len(),
        problem.s_count(),
        t0.elapsed().as_secs_f64(),
        heuristic.as_ref().map(|h| h.bottleneck_s / lb),
        result
            .as_ref()
            .map(|m| (m.bottleneck_s / lb, m.optimal, m.solver))
    );
    result
}

/// The branch and bound from the heuristic split (if any) down to the lower bound `lb`.
fn branch_and_bound(
    problem: &PartitionProblem,
    lb: f64,
    heuristic: Option<&Partition>,
    node_budget: u64,
) -> Result<Partition> {
    let out = crate::partition::bnb::solve(
        problem,
        lb,
        heuristic.map(|h| (h.stages.as_slice(), h.recompute.as_slice())),
        node_budget,
    );
    let Some((stages, recompute)) = out.split else {
        let mut err = infeasible(problem);
        if !out.decided
            && let Error::InfeasibleMemory { explanation, .. } = &mut err
        {
            explanation.push_str(&format!(
                " (no split found by the DP with per-stage shares of the limit, nor by the branch and bound within {node_budget} nodes per question)"
            ));
        }
        return Err(err);
    };
    let rank_memory_bytes = problem.rank_memory(&stages, &recompute);
    let optimal = out.bottleneck_s <= out.lower_bound_s * (1.0 + 1e-12);
    let from_heuristic = heuristic.is_some_and(|h| h.stages == stages && h.recompute == recompute);
    Ok(Partition {
        stages,
        recompute,
        bottleneck_s: out.bottleneck_s,
        rank_memory_bytes,
        solver: match (from_heuristic, optimal) {
            (true, true) => "dp (per-stage memory shares), proven optimal by branch and bound",
            (true, false) => "dp (per-stage memory shares)",
            (false, true) => "branch and bound",
            (false, false) => "branch and bound (node budget)",
        },
        lower_bound_s: out.lower_bound_s.max(lb),
        optimal,
    })
}

/// HiGHS within `time_limit_s`, or the heuristic split when HiGHS does no better.
fn highs_or_heuristic(
    problem: &PartitionProblem,
    lb: f64,
    time_limit_s: f64,
    heuristic: Option<Partition>,
) -> Result<Partition> {
    #[cfg(not(feature = "highs"))]
    {
        let _ = (problem, lb, time_limit_s, heuristic);
        Err(Error::Solver(
            "HiGHS is not built in: rebuild with `--features highs` (needs cmake and libclang), or use the default branch and bound".into(),
        ))
    }
    #[cfg(feature = "highs")]
    {
        let milp = solve_milp_within(problem, Some(time_limit_s));
        let best = match (milp, heuristic) {
            (Ok(m), Some(h)) => {
                if m.optimal || m.bottleneck_s <= h.bottleneck_s {
                    m
                } else {
                    Partition {
                        optimal: false,
                        ..h
                    }
                }
            }
            (Ok(m), None) => m,
            (Err(Error::InfeasibleMemory { .. }), _) => return Err(infeasible(problem)),
            (Err(_), Some(h)) => Partition {
                optimal: false,
                ..h
            },
            (Err(_), None) => {
                let mut err = infeasible(problem);
                if let Error::InfeasibleMemory { explanation, .. } = &mut err {
                    explanation.push_str(&format!(
                        " (no split found by the DP with per-stage shares of the limit, nor by the MILP within {time_limit_s} s)"
                    ));
                }
                return Err(err);
            }
        };
        Ok(Partition {
            lower_bound_s: lb,
            ..best
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(times: &[f64], p: u32, v: u32) -> PartitionProblem {
        PartitionProblem {
            layers: times
                .iter()
                .map(|&t| LayerCost {
                    time_s: [t; 3],
                    act_bytes: [0.0; 3],
                    params: 0,
                })
                .collect(),
            placement: Placement::looped(p, v),
            inflight: vec![1.0; (p * v) as usize],
            memory_limit_bytes: f64::INFINITY,
            static_bytes: StaticBytes::default(),
            modes: vec![Recompute::None],
        }
    }

    #[test]
    fn thirty_layers_on_four_ranks() {
        // 30 equal layers into 4 stages: the best bottleneck is ceil(30 / 4) = 8 layers.
        let part = solve_dp(&problem(&[1.0; 30], 4, 1), false).unwrap();
        assert_eq!(part.bottleneck_s, 8.0);
        let sizes: Vec<usize> = part.stages.iter().map(|r| r.len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 30);
        assert!(sizes.iter().all(|n| (1..=8).contains(n)), "{sizes:?}");
        let part = solve_dp(&problem(&[1.0; 10], 3, 1), false).unwrap();
        assert_eq!(part.bottleneck_s, 4.0);
    }

    #[test]
    fn milp_matches_dp_by_hand() {
        // Layers 5, 1, 1, 1, 5, 1 into 3 stages: [5] [1 1 1] [5 1] -> bottleneck 6.
        let pr = problem(&[5.0, 1.0, 1.0, 1.0, 5.0, 1.0], 3, 1);
        assert_eq!(solve_dp(&pr, false).unwrap().bottleneck_s, 6.0);
        assert_eq!(solve_milp(&pr).unwrap().bottleneck_s, 6.0);
    }
}
