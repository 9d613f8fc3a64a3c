//! The MILP split ([`solve_milp`]) in the cumulative formulation of the module docs, built in
//! steps: the variables ([`MilpVars`]), the constraints (stage order, stages, memory), the
//! objective (the bottleneck `t`, bounded below by the memory-free DP optimum) and the
//! read-back of a solution into a [`Partition`].

use super::{Partition, PartitionProblem, infeasible, mode_index, solve_dp};
use crate::{Error, Result};
use flatpipe_simulator::costs::Recompute;
use good_lp::{
    Constraint, Expression, ProblemVariables, Solution, SolverModel, Variable, constraint, variable,
};

/// The MILP (see the module docs), solved to proven optimality.
///
/// # Errors
/// [`Error::InfeasibleMemory`] when no split fits; [`Error::Solver`] on a solver failure.
pub fn solve_milp(problem: &PartitionProblem) -> Result<Partition> {
    solve_milp_within(problem, None)
}

/// [`solve_milp`] with a time limit in seconds (HiGHS only; microlp has none). When the limit
/// stops the search, the best split found is returned with `optimal: false`.
///
/// # Errors
/// As [`solve_milp`]; [`Error::Solver`] if the limit passes before any split is found.
pub fn solve_milp_within(
    problem: &PartitionProblem,
    time_limit_s: Option<f64>,
) -> Result<Partition> {
    #[cfg(feature = "highs")]
    {
        let limit = time_limit_s;
        // Within a time limit (the plan search) stop at a 1% relative gap: the result is
        // certified within 1% of optimal. Without one, prove optimality as documented (the 1%
        // gap, applied to every solve, let it return 34.1 where 34 was optimal: a property test
        // caught it).
        let gap = if limit.is_some() { 0.01 } else { 0.0 };
        milp_with(problem, move |p: good_lp::variable::UnsolvedProblem| {
            let m = good_lp::solvers::highs::highs(p).set_threads(1);
            let m = m
                .set_mip_rel_gap(gap)
                .unwrap_or_else(|_| unreachable!("0 and 0.01 are valid gaps"));
            match limit {
                Some(t) => m.set_time_limit(t),
                None => m,
            }
        })
    }
    #[cfg(not(feature = "highs"))]
    {
        let _ = time_limit_s;
        milp_with(problem, good_lp::solvers::microlp::microlp)
    }
}

/// Builds the MILP of `problem`, solves it with `solver` and reads the split back.
///
/// # Errors
/// [`PartitionProblem`]'s checks and the memory-free DP's; [`Error::InfeasibleMemory`] when
/// no split fits; [`Error::Solver`] on a solver failure.
fn milp_with<S>(problem: &PartitionProblem, solver: S) -> Result<Partition>
where
    S: good_lp::Solver,
    S::Model: SolverModel<Error = good_lp::ResolutionError>,
{
    problem.check()?;
    // The memory-free DP optimum bounds the bottleneck from below: as a constraint it closes
    // the weak LP bound of min-max splits, so the solver stops at the first split reaching it.
    let lb = solve_dp(problem, true)?.bottleneck_s;
    let mut problem_vars = ProblemVariables::new();
    let vars = MilpVars::new(&mut problem_vars, problem);
    let constraints = std::iter::once(constraint!(vars.t >= lb))
        .chain(order_constraints(&vars))
        .chain(stage_constraints(problem, &vars))
        .chain(memory_constraints(problem, &vars));
    let mut model = problem_vars.minimise(vars.t).using(solver);
    for c in constraints {
        model = model.with(c);
    }
    match model.solve() {
        Ok(sol) => Ok(read_back(problem, &vars, &sol, lb)),
        Err(good_lp::ResolutionError::Infeasible) => Err(infeasible(problem)),
        Err(e) => Err(Error::Solver(e.to_string())),
    }
}

