//! `flatpipe schedule`: generate a schedule, print its grid, write PyTorch's CSV.

use super::*;

/// Options of `flatpipe schedule`.
#[derive(Debug, Args)]
pub(super) struct ScheduleArgs {
    /// Schedule kind (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v, dualpipev,
    /// zb-auto: for unit costs under 1F1B memory).
    #[arg(long)]
    schedule: String,
    /// Pipeline-parallel degree (ranks).
    #[arg(long)]
    pp: u32,
    /// Stages per rank (interleaved schedules; default 2).
    #[arg(long)]
    vpp: Option<u32>,
    /// Microbatches per step.
    #[arg(long)]
    microbatches: u32,
    /// Add this many forward-only microbatches (`Fo`: a frozen reference or teacher forward),
    /// placed for unit costs (f = b = w = fo).
    #[arg(long, default_value_t = 0)]
    fo_microbatches: u32,
    /// `fused` into the training schedule's bubbles (default) or a `separate` pass first.
    #[arg(long, default_value = "fused", value_parser = ["fused", "separate"])]
    fo_mode: String,
    /// Training microbatch i's loss needs forward-only microbatch i.
    #[arg(long)]
    fo_loss_dependency: bool,
    /// Write `Fo` actions to the CSV (flatpipe's extension, e.g. `2Fo5`; PyTorch cannot read
    /// them). Without it a schedule with `Fo` is refused.
    #[arg(long)]
    fo_extension: bool,
    /// Write PyTorch's compute-only pipeline-order CSV here (atomically).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Output format of the grid.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

pub(super) fn schedule_cmd(a: ScheduleArgs) -> Result<ExitCode> {
    let kind: ScheduleKind = a.schedule.parse()?;
    let v = kind.stages_per_rank(a.vpp)?;
    let mut s = kind.generate(a.pp, v, a.microbatches)?;
    if a.fo_microbatches > 0 {
        let mode = match a.fo_mode.as_str() {
            "separate" => sim::forward_only::FoMode::Separate,
            _ => sim::forward_only::FoMode::Fused,
        };
        let costs = UniformCosts::new(&UniformCostSpec::default(), v);
        s = sim::forward_only::with_forward_only(
            &s,
            a.fo_microbatches,
            mode,
            a.fo_loss_dependency,
            &costs,
        )?;
    }
    if let Some(path) = &a.output {
        let csv = sim::pytorch_csv::write_pytorch_csv(&s, a.fo_extension).map_err(|e| {
            anyhow::anyhow!("{e} (--fo-extension writes them as flatpipe's `2Fo5` cells)")
        })?;
        profiles::write_atomic(path, csv.as_bytes())?;
    }
    match a.format {
        Format::Json => {
            let ranks: Vec<Vec<String>> = s
                .ranks
                .iter()
                .map(|r| r.iter().map(ToString::to_string).collect())
                .collect();
            let doc = serde_json::json!({
                "schedule": kind.name(), "pp": a.pp, "vpp": v, "microbatches": a.microbatches,
                "placement": format!("{:?}", s.placement.kind).to_lowercase(), "ranks": ranks,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Format::Table => {
            println!(
                "{kind}: p={} v={v} m={} ({:?} placement)",
                a.pp, a.microbatches, s.placement.kind
            );
            print!("{}", s.grid());
        }
    }
    if let Some(path) = &a.output {
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
