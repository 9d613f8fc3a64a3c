//! `flatpipe schedule`: generate a schedule, print its grid, write PyTorch's CSV.

use super::*;

/// Options of `flatpipe schedule`.
#[derive(Debug, Args)]
pub(super) struct ScheduleArgs {
    /// Schedule kind (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zb-h2, zb-v, dualpipev,
    /// combined-1f1b, zb-auto: for unit costs under 1F1B memory).
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
    /// Forward-only work, placed for unit costs (f = b = w = fo).
    #[command(flatten)]
    fo: FoArgs,
    /// Write `Fo` actions to the CSV (flatpipe's extension, e.g. `2Fo5`; PyTorch cannot read
    /// them). Without it a schedule with `Fo` is refused.
    #[arg(long)]
    fo_extension: bool,
    /// Write PyTorch's compute-only pipeline-order CSV here (atomically).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With --output, write the compute-and-communication CSV instead (the `compute_comms`
    /// format of PyTorch's `_PipelineScheduleRuntime._load_csv`): the schedule lowered with
    /// `SEND_*` / `RECV_*` and 2.15's `WAIT_SEND_*` actions, receives placed `ahead` (PyTorch's
    /// own lowering, `_add_send_recv`) or `deferred` (its `defer_pp_recv=True`).
    #[arg(long, value_enum, requires = "output", value_name = "POSTING")]
    comms: Option<super::simulate::P2pPosting>,
    /// With --comms, also FSDP's per-stage actions (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`,
    /// `WAIT_REDUCE_GRAD`) as PyTorch 2.15's compute-only loader adds them, with this many
    /// stages gathered at once (its `max_active_stages`, default 3): the whole program torch
    /// runs for a sharded model.
    #[arg(long, requires = "comms", value_name = "MAX_ACTIVE_STAGES", num_args = 0..=1, default_missing_value = "3")]
    fsdp: Option<u32>,
    /// With --fsdp: each `WAIT_REDUCE_GRAD` deferred to the rank's next reduction or the end
    /// (PyTorch's `defer_reduce_grad_wait`).
    #[arg(long, requires = "fsdp")]
    fsdp_defer_wait: bool,
    /// Output format of the grid.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

pub(super) fn schedule_cmd(a: ScheduleArgs) -> Result<ExitCode> {
    let kind: ScheduleKind = a.schedule.parse()?;
    let v = kind.stages_per_rank(a.vpp)?;
    check_schedule_memory(
        &format!(
            "--microbatches {} with --pp {} and v = {v}",
            a.microbatches, a.pp
        ),
        f64::from(a.pp) * f64::from(v) * f64::from(a.microbatches),
    )?;
    warn_underfilled(kind.name(), a.microbatches, a.pp, v);
    let mut s = kind.generate(a.pp, v, a.microbatches)?;
    if let Some(fo) = a.fo.spec()? {
        let costs = UniformCosts::new(&UniformCostSpec::default(), v);
        let k = fo.microbatches.unwrap_or(a.microbatches);
        s = sim::schedules::forward_only::with_forward_only(
            &s,
            k,
            fo.mode,
            fo.loss_dependency,
            &costs,
        )?;
    }
    if let Some(path) = &a.output {
        let csv = match a.comms {
            None => sim::ir::pytorch_csv::write_pytorch_csv(&s, a.fo_extension).map_err(|e| {
                anyhow::anyhow!("{e} (--fo-extension writes them as flatpipe's `2Fo5` cells)")
            })?,
            Some(posting) => {
                let lowering = sim::ir::lowering::Lowering {
                    posting: posting.into(),
                    fsdp: a.fsdp,
                    fsdp_defer_wait: a.fsdp_defer_wait,
                    ..Default::default()
                };
                let lowered = sim::ir::lowering::lower(&s, lowering)?;
                // Written as PyTorch would lower it (the interop check compares the two), with
                // a warning where NCCL or gloo would pair its sends and receives wrongly.
                if let Err(e) = sim::ir::lowering::check_pair_order(&s, lowering.posting) {
                    tracing::warn!("{e}");
                }
                sim::ir::pytorch_csv::write_pytorch_comms_csv(&lowered)?
            }
        };
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
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Format::Table => {
            outln!(
                "{kind}: p={} v={v} m={} ({:?} placement)",
                a.pp,
                a.microbatches,
                s.placement.kind
            );
            out!("{}", s.grid());
        }
    }
    if let Some(path) = &a.output {
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
