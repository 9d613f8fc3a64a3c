//! The CUDA kernels (`executor/src/cuda/kernels.cu`) run on the CPU and checked against the CPU
//! backend's kernels (themselves checked against finite differences), so their logic is tested
//! on machines without a GPU, CI included.
//!
//! The same source is compiled with g++ (`-std=c++20`) and `tests/cuda_emulated/emulate.h`: each
//! block runs as `blockDim` OS threads with `__syncthreads` as a barrier, blocks one after
//! another; arguments are passed as cuLaunchKernel's `kernelParams`, with the launch shapes of
//! `flatpipe_executor::cuda::launch` that the GPU path uses. Without g++ the tests say so and
//! pass, unless `FLATPIPE_REQUIRE_EMULATION=1`.
#![cfg(feature = "cuda")]
#![allow(unsafe_code)]

mod common;

use flatpipe_executor::cuda::launch::{self, Shape};
use flatpipe_executor::kernels::{self as k, AttnDims};
use flatpipe_executor::worker::AdamW;
use ndarray::{Array1, Array2};
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};
use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Head dimension the emulated module is compiled for (`-DHEAD_DIM`).
const D: usize = 16;

struct Emu {
    lib: libloading::Library,
}

type Launch = unsafe extern "C" fn(u32, u32, u32, *mut *mut c_void);

impl Emu {
    /// Runs kernel `name` with `args`, each an 8-byte slot holding the value (pointers, i64) or
    /// its low 4 bytes (i32, f32): the kernel reads each parameter's own size from its slot's
    /// address, as cuLaunchKernel does.
    fn launch(&self, name: &str, s: Shape, args: &mut [u64]) {
        let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(|a| a as *mut u64 as _).collect();
        // SAFETY: the symbol is the exported launcher of a kernel of this name (glue.cpp), whose
        // signature is `Launch`; each slot holds a valid argument of the kernel's parameter at
        // that position (the callers below pass live host buffers of the sizes the kernel reads).
        unsafe {
            let f: libloading::Symbol<'_, Launch> = self
                .lib
                .get(format!("emu_{name}\0").as_bytes())
                .unwrap_or_else(|e| panic!("no emulated kernel {name}: {e}"));
            f(s.grid.0, s.grid.1, s.block, ptrs.as_mut_ptr());
        }
    }
}

fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Result<Emu, String>> = OnceLock::new();
    let r = EMU.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = std::env::temp_dir().join(format!("flatpipe-emu-{}.so", std::process::id()));
        let status = Command::new("g++")
            .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread"])
            .arg(format!("-DHEAD_DIM={D}"))
            .arg("-I")
            .arg(dir.join("src/cuda"))
            .arg(dir.join("tests/cuda_emulated/glue.cpp"))
            .arg("-o")
            .arg(&out)
            .status()
            .map_err(|e| format!("cannot run g++: {e}"))?;
        if !status.success() {
            // A compile error in kernels.cu is a failure, not a skip.
            panic!("g++ failed to compile the CUDA kernels for emulation ({status})");
        }
        // SAFETY: loading our own freshly built library; its initialisers are the C++ runtime's.
        let lib = unsafe { libloading::Library::new(&out) }.map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&out);
        Ok(Emu { lib })
    });
    match r {
        Ok(e) => Some(e),
        Err(why) => {
            if std::env::var("FLATPIPE_REQUIRE_EMULATION").as_deref() == Ok("1") {
                panic!("FLATPIPE_REQUIRE_EMULATION=1, but {why}");
            }
            eprintln!("skipping the emulated CUDA kernels: {why}");
            None
        }
    }
}

fn p<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}
fn pa(v: &mut Array2<f32>) -> u64 {
    v.as_mut_ptr() as u64
}
fn i(x: usize) -> u64 {
    x as i32 as u32 as u64
}
fn l(x: usize) -> u64 {
    x as u64
}
fn f(x: f32) -> u64 {
    x.to_bits() as u64
}

fn randn(rng: &mut ChaCha8Rng, shape: (usize, usize)) -> Array2<f32> {
    Array2::from_shape_fn(shape, |_| rng.random::<f32>() * 2.0 - 1.0)
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = common::rel(got, want, 1e-3);
    assert!(e <= tol, "{what}: max relative difference {e:e} > {tol:e}");
}

