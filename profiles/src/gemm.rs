//! Kernel throughput by shape: what a GEMM `C[m, n] = A[m, k] B[k, n]` and a fused attention
//! kernel achieve on a GPU, from its hardware file.
//!
//! A hardware file's `gemm` names one of two curves:
//! - `table`: a measured table of `profiles/data/gemm/` (rows `m,n,k,tflops`). A shape is
//!   looked up in `log2` space: each dimension is clamped to the table's range (a GEMM larger
//!   than every measured one runs as the largest did), then the rows are weighted by inverse
//!   distance to the fourth power (Shepard 1968), so a measured shape returns its own figure;
//!   a GEMM smaller than every measured one in some dimension takes the time of the smallest.
//! - `max_flops` (no table): the GPU's maximum achievable matmul FLOP/s, MAMF (Bekman, *Machine
//!   Learning Engineering*, "Maximum Achievable Matmul FLOPS comparison table", measured with
//!   `mamf-finder.py`), under a roofline `t = max(2mnk / max_flops, 2 (mk + kn + mn) / hbm) +
//!   overhead_s`: the math at the achievable rate or the bf16 operands and result once through
//!   HBM, whichever is longer (Williams et al. 2009), plus a fixed cost per kernel.
//!   `overhead_s` defaults to [`GEMM_OVERHEAD_S`], the value at which this form best matches
//!   OpenXLA's measured H100 table (median error 5% over its shapes of at least 2^30 FLOPs, 3%
//!   under on its shapes of at least 2^35; 10% on its B200 table); the test
//!   `roofline_tracks_the_measured_tables` checks both. At the shape where MAMF was measured the
//!   form returns 99% of it on the A100.
//!
//! A hardware file's `attention` gives its fused attention kernel's forward and backward FLOP/s
//! (causal, head dimension 128, long sequences; the backward counts 2.5x the forward's FLOPs,
//! the convention of the FlashAttention papers). Without it, attention runs at the GEMM curve's
//! rate for the shape `(4096, 4096, 128)`.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// Seconds of fixed cost per GEMM kernel in the roofline curve (see the module docs).
pub const GEMM_OVERHEAD_S: f64 = 6e-6;

/// Which GEMM curve a GPU has (a hardware file's `gemm`): exactly one of `table` and
/// `max_flops`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmSpec {
    /// A built-in measured table: `h100-sxm-bf16`, `h200-sxm-bf16` or `b200-bf16`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// Maximum achievable matmul FLOP/s (MAMF), for the roofline curve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_flops: Option<f64>,
    /// The roofline curve's fixed cost per kernel, seconds (default [`GEMM_OVERHEAD_S`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead_s: Option<f64>,
}

/// A fused attention kernel's achieved throughput (a hardware file's `attention`), FLOP/s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionSpec {
    /// The kernel's name (e.g. `FlashAttention-3`).
    #[serde(default)]
    pub kernel: String,
    /// Forward FLOP/s (`4 s² d` FLOPs per head for a full square, half causal).
    pub forward_flops: f64,
    /// Backward FLOP/s (2.5x the forward's FLOPs).
    pub backward_flops: f64,
}

/// The built-in GEMM tables, by name.
const TABLES: &[(&str, &str)] = &[
    (
        "h100-sxm-bf16",
        include_str!("../data/gemm/h100-sxm-bf16.csv"),
    ),
    (
        "h200-sxm-bf16",
        include_str!("../data/gemm/h200-sxm-bf16.csv"),
    ),
    ("b200-bf16", include_str!("../data/gemm/b200-bf16.csv")),
];

