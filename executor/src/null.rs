//! A backend whose kernels do nothing: hidden states are just their element counts. Running a
//! schedule on it measures the interpreter's own overhead per action (receives, sends, mailbox,
//! bookkeeping), which the criterion bench `interpreter_overhead` reports.

use crate::worker::{AdamW, LossSums, StageInput, StageOutput, StageWorker};
use crate::{Error, MicrobatchData, Result};
use std::collections::HashSet;

/// A stage that computes nothing but checks the F -> I -> W order per microbatch.
#[derive(Debug, Clone)]
pub struct NullStage {
    hidden: usize,
    first: bool,
    last: bool,
    forwarded: HashSet<u32>,
    dgraded: HashSet<u32>,
}

impl NullStage {
    /// A stage of hidden size `hidden`; `first` takes token ids, `last` ends in the loss.
    pub fn new(hidden: usize, first: bool, last: bool) -> Self {
        NullStage {
            hidden,
            first,
            last,
            forwarded: HashSet::new(),
            dgraded: HashSet::new(),
        }
    }
}

impl StageWorker for NullStage {
    type Hidden = usize;

    fn hidden_size(&self) -> usize {
        self.hidden
    }

    fn hidden_len(h: &usize) -> usize {
        *h
    }

    fn forward(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        input: StageInput<usize>,
        keep: bool,
    ) -> Result<StageOutput<usize>> {
        if matches!(input, StageInput::Tokens) != self.first {
            return Err(Error::Invalid(
                "token ids go only into the first stage".into(),
            ));
        }
        if keep {
            self.forwarded.insert(mb);
        }
        Ok(if self.last {
            StageOutput::Loss(LossSums {
                weighted: 0.0,
                sum: 0.0,
                tokens: data.tokens() as u64,
            })
        } else {
            StageOutput::Hidden(data.tokens() * self.hidden)
        })
    }

    fn backward_input(
        &mut self,
        mb: u32,
        data: &MicrobatchData,
        _grad: Option<usize>,
    ) -> Result<Option<usize>> {
        if !self.forwarded.remove(&mb) {
            return Err(Error::Invalid(format!("I of microbatch {mb} before its F")));
        }
        self.dgraded.insert(mb);
        Ok((!self.first).then(|| data.tokens() * self.hidden))
    }

    fn backward_weight(&mut self, mb: u32, _data: &MicrobatchData) -> Result<()> {
        if !self.dgraded.remove(&mb) {
            return Err(Error::Invalid(format!("W of microbatch {mb} before its I")));
        }
        Ok(())
    }

    fn zero_grads(&mut self) -> Result<()> {
        Ok(())
    }

    fn visit_grads(&mut self, _f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        Ok(())
    }

    fn grad_sq_norm(&self) -> Result<f64> {
        Ok(0.0)
    }

    fn optimizer_step(&mut self, _opt: &AdamW, _t: u64, _grad_scale: f32) -> Result<()> {
        Ok(())
    }

    fn named_params(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    fn named_grads(&self) -> Vec<(String, Vec<f32>)> {
        Vec::new()
    }

    fn held_microbatches(&self) -> usize {
        self.forwarded.len() + self.dgraded.len()
    }
}
