//! Sharded data parallelism: what each data-parallel rank holds and what its collectives cost.
//!
//! Every mode keeps one pipeline per replica; the `dp` replicas of pipeline rank `r` (global
//! ranks `d * pp + r`, see [`DpGroup::of`]) form its data-parallel group. What differs is which of the weights,
//! gradients and optimizer state are split over that group, and when the collectives run.
//!
//! Bytes per parameter and rank (`d` = the shard degree), each in the mixed-precision layout of
//! the framework that runs the mode:
//!
//! | mode | weights | gradients | optimizer | framework and source |
//! |---|---|---|---|---|
//! | `ddp` | 2 | 4 | 12 | Megatron-LM with `--bf16` and no distributed optimizer: bf16 weights, fp32 main gradients (`--bf16` sets `accumulate_allreduce_grads_in_fp32` unless `--grad-reduce-in-bf16`, `megatron/training/arguments.py`), fp32 master weights and AdamW moments: 18 (`docs/user-guide/features/dist_optimizer.md`) |
//! | `zero1` | 2 | 4 | 12/d | Megatron-LM's distributed optimizer with `--bf16`: the same, master weights and moments sharded, "6 + 12/d" (same doc) |
//! | `zero2` | 2 | 2/d | 12/d | ZeRO stage 2 (Rajbhandari et al. 2020, §5.2: `2Ψ + (2 + K)Ψ/N_d`, K = 12) |
//! | `fsdp`, `hsdp` under PP | 2 + 4/d | 4 + 4/d | 8/d | torchtitan's FSDP2 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`): fp32 sharded parameters (the master copy), fp32 sharded gradients and moments; with PP the bf16 unsharded parameters stay gathered and the gradients accumulate unsharded in fp32 for the whole step (see below) |
//! | `fsdp` at pp = 1, `fsdp-mb` | 4/d | 4/d | 8/d | the same, resharded after every forward and backward: only the layers being computed are unsharded ([`Sharding::transient_bytes`]) |
//!
//! FSDP under PP as torchtitan runs it: its `apply_fsdp` sets `reshard_after_forward = not
//! pp_enabled` (policy "default"), and PyTorch's pipeline stage
//! (`torch/distributed/pipelining/stage.py`) turns gradient sync and resharding off for all but
//! a stage's last backward of the step. So each stage pays one all-gather before its first
//! forward and one reduce-scatter after its last backward, and holds the unsharded parameters
//! and gradients in between. `fsdp-mb` is the per-microbatch alternative (reshard after every
//! forward and backward, reduce-scatter every microbatch): less memory, `2m` all-gathers and `m`
//! reduce-scatters per stage.
//!
//! Collectives are rings over the group (Patarasuk and Yuan 2009 for the all-reduce; the
//! reduce-scatter and all-gather are its two halves, Thakur, Rabenseifner and Gropp 2005):
//! `all-reduce = 2 (n - 1) (alpha + B / (n beta))`, `reduce-scatter = all-gather = (n - 1)
//! (alpha + B / (n beta))`, `B` the unsharded bytes, on the intra-node link when the group lies
//! in one node and the inter-node link otherwise.
//!
//! What overlaps compute ([`StepCollectives`], [`MicrobatchCollectives`]):
//! - Per-step collectives run on the rank's own timeline: a gradient reduction starts at the
//!   rank's last compute of the step (a rank that finishes early hides it in its cool-down
//!   bubble), then the optimizer, then an all-gather of updated weights (ZeRO-1/2: Megatron's
//!   `--overlap-grad-reduce` and `--overlap-param-gather` are off by default, so neither overlaps
//!   compute). FSDP's all-gather before the first forward overlaps the rank's warm-up wait.
//! - Per-microbatch collectives are prefetched layer by layer (FSDP2's implicit prefetch,
//!   ZeRO-2's gradient buckets): over `L` layers, only one layer's share is exposed when
//!   compute is longer, `comm / L + (L - 1) / L * max(0, comm - compute)` ([`exposed_s`]).

