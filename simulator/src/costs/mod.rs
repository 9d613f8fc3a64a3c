//! What each action, transfer and activation costs in one simulated step.
//!
//! Two cost models implement [`CostModel`]:
//! - [`UniformCosts`]: the `--costs f=..,b=..,w=..,comm=..` model of the papers' formulas. Costs
//!   are **one rank's share of the model per microbatch** in seconds: with `v` stages per rank
//!   each stage costs `f/v`, `b/v`, `w/v`; `comm` is one transfer between adjacent stages on
//!   different ranks. Memory is counted in units: one unit is one rank's share of one
//!   microbatch's activations, so an F of one of `v` stages adds `1/v`, its I frees half of
//!   that, its W the rest, and a fused B all of it.
//! - [`TableCosts`]: per (stage, microbatch) times from a [`Profile`] and the step's flat
//!   microbatches; transfers over the hardware's links; memory in bytes.
//!
//! Simulated time is integer nanoseconds, so replays are exact and deterministic.

pub mod given;
pub mod sharding;

use crate::batching::microbatch::Microbatch;
use crate::costs::sharding::{MicrobatchCollectives, Sharding, StateBytes, exposed_s, global_rank};
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Placement, Rank, StageId};
use crate::{Error, Result};
use flatpipe_profiles::{Phase, Profile};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::str::FromStr;

/// Seconds to integer nanoseconds (rounded to nearest).
pub fn s_to_ns(s: f64) -> u64 {
    (s * 1e9).round().max(0.0) as u64
}

/// Integer nanoseconds to seconds (a division, so whole multiples of 1e9 stay exact).
pub fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The unit activation memory is reported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryUnit {
    /// Bytes (profile-driven costs).
    Bytes,
    /// One rank's share of one microbatch's activations (uniform costs).
    Units,
}

/// Costs the replay asks for. Implementations are cheap to query: the replay calls them once
/// per op.
pub trait CostModel: Sync {
    /// Duration of one compute action, ns. A fused B costs I + W.
    fn compute_ns(&self, a: ComputeAction) -> u64;
    /// Duration of an overlapped forward + backward pair run together, ns (default: their sum).
    fn overlap_ns(&self, f: ComputeAction, b: ComputeAction) -> u64 {
        self.compute_ns(f) + self.compute_ns(b)
    }
    /// Duration of the transfer that action `kind` of `stage` sends for microbatch `mb`, ns:
    /// after F or Fo the activations go to stage + 1, after I or B the gradient goes to
    /// stage - 1. Only asked when the two stages are on different ranks.
    fn comm_ns(&self, stage: StageId, mb: MicrobatchId, kind: ActionKind) -> u64;
    /// Activation memory one F of `stage` keeps for `mb`: (part freed by I, part freed by W),
    /// in [`CostModel::memory_unit`].
    fn activation(&self, stage: StageId, mb: MicrobatchId) -> (f64, f64);
    /// What a fused B of `stage` holds of its recomputation for `mb` while it runs: it
    /// recomputes layer by layer and frees each layer's wgrad inputs with that layer's weight
    /// gradient, so one layer's at a time (the largest), as PyTorch's autograd backward does
    /// (flatpipe's executor runs a B as the stage's I then its W, and holds them all); by
    /// default all of [`CostModel::recomputed`].
    fn recomputed_in_b(&self, stage: StageId, mb: MicrobatchId) -> f64 {
        self.recomputed(stage, mb)
    }
    /// Memory that I of `stage` recomputes for `mb` and that lives until W ends (the wgrad
    /// inputs of a recomputed layer), in [`CostModel::memory_unit`]. 0 without recomputation.
    fn recomputed(&self, _stage: StageId, _mb: MicrobatchId) -> f64 {
        0.0
    }
    /// Bytes of the output buffer an F of `stage` holds for `mb` until its transfer to the next
    /// stage completes (0 under uniform costs).
    fn output_bytes(&self, _stage: StageId, _mb: MicrobatchId) -> f64 {
        0.0
    }
    /// Memory of `rank` that is constant over the step (parameters, gradients, optimizer
    /// state), bytes (0 under uniform costs).
    fn static_bytes(&self, _rank: Rank) -> f64 {
        0.0
    }
    /// Optimizer-step time of `rank` at the end of the step, ns (0 for none).
    fn optimizer_ns(&self, rank: Rank) -> u64;
    /// The unit of [`CostModel::activation`].
    fn memory_unit(&self) -> MemoryUnit;
}

/// The `--costs` specification: one rank's share per microbatch, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UniformCostSpec {
    /// Forward, seconds.
    pub f: f64,
    /// Backward for inputs (dgrad), seconds.
    pub b: f64,
    /// Backward for weights (wgrad), seconds.
    pub w: f64,
    /// One transfer between adjacent stages on different ranks, seconds.
    pub comm: f64,
    /// An overlapped forward + backward pair (one rank's share), seconds; default `f + b + w`.
    pub fb: Option<f64>,
    /// A forward-only action (one rank's share), seconds; default `f`.
    pub fo: Option<f64>,
}

impl Default for UniformCostSpec {
    fn default() -> Self {
        UniformCostSpec {
            f: 1.0,
            b: 1.0,
            w: 1.0,
            comm: 0.0,
            fb: None,
            fo: None,
        }
    }
}

/// The least non-zero `--costs` value, seconds: 1 ns, the simulator's time unit.
pub const MIN_COST_S: f64 = 1e-9;
/// The largest `--costs` value, seconds (11.6 days per action).
pub const MAX_COST_S: f64 = 1e6;

