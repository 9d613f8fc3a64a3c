//! `flatpipe profile`: measure the executor's kernels, links and optimizer on this machine and
//! write a measured profile.

use super::*;
use backend::{backend_config, measure};

/// Options of `flatpipe profile`.
#[derive(Debug, Args)]
pub(super) struct ProfileArgs {
    /// Backend whose kernels are measured.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    backend: Backend,
    /// Model (YAML file or built-in name). Default tiny.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// GEMM arithmetic on --backend cuda (bf16: tensor-core math with fp32 accumulation).
    #[arg(long, value_enum, default_value_t = GemmPrecision::Fp32)]
    precision: GemmPrecision,
    /// On --backend cuda: 1 (default) measures the link between two streams of GPU 0, as
    /// ranks sharing a GPU run; 2 or more a peer copy from GPU 1 to GPU 0 (one GPU per rank).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    gpus: u32,
    /// Hardware description to start from (memory, peak FLOP/s); the profile replaces its
    /// name and links with what was measured. Default cpu (h200 on --backend cuda).
    #[arg(long)]
    hardware: Option<String>,
    /// A coarse grid (T in {32, 128, 512, 1024, 2048}, 3 timed rounds): about 25 s for tiny on
    /// 2 cores. (On a GPU the grid is T in {1024, 4096, 16384} either way.)
    #[arg(long)]
    quick: bool,
    /// Threads running the same kernels at once while measuring: the ranks that will share this
    /// machine (a 2-rank plan on 2 cores: 2; on a GPU, p ranks as p busy streams). Default 1.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Where to write the profile (YAML, atomically).
    #[arg(short, long, default_value = "flatpipe-profile.yaml")]
    output: PathBuf,
    /// Output format of the summary.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Debug, Serialize)]
struct FitRow {
    kind: String,
    phase: String,
    c0_s: f64,
    c_tok_s: f64,
    c_attn_s: f64,
    r2: f64,
    max_rel_residual: f64,
}

#[derive(Debug, Serialize)]
struct ProfileReport {
    output: String,
    device: String,
    fits: Vec<FitRow>,
    link_alpha_s: f64,
    link_beta_bytes_per_s: f64,
    optimizer_s_per_param: f64,
    seconds: f64,
}

pub(super) fn profile_cmd(a: ProfileArgs) -> Result<ExitCode> {
    let backend = backend_config(a.backend.resolve_for_stages()?, a.precision, a.gpus, false)?;
    profiles::check_writable(&a.output)?;
    let model = builtins::model(&a.model)?;
    if let Some(hw) = &a.hardware {
        builtins::hardware(hw)?;
    }
    if a.concurrency == 0 {
        bail!("--concurrency = 0 is invalid: >= 1 thread (or stream)");
    }
    let mut cfg = backend.backend.profile_config(a.quick);
    cfg.concurrency = a.concurrency;
    if backend.backend == executor::backend::Backend::Cpu {
        check_profile_memory(&model, &cfg, super::checks::available_memory_bytes())?;
    }
    let start = std::time::Instant::now();
    let profile = measure(&backend, &model, a.hardware.as_deref(), &cfg)?;
    profiles::write_atomic(&a.output, profile.to_yaml()?.as_bytes())?;
    let mut fits = Vec::new();
    for fq in &profile.provenance.fits {
        let l = profile
            .layers
            .iter()
            .find(|l| l.kind == fq.kind)
            .expect("a fit per present kind");
        let c = l.coeffs(fq.phase);
        fits.push(FitRow {
            kind: format!("{:?}", fq.kind).to_lowercase(),
            phase: format!("{:?}", fq.phase),
            c0_s: c.c0_s,
            c_tok_s: c.c_tok_s,
            c_attn_s: c.c_attn_s,
            r2: fq.r2,
            max_rel_residual: fq.max_rel_residual,
        });
    }
    let report = ProfileReport {
        output: a.output.display().to_string(),
        device: profile.provenance.device.clone(),
        fits,
        link_alpha_s: profile.hardware.intra_node.alpha_s,
        link_beta_bytes_per_s: profile.hardware.intra_node.beta_bytes_per_s,
        optimizer_s_per_param: profile.optimizer_s_per_param,
        seconds: start.elapsed().as_secs_f64(),
    };
    let header = format!(
        "{} measured on {} in {:.1} s ({})",
        model.name,
        report.device,
        report.seconds,
        profile.provenance.grid.as_deref().unwrap_or("")
    );
    let mut t = new_table(&[
        "layer",
        "phase",
        "c0",
        "per token",
        "per attn pair",
        "R²",
        "max rel. residual",
    ]);
    for f in &report.fits {
        t.add_row([
            f.kind.clone(),
            f.phase.clone(),
            format!("{:.1} us", f.c0_s * 1e6),
            format!("{:.3} us", f.c_tok_s * 1e6),
            format!("{:.3} ns", f.c_attn_s * 1e9),
            format!("{:.4}", f.r2),
            pct(f.max_rel_residual),
        ]);
    }
    let mut notes = vec![
        format!(
            "link: {:.1} us + bytes / {:.3e} B/s; optimizer: {:.2} ns per parameter",
            report.link_alpha_s * 1e6,
            report.link_beta_bytes_per_s,
            report.optimizer_s_per_param * 1e9
        ),
        format!(
            "Profile written to {} (use it: flatpipe simulate|plan|execute --profile {})",
            report.output, report.output
        ),
    ];
    for g in &profile.gemm_split {
        notes.push(format!(
            "GEMMs split {} ways (tensor parallelism): {:.3} of the whole layer's FLOP rate at T = {}",
            g.tp, g.relative_throughput, g.tokens
        ));
    }
    notes.extend(executor::backend::gemm_rates(backend.backend)?);
    emit(a.format, &report, &header, &t, &notes)
}

/// Refuses, before anything is allocated, a CPU profile this machine cannot hold: its optimizer
/// measurement builds the whole model (`profile_optimizer`: fp32 weights, gradients and both
/// AdamW moments, 16 bytes per parameter, over its `concurrency` parts at once), and each layer
/// kind runs the grid's largest microbatch
/// ([`flatpipe_executor::cpu::MemoryFloor`]; `available`: the host's available memory, `None`
/// where unknown: no check).
fn check_profile_memory(
    model: &profiles::ModelSpec,
    cfg: &executor::profiler::ProfileConfig,
    available: Option<f64>,
) -> Result<()> {
    let largest = cfg.tokens.iter().copied().max().unwrap_or(0) as u64;
    let floor = executor::cpu::MemoryFloor::of(model, largest);
    let need = floor.state + floor.activations;
    if let Some(have) = available
        && need > have
    {
        bail!(
            "profiling {} on the CPU backend needs at least {}: {} of fp32 weights, gradients and AdamW state for the optimizer's measurement ({} parameters x 16 bytes) and {} of activations ({largest} tokens in every layer); this machine has {} available. Profile a smaller model, or use the analytic profile (--model {} --hardware H in simulate and plan)",
            model.name,
            fmt_bytes(need),
            fmt_bytes(floor.state),
            model.param_count(),
            fmt_bytes(floor.activations),
            fmt_bytes(have),
            model.name
        );
    }
    Ok(())
}
