//! The profiler: measures the executor's own kernels and links on this machine and fits the
//! profile's cost model `t = c0 + c_tok * tokens + c_attn * attn_pairs` per layer kind and phase.
//!
//! For each layer kind (embedding, decoder, head) a stage holding that kind's first layers (up
//! to [`DECODERS_PER_STAGE`] consecutive decoders, each then meeting its own weights cold in
//! cache as in a real stage; the time is divided by their count) is timed over a grid of token counts T and two sequence compositions at each T: one sequence
//! of T tokens (`T(T+1)/2` attention pairs) and many short sequences (`T(s+1)/2` pairs), so the
//! attention term separates from the per-token term. Each point runs `warmup` untimed rounds and
//! `reps` timed ones of F, then I, then W (and a forward-only Fo); the median is kept. The fit is
//! non-negative least squares on relative residuals (every row scaled by `1 / t`, so short and
//! long microbatches count alike): W has no attention term and an unconstrained fit would go
//! negative. NNLS in three unknowns is solved exactly by trying every support set (the optimum is
//! the least-squares solution on its support with all coefficients positive, Lawson and Hanson
//! 1974), each by an SVD from `nalgebra`.
//!
//! Optionally `concurrency - 1` extra threads run the same layers at the same time, each on its
//! own copy made once, on the T being measured in short sequences, so the figures hold when p
//! ranks share the machine (caches, memory bandwidth, clocks) or, on a GPU, its multiprocessors
//! (each extra thread drives its own stream).
//!
//! The measurements are generic over the backend ([`Profiled`]): the CPU backend is timed with the
//! host clock ([`profile_cpu`]), the CUDA backend with CUDA events (`profile_cuda`, feature
//! `cuda`).

use crate::cpu::CpuStage;
use crate::data::{LossReduction, MicrobatchData, build_step};
use crate::worker::{AdamW, StageInput, StageWorker};
use crate::{Error, Result};
use flatpipe_profiles::{
    AnalyticOptions, CostCoeffs, FitQuality, GemmSplit, Hardware, LayerKind, Link, ModelSpec,
    Phase, Profile, ProfileSource, Provenance, analytic_profile,
};
use flatpipe_simulator::costs::Recompute;
use nalgebra::{DMatrix, DVector};
use ndarray::Array2;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the profiler needs of a backend's stage beyond [`StageWorker`].
pub trait Profiled: StageWorker + Sized {
    /// `x [T, H]` as this backend's hidden tensor.
    ///
    /// # Errors
    /// A backend failure.
    fn hidden_from(&self, x: &Array2<f32>) -> Result<Self::Hidden>;
    /// Bytes of activations held between F and W.
    fn saved_bytes(&self) -> usize;
    /// Parameters of the stage.
    fn param_count(&self) -> u64;
    /// Seconds `f` takes on this backend (host clock on the CPU; CUDA events around `f`, then a
    /// wait for them, on a GPU).
    ///
    /// # Errors
    /// `f`'s error or a backend failure.
    fn timed(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<f64>;
}

impl Profiled for CpuStage {
    fn hidden_from(&self, x: &Array2<f32>) -> Result<Array2<f32>> {
        Ok(x.clone())
    }
    fn saved_bytes(&self) -> usize {
        CpuStage::saved_bytes(self)
    }
    fn param_count(&self) -> u64 {
        crate::cpu::param_count(self)
    }
    fn timed(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<f64> {
        let s = Instant::now();
        f(self)?;
        Ok(s.elapsed().as_secs_f64())
    }
}

/// Builds the stage of layers `range` with weights from `seed` (each call a new stage; on a GPU,
/// on its own stream).
pub type StageFactory<W> = Arc<dyn Fn(std::ops::Range<usize>, u64) -> Result<W> + Send + Sync>;

/// Decoder layers timed together per grid point.
pub const DECODERS_PER_STAGE: usize = 4;

/// One timing: a microbatch of `tokens` tokens and `pairs` attention pairs took `seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Tokens T.
    pub tokens: f64,
    /// Causal attention pairs `Σ s(s+1)/2`.
    pub pairs: f64,
    /// Median seconds.
    pub seconds: f64,
}

/// A fitted cost model and how well it fits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// `c0_s`, `c_tok_s`, `c_attn_s`, all >= 0.
    pub coeffs: CostCoeffs,
    /// Coefficient of determination on the raw timings.
    pub r2: f64,
    /// `max |predicted - measured| / measured`.
    pub max_rel_residual: f64,
}