/// One `--costs` value in seconds, checked: 0 or [`MIN_COST_S`]..=[`MAX_COST_S`].
fn parse_cost_s(key: &str, v: &str) -> Result<f64> {
    let x: f64 = v
        .trim()
        .parse()
        .map_err(|_| Error::invalid(format!("costs {key}"), v, "a number of seconds"))?;
    // Time is integer nanoseconds (u64): a cost must not round to 0 ns unless it is 0, and a
    // step of many such actions must stay far below 2^64 ns (584 years).
    if !(x.is_finite() && (x == 0.0 || (MIN_COST_S..=MAX_COST_S).contains(&x))) {
        return Err(Error::invalid(
            format!("costs {key}"),
            v,
            format!(
                "0 or {MIN_COST_S:e} to {MAX_COST_S} seconds (time is counted in whole ns: 1 ns is the least, and 1000000 s per action keeps a step's makespan in range)"
            ),
        ));
    }
    Ok(x)
}

/// The `key=value` pairs of a `--costs` string, keys trimmed, in order.
///
/// # Errors
/// [`Error::InvalidArgument`] for an item without `=` (naming it and `example`) or a key given
/// twice.
fn cost_pairs<'a>(s: &'a str, example: &str) -> Result<Vec<(&'a str, &'a str)>> {
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| {
            Error::invalid(
                "costs",
                item,
                format!("key=seconds pairs such as {example}"),
            )
        })?;
        let key = k.trim();
        if pairs.iter().any(|(seen, _)| *seen == key) {
            return Err(Error::invalid(
                "costs",
                s,
                format!("each key at most once ({key} is given twice)"),
            ));
        }
        pairs.push((key, v));
    }
    Ok(pairs)
}

/// `--costs` with per-rank values: `f=1/1/2/2,b=2/2/3/3,w=1,comm=0.1` gives each rank's share
/// of the model per microbatch, seconds, one value per rank separated by `/` (a single value
/// applies to every rank); with v stages per rank each of its stages costs its share / v
/// ([`StageCosts::per_rank`]). Heterogeneous pipelines, such as the Zero Bubble repository's
/// 8-stage example, are written this way.
#[derive(Debug, Clone, PartialEq)]
pub struct PerRankCostSpec {
    /// Forward per rank, seconds (one value: every rank).
    pub f: Vec<f64>,
    /// Backward for inputs (dgrad) per rank, seconds.
    pub b: Vec<f64>,
    /// Backward for weights (wgrad) per rank, seconds.
    pub w: Vec<f64>,
    /// One transfer between adjacent stages on different ranks, seconds.
    pub comm: f64,
}

impl PerRankCostSpec {
    /// The number of ranks the lists give, if any list has more than one value.
    pub fn num_ranks(&self) -> Option<usize> {
        [&self.f, &self.b, &self.w]
            .iter()
            .map(|x| x.len())
            .find(|&n| n > 1)
    }

    /// The three lists for `p` ranks (single values repeated).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a list's length is neither 1 nor `p`.
    pub fn for_ranks(&self, p: u32) -> Result<[Vec<f64>; 3]> {
        let mut out: [Vec<f64>; 3] = Default::default();
        for (o, (name, xs)) in out
            .iter_mut()
            .zip([("f", &self.f), ("b", &self.b), ("w", &self.w)])
        {
            *o = match xs.len() {
                1 => vec![xs[0]; p as usize],
                n if n == p as usize => xs.clone(),
                n => {
                    return Err(Error::invalid(
                        format!("costs {name}"),
                        format!("{n} values"),
                        format!("one value per rank (pp = {p}) or a single value"),
                    ));
                }
            };
        }
        Ok(out)
    }
}

impl FromStr for PerRankCostSpec {
    type Err = Error;
    /// Parses `f=1/2/1/1,b=2/3/2/2,w=1,comm=0` (keys f, b, w, comm; missing ones keep
    /// f = b = w = 1, comm = 0; comm takes one value).
    fn from_str(s: &str) -> Result<Self> {
        let mut spec = PerRankCostSpec {
            f: vec![1.0],
            b: vec![1.0],
            w: vec![1.0],
            comm: 0.0,
        };
        for (key, v) in cost_pairs(s, "f=1/2/1/1,b=2,w=1,comm=0")? {
            let list = || {
                v.split('/')
                    .map(|x| parse_cost_s(key, x))
                    .collect::<Result<Vec<f64>>>()
            };
            match key {
                "f" => spec.f = list()?,
                "b" => spec.b = list()?,
                "w" => spec.w = list()?,
                "comm" => spec.comm = parse_cost_s(key, v)?,
                "fb" | "fo" => {
                    return Err(Error::invalid(
                        "costs",
                        key,
                        "f, b, w and comm with per-rank values (fb and fo only with one value per key)",
                    ));
                }
                other => {
                    return Err(Error::invalid("costs", other, "keys are f, b, w, comm"));
                }
            }
        }
        if let Some(n) = spec.num_ranks() {
            for (name, xs) in [("f", &spec.f), ("b", &spec.b), ("w", &spec.w)] {
                if xs.len() != 1 && xs.len() != n {
                    return Err(Error::invalid(
                        format!("costs {name}"),
                        format!("{} values", xs.len()),
                        format!("{n} values (one per rank, as another key gives) or one"),
                    ));
                }
            }
        }
        Ok(spec)
    }
}

impl FromStr for UniformCostSpec {
    type Err = Error;
    /// Parses `f=1,b=1,w=1,comm=0` (any subset, in any order; missing keys keep the defaults
    /// f = b = w = 1, comm = 0).
    fn from_str(s: &str) -> Result<Self> {
        let mut spec = UniformCostSpec::default();
        for (key, v) in cost_pairs(s, "f=1,b=1,w=1,comm=0")? {
            let x = parse_cost_s(key, v)?;
            match key {
                "f" => spec.f = x,
                "b" => spec.b = x,
                "w" => spec.w = x,
                "comm" => spec.comm = x,
                "fb" => spec.fb = Some(x),
                "fo" => spec.fo = Some(x),
                other => {
                    return Err(Error::invalid(
                        "costs",
                        other,
                        "keys are f, b, w, comm, fb, fo",
                    ));
                }
            }
        }
        Ok(spec)
    }
}

