//! `flatpipe._core`: the Python package's native module over the Rust core (PyO3).
//!
//! What Python gets: cost profiles ([`PyProfile`]), a pipeline configuration ([`PyPipeline`],
//! the Rust [`RunConfig`]) that plans each step from its sequence lengths into a
//! [`PyStepPlan`] (microbatches with `cu_seqlens` as numpy arrays, every rank's actions in
//! PyTorch's notation and as structured [`PyAction`]s whose parts say which stage each sends
//! to and receives from, the predicted timeline and memory), Monte Carlo simulation over a
//! workload, and the planner's search. Every Rust error becomes a `flatpipe.FlatpipeError`
//! carrying the Rust message. The torch.distributed runtime that executes a step plan is pure
//! Python (`flatpipe/torch.py`).

use flatpipe_planner::search::{self, RankBy, SearchConfig, SearchSpace};
use flatpipe_profiles::{
    AnalyticOptions, CostCoeffs, LayerKind, Profile, ProfileSource, analytic_profile, builtins,
};
use flatpipe_simulator::batching::microbatch::Microbatch;
use flatpipe_simulator::batching::policy::{Policy, PolicyParams};
use flatpipe_simulator::ir::{Action, ComputeAction, Placement, Rank, StageId};
use flatpipe_simulator::run::plan::{Plan, even_split};
use flatpipe_simulator::run::{
    config::RunConfig,
    step::{StepPlan, cut_step, plan_step},
};
use flatpipe_simulator::run::{
    config::{Capacity, ForwardOnlySpec, ScheduleSource, balance_cost, default_memory_limit},
    montecarlo::summarize,
    step::StepOutcome,
};
use flatpipe_simulator::schedules::forward_only::FoMode;
use flatpipe_simulator::schedules::generators::ScheduleKind;
use numpy::{PyArray1, ToPyArray};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::fmt::Display;
use std::ops::Range;
use std::sync::Arc;

create_exception!(
    _core,
    FlatpipeError,
    PyException,
    "An error from flatpipe's Rust core; the message names the file, field, value and allowed range."
);

fn err(e: impl Display) -> PyErr {
    FlatpipeError::new_err(e.to_string())
}

/// A cost profile: per layer and phase (F, I, W, Fo) `t = c0 + c_tok * tokens + c_attn * pairs`,
/// activation and parameter bytes, the hardware and its links.
#[pyclass(module = "flatpipe._core", name = "Profile", frozen)]
#[derive(Debug, Clone)]
pub struct PyProfile {
    inner: Arc<Profile>,
}

