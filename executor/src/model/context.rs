//! Context parallelism inside a decoder's attention: every GPU of a group of `cp` holds its
//! zigzag share of a microbatch's tokens ([`crate::data::CpShare`]) and computes the queries of
//! those tokens against the keys and values of their whole documents.
//!
//! The forward gathers the group's keys and values (one all-to-all of each GPU's own rows to
//! every other: with cp = 2 the ring's single step, Megatron-LM's `p2p` at cp = 2 and Llama 3's
//! all-gather alike), then runs the causal attention of each piece at its document offset (the
//! kernel of chunked sequences, [`crate::kernels::attention`] with a prefix). The backward
//! gathers them again rather than keeping them (as Megatron-LM's ring attention does), computes
//! each piece's query, key and value gradients, and sends every GPU the key and value gradients
//! of its own rows, which it sums: the reduce-scatter of the all-gather.
//!
//! Shapes: `q [T, H]`, `k, v [T, KV]` of this GPU's `T` rows; the gathered keys of a document of
//! `L` tokens `[L, KV]`. Through host copies ([`OpSet::to_host`], [`OpSet::upload_host`]): the
//! CPU backend only.

use super::OpSet;
use super::experts::{Exchange, Payload, Phase, device, host};
use crate::data::{CpPiece, CpShare};
use crate::kernels::{self, AttnDims};
use crate::{Error, Result};
use ndarray::{Array2, s};

/// This GPU's rows of each piece, in row order: `(piece, first row)`.
fn rows(pieces: &[CpPiece]) -> Vec<(CpPiece, usize)> {
    let mut at = 0;
    pieces
        .iter()
        .map(|&p| {
            let r = (p, at);
            at += p.len;
            r
        })
        .collect()
}

/// One array per document of a microbatch, `[L, cols]`.
type Docs = Vec<Array2<f32>>;

/// Every document's keys and values `[L, KV]`, gathered from the group: each GPU sends its
/// own rows (`k` then `v`) to every other, and places each GPU's rows by that GPU's pieces.
fn gather_kv(
    share: &CpShare,
    (k, v): (&Array2<f32>, &Array2<f32>),
    phase: Phase,
    ex: &mut Exchange<'_>,
) -> Result<(Docs, Docs)> {
    let (t, kv) = k.dim();
    if ex.ep() != share.cp {
        return Err(Error::Invalid(format!(
            "context parallelism: a share of a group of {} reaches {} GPU(s) (a stage of a cp group needs its link to the group)",
            share.cp,
            ex.ep()
        )));
    }
    let mut own = Vec::with_capacity(2 * t * kv);
    own.extend(k.iter().copied());
    own.extend(v.iter().copied());
    let sends = (0..share.cp)
        .map(|_| Payload {
            counts: vec![t as u32],
            rows: own.clone(),
        })
        .collect();
    let got = ex.all_to_all(phase, sends)?;
    let mut keys: Vec<Array2<f32>> = share
        .doc_lens
        .iter()
        .map(|&l| Array2::zeros((l, kv)))
        .collect();
    let mut values = keys.clone();
    for (r, payload) in got.iter().enumerate() {
        let pieces = share.pieces_of(r);
        let n: usize = pieces.iter().map(|p| p.len).sum();
        if payload.rows.len() != 2 * n * kv {
            return Err(Error::Invalid(format!(
                "context parallelism: GPU {r} of the group sent {} values of keys and values, its share holds {n} rows of {kv}",
                payload.rows.len()
            )));
        }
        let (kr, vr) = payload.rows.split_at(n * kv);
        for (p, at) in rows(&pieces) {
            let dst = p.offset..p.offset + p.len;
            for (src, into) in [(kr, &mut keys), (vr, &mut values)] {
                let block =
                    ndarray::ArrayView2::from_shape((p.len, kv), &src[at * kv..(at + p.len) * kv])
                        .map_err(|e| Error::Invalid(e.to_string()))?;
                into[p.doc].slice_mut(s![dst.clone(), ..]).assign(&block);
            }
        }
    }
    Ok((keys, values))
}

