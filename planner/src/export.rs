//! Exports of a plan to torchtitan, Megatron-LM and PyTorch's pipeline-order CSV
//! (formats: `docs/reference.md`, "Formats of other tools", gathered 2026-11).

use crate::{Error, Result};
use flatpipe_profiles::context_parallel::{ContextParallel, CpBalance, CpComm};
use flatpipe_profiles::{LayerKind, Profile, StepSize, Workload};
use flatpipe_simulator::costs::sharding::{DpGroup, Sharding};
use flatpipe_simulator::ir::PlacementKind;
use flatpipe_simulator::run::config::balance_cost;
use flatpipe_simulator::run::step::{StepPlan, cut_step, plan_step};
use flatpipe_simulator::{Plan, Schedule, ScheduleKind};

/// The step an export stands for: the schedule the plan's own prediction ran on one of its
/// sampled steps, and what a target that runs one fixed schedule cannot run of the plan.
#[derive(Debug, Clone)]
pub struct ExportedStep {
    /// The sampler's step id: of the plan's sampled steps, the first whose microbatch count is
    /// the median ([`median_step`]).
    pub step: u64,
    /// Replica 0's training schedule of that step's first round, as the prediction built it
    /// (zb-auto's search on that step's costs included), without forward-only work.
    pub schedule: Schedule,
    /// Microbatches of that step's replica 0.
    pub microbatches: u32,
    /// What the target will run instead of what the plan chose, one sentence each: sequence
    /// chunks, forward-only work, a microbatch count that changes per step, several rounds.
    pub warnings: Vec<String>,
    /// Of [`ExportedStep::warnings`], the one on a microbatch count that changes per step (said
    /// for targets that run one count every step; verl's dynamic batching cuts each step).
    pub count_warning: Option<String>,
}

impl ExportedStep {
    /// The warnings for a target that runs one microbatch count every step (`fixed_count`) or
    /// cuts each step itself.
    pub fn warnings_for(&self, fixed_count: bool) -> Vec<&str> {
        self.warnings
            .iter()
            .filter(|w| fixed_count || Some(*w) != self.count_warning.as_ref())
            .map(String::as_str)
            .collect()
    }
}

/// The step whose schedule [`exported_step`] exports: with `counts[i]` the microbatch count of
/// sampled step `i`, the first step whose count is the median count (the lower median of an
/// even number of steps).
/// `None` for no steps.
pub fn median_step(counts: &[u32]) -> Option<usize> {
    let mut sorted = counts.to_vec();
    sorted.sort_unstable();
    let median = *sorted.get(counts.len().checked_sub(1)? / 2)?;
    counts.iter().position(|&c| c == median)
}

/// Plans the plan's `steps` sampled steps (`workload` drawn with the plan's seed at `size`,
/// `profile` the GPU's: tensor parallelism already applied) exactly as its prediction did
/// (`cut_step` then `plan_step`), and returns the median step's schedule with the warnings
/// an export of it needs.
///
/// # Errors
/// [`Error::InvalidArgument`] for `steps = 0`; the plan's and the simulator's errors.
pub fn exported_step(
    plan: &Plan,
    profile: &Profile,
    workload: &Workload,
    size: StepSize,
    steps: u32,
) -> Result<ExportedStep> {
    let config = plan.run_config()?;
    let cost = balance_cost(profile);
    let plan_one = |i: u64| -> Result<StepPlan> {
        let seqs = workload.sample_step(plan.inputs.seed, i, size);
        let cut = cut_step(&config, &seqs, &cost)?;
        Ok(plan_step(&config, Some(profile), i, &cut)?)
    };
    let mut counts = Vec::with_capacity(steps as usize);
    let mut chunked = 0;
    for i in 0..steps {
        let planned = plan_one(u64::from(i))?;
        counts.push(planned.replicas[0].microbatches.len() as u32);
        chunked += chunked_sequences(&planned);
    }
    let step = median_step(&counts)
        .ok_or_else(|| Error::invalid("steps", 0, ">= 1 sampled step to export a schedule of"))?
        as u64;
    let planned = plan_one(step)?;
    let replica = &planned.replicas[0];
    let round = &replica.rounds[0];
    let schedule = (*round.train).clone();
    let microbatches = replica.microbatches.len() as u32;
    let mut warnings = Vec::new();
    step_count_warning(&mut warnings, &counts, step);
    let count_warning = warnings.first().cloned();
    if chunked > 0 {
        warnings.push(format!(
            "the plan cuts {chunked} of its sampled sequences (over {steps} steps) that are longer than the token budget into chunks that share their keys and values ({} in the exported step); the target has no sequence chunks and runs each chunk as an unrelated microbatch (attention across chunks is lost)",
            schedule.chunks.len()
        ));
    }
    if !round.fo.is_empty() {
        warnings.push(format!(
            "the plan runs {} forward-only microbatches per step with the training schedule; the target has no forward-only actions and runs the training schedule alone",
            round.fo.len()
        ));
    }
    if replica.rounds.len() > 1 {
        warnings.push(format!(
            "the plan's fixed capacity runs step {step} in {} rounds; this export is the first round's schedule",
            replica.rounds.len()
        ));
    }
    Ok(ExportedStep {
        step,
        schedule,
        microbatches,
        warnings,
        count_warning,
    })
}

/// Sequences a planned step cut into chunks, over its replicas and rounds.
fn chunked_sequences(planned: &StepPlan) -> usize {
    planned
        .replicas
        .iter()
        .flat_map(|r| &r.rounds)
        .map(|round| round.train.chunks.len())
        .sum()
}

/// The warning for a microbatch count that changes over the sampled steps (`counts[i]`: step
/// `i`'s count), exported as step `step`'s count.
fn step_count_warning(warnings: &mut Vec<String>, counts: &[u32], step: u64) {
    let m = counts[step as usize];
    let (lo, hi) = (
        counts.iter().copied().min().unwrap_or(m),
        counts.iter().copied().max().unwrap_or(m),
    );
    if lo != hi {
        warnings.push(format!(
            "the plan's microbatch count changes per step ({lo} to {hi} over its {} sampled steps); this export is step {step}'s schedule for {m} microbatches, and the target runs that count every step",
            counts.len()
        ));
    }
}