use crate::{Error, Result};
use flatpipe_profiles::{Hardware, Link};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the data-parallel replicas share weights, gradients and optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Sharding {
    /// Every replica holds everything; one all-reduce of the gradients per step.
    #[default]
    #[serde(rename = "ddp")]
    Ddp,
    /// Optimizer state sharded (Megatron's distributed optimizer): reduce-scatter of the
    /// gradients, all-gather of the updated weights.
    #[serde(rename = "zero1")]
    Zero1,
    /// Optimizer state and gradients sharded: a reduce-scatter per microbatch's backward (under
    /// PP gradients cannot accumulate unsharded; DeepSpeed refuses ZeRO-2 with pipelines for
    /// this reason), an all-gather of the updated weights per step.
    #[serde(rename = "zero2")]
    Zero2,
    /// Weights too (ZeRO-3, FSDP2 as torchtitan runs it): one all-gather and one reduce-scatter
    /// per stage and step under PP; per microbatch without PP.
    #[serde(rename = "fsdp")]
    Fsdp,
    /// FSDP resharded after every forward and backward, gradients reduce-scattered per
    /// microbatch, also under PP.
    #[serde(rename = "fsdp-mb")]
    FsdpPerMicrobatch,
    /// Hybrid sharding (torchtitan's `data_parallel_shard_degree` within a node x
    /// `data_parallel_replicate_degree` across nodes): FSDP over the replicas in one node, an
    /// all-reduce of the gradient shards across nodes.
    #[serde(rename = "hsdp")]
    Hsdp,
}

impl Sharding {
    /// Every mode.
    pub const ALL: [Sharding; 6] = [
        Sharding::Ddp,
        Sharding::Zero1,
        Sharding::Zero2,
        Sharding::Fsdp,
        Sharding::FsdpPerMicrobatch,
        Sharding::Hsdp,
    ];

    /// Whether the weights are resharded (and the gradients reduced) after every microbatch on
    /// `pp` pipeline ranks: `fsdp-mb` always, `fsdp` / `hsdp` without PP (torchtitan's
    /// `reshard_after_forward = not pp_enabled`).
    pub fn per_microbatch(self, pp: u32) -> bool {
        match self {
            Sharding::FsdpPerMicrobatch => true,
            Sharding::Fsdp | Sharding::Hsdp => pp == 1,
            _ => false,
        }
    }

    /// Bytes per parameter a rank holds for the whole step with shard degree `d` (see the module
    /// table), split into weights, gradients and optimizer state.
    pub fn state_bytes(self, pp: u32, d: u32) -> StateBytes {
        let d = f64::from(d.max(1));
        match self {
            Sharding::Ddp => StateBytes {
                params: 2.0,
                grads: 4.0,
                optimizer: 12.0,
            },
            Sharding::Zero1 => StateBytes {
                params: 2.0,
                grads: 4.0,
                optimizer: 12.0 / d,
            },
            Sharding::Zero2 => StateBytes {
                params: 2.0,
                grads: 2.0 / d,
                optimizer: 12.0 / d,
            },
            Sharding::Fsdp | Sharding::FsdpPerMicrobatch | Sharding::Hsdp => {
                if self.per_microbatch(pp) {
                    StateBytes {
                        params: 4.0 / d,
                        grads: 4.0 / d,
                        optimizer: 8.0 / d,
                    }
                } else {
                    StateBytes {
                        params: 2.0 + 4.0 / d,
                        grads: 4.0 + 4.0 / d,
                        optimizer: 8.0 / d,
                    }
                }
            }
        }
    }

    /// [`Sharding::state_bytes`] on pipeline rank 0 of `pp` x `dp` on `hw`, its shard degree
    /// from [`DpGroup::of`] (the same on every pipeline rank when `pp` divides the GPUs per
    /// node).
    pub fn state_bytes_on(self, hw: &Hardware, pp: u32, dp: u32) -> StateBytes {
        self.state_bytes(pp, DpGroup::of(self, hw, pp, dp, 0).shard)
    }

    /// Bytes a rank holds only while a layer is computed, resharded right after, for a rank
    /// whose largest layer has `largest_layer_params` parameters: with per-microbatch resharding
    /// the layer being computed and the next, prefetched (bf16, 2 + 2 bytes), its bf16
    /// gradients (2) and their fp32 copy for the reduce-scatter (4); 0 otherwise (the unsharded
    /// state is then in [`Sharding::state_bytes`]).
    pub fn transient_bytes(self, pp: u32, largest_layer_params: f64) -> f64 {
        if self.per_microbatch(pp) {
            10.0 * largest_layer_params
        } else {
            0.0
        }
    }

