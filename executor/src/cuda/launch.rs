//! Launch shapes of the kernels in `kernels.cu`, with no CUDA types: the GPU path and the CPU
//! emulation test (`executor/tests/cuda_emulated.rs`) launch every kernel with the same grid,
//! block and tile lists.

/// Threads of the row kernels (one block per row: RMSNorm, cross-entropy, embedding);
/// `NT_ROW` in `kernels.cu`.
pub const NT_ROW: u32 = 256;
/// Threads of an attention block; `NT_ATT` in `kernels.cu`.
pub const NT_ATT: u32 = 128;
/// Query rows (and keys) per attention tile; `BQ` = `BK` in `kernels.cu`.
pub const TILE: usize = 16;
/// Largest head dimension the attention kernels take: four `[16, d]` fp32 tiles must fit in
/// 48 KiB of static shared memory.
pub const MAX_HEAD_DIM: usize = 128;
/// Blocks of the sum-of-squares kernel (its partial sums are added on the host).
pub const SUM_BLOCKS: u32 = 256;
/// Rows per block of the RMSNorm weight-gradient kernel.
pub const DG_ROWS: usize = 64;
/// Cap on the blocks of a grid-stride elementwise kernel.
const MAX_BLOCKS: usize = 8192;

/// A launch shape: grid `(x, y)` of blocks of `block` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Blocks along x and y.
    pub grid: (u32, u32),
    /// Threads per block.
    pub block: u32,
}

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// One block of [`NT_ROW`] threads per row, `rows` rows (`rows >= 1`).
pub fn per_row(rows: usize) -> Shape {
    Shape {
        grid: (to_u32(rows.max(1)), 1),
        block: NT_ROW,
    }
}

/// A grid-stride loop over `n` elements.
pub fn elementwise(n: usize) -> Shape {
    Shape {
        grid: (to_u32(n.div_ceil(NT_ROW as usize).clamp(1, MAX_BLOCKS)), 1),
        block: NT_ROW,
    }
}

/// `rmsnorm_dg` over `[t, h]`: columns across x, [`DG_ROWS`] rows per block across y.
pub fn norm_dg(t: usize, h: usize) -> Shape {
    Shape {
        grid: (
            to_u32(h.div_ceil(NT_ROW as usize).max(1)),
            to_u32(t.div_ceil(DG_ROWS).max(1)),
        ),
        block: NT_ROW,
    }
}

/// Attention over `tiles` (a [`tiles`] list, 4 values per tile) and `heads` heads (query heads for
/// the forward and dq, key/value heads for dk/dv).
pub fn attention(tiles: &[i32], heads: usize) -> Shape {
    attention_tiles(tiles.len() / 4, heads)
}

/// Attention over `count` tiles and `heads` heads (at least one block: an empty tile list is
/// launched with the one dummy tile `(0, 0, 0, 0)`, which writes nothing).
pub fn attention_tiles(count: usize, heads: usize) -> Shape {
    Shape {
        grid: (to_u32(count.max(1)), to_u32(heads)),
        block: NT_ATT,
    }
}

/// The sum-of-squares kernel: [`SUM_BLOCKS`] blocks.
pub fn sum_squares() -> Shape {
    Shape {
        grid: (SUM_BLOCKS, 1),
        block: NT_ROW,
    }
}

/// The attention tiles of a microbatch: for each sequence `[a, b)` of `cu_seqlens`, blocks of
/// [`TILE`] tokens `(first, end, a, b)`, flattened. The forward and dq use them as query tiles,
/// dk/dv as key tiles.
pub fn tiles(cu_seqlens: &[usize]) -> Vec<i32> {
    let mut out = Vec::new();
    for w in cu_seqlens.windows(2) {
        let (a, b) = (w[0], w[1]);
        for q0 in (a..b).step_by(TILE) {
            let q1 = (q0 + TILE).min(b);
            out.extend([q0, q1, a, b].map(|x| x as i32));
        }
    }
    out
}

/// Position of every token in its sequence (`[T]`, restarting at 0 at each `cu_seqlens` entry).
pub fn positions(cu_seqlens: &[usize]) -> Vec<i32> {
    cu_seqlens
        .windows(2)
        .flat_map(|w| (0..(w[1] - w[0]) as i32).collect::<Vec<_>>())
        .collect()
}

