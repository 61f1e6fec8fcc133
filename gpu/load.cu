// GPU load generator for section 6 (gpu/latency.py): the real-GPU twin of
// examples/loadgen.rs, with a fixed-work spin kernel of a chosen length.
//
//   nvcc -O2 -std=c++17 -arch=native -o load gpu/load.cu
//   ./load calibrate [--grid G] [--block B]
//   ./load batch KERNEL_US [--depth D] [common options]
//   ./load interactive KERNELS KERNEL_US PERIOD_US [common options]
//
// common options:
//   --grid G --block B     launch shape (default: one block of 128 threads per SM)
//   --cycles-per-us R      SM cycles per microsecond, from `calibrate` with the
//                          same shape (default: calibrate here, which is only
//                          right when nothing else runs on the GPU)
//   --sync DIR --tag T     after initialising, create DIR/T.ready, then wait
//                          for DIR/go holding "START_NS END_NS" (CLOCK_MONOTONIC)
//   --seconds S            without --sync: the window is the next S seconds
//
// The kernel: every block busy-waits on clock64() until it has accumulated
// KERNEL_US worth of SM cycles, counting only short steps between two reads.
// A long step means the block was off the SM (the driver time-sliced another
// context in), and is not work: a kernel is a fixed amount of GPU time
// whether or not it is preempted, so shares measured in kernels are shares
// of GPU time.
//
// calibrate prints
//   RESULT mode=calibrate cycles_per_us=R grid=G block=B sms=N k50_us=.. k6000_us=.. k120000_us=..
// (the k*_us: how long such kernels take alone, measured with cudaEvents).
//
// batch keeps DEPTH kernels queued (an event after each; before launching
// the next, it waits for the oldest) from START to END and prints
//   RESULT mode=batch kernel_us=K depth=D kernels=N work_us=W window_us=T busy=W/T late_us=L
// N: kernels that completed inside the window; W: GPU time done inside it,
// each kernel's K spread evenly over the interval it was on the GPU (from
// the later of its launch and its predecessor's completion to its own
// completion, by its event), so kernels straddling START or END count in
// part. Default DEPTH: about 1 ms of work, and at least 2, so the queue
// never runs dry between a completion and the next launch.
//
// interactive sends a request every PERIOD_US from START to END: KERNELS
// kernels queued at once, then cudaStreamSynchronize; a request's latency
// runs from its first launch to the synchronize's return. It prints
//   RESULT mode=interactive requests=N p50_us=.. p99_us=.. max_us=.. missed=M late_us=L
// M: requests that took longer than the period. A request that ends past
// its whole next slot skips the slots it missed, as a server with a
// deadline would. late_us: how late the process was for START (0: on time).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime.h>

// ------------------------------------------------------------------ kernel

__global__ void spin(long long work_cycles, long long gap_cycles, unsigned long long *sink) {
    long long done = 0;
    long long last = clock64();
    while (done < work_cycles) {
        long long now = clock64();
        long long d = now - last;
        // Negative: the block was resumed on another SM, whose counter is
        // unrelated. Either way the step is not work.
        if (d >= 0 && d < gap_cycles) done += d;
        last = now;
    }
    if (done == -1 && sink) *sink = (unsigned long long)done;
}

// ------------------------------------------------------------------ host helpers

static int64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_until(int64_t t) {
    timespec ts;
    ts.tv_sec = t / 1000000000LL;
    ts.tv_nsec = t % 1000000000LL;
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
    }
}

