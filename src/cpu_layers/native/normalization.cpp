// Batch normalization through oneDNN (with the ReLU or the residual addition after it), and the
// library's own loops around it: the forked forward's addition and ReLU written twice, the summed
// backward's masked sum, the stand-in residual's zero gradient and the moving statistics.
#include "core.hpp"

#include <immintrin.h>  // SSE2's streaming stores (this library is built for x86_64 only)

namespace resnet_conv {

namespace {

// What both directions' plans are made of: the tensors' descriptions and the forward's, which the
// backward is made from.
struct NormDescs {
    memory::desc data;      // x, y and their gradients, blocked
    memory::desc elements;  // the same, as one flat run (the residual addition and its ReLU)
    memory::desc channel;   // a value per channel (scale, shift, statistics)
    dnnl::normalization_flags flags;
    dnnl::primitive_attr attr;
    dnnl::batch_normalization_forward::primitive_desc forward;

    Operand workspace(int slot) const {
        const auto desc = forward.workspace_desc();
        return operand(DNNL_ARG_WORKSPACE, slot, false, desc, desc);
    }
};

NormDescs norm_descs(const memory::dims &x_dims, const NormParams &p, int64_t workspace_bytes, dt type) {
    const bool relu = activation_is(p, Activation::kRelu);
    auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    if (p.global_stats != 0.f) flags = flags | dnnl::normalization_flags::use_global_stats;
    if (relu) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
    NormDescs n{activation(x_dims, type, true), flat(element_count(4, x_dims.data()), type),
                memory::desc({x_dims[1]}, dt::f32, tag::a), flags, user_scratchpad(), {}};
    n.forward = dnnl::batch_normalization_forward::primitive_desc(
        state().engine, dnnl::prop_kind::forward_training, n.data, n.data, p.epsilon, flags, n.attr);
    const auto wanted = relu ? n.forward.workspace_desc().get_size() : 0;
    if (wanted > static_cast<size_t>(workspace_bytes))
        throw std::runtime_error("the normalization's workspace needs " + std::to_string(wanted) + " bytes, " +
                                 "it was given " + std::to_string(workspace_bytes));
    return n;
}

// y = max(y + residual, 0), in place, after NormForward (forked: add_relu_twice instead).
std::unique_ptr<Plan> residual_addition(const NormDescs &n) {
    dnnl::post_ops relu_after;
    relu_after.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    auto add_attr = user_scratchpad();
    add_attr.set_post_ops(relu_after);
    auto addition = dnnl::binary::primitive_desc(state().engine, dnnl::algorithm::binary_add, n.elements, n.elements,
                                                 n.elements, add_attr);
    using namespace norm_forward;
    return primitive_plan<dnnl::binary>(addition, {operand(DNNL_ARG_SRC_0, y, false, n.elements, n.elements),
                                                   operand(DNNL_ARG_SRC_1, residual, false, n.elements, n.elements),
                                                   operand(DNNL_ARG_DST, y, true, n.elements, n.elements)});
}

// dresidual = dy where the output passed the ReLU, else 0, before NormBackward (summed: masked_sum instead).
std::unique_ptr<Plan> relu_mask(const NormDescs &n) {
    auto &engine = state().engine;
    const auto algorithm = dnnl::algorithm::eltwise_relu_use_dst_for_bwd;
    auto relu_forward = dnnl::eltwise_forward::primitive_desc(engine, dnnl::prop_kind::forward_training, algorithm,
                                                              n.elements, n.elements, 0.f, 0.f);
    auto mask = dnnl::eltwise_backward::primitive_desc(engine, algorithm, n.elements, n.elements, n.elements, 0.f, 0.f,
                                                       relu_forward, n.attr);
    using namespace norm_backward;
    return primitive_plan<dnnl::eltwise_backward>(
        mask, {operand(DNNL_ARG_DST, y, false, n.elements, n.elements),
               operand(DNNL_ARG_DIFF_DST, dy, false, n.elements, n.elements),
               operand(DNNL_ARG_DIFF_SRC, dresidual, true, n.elements, n.elements)});
}

std::unique_ptr<Plan> norm_forward_plan(Kind kind, const NormDescs &n, const NormParams &p) {
    const bool given = p.global_stats != 0.f;
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::batch_normalization_forward(n.forward);
    using namespace norm_forward;
    plan->operands = {operand(DNNL_ARG_SRC, x, false, n.data, n.forward.src_desc()),
                      operand(DNNL_ARG_SCALE, gamma, false, n.channel, n.channel),
                      operand(DNNL_ARG_SHIFT, beta, false, n.channel, n.channel),
                      operand(DNNL_ARG_MEAN, given ? mean : batch_mean, !given, n.channel, n.channel),
                      operand(DNNL_ARG_VARIANCE, given ? variance : batch_variance, !given, n.channel, n.channel),
                      operand(DNNL_ARG_DST, y, true, n.data, n.forward.dst_desc())};
    if (activation_is(p, Activation::kRelu)) plan->operands.push_back(n.workspace(norm_forward::workspace));
    own_scratchpad(*plan, n.forward);
    if (activation_is(p, Activation::kAddRelu) && kind == kNormForward) plan->postlude = residual_addition(n);
    return plan;
}

std::unique_ptr<Plan> norm_backward_plan(Kind kind, const NormDescs &n, const NormParams &p) {
    const bool add = activation_is(p, Activation::kAddRelu);
    auto backward = dnnl::batch_normalization_backward::primitive_desc(
        state().engine, dnnl::prop_kind::backward, n.data, n.data, n.data, p.epsilon, n.flags, n.forward, n.attr);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::batch_normalization_backward(backward);
    using namespace norm_backward;
    plan->operands = {operand(DNNL_ARG_SRC, x, false, n.data, backward.src_desc()),
                      // with the residual: dy masked by the output, written by the prelude
                      operand(DNNL_ARG_DIFF_DST, add ? dresidual : dy, false, n.data, backward.diff_dst_desc()),
                      operand(DNNL_ARG_MEAN, mean, false, n.channel, n.channel),
                      operand(DNNL_ARG_VARIANCE, variance, false, n.channel, n.channel),
                      operand(DNNL_ARG_SCALE, gamma, false, n.channel, n.channel),
                      operand(DNNL_ARG_DIFF_SRC, dx, true, n.data, backward.diff_src_desc()),
                      operand(DNNL_ARG_DIFF_SCALE, dgamma, true, n.channel, n.channel),
                      operand(DNNL_ARG_DIFF_SHIFT, dbeta, true, n.channel, n.channel)};
    if (activation_is(p, Activation::kRelu)) plan->operands.push_back(n.workspace(norm_backward::workspace));
    own_scratchpad(*plan, backward);
    if (add && kind == kNormBackward) plan->prelude = relu_mask(n);
    return plan;
}

// Batch normalization on blocked tensors, per channel: scale (gamma) and shift (beta), slots as
// NORM_FORWARD_SLOTS and NORM_BACKWARD_SLOTS say. The batch variance is the biased one oneDNN
// normalizes with; with global_stats the given statistics are used and are not written out. The
// workspace is the uint8 tensor the Python op gives it, one byte per element of x: more than oneDNN
// asks (a bit each), checked here.
std::unique_ptr<Plan> norm_plan(Kind kind, const memory::dims &x_dims, const NormParams &p, int64_t workspace_bytes,
                                dt type) {
    const NormDescs n = norm_descs(x_dims, p, workspace_bytes, type);
    return is_norm_forward(kind) ? norm_forward_plan(kind, n, p) : norm_backward_plan(kind, n, p);
}

// Without the residual addition the normalization's backward writes zeros as the gradient of the
// residual's stand-in (with it, the plan's prelude writes dresidual).
void zero_stand_in_gradient(void **slots, const int64_t *shape, int ndims, const char *dtype) {
    Timed timed(kZeroedGradients);
    std::memset(slots[norm_backward::dresidual], 0, element_count(ndims, shape) * element_size(dtype));
}

// The two loops below select with bit masks, not branches: a branch on the sign of each element
// mispredicted on every other one and ran at a tenth of the memory's speed (this build's -O2 does
// not if-convert them).
inline float kept_if(float value, bool keep) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    bits &= 0u - static_cast<uint32_t>(keep);
    std::memcpy(&value, &bits, sizeof(bits));
    return value;
}

// A forked normalization's residual addition and ReLU: y = y_copy = max(y + residual, 0), the float
// operations of oneDNN's binary addition with its ReLU after (NormForward's postlude), written twice.
void add_relu_twice(void **slots, int64_t count) {
    Timed timed(kResidualRelu);
    float *__restrict y = static_cast<float *>(slots[norm_forward::y]);
    float *__restrict copy = static_cast<float *>(slots[norm_forward_forked::y_copy]);
    const float *__restrict residual = static_cast<const float *>(slots[norm_forward::residual]);
    // The copy is read by the next block's shortcut, long after: streamed past the caches, which
    // also spares reading its lines before writing them (a third less memory traffic than stores).
    constexpr int64_t chunk = 1 << 14;
    const int64_t chunks = (count + chunk - 1) / chunk;
    auto one = [&](int64_t i) {
        const float sum = y[i] + residual[i];
        y[i] = copy[i] = kept_if(sum, sum > 0.f);
    };
#pragma omp parallel for if (count > kOneThreadElements)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min(count, (c + 1) * chunk);
        int64_t i = c * chunk;
        for (; i < end && reinterpret_cast<uintptr_t>(copy + i) % 16 != 0; ++i) one(i);
        const __m128 zero = _mm_setzero_ps();
        for (; i + 4 <= end; i += 4) {
            const __m128 sum = _mm_add_ps(_mm_loadu_ps(y + i), _mm_loadu_ps(residual + i));
            const __m128 out = _mm_and_ps(sum, _mm_cmpgt_ps(sum, zero));  // kept_if's select, four at a time
            _mm_storeu_ps(y + i, out);
            _mm_stream_ps(copy + i, out);
        }
        for (; i < end; ++i) one(i);
        _mm_sfence();  // this thread's streamed stores are visible before the kernel returns
    }
}

