//! `flatpipe profile`: measure the executor's kernels, links and optimizer on this machine and
//! write a measured profile.

use super::*;
use flatpipe_executor::profiler::{self, ProfileConfig};

/// Options of `flatpipe profile`.
#[derive(Debug, Args)]
pub(super) struct ProfileArgs {
    /// Backend whose kernels are measured.
    #[arg(long, value_enum, default_value_t = execute::Backend::Cpu)]
    backend: execute::Backend,
    /// Model (YAML file or built-in name). Default tiny.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Hardware description to start from (memory, peak FLOP/s); the profile replaces its
    /// name and links with what was measured. Default cpu.
    #[arg(long, default_value = "cpu")]
    hardware: String,
    /// A coarse grid (T in 128..2048, 3 timed rounds): about 15 s for tiny on 2 cores.
    #[arg(long)]
    quick: bool,
    /// Threads running the same kernels at once while measuring: the ranks that will share this
    /// machine (a 2-rank plan on 2 cores: 2). Default 1.
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

/// Today's date (UTC) as ISO 8601.
pub(super) fn today() -> String {
    time::OffsetDateTime::now_utc().date().to_string()
}

/// Measures `model` on the CPU backend with `cfg` (progress bar on stderr) and returns the
/// profile.
pub(super) fn measure(
    model: &profiles::ModelSpec,
    hardware: &profiles::Hardware,
    cfg: &ProfileConfig,
) -> Result<Profile> {
    let bar = indicatif::ProgressBar::new(profiler::grid_points(model, cfg));
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} profiling {msg}")
    {
        bar.set_style(style);
    }
    let measured = profiler::profile_cpu(model, cfg, &|what| {
        bar.set_message(what.to_string());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    let device = format!(
        "cpu: {} (1 thread per rank, {} busy)",
        profiler::cpu_name(),
        cfg.concurrency
    );
    Ok(profiler::to_profile(
        model,
        hardware,
        &device,
        Some(today()),
        cfg,
        &measured,
    )?)
}

/// `--backend cuda`: the device and cuBLAS fp32 GEMM rates at Llama-3.1-8B's layer shapes.
/// The per-layer F / I / W profile on the GPU needs the CUDA stage worker (not implemented yet).
fn cuda_gemms(a: &ProfileArgs) -> Result<ExitCode> {
    #[cfg(feature = "cuda")]
    {
        use flatpipe_executor::cuda;
        let dev = cuda::probe()?;
        #[derive(Serialize)]
        struct Row {
            gemm: String,
            m: usize,
            k: usize,
            n: usize,
            ms: f64,
            tflops: f64,
        }
        let mut rows = Vec::new();
        for t in [4096usize, 16384] {
            for (name, k, n) in [
                ("qkv", 4096, 6144),
                ("o", 4096, 4096),
                ("gate+up", 4096, 28672),
                ("down", 14336, 4096),
            ] {
                let g = cuda::time_gemm_f32((t, k, n), 2, 5)?;
                rows.push(Row {
                    gemm: format!("{name} T={t}"),
                    m: t,
                    k,
                    n,
                    ms: g.ms,
                    tflops: g.tflops,
                });
            }
        }
        let mut tab = new_table(&["GEMM (fp32)", "m", "k", "n", "time", "TFLOP/s"]);
        for r in &rows {
            tab.add_row([
                r.gemm.clone(),
                r.m.to_string(),
                r.k.to_string(),
                r.n.to_string(),
                format!("{:.3} ms", r.ms),
                format!("{:.1}", r.tflops),
            ]);
        }
        let header = format!(
            "{} x {} ({} GiB): cuBLAS fp32 GEMMs at Llama-3.1-8B layer shapes (CUDA events, median of 5)",
            dev.count,
            dev.name,
            dev.total_bytes >> 30
        );
        let notes = vec![format!(
            "the per-layer F / I / W profile of {} on the GPU needs the CUDA stage worker, not implemented yet",
            a.model
        )];
        emit(a.format, &rows, &header, &tab, &notes)
    }
    #[cfg(not(feature = "cuda"))]
    {
        bail!(
            "--backend cuda: {} (profile {})",
            execute::cuda_status(),
            a.model
        )
    }
}

pub(super) fn profile_cmd(a: ProfileArgs) -> Result<ExitCode> {
    match a.backend {
        execute::Backend::Cuda => return cuda_gemms(&a),
        execute::Backend::Auto => {
            a.backend.resolve_for_stages()?;
        }
        execute::Backend::Cpu => {}
    }
    profiles::check_writable(&a.output)?;
    let model = builtins::model(&a.model)?;
    let hardware = builtins::hardware(&a.hardware)?;
    if a.concurrency == 0 {
        bail!("--concurrency = 0 is invalid: >= 1 thread");
    }
    let mut cfg = if a.quick {
        ProfileConfig::quick()
    } else {
        ProfileConfig::full()
    };
    cfg.concurrency = a.concurrency;
    let start = std::time::Instant::now();
    let profile = measure(&model, &hardware, &cfg)?;
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
    let notes = vec![
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
    emit(a.format, &report, &header, &t, &notes)
}
