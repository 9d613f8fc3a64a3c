//! Workloads: how one step's sequence lengths are drawn.

use crate::{Error, Result, yaml};
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use rand_distr::{Distribution, LogNormal, Pareto};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

/// The longest sequence a workload may hold, tokens: 2^24 = 16,777,216, 16 times the longest
/// context of today's open models (1M tokens). Beyond it a step's attention pairs
/// (`s(s+1)/2` per sequence, summed in `u64`) and FLOP counts leave the range in which the cost
/// model and MFU mean anything.
pub const MAX_SEQ_LEN: u32 = 1 << 24;

/// How long one sequence is, in tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum LengthDistribution {
    /// Every sequence has `tokens` tokens.
    Fixed {
        /// Tokens per sequence, >= 1.
        tokens: u32,
    },
    /// Log-normal lengths: `exp(N(ln median, sigma²))`, rounded and clamped to `[min, max]`.
    Lognormal {
        /// Median length in tokens, >= 1.
        median: f64,
        /// Standard deviation of the log-length, >= 0.
        sigma: f64,
        /// Shortest length, tokens (default 1).
        #[serde(default = "one")]
        min: u32,
        /// Longest length, tokens (default 131072).
        #[serde(default = "max_len")]
        max: u32,
    },
    /// Pareto (long-tailed, RL rollouts: a few very long responses): `scale * U^(-1/alpha)`,
    /// rounded and clamped to `[scale, max]`.
    Pareto {
        /// Shortest length (the distribution's scale `x_m`), tokens, >= 1.
        scale: f64,
        /// Tail index `alpha` > 0 (smaller is heavier; the mean is finite for alpha > 1).
        alpha: f64,
        /// Longest length, tokens (default 131072).
        #[serde(default = "max_len")]
        max: u32,
    },
    /// Draw with replacement from a sample: a CSV file with a `tokens` column (path relative
    /// to the workload file).
    Empirical {
        /// The CSV file.
        csv: String,
        /// Divide every sampled length by this and round up (default 1), e.g. 16 to turn chat
        /// lengths into a CPU-sized workload.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        divide: Option<u32>,
        /// Clamp (scaled) lengths to at least this many tokens (default 1).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min: Option<u32>,
        /// Clamp (scaled) lengths to at most this many tokens (default: no cap).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max: Option<u32>,
        /// The loaded sample, scaled and clamped (filled when the workload is loaded).
        #[serde(skip)]
        samples: Arc<Vec<u32>>,
    },
}

fn one() -> u32 {
    1
}
fn max_len() -> u32 {
    131_072
}

/// How big one step is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepSize {
    /// Exactly this many sequences per step.
    Seqs(u32),
    /// Sequences are drawn until the step holds at least this many tokens.
    Tokens(u64),
}

impl std::fmt::Display for StepSize {
    /// `128 sequences per step` or `65536 tokens per step`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepSize::Seqs(n) => write!(f, "{n} sequences per step"),
            StepSize::Tokens(t) => write!(f, "{t} tokens per step"),
        }
    }
}

/// A workload file (YAML): a length distribution, a default step size and a default seed.
///
/// ```yaml
/// name: sharegpt-v3
/// lengths: {kind: empirical, csv: sharegpt_v3_tokens.csv}
/// seqs_per_step: 128
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Workload name.
    pub name: String,
    /// Sequence lengths.
    pub lengths: LengthDistribution,
    /// Sequences per step (default 128), unless `tokens_per_step` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seqs_per_step: Option<u32>,
    /// Tokens per step: sequences are drawn until the step holds at least this many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_step: Option<u64>,
    /// Keep each drawn sequence with this probability (e.g. RL steps that keep only the
    /// rollouts that passed a filter), so the count per step varies; at least one is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_probability: Option<f64>,
    /// Default seed (0).
    #[serde(default)]
    pub seed: u64,
}

