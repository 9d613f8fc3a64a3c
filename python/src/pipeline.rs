//! Python's `Pipeline`: one run (a `RunConfig`) built from arguments or a plan file, and
//! what it plans and simulates.

use super::*;

/// A pipeline configuration: schedule, ranks, stages, microbatching policy. Plans each step's
/// sequence lengths into a [`PyStepPlan`].
#[pyclass(module = "flatpipe._core", name = "Pipeline", frozen)]
#[derive(Debug, Clone)]
pub struct PyPipeline {
    pub(crate) config: RunConfig,
    pub(crate) profile: Option<Arc<Profile>>,
    pub(crate) num_layers: usize,
    pub(crate) workload: Option<String>,
}

pub(crate) fn parse_schedule(schedule: &str) -> PyResult<ScheduleKind> {
    schedule.parse::<ScheduleKind>().map_err(err)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn build_config(
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
        return Err(invalid("pp", 0, ">= 1 rank per pipeline"));
    }
    if dp == 0 {
        return Err(invalid("dp", 0, ">= 1 pipeline replica"));
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
            return Err(invalid("token_budget", 0, ">= 1 token"));
        }
        params.token_budget = b;
    }
    if microbatches == Some(0) {
        return Err(invalid("microbatches", 0, ">= 1"));
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
        pp: i128,
        num_layers: Option<i128>,
        vpp: Option<i128>,
        stages: Option<Vec<(i128, i128)>>,
        token_budget: Option<i128>,
        microbatches: Option<i128>,
        policy: Option<&str>,
        dp: i128,
        profile: Option<PyRef<'_, PyProfile>>,
        forward_only: Option<i128>,
        forward_only_mode: &str,
        chunk_tokens: Option<i128>,
    ) -> PyResult<Self> {
        let pp: u32 = nat("pp", pp)?;
        let num_layers: Option<usize> = nat_opt("num_layers", num_layers)?;
        let vpp: Option<u32> = nat_opt("vpp", vpp)?;
        let stages: Option<Vec<(usize, usize)>> = stages
            .map(|s| {
                s.into_iter()
                    .enumerate()
                    .map(|(k, (a, b))| {
                        Ok((
                            nat(&format!("stages[{k}][0]"), a)?,
                            nat(&format!("stages[{k}][1]"), b)?,
                        ))
                    })
                    .collect::<PyResult<Vec<_>>>()
            })
            .transpose()?;
        let token_budget: Option<u64> = nat_opt("token_budget", token_budget)?;
        let microbatches: Option<u32> = nat_opt("microbatches", microbatches)?;
        let dp: u32 = nat("dp", dp)?;
        let forward_only: Option<u32> = nat_opt("forward_only", forward_only)?;
        let chunk_tokens: Option<u64> = nat_opt("chunk_tokens", chunk_tokens)?;
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
        let profile = Arc::new(plan.per_gpu(&profile).map_err(err)?);
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
    fn plan_step(&self, py: Python<'_>, seq_lens: Vec<i128>, step: i128) -> PyResult<PyStepPlan> {
        let step: u64 = nat("step", step)?;
        let seq_lens: Vec<u32> = seq_lens
            .into_iter()
            .enumerate()
            .map(|(i, s)| nat(&format!("seq_lens[{i}]"), s))
            .collect::<PyResult<_>>()?;
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
    /// default the plan's) with `seed` (default the workload's, as `flatpipe simulate`), as a
    /// `flatpipe.results.SimulationSummary`: predicted step time (mean, p50, p90, p99,
    /// seconds), bubble ratio, tokens per second, MFU and peak memory (bytes). Needs a profile.
    #[pyo3(signature = (workload = None, steps = 16, seed = None))]
    fn simulate<'py>(
        &self,
        py: Python<'py>,
        workload: Option<&str>,
        steps: i128,
        seed: Option<i128>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let steps: u32 = nat("steps", steps)?;
        let seed: Option<u64> = nat_opt("seed", seed)?;
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
        typed_result(&d, "SimulationSummary")
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