/// The MILP's variables, `L` layers and `S` stages.
struct MilpVars {
    /// The bottleneck, seconds (the objective).
    t: Variable,
    /// `u[l][s]` for `s < S - 1`, binary: layer l is in a stage `<= s` (`u[l][S-1] = 1`).
    u: Vec<Vec<Variable>>,
    /// `r[s][mi]`, binary: stage s recomputes with mode `modes[mi]` (empty for one mode).
    r: Vec<Vec<Variable>>,
    /// `z[l][s][mi]` in [0, 1]: `x[l][s] AND r[s][mi]` (empty for one mode).
    z: Vec<Vec<Vec<Variable>>>,
    /// Whether only one recomputation mode is allowed (then `r` and `z` are not needed).
    single_mode: bool,
    l_count: usize,
    s_count: usize,
}

impl MilpVars {
    /// Adds the variables of `problem` to `vars`, in the order t, u, r, z.
    fn new(vars: &mut ProblemVariables, problem: &PartitionProblem) -> Self {
        let (l_count, s_count) = (problem.layers.len(), problem.s_count());
        let modes = &problem.modes;
        let t = vars.add(variable().min(0.0));
        let u: Vec<Vec<Variable>> = (0..l_count)
            .map(|_| {
                (0..s_count - 1)
                    .map(|_| vars.add(variable().binary()))
                    .collect()
            })
            .collect();
        let single_mode = modes.len() == 1;
        let r: Vec<Vec<Variable>> = if single_mode {
            Vec::new()
        } else {
            (0..s_count)
                .map(|_| {
                    modes
                        .iter()
                        .map(|_| vars.add(variable().binary()))
                        .collect()
                })
                .collect()
        };
        let z: Vec<Vec<Vec<Variable>>> = if single_mode {
            Vec::new()
        } else {
            (0..l_count)
                .map(|_| {
                    (0..s_count)
                        .map(|_| {
                            modes
                                .iter()
                                .map(|_| vars.add(variable().min(0.0).max(1.0)))
                                .collect()
                        })
                        .collect()
                })
                .collect()
        };
        MilpVars {
            t,
            u,
            r,
            z,
            single_mode,
            l_count,
            s_count,
        }
    }

    /// `u[l][s]`, with `u[l][-1] = 0` and `u[l][S-1] = 1`.
    fn u_expr(&self, l: usize, s: isize) -> Expression {
        if s < 0 {
            Expression::from(0.0)
        } else if s as usize == self.s_count - 1 {
            Expression::from(1.0)
        } else {
            self.u[l][s as usize].into()
        }
    }

    /// Membership of layer l in stage s: `x[l][s] = u[l][s] - u[l][s-1]`.
    fn x(&self, l: usize, s: usize) -> Expression {
        self.u_expr(l, s as isize) - self.u_expr(l, s as isize - 1)
    }

    /// Membership of layer l in stage s with mode index mi: `z[l][s][mi]`, or `x[l][s]` with
    /// one mode.
    fn member(&self, l: usize, s: usize, mi: usize) -> Expression {
        if self.single_mode {
            self.x(l, s)
        } else {
            self.z[l][s][mi].into()
        }
    }
}

/// The cumulative order: `u[l][s] <= u[l][s+1]` (a layer in a stage `<= s` is in one
/// `<= s+1`) and contiguity `u[l+1][s] <= u[l][s]`.
fn order_constraints(v: &MilpVars) -> Vec<Constraint> {
    let (u, l_count, s_count) = (&v.u, v.l_count, v.s_count);
    let mut out = Vec::new();
    for l in 0..l_count {
        for s in 0..s_count.saturating_sub(1) {
            if s + 1 < s_count - 1 {
                out.push(constraint!(u[l][s] <= u[l][s + 1]));
            }
            if l + 1 < l_count {
                out.push(constraint!(u[l + 1][s] <= u[l][s]));
            }
        }
    }
    out
}

