//! GPU tests (feature `cuda`). Each checks at run time for a device and, without one, prints why
//! and passes; with `FLATPIPE_REQUIRE_GPU=1` a missing device fails the test instead.
#![cfg(feature = "cuda")]

use flatpipe_executor::cuda;
use flatpipe_executor::kernels::matmul;
use ndarray::Array2;
use rand::{RngExt, SeedableRng, rngs::ChaCha8Rng};

fn device() -> Option<cuda::DeviceInfo> {
    match cuda::probe() {
        Ok(d) => Some(d),
        Err(e) => {
            if std::env::var("FLATPIPE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("FLATPIPE_REQUIRE_GPU=1, but {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}

#[test]
fn probing_never_panics() {
    // On a machine without a driver this is an error value, not a panic.
    match cuda::probe() {
        Ok(d) => assert!(d.count >= 1 && d.total_bytes > 0, "{d:?}"),
        Err(e) => assert!(e.to_string().contains("no CUDA device"), "{e}"),
    }
}

#[test]
fn cublas_fp32_gemm_matches_the_cpu_gemm() {
    let Some(dev) = device() else { return };
    eprintln!("GPU: {} ({} GiB)", dev.name, dev.total_bytes >> 30);
    let (m, k, n) = (67, 129, 33);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let a = Array2::from_shape_fn((m, k), |_| rng.random::<f32>() - 0.5);
    let b = Array2::from_shape_fn((k, n), |_| rng.random::<f32>() - 0.5);
    let want = matmul(a.view(), b.view());
    let got = cuda::matmul_f32(a.as_slice().unwrap(), b.as_slice().unwrap(), (m, k, n)).unwrap();
    let scale = want.iter().fold(0.0f32, |x, y| x.max(y.abs()));
    for (g, w) in got.iter().zip(want.iter()) {
        // fp32 with TF32 off by default in cuBLAS: agreement to ~1e-6 of the largest value.
        assert!((g - w).abs() <= 1e-4 * scale, "{g} vs {w}");
    }
}

#[test]
fn gemm_timing_reports_a_plausible_rate() {
    if device().is_none() {
        return;
    }
    let t = cuda::time_gemm_f32((1024, 1024, 1024), 2, 5).unwrap();
    assert!(t.ms > 0.0 && t.tflops > 0.1, "{t:?}");
}