#[test]
fn rmsnorm_forward_dgrad_and_wgrad_match_the_cpu() {
    let Some(emu) = emu() else { return };
    let (t, h) = (70, 48);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut x = randn(&mut rng, (t, h));
    let mut g: Vec<f32> = (0..h).map(|_| rng.random::<f32>() + 0.5).collect();
    let (y, xhat, rstd) = k::rmsnorm(x.view(), Array1::from(g.clone()).view());
    let (mut gy, mut gxhat, mut grstd) = (vec![0.0; t * h], vec![0.0; t * h], vec![0.0; t]);
    emu.launch(
        "rmsnorm_fwd",
        launch::per_row(t),
        &mut [
            pa(&mut x),
            p(&mut g),
            p(&mut gy),
            p(&mut gxhat),
            p(&mut grstd),
            i(t),
            i(h),
        ],
    );
    close("y", &gy, y.as_slice().unwrap(), 1e-5);
    close("xhat", &gxhat, xhat.as_slice().unwrap(), 1e-5);
    close("rstd", &grstd, rstd.as_slice().unwrap(), 1e-5);

    let mut dy = randn(&mut rng, (t, h));
    let mut res = randn(&mut rng, (t, h));
    let mut want = k::rmsnorm_dx(
        dy.view(),
        xhat.view(),
        rstd.view(),
        Array1::from(g.clone()).view(),
    );
    want += &res;
    let mut dx = vec![0.0; t * h];
    emu.launch(
        "rmsnorm_dx",
        launch::per_row(t),
        &mut [
            pa(&mut dy),
            p(&mut gxhat),
            p(&mut grstd),
            p(&mut g),
            pa(&mut res),
            p(&mut dx),
            i(t),
            i(h),
        ],
    );
    close("dx + residual", &dx, want.as_slice().unwrap(), 1e-5);
    // Without a residual (a null pointer).
    let want = k::rmsnorm_dx(
        dy.view(),
        xhat.view(),
        rstd.view(),
        Array1::from(g.clone()).view(),
    );
    emu.launch(
        "rmsnorm_dx",
        launch::per_row(t),
        &mut [
            pa(&mut dy),
            p(&mut gxhat),
            p(&mut grstd),
            p(&mut g),
            0,
            p(&mut dx),
            i(t),
            i(h),
        ],
    );
    close("dx", &dx, want.as_slice().unwrap(), 1e-5);

    // wgrad accumulates: start from a nonzero gradient.
    let mut want = Array1::from_elem(h, 0.25f32);
    k::rmsnorm_dg(&mut want, dy.view(), xhat.view());
    let mut dg = vec![0.25f32; h];
    emu.launch(
        "rmsnorm_dg",
        launch::norm_dg(t, h),
        &mut [
            p(&mut dg),
            pa(&mut dy),
            p(&mut gxhat),
            i(t),
            i(h),
            i(launch::DG_ROWS),
        ],
    );
    close("dg", &dg, want.as_slice().unwrap(), 1e-5);
}

#[test]
fn rotary_swiglu_and_embedding_match_the_cpu() {
    let Some(emu) = emu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    // Rotary on [T, heads * d], three sequences.
    let cu = [0usize, 3, 20, 23];
    let (t, heads) = (23, 3);
    let x = randn(&mut rng, (t, heads * D));
    let mut pos = launch::positions(&cu);
    for inverse in [false, true] {
        let mut want = x.clone();
        k::rope(&mut want.view_mut(), &cu, D, inverse, 0);
        let mut got = x.clone();
        emu.launch(
            "rope",
            launch::elementwise(t * heads * D / 2),
            &mut [
                pa(&mut got),
                p(&mut pos),
                i(t),
                i(heads),
                i(D),
                i(inverse as usize),
            ],
        );
        close(
            "rope",
            got.as_slice().unwrap(),
            want.as_slice().unwrap(),
            1e-5,
        );
    }

    // SwiGLU.
    let n = 37 * 11;
    let mut gate = randn(&mut rng, (37, 11)) * 3.0;
    let mut up = randn(&mut rng, (37, 11));
    let mut d = randn(&mut rng, (37, 11));
    let want = k::swiglu(gate.view(), up.view());
    let mut act = vec![0.0; n];
    emu.launch(
        "swiglu_fwd",
        launch::elementwise(n),
        &mut [pa(&mut gate), pa(&mut up), p(&mut act), l(n)],
    );
    close("swiglu", &act, want.as_slice().unwrap(), 1e-5);
    let (wg, wu) = k::swiglu_backward(d.view(), gate.view(), up.view());
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    emu.launch(
        "swiglu_bwd",
        launch::elementwise(n),
        &mut [
            pa(&mut d),
            pa(&mut gate),
            pa(&mut up),
            p(&mut dg),
            p(&mut du),
            l(n),
        ],
    );
    close("dgate", &dg, wg.as_slice().unwrap(), 1e-5);
    close("dup", &du, wu.as_slice().unwrap(), 1e-5);

    // add_inplace.
    let mut y = vec![1.0f32; n];
    emu.launch(
        "add_inplace",
        launch::elementwise(n),
        &mut [p(&mut y), p(&mut act), l(n)],
    );
    let want: Vec<f32> = act.iter().map(|a| a + 1.0).collect();
    close("add", &y, &want, 1e-6);

    // Embedding with repeated ids (the wgrad adds both rows).
    let (v, h, t) = (9, 20, 6);
    let mut table = randn(&mut rng, (v, h));
    let mut ids: Vec<u32> = vec![3, 1, 3, 8, 0, 3];
    let want = k::embedding(table.view(), &ids);
    let mut got = vec![0.0; t * h];
    emu.launch(
        "embedding_fwd",
        launch::per_row(t),
        &mut [pa(&mut table), p(&mut ids), p(&mut got), i(t), i(h)],
    );
    close("embedding", &got, want.as_slice().unwrap(), 0.0);
    let mut dy = randn(&mut rng, (t, h));
    let mut want = Array2::from_elem((v, h), 0.5f32);
    k::embedding_backward(&mut want, dy.view(), &ids);
    let mut dtable = vec![0.5f32; v * h];
    emu.launch(
        "embedding_bwd",
        launch::per_row(t),
        &mut [p(&mut dtable), pa(&mut dy), p(&mut ids), i(t), i(h)],
    );
    close("dtable", &dtable, want.as_slice().unwrap(), 1e-6);
}