/// Uniform costs: every stage of every microbatch costs the same (one rank's share / v).
#[derive(Debug, Clone)]
pub struct UniformCosts {
    f_ns: u64,
    i_ns: u64,
    w_ns: u64,
    fo_ns: u64,
    fb_ns: u64,
    comm_ns: u64,
    unit_per_stage: f64,
}

impl UniformCosts {
    /// Costs for `v` stages per rank.
    pub fn new(spec: &UniformCostSpec, v: u32) -> Self {
        let v = v.max(1) as f64;
        UniformCosts {
            f_ns: s_to_ns(spec.f / v),
            i_ns: s_to_ns(spec.b / v),
            w_ns: s_to_ns(spec.w / v),
            fo_ns: s_to_ns(spec.fo.unwrap_or(spec.f) / v),
            fb_ns: s_to_ns(spec.fb.unwrap_or(spec.f + spec.b + spec.w) / v),
            comm_ns: s_to_ns(spec.comm),
            unit_per_stage: 1.0 / v,
        }
    }
}

impl CostModel for UniformCosts {
    #[inline]
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        match a.kind {
            ActionKind::F => self.f_ns,
            ActionKind::I => self.i_ns,
            ActionKind::W => self.w_ns,
            ActionKind::B => self.i_ns + self.w_ns,
            ActionKind::Fo => self.fo_ns,
        }
    }
    fn overlap_ns(&self, _f: ComputeAction, b: ComputeAction) -> u64 {
        // fb is a pair of F and a full backward; a pair with I alone saves W.
        if b.kind == ActionKind::I {
            self.fb_ns.saturating_sub(self.w_ns)
        } else {
            self.fb_ns
        }
    }
    #[inline]
    fn comm_ns(&self, _: StageId, _: MicrobatchId, _: ActionKind) -> u64 {
        self.comm_ns
    }
    #[inline]
    fn activation(&self, _: StageId, _: MicrobatchId) -> (f64, f64) {
        (self.unit_per_stage / 2.0, self.unit_per_stage / 2.0)
    }
    fn optimizer_ns(&self, _: Rank) -> u64 {
        0
    }
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Units
    }
}

/// Per-stage costs: stage s's F, I (dgrad) and W (wgrad) times, the same for every
/// microbatch, one transfer time between adjacent stages on different ranks; a microbatch's
/// activations on a stage are one unit (half freed by I, half by W), as [`UniformCosts`]. The
/// Zero Bubble repository's own cost model (`GraphConfig` in `auto_schedule.py`: `cost_f`,
/// `cost_b`, `cost_w` per stage, `cost_comm`), for heterogeneous stages on the command line
/// (`--costs f=1/2/3,...`) and the parity tests.
#[derive(Debug, Clone)]
pub struct StageCosts {
    f_ns: Vec<u64>,
    i_ns: Vec<u64>,
    w_ns: Vec<u64>,
    comm_ns: u64,
    /// Activation units one F of a stage keeps (1; 1/v for [`StageCosts::per_rank`]).
    unit_per_stage: f64,
}

impl StageCosts {
    /// Costs of stages `0..f.len()`, seconds.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the three lists differ in length, are empty, or hold a
    /// negative or non-finite time.
    pub fn new(f: &[f64], b: &[f64], w: &[f64], comm: f64) -> Result<Self> {
        if f.is_empty() || f.len() != b.len() || f.len() != w.len() {
            return Err(Error::invalid(
                "per-stage costs",
                format!("f: {}, b: {}, w: {} stages", f.len(), b.len(), w.len()),
                "the same number of stages (>= 1) for f, b and w",
            ));
        }
        for (name, xs) in [("f", f), ("b", b), ("w", w), ("comm", &[comm][..])] {
            if let Some(x) = xs.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(Error::invalid(
                    format!("costs.{name}"),
                    x,
                    "a finite time >= 0 seconds",
                ));
            }
        }
        let ns = |xs: &[f64]| xs.iter().map(|&x| s_to_ns(x)).collect();
        Ok(StageCosts {
            f_ns: ns(f),
            i_ns: ns(b),
            w_ns: ns(w),
            comm_ns: s_to_ns(comm),
            unit_per_stage: 1.0,
        })
    }

    /// Costs from per-rank shares (`f[r]`, `b[r]`, `w[r]`: rank r's share of the model per
    /// microbatch, seconds, as [`UniformCostSpec`]'s): on `placement` with v stages per rank,
    /// each stage of rank r costs its share / v and keeps 1/v unit of activations per
    /// microbatch (a rank's microbatch is one unit, as under [`UniformCosts`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a list's length is not the placement's rank count, or
    /// for a time [`StageCosts::new`] refuses.
    pub fn per_rank(
        f: &[f64],
        b: &[f64],
        w: &[f64],
        comm: f64,
        placement: &crate::ir::Placement,
    ) -> Result<Self> {
        let p = placement.num_ranks as usize;
        for (name, xs) in [("f", f), ("b", b), ("w", w)] {
            if xs.len() != p {
                return Err(Error::invalid(
                    format!("costs {name}"),
                    format!("{} values", xs.len()),
                    format!("one per rank ({p})"),
                ));
            }
        }
        let v = (placement.num_stages() as usize / p.max(1)).max(1) as f64;
        let per_stage = |xs: &[f64]| -> Vec<f64> {
            placement.rank_of.iter().map(|r| xs[r.idx()] / v).collect()
        };
        let mut c = StageCosts::new(&per_stage(f), &per_stage(b), &per_stage(w), comm)?;
        c.unit_per_stage = 1.0 / v;
        Ok(c)
    }

    /// The number of stages.
    pub fn num_stages(&self) -> usize {
        self.f_ns.len()
    }
}