    /// The flag value (`ddp`, `zero1`, `zero2`, `fsdp`, `fsdp-mb`, `hsdp`).
    pub fn name(self) -> &'static str {
        match self {
            Sharding::Ddp => "ddp",
            Sharding::Zero1 => "zero1",
            Sharding::Zero2 => "zero2",
            Sharding::Fsdp => "fsdp",
            Sharding::FsdpPerMicrobatch => "fsdp-mb",
            Sharding::Hsdp => "hsdp",
        }
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Sharding {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Sharding::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                Error::invalid(
                    "sharding",
                    s,
                    "one of ddp, zero1, zero2, fsdp, fsdp-mb, hsdp",
                )
            })
    }
}

/// Bytes per parameter kept for the whole step, split as memory reports show it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StateBytes {
    /// Weights (unsharded compute copy and sharded master, where the mode has them).
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state (master weights where separate, AdamW's moments).
    pub optimizer: f64,
}

impl Default for StateBytes {
    /// The ZeRO paper's unsharded mixed-precision AdamW: bf16 weights (2), bf16 gradients (2),
    /// fp32 master weights and moments (12) (Rajbhandari et al. 2020, §3.1).
    fn default() -> Self {
        StateBytes {
            params: 2.0,
            grads: 2.0,
            optimizer: 12.0,
        }
    }
}

