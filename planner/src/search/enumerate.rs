//! Step 1, enumerate layouts: check the space, sample the steps, and list every candidate
//! layout (tp x dp x pp, token budget and chunk size, schedule, v, sharding) with the sampled
//! steps' statistics under its cut; the layouts that cannot run are rejected with the reason.

use super::stats::{BatchStats, batch_stats, cut_config};
use super::{SearchConfig, SearchSpace, tensor_parallel_degrees};
use crate::{Error, Result};
use flatpipe_profiles::context_parallel::ContextParallel;
use flatpipe_profiles::{Profile, Workload};
use flatpipe_simulator::ScheduleKind;
use flatpipe_simulator::costs::sharding::{DpGroup, Sharding};
use flatpipe_simulator::run::config::CutKey;

/// One candidate layout awaiting evaluation.
#[derive(Clone)]
pub(super) struct Pending {
    /// Index into the tensor-parallel profiles ([`Layouts::profiles`]).
    pub tpi: usize,
    /// How the replicas shard weights, gradients and optimizer state.
    pub sharding: Sharding,
    /// Data-parallel replicas.
    pub dp: u32,
    /// Pipeline ranks per replica.
    pub pp: u32,
    /// Stages per rank.
    pub v: u32,
    /// Schedule.
    pub kind: ScheduleKind,
    /// Token budget per microbatch.
    pub budget: u64,
    /// Long sequences cut into chunks of at most this many tokens (`None`: whole).
    pub chunk: Option<u64>,
    /// Index into the statistics of the sampled steps under its cut ([`Layouts::stats`]).
    pub stats: usize,
    /// Lower bound on the mean step time, seconds (0 until bounded, [`super::bound`]).
    pub lower_bound_s: f64,
    /// Context parallelism: every rank a group of GPUs (`None`: one).
    pub cp: Option<ContextParallel>,
}

impl Pending {
    /// `kind tp=.. ep=.. dp=.. pp=.. v=.. budget=..[ chunk=..] sharding` (`tp=..` and `ep=..`
    /// only above 1): the name a rejection is reported under.
    pub fn describe(&self, tp: u32, ep: u32) -> String {
        format!(
            "{} {}{}dp={} pp={} v={} budget={}{} {}",
            self.kind,
            prefix(tp, ep),
            cp_prefix(self.cp),
            self.dp,
            self.pp,
            self.v,
            self.budget,
            self.chunk.map_or(String::new(), |n| format!(" chunk={n}")),
            self.sharding
        )
    }

    /// Whether it waits for the finalists: zb-auto (its schedule is built per step by list
    /// scheduling) and cut long sequences (a refinement of a layout) run only for the layouts
    /// of the candidates ranked once the others are evaluated.
    pub fn deferred(&self) -> bool {
        self.kind == ScheduleKind::ZbAuto || self.chunk.is_some()
    }

    /// GPUs of its context-parallel group (1 without one).
    pub fn cp_gpus(&self) -> u32 {
        self.cp.map_or(1, |c| c.cp.max(1))
    }
}

/// `cp=N[ comm][ dynamic=T] ` for a group, else nothing.
pub(super) fn cp_prefix(cp: Option<ContextParallel>) -> String {
    match cp {
        Some(c) => format!(
            "cp={} {} {}{}",
            c.cp,
            c.comm,
            c.balance,
            c.max_seqlen_per_rank
                .map_or(" ".to_string(), |t| format!(" dynamic={t} "))
        ),
        None => String::new(),
    }
}

/// What the enumeration found.
pub(super) struct Layouts {
    /// (tp, one GPU's profile of that tensor-parallel degree and of an expert-parallel degree,
    /// its `expert_parallel`), the degrees that apply.
    pub profiles: Vec<(u32, Profile)>,
    /// Statistics of the sampled steps, one per distinct cut of a (tp, pp).
    pub stats: Vec<BatchStats>,
    /// The candidates, in enumeration order.
    pub pending: Vec<Pending>,
    /// Layouts rejected before evaluation, with the reason.
    pub rejected: Vec<(String, String)>,
}