#[test]
fn cross_entropy_and_loss_sums_match_the_cpu() {
    let Some(emu) = emu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (t, v) = (13, 300);
    let mut logits = randn(&mut rng, (t, v)) * 4.0;
    let mut labels: Vec<u32> = (0..t).map(|_| rng.random_range(0..v as u32)).collect();
    let mut weights: Vec<f32> = (0..t).map(|_| rng.random::<f32>()).collect();
    let (w_sum, p_sum, lse) = k::cross_entropy(logits.view(), &labels, &weights);
    let (mut glse, mut loss) = (vec![0.0; t], vec![0.0; t]);
    emu.launch(
        "cross_entropy_fwd",
        launch::per_row(t),
        &mut [
            pa(&mut logits),
            p(&mut labels),
            p(&mut glse),
            p(&mut loss),
            i(t),
            i(v),
        ],
    );
    close("lse", &glse, lse.as_slice().unwrap(), 1e-6);
    let mut sums = [0.0f64; 2];
    emu.launch(
        "loss_sums",
        Shape {
            grid: (1, 1),
            block: launch::NT_ROW,
        },
        &mut [p(&mut loss), p(&mut weights), i(t), p(&mut sums)],
    );
    assert!(
        (sums[0] - w_sum).abs() <= 1e-5 * w_sum.abs(),
        "{} vs {w_sum}",
        sums[0]
    );
    assert!(
        (sums[1] - p_sum).abs() <= 1e-5 * p_sum.abs(),
        "{} vs {p_sum}",
        sums[1]
    );
    let want = k::cross_entropy_backward(logits.view(), lse.view(), &labels, &weights);
    let mut d = vec![0.0; t * v];
    emu.launch(
        "cross_entropy_bwd",
        launch::elementwise(t * v),
        &mut [
            pa(&mut logits),
            p(&mut glse),
            p(&mut labels),
            p(&mut weights),
            p(&mut d),
            i(t),
            i(v),
        ],
    );
    close("dlogits", &d, want.as_slice().unwrap(), 1e-5);
}