/// A GPU's GEMM throughput by shape (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub enum GemmCurve {
    /// Measured rows `[log2 m, log2 n, log2 k, FLOP/s]` and each dimension's `log2` range.
    Table {
        /// The rows.
        rows: Vec<[f64; 4]>,
        /// The smallest `log2` of each dimension.
        lo: [f64; 3],
        /// The largest `log2` of each dimension.
        hi: [f64; 3],
    },
    /// The roofline.
    Roofline {
        /// Maximum achievable matmul FLOP/s.
        max_flops: f64,
        /// HBM bytes per second.
        hbm_bytes_per_s: f64,
        /// Fixed seconds per kernel.
        overhead_s: f64,
    },
}

impl GemmSpec {
    /// Checks the spec. `origin` names the hardware file.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `gemm.table` (not a built-in table), `gemm.max_flops` (not a
    /// finite number > 0) or `gemm` (both or neither given).
    pub fn validate(&self, origin: &str) -> Result<()> {
        match (&self.table, self.max_flops) {
            (Some(t), None) => table_text(t, origin).map(|_| ()),
            (None, Some(f)) if f.is_finite() && f > 0.0 => {
                Error::check_seconds(origin, "gemm.overhead_s", self.overhead_s.unwrap_or(0.0))
            }
            (None, Some(f)) => Err(Error::invalid(
                origin,
                "gemm.max_flops",
                f,
                "a finite number of FLOP/s > 0",
            )),
            _ => Err(Error::invalid(
                origin,
                "gemm",
                "both or neither of table and max_flops",
                "exactly one: a measured `table` or the `max_flops` of the roofline curve",
            )),
        }
    }

    /// The curve this spec names, on a GPU with `hbm_bytes_per_s`.
    ///
    /// # Errors
    /// As [`GemmSpec::validate`], and [`Error::Invalid`] naming a malformed table row.
    pub fn curve(&self, hbm_bytes_per_s: f64, origin: &str) -> Result<GemmCurve> {
        self.validate(origin)?;
        match (&self.table, self.max_flops) {
            (Some(t), _) => GemmCurve::from_csv(table_text(t, origin)?, t),
            (None, Some(max_flops)) => Ok(GemmCurve::Roofline {
                max_flops,
                hbm_bytes_per_s,
                overhead_s: self.overhead_s.unwrap_or(GEMM_OVERHEAD_S),
            }),
            (None, None) => unreachable!("validated above"),
        }
    }
}

fn table_text(name: &str, origin: &str) -> Result<&'static str> {
    TABLES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, t)| *t)
        .ok_or_else(|| {
            let names: Vec<&str> = TABLES.iter().map(|(n, _)| *n).collect();
            Error::invalid(
                origin,
                "gemm.table",
                name,
                format!("a built-in table: {}", names.join(", ")),
            )
        })
}

