//! Cost profiles: per-layer cost coefficients, memory, links and provenance.

use crate::{Error, Hardware, LayerKind, Link, Result, yaml};
use serde::{Deserialize, Serialize};

/// A compute phase of one layer for one microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Forward, saving activations for the backward.
    F,
    /// Backward for inputs (dgrad; the Zero Bubble paper's "B").
    I,
    /// Backward for weights (wgrad).
    W,
    /// Forward-only (reference / teacher model): no activations kept.
    Fo,
}

/// Coefficients of `t = c0_s + c_tok_s * tokens + c_attn_s * attn_pairs` (seconds), where
/// `tokens` is a microbatch's true token count and `attn_pairs = Σ s_i (s_i + 1) / 2` the
/// query-key pairs its causal attention computes. All coefficients are >= 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CostCoeffs {
    /// Fixed cost per call (kernel launches, synchronisation), seconds.
    pub c0_s: f64,
    /// Cost per token, seconds.
    pub c_tok_s: f64,
    /// Cost per causal attention query-key pair, seconds.
    #[serde(default)]
    pub c_attn_s: f64,
}

impl CostCoeffs {
    /// Whether every coefficient is 0.
    pub fn is_zero(&self) -> bool {
        *self == CostCoeffs::default()
    }

    /// Predicted time in seconds for a microbatch of `tokens` tokens and `attn_pairs` pairs.
    pub fn time_s(&self, tokens: f64, attn_pairs: f64) -> f64 {
        self.c0_s + self.c_tok_s * tokens + self.c_attn_s * attn_pairs
    }

    fn validate(&self, origin: &str, field: &str) -> Result<()> {
        for (name, v) in [
            ("c0_s", self.c0_s),
            ("c_tok_s", self.c_tok_s),
            ("c_attn_s", self.c_attn_s),
        ] {
            Error::check_seconds(origin, format!("{field}.{name}"), v)?;
        }
        Ok(())
    }
}

/// Costs of one layer of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    /// Module name (torchtitan's: `tok_embeddings`, `layers.N`, `output`).
    pub name: String,
    /// Layer kind.
    pub kind: LayerKind,
    /// Forward.
    pub f: CostCoeffs,
    /// Backward for inputs (dgrad).
    pub i: CostCoeffs,
    /// Backward for weights (wgrad).
    pub w: CostCoeffs,
    /// Forward-only (no saved activations).
    pub fo: CostCoeffs,
    /// Fused backward (input and weight gradients in one pass, the action `B`), where
    /// measured; absent, a `B` costs `I + W` ([`LayerProfile::fused_backward_s`]). Frameworks
    /// differ here: in PyTorch one autograd pass costs less than `stage_backward_input` plus
    /// `stage_backward_weight` (`torch/distributed/pipelining/_backward.py`), which walk the
    /// graph twice and each pay a fixed cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub b: Option<CostCoeffs>,
    /// Activation bytes per token kept from F until I and freed by I (needed only by dgrad).
    pub act_bytes_per_token_i: f64,
    /// Activation bytes per token kept from F until W and freed by W (the GEMM inputs wgrad needs).
    pub act_bytes_per_token_w: f64,
    /// Bytes per token of this layer's output (what a stage boundary after it transfers).
    pub output_bytes_per_token: f64,
    /// Model FLOPs of one training token through this layer (F + I + W; the MFU convention:
    /// 6 x matmul parameters, PaLM, Chowdhery et al. 2022, appendix B). 0 if unknown.
    #[serde(default)]
    pub model_flops_per_token: f64,
    /// Model FLOPs of one causal attention query-key pair in training (F + I + W: `12 h`,
    /// Narayanan et al. 2021, eq. 3, without recomputation). 0 if unknown.
    #[serde(default)]
    pub model_flops_per_attn_pair: f64,
    /// Number of parameters.
    pub param_count: u64,
    /// Bytes of the parameters in the model's dtype.
    pub param_bytes: u64,
    /// The layer's shape where known (0: unknown), which tensor parallelism splits
    /// ([`Profile::tensor_parallel`]).
    #[serde(default, skip_serializing_if = "LayerShape::is_unknown")]
    pub shape: LayerShape,
    /// Of a mixture-of-experts layer's `f`, `i` and `w`, the part that runs on the tokens its
    /// router sends to this GPU's experts (their GEMMs, and with expert parallelism the
    /// all-to-alls): what a GPU that receives more than the mean share runs longer. The
    /// forward-only pass pays as `f`, a fused backward as `i + w`. Absent for other layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed: Option<RoutedCosts>,
}