#[pymethods]
impl PyProfile {
    /// The analytic profile of `model` on `hardware` (built-in names or YAML files): FLOP counts
    /// over datasheet peaks (`profiles/src/analytic.rs` gives every formula).
    #[staticmethod]
    fn analytic(model: &str, hardware: &str) -> PyResult<Self> {
        let m = builtins::model(model).map_err(err)?;
        let hw = builtins::hardware(hardware).map_err(err)?;
        let p = analytic_profile(&m, &hw, &AnalyticOptions::default()).map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A profile file (YAML), as `flatpipe profile` writes it.
    #[staticmethod]
    fn load(path: &str) -> PyResult<Self> {
        let text = flatpipe_profiles::read_to_string(std::path::Path::new(path)).map_err(err)?;
        let p = Profile::from_yaml(&text, path).map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// The profile of one GPU of a Megatron-style tensor-parallel group of `tp` GPUs.
    #[pyo3(signature = (tp, sequence_parallel = true))]
    fn tensor_parallel(&self, tp: u32, sequence_parallel: bool) -> PyResult<Self> {
        let p = self
            .inner
            .tensor_parallel(tp, sequence_parallel)
            .map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy whose layers of `kind` (`"embedding"`, `"decoder"`, `"head"`) cost
    /// `c0_s + c_tok_s * tokens + c_attn_s * attn_pairs` seconds in `phase` (`"F"`, `"I"`,
    /// `"W"`, `"Fo"`, or `"B"`, a fused backward, which otherwise costs I + W): how a fit of measured timings becomes a profile. The copy is marked
    /// measured, with `note` added to its provenance.
    #[pyo3(signature = (kind, phase, c0_s, c_tok_s, c_attn_s = 0.0, note = ""))]
    fn with_costs(
        &self,
        kind: &str,
        phase: &str,
        c0_s: f64,
        c_tok_s: f64,
        c_attn_s: f64,
        note: &str,
    ) -> PyResult<Self> {
        let kind = match kind {
            "embedding" => LayerKind::Embedding,
            "decoder" => LayerKind::Decoder,
            "head" => LayerKind::Head,
            other => {
                return Err(err(format!(
                    "kind = {other:?} is invalid: \"embedding\", \"decoder\" or \"head\""
                )));
            }
        };
        let coeffs = CostCoeffs {
            c0_s,
            c_tok_s,
            c_attn_s,
        };
        for (name, v) in [("c0_s", c0_s), ("c_tok_s", c_tok_s), ("c_attn_s", c_attn_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(err(format!(
                    "{name} = {v} is invalid: a finite number of seconds >= 0"
                )));
            }
        }
        let mut p = (*self.inner).clone();
        let mut found = false;
        for l in p.layers.iter_mut().filter(|l| l.kind == kind) {
            found = true;
            match phase {
                "F" => l.f = coeffs,
                "I" => l.i = coeffs,
                "W" => l.w = coeffs,
                "Fo" => l.fo = coeffs,
                "B" => l.b = Some(coeffs),
                other => {
                    return Err(err(format!(
                        "phase = {other:?} is invalid: \"F\", \"I\", \"W\", \"Fo\" or \"B\""
                    )));
                }
            }
        }
        if !found {
            return Err(err(format!(
                "the profile of {} has no {kind:?} layer",
                p.model
            )));
        }
        p.provenance.source = ProfileSource::Measured;
        if !note.is_empty() && !p.provenance.notes.contains(note) {
            p.provenance.notes = format!("{}; {note}", p.provenance.notes);
        }
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy with the link between ranks (both intra- and inter-node) set to
    /// `alpha_s + bytes / beta_bytes_per_s`, each message costing its sender and its receiver
    /// `post_s` seconds of CPU time to post (LogP's `o`), and the optimizer step to
    /// `optimizer_s_per_param` seconds per parameter.
    #[pyo3(signature = (alpha_s, beta_bytes_per_s, optimizer_s_per_param = 0.0, post_s = 0.0))]
    fn with_link(
        &self,
        alpha_s: f64,
        beta_bytes_per_s: f64,
        optimizer_s_per_param: f64,
        post_s: f64,
    ) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        let link = flatpipe_profiles::Link {
            name: "measured".into(),
            alpha_s,
            beta_bytes_per_s,
            post_s,
        };
        p.hardware.intra_node = link.clone();
        p.hardware.inter_node = link;
        p.optimizer_s_per_param = optimizer_s_per_param;
        p.validate("Profile.with_link").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy whose links charge each message's sender and receiver `post_s` seconds of CPU
    /// time to post it (`Link::post_s`; 0 by default).
    fn with_post(&self, post_s: f64) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        p.hardware.intra_node.post_s = post_s;
        p.hardware.inter_node.post_s = post_s;
        p.validate("Profile.with_post").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy with a fixed cost per stage action of `f_s`, `i_s`, `w_s` and `b_s` seconds
    /// (F, I, W, fused B), whatever the layers the stage holds (`Profile::action_overhead`).
    /// With `first_stage_backward_in_w`, the first stage's I costs nothing and its W a fused
    /// backward, as in PyTorch's runtime and `flatpipe.torch`
    /// (`Profile::first_stage_backward_in_w`).
    #[pyo3(signature = (f_s, i_s, w_s, b_s = 0.0, first_stage_backward_in_w = false))]
    fn with_overhead(
        &self,
        f_s: f64,
        i_s: f64,
        w_s: f64,
        b_s: f64,
        first_stage_backward_in_w: bool,
    ) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        p.action_overhead = flatpipe_profiles::ActionOverhead { f_s, i_s, w_s, b_s };
        p.first_stage_backward_in_w = first_stage_backward_in_w;
        p.validate("Profile.with_overhead").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// The model's name.
    #[getter]
    fn model(&self) -> String {
        self.inner.model.clone()
    }

    /// The hardware's name.
    #[getter]
    fn hardware(&self) -> String {
        self.inner.hardware.name.clone()
    }

    /// Layers (embedding, decoders, head).
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.layers.len()
    }

    /// The profile as YAML text.
    fn to_yaml(&self) -> PyResult<String> {
        self.inner.to_yaml().map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "Profile(model={:?}, hardware={:?}, layers={}, source={:?})",
            self.inner.model,
            self.inner.hardware.name,
            self.inner.layers.len(),
            self.inner.provenance.source
        )
    }
}

/// A workload: the distribution of sequence lengths (tokens) a step draws from, and how many
/// sequences (or tokens) a step holds.
#[pyclass(module = "flatpipe._core", name = "Workload", frozen)]
#[derive(Debug, Clone)]
pub struct PyWorkload {
    inner: Arc<flatpipe_profiles::Workload>,
}

#[pymethods]
impl PyWorkload {
    /// A built-in workload (`sharegpt-v3`, `sharegpt-v3-merged`, `tiny-chat`) or a YAML / CSV
    /// file.
    #[staticmethod]
    fn load(name: &str) -> PyResult<Self> {
        Ok(PyWorkload {
            inner: Arc::new(builtins::workload(name).map_err(err)?),
        })
    }

    /// The workload's name.
    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    /// The workload's seed (the step sampler's default).
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }

    /// Step `step`'s sequence lengths, `[n]` uint32: the same draw `flatpipe simulate`,
    /// `plan` and `execute` make for that step and seed (default the workload's).
    #[pyo3(signature = (step, seed = None))]
    fn sample_step<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        seed: Option<u64>,
    ) -> Bound<'py, PyArray1<u32>> {
        let w = &self.inner;
        w.sample_step(seed.unwrap_or(w.seed), step, w.default_step_size())
            .to_pyarray(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "Workload(name={:?}, seed={})",
            self.inner.name, self.inner.seed
        )
    }
}

/// A pipeline configuration: schedule, ranks, stages, microbatching policy. Plans each step's
/// sequence lengths into a [`PyStepPlan`].
#[pyclass(module = "flatpipe._core", name = "Pipeline", frozen)]
#[derive(Debug, Clone)]
pub struct PyPipeline {
    config: RunConfig,
    profile: Option<Arc<Profile>>,
    num_layers: usize,
    workload: Option<String>,
}