impl GemmCurve {
    /// A table curve from CSV text (`#` comments, a `m,n,k,tflops` header, then rows).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the row that is not four positive numbers, or an empty table.
    pub fn from_csv(text: &str, origin: &str) -> Result<GemmCurve> {
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with("m,") {
                continue;
            }
            let v: Vec<f64> = line
                .split(',')
                .map(|x| x.trim().parse::<f64>().unwrap_or(f64::NAN))
                .collect();
            if v.len() != 4 || v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(Error::invalid(
                    origin,
                    format!("line {}", i + 1),
                    line,
                    "m,n,k,tflops: four numbers > 0",
                ));
            }
            rows.push([v[0].log2(), v[1].log2(), v[2].log2(), v[3] * 1e12]);
        }
        if rows.is_empty() {
            return Err(Error::invalid(origin, "rows", 0, ">= 1 measured shape"));
        }
        let mut lo = [f64::INFINITY; 3];
        let mut hi = [f64::NEG_INFINITY; 3];
        for r in &rows {
            for d in 0..3 {
                lo[d] = lo[d].min(r[d]);
                hi[d] = hi[d].max(r[d]);
            }
        }
        Ok(GemmCurve::Table { rows, lo, hi })
    }

    /// Achieved FLOP/s of one `[m, k] x [k, n]` GEMM (dimensions >= 1).
    pub fn flops_per_s(&self, m: f64, n: f64, k: f64) -> f64 {
        let flops = 2.0 * m * n * k;
        flops / self.time_s(m, n, k)
    }

    /// Seconds of one `[m, k] x [k, n]` GEMM (dimensions >= 1).
    pub fn time_s(&self, m: f64, n: f64, k: f64) -> f64 {
        let (m, n, k) = (m.max(1.0), n.max(1.0), k.max(1.0));
        let flops = 2.0 * m * n * k;
        match self {
            GemmCurve::Roofline {
                max_flops,
                hbm_bytes_per_s,
                overhead_s,
            } => {
                (flops / max_flops).max(2.0 * (m * k + k * n + m * n) / hbm_bytes_per_s)
                    + overhead_s
            }
            GemmCurve::Table { rows, lo, hi } => {
                let q = [m.log2(), n.log2(), k.log2()];
                let q: Vec<f64> = (0..3).map(|d| q[d].clamp(lo[d], hi[d])).collect();
                // A dimension under the table's smallest runs as the smallest measured one did
                // (same time); over its largest, at the largest one's rate.
                let (m, n, k) = (
                    m.max(lo[0].exp2()),
                    n.max(lo[1].exp2()),
                    k.max(lo[2].exp2()),
                );
                let flops = 2.0 * m * n * k;
                let (mut num, mut den) = (0.0, 0.0);
                for r in rows {
                    let d2: f64 = (0..3).map(|d| (r[d] - q[d]).powi(2)).sum();
                    if d2 < 1e-12 {
                        return flops / r[3];
                    }
                    let w = 1.0 / (d2 * d2);
                    num += w * r[3];
                    den += w;
                }
                flops / (num / den)
            }
        }
    }

    /// Seconds of `count` GEMMs `[m, k] x [k, n]` run as one grouped kernel (the routed
    /// experts): on the roofline the fixed cost is paid once; a table's rows are single GEMMs,
    /// each with its own fixed cost, so there `count` times one GEMM's time (an upper bound on
    /// a grouped kernel's).
    pub fn grouped_time_s(&self, count: f64, m: f64, n: f64, k: f64) -> f64 {
        match self {
            GemmCurve::Roofline { overhead_s, .. } => {
                count * (self.time_s(m, n, k) - overhead_s) + overhead_s
            }
            GemmCurve::Table { .. } => count * self.time_s(m, n, k),
        }
    }
}

