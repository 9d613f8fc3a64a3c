//! The host allocator's policy for the executor: memory a step frees stays in the process.
//!
//! The executor allocates and frees `[T, H]` tensors of megabytes every action. mimalloc, the
//! allocator of the `flatpipe` binary and of the benchmarks, returns memory that stayed free
//! longer than its purge delay (1 s in mimalloc v3, `mi_option_purge_delay`) to the operating
//! system, and the next tensors fault those pages in again, zeroed by the kernel. The time that
//! costs depends on the host, not on the schedule: measured on this project's 2-core machine
//! (2026-12-01), `flatpipe calibrate --quick` spent 9-17% of its CPU time in the kernel and the
//! same three schedules, on the same profile and steps, measured 805-968 ms in one run and
//! 1,102-1,216 ms in the next; with purging off, 5-8% in the kernel and 704-757 ms in two runs.
//! The profiler's tight loops reuse their memory within the delay, so they never paid it: the
//! predictions were biased low. PyTorch's caching allocators keep freed blocks for the same
//! reason.

/// mimalloc v3's `mi_option_purge_delay` (`mimalloc.h`, enum `mi_option_e`, position 15; the
/// `libmimalloc-sys` crate does not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to return freed memory to the operating system (purge delay -1): a
/// process keeps its peak, as a training framework's caching allocator does. Call it first
/// thing in `main`, before any thread starts. Without mimalloc as the global allocator it
/// changes an allocator nothing uses.
pub fn keep_freed_memory() {
    // SAFETY: `mi_option_set` writes one integer of mimalloc's option table; it takes no
    // pointers. Its one hazard is a data race with another thread setting options (it is not
    // thread-safe): callers run it at the start of `main`, before spawning any thread.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_option_is_mimallocs_purge_delay() {
        // SAFETY: reads one integer of the option table; no other test sets options.
        #[allow(unsafe_code)]
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        // mimalloc v3's default purge delay is 1,000 ms (`options.c`): the index is right.
        let before = get();
        assert!(before == 1000 || before == -1, "{before}");
        keep_freed_memory();
        assert_eq!(get(), -1);
    }
}