impl CostModel for StageCosts {
    #[inline]
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        let s = a.stage.idx().min(self.f_ns.len() - 1);
        match a.kind {
            ActionKind::F | ActionKind::Fo => self.f_ns[s],
            ActionKind::I => self.i_ns[s],
            ActionKind::W => self.w_ns[s],
            ActionKind::B => self.i_ns[s] + self.w_ns[s],
        }
    }
    #[inline]
    fn comm_ns(&self, _: StageId, _: MicrobatchId, _: ActionKind) -> u64 {
        self.comm_ns
    }
    #[inline]
    fn activation(&self, _: StageId, _: MicrobatchId) -> (f64, f64) {
        (self.unit_per_stage / 2.0, self.unit_per_stage / 2.0)
    }
    fn optimizer_ns(&self, _: Rank) -> u64 {
        0
    }
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Units
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Cell {
    f: u64,
    i: u64,
    w: u64,
    /// A fused backward: `i + w`, or the profile's measured [`LayerProfile::b`].
    b: u64,
    /// Transfer of this stage's output to stage + 1.
    fwd_comm: u64,
    /// Transfer of this stage's input gradient to stage - 1.
    bwd_comm: u64,
    act_i: f64,
    act_w: f64,
    act_iw: f64,
    /// The largest one layer recomputes (a fused B frees each layer's before the next).
    act_iw_layer: f64,
    out_bytes: f64,
}

/// Activation recomputation of a stage: what its forward keeps for the backward, and what the
/// backward recomputes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
/// Transformer Models").
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep everything: the profile's activation bytes, no extra time.
    #[default]
    None,
    /// Megatron-LM's selective recomputation on decoder layers: F keeps the tensors only dgrad
    /// needs (`act_bytes_per_token_i`: the GEMM outputs q, k, v, gate, up and the norms'
    /// statistics) and drops the wgrad inputs (`act_bytes_per_token_w`: the normed inputs, the
    /// attention core's output, the activation), which I recomputes (the attention forward,
    /// `c_attn * attn_pairs`, and elementwise work) and which then live until W. Other layers
    /// keep everything. This is what the executor's selective mode keeps
    /// (`flatpipe_executor::model`).
    Selective,
    /// Keep only each layer's input (the previous layer's output) and rerun the whole forward
    /// in dgrad: I gains the layer's forward time, and the wgrad inputs it recomputes live from
    /// I until W (PyTorch issue #136766: under zero-bubble schedules that is most of a step).
    Full,
}

impl Recompute {
    /// Every mode, cheapest in time first.
    pub const ALL: &'static [Recompute] = &[Recompute::None, Recompute::Selective, Recompute::Full];
}

/// What recomputation does to one layer of one microbatch: the time it adds to I and the bytes
/// it keeps, by lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RecomputeEffect {
    /// Seconds I gains (the recomputed forward work).
    pub extra_i_s: f64,
    /// Bytes kept from F until I ends.
    pub act_i: f64,
    /// Bytes kept from F until W ends.
    pub act_w: f64,
    /// Bytes I recomputes that live until W ends (the wgrad inputs of a recomputed layer).
    pub act_iw: f64,
}

impl RecomputeEffect {
    /// The most one microbatch holds at once: `act_i + act_w` after F, `act_w + act_iw` after
    /// I.
    pub fn peak(&self) -> f64 {
        self.act_w + self.act_i.max(self.act_iw)
    }
}

/// The effect of `mode` on layer `l` for a microbatch of `tokens` tokens and `pairs` attention
/// pairs; `input_bytes_per_token` is what the layer's input holds per token (the previous
/// layer's `output_bytes_per_token`; token ids for the first layer), which full recomputation
/// keeps.
pub fn recompute_effect(
    l: &flatpipe_profiles::LayerProfile,
    input_bytes_per_token: f64,
    mode: Recompute,
    tokens: f64,
    pairs: f64,
) -> RecomputeEffect {
    use flatpipe_profiles::LayerKind;
    let (act_i, act_w) = (
        l.act_bytes_per_token_i * tokens,
        l.act_bytes_per_token_w * tokens,
    );
    match (mode, l.kind) {
        (Recompute::None, _) | (Recompute::Selective, LayerKind::Embedding | LayerKind::Head) => {
            RecomputeEffect {
                act_i,
                act_w,
                ..Default::default()
            }
        }
        (Recompute::Selective, LayerKind::Decoder) => RecomputeEffect {
            extra_i_s: l.f.c_attn_s * pairs,
            act_i,
            act_w: 0.0,
            act_iw: act_w,
        },
        // The embedding keeps only its token ids, which the step holds anyway.
        (Recompute::Full, LayerKind::Embedding) => RecomputeEffect {
            act_w,
            ..Default::default()
        },
        (Recompute::Full, _) => RecomputeEffect {
            extra_i_s: l.f.time_s(tokens, pairs),
            act_i: input_bytes_per_token * tokens,
            act_w: 0.0,
            act_iw: act_w,
        },
    }
}

/// What layer `j` of `profile` takes in per token: the previous layer's output, or 4-byte token
/// ids for the first.
pub fn input_bytes_per_token(profile: &Profile, j: usize) -> f64 {
    match j.checked_sub(1) {
        Some(prev) => profile.layers[prev].output_bytes_per_token,
        None => 4.0,
    }
}

/// Options of [`TableCosts::with_options`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CostOptions<'a> {
    /// Recomputation per stage (empty: none anywhere).
    pub recompute: &'a [Recompute],
    /// The data-parallel replica (0-based): pipeline rank r of replica d is global rank
    /// `r * dp + d` ([`crate::costs::sharding::global_rank`], Megatron's order), which decides which
    /// transfers cross a node boundary.
    pub replica: usize,
    /// How the data-parallel replicas shard their state: bytes per parameter and the
    /// per-microbatch collectives ([`crate::costs::sharding`]).
    pub sharding: Sharding,
    /// Data-parallel replicas (0 or 1: none).
    pub dp: u32,
    /// Bytes per parameter in place of the sharding mode's (e.g. the CPU executor's fp32
    /// weights, gradients and AdamW moments, 16).
    pub state_bytes: Option<StateBytes>,
}