// A summed normalization's first step: dresidual = dy + dy_copy where the output passed the ReLU,
// else 0 (the sum AddN would take, then NormBackward's prelude), in one pass.
void masked_sum(void **slots, int64_t count) {
    Timed timed(kGradientSums);
    const float *__restrict y = static_cast<const float *>(slots[norm_backward::y]);
    const float *__restrict dy = static_cast<const float *>(slots[norm_backward::dy]);
    const float *__restrict dy_copy = static_cast<const float *>(slots[norm_backward_summed::dy_copy]);
    float *__restrict dresidual = static_cast<float *>(slots[norm_backward::dresidual]);
#pragma omp parallel for simd if (count > kOneThreadElements)
    for (int64_t i = 0; i < count; ++i) {
        const float sum = dy[i] + dy_copy[i];
        dresidual[i] = kept_if(sum, y[i] > 0.f);
    }
}

// The forward's in-place update of the moving statistics from the batch's (see NORM_PARAMS).
void move_statistics(void **slots, const int64_t *x, const NormParams &p) {
    if (p.global_stats != 0.f || p.momentum <= 0.f) return;
    const int64_t channels = x[1], count = x[0] * x[2] * x[3];
    const float unbias = static_cast<float>(count) / static_cast<float>(std::max<int64_t>(count - 1, 1));
    auto *moving_mean = static_cast<float *>(slots[norm_forward::mean]),
         *moving_variance = static_cast<float *>(slots[norm_forward::variance]);
    const auto *mean = static_cast<const float *>(slots[norm_forward::batch_mean]),
               *variance = static_cast<const float *>(slots[norm_forward::batch_variance]);
    for (int64_t c = 0; c < channels; ++c) {
        moving_mean[c] = moving_mean[c] * (1.f - p.momentum) + mean[c] * p.momentum;
        moving_variance[c] = moving_variance[c] * (1.f - p.momentum) + variance[c] * unbias * p.momentum;
    }
}