/// The attention of this GPU's share: `(o [T, H], lse [T, heads])` of each piece's queries at
/// its document offset against the document's gathered keys and values up to the piece's end.
///
/// # Errors
/// The exchange's (a peer stopped) and host copies' (a backend without them).
pub(crate) fn attention_forward<O: OpSet>(
    ops: &O,
    share: &CpShare,
    (q, k, v): (&O::Tensor, &O::Tensor, &O::Tensor),
    (h, kv, dims): (usize, usize, AttnDims),
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, O::Tensor)> {
    let t: usize = share.pieces.iter().map(|p| p.len).sum();
    let qh = host(ops, q, t, h)?;
    let (keys, values) = gather_kv(
        share,
        (&host(ops, k, t, kv)?, &host(ops, v, t, kv)?),
        Phase::KeysValues,
        ex,
    )?;
    let mut o = Array2::zeros((t, h));
    let mut lse = Array2::zeros((t, dims.heads));
    for (p, at) in rows(&share.pieces) {
        let r = at..at + p.len;
        let upto = p.offset + p.len;
        let (op, lp) = kernels::attention(
            qh.slice(s![r.clone(), ..]),
            keys[p.doc].slice(s![..upto, ..]),
            values[p.doc].slice(s![..upto, ..]),
            &[0, p.len],
            dims,
            p.offset,
        );
        o.slice_mut(s![r.clone(), ..]).assign(&op);
        lse.slice_mut(s![r, ..]).assign(&lp);
    }
    Ok((device(ops, o)?, device(ops, lse)?))
}

/// The attention's dgrad on this GPU's share: `(dq [T, H], dk, dv [T, KV])`, the key and value
/// gradients summed over every GPU of the group whose queries read this GPU's rows.
///
/// # Errors
/// As [`attention_forward`].
#[allow(clippy::type_complexity)]
pub(crate) fn attention_backward<O: OpSet>(
    ops: &O,
    share: &CpShare,
    dout: &O::Tensor,
    (q, k, v, o, lse): (&O::Tensor, &O::Tensor, &O::Tensor, &O::Tensor, &O::Tensor),
    (h, kv, dims): (usize, usize, AttnDims),
    ex: &mut Exchange<'_>,
) -> Result<(O::Tensor, O::Tensor, O::Tensor)> {
    let t: usize = share.pieces.iter().map(|p| p.len).sum();
    let (qh, oh, doh) = (
        host(ops, q, t, h)?,
        host(ops, o, t, h)?,
        host(ops, dout, t, h)?,
    );
    let lh = host(ops, lse, t, dims.heads)?;
    let (keys, values) = gather_kv(
        share,
        (&host(ops, k, t, kv)?, &host(ops, v, t, kv)?),
        Phase::KeysValuesAgain,
        ex,
    )?;
    let mut dq = Array2::zeros((t, h));
    let mut dkeys: Vec<Array2<f32>> = keys.iter().map(|a| Array2::zeros(a.raw_dim())).collect();
    let mut dvalues = dkeys.clone();
    for (p, at) in rows(&share.pieces) {
        let r = at..at + p.len;
        let upto = p.offset + p.len;
        let (dqp, dkp, dvp) = kernels::attention_backward(
            doh.slice(s![r.clone(), ..]),
            qh.slice(s![r.clone(), ..]),
            keys[p.doc].slice(s![..upto, ..]),
            values[p.doc].slice(s![..upto, ..]),
            oh.slice(s![r.clone(), ..]),
            lh.slice(s![r.clone(), ..]),
            &[0, p.len],
            dims,
            p.offset,
        );
        dq.slice_mut(s![r, ..]).assign(&dqp);
        let mut dk_doc = dkeys[p.doc].slice_mut(s![..upto, ..]);
        dk_doc += &dkp;
        let mut dv_doc = dvalues[p.doc].slice_mut(s![..upto, ..]);
        dv_doc += &dvp;
    }
    // Each GPU gets the gradients of its own rows from every GPU, and sums them.
    let sends = (0..share.cp)
        .map(|r| {
            let pieces = share.pieces_of(r);
            let mut rows_out = Vec::new();
            for grads in [&dkeys, &dvalues] {
                for p in &pieces {
                    rows_out.extend(
                        grads[p.doc]
                            .slice(s![p.offset..p.offset + p.len, ..])
                            .iter(),
                    );
                }
            }
            Payload {
                counts: vec![pieces.iter().map(|p| p.len as u32).sum()],
                rows: rows_out,
            }
        })
        .collect();
    let got = ex.all_to_all(Phase::KeyValueGrads, sends)?;
    let mut sum = vec![0.0f32; 2 * t * kv];
    for (r, payload) in got.iter().enumerate() {
        if payload.rows.len() != sum.len() {
            return Err(Error::Invalid(format!(
                "context parallelism: GPU {r} sent {} values of key and value gradients for this GPU's {t} rows of {kv}",
                payload.rows.len()
            )));
        }
        for (a, b) in sum.iter_mut().zip(&payload.rows) {
            *a += b;
        }
    }
    let dv_rows = sum.split_off(t * kv);
    Ok((
        device(ops, dq)?,
        ops.upload_host(sum, t, kv)?,
        ops.upload_host(dv_rows, t, kv)?,
    ))
}

