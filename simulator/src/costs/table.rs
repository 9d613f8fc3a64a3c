//! Table costs: per (stage, microbatch) times, transfers and memory from a [`Profile`] and
//! the step's microbatches.

use super::recompute::{Recompute, RecomputeEffect, input_bytes_per_token, recompute_effect};
use super::sharding::{
    MicrobatchCollectives, Sharding, StageCollectives, StateBytes, exposed_s, global_rank,
};
use super::{CostModel, MemoryUnit, ns_to_s, s_to_ns};
use crate::batching::microbatch::Microbatch;
use crate::ir::{ActionKind, ComputeAction, MicrobatchId, Placement, Rank, StageId};
use crate::{Error, Result};
use flatpipe_profiles::{Phase, Profile};
use std::ops::Range;

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
    /// Of `f` and of `i` each, the expert-parallel all-to-alls (the router's imbalance
    /// included), which an overlapped forward-backward pair can hide.
    all_to_all: u64,
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
    /// Whether FSDP's per-stage collectives run as actions of the lowering
    /// ([`crate::ir::lowering::Lowering::fsdp`]): [`CostModel::fsdp_ns`] then prices them
    /// ([`crate::costs::sharding::StageCollectives`]); otherwise it is 0 and the step's
    /// tail holds them ([`crate::run::step::StepPlan::step_time_with_collectives`]).
    pub fsdp_actions: bool,
    /// Context parallelism: each rank a group of GPUs sharing every microbatch's tokens
    /// ([`super::context`]). `None`: one GPU per rank.
    pub context_parallel: Option<flatpipe_profiles::context_parallel::ContextParallel>,
}

impl CostOptions<'_> {
    /// GPUs that hold the same stage and reduce its gradients and shard its state: the `dp`
    /// replicas times the cp group's GPUs (each holds the whole stage; Megatron-Core's
    /// data-parallel group "with context parallel",
    /// `megatron/core/parallel_state.py`, `get_data_parallel_group(with_context_parallel=True)`,
    /// which its distributed optimizer shards over), >= 1.
    pub fn grad_replicas(&self) -> u32 {
        self.dp.max(1) * self.context_parallel.map_or(1, |c| c.cp.max(1))
    }
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
    /// Per stage: FSDP's all-gather and gradient reduction as actions, ns (empty: none).
    fsdp: Vec<(u64, u64)>,
    /// The hardware's `collective_interference`.
    interference: f64,
    /// Whether some cell pays expert-parallel all-to-alls.
    has_all_to_all: bool,
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
        let build = TableBuild {
            profile,
            stages,
            placement,
            opts: *opts,
        };
        build.check()?;
        if let Some(cp) = &opts.context_parallel {
            super::context::check(cp, profile, microbatches)?;
            super::context::check(cp, profile, fo_microbatches)?;
        }
        let (m, mfo) = (microbatches.len(), fo_microbatches.len());
        let (mut cells, b_delta_s) = build.compute_cells(microbatches);
        let mut fo = build.forward_only_cells(fo_microbatches);
        build.add_microbatch_collectives(&mut cells, m);
        build.add_action_overheads(&mut cells, &b_delta_s, m, &mut fo, mfo);
        let (optimizer, static_bytes) = build.rank_state();
        let has_all_to_all = cells.iter().any(|c| c.all_to_all > 0);
        Ok(TableCosts {
            m,
            cells,
            has_all_to_all,
            fo,
            mfo,
            optimizer,
            static_bytes,
            fsdp: build.fsdp_actions(),
            interference: profile.hardware.collective_interference,
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
            fsdp: self.fsdp.clone(),
            interference: self.interference,
            has_all_to_all: self.has_all_to_all,
        }
    }

    #[inline]
    fn cell(&self, s: StageId, mb: MicrobatchId) -> &Cell {
        &self.cells[s.idx() * self.m + mb.idx()]
    }
}

/// The inputs of one [`TableCosts::with_options`] and its steps, in the order they run:
/// [`TableBuild::check`], the compute cells, the forward-only cells, the per-microbatch
/// collectives, the runtime's per-action costs, and the per-rank state. Cells are indexed
/// `s * m + k` (stage s, microbatch k of m); times are ns, memory bytes.
struct TableBuild<'a> {
    profile: &'a Profile,
    /// Each stage's range of the profile's layer list.
    stages: &'a [Range<usize>],
    placement: &'a Placement,
    opts: CostOptions<'a>,
}