#[test]
fn varlen_gqa_attention_forward_and_backward_match_the_cpu() {
    let Some(emu) = emu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    // Sequences shorter than, equal to and longer than a tile (16), and one of a single token.
    let cu = [0usize, 37, 38, 54, 59];
    let t = *cu.last().unwrap();
    let dims = AttnDims {
        heads: 4,
        kv_heads: 2,
        head_dim: D,
    };
    let mut q = randn(&mut rng, (t, dims.heads * D));
    let mut kk = randn(&mut rng, (t, dims.kv_heads * D));
    let mut v = randn(&mut rng, (t, dims.kv_heads * D));
    let (o, lse) = k::attention(q.view(), kk.view(), v.view(), &cu, dims, 0);
    let mut tiles = launch::tiles(&cu);
    let scale = 1.0 / (D as f32).sqrt();
    let (mut go, mut glse) = (Array2::zeros(o.raw_dim()), Array2::zeros(lse.raw_dim()));
    emu.launch(
        "attn_fwd",
        launch::attention(&tiles, dims.heads),
        &mut [
            pa(&mut q),
            pa(&mut kk),
            pa(&mut v),
            pa(&mut go),
            pa(&mut glse),
            p(&mut tiles),
            i(dims.heads),
            i(dims.kv_heads),
            f(scale),
        ],
    );
    close("o", go.as_slice().unwrap(), o.as_slice().unwrap(), 1e-5);
    close(
        "lse",
        glse.as_slice().unwrap(),
        lse.as_slice().unwrap(),
        1e-5,
    );

    let mut dout = randn(&mut rng, o.dim());
    let (dq, dk, dv) = k::attention_backward(
        dout.view(),
        q.view(),
        kk.view(),
        v.view(),
        o.view(),
        lse.view(),
        &cu,
        dims,
        0,
    );
    let mut delta = vec![0.0f32; t * dims.heads];
    emu.launch(
        "attn_bwd_delta",
        launch::elementwise(t * dims.heads),
        &mut [
            pa(&mut dout),
            pa(&mut go),
            p(&mut delta),
            i(t),
            i(dims.heads),
        ],
    );
    let mut gdq = Array2::zeros(dq.raw_dim());
    emu.launch(
        "attn_bwd_dq",
        launch::attention(&tiles, dims.heads),
        &mut [
            pa(&mut q),
            pa(&mut kk),
            pa(&mut v),
            pa(&mut dout),
            pa(&mut glse),
            p(&mut delta),
            pa(&mut gdq),
            p(&mut tiles),
            i(dims.heads),
            i(dims.kv_heads),
            f(scale),
        ],
    );
    close("dq", gdq.as_slice().unwrap(), dq.as_slice().unwrap(), 1e-4);
    let (mut gdk, mut gdv) = (Array2::zeros(dk.raw_dim()), Array2::zeros(dv.raw_dim()));
    emu.launch(
        "attn_bwd_dkdv",
        launch::attention(&tiles, dims.kv_heads),
        &mut [
            pa(&mut q),
            pa(&mut kk),
            pa(&mut v),
            pa(&mut dout),
            pa(&mut glse),
            p(&mut delta),
            pa(&mut gdk),
            pa(&mut gdv),
            p(&mut tiles),
            i(dims.heads),
            i(dims.kv_heads),
            f(scale),
        ],
    );
    close("dk", gdk.as_slice().unwrap(), dk.as_slice().unwrap(), 1e-4);
    close("dv", gdv.as_slice().unwrap(), dv.as_slice().unwrap(), 1e-4);
}

#[test]
fn sum_of_squares_and_adamw_match_the_cpu() {
    let Some(emu) = emu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let n = 1000;
    let mut grad: Vec<f32> = (0..n).map(|_| rng.random::<f32>() - 0.5).collect();
    let want: f64 = grad.iter().map(|&g| g as f64 * g as f64).sum();
    let mut partial = vec![0.0f64; launch::SUM_BLOCKS as usize];
    emu.launch(
        "sum_squares",
        launch::sum_squares(),
        &mut [p(&mut grad), l(n), p(&mut partial)],
    );
    let got: f64 = partial.iter().sum();
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");

    let opt = AdamW::default();
    let mut param: Vec<f32> = (0..n).map(|_| rng.random::<f32>() - 0.5).collect();
    let (mut m, mut v) = (vec![0.01f32; n], vec![0.02f32; n]);
    let (mut wp, mut wm, mut wv) = (param.clone(), m.clone(), v.clone());
    let (t, scale) = (3u64, 0.7f32);
    opt.update(&mut wp, &grad, &mut wm, &mut wv, t, scale);
    let bc1 = 1.0 - opt.beta1.powi(t as i32);
    let bc2 = 1.0 - opt.beta2.powi(t as i32);
    emu.launch(
        "adamw",
        launch::elementwise(n),
        &mut [
            p(&mut param),
            p(&mut grad),
            p(&mut m),
            p(&mut v),
            l(n),
            f(opt.lr),
            f(opt.beta1),
            f(opt.beta2),
            f(opt.eps),
            f(opt.weight_decay),
            f(bc1),
            f(bc2),
            f(scale),
        ],
    );
    close("param", &param, &wp, 1e-6);
    close("m", &m, &wm, 1e-6);
    close("v", &v, &wv, 1e-6);
}

#[test]
fn fast_initialisation_is_uniform_in_its_range() {
    let Some(emu) = emu() else { return };
    let n = 4096;
    let mut x = vec![f32::NAN; n];
    emu.launch(
        "init_uniform",
        launch::elementwise(n),
        &mut [p(&mut x), l(n), 7, f(0.5)],
    );
    assert!(x.iter().all(|v| (-0.5..0.5).contains(v)));
    // Mean 0 and variance scale^2 / 3 of a uniform distribution, within sampling error.
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
    assert!(mean.abs() < 0.02, "{mean}");
    assert!((var - 0.25 / 3.0).abs() < 0.01, "{var}");
}