static void die(const char *what, cudaError_t e) {
    std::fprintf(stderr, "load: %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
    std::exit(1);
}

#define CK(call)                               \
    do {                                       \
        cudaError_t e_ = (call);               \
        if (e_ != cudaSuccess) die(#call, e_); \
    } while (0)

static void usage() {
    std::fprintf(stderr,
                 "usage: load calibrate [--grid G] [--block B]\n"
                 "       load batch KERNEL_US [--depth D] [options]\n"
                 "       load interactive KERNELS KERNEL_US PERIOD_US [options]\n"
                 "options: --grid G --block B --cycles-per-us R (--sync DIR --tag T | --seconds S)\n");
    std::exit(2);
}

struct Opts {
    std::string mode;
    std::vector<double> pos;
    int grid = 0, block = 128, depth = 0;
    double cycles_per_us = 0, seconds = 0;
    std::string sync_dir, tag = "load";
};

static double num(const char *s) {
    char *end = nullptr;
    double v = std::strtod(s, &end);
    if (!end || *end || !std::isfinite(v)) {
        std::fprintf(stderr, "load: %s is not a number\n", s);
        usage();
    }
    return v;
}

static Opts parse(int argc, char **argv) {
    if (argc < 2) usage();
    Opts o;
    o.mode = argv[1];
    for (int i = 2; i < argc; ++i) {
        std::string a = argv[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) usage();
            return argv[++i];
        };
        if (a == "--grid") o.grid = (int)num(val());
        else if (a == "--block") o.block = (int)num(val());
        else if (a == "--depth") o.depth = (int)num(val());
        else if (a == "--cycles-per-us") o.cycles_per_us = num(val());
        else if (a == "--seconds") o.seconds = num(val());
        else if (a == "--sync") o.sync_dir = val();
        else if (a == "--tag") o.tag = val();
        else if (a.rfind("--", 0) == 0) usage();
        else o.pos.push_back(num(a.c_str()));
    }
    return o;
}

struct Gpu {
    cudaStream_t stream;
    int grid, block, sms;
    double cycles_per_us;
    long long gap_cycles;
    unsigned long long *sink;

    long long cycles(double us) const { return (long long)std::llround(us * cycles_per_us); }

    void launch(long long work_cycles) {
        spin<<<grid, block, 0, stream>>>(work_cycles, gap_cycles, sink);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) die("kernel launch", e);
    }

    // GPU time of one kernel of `work_cycles`, by events, in microseconds.
    double time_us(long long work_cycles) {
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        CK(cudaEventRecord(a, stream));
        launch(work_cycles);
        CK(cudaEventRecord(b, stream));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
        return ms * 1000.0;
    }

    double median_us(long long work_cycles, int reps) {
        std::vector<double> v;
        for (int i = 0; i < reps; ++i) v.push_back(time_us(work_cycles));
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    }

    // Cycles per microsecond from two lengths, so the launch and event
    // overhead (the same for both) cancels.
    double calibrate() {
        const long long c1 = 2000000, c2 = 4000000;
        // Before any rate is known, no step may count as a gap.
        gap_cycles = (long long)1 << 62;
        median_us(c1, 2);  // warm-up: clocks ramp, the module loads
        double t1 = median_us(c1, 5), t2 = median_us(c2, 5);
        if (t2 <= t1) {
            std::fprintf(stderr, "load: calibration failed (%.1f us for %lld cycles, %.1f us for %lld)\n", t1, c1,
                         t2, c2);
            std::exit(1);
        }
        return (double)(c2 - c1) / (t2 - t1);
    }

    void init(const Opts &o) {
        // Spin, not yield or block, while waiting: a request's latency and a
        // completion's time should not include a sleeping thread's wake-up.
        CK(cudaSetDeviceFlags(cudaDeviceScheduleSpin));
        CK(cudaFree(nullptr));
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        grid = o.grid > 0 ? o.grid : sms;
        block = o.block;
        CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        CK(cudaMalloc(&sink, sizeof(*sink)));
        cycles_per_us = o.cycles_per_us > 0 ? o.cycles_per_us : calibrate();
        // 5 us without a step of the loop is far beyond anything a resident
        // block sees, and far below a time slice.
        gap_cycles = (long long)(5.0 * cycles_per_us);
    }
};

// ------------------------------------------------------------------ the window

struct Window {
    int64_t start, end, late;
};

static Window window(const Opts &o) {
    Window w{0, 0, 0};
    if (!o.sync_dir.empty()) {
        std::string ready = o.sync_dir + "/" + o.tag + ".ready";
        int fd = open(ready.c_str(), O_CREAT | O_WRONLY, 0644);
        if (fd < 0) {
            std::perror(("load: " + ready).c_str());
            std::exit(1);
        }
        close(fd);
        std::string go = o.sync_dir + "/go";
        int64_t give_up = now_ns() + 300LL * 1000000000LL;
        for (;;) {
            FILE *f = std::fopen(go.c_str(), "r");
            if (f) {
                long long s = 0, e = 0;
                int n = std::fscanf(f, "%lld %lld", &s, &e);
                std::fclose(f);
                if (n == 2 && e > s) {
                    w.start = s;
                    w.end = e;
                    break;
                }
            }
            if (now_ns() > give_up) {
                std::fprintf(stderr, "load: no usable %s within 300 s\n", go.c_str());
                std::exit(1);
            }
            sleep_until(now_ns() + 1000000);
        }
    } else {
        if (o.seconds <= 0) usage();
        w.start = now_ns() + 50000000;
        w.end = w.start + (int64_t)(o.seconds * 1e9);
    }
    int64_t t = now_ns();
    w.late = t > w.start ? t - w.start : 0;
    return w;
}

// ------------------------------------------------------------------ modes

static int calibrate_mode(const Opts &o) {
    Gpu g;
    g.init(o);
    double k[3] = {50, 6000, 120000};
    double m[3];
    for (int i = 0; i < 3; ++i) m[i] = g.median_us(g.cycles(k[i]), k[i] > 10000 ? 3 : 5);
    std::printf("RESULT mode=calibrate cycles_per_us=%.3f grid=%d block=%d sms=%d k50_us=%.1f k6000_us=%.1f "
                "k120000_us=%.1f\n",
                g.cycles_per_us, g.grid, g.block, g.sms, m[0], m[1], m[2]);
    return 0;
}

