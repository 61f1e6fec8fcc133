// Launch-bound microbenchmark for the shim's launch fast path.
//
//   nvcc -O2 -arch=native -o empty_kernel gpu/empty_kernel.cu
//   ./empty_kernel [LAUNCHES]          (default 200000)
//
// Launches LAUNCHES empty kernels <<<1,1>>> back to back on the default
// stream after a warm-up and prints one line:
//   RESULT launches=N submit_ms=… total_ms=… ns_per_launch=…
// submit_ms is the host time to enqueue them, total_ms includes the final
// cudaDeviceSynchronize; ns_per_launch = total / N. cudart finds the driver
// through dlopen + cuGetProcAddress, so under LD_PRELOAD every launch goes
// through the shim's cuLaunchKernel hook.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void empty_kernel() {}

static bool ok(cudaError_t e, const char *what) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "empty_kernel: %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
        return false;
    }
    return true;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? std::atol(argv[1]) : 200000;
    if (n <= 0) {
        std::fprintf(stderr, "usage: empty_kernel [LAUNCHES>0]\n");
        return 2;
    }
    if (!ok(cudaFree(nullptr), "cudaFree(0) (context creation)")) return 1;
    for (int i = 0; i < 2000; ++i) empty_kernel<<<1, 1>>>();
    if (!ok(cudaGetLastError(), "warm-up launch") || !ok(cudaDeviceSynchronize(), "warm-up sync")) return 1;

    using clk = std::chrono::steady_clock;
    auto t0 = clk::now();
    for (long i = 0; i < n; ++i) empty_kernel<<<1, 1>>>();
    auto t1 = clk::now();
    cudaError_t launch = cudaGetLastError();
    cudaError_t sync = cudaDeviceSynchronize();
    auto t2 = clk::now();
    if (!ok(launch, "launch") || !ok(sync, "cudaDeviceSynchronize")) return 1;

    double submit_ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
    double total_ns = std::chrono::duration<double, std::nano>(t2 - t0).count();
    std::printf("RESULT launches=%ld submit_ms=%.3f total_ms=%.3f ns_per_launch=%.1f\n", n, submit_ns / 1e6,
                total_ns / 1e6, total_ns / (double)n);
    return 0;
}