/// Non-negative least squares fit of `t = c0 + c_tok * tokens + c_attn * pairs` on relative
/// residuals; `with_attn = false` fixes `c_attn = 0`.
///
/// # Errors
/// [`Error::Invalid`] for no samples or a non-positive time.
pub fn nnls_fit(samples: &[Sample], with_attn: bool) -> Result<Fit> {
    if samples.is_empty() {
        return Err(Error::Invalid("no samples to fit".into()));
    }
    if let Some(s) = samples
        .iter()
        .find(|s| !(s.seconds > 0.0 && s.seconds.is_finite()))
    {
        return Err(Error::Invalid(format!(
            "a timing of {} s (tokens {}) cannot be fitted: times must be > 0",
            s.seconds, s.tokens
        )));
    }
    let cols = if with_attn { 3 } else { 2 };
    let n = samples.len();
    let row = |s: &Sample| [1.0, s.tokens, s.pairs];
    let mut best: Option<(f64, [f64; 3])> = None;
    for support in 1u32..(1 << cols) {
        let idx: Vec<usize> = (0..cols).filter(|j| support & (1 << j) != 0).collect();
        // Scale each column to unit size so the SVD is well conditioned (tokens ~ 1e3, pairs ~
        // 1e6), and each row by 1 / t (relative residuals).
        let scale: Vec<f64> = idx
            .iter()
            .map(|&j| {
                samples
                    .iter()
                    .map(|s| row(s)[j].abs())
                    .fold(0.0, f64::max)
                    .max(f64::MIN_POSITIVE)
            })
            .collect();
        let a = DMatrix::from_fn(n, idx.len(), |i, k| {
            row(&samples[i])[idx[k]] / scale[k] / samples[i].seconds
        });
        let b = DVector::from_element(n, 1.0);
        let Ok(x) = a.clone().svd(true, true).solve(&b, 1e-12) else {
            continue;
        };
        let mut c = [0.0; 3];
        for (k, &j) in idx.iter().enumerate() {
            c[j] = x[k] / scale[k];
        }
        if c.iter().any(|v| *v < 0.0 || !v.is_finite()) {
            continue;
        }
        let res: f64 = samples
            .iter()
            .map(|s| {
                let p = c[0] + c[1] * s.tokens + c[2] * s.pairs;
                ((p - s.seconds) / s.seconds).powi(2)
            })
            .sum();
        if best.is_none_or(|(r, _)| res < r) {
            best = Some((res, c));
        }
    }
    let (_, c) = best.ok_or_else(|| Error::Invalid("no non-negative fit exists".into()))?;
    let coeffs = CostCoeffs {
        c0_s: c[0],
        c_tok_s: c[1],
        c_attn_s: c[2],
    };
    let mean = samples.iter().map(|s| s.seconds).sum::<f64>() / n as f64;
    let (mut ss_res, mut ss_tot, mut max_rel) = (0.0, 0.0, 0.0f64);
    for s in samples {
        let p = coeffs.time_s(s.tokens, s.pairs);
        ss_res += (p - s.seconds).powi(2);
        ss_tot += (s.seconds - mean).powi(2);
        max_rel = max_rel.max((p - s.seconds).abs() / s.seconds);
    }
    Ok(Fit {
        coeffs,
        r2: if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else {
            1.0
        },
        max_rel_residual: max_rel,
    })
}

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileConfig {
    /// Token counts T of the grid.
    pub tokens: Vec<usize>,
    /// Length of the short sequences of the many-short composition.
    pub short_seq: usize,
    /// Untimed rounds per grid point.
    pub warmup: u32,
    /// Timed rounds per grid point (the median is kept).
    pub reps: u32,
    /// Link message sizes, bytes.
    pub link_sizes: Vec<usize>,
    /// Threads running the same work at once (ranks sharing the machine).
    pub concurrency: usize,
}

impl ProfileConfig {
    /// A coarse grid: T in {32, 128, 512, 1024, 2048}, 1 warm-up, 3 timed rounds, links 1 KiB
    /// to 16 MiB.
    pub fn quick() -> Self {
        ProfileConfig {
            tokens: vec![32, 128, 512, 1024, 2048],
            short_seq: 32,
            warmup: 1,
            reps: 3,
            link_sizes: (10..=24).step_by(2).map(|k| 1usize << k).collect(),
            concurrency: 1,
        }
    }

    /// The full grid: T in {16, 32, 64, 128, 256, 512, 1024, 2048, 4096}, 2 warm-ups, 7 timed
    /// rounds, links 1 KiB to 256 MiB.
    pub fn full() -> Self {
        ProfileConfig {
            tokens: vec![16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
            short_seq: 32,
            warmup: 2,
            reps: 7,
            link_sizes: (10..=28).step_by(2).map(|k| 1usize << k).collect(),
            concurrency: 1,
        }
    }

    /// The grid for a GPU: T in {1024, 4096, 16384}, short sequences of 512 tokens, 1 warm-up and
    /// 3 timed rounds, links 64 KiB to 256 MiB.
    pub fn gpu() -> Self {
        ProfileConfig {
            tokens: vec![1024, 4096, 16384],
            short_seq: 512,
            warmup: 1,
            reps: 3,
            link_sizes: (16..=28).step_by(2).map(|k| 1usize << k).collect(),
            concurrency: 1,
        }
    }

    /// The grid in words, for the provenance.
    pub fn describe(&self) -> String {
        format!(
            "T in {:?}, one sequence of T and sequences of {} per point, {} warm-up + {} timed rounds (median), {} thread(s) busy, links {} B to {} B",
            self.tokens,
            self.short_seq,
            self.warmup,
            self.reps,
            self.concurrency,
            self.link_sizes.first().copied().unwrap_or(0),
            self.link_sizes.last().copied().unwrap_or(0)
        )
    }
}

/// Measurements of one layer kind.
#[derive(Debug, Clone, PartialEq)]
pub struct KindProfile {
    /// The layer kind.
    pub kind: LayerKind,
    /// Fits of F, I, W and Fo.
    pub f: Fit,
    /// dgrad.
    pub i: Fit,
    /// wgrad.
    pub w: Fit,
    /// forward-only.
    pub fo: Fit,
    /// Bytes per token kept from F until I only.
    pub act_bytes_per_token_i: f64,
    /// Bytes per token kept until W.
    pub act_bytes_per_token_w: f64,
    /// Bytes of the layer's parameters (fp32).
    pub param_bytes: u64,
    /// The raw samples per phase (F, I, W, Fo).
    pub samples: [Vec<Sample>; 4],
}

/// Everything the profiler measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// Per layer kind present in the model.
    pub kinds: Vec<KindProfile>,
    /// The link between two ranks (threads): latency and bandwidth of a transfer.
    pub link: Link,
    /// The expert-parallel all-to-all between two ranks (threads) through the executor's
    /// [`crate::model::experts::ExpertLink`], for a model with mixture-of-experts layers.
    pub all_to_all: Option<Link>,
    /// AdamW step seconds per parameter.
    pub optimizer_s_per_param: f64,
    /// How the figures were measured (the profile's provenance notes).
    pub notes: String,
}

/// The median of `v` (the upper of the two middle values for an even count); `v` is not empty.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn microbatch(seq_lens: Vec<u32>, vocab: u32) -> MicrobatchData {
    build_step(&[vec![seq_lens]], vocab, 1, 0, LossReduction::PerToken)
        .remove(0)
        .remove(0)
}