static int batch_mode(const Opts &o) {
    if (o.pos.size() != 1 || o.pos[0] <= 0) usage();
    const double kernel_us = o.pos[0];
    const int depth = o.depth > 0 ? o.depth : std::max(2, (int)std::ceil(1000.0 / kernel_us));
    Gpu g;
    g.init(o);
    const long long work = g.cycles(kernel_us);
    std::vector<cudaEvent_t> ev(depth);
    std::vector<int64_t> submitted(depth);
    for (auto &e : ev) CK(cudaEventCreate(&e));
    g.launch(work);  // warm-up
    // The event that maps GPU timestamps onto CLOCK_MONOTONIC: its time is
    // read right after the spinning synchronize sees it complete.
    cudaEvent_t ref;
    CK(cudaEventCreate(&ref));
    CK(cudaEventRecord(ref, g.stream));
    CK(cudaEventSynchronize(ref));
    const int64_t ref_ns = now_ns();

    Window w = window(o);
    sleep_until(w.start);
    long long kernels = 0;
    double work_us = 0;
    int64_t prev_done = INT64_MIN;
    auto account = [&](int slot) {
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ref, ev[slot]));
        int64_t done = ref_ns + (int64_t)std::llround((double)ms * 1e6);
        int64_t began = std::max(prev_done, submitted[slot]);
        done = std::max(done, began);
        int64_t lo = std::max(began, w.start), hi = std::min(done, w.end);
        if (done > began) {
            if (hi > lo) work_us += kernel_us * (double)(hi - lo) / (double)(done - began);
        } else if (done >= w.start && done <= w.end) {
            work_us += kernel_us;
        }
        if (done >= w.start && done <= w.end) ++kernels;
        prev_done = done;
    };
    long long launched = 0;
    while (now_ns() < w.end) {
        int slot = (int)(launched % depth);
        if (launched >= depth) {
            CK(cudaEventSynchronize(ev[slot]));
            account(slot);
        }
        g.launch(work);
        // When the launch returns (the shim may have held it at its gate),
        // not before: the kernel cannot have started earlier.
        submitted[slot] = now_ns();
        CK(cudaEventRecord(ev[slot], g.stream));
        ++launched;
    }
    for (long long k = std::max(0LL, launched - depth); k < launched; ++k) {
        int slot = (int)(k % depth);
        CK(cudaEventSynchronize(ev[slot]));
        account(slot);
    }
    double window_us = (double)(w.end - w.start) / 1000.0;
    std::printf("RESULT mode=batch kernel_us=%.0f depth=%d kernels=%lld work_us=%.1f window_us=%.1f busy=%.5f "
                "late_us=%.0f\n",
                kernel_us, depth, kernels, work_us, window_us, work_us / window_us, (double)w.late / 1000.0);
    return 0;
}

static int interactive_mode(const Opts &o) {
    if (o.pos.size() != 3 || o.pos[0] < 1 || o.pos[1] <= 0 || o.pos[2] <= 0) usage();
    const int kernels = (int)o.pos[0];
    const double kernel_us = o.pos[1];
    const int64_t period = (int64_t)(o.pos[2] * 1000.0);
    Gpu g;
    g.init(o);
    const long long work = g.cycles(kernel_us);
    for (int r = 0; r < 3; ++r) {  // warm-up requests, outside the window
        for (int i = 0; i < kernels; ++i) g.launch(work);
        CK(cudaStreamSynchronize(g.stream));
    }
    Window w = window(o);
    std::vector<int64_t> lat;
    int64_t next = w.start;
    while (next < w.end) {
        sleep_until(next);
        int64_t t0 = now_ns();
        for (int i = 0; i < kernels; ++i) g.launch(work);
        CK(cudaStreamSynchronize(g.stream));
        int64_t t1 = now_ns();
        lat.push_back(t1 - t0);
        next += period;
        while (next + period < t1) next += period;
    }
    std::sort(lat.begin(), lat.end());
    auto pct = [&](double p) -> double {
        if (lat.empty()) return 0;
        size_t rank = (size_t)std::ceil(p * (double)lat.size());
        rank = std::min(std::max(rank, (size_t)1), lat.size());
        return (double)lat[rank - 1] / 1000.0;
    };
    long long missed = std::count_if(lat.begin(), lat.end(), [&](int64_t l) { return l > period; });
    std::printf("RESULT mode=interactive requests=%zu p50_us=%.0f p99_us=%.0f max_us=%.0f missed=%lld late_us=%.0f\n",
                lat.size(), pct(0.50), pct(0.99), lat.empty() ? 0.0 : (double)lat.back() / 1000.0, missed,
                (double)w.late / 1000.0);
    return 0;
}

int main(int argc, char **argv) {
    Opts o = parse(argc, argv);
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    if (o.mode == "calibrate") return calibrate_mode(o);
    if (o.mode == "batch") return batch_mode(o);
    if (o.mode == "interactive") return interactive_mode(o);
    usage();
    return 2;
}