/// Checks the space and the configuration; the tensor-parallel degrees to search.
///
/// # Errors
/// [`Error::InvalidArgument`] for no ranks, no plan to keep, tp = 0, a pp that does not divide
/// the ranks or no steps; [`Error::Simulator`] for more GPUs than the hardware has.
pub(super) fn checked_tps(
    base: &Profile,
    space: &SearchSpace,
    config: &SearchConfig,
) -> Result<Vec<u32>> {
    if space.ranks == 0 {
        return Err(Error::invalid("ranks", 0, ">= 1"));
    }
    if config.keep == 0 {
        return Err(Error::invalid("keep", 0, ">= 1 plan"));
    }
    base.hardware
        .check_gpus(u64::from(space.ranks))
        .map_err(|e| Error::Simulator(e.into()))?;
    let tps = if space.tp.is_empty() {
        tensor_parallel_degrees(base)
    } else {
        space.tp.clone()
    };
    if let Some(t) = tps.iter().find(|t| **t == 0) {
        return Err(Error::invalid("tp", t, ">= 1 GPU per rank"));
    }
    if let Some(p) = space.pp.iter().find(|p| **p == 0 || space.ranks % **p != 0) {
        return Err(Error::invalid(
            "pp",
            p,
            format!("a divisor of ranks ({})", space.ranks),
        ));
    }
    if config.steps == 0 {
        return Err(Error::invalid("steps", 0, ">= 1"));
    }
    Ok(tps)
}

/// Every candidate layout of `space` on `config.steps` steps sampled from `workload`, for
/// the tensor-parallel degrees `tps` ([`checked_tps`]).
///
/// # Errors
/// The cut's ([`batch_stats`]) and a schedule kind's stages per rank.
pub(super) fn layouts(
    base: &Profile,
    workload: &Workload,
    space: &SearchSpace,
    config: &SearchConfig,
    tps: Vec<u32>,
) -> Result<Layouts> {
    let steps: Vec<Vec<u32>> = (0..config.steps)
        .map(|i| workload.sample_step(config.seed, i as u64, config.size))
        .collect();
    let mut rejected = Vec::new();
    let profiles = tp_profiles(base, space, tps, &mut rejected);
    let mut out = Layouts {
        profiles: Vec::new(),
        stats: Vec::new(),
        pending: Vec::new(),
        rejected,
    };
    let fewest_seqs = steps.iter().map(Vec::len).min().unwrap_or(0);
    let cps = if space.context_parallel.is_empty() {
        vec![None]
    } else {
        space.context_parallel.clone()
    };
    for (tpi, (tp, profile)) in profiles.iter().enumerate() {
        for &cp in &cps {
            let gpus = tp * cp.map_or(1, |c| c.cp.max(1));
            let ep = profile.expert_parallel;
            let what =
                |dp: u32, pp: u32| format!("{}{}dp={dp} pp={pp}", prefix(*tp, ep), cp_prefix(cp));
            if space.ranks % gpus != 0 || (cp.is_some() && !space.policy.is_flat()) {
                out.rejected.push((
                    format!("{}{}", prefix(*tp, ep), cp_prefix(cp)).trim_end().to_string(),
                    if space.ranks % gpus != 0 {
                        format!("{gpus} GPUs per rank (tp x cp) do not divide the {} GPUs", space.ranks)
                    } else {
                        format!("context parallelism splits flat microbatches by their cu_seqlens, not the {} policy's", space.policy)
                    },
                ));
                continue;
            }
            let ranks = space.ranks / gpus;
            for &pp in space.pp.iter().filter(|&&pp| ranks % pp == 0) {
                let dp = ranks / pp;
                if dp % ep != 0 {
                    out.rejected.push((
                        what(dp, pp),
                        format!("ep = {ep} does not divide dp = {dp} (the expert-parallel group is made of data-parallel replicas)"),
                    ));
                    continue;
                }
                if fewest_seqs < dp as usize {
                    out.rejected.push((
                        what(dp, pp),
                        format!(
                            "{dp} replicas, but a sampled step has only {fewest_seqs} sequence(s): a replica would get none (a larger step: more sequences or tokens per step)"
                        ),
                    ));
                    continue;
                }
                let layout = PipelineLayout {
                    tpi,
                    tp: *tp,
                    cp,
                    profile,
                    pp,
                    dp,
                    n_layers: base.layers.len(),
                    fo: config.forward_only.map(|f| f.microbatches),
                };
                layout.candidates(space, &steps, &mut out)?;
            }
        }
    }
    out.profiles = profiles;
    Ok(out)
}

