//! `plan --export`: the chosen plan's median sampled step written for torchtitan, Megatron-LM or
//! PyTorch's CSV, with what the target runs instead.

use super::*;

/// A file `--export` writes: its extension beside the plan, and its text.
pub(super) type ExportText = (&'static str, String);

/// Files an export references, each with its path and text.
pub(super) type ExtraFiles = Vec<(PathBuf, String)>;

/// The `--export` of the chosen `plan` (on `profile`) and the files it references (a
/// torchtitan schedule CSV), each with its path. The schedule exported is the one the plan's
/// prediction ran on its median sampled step (`planner::export::exported_step`, on the per-GPU
/// profile `per_gpu`), so a zb-auto plan exports the order its prediction searched; what the
/// target runs instead of the plan (chunks, forward-only work, a per-step microbatch count) is
/// said on stderr (CSV, torchtitan) and in `# warning:` lines (Megatron).
///
/// # Errors
/// A torchtitan export of a schedule without a torchtitan name and no `-o` (the CSV needs a
/// place); the exporters'.
pub(super) fn export(
    a: &PlanArgs,
    plan: &Plan,
    profile: &Profile,
    step: &planner::export::ExportedStep,
) -> Result<(Option<ExportText>, ExtraFiles)> {
    let mut extra_files: ExtraFiles = Vec::new();
    let Some(format) = a.export else {
        return Ok((None, extra_files));
    };
    let warn_stderr = || {
        for w in &step.warnings {
            eprintln!("warning: --export {}: {w}", format.name());
        }
    };
    let export_text = match format {
        ExportFormat::Torchtitan => {
            warn_stderr();
            // A schedule without a torchtitan name runs from a CSV written next to the TOML.
            let csv = if planner::export::torchtitan_needs_csv(plan) {
                let Some(path) = &a.output else {
                    bail!(
                        "--export torchtitan: {} has no torchtitan name, so the configuration references a schedule CSV; give -o PLAN.yaml to write plan.torchtitan.toml and plan.torchtitan.csv next to it",
                        plan.run.source.name()
                    );
                };
                let csv_path = path.with_extension("torchtitan.csv");
                extra_files.push((
                    csv_path.clone(),
                    sim::ir::pytorch_csv::write_pytorch_csv(&step.schedule, false)?,
                ));
                Some(
                    csv_path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                )
            } else {
                None
            };
            (
                "torchtitan.toml",
                planner::export::torchtitan(plan, profile, step.microbatches, csv.as_deref())?,
            )
        }
        ExportFormat::Megatron => {
            let mut text = planner::export::megatron(plan, profile, step.microbatches)?;
            let at = text.find('\n').map_or(0, |i| i + 1);
            let warnings: String = step
                .warnings
                .iter()
                .map(|w| format!("# warning: {w}\n"))
                .collect();
            text.insert_str(at, &warnings);
            ("megatron.txt", text)
        }
        ExportFormat::Verl => {
            let mut text = planner::export::verl(plan, profile)?;
            let at = text.find('\n').map_or(0, |i| i + 1);
            let warnings: String = step
                .warnings_for(false)
                .iter()
                .map(|w| format!("# warning: {w}\n"))
                .collect();
            text.insert_str(at, &warnings);
            ("verl.txt", text)
        }
        ExportFormat::PytorchCsv => {
            warn_stderr();
            (
                "pytorch.csv",
                sim::ir::pytorch_csv::write_pytorch_csv(&step.schedule, false)?,
            )
        }
    };
    Ok((Some(export_text), extra_files))
}