fn parse_schedule(schedule: &str) -> PyResult<ScheduleKind> {
    schedule.parse::<ScheduleKind>().map_err(err)
}

#[allow(clippy::too_many_arguments)]
fn build_config(
    kind: ScheduleKind,
    pp: u32,
    vpp: Option<u32>,
    num_layers: usize,
    stages: Option<Vec<Range<usize>>>,
    token_budget: Option<u64>,
    microbatches: Option<u32>,
    policy: Option<&str>,
    dp: u32,
) -> PyResult<RunConfig> {
    if pp == 0 {
        return Err(err("pp = 0 is invalid: >= 1 rank per pipeline"));
    }
    if dp == 0 {
        return Err(err("dp = 0 is invalid: >= 1 pipeline replica"));
    }
    let v = kind.stages_per_rank(vpp).map_err(err)?;
    let n = (pp * v) as usize;
    let stages = match stages {
        // Checked with the rest of the run below (RunConfig::validate).
        Some(s) => s,
        None => even_split(num_layers, n).map_err(|e| {
            err(format!(
                "{kind} on pp = {pp} runs {v} stages per rank ({n} stages): {e}"
            ))
        })?,
    };
    let policy = match policy {
        Some(p) => p.parse::<Policy>().map_err(err)?,
        None => Policy::FlatFfd,
    };
    let mut params = PolicyParams::default();
    if let Some(b) = token_budget {
        if b == 0 {
            return Err(err("token_budget = 0 is invalid: >= 1 token"));
        }
        params.token_budget = b;
    }
    if microbatches == Some(0) {
        return Err(err("microbatches = 0 is invalid: >= 1"));
    }
    params.microbatches = microbatches;
    let mut config = RunConfig::new(
        ScheduleSource::Kind(kind),
        pp,
        v,
        stages,
        policy,
        Capacity::Dynamic,
    );
    config.params = params;
    config.dp = dp;
    config.validate(num_layers).map_err(err)?;
    Ok(config)
}

