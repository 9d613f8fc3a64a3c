// Runs flatpipe's CUDA C kernels (executor/src/cuda/kernels.cu) on the CPU, for tests on machines
// without a GPU. blockDim OS threads run the blocks one after another; __syncthreads is a barrier of
// those threads; __shared__ arrays are function statics, shared by the block's threads (blocks
// never run at once, so one copy serves them all); atomicAdd is an atomic read-modify-write.
// Slow, and only for small shapes, but the same source and the same index arithmetic as on a GPU.
#pragma once
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// A blocking barrier (std::barrier spins, which starves 256 threads on a 2-core machine).
class EmuBarrier {
  public:
    explicit EmuBarrier(unsigned n) : n_(n) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(m_);
        unsigned gen = gen_;
        if (++count_ == n_) {
            count_ = 0;
            ++gen_;
            cv_.notify_all();
        } else {
            cv_.wait(lock, [&] { return gen != gen_; });
        }
    }

  private:
    std::mutex m_;
    std::condition_variable cv_;
    unsigned n_, count_ = 0, gen_ = 0;
};

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline EmuBarrier* emu_block_barrier = nullptr;
inline std::mutex emu_launch_lock;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline int min(int a, int b) { return a < b ? a : b; }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }

#define __global__
#define __device__
#define __shared__ static

// Launches kernel `k` on grid x block with its arguments packed as cuLaunchKernel's kernelParams
// (args[i] points to the i-th argument's value).
template <class... P, std::size_t... I>
void emu_launch_impl(void (*k)(P...), dim3 grid, dim3 block, void** args,
                     std::index_sequence<I...>) {
    // One launch at a time: kernels launched from several test threads at once would otherwise
    // share gridDim, blockDim and the barrier.
    std::lock_guard<std::mutex> guard(emu_launch_lock);
    gridDim = grid;
    blockDim = block;
    unsigned nt = block.x * block.y * block.z;
    EmuBarrier bar(nt);
    emu_block_barrier = &bar;
    // blockDim threads walk the blocks together; a barrier ends each block.
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (unsigned t = 0; t < nt; ++t)
        threads.emplace_back([&, t] {
            threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        blockIdx = dim3{bx, by, bz};
                        k(*static_cast<std::remove_reference_t<P>*>(args[I])...);
                        bar.arrive_and_wait();
                    }
        });
    for (auto& th : threads) th.join();
}

template <class... P>
void emu_launch(void (*k)(P...), dim3 grid, dim3 block, void** args) {
    emu_launch_impl(k, grid, block, args, std::index_sequence_for<P...>{});
}

// `extern "C" void emu_<name>(gx, gy, bx, args)`: what the Rust test loads.
#define EMU_EXPORT(name)                                                                       \
    extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned bx, void** args) {            \
        emu_launch(name, dim3{gx, gy, 1}, dim3{bx, 1, 1}, args);                                 \
    }