/// The routed part of a mixture-of-experts layer's costs ([`LayerProfile::routed`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutedCosts {
    /// Of the forward.
    pub f: CostCoeffs,
    /// Of the input-gradient pass.
    pub i: CostCoeffs,
    /// Of the weight-gradient pass.
    pub w: CostCoeffs,
    /// Of `f` and of `i` each, the all-to-alls (a dispatch and a combine) expert parallelism
    /// adds: what a schedule that overlaps a forward with a backward (DualPipe's pairs) can hide
    /// under the other chunk's compute. Zero without expert parallelism.
    #[serde(default, skip_serializing_if = "CostCoeffs::is_zero")]
    pub all_to_all: CostCoeffs,
}

/// What tensor parallelism needs of a layer's shape (0 where unknown or not applicable).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerShape {
    /// Hidden size H.
    #[serde(default)]
    pub hidden: u64,
    /// Query heads (decoders).
    #[serde(default)]
    pub heads: u64,
    /// Key-value heads (decoders).
    #[serde(default)]
    pub kv_heads: u64,
    /// Vocabulary size (embedding and head).
    #[serde(default)]
    pub vocab: u64,
    /// Routed experts of a mixture-of-experts decoder (0: a dense MLP).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub experts: u64,
    /// Experts each token is routed to.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub top_k: u64,
    /// Of `param_count`, the routed experts' weights this GPU holds (what expert parallelism
    /// divides: [`Profile::expert_parallel`]).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub expert_params: u64,
    /// Node-limited routing's nodes per token (0: no limit; [`crate::Moe::max_nodes`]).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub max_nodes: u64,
    /// The dispatch all-to-all moves FP8 with its scales ([`crate::Moe::fp8_dispatch`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp8_dispatch: bool,
    /// A multi-token-prediction module after the main model ([`crate::Layer::mtp`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mtp: bool,
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

fn is_one_u32(x: &u32) -> bool {
    *x == 1
}

fn one_u32() -> u32 {
    1
}

impl LayerShape {
    /// Whether nothing is known.
    pub fn is_unknown(&self) -> bool {
        *self == LayerShape::default()
    }
}

impl LayerProfile {
    /// The coefficients of one phase.
    pub fn coeffs(&self, phase: Phase) -> &CostCoeffs {
        match phase {
            Phase::F => &self.f,
            Phase::I => &self.i,
            Phase::W => &self.w,
            Phase::Fo => &self.fo,
        }
    }

    /// Seconds of a fused backward `B` on a microbatch of `tokens` tokens and `attn_pairs`
    /// pairs: the measured [`LayerProfile::b`] where present, else `I + W`.
    pub fn fused_backward_s(&self, tokens: f64, attn_pairs: f64) -> f64 {
        match &self.b {
            Some(b) => b.time_s(tokens, attn_pairs),
            None => self.i.time_s(tokens, attn_pairs) + self.w.time_s(tokens, attn_pairs),
        }
    }
}

/// Where a profile's numbers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfileSource {
    /// Derived from FLOP counts and datasheet peaks ([`crate::analytic_profile`]).
    Analytic,
    /// Measured by the profiler on a real device.
    Measured,
}

/// Provenance of a profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    /// Analytic or measured.
    pub source: ProfileSource,
    /// The device the numbers describe.
    pub device: String,
    /// When it was measured (ISO 8601 date); `None` for deterministic analytic profiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    /// flatpipe version that produced it.
    pub flatpipe_version: String,
    /// Free-form notes: assumptions, efficiency factors, fit quality.
    #[serde(default)]
    pub notes: String,
    /// Measured profiles: the grid the profiler timed (token counts, compositions, rounds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grid: Option<String>,
    /// Measured profiles: timed rounds per grid point (the median is kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetitions: Option<u32>,
    /// Measured profiles: how well each fitted cost model matches its timings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fits: Vec<FitQuality>,
    /// Measured profiles: threads (CPU) or streams (CUDA) kept busy at once while measuring,
    /// as the ranks of a run contend for cores and memory bandwidth. `None` in profiles written
    /// before flatpipe recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