/// Reads a `tokens` column from CSV text. `origin` names the file in errors.
pub(crate) fn parse_tokens_csv(text: &str, origin: &str) -> Result<Vec<u32>> {
    let mut rdr = csv::Reader::from_reader(text.as_bytes());
    let headers = rdr.headers().map_err(|e| Error::Csv {
        path: origin.into(),
        message: e.to_string(),
    })?;
    let col = headers
        .iter()
        .position(|h| h.trim() == "tokens")
        .ok_or_else(|| Error::Csv {
            path: origin.into(),
            message: format!(
                "no `tokens` column (header: {})",
                headers.iter().collect::<Vec<_>>().join(",")
            ),
        })?;
    let mut out = Vec::new();
    for (i, rec) in rdr.records().enumerate() {
        let row = i + 2; // 1-based, after the header
        let rec = rec.map_err(|e| Error::Csv {
            path: origin.into(),
            message: format!("row {row}: {e}"),
        })?;
        let cell = rec.get(col).unwrap_or("").trim();
        let v: u32 = cell.parse().map_err(|_| Error::Csv {
            path: origin.into(),
            message: format!("row {row}, column tokens: `{cell}` is not a whole number of tokens in 1..={MAX_SEQ_LEN}"),
        })?;
        if v == 0 || v > MAX_SEQ_LEN {
            return Err(Error::Csv {
                path: origin.into(),
                message: format!("row {row}, column tokens: {v} (must be in 1..={MAX_SEQ_LEN})"),
            });
        }
        out.push(v);
    }
    if out.is_empty() {
        return Err(Error::Csv {
            path: origin.into(),
            message: "no rows".into(),
        });
    }
    Ok(out)
}

impl Workload {
    /// Parses a workload file. Empirical samples are loaded through `load_csv`, which maps the
    /// file's `csv` field to its text (relative paths are resolved by the caller).
    ///
    /// # Errors
    /// [`Error::Yaml`], [`Error::Csv`] or [`Error::Invalid`].
    pub fn from_yaml(
        text: &str,
        origin: &str,
        load_csv: impl Fn(&str) -> Result<(String, String)>,
    ) -> Result<Self> {
        let mut w: Workload = yaml::parse(text, origin)?;
        if let LengthDistribution::Empirical {
            csv,
            samples,
            divide,
            min,
            max,
        } = &mut w.lengths
        {
            let (csv_text, csv_origin) = load_csv(csv)?;
            let (d, lo, hi) = (
                divide.unwrap_or(1),
                min.unwrap_or(1),
                max.unwrap_or(u32::MAX),
            );
            if d == 0 {
                return Err(Error::invalid(origin, "lengths.divide", 0, ">= 1"));
            }
            if lo == 0 || lo > hi {
                return Err(Error::invalid(
                    origin,
                    "lengths.min",
                    lo,
                    format!("in 1..=max ({hi})"),
                ));
            }
            let raw = parse_tokens_csv(&csv_text, &csv_origin)?;
            *samples = Arc::new(raw.iter().map(|s| s.div_ceil(d).clamp(lo, hi)).collect());
        }
        w.validate(origin)?;
        Ok(w)
    }

