//! Hardware: one device type and its links.

use crate::gemm::{AttentionSpec, GemmCurve, GemmSpec};
use crate::{Error, Result, yaml};
use serde::{Deserialize, Serialize};

/// A point-to-point link with the alpha-beta cost model `t = alpha_s + bytes / beta_bytes_per_s`
/// (Hockney 1994).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Human-readable link name (e.g. `NVLink 4`).
    #[serde(default)]
    pub name: String,
    /// Latency per message, seconds.
    pub alpha_s: f64,
    /// Bandwidth per direction, bytes per second.
    pub beta_bytes_per_s: f64,
    /// Seconds the sending rank and the receiving rank each spend posting one message (LogP's
    /// overhead `o`, Culler et al. 1993): the CPU time of an `isend` / `irecv` call, which
    /// delays the rank's next action, unlike `alpha_s`, which only delays the message.
    /// 0 where not measured (a GPU's copy engines or NCCL's kernels post asynchronously).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub post_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Link {
    /// Time to move `bytes` over this link, seconds.
    pub fn time_s(&self, bytes: f64) -> f64 {
        self.alpha_s + bytes / self.beta_bytes_per_s
    }

    pub(crate) fn validate(&self, origin: &str, field: &str) -> Result<()> {
        Error::check_seconds(origin, format!("{field}.alpha_s"), self.alpha_s)?;
        if !(self.beta_bytes_per_s.is_finite() && self.beta_bytes_per_s > 0.0) {
            return Err(Error::invalid(
                origin,
                format!("{field}.beta_bytes_per_s"),
                self.beta_bytes_per_s,
                "a finite number of bytes per second > 0",
            ));
        }
        Error::check_seconds(origin, format!("{field}.post_s"), self.post_s)
    }
}

/// One accelerator type and how its devices are connected (YAML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// Device name, e.g. `NVIDIA H200 SXM`.
    pub name: String,
    /// Device memory in bytes as the driver reports it (planners subtract a reserve).
    pub memory_bytes: u64,
    /// Peak dense bf16 throughput, FLOP/s (datasheet, no sparsity).
    pub peak_flops: f64,
    /// HBM bandwidth, bytes per second (bounds memory-bound kernels).
    pub hbm_bytes_per_s: f64,
    /// Devices per node; ranks `r` and `q` share a node iff `r / gpus_per_node == q / gpus_per_node`.
    pub gpus_per_node: u32,
    /// Link between devices of one node.
    pub intra_node: Link,
    /// Link between devices of different nodes (per device).
    pub inter_node: Link,
    /// Nodes of the cluster, when it has a size: a run of more than `nodes x gpus_per_node`
    /// GPUs is refused (absent: as many nodes as a run asks for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<u32>,
    /// How much longer compute runs while a collective runs on the same device (a fraction:
    /// 0.18 is 18% longer), applied only over the time they overlap: the communication
    /// kernels take streaming multiprocessors and memory bandwidth from the compute. The
    /// built-in GPUs derive it from the SMs a collective occupies: DeepSeek-V3 (arXiv
    /// 2412.19437, §3.2.2) runs its all-to-all at full InfiniBand and NVLink bandwidth on 20
    /// of an H800's 132 SMs, leaving compute `(SMs - 20) / SMs` of the device, so `SMs / (SMs -
    /// 20) - 1`. Absent: 0 (not modelled). Range 0 to 10.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub collective_interference: f64,
    /// GEMM throughput by shape: a measured table or the roofline of the GPU's maximum
    /// achievable matmul FLOP/s ([`crate::gemm`]). Absent: the analytic profile's flat
    /// efficiency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<GemmSpec>,
    /// The fused attention kernel's throughput ([`crate::gemm`]). Absent: the GEMM curve's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionSpec>,
    /// An expert-parallel all-to-all's link inside a node where it is not `intra_node`'s: the
    /// exchange `flatpipe profile` measured on a backend whose all-to-all is not a
    /// point-to-point transfer (the CPU executor's). Absent: `intra_node`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub all_to_all: Option<Link>,
}

impl Hardware {
    /// Checks that a run of `gpus` GPUs fits the cluster (`nodes x gpus_per_node`, when
    /// `nodes` is given).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the GPUs asked for and the cluster's.
    pub fn check_gpus(&self, gpus: u64) -> Result<()> {
        if let Some(n) = self.nodes {
            let have = u64::from(n) * u64::from(self.gpus_per_node);
            if gpus > have {
                return Err(Error::invalid(
                    &self.name,
                    "GPUs asked for (tp x dp x pp)",
                    gpus,
                    format!(
                        "at most {n} nodes x {} GPUs = {have} on this cluster (its `nodes`)",
                        self.gpus_per_node
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Parses and validates a hardware file's text. `origin` names the file in errors.
    ///
    /// # Errors
    /// [`Error::Yaml`] or [`Error::Invalid`].
    pub fn from_yaml(text: &str, origin: &str) -> Result<Self> {
        let hw: Hardware = yaml::parse(text, origin)?;
        hw.validate(origin)?;
        Ok(hw)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field.
    pub fn validate(&self, origin: &str) -> Result<()> {
        if self.memory_bytes == 0 {
            return Err(Error::invalid(origin, "memory_bytes", 0, "> 0 bytes"));
        }
        for (field, v) in [
            ("peak_flops", self.peak_flops),
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::invalid(origin, field, v, "a finite number > 0"));
            }
        }
        if self.gpus_per_node == 0 {
            return Err(Error::invalid(origin, "gpus_per_node", 0, ">= 1"));
        }
        if self.nodes == Some(0) {
            return Err(Error::invalid(origin, "nodes", 0, ">= 1 node (or absent)"));
        }
        let k = self.collective_interference;
        if !(k.is_finite() && (0.0..=10.0).contains(&k)) {
            return Err(Error::invalid(
                origin,
                "collective_interference",
                k,
                "a fraction from 0 to 10 (how much longer compute runs beside a collective)",
            ));
        }
        if let Some(g) = &self.gemm {
            g.validate(origin)?;
        }
        if let Some(a) = &self.attention {
            a.validate(origin)?;
        }
        self.intra_node.validate(origin, "intra_node")?;
        self.inter_node.validate(origin, "inter_node")
    }

    /// The GPU's GEMM curve, if its file names one.
    ///
    /// # Errors
    /// As [`GemmSpec::curve`].
    pub fn gemm_curve(&self) -> Result<Option<GemmCurve>> {
        self.gemm
            .as_ref()
            .map(|g| g.curve(self.hbm_bytes_per_s, &self.name))
            .transpose()
    }
}