/// The quality of one fitted cost model (one layer kind and phase) of a measured profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FitQuality {
    /// Layer kind.
    pub kind: LayerKind,
    /// Phase: F, I, W or Fo.
    pub phase: Phase,
    /// Coefficient of determination R² on the timings.
    pub r2: f64,
    /// Largest `|predicted - measured| / measured` over the grid.
    pub max_rel_residual: f64,
    /// Grid points fitted.
    pub samples: u32,
}

/// A cost profile of one model on one hardware (YAML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Model name.
    pub model: String,
    /// Hardware description (devices, memory and links).
    pub hardware: Hardware,
    /// Per layer, in model order (embedding first, head last).
    pub layers: Vec<LayerProfile>,
    /// Optimizer-step time per parameter on one rank, seconds (it ends the step).
    pub optimizer_s_per_param: f64,
    /// Where the numbers come from.
    pub provenance: Provenance,
    /// The GEMM throughput of one GPU of a tensor-parallel group relative to the unsplit
    /// layer's, per group size, where measured (`flatpipe profile` times the layer's GEMMs split
    /// as Megatron splits them); [`Profile::tensor_parallel`] applies it. Empty: not measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gemm_split: Vec<GemmSplit>,
    /// Fixed seconds per action of the runtime that runs the schedule, paid once by every
    /// stage action whatever the number of layers it holds. Zero where the layers' own fixed
    /// costs (`c0_s`) hold it all (flatpipe's executors); measured for flatpipe's PyTorch
    /// runtime, where each action is a Python call into autograd (`flatpipe.fit`).
    #[serde(default, skip_serializing_if = "ActionOverhead::is_zero")]
    pub action_overhead: ActionOverhead,
    /// Whether the runtime skips the first stage's input-gradient pass (its input, token ids,
    /// needs no gradient) and runs the stage's whole backward in its W. PyTorch's pipelining
    /// runtime does (`torch/distributed/pipelining/stage.py`, `backward_one_chunk`: "Skip the
    /// backward for the first stage since we will perform the weight update with
    /// autograd.backward in backward_weight_one_chunk"), and so does `flatpipe.torch`. Then the
    /// first stage's I costs nothing and its W what a fused B costs. flatpipe's executors run
    /// the first stage's I and W as the other stages' (false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub first_stage_backward_in_w: bool,
    /// The expert-parallel degree this profile is one GPU of ([`Profile::expert_parallel`]):
    /// its routed experts' optimizer state shards over `dp / expert_parallel` replicas, not
    /// `dp`. 1 without expert parallelism.
    #[serde(default = "one_u32", skip_serializing_if = "is_one_u32")]
    pub expert_parallel: u32,
    /// The tensor-parallel degree this profile is one GPU of ([`Profile::tensor_parallel`]):
    /// its decoders' `shape.heads` and `kv_heads` are already divided by it, `shape.hidden` is
    /// the model's. 1 without tensor parallelism.
    #[serde(default = "one_u32", skip_serializing_if = "is_one_u32")]
    pub tensor_parallel: u32,
    /// The routed experts' GEMM throughput on one GPU of an expert-parallel group relative to
    /// one GPU without expert parallelism, per group size: with `ep` GPUs each runs `E / ep`
    /// experts on `ep` times taller batches (every GPU's tokens for them), the same FLOPs at
    /// the GEMM curve's better rate. [`Profile::expert_parallel`] applies it. Empty: not known
    /// (a flat GEMM rate, or a profile without routed experts).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expert_batching: Vec<ExpertBatching>,
}

/// The routed experts' GEMM throughput at one expert-parallel degree ([`Profile::expert_batching`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertBatching {
    /// Expert-parallel group size, >= 2.
    pub ep: u32,
    /// `(FLOPs / time)` of the experts' GEMMs (forward, dgrad and wgrad) on one GPU of the
    /// group over that without expert parallelism, > 0 (above 1: taller batches run faster).
    pub relative_throughput: f64,
    /// Tokens per GPU `T` it was priced at.
    pub tokens: u64,
}

/// Fixed seconds per stage action, by action kind (a forward-only `Fo` pays `f_s`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionOverhead {
    /// Per forward, seconds.
    #[serde(default)]
    pub f_s: f64,
    /// Per input-gradient pass, seconds.
    #[serde(default)]
    pub i_s: f64,
    /// Per weight-gradient pass, seconds.
    #[serde(default)]
    pub w_s: f64,
    /// Per fused backward, seconds (used where the stage's layers have a measured fused
    /// cost; otherwise a `B` pays `i_s + w_s`, as its `I` and `W` would).
    #[serde(default)]
    pub b_s: f64,
}