    /// Reads a workload from a YAML file, or directly from a CSV file with a `tokens` column
    /// (then the defaults apply: 128 sequences per step, seed 0).
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Yaml`], [`Error::Csv`] or [`Error::Invalid`], naming the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let origin = path.display().to_string();
        let text = yaml::read_to_string(path)?;
        if text.trim().is_empty() {
            return Err(Error::invalid(
                &origin,
                "file",
                "empty",
                "a workload YAML (`lengths: ...`) or a CSV with a `tokens` column",
            ));
        }
        // The format is read from the text: a CSV's header is a comma-separated line without
        // a YAML key's colon, or the single column `tokens` (whatever the file is called); YAML
        // comment lines (`#`) are not a header.
        let first = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .unwrap_or("");
        let looks_csv = first == "tokens" || (first.contains(',') && !first.contains(':'));
        if looks_csv
            || path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
        {
            let samples = parse_tokens_csv(&text, &origin)?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Ok(Workload::empirical(name, origin, samples));
        }
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Workload::from_yaml(&text, &origin, |csv| {
            let p = dir.join(csv);
            match yaml::read_to_string(&p) {
                Ok(text) => Ok((text, p.display().to_string())),
                // A file that is not there: the workload's field that names it is the mistake.
                Err(Error::Io { cause, .. }) if cause.kind() == std::io::ErrorKind::NotFound => {
                    Err(Error::invalid(
                        &origin,
                        "lengths.csv",
                        csv,
                        format!(
                            "a CSV file with a `tokens` column, relative to the workload file ({} does not exist)",
                            p.display()
                        ),
                    ))
                }
                Err(e) => Err(e),
            }
        })
    }

    /// An empirical workload over `samples` with the default step size and seed.
    pub fn empirical(name: String, csv: String, samples: Vec<u32>) -> Self {
        Workload {
            name,
            lengths: LengthDistribution::Empirical {
                csv,
                divide: None,
                min: None,
                max: None,
                samples: Arc::new(samples),
            },
            seqs_per_step: None,
            tokens_per_step: None,
            keep_probability: None,
            seed: 0,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field.
    pub fn validate(&self, origin: &str) -> Result<()> {
        match &self.lengths {
            LengthDistribution::Fixed { tokens } if *tokens == 0 || *tokens > MAX_SEQ_LEN => {
                return Err(Error::invalid(
                    origin,
                    "lengths.tokens",
                    tokens,
                    format!("in 1..={MAX_SEQ_LEN} tokens"),
                ));
            }
            LengthDistribution::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                if *max > MAX_SEQ_LEN {
                    return Err(Error::invalid(
                        origin,
                        "lengths.max",
                        max,
                        format!("<= {MAX_SEQ_LEN} tokens"),
                    ));
                }
                if !(median.is_finite() && *median >= 1.0) {
                    return Err(Error::invalid(
                        origin,
                        "lengths.median",
                        median,
                        ">= 1 token",
                    ));
                }
                if !(sigma.is_finite() && *sigma >= 0.0) {
                    return Err(Error::invalid(origin, "lengths.sigma", sigma, ">= 0"));
                }
                if *min == 0 || min > max {
                    return Err(Error::invalid(
                        origin,
                        "lengths.min",
                        min,
                        format!("in 1..=max ({max})"),
                    ));
                }
            }
            LengthDistribution::Pareto { scale, alpha, max } => {
                if *max > MAX_SEQ_LEN {
                    return Err(Error::invalid(
                        origin,
                        "lengths.max",
                        max,
                        format!("<= {MAX_SEQ_LEN} tokens"),
                    ));
                }
                if !(scale.is_finite() && *scale >= 1.0) {
                    return Err(Error::invalid(origin, "lengths.scale", scale, ">= 1 token"));
                }
                if !(alpha.is_finite() && *alpha > 0.0) {
                    return Err(Error::invalid(origin, "lengths.alpha", alpha, "> 0"));
                }
                if (*max as f64) < *scale {
                    return Err(Error::invalid(
                        origin,
                        "lengths.max",
                        max,
                        format!(">= scale ({scale})"),
                    ));
                }
            }
            _ => {}
        }
        if let Some(q) = self.keep_probability
            && !(q > 0.0 && q <= 1.0)
        {
            return Err(Error::invalid(origin, "keep_probability", q, "in (0, 1]"));
        }
        if self.seqs_per_step == Some(0) {
            return Err(Error::invalid(origin, "seqs_per_step", 0, ">= 1"));
        }
        if self.tokens_per_step == Some(0) {
            return Err(Error::invalid(origin, "tokens_per_step", 0, ">= 1"));
        }
        if self.seqs_per_step.is_some() && self.tokens_per_step.is_some() {
            return Err(Error::invalid(
                origin,
                "tokens_per_step",
                "set",
                "give seqs_per_step or tokens_per_step, not both",
            ));
        }
        Ok(())
    }

    /// The step size the file asks for (default 128 sequences).
    pub fn default_step_size(&self) -> StepSize {
        match (self.seqs_per_step, self.tokens_per_step) {
            (_, Some(t)) => StepSize::Tokens(t),
            (Some(n), None) => StepSize::Seqs(n),
            (None, None) => StepSize::Seqs(128),
        }
    }

    fn draw(&self, rng: &mut ChaCha8Rng) -> u32 {
        match &self.lengths {
            LengthDistribution::Fixed { tokens } => *tokens,
            LengthDistribution::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                let d = LogNormal::new(median.ln(), *sigma).expect("validated: sigma >= 0");
                let x: f64 = d.sample(rng);
                (x.round().clamp(*min as f64, *max as f64)) as u32
            }
            LengthDistribution::Pareto { scale, alpha, max } => {
                let d = Pareto::new(*scale, *alpha).expect("validated: scale >= 1, alpha > 0");
                let x: f64 = d.sample(rng);
                x.round().clamp(*scale, *max as f64) as u32
            }
            LengthDistribution::Empirical { samples, .. } => {
                samples[rng.random_range(0..samples.len())]
            }
        }
    }

    /// Draws the sequence lengths (tokens) of step number `step` under `seed`. The same
    /// `(seed, step)` always gives the same lengths, independently of other steps, so steps can
    /// be drawn in parallel. With [`StepSize::Tokens`], sequences are drawn until the step holds
    /// at least that many tokens (the last one may overshoot).
    pub fn sample_step(&self, seed: u64, step: u64, size: StepSize) -> Vec<u32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut out: Vec<u32> = match size {
            StepSize::Seqs(n) => (0..n).map(|_| self.draw(&mut rng)).collect(),
            StepSize::Tokens(t) => {
                let mut out = Vec::new();
                let mut total = 0u64;
                while total < t {
                    let s = self.draw(&mut rng);
                    total += s as u64;
                    out.push(s);
                }
                out
            }
        };
        if let Some(q) = self.keep_probability.filter(|q| *q < 1.0) {
            let first = out[0];
            out.retain(|_| rng.random_bool(q));
            if out.is_empty() {
                out.push(first);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_csv_names_the_workload_field() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.yaml");
        std::fs::write(
            &path,
            "name: w\nlengths: {kind: empirical, csv: nowhere.csv}\n",
        )
        .unwrap();
        let e = Workload::from_file(&path).unwrap_err().to_string();
        assert!(
            e.contains("w.yaml") && e.contains("lengths.csv") && e.contains("nowhere.csv"),
            "{e}"
        );
    }

    /// A workload YAML that opens with a comment line holding a comma and no colon (the
    /// published runs' files do) is YAML, not a CSV header.
    #[test]
    fn a_yaml_opening_with_a_comment_is_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.yaml");
        let text = "# The batch (Dubey et al. 2024, Table 4)\n\nname: w\nlengths: {kind: fixed, tokens: 8192}\nseqs_per_step: 2048\n";
        std::fs::write(&path, text).unwrap();
        let w = Workload::from_file(&path).unwrap();
        assert_eq!(w.name, "w");
        assert!(
            matches!(w.lengths, LengthDistribution::Fixed { tokens: 8192 }),
            "{:?}",
            w.lengths
        );
    }

    /// Both ways a cell can be out of range state the same range.
    #[test]
    fn csv_token_range_is_stated_once() {
        let big = parse_tokens_csv("tokens\n99999999999\n", "w.csv")
            .unwrap_err()
            .to_string();
        let over = parse_tokens_csv(&format!("tokens\n{}\n", MAX_SEQ_LEN + 1), "w.csv")
            .unwrap_err()
            .to_string();
        let range = format!("1..={MAX_SEQ_LEN}");
        assert!(
            big.contains(&range) && over.contains(&range),
            "{big}\n{over}"
        );
    }

    #[test]
    fn csv_errors_name_row_and_column() {
        let e = parse_tokens_csv("tokens\n12\nabc\n", "w.csv")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("w.csv") && e.contains("row 3") && e.contains("abc"),
            "{e}"
        );
        let e = parse_tokens_csv("len\n12\n", "w.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no `tokens` column"), "{e}");
    }

    #[test]
    fn sampling_is_reproducible_and_sized() {
        let w = Workload::empirical("t".into(), "t.csv".into(), vec![10, 20, 30]);
        let a = w.sample_step(7, 3, StepSize::Seqs(50));
        assert_eq!(a, w.sample_step(7, 3, StepSize::Seqs(50)));
        assert_ne!(a, w.sample_step(7, 4, StepSize::Seqs(50)));
        assert_eq!(a.len(), 50);
        let b = w.sample_step(1, 0, StepSize::Tokens(1000));
        let total: u32 = b.iter().sum();
        assert!(total >= 1000 && total - b.last().unwrap() < 1000);
    }

    #[test]
    fn pareto_tail_and_filter() {
        let mut w = Workload::empirical("t".into(), "t.csv".into(), vec![1]);
        w.lengths = LengthDistribution::Pareto {
            scale: 100.0,
            alpha: 1.5,
            max: 1 << 30,
        };
        let v = w.sample_step(0, 0, StepSize::Seqs(20_000));
        // P(X > x) = (scale / x)^alpha: P(X > 400) = 4^-1.5 = 1/8.
        let frac = v.iter().filter(|&&x| x > 400).count() as f64 / v.len() as f64;
        assert!((frac - 0.125).abs() < 0.01, "{frac}");
        assert!(v.iter().all(|&x| x >= 100));
        w.keep_probability = Some(0.5);
        let counts: Vec<usize> = (0..50)
            .map(|s| w.sample_step(0, s, StepSize::Seqs(100)).len())
            .collect();
        assert!(
            counts.iter().any(|&c| c != counts[0]),
            "counts must vary: {counts:?}"
        );
        let mean = counts.iter().sum::<usize>() as f64 / 50.0;
        assert!((mean - 50.0).abs() < 5.0, "{mean}");
    }

    #[test]
    fn lognormal_median_is_close() {
        let w = Workload {
            name: "ln".into(),
            lengths: LengthDistribution::Lognormal {
                median: 1000.0,
                sigma: 1.0,
                min: 1,
                max: 1 << 30,
            },
            seqs_per_step: None,
            tokens_per_step: None,
            keep_probability: None,
            seed: 0,
        };
        let mut v = w.sample_step(0, 0, StepSize::Seqs(20001));
        v.sort_unstable();
        let med = v[10000] as f64;
        assert!((med / 1000.0 - 1.0).abs() < 0.05, "{med}");
    }
}
