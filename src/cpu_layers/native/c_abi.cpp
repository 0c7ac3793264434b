// The library's C ABI: the kernels MindSpore's Custom ops call (KERNEL, each through call_kernel, the
// one guarded way in), and the functions the Python side calls through ctypes (library.py). Only
// these are visible outside the library (EXPORT; everything else is hidden by -fvisibility=hidden).
#include "core.hpp"

namespace resnet_conv {

namespace {

const std::pair<const char *, dnnl::cpu_isa> kIsas[] = {
    {"avx2", dnnl::cpu_isa::avx2}, {"avx512_core", dnnl::cpu_isa::avx512_core},
    {"avx512_core_bf16", dnnl::cpu_isa::avx512_core_bf16}, {"avx512_core_amx", dnnl::cpu_isa::avx512_core_amx},
    {"all", dnnl::cpu_isa::avx512_core_amx_fp16}};

const char *record_fields(const char *record) {
    const std::pair<const char *, const char *> records[] = {
        {"ConvParams", CONV_PARAMS(NAME_OF)}, {"NormParams", NORM_PARAMS(NAME_OF)},
        {"PoolParams", POOL_PARAMS(NAME_OF)}, {"QuantParams", QUANT_PARAMS(NAME_OF)},
        {"LsqParams", LSQ_PARAMS(NAME_OF)}};
    for (const auto &[name, fields] : records)
        if (std::strcmp(record, name) == 0) return fields;
    return "";
}

// TakeError's message "`name`: `what`"; nothing is thrown (an empty message where there is no memory).
void record_failure(const char *name, const char *what) noexcept {
    try {
        g_error = std::string(name) + ": " + what;
    } catch (...) {
        g_error.clear();
    }
}

// A function of the Python side's, run as call_kernel runs a kernel: under the state's lock, what it
// throws (which across the C ABI would end the process) becomes TakeError's message, "`name`: what
// was thrown", and the value `failed`.
template <typename Value, typename Body>
Value guarded(const char *name, Value failed, Body body) noexcept {
    std::unique_lock<std::mutex> guard;  // declared outside the try: the handlers write the message under it
    try {
        auto &s = state();
        guard = std::unique_lock<std::mutex>(s.lock);
        return body(s);
    } catch (const std::exception &e) {
        record_failure(name, e.what());  // in the handler: what() lives as long as the exception
    } catch (...) {
        record_failure(name, "an exception of unknown type");
    }
    return failed;
}

const char *kernel_slots(const char *kernel) {
    for (int kind = 0; kind < kKindCount; ++kind)
        if (std::strcmp(kernel, info(static_cast<Kind>(kind)).name) == 0) return info(static_cast<Kind>(kind)).slots;
    return "";
}

}  // namespace

}  // namespace resnet_conv

using namespace resnet_conv;  // the exported functions call the library's internals by name

#define EXPORT __attribute__((visibility("default")))
// A Custom op's kernel, with the signature MindSpore calls.
#define KERNEL(name, kind)                                                                                        \
    EXPORT int name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) { \
        return call_kernel(kind, nparam, params, ndims, shapes, dtypes);                                          \
    }