/// Whether torchtitan runs `plan` from a schedule CSV (its schedule has no torchtitan name:
/// zb-h1, zb-h2, zb-auto, or interleaved 1F1B with one stage per rank).
pub fn torchtitan_needs_csv(plan: &Plan) -> bool {
    // A given schedule (not a family) has no name at all: it goes as a CSV too.
    match plan.schedule() {
        Some(kind) if kind.pytorch_name().is_some() => {
            kind == ScheduleKind::Interleaved1F1B && plan.run.v <= 1
        }
        _ => true,
    }
}

/// torchtitan's job configuration for `plan` as a TOML file (torchtitan 0.2.x, loaded with
/// `--job.config_file`; torchtitan 0.3 takes Python configuration functions instead and is not
/// exported yet): `[parallelism]` with the degree, the schedule name or, for schedules
/// torchtitan has no name for, `pipeline_parallel_schedule_csv = csv_path` (the caller writes
/// that CSV, compute-only, for `microbatches` microbatches, next to the TOML),
/// `module_fqns_per_model_part` with torchtitan's Llama module names and
/// `pipeline_parallel_microbatch_size = 1`; `[training] local_batch_size = microbatches` and
/// `seq_len` = the token budget (one packed row of the budget per microbatch); and
/// `[activation_checkpoint]` ([`torchtitan_activation_checkpoint`]). Comment lines say which
/// microbatch count the CSV is for, and warn where torchtitan runs something else than the
/// plan.
///
/// # Errors
/// [`Error::Export`] if a stage range leaves the profile's layers, if the plan needs a CSV and
/// `csv_path` is `None`, or if a V-placed plan needs a CSV: torchtitan places the stages of a
/// CSV schedule in loop order (`torchtitan/distributed/pipeline_parallel.py`,
/// `_get_pp_rank_to_stage_indices_mapping`: V only for `ScheduleZBVZeroBubble` and
/// `ScheduleDualPipeV`; a CSV runs `_PipelineScheduleRuntime`).
pub fn torchtitan(
    plan: &Plan,
    profile: &Profile,
    microbatches: u32,
    csv_path: Option<&str>,
) -> Result<String> {
    let mut parts = Vec::new();
    for (i, s) in plan.run.stages.iter().enumerate() {
        let layers = profile
            .layers
            .get(s.start..s.end)
            .ok_or_else(|| Error::Export {
                format: "torchtitan",
                reason: format!(
                    "stage {i} covers layers {}..{} of {}",
                    s.start,
                    s.end,
                    profile.layers.len()
                ),
            })?;
        let mut names = Vec::new();
        for l in layers {
            if l.kind == LayerKind::Head {
                names.push("\"norm\"".to_string());
            }
            names.push(format!("\"{}\"", l.name));
        }
        parts.push(format!("[{}]", names.join(", ")));
    }
    let v_placed = plan.placement() == PlacementKind::V;
    let mut head = String::from(
        "# torchtitan 0.2.x job configuration (run with --job.config_file); generated by flatpipe\n",
    );
    let mut out = String::from("[parallelism]\n");
    out.push_str(&format!("pipeline_parallel_degree = {}\n", plan.run.pp));
    let (tp, sp) = plan.tensor_parallel();
    if tp > 1 {
        // torchtitan's tensor parallelism always shards the norms along the sequence and keeps
        // the loss vocabulary-parallel (`parallelize_llama`: SequenceParallel, loss_parallel).
        out.push_str(&format!("tensor_parallel_degree = {tp}\n"));
        if !sp {
            head.push_str("# warning: the plan has tensor parallelism without sequence parallelism; torchtitan always shards the norms along the sequence (less activation memory than planned)\n");
        }
    }
    if plan.ep > 1 {
        // torchtitan 0.2.x: experts split over the data-parallel (and tensor-parallel) GPUs;
        // its expert tensor parallelism is either 1 or tp, and flatpipe models tp.
        out.push_str(&format!("expert_parallel_degree = {}\n", plan.ep));
        out.push_str(&format!("expert_tensor_parallel_degree = {tp}\n"));
    }
    let (cp_lines, cp_warnings) = torchtitan_context_parallel(plan)?;
    out.push_str(&cp_lines);
    for w in cp_warnings {
        head.push_str(&format!("# warning: {w}\n"));
    }
    if let Some(dp) = Some(plan.run.dp).filter(|d| *d > 1) {
        let (replicate, shard, warning) = torchtitan_data_parallel(plan, profile, dp);
        out.push_str(&format!("data_parallel_replicate_degree = {replicate}\n"));
        out.push_str(&format!("data_parallel_shard_degree = {shard}\n"));
        if plan.run.sharding == Sharding::FsdpPerMicrobatch {
            out.push_str("fsdp_reshard_after_forward = \"always\"\n");
        }
        if let Some(w) = warning {
            head.push_str(&format!("# warning: {w}\n"));
        }
    }
    if torchtitan_needs_csv(plan) {
        if v_placed {
            return Err(Error::Export {
                format: "torchtitan",
                reason: format!(
                    "{} here places stages in a V (rank r holds stages r and 2p-1-r), but torchtitan runs a CSV schedule with stages in loop order (V only for its ZBVZeroBubble and DualPipeV schedules)",
                    plan.run.source.name()
                ),
            });
        }
        let path = csv_path.ok_or_else(|| Error::Export {
            format: "torchtitan",
            reason: format!(
                "{} has no torchtitan name: the configuration needs a schedule CSV file written next to it",
                plan.run.source.name()
            ),
        })?;
        head.push_str(&format!(
            "# {} has no torchtitan name: {path} holds its compute-only action order for {microbatches} microbatches (the path is\n\
             # relative to the directory torchtitan runs in).\n\
             # torchtitan runs that one fixed schedule every step: local_batch_size = {microbatches} rows of seq_len tokens,\n\
             # one row per microbatch; a step with another microbatch count needs another CSV.\n",
            plan.run.source.name()
        ));
        out.push_str(&format!("pipeline_parallel_schedule_csv = \"{path}\"\n"));
    } else if let Some(name) = plan.schedule().and_then(|k| k.pytorch_name()) {
        out.push_str(&format!("pipeline_parallel_schedule = \"{name}\"\n"));
    }
    out.push_str(&format!(
        "module_fqns_per_model_part = [{}]\n",
        parts.join(", ")
    ));
    // torchtitan 0.2.x cuts a data-parallel rank's batch of `local_batch_size` rows of
    // `seq_len` tokens into microbatches of `pipeline_parallel_microbatch_size` rows: one row
    // of the token budget per microbatch (its data loader packs documents into rows).
    out.push_str("pipeline_parallel_microbatch_size = 1\n");
    out.push_str(&format!(
        "\n[training]\nlocal_batch_size = {microbatches}\n"
    ));
    if plan.run.params.microbatches.is_none() {
        let t = plan.run.params.token_budget;
        out.push_str(&format!("seq_len = {t}\n"));
    }
    let (ac, warnings) = torchtitan_activation_checkpoint(plan, profile);
    for w in warnings {
        head.push_str(&format!("# warning: {w}\n"));
    }
    let (model, warning) = torchtitan_model(plan);
    if let Some(w) = warning {
        head.push_str(&format!("# warning: {w}\n"));
    }
    if let Some((name, flavor)) = model {
        out.push_str(&format!(
            "\n[model]\nname = \"{name}\"\nflavor = \"{flavor}\"\n"
        ));
    }
    out.push_str(&format!("\n[activation_checkpoint]\n{ac}"));
    Ok(head + &out)
}

