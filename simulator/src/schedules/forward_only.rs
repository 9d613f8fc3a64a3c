//! Forward-only work inside a training step (design point 4 in docs/design.md): a frozen reference
//! model's forward for the KL term of RL, a teacher's forward in on-policy distillation. Each
//! forward-only microbatch `k` runs `Fo` on every stage in turn (its own microbatch ids), keeps no
//! activations beyond the transfer and has no backward.
//!
//! - [`FoMode::Separate`] (the baseline): every rank first runs its `Fo` actions (stage by stage,
//!   all K microbatches), then the training schedule.
//! - [`FoMode::Fused`]: the training schedule is replayed alone, and each `Fo(s, k)` (in order of
//!   k, then s) goes into the first idle gap of its rank that it fits whole, after its input has
//!   arrived; what fits nowhere runs after the rank's training actions. Training actions keep
//!   their order. When the separate pass is faster (a schedule with few bubbles, such as ZB-H1,
//!   overlaps a leading pass with its pipeline fill), fused keeps that order instead, so fused is
//!   never worse than separate. Works for any schedule: 1F1B, interleaved 1F1B, ZB-H1, zb-auto.
//!
//! With `loss_dependency`, training microbatch i's loss needs forward-only microbatch i's last
//! stage (`Fo(last, i)` before `F(last, i)` on the last stage's rank; the fused schedule puts
//! every `Fo(s, i)` before `F(s, i)`, which keeps it deadlock-free): PPO / GRPO with a KL
//! penalty against a reference model computed in the same step, DPO's reference log-probs,
//! on-policy distillation's teacher logits. Without it the forward-only work is independent:
//! reference log-probs or rewards computed for the next step, or scores only logged.
//!
//! `fo_hidden_fraction = (T_train + T_fo_separate - T_combined) / T_fo_separate`: the share of
//! the forward-only pass's time that disappears into the training schedule's bubbles.

use crate::costs::CostModel;
use crate::ir::{Action, ActionKind, ComputeAction, Rank, Schedule};
use crate::{Error, Result, replay};
use serde::{Deserialize, Serialize};

/// How forward-only work joins the training schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FoMode {
    /// A separate forward-only pass before training.
    Separate,
    /// Forward-only actions in the training schedule's bubbles.
    #[default]
    Fused,
}

impl FoMode {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            FoMode::Separate => "separate",
            FoMode::Fused => "fused",
        }
    }
}

impl std::fmt::Display for FoMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FoMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "fused" => Ok(FoMode::Fused),
            "separate" => Ok(FoMode::Separate),
            other => Err(Error::invalid(
                "forward_only.mode",
                other,
                "fused or separate",
            )),
        }
    }
}

/// The forward-only pass alone: every rank runs `Fo` of its stages in ascending order, each over
/// all `k` microbatches.
pub fn forward_only_pass(train: &Schedule, k: u32) -> Schedule {
    let p = train.placement.num_ranks;
    let ranks = (0..p)
        .map(|r| {
            let stages = train.placement.stages_of(Rank(r));
            stages
                .iter()
                .flat_map(|s| (0..k).map(move |mb| Action::new(s.0, ActionKind::Fo, mb)))
                .collect()
        })
        .collect();
    Schedule {
        name: format!("{}-forward-only", train.name),
        placement: train.placement.clone(),
        num_microbatches: 0,
        num_fo_microbatches: k,
        chunks: Vec::new(),
        ranks,
    }
}