impl StateBytes {
    /// Total bytes per parameter.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// The data-parallel group of one pipeline rank as a mode uses it.
#[derive(Debug, Clone, PartialEq)]
pub struct DpGroup {
    /// Ranks the sharded state is split over (`d`; 1 for `ddp`).
    pub shard: u32,
    /// The link of the shard group (or of the whole group for `ddp`).
    pub shard_link: Link,
    /// Groups holding the same shard (`hsdp`: the nodes), and their link; 1 otherwise.
    pub replicate: u32,
    /// The link across replicate groups.
    pub replicate_link: Link,
}

impl DpGroup {
    /// The data-parallel group of pipeline rank `r` of `pp`, over `dp` replicas on `hw`: replica
    /// d's pipeline rank r is global rank `r * dp + d` ([`global_rank`]), `gpus_per_node`
    /// consecutive global ranks per node.
    ///
    /// `hsdp` shards over the replicas of rank r in its node, `gcd(dp, replicas in the node)`,
    /// and replicates across nodes; the other modes shard over all `dp` replicas (1 for `ddp`).
    pub fn of(sharding: Sharding, hw: &Hardware, pp: u32, dp: u32, r: u32) -> DpGroup {
        let g = hw.gpus_per_node.max(1) as usize;
        let (_pp, dp, r) = (pp.max(1) as usize, dp.max(1) as usize, r as usize);
        let node = |d: usize| global_rank(r, d, dp) / g;
        let in_node = (0..dp).take_while(|&d| node(d) == node(0)).count() as u64;
        let dp = dp as u64;
        let whole_link = if (0..dp as usize).all(|d| node(d) == node(0)) {
            hw.intra_node.clone()
        } else {
            hw.inter_node.clone()
        };
        match sharding {
            Sharding::Hsdp => {
                let shard = gcd(dp, in_node.max(1));
                DpGroup {
                    shard: shard as u32,
                    shard_link: if shard > 1 || dp == 1 {
                        hw.intra_node.clone()
                    } else {
                        whole_link.clone()
                    },
                    replicate: (dp / shard) as u32,
                    replicate_link: hw.inter_node.clone(),
                }
            }
            Sharding::Ddp => DpGroup {
                shard: 1,
                shard_link: whole_link.clone(),
                replicate: dp as u32,
                replicate_link: whole_link,
            },
            _ => DpGroup {
                shard: dp as u32,
                shard_link: whole_link.clone(),
                replicate: 1,
                replicate_link: whole_link,
            },
        }
    }
}

/// The global rank of replica `replica`'s pipeline rank `r` among `dp` replicas: `r * dp +
/// replica`, Megatron-LM's order (`tp-cp-ep-dp-pp`: data-parallel ranks adjacent, pipeline
/// ranks outermost; `megatron/core/parallel_state.py`, `RankGenerator`), with a rank here being
/// one tensor-parallel group (see `flatpipe_profiles::Profile::tensor_parallel`). Ranks
/// `gpus_per_node` apart share no node.
pub fn global_rank(r: usize, replica: usize, dp: usize) -> usize {
    r * dp.max(1) + replica
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Ring all-reduce of `bytes` over `n` ranks: `2 (n - 1) (alpha + bytes / (n beta))`, seconds
/// (Patarasuk and Yuan 2009); 0 for `n <= 1`.
pub fn all_reduce_s(link: &Link, n: u32, bytes: f64) -> f64 {
    2.0 * reduce_scatter_s(link, n, bytes)
}

/// Ring reduce-scatter of `bytes` (the unsharded size) over `n` ranks: `(n - 1) (alpha + bytes
/// / (n beta))`, seconds (Thakur, Rabenseifner and Gropp 2005); 0 for `n <= 1`. An all-gather
/// costs the same ([`all_gather_s`]).
pub fn reduce_scatter_s(link: &Link, n: u32, bytes: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n = f64::from(n);
    (n - 1.0) * (link.alpha_s + bytes / (n * link.beta_bytes_per_s))
}

/// Ring all-gather to `bytes` (the unsharded size) over `n` ranks, seconds: as
/// [`reduce_scatter_s`].
pub fn all_gather_s(link: &Link, n: u32, bytes: f64) -> f64 {
    reduce_scatter_s(link, n, bytes)
}

/// The exposed part of `comm_s` prefetched layer by layer against `compute_s` over `layers`
/// layers: one layer's share cannot overlap, the rest overlaps the compute of the neighbouring
/// layer, `comm / L + (L - 1) / L * max(0, comm - compute)`, seconds. With uniform layers this is
/// exactly `g + (L - 1) max(c, g) + c - L c` for per-layer compute `c` and communication `g`.
pub fn exposed_s(compute_s: f64, comm_s: f64, layers: usize) -> f64 {
    if comm_s <= 0.0 {
        return 0.0;
    }
    let l = layers.max(1) as f64;
    comm_s / l + (l - 1.0) / l * (comm_s - compute_s).max(0.0)
}

/// One pipeline rank's per-step data-parallel collectives, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepCollectives {
    /// Before the rank's first forward (FSDP under PP: the all-gather of its weights); it
    /// overlaps the time the rank waits for its first input.
    pub before_first_forward_s: f64,
    /// After the rank's last compute: the gradient reduction (all-reduce, reduce-scatter, or
    /// HSDP's reduce-scatter then all-reduce across nodes).
    pub gradient_reduction_s: f64,
    /// After the optimizer: the all-gather of the updated weights (ZeRO-1/2).
    pub after_optimizer_s: f64,
}

impl StepCollectives {
    /// Rank `r`'s per-step collectives for `params` parameters (its stages' sum).
    pub fn of(sharding: Sharding, hw: &Hardware, pp: u32, dp: u32, r: u32, params: f64) -> Self {
        if dp <= 1 {
            return StepCollectives::default();
        }
        let g = DpGroup::of(sharding, hw, pp, dp, r);
        match sharding {
            Sharding::Ddp => StepCollectives {
                gradient_reduction_s: all_reduce_s(&g.shard_link, g.replicate, 4.0 * params),
                ..Default::default()
            },
            Sharding::Zero1 => StepCollectives {
                gradient_reduction_s: reduce_scatter_s(&g.shard_link, g.shard, 4.0 * params),
                after_optimizer_s: all_gather_s(&g.shard_link, g.shard, 2.0 * params),
                ..Default::default()
            },
            Sharding::Zero2 => StepCollectives {
                after_optimizer_s: all_gather_s(&g.shard_link, g.shard, 2.0 * params),
                ..Default::default()
            },
            Sharding::Fsdp | Sharding::Hsdp | Sharding::FsdpPerMicrobatch => {
                let across = all_reduce_s(
                    &g.replicate_link,
                    g.replicate,
                    4.0 * params / f64::from(g.shard),
                );
                if sharding.per_microbatch(pp) {
                    // Reduce-scatters ran per microbatch; HSDP's cross-node all-reduce of the
                    // accumulated shard stays per step.
                    StepCollectives {
                        gradient_reduction_s: across,
                        ..Default::default()
                    }
                } else {
                    StepCollectives {
                        before_first_forward_s: all_gather_s(&g.shard_link, g.shard, 2.0 * params),
                        gradient_reduction_s: reduce_scatter_s(
                            &g.shard_link,
                            g.shard,
                            4.0 * params,
                        ) + across,
                        after_optimizer_s: 0.0,
                    }
                }
            }
        }
    }
}

/// One stage's data-parallel collectives as actions on its rank's collective stream, in
/// PyTorch 2.15's runtime's per-stage `UNSHARD` and `REDUCE_GRAD` slots
/// ([`crate::ir::lowering::fsdp_programs`]), seconds: FSDP2 (`fully_shard`,
/// `reshard_after_forward=False` under PP) gathers the stage's weights at `UNSHARD` and
/// reduce-scatters its gradients at `REDUCE_GRAD`; DDP all-reduces the gradients, and ZeRO-1
/// (Megatron's distributed optimizer) reduce-scatters them, both after the stage's last
/// backward, where `REDUCE_GRAD` stands (ZeRO-1's all-gather of the updated weights follows the
/// optimizer and stays in the step's tail).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageCollectives {
    /// `UNSHARD`: the ring all-gather of the stage's bf16 weights (2 bytes per parameter) over
    /// the shard group (FSDP and HSDP; 0 for the others).
    pub all_gather_s: f64,
    /// `REDUCE_GRAD`: the gradient reduction of the stage's fp32 gradients (4 bytes per
    /// parameter): FSDP's ring reduce-scatter over the shard group (under `hsdp` then the
    /// all-reduce of the shard across the nodes, as FSDP2 runs both in the stage's
    /// post-backward reduction), DDP's ring all-reduce, ZeRO-1's ring reduce-scatter.
    pub reduce_grad_s: f64,
}