/// torchtitan's `[model]` for `plan` (`name`, `flavor`) and a warning where its attention is
/// not the plan's. A flat plan's microbatch is a row of packed documents that attend each to
/// itself (flatpipe's `cu_seqlens`): in torchtitan 0.2.2 that is a flavor with `attn_type =
/// "varlen"` and `attn_mask_type = "block_causal"` (`torchtitan/models/llama3/__init__.py`:
/// `8B_varlen`; the 70B and 405B flavors run causal attention over the whole row, across
/// documents: warned). `packed` plans attend across documents: the plain flavor. A model
/// torchtitan has no flavor for is left to the user (warned).
pub fn torchtitan_model(plan: &Plan) -> (Option<(&'static str, String)>, Option<String>) {
    let size = match plan.inputs.model.as_deref() {
        Some("llama3.1-8b") => "8B",
        Some("llama3.1-70b") => "70B",
        Some("llama3.1-405b") => "405B",
        other => {
            return (
                None,
                Some(format!(
                    "torchtitan has no flavor of {}: set [model] name and flavor, one whose attention keeps the packed documents of a row apart (attn_type = \"varlen\", attn_mask_type = \"block_causal\") for a flat plan",
                    other.unwrap_or("this model")
                )),
            );
        }
    };
    if !plan.run.policy.is_flat() {
        return (Some(("llama3", size.to_string())), None);
    }
    if size == "8B" {
        // torchtitan's context parallelism runs SDPA or FlexAttention, not varlen
        // (`TransformerModelArgs.update_from_config` raises for varlen with cp > 1): its flex
        // flavor keeps the documents apart with the same block_causal mask.
        let cp = plan.run.context_parallel.is_some_and(|c| c.cp > 1);
        let flavor = if cp { "8B_flex" } else { "8B_varlen" };
        return (Some(("llama3", flavor.into())), None);
    }
    (
        Some(("llama3", size.to_string())),
        Some(format!(
            "torchtitan 0.2.2 has no varlen flavor of llama3 {size}: its {size} flavor runs causal attention across the documents packed in a row, where the plan predicted each attending to itself; add a flavor with attn_type = \"varlen\", attn_mask_type = \"block_causal\" to torchtitan's llama3_args"
        )),
    )
}

/// torchtitan's data-parallel degrees for the plan's sharding over `dp` replicas,
/// `(data_parallel_replicate_degree, data_parallel_shard_degree, warning)`. torchtitan 0.2.x
/// runs FSDP2 when the shard degree is above 1 (HSDP when the replicate degree is too) and DDP
/// only without other parallelism (`apply_ddp` raises "DDP has not supported > 1D
/// parallelism"); it has no ZeRO-1 or ZeRO-2. `fsdp-mb` adds `fsdp_reshard_after_forward =
/// "always"`; under PP torchtitan still reduces gradients at a stage's last backward (torch's
/// pipeline stage), so the per-microbatch reduce-scatters are not what it runs (warned).
pub fn torchtitan_data_parallel(
    plan: &Plan,
    profile: &Profile,
    dp: u32,
) -> (u32, u32, Option<String>) {
    let fsdp_instead = |what: &str| {
        Some(format!(
            "torchtitan has no {what}: it runs FSDP over the same {dp} replicas instead (a plan with sharding fsdp predicts that)"
        ))
    };
    match plan.run.sharding {
        Sharding::Ddp if plan.run.pp > 1 => (
            1,
            dp,
            fsdp_instead("DDP with pipeline parallelism (apply_ddp refuses more than one mesh dimension)"),
        ),
        Sharding::Ddp => (dp, 1, None),
        Sharding::Zero1 => (1, dp, fsdp_instead("ZeRO-1")),
        Sharding::Zero2 => (1, dp, fsdp_instead("ZeRO-2")),
        Sharding::Fsdp => (1, dp, None),
        Sharding::FsdpPerMicrobatch => (
            1,
            dp,
            (plan.run.pp > 1).then(|| {
                "fsdp-mb: torchtitan reshards after every forward (\"always\") but, under pipeline parallelism, reduce-scatters gradients once per step at each stage's last backward, not per microbatch".to_string()
            }),
        ),
        Sharding::Hsdp => {
            let g = DpGroup::of(Sharding::Hsdp, &profile.hardware, plan.run.pp, dp, 0);
            (g.replicate, g.shard, None)
        }
    }
}

/// torchtitan's `[activation_checkpoint]` values closest to the plan's per-stage
/// [`Recompute`](flatpipe_simulator::costs::Recompute) modes, and warnings where they differ.
/// torchtitan applies one mode to every transformer block (`ActivationCheckpoint.mode`:
/// `none`, `selective`, `full`, `memory_budget`; its default is `selective` with
/// `selective_ac_option = "2"`, so `none` is written out): every decoder stage the same mode
/// maps to that mode (`selective` as `selective_ac_option = "op"`, torchtitan's per-op
/// selective checkpointing, which saves the attention and matmul outputs it deems expensive
/// and recomputes the rest: not flatpipe's selective exactly, warned); mixed modes take the
/// most memory-saving mode present, warned.
pub fn torchtitan_activation_checkpoint(plan: &Plan, profile: &Profile) -> (String, Vec<String>) {
    use flatpipe_simulator::costs::Recompute;
    let modes: Vec<(usize, Recompute)> = (0..plan.run.stages.len())
        .filter(|&s| {
            let r = &plan.run.stages[s];
            profile
                .layers
                .get(r.start..r.end)
                .is_some_and(|ls| ls.iter().any(|l| l.kind == LayerKind::Decoder))
        })
        .map(|s| (s, plan.run.recompute_of(s)))
        .collect();
    let has = |m: Recompute| modes.iter().any(|(_, x)| *x == m);
    let chosen = if has(Recompute::Full) {
        Recompute::Full
    } else if has(Recompute::Selective) {
        Recompute::Selective
    } else {
        Recompute::None
    };
    let mut warnings = Vec::new();
    let differ: Vec<String> = modes
        .iter()
        .filter(|(_, m)| *m != chosen)
        .map(|(s, _)| s.to_string())
        .collect();
    if !differ.is_empty() {
        warnings.push(format!(
            "torchtitan cannot checkpoint per stage: mode {} applies to every layer, also on {} that the plan recomputes less (slower than predicted)",
            match chosen {
                Recompute::None => "none",
                Recompute::Selective => "selective",
                Recompute::Full => "full",
            },
            stage_list(&differ)
        ));
    }
    let text = match chosen {
        Recompute::None => "mode = \"none\"\n".to_string(),
        Recompute::Full => "mode = \"full\"\n".to_string(),
        Recompute::Selective => {
            warnings.push(
                "torchtitan's per-op selective checkpointing (selective_ac_option = \"op\") saves a different set of tensors than flatpipe's selective (which keeps the matmul inputs and each layer's input and reruns attention and the elementwise work): its memory and time differ from the plan's".into(),
            );
            "mode = \"selective\"\nselective_ac_option = \"op\"\n".to_string()
        }
    };
    (text, warnings)
}

/// Megatron-LM's `--pipeline-model-parallel-layout` string of `plan`: stages separated by `|`,
/// `E` the embedding, `t` a decoder layer, `m` a multi-token-prediction module, `L` the loss
/// (head); stage list index `vpp_index * pp + pp_rank`, which is flatpipe's loop placement
/// order.
///
/// # Errors
/// [`Error::Export`] for V placements, which the layout cannot express.
pub fn megatron_layout(plan: &Plan, profile: &Profile) -> Result<String> {
    if plan.placement() == PlacementKind::V {
        return Err(Error::Export {
            format: "megatron",
            reason: format!(
                "{} uses the V placement (rank r holds stages r and 2p-1-r); Megatron's layout puts stage i on rank i mod pp",
                plan.run.source.name()
            ),
        });
    }
    let mut stages = Vec::new();
    for s in &plan.run.stages {
        let mut text = String::new();
        for l in &profile.layers[s.start..s.end] {
            text.push(match l.kind {
                LayerKind::Embedding => 'E',
                LayerKind::Decoder if l.shape.mtp => 'm',
                LayerKind::Decoder => 't',
                LayerKind::Head => 'L',
            });
        }
        stages.push(text);
    }
    Ok(stages.join("|"))
}

/// Megatron-LM's batch arguments for a step of `microbatches` microbatches per replica, and
/// the warnings where Megatron runs another batch than the plan:
/// - a flat policy's microbatch is one packed sample of at most the token budget:
///   `--seq-length` the budget, `--micro-batch-size 1`, `--global-batch-size` microbatches x
///   dp, and the documents kept apart in attention and positions
///   (`--dataloader-inter-document-masking`, which hands the attention `cu_seqlens`, and
///   `--reset-position-ids`; `megatron/training/arguments.py`). Megatron's GPT dataset packs
///   documents into samples of exactly `--seq-length` tokens and splits a document across
///   samples where flatpipe keeps it whole: warned. `packed` is the same without the masking.
/// - Megatron's interleaved schedule needs the microbatch count to be a multiple of pp (its
///   `microbatch_group_size_per_vp_stage` defaults to pp, and
///   `megatron/core/pipeline_parallel/schedules.py` refuses a last group of fewer than pp):
///   the global batch is rounded up to one, warned.
/// - `padded` microbatches have no packed-sample form here: warned, batch arguments left out.
pub fn megatron_batch(plan: &Plan, microbatches: u32) -> (Vec<String>, Vec<String>) {
    let (mut args, mut warnings) = (Vec::new(), Vec::new());
    let policy = plan.run.policy;
    if policy == flatpipe_simulator::batching::policy::Policy::Padded {
        warnings.push(
            "the plan pads its microbatches to their longest sequence; these arguments leave Megatron-LM's batch settings (--seq-length, --micro-batch-size, --global-batch-size) to you".into(),
        );
        return (args, warnings);
    }
    let (pp, dp) = (plan.run.pp.max(1), plan.run.dp.max(1));
    let v = plan.run.stages.len() as u32 / pp;
    let mut m = microbatches.max(1);
    if v > 1 && m % pp != 0 {
        let rounded = m.div_ceil(pp) * pp;
        warnings.push(format!(
            "Megatron-LM's interleaved schedule runs a multiple of pp = {pp} microbatches; the step's {m} are rounded up to {rounded}"
        ));
        m = rounded;
    }
    args.push(format!("--seq-length {}", plan.run.params.token_budget));
    args.push("--micro-batch-size 1".into());
    args.push(format!(
        "--global-batch-size {}",
        u64::from(m) * u64::from(dp)
    ));
    if policy.is_flat() {
        args.push("--dataloader-inter-document-masking".into());
        args.push("--reset-position-ids".into());
    }
    warnings.push(format!(
        "Megatron-LM's GPT dataset packs documents into samples of exactly --seq-length tokens and splits a document across samples where the plan keeps each whole in one microbatch of at most {} tokens",
        plan.run.params.token_budget
    ));
    (args, warnings)
}

/// The schedule Megatron-LM (and verl's Megatron workers) run in place of `plan`'s: its
/// interleaved 1F1B for several stages per rank, else its 1F1B; `None` when that is the plan's
/// own schedule (combined 1F1B is its interleaved 1F1B under
/// `--overlap-moe-expert-parallel-comm`, [`megatron_overlap`]).
fn megatron_runs_instead(plan: &Plan) -> Option<&'static str> {
    let v = plan.run.stages.len() as u32 / plan.run.pp.max(1);
    let same = matches!(
        (plan.schedule(), v > 1),
        (Some(ScheduleKind::OneFOneB), false)
            | (Some(ScheduleKind::Interleaved1F1B), _)
            | (Some(ScheduleKind::Combined1F1B), _)
    );
    (!same).then_some(if v > 1 { "interleaved 1F1B" } else { "1F1B" })
}

