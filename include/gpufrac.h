/*
 * gpufrac.h — the C contract of libgpufrac.so.
 *
 * libgpufrac.so is injected with LD_PRELOAD (or /etc/ld.so.preload) in front
 * of the CUDA driver (libcuda.so.1). Applications need no change and need
 * not include this header; it documents the contract and declares the small
 * query API for programs that want to know their cap.
 *
 * Environment (read once, at the first CUDA call; never before):
 *
 *   GPU_MEM_LIMIT        Memory cap for every device this process sees:
 *                        4G, 4GiB, 4GB, 512M, 1.5G, 4294967296 (bytes), 25%
 *                        (of the device's physical memory). K/M/G/T with an
 *                        optional i, iB or B suffix are all binary (x1024).
 *                        Unset, empty or 0: no cap.
 *   GPU_MEM_LIMIT_<N>    Overrides GPU_MEM_LIMIT for CUDA device ordinal N as
 *                        this process numbers it (after CUDA_VISIBLE_DEVICES).
 *                        0 lifts the cap for that device.
 *   GPU_COMPUTE_SHARE    30% or 30: weight when the GPU is contended
 *                        (work-conserving). Needs the broker.
 *   GPU_COMPUTE_LIMIT    30%: hard ceiling of GPU time over a sliding window,
 *                        even when the GPU is otherwise idle. Needs the broker.
 *   GPUFRAC_SOCKET       Broker socket (default /run/gpufrac/broker.sock).
 *   GPUFRAC_BROKER       optional (default) | required | off.
 *   GPUFRAC_LOG          error (default) | warn | info | debug; lines on
 *                        stderr prefixed "gpufrac: ". Refusals by a cap
 *                        are said at every level (see Errors).
 *
 * Errors:
 *
 *   - A malformed value fails closed: cuInit (and any hooked entry point
 *     reached before it) returns CUDA_ERROR_INVALID_VALUE (1) and stderr
 *     names the variable, the bad value and a good example.
 *   - An allocation that would take the process past its cap on a device
 *     returns CUDA_ERROR_OUT_OF_MEMORY (2) without calling the driver; the
 *     process carries on, and frees make room again. The first refusal
 *     says so on stderr whatever GPUFRAC_LOG says, then at most one a
 *     second: "gpufrac: device 0: refused 256 MiB: cap 4 GiB reached
 *     (4 GiB in use)", or, for a request larger than the cap itself,
 *     "refused 6 GiB: the request alone exceeds the cap of 4 GiB (0 B in
 *     use)".
 *   - GPUFRAC_BROKER=required with no broker answering: cuInit returns
 *     CUDA_ERROR_SYSTEM_NOT_READY (802) with a message on stderr.
 *   - Every other driver result code is passed through unchanged.
 *
 * What the process sees: cuMemGetInfo reports total = min(cap, physical)
 * and free = min(physical free, cap - used); cuDeviceTotalMem reports
 * min(cap, physical); NVML's nvmlDeviceGetMemoryInfo(_v2) agrees (devices
 * matched by UUID).
 */
#ifndef GPUFRAC_H
#define GPUFRAC_H

#ifdef __cplusplus
extern "C" {
#endif

/* Cap in bytes for CUDA device `device` as this process numbers it, or 0
 * when uncapped (or unknown). Percentage caps are known once cuInit has
 * succeeded. */
unsigned long long gpufrac_mem_limit(int device);

/* Sets this process's own cap on `device` to `bytes` (0: back to the cap
 * it started with) and returns the cap now in force (0: none). Never
 * raises the cap above the one the process started with (GPU_MEM_LIMIT),
 * and a job's shared cap still binds: a test runner narrows a worker to
 * one test's budget, then widens it again. Memory already held past a new
 * cap stays held; the next allocation is refused. */
unsigned long long gpufrac_mem_limit_set(int device, unsigned long long bytes);

/* Bytes currently charged to this process on `device`. */
unsigned long long gpufrac_mem_used(int device);

/* Highest usage seen on `device`. */
unsigned long long gpufrac_mem_peak(int device);

/* Starts a new peak on `device` at the usage charged now and returns the
 * peak before it: call it before a test, and again after, for that test's
 * peak. */
unsigned long long gpufrac_mem_peak_reset(int device);

/* The most this process asked to hold on `device` since its peak was last
 * reset: its peak, or what it held when an allocation was refused plus the
 * refused request, whichever is more. What a piece of work needed, even
 * when its first allocation was refused (its peak is then 0). */
unsigned long long gpufrac_mem_wanted(int device);

/* Allocations the shim refused on `device` with CUDA_ERROR_OUT_OF_MEMORY
 * (the process's cap, the job's cap, or job books it could not trust),
 * counted from the start of the process (a forked child starts at 0).
 * Read it before and after a piece of work: a difference means the work
 * ran into its cap, whatever the application made of the error. */
unsigned long long gpufrac_mem_refusals(int device);

/* Live allocations tracked by the shim, all devices. */
unsigned long long gpufrac_live_allocations(void);

/* Version of libgpufrac.so, e.g. "0.1.0". */
const char *gpufrac_version(void);

/*
 * Applications that may run without the shim should look the functions up
 * instead of linking them:
 *
 *   unsigned long long (*limit)(int) =
 *       (unsigned long long (*)(int))dlsym(RTLD_DEFAULT, "gpufrac_mem_limit");
 *   if (limit) printf("cap: %llu bytes\n", limit(0));
 */

#ifdef __cplusplus
}
#endif

#endif /* GPUFRAC_H */
