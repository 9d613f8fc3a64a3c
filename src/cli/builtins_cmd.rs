//! `flatpipe builtins`: list the built-in models, hardware, profiles and workloads.

use super::*;

/// Options of `flatpipe builtins`.
#[derive(Debug, Args)]
pub(super) struct BuiltinsArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

pub(super) fn list_builtins(a: BuiltinsArgs) -> Result<ExitCode> {
    #[derive(Serialize)]
    struct Entry {
        kind: &'static str,
        name: String,
        description: String,
    }
    let mut out = Vec::new();
    for (name, _) in builtins::MODELS {
        let m = builtins::model(name)?;
        out.push(Entry {
            kind: "model",
            name: name.to_string(),
            description: {
                let count = |n: u64| {
                    let n = n as f64;
                    if n >= 1e9 {
                        format!("{:.2}B", n / 1e9)
                    } else {
                        format!("{:.2}M", n / 1e6)
                    }
                };
                let mut params = count(m.param_count());
                if m.active_param_count() < m.main_param_count() {
                    params += &format!(" ({} activated)", count(m.active_param_count()));
                }
                format!(
                    "{} decoder layers, {params} parameters, {}",
                    m.num_decoder_layers(),
                    format!("{:?}", m.dtype).to_lowercase()
                )
            },
        });
    }
    for (name, _) in builtins::HARDWARE {
        let h = builtins::hardware(name)?;
        out.push(Entry {
            kind: "hardware",
            name: name.to_string(),
            description: format!(
                "{}, {} MiB, {} peak, {} per node",
                h.name,
                h.memory_bytes >> 20,
                if h.peak_flops >= 1e12 {
                    format!("{:.0} TFLOP/s", h.peak_flops / 1e12)
                } else {
                    format!("{:.0} GFLOP/s", h.peak_flops / 1e9)
                },
                h.gpus_per_node
            ),
        });
    }
    for name in builtin_profile_names() {
        out.push(Entry {
            kind: "profile",
            name: name.clone(),
            description:
                "analytic profile (GEMMs by shape on the hardware's curve, attention by kernel)"
                    .into(),
        });
    }
    for (name, _) in builtins::WORKLOADS {
        let w = builtins::workload(name)?;
        let d = match &w.lengths {
            profiles::LengthDistribution::Empirical {
                samples, divide, ..
            } => format!(
                "{} real sequence lengths{}, {} per step",
                samples.len(),
                divide.map_or(String::new(), |d| format!(" divided by {d}")),
                match w.default_step_size() {
                    StepSize::Seqs(n) => format!("{n} sequences"),
                    StepSize::Tokens(t) => format!("{t} tokens"),
                }
            ),
            other => format!("{other:?}"),
        };
        out.push(Entry {
            kind: "workload",
            name: name.to_string(),
            description: d,
        });
    }
    match a.format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&out)?),
        Format::Table => {
            let mut t = super::new_table(&["kind", "name", "description"]);
            for e in out {
                t.add_row([e.kind.to_string(), e.name, e.description]);
            }
            outln!("{t}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