#[cfg(test)]
mod tests {
    use crate::cpu::CpuStage;
    use crate::data::{LossReduction, MicrobatchData, build_step};
    use crate::model::experts::ExpertLink;
    use crate::worker::{StageInput, StageOutput, StageWorker};
    use flatpipe_profiles::ModelSpec;
    use flatpipe_simulator::costs::Recompute;
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    /// One step (F, I, W) of the whole model on `data`: the loss `Σ weight loss` and every
    /// parameter's gradient by name.
    fn step(st: &mut CpuStage, data: &MicrobatchData) -> (f64, HashMap<String, Vec<f32>>) {
        let StageOutput::Loss(loss) = st.forward(0, data, StageInput::Tokens, true).unwrap() else {
            panic!("the whole model ends in its loss")
        };
        assert!(st.backward_input(0, data, None).unwrap().is_none());
        st.backward_weight(0, data).unwrap();
        (loss.weighted, st.named_grads().into_iter().collect())
    }

    /// A group of two GPUs, each with its zigzag share of a microbatch of one long and several
    /// short documents (one shorter than 2 cp chunks), computes the loss and, summed over the
    /// group, every gradient of the whole model on one GPU: the gathered keys give each query
    /// its whole document's causal context, the scattered key and value gradients reach the GPU
    /// whose rows they are. The same at cp = 4 (pieces of 3 tokens' documents left empty).
    #[test]
    fn a_cp_group_matches_one_gpu_on_long_and_short_documents() {
        let m = ModelSpec::from_yaml(
            "name: t\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 32, hidden: 16}\n  - {kind: decoder, count: 2, hidden: 16, ffn: 24, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 32, hidden: 16}\n",
            "test",
        )
        .unwrap();
        let whole = build_step(
            &[vec![vec![97, 9, 5, 3]]],
            32,
            4,
            0,
            LossReduction::PerToken,
        )
        .remove(0)
        .remove(0);
        let mut one = CpuStage::new(&m, 0..4, 7, Recompute::None).unwrap();
        let (want_loss, want) = step(&mut one, &whole);
        for cp in [2usize, 4] {
            let abort = Arc::new(AtomicBool::new(false));
            let results: Vec<(f64, HashMap<String, Vec<f32>>)> = std::thread::scope(|scope| {
                let hs: Vec<_> = ExpertLink::group(cp, &abort)
                    .into_iter()
                    .enumerate()
                    .map(|(i, link)| {
                        let share = whole.cp_share(i, cp).unwrap();
                        let m = &m;
                        scope.spawn(move || {
                            let mut st = CpuStage::new(m, 0..4, 7, Recompute::None)
                                .unwrap()
                                .with_link(link);
                            step(&mut st, &share)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let loss: f64 = results.iter().map(|r| r.0).sum();
            assert!(
                (loss - want_loss).abs() < 1e-5 * want_loss.abs(),
                "cp {cp}: {loss} vs {want_loss}"
            );
            for (name, g) in &want {
                let sum: Vec<f32> = (0..g.len())
                    .map(|j| results.iter().map(|r| r.1[name][j]).sum())
                    .collect();
                let scale = g.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-6);
                let diff = g
                    .iter()
                    .zip(&sum)
                    .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                assert!(
                    diff <= 1e-4 * scale,
                    "cp {cp}: {name}: max diff {diff} of {scale}"
                );
            }
        }
    }
}