// The normalizations' part of call_kernel (core.cpp).
std::string norm_record_problem(const KernelCall &call) {
    const auto &p = *static_cast<const NormParams *>(call.record);
    const Kind kind = call.kind;
    if (!activation_is(p, Activation::kNone) && !activation_is(p, Activation::kRelu) &&
        !activation_is(p, Activation::kAddRelu))
        return "the normalization's activation " + std::to_string(p.activation) + " is not 0, 1 or 2";
    if ((kind == kNormForwardForked || kind == kNormBackwardSummed) &&
        (!activation_is(p, Activation::kAddRelu) || std::strcmp(call.dtypes[0], "float32") != 0))
        return "a forked normalization ends a block (activation 2, add_relu) on float32 tensors";
    const int residual = is_norm_forward(kind) ? int(norm_forward::residual) : int(norm_backward::residual);
    if (activation_is(p, Activation::kAddRelu) &&
        (call.elements(residual) != element_count(4, call.shapes[0]) ||
         std::strcmp(call.dtypes[residual], call.dtypes[0]) != 0))
        return "the residual added after the normalization is not of its input's shape and type";
    return "";
}

std::unique_ptr<Plan> make_norm_plan(const KernelCall &call, int64_t workspace_bytes) {
    NormParams p;
    std::memcpy(&p, call.record, sizeof(p));
    return norm_plan(call.kind, dims_of(call.shapes[0], 4), p, workspace_bytes, data_type(call.dtypes[0]));
}

void before_norm(const KernelCall &call) {
    const auto &p = *static_cast<const NormParams *>(call.record);
    if (call.kind == kNormBackward && !activation_is(p, Activation::kAddRelu))
        zero_stand_in_gradient(call.params, call.shapes[norm_backward::residual], call.ndims[norm_backward::residual],
                               call.dtypes[norm_backward::residual]);
    if (call.kind == kNormBackwardSummed) masked_sum(call.params, element_count(4, call.shapes[0]));
}

void after_norm(const KernelCall &call) {
    if (call.kind == kNormForwardForked) add_relu_twice(call.params, element_count(4, call.shapes[0]));
    if (is_norm_forward(call.kind))
        move_statistics(call.params, call.shapes[0], *static_cast<const NormParams *>(call.record));
}

}  // namespace

const Family kNormalizationFamily = {norm_record_problem, make_norm_plan, nullptr, before_norm, after_norm};

}  // namespace resnet_conv