#[pymethods]
impl PyPipeline {
    /// A pipeline of `schedule` (`1f1b`, `interleaved-1f1b`, `zb-h1`, `zb-v`, `zb-auto`, ...) on
    /// `pp` ranks. Stages: `stages` as `(start, end)` layer ranges, or an even split of
    /// `num_layers` (default: the profile's) into `pp x vpp`. Microbatches: the fewest of at
    /// most `token_budget` tokens (default 16,384), or exactly `microbatches`. `profile` makes
    /// step plans carry predictions (and builds zb-auto from its costs). `forward_only = K`
    /// adds K forward-only microbatches per replica and step (a frozen reference or teacher
    /// forward over the step's microbatches, cycled to K), fused into the training schedule's
    /// bubbles (`forward_only_mode = "fused"`) or run as a pass before it (`"separate"`).
    /// `chunk_tokens = C` cuts a sequence longer than the token budget into chunks of at most
    /// C tokens (<= the budget), each a microbatch, pipelined along the token dimension
    /// (`Microbatch.chunk`; TeraPipe / Seq1F1B).
    #[new]
    #[pyo3(signature = (schedule, pp, num_layers = None, *, vpp = None, stages = None,
        token_budget = None, microbatches = None, policy = None, dp = 1, profile = None,
        forward_only = None, forward_only_mode = "fused", chunk_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        schedule: &str,
        pp: u32,
        num_layers: Option<usize>,
        vpp: Option<u32>,
        stages: Option<Vec<(usize, usize)>>,
        token_budget: Option<u64>,
        microbatches: Option<u32>,
        policy: Option<&str>,
        dp: u32,
        profile: Option<PyRef<'_, PyProfile>>,
        forward_only: Option<u32>,
        forward_only_mode: &str,
        chunk_tokens: Option<u64>,
    ) -> PyResult<Self> {
        let kind = parse_schedule(schedule)?;
        let profile = profile.map(|p| p.inner.clone());
        let num_layers = match (num_layers, &profile) {
            (Some(n), Some(p)) if n != p.layers.len() => {
                return Err(err(format!(
                    "num_layers = {n}, but the profile of {} has {} layers",
                    p.model,
                    p.layers.len()
                )));
            }
            (Some(n), _) => n,
            (None, Some(p)) => p.layers.len(),
            (None, None) => return Err(err("give num_layers or a profile")),
        };
        let stages = stages.map(|s| s.into_iter().map(|(a, b)| a..b).collect());
        let config = build_config(
            kind,
            pp,
            vpp,
            num_layers,
            stages,
            token_budget,
            microbatches,
            policy,
            dp,
        )?;
        config.placement().map_err(err)?;
        let mode = match forward_only_mode {
            "fused" => FoMode::Fused,
            "separate" => FoMode::Separate,
            other => {
                return Err(err(format!(
                    "forward_only_mode = {other:?} is invalid: \"fused\" (into the training schedule's bubbles) or \"separate\" (a pass before it)"
                )));
            }
        };
        let mut config = config;
        if let Some(c) = chunk_tokens {
            if microbatches.is_some() {
                return Err(err(
                    "chunk_tokens cuts sequences longer than the token budget: give token_budget, not microbatches",
                ));
            }
            if c == 0 || c > config.params.token_budget {
                return Err(err(format!(
                    "chunk_tokens = {c} is invalid: 1..={} (the token budget)",
                    config.params.token_budget
                )));
            }
            config.params.chunk_tokens = Some(c);
        }
        config.forward_only = match forward_only {
            None => None,
            Some(0) => {
                return Err(err(
                    "forward_only = 0 is invalid: >= 1 forward-only microbatch per replica (None: none)",
                ));
            }
            Some(k) => Some(ForwardOnlySpec {
                microbatches: Some(k),
                mode,
                loss_dependency: false,
            }),
        };
        Ok(PyPipeline {
            config,
            profile,
            num_layers,
            workload: None,
        })
    }

    /// The pipeline of a plan file (`flatpipe plan -o plan.yaml`), with its profile (the
    /// plan's `profile`, or the analytic profile of its `model` on its `hardware`).
    #[staticmethod]
    fn from_plan(path: &str) -> PyResult<Self> {
        let text = flatpipe_profiles::read_to_string(std::path::Path::new(path)).map_err(err)?;
        let plan = Plan::from_yaml(&text, path).map_err(err)?;
        let profile = match (
            &plan.inputs.profile,
            &plan.inputs.model,
            &plan.inputs.hardware,
        ) {
            (Some(p), _, _) => PyProfile::load(p)?.inner,
            (None, Some(m), Some(h)) => PyProfile::analytic(m, h)?.inner,
            _ => {
                return Err(err(format!(
                    "{path}: the plan names no profile and no model and hardware"
                )));
            }
        };
        let (tp, sp) = plan.tensor_parallel();
        let profile = Arc::new(profile.tensor_parallel(tp, sp).map_err(err)?);
        plan.validate(path, profile.layers.len()).map_err(err)?;
        // The plan's run as the file gives it (checked against the model above).
        let config = plan.run.clone();
        Ok(PyPipeline {
            config,
            num_layers: profile.layers.len(),
            profile: Some(profile),
            workload: Some(plan.inputs.workload.clone()),
        })
    }

    /// Plans one step from its sequence lengths (tokens): its microbatches (cut by the policy;
    /// data-parallel shares first when `dp > 1`), each rank's actions and, with a profile, the
    /// predicted timeline and memory.
    #[pyo3(signature = (seq_lens, step = 0))]
    fn plan_step(&self, py: Python<'_>, seq_lens: Vec<u32>, step: u64) -> PyResult<PyStepPlan> {
        if seq_lens.is_empty() {
            return Err(err("seq_lens is empty: a step needs >= 1 sequence"));
        }
        if let Some(i) = seq_lens.iter().position(|&s| s == 0) {
            return Err(err(format!("seq_lens[{i}] = 0: sequences have >= 1 token")));
        }
        let config = &self.config;
        let profile = self.profile.as_deref();
        let plan = py.detach(|| -> Result<StepPlan, String> {
            let cut = match profile {
                Some(p) => {
                    let cost = balance_cost(p);
                    cut_step(config, &seq_lens, &cost)
                }
                None => cut_step(config, &seq_lens, &|t, _| t as f64),
            }
            .map_err(|e| e.to_string())?;
            plan_step(config, profile, step, &cut).map_err(|e| e.to_string())
        });
        let plan = plan.map_err(err)?;
        let placement = config.placement().map_err(err)?;
        Ok(PyStepPlan {
            plan: Arc::new(plan),
            placement,
        })
    }

    /// Monte Carlo over `steps` steps sampled from `workload` (a built-in name or a file;
    /// default the plan's) with `seed` (default the workload's, as `flatpipe simulate`): predicted step time (mean, p50, p90, p99, seconds), bubble ratio,
    /// tokens per second and peak memory per rank (bytes). Needs a profile.
    #[pyo3(signature = (workload = None, steps = 16, seed = None))]
    fn simulate<'py>(
        &self,
        py: Python<'py>,
        workload: Option<&str>,
        steps: u32,
        seed: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let profile = self
            .profile
            .clone()
            .ok_or_else(|| err("simulate needs a profile: Pipeline(..., profile=...)"))?;
        let name = workload
            .map(str::to_string)
            .or_else(|| self.workload.clone())
            .ok_or_else(|| err("give a workload (a built-in name or a file)"))?;
        if steps == 0 {
            return Err(err("steps = 0 is invalid: >= 1"));
        }
        let w = builtins::workload(&name).map_err(err)?;
        let size = w.default_step_size();
        let seed = seed.unwrap_or(w.seed);
        let config = &self.config;
        let outcomes = py.detach(|| -> Result<Vec<StepOutcome>, String> {
            let cost = balance_cost(&profile);
            (0..u64::from(steps))
                .map(|s| {
                    let seqs = w.sample_step(seed, s, size);
                    let cut = cut_step(config, &seqs, &cost).map_err(|e| e.to_string())?;
                    let plan =
                        plan_step(config, Some(&profile), s, &cut).map_err(|e| e.to_string())?;
                    plan.outcome(config, &profile)
                        .ok_or_else(|| "no prediction for a planned step".to_string())
                })
                .collect()
        });
        let outcomes = outcomes.map_err(err)?;
        let s = summarize(
            &outcomes,
            config.pp * config.dp,
            profile.hardware.peak_flops,
        );
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("step_time_mean_s", s.step_time_s.mean)?;
        d.set_item("step_time_p50_s", s.step_time_s.p50)?;
        d.set_item("step_time_p90_s", s.step_time_s.p90)?;
        d.set_item("step_time_p99_s", s.step_time_s.p99)?;
        d.set_item("bubble_ratio_mean", s.bubble_ratio_mean)?;
        d.set_item("tokens_per_s", s.tokens_per_s)?;
        d.set_item("mfu", s.mfu)?;
        d.set_item("peak_memory_bytes", s.peak_memory_bytes)?;
        d.set_item("microbatches_mean", s.microbatches_mean)?;
        Ok(d)
    }

    /// Schedule name.
    #[getter]
    fn schedule(&self) -> String {
        self.config.source.name()
    }

    /// Ranks per pipeline.
    #[getter]
    fn pp(&self) -> u32 {
        self.config.pp
    }

    /// Stages per rank.
    #[getter]
    fn vpp(&self) -> u32 {
        self.config.v
    }

    /// Data-parallel replicas.
    #[getter]
    fn dp(&self) -> u32 {
        self.config.dp
    }

    /// Layers of the model.
    #[getter]
    fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Layer range `(start, end)` of every stage, in stage order.
    #[getter]
    fn stages(&self) -> Vec<(usize, usize)> {
        self.config
            .stages
            .iter()
            .map(|r| (r.start, r.end))
            .collect()
    }

    /// The rank that runs each stage, in stage order.
    #[getter]
    fn stage_ranks(&self) -> PyResult<Vec<u32>> {
        let p = self.config.placement().map_err(err)?;
        Ok(p.rank_of.iter().map(|r| r.0).collect())
    }

    /// The profile, if any.
    #[getter]
    fn profile(&self) -> Option<PyProfile> {
        self.profile.clone().map(|inner| PyProfile { inner })
    }

    fn __repr__(&self) -> String {
        format!(
            "Pipeline(schedule={:?}, pp={}, vpp={}, dp={}, stages={:?})",
            self.config.source.name(),
            self.config.pp,
            self.config.v,
            self.config.dp,
            self.stages()
        )
    }
}