/// `train` with `k` forward-only microbatches added per `mode` (see the module doc), replayed
/// under `costs` (which must know the `k` forward-only microbatches).
///
/// # Errors
/// [`Error::InvalidArgument`] when `train` already has forward-only work, or `loss_dependency`
/// asks for more training microbatches than there are forward-only ones; replay errors.
pub fn with_forward_only<C: CostModel>(
    train: &Schedule,
    k: u32,
    mode: FoMode,
    loss_dependency: bool,
    costs: &C,
) -> Result<Schedule> {
    if train.num_fo_microbatches != 0 {
        return Err(Error::invalid(
            "schedule",
            &train.name,
            "a training schedule without forward-only actions",
        ));
    }
    if loss_dependency && k < train.num_microbatches {
        return Err(Error::invalid(
            "forward_only.microbatches",
            k,
            format!(
                ">= the {} training microbatches when their loss needs the forward-only results",
                train.num_microbatches
            ),
        ));
    }
    if k == 0 {
        return Ok(train.clone());
    }
    let last = train.num_stages() - 1;
    let pass = forward_only_pass(train, k);
    let mut out = match mode {
        FoMode::Separate => {
            let ranks = pass
                .ranks
                .iter()
                .zip(&train.ranks)
                .map(|(fo, t)| fo.iter().chain(t).copied().collect())
                .collect();
            Schedule {
                ranks,
                ..train.clone()
            }
        }
        FoMode::Fused => {
            let timeline = replay::replay(train, costs)?;
            let p = train.placement.num_ranks as usize;
            // Busy intervals per rank: training ops, then placed Fo actions.
            let mut busy: Vec<Vec<(u64, u64)>> = timeline
                .compute
                .iter()
                .map(|ops| ops.iter().map(|o| (o.start_ns, o.end_ns)).collect())
                .collect();
            // Where each training F(s, i) starts. With the loss dependency, Fo(s, i) must run
            // before F(s, i) on every stage: then the Fo chain of microbatch i moves along its F
            // chain and no rank can wait on a forward-only result that waits on it.
            let m = train.num_microbatches as usize;
            let mut f_start = vec![u64::MAX; (last as usize + 1) * m];
            for ops in &timeline.compute {
                for o in ops {
                    for a in o.action.parts() {
                        if a.kind == ActionKind::F {
                            f_start[a.stage.idx() * m + a.microbatch.idx()] = o.start_ns;
                        }
                    }
                }
            }
            // (rank, sort key, action): sort key = placed start; forced ones just before F.
            let mut placed: Vec<(usize, u64, u32, ComputeAction)> = Vec::new();
            let mut ready = vec![0u64; k as usize];
            for mb in 0..k {
                for s in 0..=last {
                    let a = ComputeAction::new(s, ActionKind::Fo, mb);
                    let r = train.placement.rank_of[s as usize].idx();
                    let dur = costs.compute_ns(a);
                    let deadline = if loss_dependency && (mb as usize) < m {
                        f_start[s as usize * m + mb as usize]
                    } else {
                        u64::MAX
                    };
                    let at = ready[mb as usize];
                    let slot = first_gap(&busy[r], at, dur).filter(|&st| st + dur <= deadline);
                    let (start, tiebreak) = match slot {
                        Some(st) => {
                            insert_busy(&mut busy[r], st, st + dur);
                            (st, 1)
                        }
                        // No gap before its deadline: run just before that stage's F.
                        None if deadline != u64::MAX => (deadline, 0),
                        // No gap: after the rank's training work.
                        None => {
                            let end = busy[r].last().map_or(0, |b| b.1).max(at);
                            insert_busy(&mut busy[r], end, end + dur);
                            (end, 1)
                        }
                    };
                    placed.push((r, start, tiebreak, a));
                    let next_rank = if s < last {
                        train.placement.rank_of[s as usize + 1].idx()
                    } else {
                        r
                    };
                    let comm = if next_rank != r && s < last {
                        costs.comm_ns(a.stage, a.microbatch, ActionKind::Fo)
                    } else {
                        0
                    };
                    ready[mb as usize] = start + dur + comm;
                }
            }
            let mut ranks: Vec<Vec<(u64, u32, Action)>> = timeline
                .compute
                .iter()
                .map(|ops| ops.iter().map(|o| (o.start_ns, 2, o.action)).collect())
                .collect();
            for (r, start, tiebreak, a) in placed {
                ranks[r].push((start, tiebreak, Action::Compute(a)));
            }
            debug_assert_eq!(ranks.len(), p);
            Schedule {
                ranks: ranks
                    .into_iter()
                    .map(|mut v| {
                        // Stable: training ops keep their order among equal starts.
                        v.sort_by_key(|x| (x.0, x.1));
                        v.into_iter().map(|x| x.2).collect()
                    })
                    .collect(),
                ..train.clone()
            }
        }
    };
    out.num_fo_microbatches = k;
    out.name = format!("{}+fo-{mode}", train.name);
    out.validate()?;
    if mode == FoMode::Fused {
        // Where the training schedule has few bubbles (ZB-H1), running the forward-only pass
        // first overlaps it with the pipeline's fill better than appending what found no gap:
        // fused keeps whichever is faster, so it is never worse than separate.
        let sep = with_forward_only(train, k, FoMode::Separate, loss_dependency, costs)?;
        if replay::replay(&sep, costs)?.makespan_ns() < replay::replay(&out, costs)?.makespan_ns() {
            out.ranks = sep.ranks;
        }
    }
    if loss_dependency {
        check_loss_dependency(&out)?;
    }
    Ok(out)
}

/// The earliest start `>= at` of an interval of `dur` that overlaps no busy interval (sorted).
fn first_gap(busy: &[(u64, u64)], at: u64, dur: u64) -> Option<u64> {
    let mut t = at;
    for &(a, b) in busy {
        if t + dur <= a {
            return Some(t);
        }
        t = t.max(b);
    }
    // After the last busy interval: only a "gap" if the rank has no more work, which the caller
    // treats separately (appending keeps the order simple).
    None
}

fn insert_busy(busy: &mut Vec<(u64, u64)>, a: u64, b: u64) {
    let i = busy.partition_point(|x| x.0 <= a);
    busy.insert(i, (a, b));
}