/// Per stage: at least one layer; with several modes exactly one mode and the linearization
/// of `z = x AND r`; its time (F + I + W of its layers under its mode, seconds) at most `t`.
fn stage_constraints(problem: &PartitionProblem, v: &MilpVars) -> Vec<Constraint> {
    let modes = &problem.modes;
    let mut out = Vec::new();
    for s in 0..v.s_count {
        let size: Expression = (0..v.l_count).map(|l| v.x(l, s)).sum();
        out.push(constraint!(size >= 1.0));
        if !v.single_mode {
            let one: Expression = v.r[s].iter().map(|x| Expression::from(*x)).sum();
            out.push(constraint!(one == 1.0));
            for (l, zl) in v.z.iter().enumerate() {
                for (mi, &zv) in zl[s].iter().enumerate() {
                    let rv = v.r[s][mi];
                    out.push(constraint!(zv <= v.x(l, s)));
                    out.push(constraint!(zv <= rv));
                    out.push(constraint!(zv >= v.x(l, s) + rv - 1.0));
                }
            }
        }
        let time: Expression = (0..v.l_count)
            .flat_map(|l| modes.iter().enumerate().map(move |(mi, &m)| (l, mi, m)))
            .map(|(l, mi, m)| problem.layers[l].time_s[mode_index(m)] * v.member(l, s, mi))
            .sum();
        out.push(constraint!(time <= v.t));
    }
    out
}

/// Per rank, under a finite limit: the static bytes of its layers plus each stage's in-flight
/// activations under its mode, at most the limit (bytes).
fn memory_constraints(problem: &PartitionProblem, v: &MilpVars) -> Vec<Constraint> {
    if !problem.memory_limit_bytes.is_finite() {
        return Vec::new();
    }
    let modes = &problem.modes;
    (0..problem.placement.num_ranks)
        .map(|rank| {
            let stages = problem.placement.stages_of(flatpipe_simulator::Rank(rank));
            let mem: Expression = stages
                .iter()
                .flat_map(|s| {
                    (0..v.l_count).flat_map(move |l| {
                        modes
                            .iter()
                            .enumerate()
                            .map(move |(mi, &m)| (s.idx(), l, mi, m))
                    })
                })
                .map(|(s, l, mi, m)| {
                    let layer = &problem.layers[l];
                    let bytes = layer.params as f64 * problem.static_bytes.total()
                        + problem.inflight[s] * layer.act_bytes[mode_index(m)];
                    bytes * v.member(l, s, mi)
                })
                .sum();
            constraint!(mem <= problem.memory_limit_bytes)
        })
        .collect()
}

/// The split of a solution: each stage's layers (`x[l][s] > 0.5`, contiguous from the previous
/// stage's end), its mode, the bottleneck and rank memory recomputed from the problem, and
/// `lb`, the certified lower bound, seconds.
fn read_back(problem: &PartitionProblem, v: &MilpVars, sol: &impl Solution, lb: f64) -> Partition {
    let (l_count, s_count, modes) = (v.l_count, v.s_count, &problem.modes);
    let in_stage = |l: usize, s: usize| {
        let u = |s: isize| {
            if s < 0 {
                0.0
            } else if s as usize == s_count - 1 {
                1.0
            } else {
                sol.value(v.u[l][s as usize])
            }
        };
        u(s as isize) - u(s as isize - 1) > 0.5
    };
    let mut stages = Vec::with_capacity(s_count);
    let mut start = 0;
    for s in 0..s_count {
        let mut end = start;
        while end < l_count && in_stage(end, s) {
            end += 1;
        }
        stages.push(start..end);
        start = end;
    }
    let recompute: Vec<Recompute> = (0..s_count)
        .map(|s| {
            if v.single_mode {
                modes[0]
            } else {
                modes[(0..modes.len())
                    .find(|&mi| sol.value(v.r[s][mi]) > 0.5)
                    .unwrap_or(0)]
            }
        })
        .collect();
    let bottleneck = stages
        .iter()
        .zip(&recompute)
        .map(|(r, &m)| problem.time(r.clone(), m))
        .fold(0.0, f64::max);
    let rank_memory_bytes = problem.rank_memory(&stages, &recompute);
    let optimal = matches!(sol.status(), good_lp::solvers::SolutionStatus::Optimal);
    Partition {
        stages,
        recompute,
        bottleneck_s: bottleneck,
        rank_memory_bytes,
        solver: if optimal { "milp" } else { "milp (time limit)" },
        lower_bound_s: lb,
        optimal,
    }
}
