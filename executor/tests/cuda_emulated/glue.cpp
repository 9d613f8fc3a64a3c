// One translation unit: the emulation header, the kernels exactly as NVRTC compiles them, and an
// exported launcher per kernel. Built by executor/tests/cuda_emulated.rs with g++ -std=c++20.
#include "emulate.h"
#include "kernels.cu"

EMU_EXPORT(add_inplace)
EMU_EXPORT(swiglu_fwd)
EMU_EXPORT(swiglu_bwd)
EMU_EXPORT(rmsnorm_fwd)
EMU_EXPORT(rmsnorm_dx)
EMU_EXPORT(rmsnorm_dg)
EMU_EXPORT(rope)
EMU_EXPORT(embedding_fwd)
EMU_EXPORT(embedding_bwd)
EMU_EXPORT(cross_entropy_fwd)
EMU_EXPORT(loss_sums)
EMU_EXPORT(cross_entropy_bwd)
EMU_EXPORT(attn_fwd)
EMU_EXPORT(attn_bwd_delta)
EMU_EXPORT(attn_bwd_dq)
EMU_EXPORT(attn_bwd_dkdv)
EMU_EXPORT(sum_squares)
EMU_EXPORT(adamw)
EMU_EXPORT(init_uniform)