/// Per (stage, microbatch) costs derived from a profile and the step's microbatches.
#[derive(Debug, Clone)]
pub struct TableCosts {
    m: usize,
    cells: Vec<Cell>,
    /// Forward-only: (time, transfer) per (stage, fo microbatch).
    fo: Vec<(u64, u64)>,
    mfo: usize,
    optimizer: Vec<u64>,
    static_bytes: Vec<f64>,
}

impl TableCosts {
    /// Builds the table for `stages` (each a range of the profile's layer list), placed by
    /// `placement`, over the step's `microbatches` and forward-only `fo_microbatches`.
    /// Stage time is the sum over its layers of `c0 + c_tok * tokens + c_attn * attn_pairs` over
    /// what the kernels compute ([`Microbatch::computed_tokens`], padding included); a
    /// transfer moves `output_bytes_per_token * tokens` of the sending boundary over the link
    /// between the two ranks (`alpha + bytes / beta`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the stage count differs from the placement's or a range
    /// leaves the layer list.
    pub fn from_profile(
        profile: &Profile,
        stages: &[Range<usize>],
        placement: &Placement,
        microbatches: &[Microbatch],
        fo_microbatches: &[Microbatch],
    ) -> Result<Self> {
        Self::with_options(
            profile,
            stages,
            placement,
            microbatches,
            fo_microbatches,
            &CostOptions::default(),
        )
    }