impl ActionOverhead {
    /// Whether every overhead is 0.
    pub fn is_zero(&self) -> bool {
        *self == ActionOverhead::default()
    }
}

/// The GEMM efficiency of narrower matrices: what one GPU of a tensor-parallel group of `tp`
/// achieves on its share of a decoder layer's GEMMs, relative to the whole layer's GEMMs on
/// one GPU. Megatron splits the Q/K/V and gate/up projections by columns (`n / tp`) and the
/// output and down projections by rows (`k / tp`; Shoeybi et al. 2019, §3); the smaller
/// matrices fill fewer of the device's tiles and waves, so they run at a lower FLOP rate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmSplit {
    /// Tensor-parallel group size, >= 2.
    pub tp: u32,
    /// `(FLOPs / time)` of the split GEMMs over that of the unsplit ones, in (0, 2]
    /// (1.0: no loss; above 1 where the smaller matrices fit a cache better).
    pub relative_throughput: f64,
    /// Tokens `T` (the GEMMs' `m`) of the measurement.
    pub tokens: u64,
}

/// The R² below which a fitted cost model is called poor ([`Profile::poor_fits`]): a fit that
/// explains less than 95% of its timings' variance predicts a step's time to within its
/// residuals at best.
pub const MIN_FIT_R2: f64 = 0.95;

impl Profile {
    /// The fits with R² below [`MIN_FIT_R2`] of the layer kinds that weigh in a step: those
    /// whose layers take at least 5% of the model's forward time at 1,024 tokens in one
    /// sequence (an embedding's microseconds are noise whatever its fit).
    pub fn poor_fits(&self) -> Vec<&FitQuality> {
        let (t, pairs) = (1024.0, 1024.0 * 1025.0 / 2.0);
        let time = |kind: LayerKind| -> f64 {
            self.layers
                .iter()
                .filter(|l| l.kind == kind)
                .map(|l| l.f.time_s(t, pairs))
                .sum()
        };
        let total: f64 = self.layers.iter().map(|l| l.f.time_s(t, pairs)).sum();
        self.provenance
            .fits
            .iter()
            .filter(|f| f.r2 < MIN_FIT_R2 && total > 0.0 && time(f.kind) >= 0.05 * total)
            .collect()
    }