/// Times F, I, W and Fo of `stage` on `mb`; returns the median seconds of each.
fn time_phases<W: Profiled>(
    stage: &mut W,
    mb: &MicrobatchData,
    first: bool,
    last: bool,
    warmup: u32,
    reps: u32,
) -> Result<[f64; 4]> {
    let t = mb.tokens();
    let h = stage.hidden_size();
    let x = Array2::from_shape_fn((t, h), |(i, j)| ((i * 7 + j * 13) % 23) as f32 / 23.0 - 0.5);
    let input = |st: &W| -> Result<StageInput<W::Hidden>> {
        Ok(if first {
            StageInput::Tokens
        } else {
            StageInput::Hidden(st.hidden_from(&x)?)
        })
    };
    let mut times: [Vec<f64>; 4] = Default::default();
    for round in 0..warmup + reps {
        // Inputs are made before the clock starts.
        let inp = input(stage)?;
        let f = stage.timed(|st| st.forward(0, mb, inp, true).map(drop))?;
        let g = if last {
            None
        } else {
            Some(stage.hidden_from(&x)?)
        };
        let i = stage.timed(|st| st.backward_input(0, mb, g).map(drop))?;
        let w = stage.timed(|st| st.backward_weight(0, mb))?;
        let inp = input(stage)?;
        let fo = stage.timed(|st| st.forward(1, mb, inp, false).map(drop))?;
        // Losses a GPU left on the device.
        stage.take_losses()?;
        if round >= warmup {
            for (k, v) in [f, i, w, fo].into_iter().enumerate() {
                times[k].push(v);
            }
        }
    }
    Ok(times.map(median))
}

/// The other ranks sharing the machine while the profiler measures
/// ([`ProfileConfig::concurrency`]): `n`
/// threads, each with its own copy of the stage made once, running F, I, W and Fo round after
/// round on the microbatch it is told ([`Load::follow`]: the profiler's current T, in short
/// sequences), until dropped.
///
/// Each thread used to make a fresh stage per round (weights allocated and drawn; on a GPU
/// also new streams and a cuBLAS handle), so the other ranks' load was largely set-up, and ran
/// one fixed T throughout. Two profiles of Llama-3.1-8B with 4 streams busy on one H200, taken
/// that way, disagreed by 7x on the decoder's F per token and predicted the same steps 17%
/// short and 5% over (`docs/gpu/h200-2026-12-04/`).
struct Load {
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Arc<MicrobatchData>>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    /// `n` threads; each makes its stage with `make` and runs `round` on it with the current
    /// microbatch, starting from `mb`. Returns once every thread has made its stage, so no
    /// measurement runs against their set-up. A thread whose stage cannot be made (on a GPU,
    /// out of memory) says so and stays idle; one whose round fails (its stage may be left
    /// mid-step) says so and makes a fresh stage.
    fn start<S: 'static>(
        n: usize,
        mb: MicrobatchData,
        make: impl Fn() -> Result<S> + Send + Sync + Clone + 'static,
        round: impl Fn(&mut S, &MicrobatchData) -> Result<()> + Send + Sync + Clone + 'static,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(Arc::new(mb)));
        let ready = Arc::new(std::sync::Barrier::new(n + 1));
        let handles = (0..n)
            .map(|_| {
                let (stop, current) = (Arc::clone(&stop), Arc::clone(&current));
                let (make, round, ready) = (make.clone(), round.clone(), Arc::clone(&ready));
                std::thread::spawn(move || {
                    let made = make();
                    ready.wait();
                    let mut stage = match made {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(
                                "profile: a concurrent rank's stage: {e}; it stays idle, so fewer ranks than the profile's `concurrency` are busy"
                            );
                            return;
                        }
                    };
                    let mut warned = false;
                    while !stop.load(Ordering::Relaxed) {
                        let mb = Arc::clone(&current.lock().unwrap_or_else(|e| e.into_inner()));
                        if let Err(e) = round(&mut stage, &mb) {
                            if !warned {
                                tracing::warn!(
                                    "profile: a concurrent rank's round at T = {}: {e}; it makes a fresh stage",
                                    mb.tokens()
                                );
                                warned = true;
                            }
                            match make() {
                                Ok(s) => stage = s,
                                Err(_) => return,
                            }
                        }
                    }
                })
            })
            .collect();
        ready.wait();
        Load {
            stop,
            current,
            handles,
        }
    }

    /// The microbatch the threads run from their next round on.
    fn follow(&self, mb: &MicrobatchData) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(mb.clone());
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Profiles one layer kind of `model` (its first layer of that kind).
fn profile_kind<W: Profiled + 'static>(
    model: &ModelSpec,
    kind: LayerKind,
    cfg: &ProfileConfig,
    make: &StageFactory<W>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<KindProfile> {
    let layers = model.layers();
    let layer = layers
        .iter()
        .find(|l| l.kind == kind)
        .ok_or_else(|| Error::Invalid(format!("the model has no {kind:?} layer")))?;
    let vocab = layers[0].vocab.max(1) as u32;
    // Several consecutive layers of the kind (decoders: up to DECODERS_PER_STAGE), timed
    // together and divided by their count: each layer then meets its own weights cold in cache,
    // as in a real stage, not one layer's weights kept warm by repeating it.
    let n = layers[layer.index..]
        .iter()
        .take_while(|l| l.kind == kind)
        .count()
        .min(DECODERS_PER_STAGE);
    let range = layer.index..layer.index + n;
    let (first, last) = (layer.index == 0, range.end == layers.len());
    let mut stage = make(range.clone(), 0)?;
    let load = (cfg.concurrency > 1).then(|| {
        let make = Arc::clone(make);
        let range = range.clone();
        Load::start(
            cfg.concurrency - 1,
            microbatch(vec![cfg.tokens[0].min(cfg.short_seq).max(1) as u32], vocab),
            move || make(range.clone(), 1),
            move |st: &mut W, mb| time_phases(st, mb, first, last, 0, 1).map(drop),
        )
    });
    let mut samples: [Vec<Sample>; 4] = Default::default();
    let (mut act_i, mut act_w) = (Vec::new(), Vec::new());
    for &t in &cfg.tokens {
        let s = cfg.short_seq.min(t).max(1);
        let mut short = vec![s as u32; t / s];
        if t % s != 0 {
            short.push((t % s) as u32);
        }
        // The other ranks run the same T in short sequences, as the other ranks of a step of
        // real lengths do (and a round of T = 16,384 in one sequence would hold the measured
        // rank's GPU for most of a minute).
        if let Some(load) = &load {
            load.follow(&microbatch(short.clone(), vocab));
        }
        for lens in [vec![t as u32], short] {
            progress(
                &format!("{kind:?} layer, T = {t}, {} sequence(s)", lens.len()).to_lowercase(),
            );
            let mb = microbatch(lens, vocab);
            let pairs = mb
                .seq_lens
                .iter()
                .map(|&s| s as f64 * (s as f64 + 1.0) / 2.0)
                .sum();
            let med = time_phases(&mut stage, &mb, first, last, cfg.warmup, cfg.reps)?;
            // The raw medians behind the fit (`flatpipe -v profile`), per layer.
            tracing::info!(
                "profile: {kind:?} T = {t}, {} sequence(s): F {:.3} ms, I {:.3} ms, W {:.3} ms, Fo {:.3} ms per layer",
                mb.seq_lens.len(),
                med[0] * 1e3 / n as f64,
                med[1] * 1e3 / n as f64,
                med[2] * 1e3 / n as f64,
                med[3] * 1e3 / n as f64
            );
            for (k, secs) in med.into_iter().enumerate() {
                samples[k].push(Sample {
                    tokens: t as f64,
                    pairs,
                    seconds: secs / n as f64,
                });
            }
            // Activation bytes from the real saved tensors.
            let x = Array2::from_elem((t, stage.hidden_size()), 0.1f32);
            let inp = if first {
                StageInput::Tokens
            } else {
                StageInput::Hidden(stage.hidden_from(&x)?)
            };
            stage.forward(0, &mb, inp, true)?;
            let after_f = stage.saved_bytes();
            let g = if last {
                None
            } else {
                Some(stage.hidden_from(&x)?)
            };
            stage.backward_input(0, &mb, g)?;
            let after_i = stage.saved_bytes();
            stage.backward_weight(0, &mb)?;
            stage.take_losses()?;
            let per = (t * n) as f64;
            act_w.push(after_i as f64 / per);
            act_i.push((after_f as f64 - after_i as f64).max(0.0) / per);
        }
    }
    let has_attn = kind == LayerKind::Decoder;
    let fit = |k: usize, attn: bool| nnls_fit(&samples[k], attn);
    Ok(KindProfile {
        kind,
        f: fit(0, has_attn)?,
        i: fit(1, has_attn)?,
        w: fit(2, false)?,
        fo: fit(3, has_attn)?,
        act_bytes_per_token_i: median(act_i),
        act_bytes_per_token_w: median(act_w),
        param_bytes: stage.param_count() * 4 / n as u64,
        samples,
    })
}