    /// [`TableCosts::from_profile`] with per-stage recomputation (see [`Recompute`]) and a
    /// replica's rank offset.
    ///
    /// # Errors
    /// As [`TableCosts::from_profile`], and if `recompute` is non-empty with a length other than
    /// the stage count.
    pub fn with_options(
        profile: &Profile,
        stages: &[Range<usize>],
        placement: &Placement,
        microbatches: &[Microbatch],
        fo_microbatches: &[Microbatch],
        opts: &CostOptions<'_>,
    ) -> Result<Self> {
        if !opts.recompute.is_empty() && opts.recompute.len() != stages.len() {
            return Err(Error::invalid(
                "recompute",
                opts.recompute.len(),
                format!("one mode per stage ({})", stages.len()),
            ));
        }
        let mode = |s: usize| opts.recompute.get(s).copied().unwrap_or_default();
        let n_layers = profile.layers.len();
        if stages.len() != placement.num_stages() as usize {
            return Err(Error::invalid(
                "stages",
                stages.len(),
                format!("{} stages for this placement", placement.num_stages()),
            ));
        }
        for (s, r) in stages.iter().enumerate() {
            if r.start >= r.end || r.end > n_layers {
                return Err(Error::invalid(
                    format!("stages[{s}]"),
                    format!("{}..{}", r.start, r.end),
                    format!("a non-empty range within 0..{n_layers}"),
                ));
            }
        }
        let phase_s = |r: &Range<usize>, ph: Phase, t: f64, a: f64| -> f64 {
            profile.layers[r.clone()]
                .iter()
                .map(|l| l.coeffs(ph).time_s(t, a))
                .sum()
        };
        let out_bytes =
            |s: usize, t: f64| profile.layers[stages[s].end - 1].output_bytes_per_token * t;
        let link_ns = |s_from: usize, s_to: usize, bytes: f64| {
            let dp = opts.dp.max(1) as usize;
            let a = global_rank(placement.rank_of[s_from].idx(), opts.replica, dp);
            let b = global_rank(placement.rank_of[s_to].idx(), opts.replica, dp);
            s_to_ns(profile.link(a, b).time_s(bytes))
        };
        // Posting a message costs its sender and its receiver CPU time (`Link::post_s`), on
        // top of the transfer itself, when the two stages are on different ranks.
        let post_ns = |s_from: usize, s_to: usize| {
            if placement.rank_of[s_from] == placement.rank_of[s_to] {
                return 0;
            }
            let dp = opts.dp.max(1) as usize;
            let a = global_rank(placement.rank_of[s_from].idx(), opts.replica, dp);
            let b = global_rank(placement.rank_of[s_to].idx(), opts.replica, dp);
            s_to_ns(profile.link(a, b).post_s)
        };
        let m = microbatches.len();
        let mut cells = vec![Cell::default(); stages.len() * m];
        // Per cell, seconds a fused B differs from I + W (0 unless the profile measured B).
        let mut b_delta_s = vec![0.0f64; stages.len() * m];
        for (s, r) in stages.iter().enumerate() {
            for (k, mb) in microbatches.iter().enumerate() {
                let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
                let mut act_iw_layer = 0.0f64;
                let e = r.clone().fold(RecomputeEffect::default(), |acc, j| {
                    let l = &profile.layers[j];
                    let e = recompute_effect(l, input_bytes_per_token(profile, j), mode(s), t, a);
                    act_iw_layer = act_iw_layer.max(e.act_iw);
                    RecomputeEffect {
                        extra_i_s: acc.extra_i_s + e.extra_i_s,
                        act_i: acc.act_i + e.act_i,
                        act_w: acc.act_w + e.act_w,
                        act_iw: acc.act_iw + e.act_iw,
                    }
                });
                let (extra_i, act_i, act_w) = (e.extra_i_s, e.act_i, e.act_w);
                b_delta_s[s * m + k] = profile.layers[r.clone()]
                    .iter()
                    .filter(|l| l.b.is_some())
                    .map(|l| {
                        l.fused_backward_s(t, a)
                            - l.coeffs(Phase::I).time_s(t, a)
                            - l.coeffs(Phase::W).time_s(t, a)
                    })
                    .sum();
                cells[s * m + k] = Cell {
                    f: s_to_ns(phase_s(r, Phase::F, t, a)),
                    i: s_to_ns(phase_s(r, Phase::I, t, a) + extra_i),
                    w: s_to_ns(phase_s(r, Phase::W, t, a)),
                    b: 0,
                    fwd_comm: if s + 1 < stages.len() {
                        link_ns(s, s + 1, out_bytes(s, t))
                    } else {
                        0
                    },
                    bwd_comm: if s > 0 {
                        link_ns(s, s - 1, out_bytes(s - 1, t))
                    } else {
                        0
                    },
                    act_i,
                    act_w,
                    act_iw: e.act_iw,
                    act_iw_layer,
                    out_bytes: if s + 1 < stages.len() {
                        out_bytes(s, t)
                    } else {
                        0.0
                    },
                };
            }
        }
        let mfo = fo_microbatches.len();
        let mut fo = vec![(0, 0); stages.len() * mfo];
        for (s, r) in stages.iter().enumerate() {
            for (k, mb) in fo_microbatches.iter().enumerate() {
                let (t, a) = (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64);
                let comm = if s + 1 < stages.len() {
                    link_ns(s, s + 1, out_bytes(s, t))
                } else {
                    0
                };
                let post = if s + 1 < stages.len() {
                    post_ns(s, s + 1)
                } else {
                    0
                } + if s > 0 { post_ns(s - 1, s) } else { 0 };
                fo[s * mfo + k] = (s_to_ns(phase_s(r, Phase::Fo, t, a)) + post, comm);
            }
        }
        let mut optimizer = vec![0u64; placement.num_ranks as usize];
        let mut static_bytes = vec![0.0; placement.num_ranks as usize];
        let mut largest_layer = vec![0.0f64; placement.num_ranks as usize];
        let pp = placement.num_ranks;
        let state = opts
            .state_bytes
            .unwrap_or_else(|| opts.sharding.state_bytes_on(&profile.hardware, pp, opts.dp))
            .total();
        for (s, r) in stages.iter().enumerate() {
            let layers = &profile.layers[r.clone()];
            let params: u64 = layers.iter().map(|l| l.param_count).sum();
            let rank = placement.rank_of[s].idx();
            optimizer[rank] += s_to_ns(params as f64 * profile.optimizer_s_per_param);
            static_bytes[rank] += params as f64 * state;
            for l in layers {
                largest_layer[rank] = largest_layer[rank].max(l.param_count as f64);
            }
            // Per-microbatch collectives (ZeRO-2's gradient reduce-scatter, FSDP resharded per
            // microbatch), prefetched layer by layer against the action's own compute.
            let coll = MicrobatchCollectives::of(
                opts.sharding,
                &profile.hardware,
                pp,
                opts.dp,
                rank as u32,
                params as f64,
            );
            if coll != MicrobatchCollectives::default() {
                let n = layers.len();
                for c in &mut cells[s * m..(s + 1) * m] {
                    let (f, i, w) = (ns_to_s(c.f), ns_to_s(c.i), ns_to_s(c.w));
                    c.f += s_to_ns(exposed_s(f, coll.before_forward_s, n));
                    c.i += s_to_ns(exposed_s(i, coll.before_backward_s, n));
                    c.w += s_to_ns(exposed_s(w, coll.after_backward_s, n));
                }
            }
        }
        let n = stages.len();
        for s in 0..n {
            // F sends its output and receives its input; I and B the other way round.
            let down = if s + 1 < n { post_ns(s, s + 1) } else { 0 };
            let up = if s > 0 { post_ns(s - 1, s) } else { 0 };
            let (post_f, post_b) = (
                down + up,
                if s > 0 { post_ns(s, s - 1) } else { 0 }
                    + if s + 1 < n { post_ns(s + 1, s) } else { 0 },
            );
            // The runtime's fixed cost per action (`Profile::action_overhead`).
            let o = &profile.action_overhead;
            let fused_measured = profile.layers[stages[s].clone()]
                .iter()
                .any(|l| l.b.is_some());
            let (o_f, o_i, o_w) = (s_to_ns(o.f_s), s_to_ns(o.i_s), s_to_ns(o.w_s));
            let o_b = if fused_measured {
                s_to_ns(o.b_s)
            } else {
                o_i + o_w
            };
            let in_w = s == 0 && profile.first_stage_backward_in_w;
            for k in 0..m {
                let c = &mut cells[s * m + k];
                let fused = ((c.i + c.w) as f64 + b_delta_s[s * m + k] * 1e9)
                    .max(0.0)
                    .round() as u64
                    + o_b;
                c.b = fused + post_b;
                c.f += o_f + post_f;
                if in_w {
                    c.i = post_b;
                    c.w = fused;
                } else {
                    c.i += o_i + post_b;
                    c.w += o_w;
                }
            }
            for k in 0..mfo {
                fo[s * mfo + k].0 += o_f;
            }
        }
        if opts.state_bytes.is_none() {
            for (r, b) in static_bytes.iter_mut().enumerate() {
                *b += opts.sharding.transient_bytes(pp, largest_layer[r]);
            }
        }
        Ok(TableCosts {
            m,
            cells,
            fo,
            mfo,
            optimizer,
            static_bytes,
        })
    }

    /// The same costs with no optimizer step (a round of a fixed-capacity schedule that is not
    /// the step's last).
    pub fn without_optimizer(mut self) -> Self {
        self.optimizer.fill(0);
        self
    }

    /// The same costs with the microbatches reordered: microbatch `j` of the result is
    /// microbatch `order[j]` of these (no forward-only microbatches; the per-step planner
    /// prices one cut in several orders without rebuilding the table).
    ///
    /// # Panics
    /// If `order` is not a permutation of `0..m` (a caller bug; [`crate::run::mb_plan`] builds it).
    pub(crate) fn permuted(&self, order: &[usize]) -> TableCosts {
        assert_eq!(order.len(), self.m, "a permutation of the microbatches");
        let stages = self.cells.len() / self.m.max(1);
        let mut cells = Vec::with_capacity(self.cells.len());
        for s in 0..stages {
            cells.extend(order.iter().map(|&k| self.cells[s * self.m + k]));
        }
        TableCosts {
            m: self.m,
            cells,
            fo: Vec::new(),
            mfo: 0,
            optimizer: self.optimizer.clone(),
            static_bytes: self.static_bytes.clone(),
        }
    }