    /// Parses and validates a profile file's text. `origin` names the file in errors.
    ///
    /// # Errors
    /// [`Error::Yaml`] or [`Error::Invalid`] naming the field.
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        let p: Profile = yaml::parse(text, origin)?;
        p.validate(origin)?;
        Ok(p)
    }

    /// The profile as YAML text.
    ///
    /// # Errors
    /// [`Error::Yaml`] if serialization fails.
    pub fn to_yaml(&self) -> Result<String> {
        yaml::to_yaml(self, &self.model)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field, its value and the allowed range.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if self.expert_parallel == 0 {
            return Err(Error::invalid(origin, "expert_parallel", 0, ">= 1"));
        }
        if self.tensor_parallel == 0 {
            return Err(Error::invalid(origin, "tensor_parallel", 0, ">= 1"));
        }
        self.hardware.validate(origin)?;
        if self.layers.len() < 2 {
            return Err(Error::invalid(
                origin,
                "layers",
                self.layers.len(),
                "at least 2 layers (embedding and head)",
            ));
        }
        for (i, l) in self.layers.iter().enumerate() {
            for (name, c) in [("f", &l.f), ("i", &l.i), ("w", &l.w), ("fo", &l.fo)] {
                c.validate(origin, &format!("layers[{i}].{name}"))?;
            }
            if let Some(b) = &l.b {
                b.validate(origin, &format!("layers[{i}].b"))?;
            }
            for (name, v) in [
                ("act_bytes_per_token_i", l.act_bytes_per_token_i),
                ("act_bytes_per_token_w", l.act_bytes_per_token_w),
                ("output_bytes_per_token", l.output_bytes_per_token),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(Error::invalid(
                        origin,
                        format!("layers[{i}].{name}"),
                        v,
                        "a finite number of bytes >= 0",
                    ));
                }
            }
        }
        for (i, g) in self.gemm_split.iter().enumerate() {
            if g.tp < 2 {
                return Err(Error::invalid(
                    origin,
                    format!("gemm_split[{i}].tp"),
                    g.tp,
                    "a tensor-parallel group size >= 2",
                ));
            }
            let r = g.relative_throughput;
            if !(r.is_finite() && r > 0.0 && r <= 2.0) {
                return Err(Error::invalid(
                    origin,
                    format!("gemm_split[{i}].relative_throughput"),
                    r,
                    "a ratio in (0, 2]",
                ));
            }
        }
        let ao = &self.action_overhead;
        for (name, v) in [
            ("f_s", ao.f_s),
            ("i_s", ao.i_s),
            ("w_s", ao.w_s),
            ("b_s", ao.b_s),
        ] {
            Error::check_seconds(origin, format!("action_overhead.{name}"), v)?;
        }
        let o = self.optimizer_s_per_param;
        if !(o.is_finite() && o >= 0.0) {
            return Err(Error::invalid(
                origin,
                "optimizer_s_per_param",
                o,
                "a finite number of seconds >= 0",
            ));
        }
        Ok(())
    }

    /// Model FLOPs of training `tokens` true tokens with `attn_pairs` true attention pairs
    /// through every layer. MFU is this over `step time x ranks x peak_flops`; callers pass
    /// true tokens and pairs, never padded ones.
    pub fn model_flops(&self, tokens: f64, attn_pairs: f64) -> f64 {
        self.layers
            .iter()
            .map(|l| l.model_flops_per_token * tokens + l.model_flops_per_attn_pair * attn_pairs)
            .sum()
    }

    /// The link between ranks `a` and `b` (intra-node iff they share a node).
    pub fn link(&self, a: usize, b: usize) -> &Link {
        let g = self.hardware.gpus_per_node as usize;
        if a / g == b / g {
            &self.hardware.intra_node
        } else {
            &self.hardware.inter_node
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Profile {
        let model = crate::builtins::model("tiny").unwrap();
        let hw = crate::builtins::hardware("cpu").unwrap();
        crate::analytic_profile(&model, &hw, &Default::default()).unwrap()
    }

    #[test]
    fn a_runtime_s_measurements_round_trip_and_bad_ones_are_named() {
        let mut p = tiny();
        // Absent from an analytic profile's YAML, so older profiles read the same.
        let text = p.to_yaml().unwrap();
        for field in [
            "post_s",
            "action_overhead",
            "first_stage_backward_in_w",
            "tensor_parallel",
            "\n    b:",
        ] {
            assert!(!text.contains(field), "{field} in {text}");
        }
        p.layers[1].b = Some(CostCoeffs {
            c0_s: 1e-4,
            c_tok_s: 2e-6,
            c_attn_s: 3e-9,
        });
        p.hardware.intra_node.post_s = 5e-4;
        p.action_overhead.i_s = 2e-3;
        p.first_stage_backward_in_w = true;
        let back = Profile::from_yaml(&p.to_yaml().unwrap(), "p.yaml").unwrap();
        assert_eq!(back, p);
        // I + W where no fused cost was measured, the fused cost where it was.
        let (t, a) = (100.0, 5050.0);
        let l = &p.layers[2];
        assert_eq!(
            l.fused_backward_s(t, a),
            l.i.time_s(t, a) + l.w.time_s(t, a)
        );
        assert!((p.layers[1].fused_backward_s(t, a) - (1e-4 + 2e-4 + 3e-9 * a)).abs() < 1e-15);
        type Spoil = fn(&mut Profile);
        let cases: [(&str, Spoil); 4] = [
            ("tensor_parallel", |p| p.tensor_parallel = 0),
            ("layers[1].b.c_tok_s", |p| {
                p.layers[1].b.as_mut().unwrap().c_tok_s = -1.0
            }),
            ("intra_node.post_s", |p| {
                p.hardware.intra_node.post_s = f64::NAN
            }),
            ("action_overhead.w_s", |p| p.action_overhead.w_s = -2.0),
        ];
        for (field, spoil) in cases {
            let mut bad = p.clone();
            spoil(&mut bad);
            let e = bad.validate("p.yaml").unwrap_err().to_string();
            assert!(e.contains("p.yaml") && e.contains(field), "{field}: {e}");
        }
    }
}