/// The profile of one GPU for every tensor-parallel degree in `tps` and every expert-parallel
/// degree of the space ([`super::expert_parallel_degrees`] by default); a degree that does not
/// divide the GPUs, the model's heads or its experts is rejected into `rejected`.
fn tp_profiles(
    base: &Profile,
    space: &SearchSpace,
    tps: Vec<u32>,
    rejected: &mut Vec<(String, String)>,
) -> Vec<(u32, Profile)> {
    let eps = if space.ep.is_empty() {
        super::expert_parallel_degrees(base)
    } else {
        space.ep.clone()
    };
    let mut profiles = Vec::new();
    for tp in tps {
        if space.ranks % tp != 0 {
            rejected.push((
                format!("tp={tp}"),
                format!("{tp} GPUs per rank do not divide the {} GPUs", space.ranks),
            ));
            continue;
        }
        let split = match base.tensor_parallel(tp, space.sequence_parallel) {
            Ok(p) => p,
            Err(e) => {
                rejected.push((format!("tp={tp}"), e.to_string()));
                continue;
            }
        };
        for &ep in &eps {
            match split.expert_parallel(ep, tp, space.sequence_parallel && tp > 1) {
                Ok(p) => profiles.push((tp, p)),
                Err(e) => rejected.push((prefix(tp, ep).trim_end().to_string(), e.to_string())),
            }
        }
    }
    profiles
}

/// `tp=.. ep=.. ` (each above 1), else nothing.
fn prefix(tp: u32, ep: u32) -> String {
    let mut out = String::new();
    if tp > 1 {
        out.push_str(&format!("tp={tp} "));
    }
    if ep > 1 {
        out.push_str(&format!("ep={ep} "));
    }
    out
}

/// One (tp, pp) of the enumeration: `dp` replicas of `pp` ranks of `tp` GPUs each.
struct PipelineLayout<'a> {
    tpi: usize,
    tp: u32,
    /// The context-parallel group of every rank (`None`: one GPU).
    cp: Option<ContextParallel>,
    profile: &'a Profile,
    pp: u32,
    dp: u32,
    /// Layers of the model (a stage holds at least one).
    n_layers: usize,
    /// Forward-only work per replica and step: `Some(Some(k))` k microbatches (the training
    /// ones cycled), `Some(None)` one per training microbatch, `None` none.
    fo: Option<Option<u32>>,
}