/// Times a transfer between two threads as the CPU executor does it (the sender's buffer moves
/// through a channel; nothing is copied) for each size, and fits `alpha + bytes / beta`.
fn profile_link(cfg: &ProfileConfig) -> Result<Link> {
    use std::sync::mpsc::channel;
    let (to_peer, peer_rx) = channel::<Vec<f32>>();
    let (to_me, my_rx) = channel::<usize>();
    let peer = std::thread::spawn(move || {
        while let Ok(v) = peer_rx.recv() {
            let n = v.len();
            drop(v);
            if to_me.send(n).is_err() {
                break;
            }
        }
    });
    let mut samples = Vec::new();
    for &bytes in &cfg.link_sizes {
        let mut times = Vec::new();
        for round in 0..cfg.warmup + cfg.reps.max(5) {
            let buf = vec![1.0f32; bytes / 4];
            let s = Instant::now();
            to_peer
                .send(buf)
                .map_err(|_| Error::Invalid("link profiler thread stopped".into()))?;
            my_rx
                .recv()
                .map_err(|_| Error::Invalid("link profiler thread stopped".into()))?;
            // One way: half the round trip (the reply is a few bytes).
            if round >= cfg.warmup {
                times.push(s.elapsed().as_secs_f64() / 2.0);
            }
        }
        samples.push(Sample {
            tokens: bytes as f64,
            pairs: 0.0,
            seconds: median(times).max(1e-9),
        });
    }
    drop(to_peer);
    let _ = peer.join();
    fit_link(
        "channel between rank threads (buffers move, no copy)",
        &samples,
    )
}

/// `alpha + bytes / beta` fitted (non-negative least squares) to `(bytes, seconds)` samples
/// (`Sample::tokens` holds the bytes), as a link named `name`. A size-independent transfer fits
/// no per-byte cost: its bandwidth is capped at 1 PB/s.
///
/// # Errors
/// The fit's.
pub(crate) fn fit_link(name: &str, samples: &[Sample]) -> Result<Link> {
    let fit = nnls_fit(samples, false)?;
    Ok(Link {
        name: name.into(),
        alpha_s: fit.coeffs.c0_s,
        beta_bytes_per_s: if fit.coeffs.c_tok_s > 1e-15 {
            1.0 / fit.coeffs.c_tok_s
        } else {
            1e15
        },
        post_s: 0.0,
    })
}