impl StageCollectives {
    /// Whether `sharding` on `pp` pipeline ranks runs collectives per stage and step (all but
    /// `zero2` and the per-microbatch modes).
    pub fn runs(sharding: Sharding, pp: u32) -> bool {
        !matches!(sharding, Sharding::Zero2) && !sharding.per_microbatch(pp)
    }

    /// The collectives of a stage of `params` parameters on pipeline rank `r` of `pp`, over
    /// `dp` replicas on `hw`; `None` where `sharding` runs none per stage and step (`zero2`
    /// and the per-microbatch modes: `fsdp-mb`, `fsdp` / `hsdp` at pp 1).
    pub fn of(
        sharding: Sharding,
        hw: &Hardware,
        pp: u32,
        dp: u32,
        r: u32,
        params: f64,
    ) -> Option<Self> {
        if !Self::runs(sharding, pp) {
            return None;
        }
        let g = DpGroup::of(sharding, hw, pp, dp, r);
        let grads = 4.0 * params;
        Some(match sharding {
            Sharding::Ddp => StageCollectives {
                all_gather_s: 0.0,
                reduce_grad_s: all_reduce_s(&g.shard_link, g.replicate, grads),
            },
            Sharding::Zero1 => StageCollectives {
                all_gather_s: 0.0,
                reduce_grad_s: reduce_scatter_s(&g.shard_link, g.shard, grads),
            },
            _ => StageCollectives {
                all_gather_s: all_gather_s(&g.shard_link, g.shard, 2.0 * params),
                reduce_grad_s: reduce_scatter_s(&g.shard_link, g.shard, grads)
                    + all_reduce_s(&g.replicate_link, g.replicate, grads / f64::from(g.shard)),
            },
        })
    }
}

/// One stage's per-microbatch collectives (before overlap), seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct MicrobatchCollectives {
    /// All-gather of the stage's weights before each forward.
    pub before_forward_s: f64,
    /// All-gather of the stage's weights before each input-gradient pass (I, or B).
    pub before_backward_s: f64,
    /// Reduce-scatter of the stage's gradients after each weight-gradient pass (W, or B).
    pub after_backward_s: f64,
}