    #[inline]
    fn cell(&self, s: StageId, mb: MicrobatchId) -> &Cell {
        &self.cells[s.idx() * self.m + mb.idx()]
    }
}

impl CostModel for TableCosts {
    #[inline]
    fn compute_ns(&self, a: ComputeAction) -> u64 {
        if a.kind == ActionKind::Fo {
            return self.fo[a.stage.idx() * self.mfo + a.microbatch.idx()].0;
        }
        let c = self.cell(a.stage, a.microbatch);
        match a.kind {
            ActionKind::F => c.f,
            ActionKind::I => c.i,
            ActionKind::W => c.w,
            ActionKind::B => c.b,
            ActionKind::Fo => unreachable!("handled above"),
        }
    }
    #[inline]
    fn comm_ns(&self, stage: StageId, mb: MicrobatchId, kind: ActionKind) -> u64 {
        match kind {
            ActionKind::Fo => self.fo[stage.idx() * self.mfo + mb.idx()].1,
            ActionKind::F => self.cell(stage, mb).fwd_comm,
            _ => self.cell(stage, mb).bwd_comm,
        }
    }
    #[inline]
    fn activation(&self, s: StageId, mb: MicrobatchId) -> (f64, f64) {
        let c = self.cell(s, mb);
        (c.act_i, c.act_w)
    }
    #[inline]
    fn recomputed(&self, s: StageId, mb: MicrobatchId) -> f64 {
        self.cell(s, mb).act_iw
    }
    #[inline]
    fn recomputed_in_b(&self, s: StageId, mb: MicrobatchId) -> f64 {
        self.cell(s, mb).act_iw_layer
    }
    fn optimizer_ns(&self, rank: Rank) -> u64 {
        self.optimizer[rank.idx()]
    }
    fn output_bytes(&self, s: StageId, mb: MicrobatchId) -> f64 {
        self.cell(s, mb).out_bytes
    }
    fn static_bytes(&self, rank: Rank) -> f64 {
        self.static_bytes[rank.idx()]
    }
    fn memory_unit(&self) -> MemoryUnit {
        MemoryUnit::Bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::microbatch::Microbatch;
    use crate::ir::{Action, ActionKind, Placement, Schedule};

    /// The peak activation bytes of rank 0 when one rank runs `actions` (stage 0, microbatches
    /// of `tokens` tokens in one sequence) over layers `layers` of the tiny model's analytic
    /// profile, recomputing per `mode`.
    fn peak_of(layers: Range<usize>, mode: Recompute, actions: &[(ActionKind, u32)]) -> f64 {
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let profile =
            flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let placement = Placement::looped(1, 1);
        let mbs = vec![
            Microbatch {
                chunk: None,
                seq_lens: vec![128],
                shape: Default::default(),
            };
            2
        ];
        let costs = TableCosts::with_options(
            &profile,
            &[layers],
            &placement,
            &mbs,
            &[],
            &CostOptions {
                recompute: &[mode],
                ..Default::default()
            },
        )
        .unwrap();
        let schedule = Schedule {
            name: "by hand".into(),
            placement,
            num_microbatches: 2,
            num_fo_microbatches: 0,
            chunks: Vec::new(),
            ranks: vec![
                actions
                    .iter()
                    .map(|&(k, mb)| Action::new(0, k, mb))
                    .collect(),
            ],
        };
        let t = crate::replay::replay(&schedule, &costs).unwrap();
        crate::replay::metrics::metrics(&schedule, &costs, &t).ranks[0]
            .peak_activation_bytes
            .unwrap()
    }

    #[test]
    fn recomputed_wgrad_inputs_live_from_i_to_w() {
        // PyTorch issue #136766: under a zero-bubble order (W deferred), what I recomputes stays
        // until W. One decoder layer, full recomputation, F0 F1 I0 I1 W0 W1 on one rank: F keeps
        // each microbatch's input; I recomputes the wgrad inputs (act_w) and frees the input; W
        // frees them. By hand, the peak is while I1 runs: act_w of microbatch 0 (kept for W0),
        // act_w of microbatch 1 and microbatch 1's input (freed when I1 ends).
        use ActionKind::{F, I, W};
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let (input, act_w) = (
            p.layers[0].output_bytes_per_token * 128.0,
            p.layers[1].act_bytes_per_token_w * 128.0,
        );
        assert!(act_w > input);
        let zb = [(F, 0), (F, 1), (I, 0), (I, 1), (W, 0), (W, 1)];
        let peak = peak_of(1..2, Recompute::Full, &zb);
        assert!((peak - (input + 2.0 * act_w)).abs() < 1e-6, "{peak}");
        // The head under full recomputation keeps its input (hidden states), not its 4-byte
        // loss: F0 I0 W0 peaks at the input plus the recomputed wgrad inputs.
        let head = model.layers().len() - 1;
        let (h_input, h_w) = (
            p.layers[head - 1].output_bytes_per_token * 128.0,
            p.layers[head].act_bytes_per_token_w * 128.0,
        );
        let peak = peak_of(head..head + 1, Recompute::Full, &[(F, 0), (I, 0), (W, 0)]);
        assert!((peak - (h_input + h_w)).abs() < 1e-6, "{peak}");
        // Selective on a decoder keeps the dgrad-only tensors from F (act_i) and recomputes
        // the wgrad inputs in I, as the executor does: same order, act_i of both microbatches,
        // then act_w of both plus what microbatch 1 still holds.
        let act_i = p.layers[1].act_bytes_per_token_i * 128.0;
        let peak = peak_of(1..2, Recompute::Selective, &zb);
        let want = (2.0 * act_i + act_w).max(act_i + 2.0 * act_w);
        assert!((peak - want).abs() < 1e-6, "{peak} vs {want}");
    }

    #[test]
    fn fused_backward_recomputes_one_layer_at_a_time() {
        // A fused B recomputes layer by layer and frees each layer's recomputed wgrad inputs
        // with that layer's weight gradient: two decoder layers under selective recomputation,
        // F0 B0 on one rank, peak while B runs = both layers' dgrad-only tensors kept by F plus
        // one layer's recomputed wgrad inputs (not both layers', as a deferred W would need).
        use ActionKind::{B, F};
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let (act_i, act_w) = (
            p.layers[1].act_bytes_per_token_i * 128.0,
            p.layers[1].act_bytes_per_token_w * 128.0,
        );
        assert_eq!(
            p.layers[1].act_bytes_per_token_w,
            p.layers[2].act_bytes_per_token_w
        );
        let peak = peak_of(1..3, Recompute::Selective, &[(F, 0), (B, 0)]);
        let want = 2.0 * act_i + act_w;
        assert!((peak - want).abs() < 1e-6, "{peak} vs {want}");
    }

    #[test]
    fn a_runtime_s_fused_backward_overheads_posting_and_first_stage_are_priced() {
        // Two stages on two ranks (layers 0..2 and 2..n of the tiny model), one microbatch
        // of 100 tokens in one sequence. By hand from the profile's coefficients:
        // - a stage's B is the measured fused cost of its layers where present, I + W of the
        //   others, plus the per-action B overhead;
        // - F, I, W pay their per-action overhead once, whatever the layers;
        // - each cross-rank message costs its sender and its receiver `post_s`;
        // - with `first_stage_backward_in_w`, stage 0's I costs its receive's posting only
        //   and its W the fused backward.
        use flatpipe_profiles::{ActionOverhead, CostCoeffs};
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        let hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let mut p = flatpipe_profiles::analytic_profile(&model, &hw, &Default::default()).unwrap();
        let n = p.layers.len();
        let fused = CostCoeffs {
            c0_s: 1e-4,
            c_tok_s: 2e-6,
            c_attn_s: 0.0,
        };
        p.layers[1].b = Some(fused);
        p.action_overhead = ActionOverhead {
            f_s: 1e-3,
            i_s: 2e-3,
            w_s: 3e-3,
            b_s: 4e-3,
        };
        p.hardware.intra_node.post_s = 5e-4;
        p.hardware.inter_node.post_s = 5e-4;
        let (t, a) = (100.0, 5050.0);
        let sum = |r: Range<usize>, ph: Phase| -> f64 {
            p.layers[r].iter().map(|l| l.coeffs(ph).time_s(t, a)).sum()
        };
        let fused_s = |r: Range<usize>| -> f64 {
            p.layers[r]
                .iter()
                .map(|l| match &l.b {
                    Some(b) => b.time_s(t, a),
                    None => l.i.time_s(t, a) + l.w.time_s(t, a),
                })
                .sum()
        };
        let mbs = [Microbatch {
            chunk: None,
            seq_lens: vec![100],
            shape: Default::default(),
        }];
        let ns = |s: f64| (s * 1e9).round();
        let close = |got: u64, want: f64| {
            assert!(
                (got as f64 - ns(want)).abs() <= 3.0,
                "{got} vs {}",
                ns(want)
            )
        };
        let stages = [0..2, 2..n];
        let act = |s: u32, k: ActionKind| ComputeAction::new(s, k, 0);
        for first_in_w in [false, true] {
            p.first_stage_backward_in_w = first_in_w;
            let c =
                TableCosts::from_profile(&p, &stages, &Placement::looped(2, 1), &mbs, &[]).unwrap();
            let post = 5e-4;
            // Stage 0 sends its output (F) and receives the gradient (I or B).
            close(
                c.compute_ns(act(0, ActionKind::F)),
                sum(0..2, Phase::F) + 1e-3 + post,
            );
            close(
                c.compute_ns(act(0, ActionKind::B)),
                fused_s(0..2) + 4e-3 + post,
            );
            if first_in_w {
                close(c.compute_ns(act(0, ActionKind::I)), post);
                close(c.compute_ns(act(0, ActionKind::W)), fused_s(0..2) + 4e-3);
            } else {
                close(
                    c.compute_ns(act(0, ActionKind::I)),
                    sum(0..2, Phase::I) + 2e-3 + post,
                );
                close(
                    c.compute_ns(act(0, ActionKind::W)),
                    sum(0..2, Phase::W) + 3e-3,
                );
            }
            // Stage 1 holds no measured fused layer: its B is I + W with both overheads.
            close(
                c.compute_ns(act(1, ActionKind::F)),
                sum(2..n, Phase::F) + 1e-3 + post,
            );
            close(
                c.compute_ns(act(1, ActionKind::B)),
                sum(2..n, Phase::I) + sum(2..n, Phase::W) + 2e-3 + 3e-3 + post,
            );
            close(
                c.compute_ns(act(1, ActionKind::W)),
                sum(2..n, Phase::W) + 3e-3,
            );
        }
        // On one rank, nothing is posted.
        p.first_stage_backward_in_w = false;
        let c = TableCosts::from_profile(&p, &stages, &Placement::looped(1, 2), &mbs, &[]).unwrap();
        close(
            c.compute_ns(act(0, ActionKind::F)),
            sum(0..2, Phase::F) + 1e-3,
        );
    }

    #[test]
    fn cost_spec_parses_and_rejects() {
        let c: UniformCostSpec = "f=1,b=2,w=0.5,comm=0.1".parse().unwrap();
        assert_eq!((c.f, c.b, c.w, c.comm), (1.0, 2.0, 0.5, 0.1));
        let e = "f=-1".parse::<UniformCostSpec>().unwrap_err().to_string();
        assert!(e.contains("0 or 1e-9") && e.contains("costs f"), "{e}");
        assert!("x=1".parse::<UniformCostSpec>().is_err());
        assert!("f".parse::<UniformCostSpec>().is_err());
        // A repeated key was silently the last one given.
        let e = "f=1,b=2,f=3"
            .parse::<UniformCostSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("f is given twice"), "{e}");
    }
}