/// The Megatron-LM arguments of `plan`: `--pipeline-model-parallel-size`, the
/// `--pipeline-model-parallel-layout` alone (it implies the virtual stages: Megatron-LM's
/// `megatron/training/arguments.py`, `validate_args`, allows at most one of
/// `--num-layers-per-virtual-pipeline-stage`, `--num-virtual-stages-per-pipeline-rank` and
/// `--pipeline-model-parallel-layout`, and sets the virtual pipeline size to the layout's stage
/// count divided by pp), and the closest activation recomputation settings
/// ([`megatron_recompute`]). `# warning:` lines say where Megatron runs something else than
/// the plan: its schedule (1F1B, or interleaved 1F1B for v > 1) and recomputation that cannot
/// be expressed per stage; and the batch of a step of `microbatches` microbatches per
/// replica ([`megatron_batch`]).
///
/// # Errors
/// As [`megatron_layout`].
pub fn megatron(plan: &Plan, profile: &Profile, microbatches: u32) -> Result<String> {
    let layout = megatron_layout(plan, profile)?;
    let mut out = String::new();
    if let Some(runs) = megatron_runs_instead(plan) {
        out.push_str(&format!(
            "# warning: Megatron-LM has no {} schedule; these arguments run its {runs} on the same layout (the predicted step time is {}'s)\n",
            plan.run.source.name(), plan.run.source.name()
        ));
    }
    let (mut args, mut warnings) = megatron_recompute(plan, profile);
    megatron_overlap(plan, &mut args, &mut warnings);
    let (batch, batch_warnings) = megatron_batch(plan, microbatches);
    args.extend(batch);
    warnings.extend(batch_warnings);
    args.extend(megatron_context_parallel(plan, &mut warnings)?);
    // Megatron-LM's sharded data parallelism under PP is its distributed optimizer (ZeRO-1,
    // `--use-distributed-optimizer`); deeper sharding is warned.
    if plan.run.dp > 1 && plan.run.sharding != Sharding::Ddp {
        args.push("--use-distributed-optimizer".into());
        if plan.run.sharding != Sharding::Zero1 {
            warnings.push(format!(
                "the plan shards as {}; Megatron-LM runs its distributed optimizer (ZeRO-1: optimizer state sharded, weights and gradients not), which holds more memory per rank (a plan with sharding zero1 predicts it)",
                plan.run.sharding
            ));
        }
    }
    for w in &warnings {
        out.push_str(&format!("# warning: {w}\n"));
    }
    let (tp, sp) = plan.tensor_parallel();
    if tp > 1 {
        out.push_str(&format!("--tensor-model-parallel-size {tp} \\\n"));
        if sp {
            out.push_str("--sequence-parallel \\\n");
        }
    }
    out.push_str(&megatron_experts(plan, profile));
    let mtp = profile.layers.iter().filter(|l| l.shape.mtp).count();
    if mtp > 0 {
        // The layout's `m` layers (`megatron/training/arguments.py`: `--mtp-num-layers`).
        out.push_str(&format!("--mtp-num-layers {mtp} \\\n"));
    }
    out.push_str(&format!(
        "--pipeline-model-parallel-size {} \\\n",
        plan.run.pp
    ));
    out.push_str(&format!("--pipeline-model-parallel-layout \"{layout}\""));
    for a in args {
        out.push_str(&format!(" \\\n{a}"));
    }
    out.push('\n');
    Ok(out)
}

