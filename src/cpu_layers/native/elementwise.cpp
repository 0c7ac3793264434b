// Element-wise kernels: the reorders between the layouts, the sum of two gradients (both through
// oneDNN), the fork of a tensor into two copies and the finiteness checks of the gradients.
#include "core.hpp"

namespace resnet_conv {

namespace {

// A reorder between the two layouts (and the types of the two tensors).
std::unique_ptr<Plan> reorder_plan(Kind kind, const memory::dims &x, dt x_type, dt y_type) {
    auto from = activation(x, x_type, kind == kToPlain), to = activation(x, y_type, kind == kToBlocked);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::reorder(memory(from, state().engine), memory(to, state().engine));
    plan->operands = {operand(DNNL_ARG_FROM, reorder_slots::x, false, from, from),
                      operand(DNNL_ARG_TO, reorder_slots::y, true, to, to)};
    return plan;
}

// The element-wise sum of two tensors of one shape, type and layout (the gradient of a tensor two
// layers read; bfloat16 sums are computed in float32, rounded once).
std::unique_ptr<Plan> sum_plan(int64_t count, dt type) {
    auto elements = flat(count, type);
    auto attr = user_scratchpad();
    auto sum = dnnl::sum::primitive_desc(state().engine, elements, {1.f, 1.f}, {elements, elements}, attr);
    return primitive_plan<dnnl::sum>(sum, {operand(DNNL_ARG_MULTIPLE_SRC, sum_slots::a, false, elements, elements),
                                           operand(DNNL_ARG_MULTIPLE_SRC + 1, sum_slots::b, false, elements, elements),
                                           operand(DNNL_ARG_DST, sum_slots::y, true, elements, elements)});
}

// The reorders' and the sum's part of call_kernel (core.cpp).
std::unique_ptr<Plan> make_elementwise_plan(const KernelCall &call, int64_t) {
    if (call.kind == kSum) return sum_plan(call.elements(0), data_type(call.dtypes[0]));
    return reorder_plan(call.kind, dims_of(call.shapes[0], 4), data_type(call.dtypes[0]), data_type(call.dtypes[1]));
}

}  // namespace

const Family kElementwiseFamily = {nullptr, make_elementwise_plan, nullptr, nullptr, nullptr};

// The kernels below do not use oneDNN but share its threads, its lock and the error message
// (call_kernel, after the kernel table's checks); each returns why it refused its arguments, or "".

// Two copies of one float32 or bfloat16 tensor: a tensor two layers read, each from its own copy, so
// that MindSpore need not sum the two gradients (its CPU sum of gradients, AddN, has no bfloat16
// kernel); Sum is the backward.
std::string fork_copies(const KernelCall &call) {
    const char **dtypes = call.dtypes;
    if (std::strcmp(dtypes[fork_slots::x], dtypes[fork_slots::a]) != 0 ||
        std::strcmp(dtypes[fork_slots::x], dtypes[fork_slots::b]) != 0)
        return "takes one float32 or bfloat16 tensor and returns two of its type";
    const int64_t bytes = call.elements(fork_slots::x) * element_size(dtypes[fork_slots::x]);
    const char *x = static_cast<const char *>(call.params[fork_slots::x]);
    char *a = static_cast<char *>(call.params[fork_slots::a]), *b = static_cast<char *>(call.params[fork_slots::b]);
    constexpr int64_t chunk = 1 << 16;
    const int64_t chunks = (bytes + chunk - 1) / chunk;
#pragma omp parallel for if (chunks > 4)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = c * chunk, size = std::min(chunk, bytes - begin);
        std::memcpy(a + begin, x + begin, size);
        std::memcpy(b + begin, x + begin, size);
    }
    return "";
}

namespace {

// Whether any of `count` float32 values, value(j) the j-th (which may also store it where it
// belongs), is Inf or NaN: one pass, on every thread where there are many. Each thread reads its own
// copy of `value` (firstprivate): through the shared one GCC could not tell its captures from what
// value(j) stores, and left the loop unvectorized at half the speed.
template <typename Value>
bool any_inf_or_nan(int64_t count, Value value) {
    int bad = 0;
#pragma omp parallel for simd reduction(| : bad) firstprivate(value) if (count > (1 << 16))
    for (int64_t j = 0; j < count; ++j) {
        const float v = value(j);
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof(bits));
        bad |= inf_or_nan(bits);
    }
    return bad != 0;
}

}  // namespace

// 1.0 when every element of every float32 input is finite, else 0.0 (the last argument, one float):
// the training step's check of its gradients as one multi-threaded pass, where MindSpore's CPU
// kernels take a reduction per tensor.
std::string all_finite(const KernelCall &call) {
    const int n = call.nparam - 1;
    if (call.elements(n) != 1) return "takes float32 tensors and returns one float32 value";
    bool finite = true;
    for (int i = 0; i < n && finite; ++i) {
        const float *values = static_cast<const float *>(call.params[i]);
        finite = !any_inf_or_nan(call.elements(i), [values](int64_t j) { return values[j]; });
    }
    *static_cast<float *>(call.params[n]) = finite ? 1.f : 0.f;
    return "";
}

// The loss scale divided out of every gradient and the finiteness check in one multi-threaded
// pass: inputs the factor (float32 [1], 1 / scale) and n float32 gradients; outputs the n gradients
// times the factor, then 1.0 when every product is finite, else 0.0. MindSpore's CPU Mul took
// ~100 ms of a ResNet50 step for the 161 products alone (a scalar broadcast, one thread).
std::string unscale_all_finite(const KernelCall &call) {
    const int n = (call.nparam - 2) / 2;
    bool ok = call.elements(0) == 1;
    for (int i = 0; ok && i < n; ++i) ok = call.elements(1 + i) == call.elements(1 + n + i);
    if (!ok) return "takes a float32 factor and n float32 gradients, returns the n products and one value";
    const float factor = *static_cast<const float *>(call.params[0]);
    bool bad = false;
    for (int i = 0; i < n; ++i) {
        const float *gradient = static_cast<const float *>(call.params[1 + i]);
        float *scaled = static_cast<float *>(call.params[1 + n + i]);
        bad |= any_inf_or_nan(call.elements(1 + i), [gradient, scaled, factor](int64_t j) {
            return scaled[j] = gradient[j] * factor;
        });
    }
    *static_cast<float *>(call.params[call.nparam - 1]) = bad ? 0.f : 1.f;
    return "";
}

}  // namespace resnet_conv
