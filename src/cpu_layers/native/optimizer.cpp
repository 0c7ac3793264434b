// The training step's momentum SGD over every parameter, in two passes compiled for AVX-512 and for
// any x86_64.
#include "core.hpp"

namespace resnet_conv {

namespace {

// The arguments of momentum_step's two passes: n parameters' element counts and buffers.
struct MomentumArgs {
    int n;
    float factor, lr, momentum;
    const float *decays;
    const int64_t *counts;
    void *const *gradients, *const *weights, *const *moments;
};

// momentum_step's two passes (see there): every gradient times the factor checked, then, only when
// all are finite, every parameter moved; true when they moved. They are memory-bound, yet over
// ResNet18's 11.2M parameters, caches cold as in a training step, AVX-512's 64-byte loads took them
// from 2.9 + 6.1 to 2.1 + 5.1 ms on 2 threads. So they are compiled twice, for AVX-512 and for any
// x86_64, with the same float operations in the same order (the build's -ffp-contract=off keeps the
// AVX-512 copy from fusing a multiply and an add, which would change the bits). A macro, not a
// template: OpenMP outlines a parallel loop, before any inlining, into a function of its enclosing
// function's target.
#define MOMENTUM_PASSES(NAME, TARGET)                                                                     \
    TARGET bool NAME(const MomentumArgs &a) {                                                            \
        const float factor = a.factor, lr = a.lr, momentum = a.momentum;                                  \
        int bad = 0;                                                                                      \
        for (int i = 0; i < a.n && !bad; ++i) {                                                           \
            const int64_t count = a.counts[i];                                                            \
            const float *gradient = static_cast<const float *>(a.gradients[i]);                          \
            int tensor_bad = 0;                                                                           \
            _Pragma("omp parallel for simd reduction(| : tensor_bad) if (count > (1 << 16))")            \
            for (int64_t j = 0; j < count; ++j) {                                                         \
                const float value = gradient[j] * factor;                                                 \
                uint32_t bits;                                                                            \
                std::memcpy(&bits, &value, sizeof(bits));                                                 \
                tensor_bad |= inf_or_nan(bits);                                                           \
            }                                                                                             \
            bad |= tensor_bad;                                                                            \
        }                                                                                                 \
        if (bad) return false;                                                                            \
        for (int i = 0; i < a.n; ++i) {                                                                   \
            const int64_t count = a.counts[i];                                                            \
            const float *gradient = static_cast<const float *>(a.gradients[i]);                          \
            float *weight = static_cast<float *>(a.weights[i]), *moment = static_cast<float *>(a.moments[i]); \
            const float decay = a.decays[i];                                                              \
            if (decay != 0.f) {                                                                           \
                _Pragma("omp parallel for simd if (count > (1 << 16))")                                   \
                for (int64_t j = 0; j < count; ++j) {                                                     \
                    const float decayed = weight[j] * decay;                                              \
                    const float moved = moment[j] * momentum + (decayed + gradient[j] * factor);          \
                    moment[j] = moved;                                                                    \
                    weight[j] = weight[j] - lr * moved;                                                   \
                }                                                                                         \
            } else {                                                                                      \
                _Pragma("omp parallel for simd if (count > (1 << 16))")                                   \
                for (int64_t j = 0; j < count; ++j) {                                                     \
                    const float moved = moment[j] * momentum + gradient[j] * factor;                      \
                    moment[j] = moved;                                                                    \
                    weight[j] = weight[j] - lr * moved;                                                   \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        return true;                                                                                      \
    }
MOMENTUM_PASSES(momentum_passes, )
MOMENTUM_PASSES(momentum_passes_avx512, __attribute__((target("avx512f"))))
#undef MOMENTUM_PASSES

// Whether this library's own loops may use AVX-512: the CPU has it and oneDNN is not capped at AVX2
// (CapIsa: tests and the benchmark's AVX2 rows run as a CPU without it would).
bool own_loops_use_avx512() { return g_isa != dnnl::cpu_isa::avx2 && __builtin_cpu_supports("avx512f"); }

}  // namespace

// One momentum SGD step over every parameter, as the training step with MindSpore's nn.Momentum takes
// it, in two multi-threaded passes instead of five kernels per parameter. Inputs: the factor (1 / loss
// scale), lr, momentum, the decays (one per parameter, 0: none), then n gradients, n weights and n
// moments; the weights and moments are written in place. First every gradient times the factor is
// checked; only when all are finite does each parameter move, with MindSpore's float32 operations in
// its order (no fused multiply-add: the same bits): g = grad * factor; g = weight * decay + g where it
// decays; moment = moment * momentum + g; weight = weight - lr * moment. The output: 1.0 when the step
// was applied, 0.0 when a gradient was not finite and nothing moved.
std::string momentum_step(const KernelCall &call) {
    const int nparam = call.nparam, n = (nparam - 5) / 3;
    void **params = call.params;
    bool ok = call.elements(3) == n && call.elements(nparam - 1) == 1;
    for (int slot = 0; ok && slot < 3; ++slot) ok = call.elements(slot) == 1;
    std::vector<int64_t> counts(ok ? n : 0);
    for (int i = 0; ok && i < n; ++i) {
        counts[i] = call.elements(4 + i);
        ok = counts[i] == call.elements(4 + n + i) && counts[i] == call.elements(4 + 2 * n + i);
    }
    if (!ok)
        return "takes float32 factor, lr, momentum, n decays, n gradients, n weights and n moments of their shapes, "
               "returns one value";
    const MomentumArgs args{n,
                            *static_cast<const float *>(params[0]),
                            *static_cast<const float *>(params[1]),
                            *static_cast<const float *>(params[2]),
                            static_cast<const float *>(params[3]),
                            counts.data(),
                            params + 4,
                            params + 4 + n,
                            params + 4 + 2 * n};
    const bool applied = own_loops_use_avx512() ? momentum_passes_avx512(args) : momentum_passes(args);
    *static_cast<float *>(params[nparam - 1]) = applied ? 1.f : 0.f;
    return "";
}

}  // namespace resnet_conv