extern "C" {

KERNEL(ConvForward, kConvForward)
KERNEL(ConvBackwardData, kConvBackwardData)
KERNEL(ConvBackwardWeights, kConvBackwardWeights)
KERNEL(NormForward, kNormForward)
KERNEL(NormBackward, kNormBackward)
KERNEL(PoolForward, kPoolForward)
KERNEL(PoolBackward, kPoolBackward)
KERNEL(ToPlain, kToPlain)
KERNEL(ToBlocked, kToBlocked)
KERNEL(Sum, kSum)
KERNEL(NormForwardForked, kNormForwardForked)
KERNEL(NormBackwardSummed, kNormBackwardSummed)

KERNEL(Fork, kFork)
KERNEL(AllFinite, kAllFinite)
KERNEL(UnscaleAllFinite, kUnscaleAllFinite)
KERNEL(FakeQuant, kFakeQuant)
KERNEL(FakeQuantGrad, kFakeQuantGrad)
KERNEL(LearnedScaleQuant, kLearnedScaleQuant)
KERNEL(LearnedScaleQuantGrad, kLearnedScaleQuantGrad)
KERNEL(MomentumStep, kMomentumStep)

// For the Python side (ctypes, library.py).

// Threads per kernel (0: OpenMP's default, as when the library loaded).
EXPORT void SetThreads(int threads) { g_threads = std::max(threads, 0); }

// Freezes the weights of inference forwards until ThawWeights or the next training forward: each
// weights tensor is reordered on its first call and the reorder reused after. Returns the version (a
// new one each call, so weights loaded between two freezes are reordered again), 0 with TakeError's
// message when it failed. ThawWeights returns 0, or 1 with the message.
EXPORT uint64_t FreezeWeights() {
    return guarded("FreezeWeights", uint64_t{0}, [](State &s) {
        drop_kept_reorders(s);
        return g_frozen_version = ++g_last_version;
    });
}
EXPORT int ThawWeights() {
    return guarded("ThawWeights", 1, [](State &s) {
        drop_kept_reorders(s);
        g_frozen_version = 0;
        return 0;
    });
}
EXPORT uint64_t FrozenVersion() { return g_frozen_version; }

// How many floats the training forward of a convolution (x, w -> y shapes, ConvParams `record`) writes
// into its `matrix` output for the backward of its image gradient (weight_matrix_elements); -1 with
// TakeError's message when it failed.
EXPORT int64_t WeightMatrixElements(const int64_t *x, const int64_t *w, const int64_t *y, const int32_t *record) {
    return guarded("WeightMatrixElements", int64_t{-1}, [&](State &) {
        ConvParams p;
        std::memcpy(&p, record, sizeof(p));
        return weight_matrix_elements(x, w, y, p);
    });
}

// How the library runs a convolution (x, w -> y shapes, ConvParams `record`) on this CPU, under its ISA
// cap (convolution_path); "" with TakeError's message when it failed.
EXPORT const char *ConvolutionPath(const int64_t *x, const int64_t *w, const int64_t *y, const int32_t *record) {
    return guarded("ConvolutionPath", "", [&](State &) {
        ConvParams p;
        std::memcpy(&p, record, sizeof(p));
        return convolution_path(x, w, y, p);
    });
}

// The names of the layers' own loops (each followed by a comma), and their seconds since the library
// loaded, into `seconds` (at most `capacity`); returns how many there are (-1 with TakeError's message
// when it failed).
EXPORT const char *OwnLoopNames() { return kOwnLoopNames; }
EXPORT int OwnLoopSeconds(double *seconds, int capacity) {
    return guarded("OwnLoopSeconds", -1, [&](State &) {
        for (int i = 0; i < std::min<int>(capacity, kOwnLoopCount); ++i) seconds[i] = g_own_seconds[i];
        return static_cast<int>(kOwnLoopCount);
    });
}

// The oneDNN version this library runs (to prove the private copy is the one bound).
EXPORT int OneDnnVersion() {
    const dnnl_version_t *v = dnnl_version();
    return v->major * 10000 + v->minor * 100 + v->patch;
}

// The message of the last kernel that failed ("" when none since the last call), cleared as read.
EXPORT const char *TakeError() {
    static std::string taken;  // read by Python after a kernel failed, when no kernel runs
    taken.swap(g_error);
    g_error.clear();
    return taken.c_str();
}

// The names of a parameter record's fields and of a kernel's argument slots, in order, each followed
// by a comma ("" for an unknown name).
EXPORT const char *RecordFields(const char *record) { return record_fields(record); }
EXPORT const char *KernelSlots(const char *kernel) { return kernel_slots(kernel); }

// Caps this copy of oneDNN's ISA (avx2, avx512_core, avx512_core_bf16, avx512_core_amx, all); only
// before its first primitive. 0: done; 1: too late; 2: an unknown name.
EXPORT int CapIsa(const char *name) {
    for (const auto &isa : kIsas)
        if (std::strcmp(name, isa.first) == 0) {
            if (g_state_made) return 1;
            g_isa = isa.second;
            return 0;
        }
    return 2;
}

// The name of the ISA limit in force (CapIsa's names).
EXPORT const char *IsaCap() {
    for (const auto &isa : kIsas)
        if (isa.second == g_isa) return isa.first;
    return "";
}

// The layout blocked activations of a type ("float32", "bfloat16") have on this CPU: nChw16c,
// nChw8c, nhwc or nchw; "" where oneDNN has no such convolution here or chose another layout (or,
// with TakeError's message, where it failed).
EXPORT const char *BlockedLayout(const char *dtype) {
    return guarded("BlockedLayout", "", [&](State &s) {
        const tag layout = data_type(dtype) == dt::bf16 ? s.bf16_layout : s.f32_layout;
        for (const auto &known : kLayouts)
            if (known.first == layout) return known.second;
        return "";
    });
}

// Plans cached now, the most that are kept (a limit below 1 leaves it as it is), the scratchpad's
// bytes and those of the inference forwards' kept weight reorders (see drop_kept_reorders); -1 with
// TakeError's message when it failed.
EXPORT int PlanCount() {
    return guarded("PlanCount", -1, [](State &s) { return static_cast<int>(s.plans.size()); });
}
EXPORT int SetPlanLimit(int limit) {
    return guarded("SetPlanLimit", -1, [limit](State &s) {
        if (limit > 0) s.plan_limit = static_cast<size_t>(limit);
        return static_cast<int>(s.plan_limit);
    });
}
EXPORT int64_t ScratchpadBytes() {
    return guarded("ScratchpadBytes", int64_t{-1}, [](State &s) { return static_cast<int64_t>(s.scratchpad_bytes); });
}
EXPORT int64_t KeptReorderBytes() { return guarded("KeptReorderBytes", int64_t{-1}, kept_reorder_bytes); }

// Milliseconds for one convolution's forward and both backwards (probe_convolution), or -1 with
// TakeError's message.
EXPORT double ProbeConvolution(int64_t batch, int64_t channels, int64_t size, int64_t out_channels, int64_t kernel,
                               int64_t stride, int bf16, int repeats) {
    return guarded("ProbeConvolution", -1.0, [&](State &) {
        use_threads();
        return probe_convolution({batch, channels, size, size}, out_channels, kernel, stride, bf16 ? dt::bf16 : dt::f32,
                                 std::max(repeats, 1));
    });
}

// GMAC/s of a large 1x1 convolution (peak_gmacs), or -1 with TakeError's message.
EXPORT double PeakGmacs(int bf16) {
    return guarded("PeakGmacs", -1.0, [bf16](State &) {
        use_threads();
        return peak_gmacs(bf16 ? dt::bf16 : dt::f32);
    });
}
}