/// Checks that on the last stage's rank, `Fo(last, i)` precedes `F(last, i)` for every training
/// microbatch i.
///
/// # Errors
/// [`Error::InvalidSchedule`] naming the first microbatch whose loss would run before its
/// forward-only result.
pub fn check_loss_dependency(s: &Schedule) -> Result<()> {
    let last = s.num_stages() - 1;
    let r = s.placement.rank_of[last as usize].idx();
    let mut fo_done = vec![false; s.num_fo_microbatches as usize];
    for a in s.ranks[r].iter().flat_map(|a| a.parts()) {
        if a.stage.0 != last {
            continue;
        }
        match a.kind {
            ActionKind::Fo => fo_done[a.microbatch.idx()] = true,
            ActionKind::F if !fo_done.get(a.microbatch.idx()).copied().unwrap_or(false) => {
                return Err(Error::InvalidSchedule {
                    schedule: s.name.clone(),
                    reason: format!(
                        "{a} computes microbatch {}'s loss before {last}Fo{} has run",
                        a.microbatch, a.microbatch
                    ),
                });
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScheduleKind;
    use crate::costs::{UniformCostSpec, UniformCosts};

    fn costs(fo: f64) -> UniformCosts {
        UniformCosts::new(
            &UniformCostSpec {
                f: 1.0,
                b: 1.0,
                w: 1.0,
                comm: 0.0,
                fb: None,
                fo: Some(fo),
                fsdp: Default::default(),
            },
            1,
        )
    }

    fn span(s: &Schedule, c: &UniformCosts) -> f64 {
        replay::replay(s, c).unwrap().makespan_ns() as f64 / 1e9
    }

    #[test]
    fn separate_pass_costs_its_own_pipeline() {
        // The Fo pass alone on p ranks, K microbatches, fo each: (K + p - 1) fo.
        let c = costs(0.5);
        let train = ScheduleKind::OneFOneB.generate(4, 1, 8).unwrap();
        let pass = forward_only_pass(&train, 6);
        assert!((span(&pass, &c) - (6.0 + 3.0) * 0.5).abs() < 1e-9);
        let sep = with_forward_only(&train, 6, FoMode::Separate, false, &c).unwrap();
        assert_eq!(sep.num_fo_microbatches, 6);
        // The separate pass ends on rank 0 after 6 fo; its training starts then.
        assert!(span(&sep, &c) >= span(&train, &c) + 6.0 * 0.5 - 1e-9);
    }

    #[test]
    fn fused_work_hides_in_1f1b_bubbles() {
        // 1F1B p = 4, m = 8, f = b = w = 1: rank 0 idles 3 (p - 1) x (f + b + w) / ... in its
        // warm-up and cool-down; Fo of 0.5 fits there.
        let c = costs(0.5);
        let train = ScheduleKind::OneFOneB.generate(4, 1, 8).unwrap();
        let t_train = span(&train, &c);
        let pass = forward_only_pass(&train, 2);
        let t_fo = span(&pass, &c);
        let fused = with_forward_only(&train, 2, FoMode::Fused, false, &c).unwrap();
        let t = span(&fused, &c);
        let hidden = (t_train + t_fo - t) / t_fo;
        assert!(t >= t_train - 1e-9, "training order is kept");
        assert!(hidden > 0.5, "hidden fraction {hidden}");
        // Never worse than the separate pass, on any schedule.
        for kind in [
            ScheduleKind::ZbH1,
            ScheduleKind::Interleaved1F1B,
            ScheduleKind::ZbAuto,
        ] {
            let v = kind.stages_per_rank(None).unwrap();
            let tr = kind.generate(4, v, 8).unwrap();
            let f = with_forward_only(&tr, 8, FoMode::Fused, false, &c).unwrap();
            let s = with_forward_only(&tr, 8, FoMode::Separate, false, &c).unwrap();
            assert!(span(&f, &c) <= span(&s, &c), "{}", kind.name());
        }
        // Each Fo ran once per stage.
        let fo_count: usize = fused
            .ranks
            .iter()
            .flatten()
            .flat_map(|a| a.parts())
            .filter(|a| a.kind == ActionKind::Fo)
            .count();
        assert_eq!(fo_count, 2 * 4);
    }

    #[test]
    fn loss_dependency_orders_fo_before_the_loss() {
        let c = costs(0.5);
        for kind in [
            ScheduleKind::OneFOneB,
            ScheduleKind::ZbH1,
            ScheduleKind::Interleaved1F1B,
        ] {
            let v = kind.stages_per_rank(None).unwrap();
            let train = kind.generate(3, v, 6).unwrap();
            for mode in [FoMode::Separate, FoMode::Fused] {
                let s = with_forward_only(&train, 6, mode, true, &c).unwrap();
                check_loss_dependency(&s).unwrap();
                replay::replay(&s, &c).unwrap();
            }
        }
        let train = ScheduleKind::OneFOneB.generate(3, 1, 6).unwrap();
        let e = with_forward_only(&train, 2, FoMode::Fused, true, &c).unwrap_err();
        assert!(e.to_string().contains("forward_only.microbatches"), "{e}");
    }
}
