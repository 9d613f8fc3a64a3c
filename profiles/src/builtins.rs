//! Built-in models, hardware and workloads, embedded in the binary, and the resolution of a
//! `--model` / `--hardware` / `--workload` argument (a file path or a built-in name).

use crate::{Error, Hardware, ModelSpec, Result, Workload, workload::parse_tokens_csv, yaml};
use std::path::Path;

/// Built-in model names and their YAML.
pub const MODELS: &[(&str, &str)] = &[
    (
        "llama3.1-8b",
        include_str!("../data/models/llama3.1-8b.yaml"),
    ),
    (
        "llama3.1-70b",
        include_str!("../data/models/llama3.1-70b.yaml"),
    ),
    (
        "llama3.1-405b",
        include_str!("../data/models/llama3.1-405b.yaml"),
    ),
    ("tiny", include_str!("../data/models/tiny.yaml")),
    ("tiny-moe", include_str!("../data/models/tiny-moe.yaml")),
    (
        "deepseek-v3",
        include_str!("../data/models/deepseek-v3.yaml"),
    ),
    (
        "qwen3-30b-a3b",
        include_str!("../data/models/qwen3-30b-a3b.yaml"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../data/models/qwen3-235b-a22b.yaml"),
    ),
    (
        "mixtral-8x7b",
        include_str!("../data/models/mixtral-8x7b.yaml"),
    ),
];

/// Built-in hardware names and their YAML.
pub const HARDWARE: &[(&str, &str)] = &[
    ("h200", include_str!("../data/hardware/h200.yaml")),
    ("h100", include_str!("../data/hardware/h100.yaml")),
    ("h800", include_str!("../data/hardware/h800.yaml")),
    ("a100", include_str!("../data/hardware/a100.yaml")),
    ("b200", include_str!("../data/hardware/b200.yaml")),
    ("cpu", include_str!("../data/hardware/cpu.yaml")),
];

/// Built-in workload names, their YAML and the CSV files they refer to.
pub const WORKLOADS: &[(&str, &str)] = &[
    (
        "sharegpt-v3",
        include_str!("../data/workloads/sharegpt-v3.yaml"),
    ),
    (
        "sharegpt-v3-merged",
        include_str!("../data/workloads/sharegpt-v3-merged.yaml"),
    ),
    (
        "tiny-chat",
        include_str!("../data/workloads/tiny-chat.yaml"),
    ),
];

const CSVS: &[(&str, &str)] = &[
    (
        "sharegpt_v3_tokens.csv",
        include_str!("../data/workloads/sharegpt_v3_tokens.csv"),
    ),
    (
        "sharegpt_v3_merged_tokens.csv",
        include_str!("../data/workloads/sharegpt_v3_merged_tokens.csv"),
    ),
];

/// The default model name.
pub const DEFAULT_MODEL: &str = "llama3.1-8b";
/// The default hardware name.
pub const DEFAULT_HARDWARE: &str = "h200";
/// The default workload name.
pub const DEFAULT_WORKLOAD: &str = "sharegpt-v3";

fn names(table: &[(&str, &str)]) -> String {
    table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

fn lookup<'a>(table: &'a [(&str, &str)], name: &str) -> Option<&'a str> {
    table.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// Resolves `arg` as a file path if such a file exists, else as a built-in name.
fn resolve<T>(
    arg: &str,
    what: &'static str,
    table: &[(&str, &str)],
    from_file: impl Fn(&Path) -> Result<T>,
    from_builtin: impl Fn(&str, &str) -> Result<T>,
) -> Result<T> {
    let path = Path::new(arg);
    // Any path that is there but is not a directory is read: a file, or a device such as
    // /dev/null or a pipe (whose reading then says what is wrong with its text).
    if path.is_file() || (path.exists() && !path.is_dir()) {
        return from_file(path);
    }
    match lookup(table, arg) {
        Some(text) => from_builtin(text, &format!("built-in {what} `{arg}`")),
        // A directory is not a file: reading it says so, naming the path.
        None if path.is_dir() => from_file(path),
        None => Err(Error::Unknown {
            what,
            name: arg.into(),
            builtins: names(table),
        }),
    }
}

/// A model: a YAML file path or a built-in name (`llama3.1-8b`, `llama3.1-70b`,
/// `llama3.1-405b`, `tiny`).
///
/// # Errors
/// [`Error::Unknown`], or the file's read/parse/validation error.
pub fn model(arg: &str) -> Result<ModelSpec> {
    resolve(
        arg,
        "model",
        MODELS,
        |p| ModelSpec::from_yaml(&yaml::read_to_string(p)?, &p.display().to_string()),
        ModelSpec::from_yaml,
    )
}

/// A hardware: a YAML file path or a built-in name (`h200`, `h100`, `a100`, `b200`, `cpu`).
///
/// # Errors
/// [`Error::Unknown`], or the file's read/parse/validation error.
pub fn hardware(arg: &str) -> Result<Hardware> {
    resolve(
        arg,
        "hardware",
        HARDWARE,
        |p| Hardware::from_yaml(&yaml::read_to_string(p)?, &p.display().to_string()),
        Hardware::from_yaml,
    )
}

/// A workload: a YAML or CSV file path, or a built-in name (`sharegpt-v3`, `sharegpt-v3-merged`,
/// `tiny-chat`).
///
/// # Errors
/// [`Error::Unknown`], or the file's read/parse/validation error.
pub fn workload(arg: &str) -> Result<Workload> {
    resolve(
        arg,
        "workload",
        WORKLOADS,
        Workload::from_file,
        |text, origin| {
            Workload::from_yaml(text, origin, |csv| {
                let t = lookup(CSVS, csv)
                    .ok_or_else(|| Error::invalid(origin, "lengths.csv", csv, "a shipped CSV"))?;
                Ok((t.to_string(), format!("built-in {csv}")))
            })
        },
    )
}

/// Parses a built-in CSV sample (for tests and docs).
///
/// # Errors
/// [`Error::Unknown`] for an unknown name.
pub fn csv_sample(name: &str) -> Result<Vec<u32>> {
    let t = lookup(CSVS, name).ok_or_else(|| Error::Unknown {
        what: "csv",
        name: name.into(),
        builtins: names(CSVS),
    })?;
    parse_tokens_csv(t, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_chat_is_sharegpt_divided_by_16_within_8_to_512() {
        let raw = csv_sample("sharegpt_v3_tokens.csv").unwrap();
        let w = workload("tiny-chat").unwrap();
        let crate::LengthDistribution::Empirical { samples, .. } = &w.lengths else {
            panic!("empirical");
        };
        assert_eq!(samples.len(), raw.len());
        for (s, r) in samples.iter().zip(&raw) {
            assert_eq!(*s, r.div_ceil(16).clamp(8, 512), "raw {r}");
        }
        let e = Workload::from_yaml(
            "name: x\nlengths: {kind: empirical, csv: a.csv, divide: 0}\n",
            "x.yaml",
            |_| Ok(("tokens\n5\n".into(), "a.csv".into())),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("x.yaml") && e.contains("divide"), "{e}");
    }

    #[test]
    fn every_builtin_loads() {
        for (n, _) in MODELS {
            model(n).unwrap();
        }
        for (n, _) in HARDWARE {
            hardware(n).unwrap();
        }
        for (n, _) in WORKLOADS {
            workload(n).unwrap();
        }
    }

    #[test]
    fn shipped_samples_match_their_readme() {
        // ../shared/data/README.md: 17,545 and 9,457 rows, maxima 161,298 and 197,528.
        let a = csv_sample("sharegpt_v3_tokens.csv").unwrap();
        assert_eq!((a.len(), *a.iter().max().unwrap()), (17_545, 161_298));
        let b = csv_sample("sharegpt_v3_merged_tokens.csv").unwrap();
        assert_eq!((b.len(), *b.iter().max().unwrap()), (9_457, 197_528));
    }

    #[test]
    fn h200_memory_is_143771_mib() {
        assert_eq!(
            hardware("h200").unwrap().memory_bytes,
            143_771 * 1024 * 1024
        );
    }

    #[test]
    fn unknown_names_list_builtins() {
        let e = model("gpt-5").unwrap_err().to_string();
        assert!(e.contains("llama3.1-8b") && e.contains("gpt-5"), "{e}");
    }

    #[test]
    fn malformed_model_yaml_is_an_error() {
        let e = ModelSpec::from_yaml("name: x\ndtype: bf16\nlayers: [", "m.yaml").unwrap_err();
        assert!(e.to_string().starts_with("m.yaml: invalid YAML"), "{e}");
        let text = "name: x\ndtype: bf16\nlayers:\n  - {kind: embedding, vocab: 10, hidden: 8}\n  - {kind: decoder, hidden: 8, ffn: 0, heads: 2, kv_heads: 1}\n  - {kind: head, vocab: 10, hidden: 8}\n";
        let e = ModelSpec::from_yaml(text, "m.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layers[1].ffn") && e.contains("in 1..=16777216"),
            "{e}"
        );
    }
}

/// The measured GEMM tables of `profiles/data/gemm/` (the hardware files' `gemm` curves),
/// checked as data: every row a positive shape at or under its GPU's datasheet peak.
#[cfg(test)]
mod gemm_tables {
    const TABLES: &[(&str, &str, &str)] = &[
        (
            "h100-sxm-bf16.csv",
            include_str!("../data/gemm/h100-sxm-bf16.csv"),
            "h100",
        ),
        (
            "h200-sxm-bf16.csv",
            include_str!("../data/gemm/h200-sxm-bf16.csv"),
            "h200",
        ),
        (
            "b200-bf16.csv",
            include_str!("../data/gemm/b200-bf16.csv"),
            "b200",
        ),
    ];

    #[test]
    fn every_row_is_a_shape_under_the_peak() {
        for (name, text, hw) in TABLES {
            let peak = super::hardware(hw).unwrap().peak_flops / 1e12;
            let rows: Vec<Vec<f64>> = text
                .lines()
                .filter(|l| !l.starts_with('#') && !l.starts_with("m,"))
                .map(|l| l.split(',').map(|x| x.trim().parse().unwrap()).collect())
                .collect();
            assert!(rows.len() >= 8, "{name}: {} rows", rows.len());
            for r in &rows {
                assert_eq!(r.len(), 4, "{name}: {r:?}");
                assert!(
                    r[..3].iter().all(|&d| d >= 1.0 && d.fract() == 0.0),
                    "{name}: {r:?}"
                );
                assert!(
                    r[3] > 0.0 && r[3] <= peak,
                    "{name}: {r:?} over the peak {peak}"
                );
            }
        }
    }
}