/// For a combined-1F1B plan, adds Megatron-LM's `--overlap-moe-expert-parallel-comm` (its
/// combined 1F1B) to `args`, the plan's other Megatron arguments, or to `warnings` why Megatron
/// refuses it for this plan (`TransformerConfig.__post_init__`: expert parallelism, a virtual
/// pipeline when `pp > 1`, no full recomputation); nothing for other schedules.
fn megatron_overlap(plan: &Plan, args: &mut Vec<String>, warnings: &mut Vec<String>) {
    if plan.schedule() != Some(ScheduleKind::Combined1F1B) {
        return;
    }
    let v = plan.run.stages.len() as u32 / plan.run.pp.max(1);
    let why = if plan.ep <= 1 {
        Some("it needs expert parallelism (ep > 1) and the plan has none")
    } else if plan.run.pp > 1 && v < 2 {
        Some("it needs a virtual pipeline when pp > 1")
    } else if args.iter().any(|a| a == "--recompute-granularity full") {
        Some("it refuses full recomputation, which the plan runs")
    } else {
        None
    };
    match why {
        None => args.push("--overlap-moe-expert-parallel-comm".into()),
        Some(why) => warnings.push(format!(
            "Megatron-LM's combined 1F1B (--overlap-moe-expert-parallel-comm) is left out: {why}; these arguments run interleaved 1F1B without the overlap (the predicted step time is combined-1f1b's)"
        )),
    }
}

/// Megatron-LM's mixture-of-experts arguments for `plan` on `profile`'s model, one per line
/// (empty for a dense model): the experts and the router's top-k of its first
/// mixture-of-experts layer (`--num-experts`, `--moe-router-topk`), the expert-parallel degree
/// and the expert tensor-parallel degree flatpipe models (the tensor-parallel size, Megatron's
/// default made explicit), and the all-to-all token dispatcher whose cost the plan predicted
/// (`--moe-token-dispatcher-type alltoall`; `megatron/training/arguments.py`). Under
/// node-limited routing (`max_nodes`) across `n > 1` nodes, Megatron's group-limited routing
/// with one group per node (`--moe-router-num-groups n --moe-router-group-topk min(M, n)`, the
/// "node-limited" use its help text gives), where `n` divides the experts and the group top-k
/// divides the router's top-k (`TransformerConfig.__post_init__`'s checks).
fn megatron_experts(plan: &Plan, profile: &Profile) -> String {
    let Some(moe) = profile.layers.iter().find(|l| l.shape.experts > 0) else {
        return String::new();
    };
    let (tp, _) = plan.tensor_parallel();
    let mut out = format!(
        "--num-experts {} \\\n--moe-router-topk {} \\\n--expert-model-parallel-size {} \\\n--expert-tensor-parallel-size {tp} \\\n--moe-token-dispatcher-type alltoall \\\n",
        moe.shape.experts, moe.shape.top_k, plan.ep
    );
    let nodes = (u64::from(plan.ep) * u64::from(tp))
        .div_ceil(u64::from(profile.hardware.gpus_per_node.max(1)));
    let group_topk = moe.shape.max_nodes.min(nodes);
    if moe.shape.max_nodes > 0
        && nodes > 1
        && moe.shape.experts % nodes == 0
        && moe.shape.top_k % group_topk == 0
    {
        out.push_str(&format!(
            "--moe-router-num-groups {nodes} \\\n--moe-router-group-topk {group_topk} \\\n"
        ));
    }
    out
}

