//! Exports of a plan to torchtitan, Megatron-LM and PyTorch's pipeline-order CSV
//! (formats: `shared/reference/interop.md`, gathered 2026-11).

use crate::{Error, Result};
use flatpipe_profiles::{LayerKind, Profile};
use flatpipe_simulator::ir::PlacementKind;
use flatpipe_simulator::{Plan, ScheduleKind};

/// torchtitan's `ParallelismConfig` values for `plan` as a TOML fragment: the degree, the
/// schedule name (or, for schedules torchtitan has no name for, the CSV path it should load),
/// `module_fqns_per_model_part` with torchtitan's Llama module names, the microbatch count and
/// the token budget as `num_tokens_per_microbatch_per_dp_rank`.
///
/// # Errors
/// [`Error::Export`] if a stage range leaves the profile's layers.
pub fn torchtitan(
    plan: &Plan,
    profile: &Profile,
    microbatches: u32,
    csv_path: Option<&str>,
) -> Result<String> {
    let mut parts = Vec::new();
    for (i, s) in plan.stages.iter().enumerate() {
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
    let mut out = String::from("[parallelism]\n");
    out.push_str(&format!("pipeline_parallel_degree = {}\n", plan.pp));
    if let Some(dp) = plan.dp.filter(|d| *d > 1) {
        out.push_str(&format!("data_parallel_replicate_degree = {dp}\n"));
    }
    match (plan.schedule.pytorch_name(), plan.schedule) {
        (Some(name), k) if k != ScheduleKind::Interleaved1F1B || plan.vpp.unwrap_or(2) > 1 => {
            out.push_str(&format!("pipeline_parallel_schedule = \"{name}\"\n"));
        }
        _ => {
            let path = csv_path.unwrap_or("schedule.csv");
            out.push_str(&format!(
                "pipeline_parallel_schedule_csv = \"{path}\"  # {} has no torchtitan name\n",
                plan.schedule
            ));
        }
    }
    out.push_str(&format!(
        "module_fqns_per_model_part = [{}]\n",
        parts.join(", ")
    ));
    out.push_str(&format!("num_pp_microbatches = {microbatches}\n"));
    if let Some(t) = plan.token_budget {
        out.push_str(&format!(
            "\n[training]\nnum_tokens_per_microbatch_per_dp_rank = {t}\n"
        ));
    }
    Ok(out)
}

/// Megatron-LM's `--pipeline-model-parallel-layout` string of `plan`: stages separated by `|`,
/// `E` the embedding, `t` a decoder layer, `L` the loss (head); stage list index
/// `vpp_index * pp + pp_rank`, which is flatpipe's loop placement order.
///
/// # Errors
/// [`Error::Export`] for V placements, which the layout cannot express.
pub fn megatron_layout(plan: &Plan, profile: &Profile) -> Result<String> {
    if plan.placement == PlacementKind::V
        || plan.schedule.placement_for(plan.vpp.unwrap_or(1)) == PlacementKind::V
    {
        return Err(Error::Export {
            format: "megatron",
            reason: format!(
                "{} uses the V placement (rank r holds stages r and 2p-1-r); Megatron's layout puts stage i on rank i mod pp",
                plan.schedule
            ),
        });
    }
    let mut stages = Vec::new();
    for s in &plan.stages {
        let mut text = String::new();
        for l in &profile.layers[s.start..s.end] {
            text.push(match l.kind {
                LayerKind::Embedding => 'E',
                LayerKind::Decoder => 't',
                LayerKind::Head => 'L',
            });
        }
        stages.push(text);
    }
    Ok(stages.join("|"))
}

/// The Megatron-LM arguments of `plan`, with a warning line for schedules Megatron lacks.
///
/// # Errors
/// As [`megatron_layout`].
pub fn megatron(plan: &Plan, profile: &Profile) -> Result<String> {
    let layout = megatron_layout(plan, profile)?;
    let v = plan.stages.len() as u32 / plan.pp.max(1);
    let mut out = String::new();
    if matches!(
        plan.schedule,
        ScheduleKind::ZbH1 | ScheduleKind::ZbH2 | ScheduleKind::LoopedBfs | ScheduleKind::GPipe
    ) {
        out.push_str(&format!(
            "# warning: Megatron-LM has no {} schedule; these arguments run its 1F1B{} on the same layout\n",
            plan.schedule,
            if v > 1 { " (interleaved)" } else { "" }
        ));
    }
    out.push_str(&format!("--pipeline-model-parallel-size {} \\\n", plan.pp));
    out.push_str(&format!("--pipeline-model-parallel-layout \"{layout}\""));
    if v > 1 {
        out.push_str(&format!(" \\\n--num-virtual-stages-per-pipeline-rank {v}"));
    }
    out.push('\n');
    Ok(out)
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