/// cuBLAS's (column-major) arguments for the row-major `c [m, n] = op(a) [m, k] op(b) [k, n]`
/// (`a` stored `[k, m]` when `ta`, `b` stored `[n, k]` when `tb`): a row-major matrix is its
/// transpose in column-major order, so cuBLAS computes `c^T = op(b)^T op(a)^T`: its first
/// operand is `b`, its second `a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColumnMajorGemm {
    /// Transpose cuBLAS's first operand (`b`).
    pub trans_first: bool,
    /// Transpose cuBLAS's second operand (`a`).
    pub trans_second: bool,
    /// cuBLAS's m: rows of `c^T` = n.
    pub m: usize,
    /// cuBLAS's n: columns of `c^T` = m.
    pub n: usize,
    /// The inner dimension k.
    pub k: usize,
    /// Leading dimension of `b` as stored.
    pub ld_first: usize,
    /// Leading dimension of `a` as stored.
    pub ld_second: usize,
    /// Leading dimension of `c` (n).
    pub ldc: usize,
}

/// See [`ColumnMajorGemm`].
pub fn row_major_gemm(ta: bool, tb: bool, (m, k, n): (usize, usize, usize)) -> ColumnMajorGemm {
    ColumnMajorGemm {
        trans_first: tb,
        trans_second: ta,
        m: n,
        n: m,
        k,
        ld_first: if tb { k } else { n },
        ld_second: if ta { m } else { k },
        ldc: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference BLAS GEMM (column-major, `C = op(A) op(B)`, `beta = 0`), as cuBLAS defines it.
    #[allow(clippy::too_many_arguments)]
    fn sgemm_col_major(
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        a: &[f32],
        lda: usize,
        b: &[f32],
        ldb: usize,
        c: &mut [f32],
        ldc: usize,
    ) {
        let at = |i: usize, p: usize| if ta { a[p + i * lda] } else { a[i + p * lda] };
        let bt = |p: usize, j: usize| if tb { b[j + p * ldb] } else { b[p + j * ldb] };
        for j in 0..n {
            for i in 0..m {
                c[i + j * ldc] = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
            }
        }
    }

    #[test]
    fn the_column_major_arguments_compute_the_row_major_product() {
        let (m, k, n) = (3, 4, 5);
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            // Row-major storage of a ([m, k], or [k, m] when ta) and b ([k, n], or [n, k]).
            let a: Vec<f32> = (0..m * k).map(|x| (x as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|x| (x as f32 * 0.53).cos()).collect();
            let a_at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
            let b_at = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
            let g = row_major_gemm(ta, tb, (m, k, n));
            let mut c = vec![0.0f32; m * n];
            sgemm_col_major(
                (g.trans_first, g.trans_second),
                (g.m, g.n, g.k),
                &b,
                g.ld_first,
                &a,
                g.ld_second,
                &mut c,
                g.ldc,
            );
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|p| a_at(i, p) * b_at(p, j)).sum();
                    assert!(
                        (c[i * n + j] - want).abs() < 1e-5,
                        "ta {ta} tb {tb} ({i}, {j})"
                    );
                }
            }
        }
    }

    #[test]
    fn tiles_never_cross_a_sequence_and_cover_every_token() {
        let cu = [0, 5, 5 + 16, 5 + 16 + 33];
        let t = tiles(&cu);
        // 5 -> 1 tile, 16 -> 1, 33 -> 3 (16 + 16 + 1).
        assert_eq!(t.len() / 4, 5);
        let mut covered = 0;
        for c in t.chunks(4) {
            assert!(c[2] <= c[0] && c[0] < c[1] && c[1] <= c[3]);
            assert!(c[1] - c[0] <= TILE as i32);
            covered += c[1] - c[0];
        }
        assert_eq!(covered, 54);
        assert_eq!(positions(&[0, 2, 5]), vec![0, 1, 0, 1, 2]);
    }

    #[test]
    fn grids_cover_their_work() {
        assert_eq!(per_row(7).grid, (7, 1));
        assert_eq!(elementwise(1000).grid.0, 4); // 1000 / 256, rounded up
        assert_eq!(elementwise(1 << 30).grid.0, MAX_BLOCKS as u32);
        assert_eq!(norm_dg(130, 300).grid, (2, 3));
    }
}
