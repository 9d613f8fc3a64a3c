//! Python's `Profile`: a cost profile loaded, built analytically or fitted, and its
//! queries.

use super::*;

/// A cost profile: per layer and phase (F, I, W, Fo) `t = c0 + c_tok * tokens + c_attn * pairs`,
/// activation and parameter bytes, the hardware and its links.
#[pyclass(module = "flatpipe._core", name = "Profile", frozen)]
#[derive(Debug, Clone)]
pub struct PyProfile {
    pub(crate) inner: Arc<Profile>,
}

#[pymethods]
impl PyProfile {
    /// The analytic profile of `model` on `hardware` (built-in names or YAML files): FLOP counts
    /// over datasheet peaks (`profiles/src/analytic.rs` gives every formula).
    #[staticmethod]
    pub(crate) fn analytic(model: &str, hardware: &str) -> PyResult<Self> {
        let m = builtins::model(model).map_err(err)?;
        let hw = builtins::hardware(hardware).map_err(err)?;
        let p = analytic_profile(&m, &hw, &AnalyticOptions::default()).map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A profile file (YAML), as `flatpipe profile` writes it.
    #[staticmethod]
    pub(crate) fn load(path: &str) -> PyResult<Self> {
        let text = flatpipe_profiles::read_to_string(std::path::Path::new(path)).map_err(err)?;
        let p = Profile::from_yaml(&text, path).map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// The profile of one GPU of a Megatron-style tensor-parallel group of `tp` GPUs.
    #[pyo3(signature = (tp, sequence_parallel = true))]
    fn tensor_parallel(&self, tp: i128, sequence_parallel: bool) -> PyResult<Self> {
        let tp: u32 = nat("tp", tp)?;
        let p = self
            .inner
            .tensor_parallel(tp, sequence_parallel)
            .map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy whose layers of `kind` (`"embedding"`, `"decoder"`, `"head"`) cost
    /// `c0_s + c_tok_s * tokens + c_attn_s * attn_pairs` seconds in `phase` (`"F"`, `"I"`,
    /// `"W"`, `"Fo"`, or `"B"`, a fused backward, which otherwise costs I + W): how a fit of measured timings becomes a profile. The copy is marked
    /// measured, with `note` added to its provenance.
    #[pyo3(signature = (kind, phase, c0_s, c_tok_s, c_attn_s = 0.0, note = ""))]
    fn with_costs(
        &self,
        kind: &str,
        phase: &str,
        c0_s: f64,
        c_tok_s: f64,
        c_attn_s: f64,
        note: &str,
    ) -> PyResult<Self> {
        let kind = match kind {
            "embedding" => LayerKind::Embedding,
            "decoder" => LayerKind::Decoder,
            "head" => LayerKind::Head,
            other => {
                return Err(err(format!(
                    "kind = {other:?} is invalid: \"embedding\", \"decoder\" or \"head\""
                )));
            }
        };
        let coeffs = CostCoeffs {
            c0_s,
            c_tok_s,
            c_attn_s,
        };
        for (name, v) in [("c0_s", c0_s), ("c_tok_s", c_tok_s), ("c_attn_s", c_attn_s)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(err(format!(
                    "{name} = {v} is invalid: a finite number of seconds >= 0"
                )));
            }
        }
        let mut p = (*self.inner).clone();
        let mut found = false;
        for l in p.layers.iter_mut().filter(|l| l.kind == kind) {
            found = true;
            match phase {
                "F" => l.f = coeffs,
                "I" => l.i = coeffs,
                "W" => l.w = coeffs,
                "Fo" => l.fo = coeffs,
                "B" => l.b = Some(coeffs),
                other => {
                    return Err(err(format!(
                        "phase = {other:?} is invalid: \"F\", \"I\", \"W\", \"Fo\" or \"B\""
                    )));
                }
            }
        }
        if !found {
            return Err(err(format!(
                "the profile of {} has no {kind:?} layer",
                p.model
            )));
        }
        p.provenance.source = ProfileSource::Measured;
        if !note.is_empty() && !p.provenance.notes.contains(note) {
            p.provenance.notes = format!("{}; {note}", p.provenance.notes);
        }
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy with the link between ranks (both intra- and inter-node) set to
    /// `alpha_s + bytes / beta_bytes_per_s`, each message costing its sender and its receiver
    /// `post_s` seconds of CPU time to post (LogP's `o`), and the optimizer step to
    /// `optimizer_s_per_param` seconds per parameter.
    #[pyo3(signature = (alpha_s, beta_bytes_per_s, optimizer_s_per_param = 0.0, post_s = 0.0))]
    fn with_link(
        &self,
        alpha_s: f64,
        beta_bytes_per_s: f64,
        optimizer_s_per_param: f64,
        post_s: f64,
    ) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        let link = flatpipe_profiles::Link {
            name: "measured".into(),
            alpha_s,
            beta_bytes_per_s,
            post_s,
        };
        p.hardware.intra_node = link.clone();
        p.hardware.inter_node = link;
        p.optimizer_s_per_param = optimizer_s_per_param;
        p.validate("Profile.with_link").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy whose links charge each message's sender and receiver `post_s` seconds of CPU
    /// time to post it (`Link::post_s`; 0 by default).
    fn with_post(&self, post_s: f64) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        p.hardware.intra_node.post_s = post_s;
        p.hardware.inter_node.post_s = post_s;
        p.validate("Profile.with_post").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// A copy with a fixed cost per stage action of `f_s`, `i_s`, `w_s` and `b_s` seconds
    /// (F, I, W, fused B), whatever the layers the stage holds (`Profile::action_overhead`).
    /// With `first_stage_backward_in_w`, the first stage's I costs nothing and its W a fused
    /// backward, as in PyTorch's runtime and `flatpipe.torch`
    /// (`Profile::first_stage_backward_in_w`).
    #[pyo3(signature = (f_s, i_s, w_s, b_s = 0.0, first_stage_backward_in_w = false))]
    fn with_overhead(
        &self,
        f_s: f64,
        i_s: f64,
        w_s: f64,
        b_s: f64,
        first_stage_backward_in_w: bool,
    ) -> PyResult<Self> {
        let mut p = (*self.inner).clone();
        p.action_overhead = flatpipe_profiles::ActionOverhead { f_s, i_s, w_s, b_s };
        p.first_stage_backward_in_w = first_stage_backward_in_w;
        p.validate("Profile.with_overhead").map_err(err)?;
        Ok(PyProfile { inner: Arc::new(p) })
    }

    /// The model's name.
    #[getter]
    fn model(&self) -> String {
        self.inner.model.clone()
    }

    /// The hardware's name.
    #[getter]
    fn hardware(&self) -> String {
        self.inner.hardware.name.clone()
    }

    /// Layers (embedding, decoders, head).
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.layers.len()
    }

    /// The profile as YAML text.
    fn to_yaml(&self) -> PyResult<String> {
        self.inner.to_yaml().map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "Profile(model={:?}, hardware={:?}, layers={}, source={:?})",
            self.inner.model,
            self.inner.hardware.name,
            self.inner.layers.len(),
            self.inner.provenance.source
        )
    }
}