impl PipelineLayout<'_> {
    /// Appends to `out` this pipeline's candidates: every (token budget, chunk size) x
    /// schedule x v x sharding mode, each with the statistics of its cut of `steps`; too many
    /// stages for the layers is rejected.
    ///
    /// # Errors
    /// The cut's ([`batch_stats`]) and a schedule kind's stages per rank.
    fn candidates(&self, space: &SearchSpace, steps: &[Vec<u32>], out: &mut Layouts) -> Result<()> {
        let (tp, pp, dp) = (self.tp, self.pp, self.dp);
        // A cp group's GPUs shard the state with the replicas (dp x cp of them).
        let cp_gpus = self.cp.map_or(1, |c| c.cp.max(1));
        let shardings = shardings_for(self.profile, space, pp, dp * cp_gpus);
        let longest = steps.iter().flatten().copied().max().unwrap_or(0) as u64;
        // A cp group is the other answer to long sequences: no chunks with it.
        let chunk_pp = if self.cp.is_some() { 1 } else { pp };
        for (budget, chunk) in budget_options(space, chunk_pp, longest) {
            // The cut every kind at v = 1 shares (and, but for verl-kk's divisor, every v).
            let mut cuts: Vec<(CutKey, usize)> = Vec::new();
            let mut stats_of = |kind: ScheduleKind, v: u32, out: &mut Layouts| -> Result<usize> {
                let cut = cut_config((kind, dp, pp, v), space.policy, (budget, chunk));
                if let Some(&(_, i)) = cuts.iter().find(|(k, _)| *k == cut.cut_key()) {
                    return Ok(i);
                }
                out.stats
                    .push(batch_stats(self.profile, steps, &cut, self.fo)?);
                cuts.push((cut.cut_key(), out.stats.len() - 1));
                Ok(out.stats.len() - 1)
            };
            stats_of(ScheduleKind::OneFOneB, 1, out)?;
            for (kind, vs) in schedule_shapes(space, pp, self.profile.expert_parallel)? {
                for v in vs {
                    let s_count = (pp * v) as usize;
                    if s_count > self.n_layers {
                        let what = format!(
                            "{kind} {}{}dp={dp} pp={pp} v={v} budget={budget}",
                            prefix(tp, self.profile.expert_parallel),
                            cp_prefix(self.cp)
                        );
                        out.rejected.push((
                            what,
                            format!("{s_count} stages for {} layers", self.n_layers),
                        ));
                        continue;
                    }
                    let stats = stats_of(kind, v, out)?;
                    for &sharding in &shardings {
                        out.pending.push(Pending {
                            tpi: self.tpi,
                            sharding,
                            dp,
                            pp,
                            v,
                            kind,
                            budget,
                            chunk,
                            stats,
                            lower_bound_s: 0.0,
                            cp: self.cp,
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

/// (token budget, chunk size) of every budget searched: long sequences whole (a microbatch
/// each), or, where `space.chunk` and a sampled sequence (`longest` tokens) exceeds the
/// budget, in chunks of the budget or half (with a pipeline to fill: pp = 1 runs the chunks one
/// after the other).
fn budget_options(space: &SearchSpace, pp: u32, longest: u64) -> Vec<(u64, Option<u64>)> {
    space
        .token_budgets
        .iter()
        .flat_map(|&budget| {
            let chunks = if space.chunk && pp > 1 && longest > budget {
                vec![None, Some(budget), Some(budget / 2)]
            } else {
                vec![None]
            };
            chunks
                .into_iter()
                .filter(|c| *c != Some(0))
                .map(move |c| (budget, c))
        })
        .collect()
}

/// (schedule, its stages per rank to try) on `pp` ranks. pp = 1 is no pipeline: one rank runs
/// F then B of each microbatch in turn (gradient accumulation), whatever the schedule; one
/// candidate, as 1F1B on one stage. Interleaved kinds take the space's v >= 2, the others
/// their own. Combined 1F1B only with expert parallelism (`ep > 1`): without all-to-alls to
/// hide it is interleaved 1F1B with one more microbatch in flight.
///
/// # Errors
/// A kind's [`ScheduleKind::stages_per_rank`].
fn schedule_shapes(space: &SearchSpace, pp: u32, ep: u32) -> Result<Vec<(ScheduleKind, Vec<u32>)>> {
    let kinds: Vec<ScheduleKind> = if pp == 1 {
        vec![ScheduleKind::OneFOneB]
    } else {
        space
            .kinds
            .iter()
            .copied()
            .filter(|&k| k != ScheduleKind::Combined1F1B || ep > 1)
            .collect()
    };
    kinds
        .into_iter()
        .map(|kind| {
            let vs: Vec<u32> = match kind {
                _ if pp == 1 => vec![1],
                ScheduleKind::Interleaved1F1B
                | ScheduleKind::LoopedBfs
                | ScheduleKind::Combined1F1B => {
                    space.vpp.iter().copied().filter(|v| *v >= 2).collect()
                }
                _ => vec![kind.stages_per_rank(None)?],
            };
            Ok((kind, vs))
        })
        .collect()
}

/// The sharding modes to search for `pp` x `dp`: the space's, without `hsdp` where it is `fsdp`
/// (every data-parallel group in one node) and `fsdp` is searched, and only `ddp` for dp = 1
/// (nothing to shard).
pub(super) fn shardings_for(
    profile: &Profile,
    space: &SearchSpace,
    pp: u32,
    dp: u32,
) -> Vec<Sharding> {
    if dp <= 1 {
        return vec![Sharding::Ddp];
    }
    space
        .sharding
        .iter()
        .copied()
        .filter(|&m| {
            m != Sharding::Hsdp
                || !space.sharding.contains(&Sharding::Fsdp)
                || (0..pp).any(|r| {
                    DpGroup::of(Sharding::Hsdp, &profile.hardware, pp, dp, r).replicate > 1
                })
        })
        .collect()
}