impl AttentionSpec {
    /// Checks both rates. `origin` names the hardware file.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `attention.forward_flops` or `attention.backward_flops`.
    pub fn validate(&self, origin: &str) -> Result<()> {
        for (field, v) in [
            ("attention.forward_flops", self.forward_flops),
            ("attention.backward_flops", self.backward_flops),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid(
                    origin,
                    field,
                    v,
                    "a finite number of FLOP/s > 0",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(name: &str) -> Vec<[f64; 4]> {
        let GemmCurve::Table { rows, .. } =
            GemmCurve::from_csv(table_text(name, "t").unwrap(), name).unwrap()
        else {
            unreachable!()
        };
        rows
    }

    #[test]
    fn a_measured_shape_returns_its_row_and_larger_shapes_clamp() {
        let c = GemmSpec {
            table: Some("h100-sxm-bf16".into()),
            max_flops: None,
            overhead_s: None,
        }
        .curve(3.35e12, "h100")
        .unwrap();
        // The table's row 4096,4096,4096,780.2 and 1024,4096,4096,751.9.
        assert!((c.flops_per_s(4096.0, 4096.0, 4096.0) / 780.2e12 - 1.0).abs() < 1e-9);
        assert!((c.flops_per_s(1024.0, 4096.0, 4096.0) / 751.9e12 - 1.0).abs() < 1e-9);
        // Past the table's largest dimension a GEMM runs at the largest measured rate.
        assert!((c.flops_per_s(16384.0, 8192.0, 4096.0) / 780.2e12 - 1.0).abs() < 1e-9);
        // Under the table's smallest m (256), the time of m = 256.
        let small = c.time_s(16.0, 4096.0, 4096.0);
        assert!((small / c.time_s(256.0, 4096.0, 4096.0) - 1.0).abs() < 1e-12);
        // Between rows: between its neighbours' rates.
        let mid = c.flops_per_s(3000.0, 4096.0, 4096.0);
        assert!(mid > 700e12 && mid < 790e12, "{mid}");
    }

    #[test]
    fn roofline_tracks_the_measured_tables() {
        // The roofline form with each GPU's MAMF (H100 SXM 794.5, B200 1,745 TFLOP/s: Bekman's
        // table) and datasheet HBM bandwidth, against OpenXLA's measured tables: the median
        // |error| over shapes of at least 2^30 FLOPs.
        for (name, mamf, hbm, bound) in [
            ("h100-sxm-bf16", 794.5e12, 3.35e12, 0.08),
            ("b200-bf16", 1745e12, 8e12, 0.12),
        ] {
            let c = GemmCurve::Roofline {
                max_flops: mamf,
                hbm_bytes_per_s: hbm,
                overhead_s: GEMM_OVERHEAD_S,
            };
            let mut errors: Vec<f64> = rows(name)
                .iter()
                .map(|r| (r[0].exp2(), r[1].exp2(), r[2].exp2(), r[3]))
                .filter(|(m, n, k, _)| 2.0 * m * n * k >= 2f64.powi(30))
                .map(|(m, n, k, f)| (c.flops_per_s(m, n, k) / f - 1.0).abs())
                .collect();
            errors.sort_by(f64::total_cmp);
            let median = errors[errors.len() / 2];
            assert!(median < bound, "{name}: median |error| {median}");
        }
    }

    #[test]
    fn the_h200_runs_on_the_h100_table_a_little_below_its_own_runs() {
        // The H200 file prices GEMMs on the H100 SXM's table (same GH100 die and clocks);
        // flatpipe's own cuBLAS runs on an H200 are 7-16% faster at Llama-3.1-8B's shapes.
        let h100 = GemmCurve::from_csv(table_text("h100-sxm-bf16", "t").unwrap(), "h100").unwrap();
        for r in rows("h200-sxm-bf16") {
            let (m, n, k) = (r[0].exp2(), r[1].exp2(), r[2].exp2());
            let ratio = h100.flops_per_s(m, n, k) / r[3];
            assert!((0.84..0.95).contains(&ratio), "{m} {n} {k}: {ratio}");
        }
    }

    #[test]
    fn roofline_returns_mamf_at_its_measured_shape() {
        // Bekman's table: A100 SXM, 271.2 TFLOP/s at 1024 x 10240 x 5120 (M x N x K).
        let c = GemmSpec {
            table: None,
            max_flops: Some(271.2e12),
            overhead_s: None,
        }
        .curve(2.039e12, "a100")
        .unwrap();
        let got = c.flops_per_s(1024.0, 10240.0, 5120.0) / 271.2e12;
        assert!((0.98..=1.0).contains(&got), "{got}");
    }

    #[test]
    fn bad_specs_are_refused() {
        let both = GemmSpec {
            table: Some("h100-sxm-bf16".into()),
            max_flops: Some(1e12),
            overhead_s: None,
        };
        let e = both.validate("hw.yaml").unwrap_err().to_string();
        assert!(e.contains("gemm") && e.contains("exactly one"), "{e}");
        let unknown = GemmSpec {
            table: Some("a100".into()),
            max_flops: None,
            overhead_s: None,
        };
        let e = unknown.validate("hw.yaml").unwrap_err().to_string();
        assert!(
            e.contains("gemm.table") && e.contains("h100-sxm-bf16"),
            "{e}"
        );
        let e = GemmCurve::from_csv("m,n,k,tflops\n1,2,x,4\n", "t.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }
}