/// verl's actor settings for `plan` as Hydra overrides of its Megatron trainer configuration
/// (`verl/trainer/config/ppo_megatron_trainer.yaml`, verl 0.7.0), one `key=value` per line for
/// `python -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer`:
/// - dynamic batching with the plan's token budget per microbatch
///   (`actor_rollout_ref.actor.use_dynamic_bsz=True`, `ppo_max_token_len_per_gpu`; the
///   reference model's and the rollout's log-prob passes take the actor's by default);
/// - the pipeline and tensor parallelism of the plan (`megatron.pipeline_model_parallel_size`,
///   `virtual_pipeline_model_parallel_size` for v > 1, `tensor_model_parallel_size`,
///   `sequence_parallel`), the expert parallelism (`expert_model_parallel_size`,
///   `expert_tensor_parallel_size`), and the recomputation ([`megatron_recompute`]) and a
///   combined-1F1B plan's `overlap_moe_expert_parallel_comm` (`megatron_overlap`), as
///   `megatron.override_transformer_config` fields.
///
/// `# warning:` lines say where verl runs something else: Megatron's 1F1B or interleaved
/// schedule, verl's own microbatching (Karmarkar-Karp over the token budget,
/// `verl/utils/seqlen_balancing.py`, `rearrange_micro_batches`, which also rounds the
/// microbatch count up to a multiple of the virtual stages: the plan's policy `verl-kk` predicts
/// it), and its distributed optimizer for any data-parallel sharding.
///
/// # Errors
/// As [`megatron_layout`]: verl runs Megatron's layout, which has no V placement.
pub fn verl(plan: &Plan, profile: &Profile) -> Result<String> {
    megatron_layout(plan, profile)?;
    let pp = plan.run.pp.max(1);
    let v = plan.run.stages.len() as u32 / pp;
    let mut head = String::from(
        "# verl 0.7 actor settings (Hydra overrides for python -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer); generated by flatpipe\n",
    );
    if let Some(runs) = megatron_runs_instead(plan) {
        head.push_str(&format!(
            "# warning: verl runs Megatron-LM's {runs} schedule, not {} (the predicted step time is {}'s)\n",
            plan.run.source.name(),
            plan.run.source.name()
        ));
    }
    if plan.run.policy != flatpipe_simulator::batching::policy::Policy::VerlKk {
        head.push_str(&format!(
            "# warning: verl cuts each step into microbatches itself (Karmarkar-Karp under ppo_max_token_len_per_gpu, rounded up to a multiple of the virtual stages); the plan predicted its policy {} (a plan made for the verl export predicts verl's)\n",
            plan.run.policy
        ));
    }
    if plan.run.dp > 1 && !matches!(plan.run.sharding, Sharding::Zero1 | Sharding::Ddp) {
        // DDP exports use_distributed_optimizer=False below; ZeRO-1 is verl's default.
        head.push_str(&format!(
            "# warning: the plan shards as {}; verl's Megatron workers run Megatron's distributed optimizer (ZeRO-1)\n",
            plan.run.sharding
        ));
    }
    let actor = "actor_rollout_ref.actor";
    let mut out = vec![
        format!("{actor}.strategy=megatron"),
        format!("{actor}.use_dynamic_bsz=True"),
        format!(
            "{actor}.ppo_max_token_len_per_gpu={}",
            plan.run.params.token_budget
        ),
        format!("{actor}.megatron.pipeline_model_parallel_size={pp}"),
        format!(
            "{actor}.megatron.virtual_pipeline_model_parallel_size={}",
            if v > 1 { v.to_string() } else { "null".into() }
        ),
    ];
    if plan.run.sharding == Sharding::Ddp {
        out.push(format!("{actor}.megatron.use_distributed_optimizer=False"));
    }
    let (tp, sp) = plan.tensor_parallel();
    out.push(format!("{actor}.megatron.tensor_model_parallel_size={tp}"));
    out.push(format!(
        "{actor}.megatron.sequence_parallel={}",
        if tp > 1 && sp { "True" } else { "False" }
    ));
    if plan.ep > 1 {
        // verl's McoreEngineConfig: the experts split over the data-parallel GPUs.
        out.push(format!(
            "{actor}.megatron.expert_model_parallel_size={}",
            plan.ep
        ));
        out.push(format!("{actor}.megatron.expert_tensor_parallel_size={tp}"));
    }
    let (mut args, mut warnings) = megatron_recompute(plan, profile);
    megatron_overlap(plan, &mut args, &mut warnings);
    for w in warnings {
        head.push_str(&format!("# warning: {w}\n"));
    }
    let over = format!("{actor}.megatron.override_transformer_config");
    for a in args {
        // `--recompute-granularity full` -> `recompute_granularity=full`.
        let mut words = a.trim_start_matches("--").splitn(2, ' ');
        let key = words.next().unwrap_or_default().replace('-', "_");
        let value = words.next().unwrap_or("True");
        out.push(format!("{over}.{key}={value}"));
    }
    Ok(head + &out.join("\n") + "\n")
}