/// One microbatch of a step: flat `[T]` tokens of several sequences.
#[pyclass(module = "flatpipe._core", name = "Microbatch", frozen)]
#[derive(Debug, Clone)]
pub struct PyMicrobatch {
    mb: Microbatch,
    index: usize,
}

#[pymethods]
impl PyMicrobatch {
    /// The microbatch's id in the step's actions (`0F3` is microbatch 3).
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    /// True tokens `T`.
    #[getter]
    fn tokens(&self) -> u64 {
        self.mb.tokens()
    }

    /// Sequence lengths, `[n]` uint32.
    #[getter]
    fn seq_lens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.mb.seq_lens.to_pyarray(py)
    }

    /// `[0, s_0, s_0 + s_1, ..., T]`, `[n + 1]` int64 (FlashAttention's varlen layout).
    #[getter]
    fn cu_seqlens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let v: Vec<i64> = self.mb.cu_seqlens().iter().map(|&x| x as i64).collect();
        v.to_pyarray(py)
    }

    /// Causal attention query-key pairs, `sum s (s + 1) / 2` (a chunk at offset `o`: `T (T + 1)
    /// / 2 + T o`).
    #[getter]
    fn attn_pairs(&self) -> u64 {
        self.mb.attn_pairs()
    }

    /// `None`, or for one chunk of a sequence longer than the token budget `(sequence, index,
    /// of, offset)`: the sequence's index in the replica's share of the step, the chunk's index
    /// among its `of` chunks, and the tokens of the sequence before it. A chunk's forward reads
    /// the earlier chunks' keys and values on each stage; its backward hands back their
    /// gradients.
    #[getter]
    fn chunk(&self) -> Option<(u32, u32, u32, u32)> {
        self.mb.chunk.map(|c| (c.sequence, c.index, c.of, c.offset))
    }

    fn __repr__(&self) -> String {
        format!(
            "Microbatch(index={}, tokens={}, sequences={})",
            self.index,
            self.mb.tokens(),
            self.mb.seq_lens.len()
        )
    }
}

/// One compute action of a step plan: stage `stage` runs `kind` (`"F"`, `"I"`, `"W"`, `"B"`,
/// `"Fo"`) on microbatch `microbatch`, with the pipeline's transfers it takes part in: the stage
/// its result goes to (`sends_to`: F and Fo send activations `[T, H]` to stage s + 1, I and B
/// the input gradient `[T, H]` to stage s - 1) and the stage whose result it waits on
/// (`receives_from`). Both are the core's rule (`ComputeAction::sends` / `receives`), given the
/// plan's stage count; `None` at the ends of the pipeline and for W.
#[pyclass(module = "flatpipe._core", name = "ComputeAction", frozen, eq, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyComputeAction {
    action: ComputeAction,
    num_stages: u32,
}

#[pymethods]
impl PyComputeAction {
    /// The stage (global index over all virtual stages).
    #[getter]
    fn stage(&self) -> u32 {
        self.action.stage.0
    }

