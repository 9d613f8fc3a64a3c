//! Python's `Workload`: a length distribution and its step sampler.

use super::*;

/// A workload: the distribution of sequence lengths (tokens) a step draws from, and how many
/// sequences (or tokens) a step holds.
#[pyclass(module = "flatpipe._core", name = "Workload", frozen)]
#[derive(Debug, Clone)]
pub struct PyWorkload {
    pub(crate) inner: Arc<flatpipe_profiles::Workload>,
}

#[pymethods]
impl PyWorkload {
    /// A built-in workload (`sharegpt-v3`, `sharegpt-v3-merged`, `tiny-chat`) or a YAML / CSV
    /// file.
    #[staticmethod]
    pub(crate) fn load(name: &str) -> PyResult<Self> {
        Ok(PyWorkload {
            inner: Arc::new(builtins::workload(name).map_err(err)?),
        })
    }

    /// The workload's name.
    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    /// The workload's seed (the step sampler's default).
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed
    }

    /// Step `step`'s sequence lengths, `[n]` uint32: the same draw `flatpipe simulate`,
    /// `plan` and `execute` make for that step and seed (default the workload's).
    #[pyo3(signature = (step, seed = None))]
    fn sample_step<'py>(
        &self,
        py: Python<'py>,
        step: i128,
        seed: Option<i128>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let step: u64 = nat("step", step)?;
        let seed: Option<u64> = nat_opt("seed", seed)?;
        let w = &self.inner;
        Ok(
            w.sample_step(seed.unwrap_or(w.seed), step, w.default_step_size())
                .to_pyarray(py),
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "Workload(name={:?}, seed={})",
            self.inner.name, self.inner.seed
        )
    }
}
