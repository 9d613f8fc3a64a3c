//! The GEMM arithmetic of a backend: a leaf module, so that the backend's selection
//! ([`crate::backend`]) and the CUDA op set both name it without importing each other.

/// GEMM arithmetic of the CUDA backend (the CPU backend is fp32 only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Precision {
    /// fp32 in, fp32 math (the correctness path, comparable with the CPU backend).
    #[default]
    Fp32,
    /// fp32 tensors, bf16 tensor-core math with fp32 accumulation
    /// (`CUBLAS_COMPUTE_32F_FAST_16BF`): the speed of bf16 GEMMs, fp32 storage; fp32
    /// tolerances against the CPU do not hold.
    Bf16,
}

impl Precision {
    /// `fp32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }
}