    /// What is done: `"F"`, `"I"`, `"W"`, `"B"` or `"Fo"` (PyTorch's letters, plus
    /// forward-only).
    #[getter]
    fn kind(&self) -> &'static str {
        self.action.kind.letter()
    }

    /// The microbatch (forward-only microbatches, `Fo`, have their own id space).
    #[getter]
    fn microbatch(&self) -> u32 {
        self.action.microbatch.0
    }

    /// The stage this action's result is sent to, or `None` (W, the last stage's forward,
    /// stage 0's backward).
    #[getter]
    fn sends_to(&self) -> Option<u32> {
        self.action.sends(self.num_stages).map(|s| s.0)
    }

    /// The stage whose result this action waits on, or `None` (W, stage 0's forward, the last
    /// stage's backward).
    #[getter]
    fn receives_from(&self) -> Option<u32> {
        self.action.receives(self.num_stages).map(|s| s.0)
    }

    /// PyTorch's notation: `0F3`, `1I2`, `2Fo0`.
    fn __str__(&self) -> String {
        self.action.to_string()
    }

    fn __repr__(&self) -> String {
        let opt = |s: Option<u32>| s.map_or_else(|| "None".to_string(), |s| s.to_string());
        format!(
            "ComputeAction({:?}, sends_to={}, receives_from={})",
            self.action.to_string(),
            opt(self.sends_to()),
            opt(self.receives_from())
        )
    }
}

/// One entry of a rank's action list: a compute action, or an overlapped pair (DualPipe's
/// `(0F3;1B2)OVERLAP_F_B`: a forward and a backward the rank runs together, forward first).
#[pyclass(module = "flatpipe._core", name = "Action", frozen, eq, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyAction {
    action: Action,
    num_stages: u32,
}

#[pymethods]
impl PyAction {
    /// The entry in PyTorch's notation, as [`PyStepPlan::actions`] gives it (`0F3`,
    /// `(0F3;1B2)OVERLAP_F_B`).
    #[getter]
    fn text(&self) -> String {
        self.action.to_string()
    }

    /// Its compute actions: one, or an overlapped pair's forward then backward.
    #[getter]
    fn parts(&self) -> Vec<PyComputeAction> {
        self.action
            .parts()
            .map(|action| PyComputeAction {
                action,
                num_stages: self.num_stages,
            })
            .collect()
    }

    /// Whether this is an overlapped pair.
    #[getter]
    fn is_overlap(&self) -> bool {
        matches!(self.action, Action::Overlap(..))
    }

    fn __str__(&self) -> String {
        self.text()
    }

    fn __repr__(&self) -> String {
        format!("Action({:?})", self.text())
    }
}

/// One action in PyTorch's notation, read by the core's parser (`Action::from_str`):
/// `"0F3"` -> `[(0, "F", 3)]`, an overlapped pair `"(0F3;1B2)OVERLAP_F_B"` -> both halves,
/// forward first, as `(stage, kind, microbatch)`.
///
/// # Errors
/// `ValueError` (the text is the caller's value) naming the text and what is wrong with it.
#[pyfunction]
fn parse_action(text: &str) -> PyResult<Vec<(u32, &'static str, u32)>> {
    let action: Action = text.parse().map_err(|e| match &e {
        flatpipe_simulator::Error::ParseAction { text: part, .. } if part != text => {
            PyValueError::new_err(format!("{text:?}: {e}"))
        }
        _ => PyValueError::new_err(e.to_string()),
    })?;
    Ok(action
        .parts()
        .map(|a| (a.stage.0, a.kind.letter(), a.microbatch.0))
        .collect())
}

/// One step, planned: per data-parallel replica its microbatches and every rank's actions in
/// PyTorch's notation (`0F3`, `1I2`, `1W2`, `0B1`, `(0F3;1B2)OVERLAP_F_B`), and with a profile
/// the predicted timeline and memory.
#[pyclass(module = "flatpipe._core", name = "StepPlan", frozen)]
#[derive(Debug)]
pub struct PyStepPlan {
    plan: Arc<StepPlan>,
    placement: Placement,
}

impl PyStepPlan {
    fn replica(&self, replica: usize) -> PyResult<&flatpipe_simulator::run::step::ReplicaPlan> {
        let n = self.plan.replicas.len();
        let r = self.plan.replicas.get(replica).ok_or_else(|| {
            err(format!(
                "replica = {replica} is out of range: the step has {n} replicas (0..{n})"
            ))
        })?;
        if r.rounds.len() != 1 {
            return Err(err(format!(
                "replica {replica} runs {} rounds; the Python runtime runs one round per step",
                r.rounds.len()
            )));
        }
        Ok(r)
    }

    /// The replica's predicted timeline and memory (`None` without a profile).
    fn prediction(
        &self,
        replica: usize,
    ) -> PyResult<Option<&flatpipe_simulator::run::step::RoundPrediction>> {
        Ok(self.replica(replica)?.rounds[0].prediction.as_ref())
    }

