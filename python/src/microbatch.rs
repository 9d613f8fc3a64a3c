//! Python's `Microbatch`: one flat `[T]` microbatch with its `cu_seqlens`.

use super::*;

/// One microbatch of a step: flat `[T]` tokens of several sequences.
#[pyclass(module = "flatpipe._core", name = "Microbatch", frozen)]
#[derive(Debug, Clone)]
pub struct PyMicrobatch {
    pub(crate) mb: Microbatch,
    pub(crate) index: usize,
}

impl PyMicrobatch {
    /// `mbs` in order, each with its index in the list as its id.
    pub(crate) fn numbered(mbs: &[Microbatch]) -> Vec<Self> {
        mbs.iter()
            .enumerate()
            .map(|(index, mb)| Self {
                mb: mb.clone(),
                index,
            })
            .collect()
    }
}

#[pymethods]
impl PyMicrobatch {
    /// The microbatch's id in the step's actions (`0F3` is microbatch 3).
    #[getter]
    fn index(&self) -> usize {
        self.index
    }

    /// True tokens `T`.
    #[getter]
    fn tokens(&self) -> u64 {
        self.mb.tokens()
    }

    /// Sequence lengths, `[n]` uint32.
    #[getter]
    fn seq_lens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        self.mb.seq_lens.to_pyarray(py)
    }

    /// `[0, s_0, s_0 + s_1, ..., T]`, `[n + 1]` int64 (FlashAttention's varlen layout).
    #[getter]
    fn cu_seqlens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let v: Vec<i64> = self.mb.cu_seqlens().iter().map(|&x| x as i64).collect();
        v.to_pyarray(py)
    }

    /// Causal attention query-key pairs, `sum s (s + 1) / 2` (a chunk at offset `o`: `T (T + 1)
    /// / 2 + T o`).
    #[getter]
    fn attn_pairs(&self) -> u64 {
        self.mb.attn_pairs()
    }

    /// `None`, or for one chunk of a sequence longer than the token budget `(sequence, index,
    /// of, offset)`: the sequence's index in the replica's share of the step, the chunk's index
    /// among its `of` chunks, and the tokens of the sequence before it. A chunk's forward reads
    /// the earlier chunks' keys and values on each stage; its backward hands back their
    /// gradients.
    #[getter]
    fn chunk(&self) -> Option<(u32, u32, u32, u32)> {
        self.mb.chunk.map(|c| (c.sequence, c.index, c.of, c.offset))
    }

    fn __repr__(&self) -> String {
        format!(
            "Microbatch(index={}, tokens={}, sequences={})",
            self.index,
            self.mb.tokens(),
            self.mb.seq_lens.len()
        )
    }
}