/// Megatron-LM's recomputation arguments closest to the plan's per-stage [`flatpipe_simulator::costs::Recompute`] modes,
/// and warnings where they differ. Megatron-LM applies one setting to every transformer layer
/// (`megatron/core/transformer/transformer_config.py`, `TransformerConfig.__post_init__`:
/// `selective` takes no `--recompute-method` nor `--recompute-num-layers`; `full` needs a method,
/// `uniform` or `block`, and `--recompute-num-layers`):
/// - every decoder stage `none`: nothing;
/// - every decoder stage `full`: `--recompute-granularity full --recompute-method uniform
///   --recompute-num-layers 1` (each layer rerun from its input, flatpipe's `full`);
/// - every decoder stage `selective`: `--recompute-granularity selective` (Megatron's default
///   module, `core_attn`: the attention core is recomputed; flatpipe's `selective` also
///   recomputes the elementwise work, so Megatron keeps more activation memory: warned);
/// - `full` on some stages: `--recompute-granularity full --recompute-method block
///   --recompute-num-layers N`, N the most decoder layers of a `full` stage: Megatron reruns
///   the first N layers of every (virtual) stage; the stages this changes are warned;
/// - `selective` and `none` mixed: `selective` everywhere, warned.
pub fn megatron_recompute(plan: &Plan, profile: &Profile) -> (Vec<String>, Vec<String>) {
    use flatpipe_simulator::costs::Recompute;
    let decoders = |s: usize| -> usize {
        let r = &plan.run.stages[s];
        profile.layers.get(r.start..r.end).map_or(0, |ls| {
            ls.iter().filter(|l| l.kind == LayerKind::Decoder).count()
        })
    };
    let modes: Vec<(usize, Recompute)> = (0..plan.run.stages.len())
        .filter(|&s| decoders(s) > 0)
        .map(|s| (s, plan.run.recompute_of(s)))
        .collect();
    let count = |m: Recompute| modes.iter().filter(|(_, x)| *x == m).count();
    let list = |pred: &dyn Fn(usize, Recompute) -> bool| -> String {
        modes
            .iter()
            .filter(|(s, m)| pred(*s, *m))
            .map(|(s, _)| s.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let selective_note = "Megatron-LM's selective recomputation reruns the attention core only (--recompute-modules core_attn, its default); flatpipe's selective also reruns the norms, rotary and SwiGLU, so Megatron keeps more activation memory on those stages than the plan counts";
    let n = modes.len();
    let (full, selective) = (count(Recompute::Full), count(Recompute::Selective));
    if full == 0 && selective == 0 {
        return (Vec::new(), Vec::new());
    }
    if full == n {
        return (
            vec![
                "--recompute-granularity full".into(),
                "--recompute-method uniform".into(),
                "--recompute-num-layers 1".into(),
            ],
            Vec::new(),
        );
    }
    if full == 0 {
        let mut warnings = vec![selective_note.to_string()];
        if selective < n {
            warnings.push(format!(
                "Megatron-LM cannot recompute per stage: selective recomputation applies to every layer, also on {} that the plan keeps without recomputation (slower than predicted)",
                stage_list(&[list(&|_, m| m == Recompute::None)])
            ));
        }
        return (vec!["--recompute-granularity selective".into()], warnings);
    }
    let most = modes
        .iter()
        .filter(|(_, m)| *m == Recompute::Full)
        .map(|(s, _)| decoders(*s))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut warnings = vec![format!(
        "Megatron-LM cannot recompute per stage: --recompute-method block reruns the first {most} decoder layers of every virtual stage"
    )];
    let slower = list(&|_, m| m != Recompute::Full);
    if !slower.is_empty() {
        warnings.push(format!(
            "stages {slower}, planned without full recomputation, are fully recomputed on their first {most} decoder layers (slower than predicted)"
        ));
    }
    let more_memory = list(&|s, m| m == Recompute::Selective && decoders(s) > most);
    if !more_memory.is_empty() {
        warnings.push(format!(
            "stages {more_memory}, planned with selective recomputation, keep every activation of their layers after the first {most} (more memory than the plan counts)"
        ));
    }
    (
        vec![
            "--recompute-granularity full".into(),
            "--recompute-method block".into(),
            format!("--recompute-num-layers {most}"),
        ],
        warnings,
    )
}

/// Parses a Megatron layout string into, per stage, (has embedding, decoder layers, has loss).
/// Supports `x*n` and `(...)*n` repetition; commas and spaces are cosmetic.
///
/// # Errors
/// [`Error::Export`] naming the offending character.
pub fn parse_megatron_layout(layout: &str) -> Result<Vec<(bool, usize, bool)>> {
    let bad = |reason: String| Error::Export {
        format: "megatron",
        reason,
    };
    fn expand(s: &str, bad: &dyn Fn(String) -> Error) -> Result<String> {
        let chars: Vec<char> = s
            .chars()
            .filter(|c| !c.is_whitespace() && *c != ',')
            .collect();
        let mut out = String::new();
        let mut i = 0;
        while i < chars.len() {
            let (unit, next) = if chars[i] == '(' {
                let mut depth = 0;
                let mut j = i;
                loop {
                    match chars.get(j) {
                        Some('(') => depth += 1,
                        Some(')') => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        Some(_) => {}
                        None => return Err(bad(format!("unclosed ( at {i}"))),
                    }
                    j += 1;
                }
                (
                    expand(&chars[i + 1..j].iter().collect::<String>(), bad)?,
                    j + 1,
                )
            } else {
                (chars[i].to_string(), i + 1)
            };
            i = next;
            let mut times = 1;
            if chars.get(i) == Some(&'*') {
                let start = i + 1;
                let mut end = start;
                while end < chars.len() && chars[end].is_ascii_digit() {
                    end += 1;
                }
                times = chars[start..end]
                    .iter()
                    .collect::<String>()
                    .parse()
                    .map_err(|_| bad(format!("`*` at {i} needs a count")))?;
                i = end;
            }
            out.push_str(&unit.repeat(times));
        }
        Ok(out)
    }
    let flat = expand(layout, &bad)?;
    flat.split('|')
        .map(|stage| {
            let (mut e, mut t, mut l) = (false, 0, false);
            for c in stage.chars() {
                match c {
                    'E' => e = true,
                    't' => t += 1,
                    'L' => l = true,
                    'm' => {}
                    other => return Err(bad(format!("unknown layer `{other}` (E, t, m, L)"))),
                }
            }
            Ok((e, t, l))
        })
        .collect()
}

/// `stage 7` or `stages 5, 7` (`ids` already formatted; one entry may hold a list).
fn stage_list(ids: &[String]) -> String {
    let joined = ids.join(", ");
    if joined.contains(',') {
        format!("stages {joined}")
    } else {
        format!("stage {joined}")
    }
}

/// The plan's context-parallel group (`None` for none or a group of one GPU) and the token
/// count a row of its microbatches must divide: each sequence is cut into `2 cp` chunks for the
/// zigzag split, and sequence parallelism cuts the row over `tp` (torchtitan's
/// `ParallelDims.seq_len_divisor`, `tp x 2 cp`; Megatron-LM's `get_batch_on_this_cp_rank`
/// splits a sample into `2 cp` chunks).
fn cp_group(plan: &Plan) -> Option<(ContextParallel, u64)> {
    let cp = plan.run.context_parallel.filter(|c| c.cp > 1)?;
    let (tp, sp) = plan.tensor_parallel();
    let tp = if sp { u64::from(tp) } else { 1 };
    Some((cp, 2 * u64::from(cp.cp) * tp))
}

/// A refusal when the plan's token budget (the target's sequence length) is not a multiple of
/// `divisor` ([`cp_group`]).
fn check_cp_seq_len(plan: &Plan, format: &'static str, divisor: u64) -> Result<()> {
    let t = plan.run.params.token_budget;
    if plan.run.params.microbatches.is_none() && t % divisor != 0 {
        return Err(Error::Export {
            format,
            reason: format!(
                "the token budget {t} (the sequence length) is not a multiple of 2 x cp x tp = {divisor}: the target cuts each row into 2 cp chunks over the group and the row over tp; plan with budgets that are"
            ),
        });
    }
    Ok(())
}

/// torchtitan's `[parallelism]` lines for the plan's context parallelism (empty without one)
/// and warnings. torchtitan 0.2.x runs torch's ring attention (`context_parallel`): keys and
/// values rotated by all-to-all (`context_parallel_rotate_method = "alltoall"`, the plan's
/// `p2p` ring) or all-gathered (`"allgather"`), balanced by the head-tail (zigzag) split for
/// SDPA or `ptrr` for FlexAttention (`torchtitan/distributed/context_parallel.py`, `cp_shard`);
/// its flat flavor with cp is FlexAttention ([`torchtitan_model`]).
///
/// # Errors
/// [`Error::Export`] for Ulysses or hierarchical communication (torchtitan has neither) and a
/// token budget that is not a multiple of `tp x 2 cp`.
pub fn torchtitan_context_parallel(plan: &Plan) -> Result<(String, Vec<String>)> {
    let Some((cp, divisor)) = cp_group(plan) else {
        return Ok((String::new(), Vec::new()));
    };
    let rotate = match cp.comm {
        CpComm::Ring => "alltoall",
        CpComm::AllGather => "allgather",
        other => {
            return Err(Error::Export {
                format: "torchtitan",
                reason: format!(
                    "cp communication {other}: torchtitan's context parallelism is torch's ring attention, its keys and values rotated (p2p) or all-gathered (allgather); it has no Ulysses all-to-all of heads"
                ),
            });
        }
    };
    check_cp_seq_len(plan, "torchtitan", divisor)?;
    let flex = plan.run.policy.is_flat() && plan.inputs.model.as_deref() == Some("llama3.1-8b");
    let mut warnings = Vec::new();
    if cp.balance == CpBalance::Contiguous {
        warnings.push(format!(
            "the plan cuts each sequence into {} contiguous blocks; torchtitan balances the causal work ({}) and its TOML cannot switch that off (the prediction of a zigzag plan is closer)",
            cp.cp,
            if flex { "ptrr" } else { "headtail" }
        ));
    }
    if let Some(t) = cp.max_seqlen_per_rank {
        warnings.push(format!(
            "the plan runs dynamic cp (each microbatch on the fewest GPUs of the group holding its longest sequence at {t} tokens per GPU); torchtitan runs every microbatch on all {} GPUs",
            cp.cp
        ));
    }
    let lines = format!(
        "context_parallel_degree = {}\ncontext_parallel_rotate_method = \"{rotate}\"\ncontext_parallel_load_balancer = \"{}\"\n",
        cp.cp,
        if flex { "ptrr" } else { "headtail" }
    );
    Ok((lines, warnings))
}

/// Megatron-LM's context-parallel arguments for the plan (none without a group):
/// `--context-parallel-size`, `--cp-comm-type` (`p2p`, `a2a`, `allgather`, `a2a+p2p`) and, for
/// `a2a+p2p`, `--hierarchical-context-parallel-sizes` (the all-to-all inside a node, then the
/// ring; their product is cp: `megatron/training/arguments.py`). Megatron-LM always splits a
/// sample into `2 cp` chunks, zigzag (a contiguous plan is warned), and runs a fixed group
/// under a pipeline (dynamic cp is refused with PP > 1 by Megatron-Bridge: warned, exported
/// fixed).
///
/// # Errors
/// [`Error::Export`] for a token budget that is not a multiple of `2 cp x tp`.
fn megatron_context_parallel(plan: &Plan, warnings: &mut Vec<String>) -> Result<Vec<String>> {
    let Some((cp, divisor)) = cp_group(plan) else {
        return Ok(Vec::new());
    };
    check_cp_seq_len(plan, "megatron", divisor)?;
    let mut args = vec![format!("--context-parallel-size {}", cp.cp)];
    match cp.comm {
        CpComm::Hierarchical { a2a } => {
            args.push("--cp-comm-type a2a+p2p".into());
            args.push(format!(
                "--hierarchical-context-parallel-sizes {a2a} {}",
                cp.cp / a2a.max(1)
            ));
        }
        other => args.push(format!("--cp-comm-type {other}")),
    }
    if cp.balance == CpBalance::Contiguous {
        warnings.push(format!(
            "the plan cuts each sequence into {} contiguous blocks; Megatron-LM always cuts 2 cp chunks, zigzag (balanced)",
            cp.cp
        ));
    }
    if let Some(t) = cp.max_seqlen_per_rank {
        warnings.push(format!(
            "the plan runs dynamic cp (each microbatch on the fewest GPUs of the group holding its longest sequence at {t} tokens per GPU); Megatron's dynamic cp does not run with a pipeline, so these arguments run a fixed group of {}",
            cp.cp
        ));
    }
    Ok(args)
}

#[cfg(test)]
mod median_tests {
    use super::median_step;

    #[test]
    fn the_median_step_is_the_lower_median_with_ties_to_the_lower_index() {
        // Counts 5, 3, 4, 3: sorted 3, 3, 4, 5; the lower median is 3, first at step 1.
        assert_eq!(median_step(&[5, 3, 4, 3]), Some(1));
        // Odd: 7, 2, 9 -> sorted (2@1, 7@0, 9@2), the middle: step 0.
        assert_eq!(median_step(&[7, 2, 9]), Some(0));
        // All equal: the lowest index.
        assert_eq!(median_step(&[4, 4, 4]), Some(0));
        assert_eq!(median_step(&[]), None);
    }
}