    fn check_rank(&self, rank: u32) -> PyResult<()> {
        let p = self.placement.num_ranks;
        if rank >= p {
            return Err(err(format!(
                "rank = {rank} is out of range: the pipeline has {p} ranks (0..{p})"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl PyStepPlan {
    /// The step's number.
    #[getter]
    fn step(&self) -> u64 {
        self.plan.step
    }

    /// Data-parallel replicas.
    #[getter]
    fn num_replicas(&self) -> usize {
        self.plan.replicas.len()
    }

    /// Ranks per pipeline.
    #[getter]
    fn num_ranks(&self) -> u32 {
        self.placement.num_ranks
    }

    /// Stages (`pp x vpp`).
    #[getter]
    fn num_stages(&self) -> u32 {
        self.placement.num_stages()
    }

    /// The rank that runs each stage, in stage order.
    #[getter]
    fn stage_ranks(&self) -> Vec<u32> {
        self.placement.rank_of.iter().map(|r| r.0).collect()
    }

    /// The stages `rank` runs, in stage order.
    fn stages_of(&self, rank: u32) -> PyResult<Vec<u32>> {
        self.check_rank(rank)?;
        Ok(self
            .placement
            .stages_of(Rank(rank))
            .into_iter()
            .map(|s: StageId| s.0)
            .collect())
    }

    /// The replica's microbatches, in id order.
    #[pyo3(signature = (replica = 0))]
    fn microbatches(&self, replica: usize) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(r.microbatches
            .iter()
            .enumerate()
            .map(|(index, mb)| PyMicrobatch {
                mb: mb.clone(),
                index,
            })
            .collect())
    }

    /// The forward-only microbatches of the replica's step (their own id space), if any.
    #[pyo3(signature = (replica = 0))]
    fn forward_only_microbatches(&self, replica: usize) -> PyResult<Vec<PyMicrobatch>> {
        let r = self.replica(replica)?;
        Ok(r.rounds[0]
            .fo
            .iter()
            .enumerate()
            .map(|(index, mb)| PyMicrobatch {
                mb: mb.clone(),
                index,
            })
            .collect())
    }

    /// `rank`'s actions in the replica's step, in the order it runs them.
    #[pyo3(signature = (rank, replica = 0))]
    fn actions(&self, rank: u32, replica: usize) -> PyResult<Vec<String>> {
        self.check_rank(rank)?;
        let r = self.replica(replica)?;
        Ok(r.rounds[0].schedule.ranks[rank as usize]
            .iter()
            .map(ToString::to_string)
            .collect())
    }

    /// `rank`'s actions in the replica's step, in the order it runs them, as structured
    /// [`PyAction`]s: the same entries as [`PyStepPlan::actions`], each with its one or two
    /// compute actions and the stages they send to and receive from (the core's
    /// `ComputeAction::sends` / `receives` over this plan's stages).
    ///
    /// # Errors
    /// `FlatpipeError` for a rank or replica out of range, or a replica of several rounds.
    #[pyo3(signature = (rank, replica = 0))]
    fn actions_of(&self, rank: u32, replica: usize) -> PyResult<Vec<PyAction>> {
        self.check_rank(rank)?;
        let r = self.replica(replica)?;
        let num_stages = self.placement.num_stages();
        Ok(r.rounds[0].schedule.ranks[rank as usize]
            .iter()
            .map(|&action| PyAction { action, num_stages })
            .collect())
    }

    /// The schedule's name.
    #[pyo3(signature = (replica = 0))]
    fn schedule_name(&self, replica: usize) -> PyResult<String> {
        Ok(self.replica(replica)?.rounds[0].schedule.name.clone())
    }

    /// Predicted step time of the replica's pipeline (the replay's makespan, optimizer
    /// included), seconds; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_step_time_s(&self, replica: usize) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.makespan_s))
    }

    /// Predicted bubble ratio of the replica's pipeline; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_bubble_ratio(&self, replica: usize) -> PyResult<Option<f64>> {
        Ok(self
            .prediction(replica)?
            .map(|p| p.simulation.metrics.bubble_ratio))
    }

    /// Predicted peak memory per rank (parameters, gradients, optimizer state and the peak of
    /// activations), bytes; `None` without a profile.
    #[pyo3(signature = (replica = 0))]
    fn predicted_peak_bytes(&self, replica: usize) -> PyResult<Option<Vec<f64>>> {
        Ok(self.prediction(replica)?.map(|p| {
            p.simulation
                .metrics
                .ranks
                .iter()
                .zip(&p.static_bytes)
                .map(|(m, s)| m.peak_activation_bytes.unwrap_or(0.0) + s)
                .collect()
        }))
    }

    /// The predicted timeline: `(rank, action, start_s, end_s)` per compute action, rank by
    /// rank in run order; empty without a profile.
    #[pyo3(signature = (replica = 0))]
    fn timeline(&self, replica: usize) -> PyResult<Vec<(u32, String, f64, f64)>> {
        let Some(p) = self.prediction(replica)? else {
            return Ok(Vec::new());
        };
        Ok(p.simulation
            .timeline
            .compute
            .iter()
            .enumerate()
            .flat_map(|(rank, ops)| {
                ops.iter().map(move |op| {
                    (
                        rank as u32,
                        op.action.to_string(),
                        op.start_ns as f64 * 1e-9,
                        op.end_ns as f64 * 1e-9,
                    )
                })
            })
            .collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step={}, replicas={}, ranks={}, microbatches={:?})",
            self.plan.step,
            self.plan.replicas.len(),
            self.placement.num_ranks,
            self.plan
                .replicas
                .iter()
                .map(|r| r.microbatches.len())
                .collect::<Vec<_>>()
        )
    }
}

/// The planner's search: the best (tp, dp, pp, vpp, schedule, token budget, sharding, stages,
/// recomputation) for `profile` on `ranks` GPUs over `steps` steps of `workload` (sampled with
/// `seed`, default the workload's), under the hardware's memory less a reserve, as a list of at most `keep` dicts, best
/// first (predicted mean step time, seconds; peak memory per rank, bytes).
#[pyfunction]
#[pyo3(signature = (profile, workload, ranks, *, steps = 8, seed = None, keep = 5))]
fn plan<'py>(
    py: Python<'py>,
    profile: PyRef<'_, PyProfile>,
    workload: &str,
    ranks: u32,
    steps: u32,
    seed: Option<u64>,
    keep: usize,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    if steps == 0 {
        return Err(err("steps = 0 is invalid: >= 1"));
    }
    let w = builtins::workload(workload).map_err(err)?;
    let seed = seed.unwrap_or(w.seed);
    let p = profile.inner.clone();
    let space = SearchSpace::default_for(ranks);
    let config = SearchConfig {
        steps,
        seed,
        size: w.default_step_size(),
        memory_limit_bytes: default_memory_limit(&p),
        state_bytes: None,
        rank_by: RankBy::Mean,
        keep: keep.max(1),
        exact_split: flatpipe_planner::partition::ExactSplit::Off,
        forward_only: None,
    };
    let result = py
        .detach(|| search::search(&p, &w, &space, &config, &|_, _| {}))
        .map_err(err)?;
    result
        .ranked
        .iter()
        .map(|c| {
            let d = PyDict::new(py);
            d.set_item("tp", c.tp)?;
            d.set_item("dp", c.run.dp)?;
            d.set_item("pp", c.run.pp)?;
            d.set_item("vpp", c.run.v)?;
            d.set_item("schedule", c.schedule().name())?;
            d.set_item("token_budget", c.token_budget())?;
            d.set_item("sharding", c.run.sharding.to_string())?;
            d.set_item(
                "stages",
                c.run
                    .stages
                    .iter()
                    .map(|r| (r.start, r.end))
                    .collect::<Vec<_>>(),
            )?;
            d.set_item(
                "recompute",
                c.run
                    .recompute
                    .iter()
                    .map(|r| format!("{r:?}").to_lowercase())
                    .collect::<Vec<_>>(),
            )?;
            d.set_item("step_time_mean_s", c.summary.step_time_s.mean)?;
            d.set_item("step_time_p90_s", c.summary.step_time_s.p90)?;
            d.set_item("lower_bound_s", c.lower_bound_s)?;
            d.set_item("peak_memory_bytes", c.peak_memory_bytes.clone())?;
            Ok(d)
        })
        .collect()
}

/// Reads PyTorch profiler traces of a pipelined run (`PP:<action>` events; one file per rank in
/// rank order, `.gz` read too), as `flatpipe import-trace` does
/// (`simulator/src/io/kineto.rs`), and returns a dict: `actions` (per rank, `(action, start_s,
/// end_s)` of the imported step, busy time from each action's first nested operator), `steps`,
/// `step`, `leading_wait_s` (per rank), `other_events` and `warnings`.
#[pyfunction]
#[pyo3(signature = (paths, step = None))]
fn import_trace<'py>(
    py: Python<'py>,
    paths: Vec<String>,
    step: Option<usize>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut files = Vec::with_capacity(paths.len());
    for p in &paths {
        let text = flatpipe_simulator::io::kineto::read_trace_file(std::path::Path::new(p))
            .map_err(err)?;
        files.push((p.clone(), text));
    }
    let t = flatpipe_simulator::io::kineto::read_traces(
        &files,
        &flatpipe_simulator::io::kineto::ImportOptions { step },
    )
    .map_err(err)?;
    let d = PyDict::new(py);
    let actions: Vec<Vec<(String, f64, f64)>> = t
        .timeline
        .compute
        .iter()
        .map(|ops| {
            ops.iter()
                .map(|o| {
                    (
                        o.action.to_string(),
                        o.start_ns as f64 * 1e-9,
                        o.end_ns as f64 * 1e-9,
                    )
                })
                .collect()
        })
        .collect();
    d.set_item("actions", actions)?;
    d.set_item("steps", t.steps)?;
    d.set_item("step", t.step)?;
    d.set_item(
        "leading_wait_s",
        t.leading_wait_ns
            .iter()
            .map(|&w| w as f64 * 1e-9)
            .collect::<Vec<_>>(),
    )?;
    d.set_item("other_events", t.other_events.clone())?;
    d.set_item("warnings", t.warnings.clone())?;
    let nested: Vec<Vec<(u32, f64)>> = t
        .nested
        .iter()
        .map(|v| {
            v.iter()
                .map(|n| (n.events, n.comm_ns as f64 * 1e-9))
                .collect()
        })
        .collect();
    d.set_item("nested", nested)?;
    Ok(d)
}

/// The native module `flatpipe._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FlatpipeError", m.py().get_type::<FlatpipeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyProfile>()?;
    m.add_class::<PyPipeline>()?;
    m.add_class::<PyWorkload>()?;
    m.add_class::<PyMicrobatch>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PyComputeAction>()?;
    m.add_class::<PyAction>()?;
    m.add_function(wrap_pyfunction!(parse_action, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(import_trace, m)?)?;
    Ok(())
}