/// Times the executor's expert-parallel all-to-all between two rank threads, both ready (each
/// sends the other `bytes` of rows and waits for the other's, through
/// [`crate::model::experts::ExpertLink`]), for each size, and fits `alpha + bytes / beta` per
/// peer. What a run adds to it, a partner that is not yet ready, is the schedule's, not the
/// link's.
fn profile_all_to_all(cfg: &ProfileConfig) -> Result<Link> {
    use crate::model::experts::ExpertLink;
    let abort = Arc::new(AtomicBool::new(false));
    let mut links = ExpertLink::group(2, &abort).into_iter();
    let (Some(mut me), Some(mut peer)) = (links.next(), links.next()) else {
        return Err(Error::Invalid("an expert-parallel group of 2".into()));
    };
    let sizes = cfg.link_sizes.clone();
    let rounds = cfg.warmup + cfg.reps.max(5);
    let partner = std::thread::spawn(move || -> Result<()> {
        for (i, &bytes) in sizes.iter().enumerate() {
            for round in 0..rounds {
                peer.exchange_for_profile(i * 1000 + round as usize, bytes / 4)?;
            }
        }
        Ok(())
    });
    let mut samples = Vec::new();
    for (i, &bytes) in cfg.link_sizes.iter().enumerate() {
        let mut times = Vec::new();
        for round in 0..rounds {
            let s = Instant::now();
            me.exchange_for_profile(i * 1000 + round as usize, bytes / 4)?;
            if round >= cfg.warmup {
                times.push(s.elapsed().as_secs_f64());
            }
        }
        samples.push(Sample {
            tokens: bytes as f64,
            pairs: 0.0,
            seconds: median(times).max(1e-9),
        });
    }
    partner.join().map_err(|_| {
        Error::Invalid("the all-to-all profiler's partner thread panicked".into())
    })??;
    fit_link(
        "all-to-all between rank threads (the executor's expert link)",
        &samples,
    )
}