impl MicrobatchCollectives {
    /// The per-microbatch collectives of a stage with `params` parameters on pipeline rank `r`.
    pub fn of(sharding: Sharding, hw: &Hardware, pp: u32, dp: u32, r: u32, params: f64) -> Self {
        if dp <= 1 {
            return MicrobatchCollectives::default();
        }
        let g = DpGroup::of(sharding, hw, pp, dp, r);
        match sharding {
            Sharding::Zero2 => MicrobatchCollectives {
                after_backward_s: reduce_scatter_s(&g.shard_link, g.shard, 2.0 * params),
                ..Default::default()
            },
            s if s.per_microbatch(pp) => {
                let gather = all_gather_s(&g.shard_link, g.shard, 2.0 * params);
                MicrobatchCollectives {
                    before_forward_s: gather,
                    before_backward_s: gather,
                    after_backward_s: reduce_scatter_s(&g.shard_link, g.shard, 4.0 * params),
                }
            }
            _ => MicrobatchCollectives::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hw(g: u32) -> Hardware {
        let mut h = flatpipe_profiles::builtins::hardware("h200").unwrap();
        h.gpus_per_node = g;
        h
    }

    #[test]
    fn names_round_trip() {
        for m in Sharding::ALL {
            assert_eq!(m.name().parse::<Sharding>().unwrap(), m);
        }
        let e = "zero4".parse::<Sharding>().unwrap_err().to_string();
        assert!(e.contains("zero4") && e.contains("fsdp-mb"), "{e}");
    }

    #[test]
    fn megatron_distributed_optimizer_is_6_plus_12_over_d() {
        for d in [1, 2, 8] {
            let b = Sharding::Zero1.state_bytes(2, d);
            assert_eq!(b.total(), 6.0 + 12.0 / d as f64);
        }
        // Unsharded Megatron bf16 is 18 bytes: ZeRO-1 at d = 1, and DDP.
        assert_eq!(Sharding::Zero1.state_bytes(1, 1).total(), 18.0);
        assert_eq!(Sharding::Ddp.state_bytes(2, 8).total(), 18.0);
        // FSDP2 under PP: 6 unsharded (bf16 weights, fp32 accumulated gradients) + 16/d.
        assert_eq!(Sharding::Fsdp.state_bytes(2, 8).total(), 6.0 + 2.0);
        assert_eq!(Sharding::Fsdp.state_bytes(1, 8).total(), 2.0);
    }

    #[test]
    fn hsdp_shards_within_a_node() {
        // 8 GPUs per node, Megatron's order (replicas adjacent): pp = 2 x dp = 8 puts each
        // pipeline rank's 8 replicas in one node, so HSDP is FSDP there.
        let g = DpGroup::of(Sharding::Hsdp, &hw(8), 2, 8, 1);
        assert_eq!((g.shard, g.replicate), (8, 1));
        assert_eq!(g.shard_link, hw(8).intra_node);
        // pp = 2 x dp = 16 on 4 nodes: pipeline rank 1 is global ranks 16..32, two nodes: shard
        // over a node's 8, 2 copies across nodes.
        let g = DpGroup::of(Sharding::Hsdp, &hw(8), 2, 16, 1);
        assert_eq!((g.shard, g.replicate), (8, 2));
        assert_eq!(g.shard_link, hw(8).intra_node);
        assert_eq!(g.replicate_link, hw(8).inter_node);
        // FSDP over the same 16 replicas crosses nodes.
        let g = DpGroup::of(Sharding::Fsdp, &hw(8), 2, 16, 1);
        assert_eq!((g.shard, g.replicate), (16, 1));
        assert_eq!(g.shard_link, hw(8).inter_node);
        assert_eq!(global_rank(1, 3, 16), 19);
    }

    #[test]
    fn exposed_matches_the_layer_by_layer_timeline() {
        // L layers of compute c, communication g per layer, prefetched one layer ahead.
        for (c, g, l) in [
            (1.0, 0.5, 4usize),
            (1.0, 3.0, 4),
            (2.0, 2.0, 1),
            (0.0, 1.0, 3),
        ] {
            let timeline = g + (l as f64 - 1.0) * f64::max(c, g) + c;
            let want = timeline - l as f64 * c;
            let got = exposed_s(l as f64 * c, l as f64 * g, l);
            assert!((got - want).abs() < 1e-12, "{c} {g} {l}: {got} vs {want}");
        }
    }
}