impl TableBuild<'_> {
    /// Checks the layout against the profile and the placement.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `recompute` is non-empty with a length other than the stage
    /// count, the stage count differs from the placement's, or a range is empty or leaves the
    /// layer list.
    fn check(&self) -> Result<()> {
        let (stages, placement) = (self.stages, self.placement);
        let recompute = self.opts.recompute;
        if !recompute.is_empty() && recompute.len() != stages.len() {
            return Err(Error::invalid(
                "recompute",
                recompute.len(),
                format!("one mode per stage ({})", stages.len()),
            ));
        }
        let n_layers = self.profile.layers.len();
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
        Ok(())
    }

    /// Stage `s`'s recomputation mode ([`Recompute::None`] when none is given).
    fn mode(&self, s: usize) -> Recompute {
        self.opts.recompute.get(s).copied().unwrap_or_default()
    }

    /// Seconds phase `ph` of the layers `r` takes for `t` computed tokens and `a` attention
    /// pairs.
    fn phase_s(&self, r: &Range<usize>, ph: Phase, t: f64, a: f64) -> f64 {
        self.profile.layers[r.clone()]
            .iter()
            .map(|l| l.coeffs(ph).time_s(t, a))
            .sum()
    }

    /// What one GPU of a rank computes for microbatch `mb` on the layers `r`: `(tokens,
    /// attention pairs)` (the microbatch's, or with context parallelism its share and its
    /// busiest GPU's pairs), and the context-parallel exchange exposed in its F and I, seconds.
    fn per_gpu(&self, r: &Range<usize>, mb: &Microbatch) -> ((f64, f64), (f64, f64)) {
        match &self.opts.context_parallel {
            Some(cp) => {
                let share = super::context::share(cp, self.profile, r, mb);
                let x = super::context::exchange_s(cp, self.profile, r, &share);
                ((share.tokens, share.pairs), x)
            }
            None => (
                (mb.computed_tokens() as f64, mb.computed_attn_pairs() as f64),
                (0.0, 0.0),
            ),
        }
    }

    /// Bytes stage `s` sends to stage s + 1 for `t` tokens (its last layer's output).
    fn out_bytes(&self, s: usize, t: f64) -> f64 {
        self.profile.layers[self.stages[s].end - 1].output_bytes_per_token * t
    }

    /// The link between the ranks of stages `s_from` and `s_to` in this replica (global ranks
    /// in Megatron's order, [`global_rank`]).
    fn link(&self, s_from: usize, s_to: usize) -> &flatpipe_profiles::Link {
        let dp = self.opts.dp.max(1) as usize;
        let rank_of = &self.placement.rank_of;
        let a = global_rank(rank_of[s_from].idx(), self.opts.replica, dp);
        let b = global_rank(rank_of[s_to].idx(), self.opts.replica, dp);
        self.profile.link(a, b)
    }

    /// A transfer of `bytes` from stage `s_from` to stage `s_to`, ns (`alpha + bytes / beta`).
    fn transfer_ns(&self, s_from: usize, s_to: usize, bytes: f64) -> u64 {
        s_to_ns(self.link(s_from, s_to).time_s(bytes))
    }

    /// CPU time posting a message costs its sender and its receiver (`Link::post_s`), ns, on
    /// top of the transfer itself; 0 when the two stages are on the same rank.
    fn post_ns(&self, s_from: usize, s_to: usize) -> u64 {
        let rank_of = &self.placement.rank_of;
        if rank_of[s_from] == rank_of[s_to] {
            return 0;
        }
        s_to_ns(self.link(s_from, s_to).post_s)
    }

    /// Every (stage, microbatch) cell from the layers' coefficients, recomputation and the
    /// links, before collectives and per-action overheads; with, per cell, the seconds a fused
    /// B differs from I + W (0 unless the profile measured B).
    fn compute_cells(&self, microbatches: &[Microbatch]) -> (Vec<Cell>, Vec<f64>) {
        let m = microbatches.len();
        let mut cells = vec![Cell::default(); self.stages.len() * m];
        let mut b_delta_s = vec![0.0f64; self.stages.len() * m];
        for s in 0..self.stages.len() {
            for (k, mb) in microbatches.iter().enumerate() {
                (cells[s * m + k], b_delta_s[s * m + k]) = self.compute_cell(s, mb);
            }
        }
        (cells, b_delta_s)
    }

    /// One cell of [`TableBuild::compute_cells`] (stage `s`, microbatch `mb`) and its fused-B
    /// difference, seconds.
    fn compute_cell(&self, s: usize, mb: &Microbatch) -> (Cell, f64) {
        let (profile, r, n) = (self.profile, &self.stages[s], self.stages.len());
        let ((t, a), (cf, ci)) = self.per_gpu(r, mb);
        let mut act_iw_layer = 0.0f64;
        let e = r.clone().fold(RecomputeEffect::default(), |acc, j| {
            let l = &profile.layers[j];
            let e = recompute_effect(l, input_bytes_per_token(profile, j), self.mode(s), t, a);
            act_iw_layer = act_iw_layer.max(e.act_iw);
            RecomputeEffect {
                extra_i_s: acc.extra_i_s + e.extra_i_s,
                act_i: acc.act_i + e.act_i,
                act_w: acc.act_w + e.act_w,
                act_iw: acc.act_iw + e.act_iw,
            }
        });
        let b_delta_s = profile.layers[r.clone()]
            .iter()
            .filter(|l| l.b.is_some())
            .map(|l| {
                l.fused_backward_s(t, a)
                    - l.coeffs(Phase::I).time_s(t, a)
                    - l.coeffs(Phase::W).time_s(t, a)
            })
            .sum();
        let ([xf, xi, xw], all_to_all) = self.routing_s(r, mb, t);
        let cell = Cell {
            f: s_to_ns(self.phase_s(r, Phase::F, t, a) + xf + cf),
            i: s_to_ns(self.phase_s(r, Phase::I, t, a) + e.extra_i_s + xi + ci),
            w: s_to_ns(self.phase_s(r, Phase::W, t, a) + xw),
            b: 0,
            fwd_comm: if s + 1 < n {
                self.transfer_ns(s, s + 1, self.out_bytes(s, t))
            } else {
                0
            },
            bwd_comm: if s > 0 {
                self.transfer_ns(s, s - 1, self.out_bytes(s - 1, t))
            } else {
                0
            },
            act_i: e.act_i,
            act_w: e.act_w,
            act_iw: e.act_iw,
            act_iw_layer,
            out_bytes: if s + 1 < n { self.out_bytes(s, t) } else { 0.0 },
            all_to_all: s_to_ns(all_to_all),
        };
        (cell, b_delta_s)
    }

    /// The stage's mixture-of-experts layers under the router model for microbatch `mb`
    /// ([`super::routing`]: only a microbatch's padding, which all goes to the same experts,
    /// unbalances it): what the busiest GPU of an expert-parallel group runs beyond the mean, in
    /// seconds of F, I and W (each layer's routed part times the imbalance less one), and the
    /// seconds of all-to-all one F or one I pays (imbalance included), for `t` tokens on one GPU
    /// (the microbatch's, or with context parallelism its share).
    fn routing_s(&self, r: &Range<usize>, mb: &Microbatch, t: f64) -> ([f64; 3], f64) {
        let profile = self.profile;
        let ep = profile.expert_parallel;
        let computed = mb.computed_tokens() as f64;
        if ep <= 1 || t <= 0.0 || computed <= 0.0 {
            return ([0.0; 3], 0.0);
        }
        let padding = (computed - mb.tokens() as f64) / computed;
        let (mut out, mut all_to_all) = ([0.0; 3], 0.0);
        for j in r.clone() {
            let l = &profile.layers[j];
            let Some(routed) = l.routed else { continue };
            let (experts, k) = (l.shape.experts, l.shape.top_k);
            let hot = super::routing::padding_experts_on_busiest(j, experts, k, ep);
            let rho = super::routing::imbalance(padding, hot, k, ep);
            for (o, c) in out.iter_mut().zip([routed.f, routed.i, routed.w]) {
                *o += (rho - 1.0) * c.time_s(t, 0.0);
            }
            all_to_all += rho * routed.all_to_all.time_s(t, 0.0);
        }
        (out, all_to_all)
    }

    /// Forward-only (time with its postings, transfer to the next stage) per (stage, fo
    /// microbatch), ns, before the per-action overhead.
    fn forward_only_cells(&self, fo_microbatches: &[Microbatch]) -> Vec<(u64, u64)> {
        let (n, mfo) = (self.stages.len(), fo_microbatches.len());
        let mut fo = vec![(0, 0); n * mfo];
        for (s, r) in self.stages.iter().enumerate() {
            for (k, mb) in fo_microbatches.iter().enumerate() {
                let ((t, a), (cf, _)) = self.per_gpu(r, mb);
                let comm = if s + 1 < n {
                    self.transfer_ns(s, s + 1, self.out_bytes(s, t))
                } else {
                    0
                };
                let post = if s + 1 < n { self.post_ns(s, s + 1) } else { 0 }
                    + if s > 0 { self.post_ns(s - 1, s) } else { 0 };
                let xf = self.routing_s(r, mb, t).0[0];
                fo[s * mfo + k] = (
                    s_to_ns(self.phase_s(r, Phase::Fo, t, a) + xf + cf) + post,
                    comm,
                );
            }
        }
        fo
    }

    /// Adds the sharding's per-microbatch collectives (ZeRO-2's gradient reduce-scatter, FSDP
    /// resharded per microbatch) to F, I and W of every cell: prefetched layer by layer against
    /// the action's own compute, so only their exposed part ([`exposed_s`]).
    /// Per stage, FSDP's all-gather and gradient reduction as actions, ns; empty unless
    /// `opts.fsdp_actions` and the sharding runs them per stage and step.
    fn fsdp_actions(&self) -> Vec<(u64, u64)> {
        if !self.opts.fsdp_actions {
            return Vec::new();
        }
        let (profile, pp) = (self.profile, self.placement.num_ranks);
        let mut out = Vec::with_capacity(self.stages.len());
        for (s, r) in self.stages.iter().enumerate() {
            let params: u64 = profile.layers[r.clone()]
                .iter()
                .map(|l| l.param_count)
                .sum();
            let rank = self.placement.rank_of[s].0;
            match StageCollectives::of(
                self.opts.sharding,
                &profile.hardware,
                pp,
                self.opts.grad_replicas(),
                rank,
                params as f64,
            ) {
                Some(c) => out.push((s_to_ns(c.all_gather_s), s_to_ns(c.reduce_grad_s))),
                None => return Vec::new(),
            }
        }
        out
    }

    fn add_microbatch_collectives(&self, cells: &mut [Cell], m: usize) {
        let (profile, opts) = (self.profile, &self.opts);
        let pp = self.placement.num_ranks;
        for (s, r) in self.stages.iter().enumerate() {
            let layers = &profile.layers[r.clone()];
            let params: u64 = layers.iter().map(|l| l.param_count).sum();
            let rank = self.placement.rank_of[s].idx();
            let coll = MicrobatchCollectives::of(
                opts.sharding,
                &profile.hardware,
                pp,
                opts.grad_replicas(),
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
    }

    /// Adds what the runtime costs per action: its fixed cost (`Profile::action_overhead`), the
    /// posting of the messages it sends and receives (F sends its output and receives its
    /// input; I and B the other way round), and sets each cell's fused B (measured where the
    /// profile has it: `b_delta_s`, seconds per cell). With `first_stage_backward_in_w`, stage
    /// 0's I is its receive's posting only and its W the fused backward.
    fn add_action_overheads(
        &self,
        cells: &mut [Cell],
        b_delta_s: &[f64],
        m: usize,
        fo: &mut [(u64, u64)],
        mfo: usize,
    ) {
        let (profile, n) = (self.profile, self.stages.len());
        for s in 0..n {
            let down = if s + 1 < n { self.post_ns(s, s + 1) } else { 0 };
            let up = if s > 0 { self.post_ns(s - 1, s) } else { 0 };
            let (post_f, post_b) = (
                down + up,
                if s > 0 { self.post_ns(s, s - 1) } else { 0 }
                    + if s + 1 < n { self.post_ns(s + 1, s) } else { 0 },
            );
            let o = &profile.action_overhead;
            let fused_measured = profile.layers[self.stages[s].clone()]
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
    }

    /// Per pipeline rank: the optimizer step, ns, and the memory constant over the step,
    /// bytes (parameters, gradients and optimizer state at the sharding's or the given bytes
    /// per parameter, plus the sharding's transient buffers for the rank's largest layer when
    /// the bytes per parameter are the sharding's).
    fn rank_state(&self) -> (Vec<u64>, Vec<f64>) {
        let (profile, opts, placement) = (self.profile, &self.opts, self.placement);
        let p = placement.num_ranks as usize;
        let mut optimizer = vec![0u64; p];
        let mut static_bytes = vec![0.0; p];
        let mut largest_layer = vec![0.0f64; p];
        let pp = placement.num_ranks;
        let state = opts
            .state_bytes
            .unwrap_or_else(|| {
                opts.sharding
                    .state_bytes_on(&profile.hardware, pp, opts.grad_replicas())
            })
            .total();
        // The routed experts' state shards over the replicas that hold the same experts.
        let ep = profile.expert_parallel.max(1);
        let expert_state = opts
            .state_bytes
            .unwrap_or_else(|| {
                let dp = (opts.grad_replicas() / ep).max(1);
                opts.sharding.state_bytes_on(&profile.hardware, pp, dp)
            })
            .total();
        for (s, r) in self.stages.iter().enumerate() {
            let layers = &profile.layers[r.clone()];
            let params: u64 = layers.iter().map(|l| l.param_count).sum();
            let experts: u64 = layers.iter().map(|l| l.shape.expert_params).sum();
            let rank = placement.rank_of[s].idx();
            optimizer[rank] += s_to_ns(params as f64 * profile.optimizer_s_per_param);
            static_bytes[rank] += (params - experts) as f64 * state + experts as f64 * expert_state;
            for l in layers {
                largest_layer[rank] = largest_layer[rank].max(l.param_count as f64);
            }
        }
        if opts.state_bytes.is_none() {
            for (r, b) in static_bytes.iter_mut().enumerate() {
                *b += opts.sharding.transient_bytes(pp, largest_layer[r]);
            }
        }
        (optimizer, static_bytes)
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
    fn has_all_to_all(&self) -> bool {
        self.has_all_to_all
    }
    /// F, I and B each pay the cell's two all-to-alls (B holds the I); W and Fo none.
    fn all_to_all_ns(&self, a: ComputeAction) -> u64 {
        match a.kind {
            ActionKind::F | ActionKind::I | ActionKind::B => {
                self.cell(a.stage, a.microbatch).all_to_all
            }
            ActionKind::W | ActionKind::Fo => 0,
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
    fn fsdp_ns(&self, s: StageId, action: crate::ir::comm::FsdpAction) -> u64 {
        use crate::ir::comm::FsdpAction;
        match (self.fsdp.get(s.idx()), action) {
            (Some(&(ag, _)), FsdpAction::Unshard) => ag,
            (Some(&(_, rs)), FsdpAction::ReduceGrad) => rs,
            _ => 0,
        }
    }
    fn collective_interference(&self) -> f64 {
        self.interference
    }
    /// An overlapped pair (DualPipe's): each chunk's expert-parallel all-to-alls run beside the
    /// other's compute on their own stream (DeepSeek-V3, arXiv 2412.19437, §3.2.1), so the pair
    /// takes the longer of its compute, slowed by the hardware's collective interference over
    /// the time they overlap, and its all-to-alls: `max(C + k min(C, A), A)`, with `A` both
    /// chunks' all-to-alls and `C` the rest of their time. Without all-to-alls, the sum.
    fn overlap_ns(&self, f: ComputeAction, b: ComputeAction) -> u64 {
        let (tf, tb) = (self.compute_ns(f), self.compute_ns(b));
        let a = self.all_to_all_ns(f) + self.all_to_all_ns(b);
        if a == 0 {
            return tf + tb;
        }
        let c = (tf + tb).saturating_sub(a) as f64;
        let k = self.interference;
        (c + k * c.min(a as f64)).max(a as f64).round() as u64
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
}