/// Seconds per parameter of the gradient norm and one AdamW step over the whole model (memory-bound: the weights,
/// gradients and both moments stream through once, so a small layer whose state fits in cache
/// would look faster than a stage is).
/// The optimizer's time per parameter: the global gradient norm then AdamW, on the first of
/// `concurrency` contiguous parts of the model while `concurrency - 1` threads step the other
/// parts, as the ranks of a pipeline all run their optimizer at the end of a step (AdamW reads
/// and writes 16 bytes per parameter; the ranks share the memory bandwidth). On this project's
/// 2-core machine (2026-12-01, `tiny`) the difference is small: 1.41 ns per parameter with the
/// other rank stepping, 1.38 alone.
fn profile_optimizer(model: &ModelSpec, reps: u32, concurrency: usize) -> Result<f64> {
    let n_layers = model.layers().len();
    let parts = concurrency.clamp(1, n_layers.max(1));
    let part = |i: usize| (i * n_layers / parts)..((i + 1) * n_layers / parts);
    let mut stage = CpuStage::new(model, part(0), 0, Recompute::None)?;
    let n = crate::cpu::param_count(&stage) as f64;
    let opt = AdamW::default();
    let stop = Arc::new(AtomicBool::new(false));
    // Timing starts once every other thread has built its part and is about to step it
    // (building draws the weights, far longer than the timed rounds).
    let built = Arc::new(std::sync::Barrier::new(parts));
    let others: Vec<_> = (1..parts)
        .map(|i| {
            let (m, range, stop) = (model.clone(), part(i), Arc::clone(&stop));
            let built = Arc::clone(&built);
            std::thread::spawn(move || {
                let stage = CpuStage::new(&m, range, i as u64, Recompute::None);
                built.wait();
                let Ok(mut st) = stage else {
                    return;
                };
                let opt = AdamW::default();
                let mut t = 1;
                while !stop.load(Ordering::Relaxed) {
                    let norm = st.grad_sq_norm().unwrap_or(0.0);
                    let _ = st.optimizer_step(&opt, t, (1.0 / (1.0 + norm)) as f32);
                    t += 1;
                }
            })
        })
        .collect();
    built.wait();
    let mut times = Vec::new();
    for t in 1..=reps.max(3) as u64 + 1 {
        let s = Instant::now();
        // What the executor does after the pipeline: the global gradient norm, then AdamW.
        let norm = stage.grad_sq_norm()?;
        stage.optimizer_step(&opt, t, (1.0 / (1.0 + norm)) as f32)?;
        if t > 1 {
            times.push(s.elapsed().as_secs_f64());
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in others {
        let _ = h.join();
    }
    Ok(median(times) / n)
}

/// Measures every layer kind of `model`, the link and the optimizer on the CPU backend.
/// `progress` is called before each measurement with what is measured.
///
/// # Errors
/// Stage construction or fit errors.
pub fn profile_cpu(
    model: &ModelSpec,
    cfg: &ProfileConfig,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Measured> {
    let m = model.clone();
    let make: StageFactory<CpuStage> =
        Arc::new(move |range, seed| CpuStage::new(&m, range, seed, Recompute::None));
    let kinds = profile_kinds(model, cfg, &make, progress)?;
    progress("links");
    let link = profile_link(cfg)?;
    let all_to_all = if model.layers().iter().any(|l| l.moe.is_some()) {
        Some(profile_all_to_all(cfg)?)
    } else {
        None
    };
    progress("optimizer");
    let optimizer_s_per_param = profile_optimizer(model, cfg.reps, cfg.concurrency)?;
    Ok(Measured {
        kinds,
        link,
        all_to_all,
        optimizer_s_per_param,
        notes: "measured by `flatpipe profile` on the CPU backend's kernels (host clock): t = c0 + c_tok * tokens + c_attn * attn_pairs per layer kind and phase, non-negative least squares on relative residuals; activation bytes from the saved tensors (F -> I -> W); link = a buffer moving through a channel between rank threads; all-to-all (mixture-of-experts models) = two rank threads exchanging rows through the executor's expert link; optimizer = gradient norm + AdamW over the whole model. FLOPs per token (MFU) are the analytic counts.".into(),
    })
}

/// Measures every layer kind of `model` on the stages `make` builds.
///
/// # Errors
/// An empty grid; stage construction or fit errors.
pub fn profile_kinds<W: Profiled + 'static>(
    model: &ModelSpec,
    cfg: &ProfileConfig,
    make: &StageFactory<W>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<KindProfile>> {
    if cfg.tokens.is_empty() || cfg.reps == 0 {
        return Err(Error::Invalid(
            "the profiler needs at least one token count and one timed round".into(),
        ));
    }
    let mut kinds = Vec::new();
    for kind in [LayerKind::Embedding, LayerKind::Decoder, LayerKind::Head] {
        if model.layers().iter().any(|l| l.kind == kind) {
            kinds.push(profile_kind(model, kind, cfg, make, progress)?);
        }
    }
    Ok(kinds)
}

/// Number of grid points the profiler times (for progress bars): per kind, every T in two
/// compositions, plus the link and the optimizer.
pub fn grid_points(model: &ModelSpec, cfg: &ProfileConfig) -> u64 {
    let kinds = [LayerKind::Embedding, LayerKind::Decoder, LayerKind::Head]
        .iter()
        .filter(|k| model.layers().iter().any(|l| l.kind == **k))
        .count();
    (kinds * cfg.tokens.len() * 2 + 2 + gemm_split_degrees(model).len()) as u64
}

/// The tensor-parallel group sizes whose GEMM split [`gemm_split`] measures: 2, 4 and 8 where
/// they divide the first decoder's attention heads, key-value heads and MLP size (Megatron
/// requires the heads; `megatron/core/transformer/transformer_config.py`).
pub fn gemm_split_degrees(model: &ModelSpec) -> Vec<u32> {
    let Some(d) = model
        .layers()
        .into_iter()
        .find(|l| l.kind == LayerKind::Decoder)
    else {
        return Vec::new();
    };
    [2u32, 4, 8]
        .into_iter()
        .filter(|&t| {
            let t = u64::from(t);
            d.heads % t == 0 && d.kv_heads % t == 0 && d.ffn % t == 0 && d.hidden % t == 0
        })
        .collect()
}

/// Measures the GEMM efficiency of narrower matrices: for each of [`gemm_split_degrees`], the
/// first decoder's four GEMMs at `tokens` rows, whole (`[T, H] x [H, H + 2 kv]` Q/K/V,
/// `[T, H] x [H, H]` output, `[T, H] x [H, 2 F]` gate and up, `[T, F] x [F, H]` down) and as
/// one rank of a tensor-parallel group of `t` holds them (Megatron: Q/K/V and gate/up split by
/// columns, output and down by rows; Shoeybi et al. 2019, §3). `time_gemm((m, k, n))` returns
/// one GEMM's time in seconds. The ratio is `t_whole / (t x t_split)`: the split GEMMs' FLOP
/// rate over the whole ones'. `progress` is called before each group size.
///
/// # Errors
/// `time_gemm`'s.
pub fn gemm_split(
    model: &ModelSpec,
    tokens: usize,
    time_gemm: &mut dyn FnMut((usize, usize, usize)) -> Result<f64>,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<GemmSplit>> {
    let Some(d) = model
        .layers()
        .into_iter()
        .find(|l| l.kind == LayerKind::Decoder)
    else {
        return Ok(Vec::new());
    };
    let (h, f) = (d.hidden as usize, d.ffn as usize);
    let kv = h / d.heads.max(1) as usize * d.kv_heads as usize;
    // (k, n, split by columns).
    let gemms = [
        (h, h + 2 * kv, true),
        (h, h, false),
        (h, 2 * f, true),
        (f, h, false),
    ];
    let mut time = |t: usize| -> Result<f64> {
        let mut sum = 0.0;
        for &(k, n, columns) in &gemms {
            let shape = if columns {
                (tokens, k, n / t)
            } else {
                (tokens, k / t, n)
            };
            sum += time_gemm(shape)?;
        }
        Ok(sum)
    };
    let whole = time(1)?;
    let mut out = Vec::new();
    for tp in gemm_split_degrees(model) {
        progress(&format!("GEMMs split {tp} ways"));
        let split = time(tp as usize)?;
        out.push(GemmSplit {
            tp,
            relative_throughput: (whole / (f64::from(tp) * split)).clamp(1e-3, 2.0),
            tokens: tokens as u64,
        });
    }
    Ok(out)
}

/// Median seconds of `reps` runs of `a [m, k] @ b [k, n]` with the CPU executor's GEMM kernel
/// (one thread), after one untimed run.
pub fn time_cpu_gemm((m, k, n): (usize, usize, usize), reps: usize) -> f64 {
    let a = Array2::<f32>::from_elem((m, k), 0.5);
    let b = Array2::<f32>::from_elem((k, n), 0.25);
    let _ = std::hint::black_box(crate::kernels::matmul(a.view(), b.view()));
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let start = Instant::now();
            let c = crate::kernels::matmul(a.view(), b.view());
            let s = start.elapsed().as_secs_f64();
            std::hint::black_box(c);
            s
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Builds a [`Profile`] of `model` from the measurements: every layer gets its kind's fitted
/// costs and measured activation and parameter bytes; FLOP counts per token (for MFU) come from
/// the model's analytic profile; the hardware is `base` with the measured link and `device` as
/// its name.
///
/// # Errors
/// Analytic-profile errors for an invalid model.
pub fn to_profile(
    model: &ModelSpec,
    base: &Hardware,
    device: &str,
    date: Option<String>,
    cfg: &ProfileConfig,
    m: &Measured,
) -> Result<Profile> {
    let mut hw = base.clone();
    hw.name = device.to_string();
    hw.intra_node = m.link.clone();
    hw.inter_node = m.link.clone();
    hw.all_to_all = m.all_to_all.clone();
    let mut p = analytic_profile(model, &hw, &AnalyticOptions::default())?;
    for l in &mut p.layers {
        let Some(k) = m.kinds.iter().find(|k| k.kind == l.kind) else {
            continue;
        };
        l.f = k.f.coeffs;
        l.i = k.i.coeffs;
        l.w = k.w.coeffs;
        l.fo = k.fo.coeffs;
        l.act_bytes_per_token_i = k.act_bytes_per_token_i;
        l.act_bytes_per_token_w = k.act_bytes_per_token_w;
        l.param_bytes = l.param_count * 4;
    }
    let layers = model.layers();
    for (l, spec) in p.layers.iter_mut().zip(&layers) {
        // What a stage boundary after this layer sends: hidden states [T, H], fp32.
        l.output_bytes_per_token = spec.hidden as f64 * 4.0;
    }
    p.optimizer_s_per_param = m.optimizer_s_per_param;
    let mut fits = Vec::new();
    for k in &m.kinds {
        for (phase, f, n) in [
            (Phase::F, &k.f, k.samples[0].len()),
            (Phase::I, &k.i, k.samples[1].len()),
            (Phase::W, &k.w, k.samples[2].len()),
            (Phase::Fo, &k.fo, k.samples[3].len()),
        ] {
            fits.push(FitQuality {
                kind: k.kind,
                phase,
                r2: f.r2,
                max_rel_residual: f.max_rel_residual,
                samples: n as u32,
            });
        }
    }
    p.provenance = Provenance {
        source: ProfileSource::Measured,
        device: device.to_string(),
        date,
        flatpipe_version: flatpipe_profiles::VERSION.to_string(),
        notes: m.notes.clone(),
        grid: Some(cfg.describe()),
        repetitions: Some(cfg.reps),
        fits,
        concurrency: Some(cfg.concurrency as u32),
    };
    p.validate("measured profile")?;
    Ok(p)
}

/// A human-readable name of this machine's CPU (`/proc/cpuinfo`'s model name on Linux).
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH))
}

#[cfg(test)]
mod tests {
    /// The concurrent ranks make their stage once each before the measurement starts, run the
    /// microbatch being measured and move to the next one when told; a rank whose stage
    /// cannot be made stays idle, one whose round fails makes a fresh stage.
    #[test]
    fn the_concurrent_ranks_make_their_stage_once_and_follow_the_measured_microbatch() {
        use std::sync::atomic::AtomicUsize;
        use std::time::Duration;
        let made = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(AtomicBool::new(false));
        let (m, s, f) = (Arc::clone(&made), Arc::clone(&seen), Arc::clone(&failed));
        let load = Load::start(
            3,
            microbatch(vec![4], 10),
            move || {
                // The third stage fails, as on a GPU out of memory.
                match m.fetch_add(1, Ordering::SeqCst) {
                    2 => Err(Error::Invalid("out of memory".into())),
                    k => Ok(k),
                }
            },
            move |rank: &mut usize, mb| {
                s.lock().unwrap().push((*rank, mb.tokens()));
                std::thread::sleep(Duration::from_millis(1));
                // One failed round (a stage left mid-step): that rank makes a fresh stage.
                if mb.tokens() == 8 && !f.swap(true, Ordering::SeqCst) {
                    return Err(Error::Invalid("out of memory".into()));
                }
                Ok(())
            },
        );
        // Every stage was made before `start` returned.
        assert_eq!(made.load(Ordering::SeqCst), 3);
        // The last `k` rounds recorded ran `tokens`, on two stages (the two ranks that run).
        let settled = |tokens: usize, k: usize| {
            for _ in 0..5000 {
                let v = seen.lock().unwrap().clone();
                let tail = &v[v.len().saturating_sub(k)..];
                if tail.len() == k
                    && tail.iter().all(|&(_, t)| t == tokens)
                    && tail.iter().any(|&(q, _)| q != tail[0].0)
                {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            false
        };
        assert!(settled(4, 10));
        load.follow(&microbatch(vec![3, 5], 10));
        assert!(settled(8, 10));
        drop(load);
        assert_eq!(
            made.load(Ordering::SeqCst),
            4,
            "one stage per concurrent rank, and a fresh one after the failed round"
        );
        let v = seen.lock().unwrap();
        assert!(
            v.iter().all(|&(r, _)| r != 2),
            "the stage that was not made ran nothing"
        );
    }

    #[test]
    fn gemm_split_is_the_flop_rate_ratio_with_a_fixed_cost_per_gemm() {
        let model = flatpipe_profiles::builtins::model("tiny").unwrap();
        // tiny: H = 256, F = 688, 4 heads, 2 key-value heads (kv = 128): tp = 2 only.
        assert_eq!(gemm_split_degrees(&model), vec![2]);
        let (t, rate, c) = (512.0, 1e9, 1e-3);
        let flops = 2.0 * t * (256.0 * 512.0 + 256.0 * 256.0 + 256.0 * 1376.0 + 688.0 * 256.0);
        let mut timer = |(m, k, n): (usize, usize, usize)| Ok(2.0 * (m * k * n) as f64 / rate + c);
        let g = gemm_split(&model, 512, &mut timer, &|_| {}).unwrap();
        // Whole: F / r + 4c; split in two: F / 2r + 4c; ratio = whole / (2 x split).
        let want = (flops / rate + 4.0 * c) / (flops / rate + 8.0 * c);
        assert_eq!(g.len(), 1);
        assert!(
            (g[0].relative_throughput - want).abs() < 1e-12,
            "{g:?} {want}"
        );
        assert!(want < 1.0);
        let m70 = flatpipe_profiles::builtins::model("llama3.1-70b").unwrap();
        assert_eq!(gemm_split_degrees(&m70), vec![2, 4, 8]);
    }

    use super::*;
    use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

    fn synthetic(c: CostCoeffs, noise: f64, seed: u64) -> Vec<Sample> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = Vec::new();
        for t in [64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0f64] {
            for pairs in [t * (t + 1.0) / 2.0, t * 33.0 / 2.0] {
                let e = 1.0 + noise * (rng.random::<f64>() * 2.0 - 1.0);
                out.push(Sample {
                    tokens: t,
                    pairs,
                    seconds: c.time_s(t, pairs) * e,
                });
            }
        }
        out
    }

    #[test]
    fn the_fit_recovers_known_coefficients_from_noisy_timings() {
        let truth = CostCoeffs {
            c0_s: 50e-6,
            c_tok_s: 20e-6,
            c_attn_s: 3e-9,
        };
        let fit = nnls_fit(&synthetic(truth, 0.02, 1), true).unwrap();
        let rel = |a: f64, b: f64| (a - b).abs() / b;
        assert!(rel(fit.coeffs.c_tok_s, truth.c_tok_s) < 0.03, "{fit:?}");
        assert!(rel(fit.coeffs.c_attn_s, truth.c_attn_s) < 0.05, "{fit:?}");
        assert!(rel(fit.coeffs.c0_s, truth.c0_s) < 0.5, "{fit:?}");
        assert!(fit.r2 > 0.99 && fit.max_rel_residual < 0.05, "{fit:?}");
        // Without noise the fit is exact.
        let exact = nnls_fit(&synthetic(truth, 0.0, 1), true).unwrap();
        assert!(rel(exact.coeffs.c_tok_s, truth.c_tok_s) < 1e-6, "{exact:?}");
        assert!(
            rel(exact.coeffs.c_attn_s, truth.c_attn_s) < 1e-6,
            "{exact:?}"
        );
    }

    #[test]
    fn the_fit_never_goes_negative() {
        // Timings that fall with the attention pairs: an unconstrained fit gives c_attn < 0.
        let samples: Vec<Sample> = [
            (100.0, 5050.0, 1.0e-3),
            (100.0, 1650.0, 1.2e-3),
            (200.0, 20100.0, 2.0e-3),
            (200.0, 3300.0, 2.3e-3),
        ]
        .iter()
        .map(|&(t, p, s)| Sample {
            tokens: t,
            pairs: p,
            seconds: s,
        })
        .collect();
        let unconstrained = {
            let a = DMatrix::from_fn(4, 3, |i, j| [1.0, samples[i].tokens, samples[i].pairs][j]);
            let b = DVector::from_iterator(4, samples.iter().map(|s| s.seconds));
            a.svd(true, true).solve(&b, 1e-18).unwrap()
        };
        assert!(
            unconstrained[2] < 0.0,
            "the test needs a negative LS coefficient"
        );
        let fit = nnls_fit(&samples, true).unwrap();
        let c = fit.coeffs;
        assert!(
            c.c0_s >= 0.0 && c.c_tok_s >= 0.0 && c.c_attn_s >= 0.0,
            "{c:?}"
        );
        // W-like data (no attention): c_attn stays exactly 0.
        let w = nnls_fit(&samples, false).unwrap();
        assert_eq!(w.coeffs.c_attn_s, 0.0);
    }

    #[test]
    fn a_quick_profile_of_a_small_model_fits_well() {
        let model = ModelSpec::from_yaml(
            "name: s\ndtype: fp32\nlayers:\n  - {kind: embedding, vocab: 64, hidden: 32}\n  - {kind: decoder, count: 2, hidden: 32, ffn: 64, heads: 4, kv_heads: 2}\n  - {kind: head, vocab: 64, hidden: 32}\n",
            "s",
        )
        .unwrap();
        let cfg = ProfileConfig {
            tokens: vec![32, 64, 128],
            link_sizes: vec![1024, 4096],
            ..ProfileConfig::quick()
        };
        let m = profile_cpu(&model, &cfg, &|_| {}).unwrap();
        assert_eq!(m.kinds.len(), 3);
        for k in &m.kinds {
            for f in [&k.f, &k.i, &k.w, &k.fo] {
                let c = f.coeffs;
                assert!(c.c0_s >= 0.0 && c.c_tok_s >= 0.0 && c.c_attn_s >= 0.0);
            }
            assert_eq!(k.w.coeffs.c_attn_s, 0.0);
            assert!(k.act_bytes_per_token_w > 0.0, "{:?}", k.kind);
        }
        let dec = &m.kinds[1];
        // Parameter bytes from the real tensors: fp32, the spec's count.
        assert_eq!(dec.param_bytes, model.layers()[1].param_count() * 4);
        assert!(m.link.alpha_s >= 0.0 && m.link.beta_bytes_per_s > 0.0);
        assert!(m.optimizer_s_per_param > 0.0);
        // A dense model has no all-to-all to measure.
        assert!(m.all_to_all.is_none());
    }

    /// The expert link's all-to-all between two threads: a latency and a finite bandwidth,
    /// and a profile that carries it prices expert parallelism's exchanges on it.
    #[test]
    fn the_all_to_all_is_measured_and_priced() {
        let cfg = ProfileConfig {
            link_sizes: vec![4096, 1 << 20],
            ..ProfileConfig::quick()
        };
        let l = profile_all_to_all(&cfg).unwrap();
        assert!(l.alpha_s >= 0.0 && l.beta_bytes_per_s > 0.0, "{l:?}");
        let model = flatpipe_profiles::builtins::model("tiny-moe").unwrap();
        let mut hw = flatpipe_profiles::builtins::hardware("cpu").unwrap();
        let priced = |hw: &Hardware| {
            let p = analytic_profile(&model, hw, &AnalyticOptions::default()).unwrap();
            p.expert_parallel(2, 1, false).unwrap().layers[1].f.c0_s - p.layers[1].f.c0_s
        };
        hw.all_to_all = Some(Link { alpha_s: 1e-3, ..l });
        // Two all-to-alls per forward, each one pairwise exchange's latency at ep = 2.
        assert!((priced(&hw) - 2e-3).abs() < 1e-9, "{}", priced(&hw));
    }
}
