// ResNet's layers for MindSpore's CPU backend through a private oneDNN, as `ops.Custom(func_type="aot")`
// kernels on float32 or bfloat16 tensors: convolution (forward, backward-data, backward-weights), batch
// normalization with the ReLU or residual addition after it (forward, backward), max pooling
// (forward, backward), the reorders between MindSpore's NCHW and oneDNN's blocked layout, two copies
// of a tensor two layers read (and the sum of their gradients), and the training step's pass over
// its gradients (the loss scale divided out, the finiteness check).
//
// MindSpore's own CPU convolutions hand oneDNN plain NCHW descriptors, so oneDNN never picks its
// blocked layouts (and, above AVX2, falls into a reference kernel). Here convolution primitives are
// created with `format_tag::any`, so oneDNN chooses. A tensor MindSpore holds as [N, C, H, W] may be
// in one of two layouts, said by the kernel's parameters: plain NCHW, or "blocked": the layout
// oneDNN's convolutions choose for the tensor's type, nChw16c for float32 (exactly N*C*H*W floats
// when C is a multiple of 16) and NHWC for bfloat16 (AMX). Between the layers of a network whose
// every layer runs here the tensors stay blocked (the normalizations apply the ReLUs and residual
// additions; sums of gradients are element-wise), so no reorder is needed; where a kernel meets
// another layout or type, it reorders through a buffer of its plan. Each primitive is created once
// per shape and types, and cached.
//
// The library links against oneDNN 3.2 under a renamed SONAME (libdnnl_resnet.so.3, see build.sh):
// MindSpore's own libdnnl.so.3 is already in the process and would otherwise be bound instead.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

// The int32 parameter tensor of the convolution kernels (written by cells.py).
struct ConvParams {
    int32_t stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, dilation_h, dilation_w, groups, bf16;
    int32_t layout;  // bit 0: the input (x, dx) is blocked; bit 1: the output (y, dy) is blocked
};
constexpr int kConvParams = 11;

// The float32 parameter tensor of the batch-normalization kernels.
struct NormParams {
    float epsilon, global_stats;  // global_stats 1: normalize with the given (moving) statistics
    // With batch statistics and momentum > 0, the forward moves the given statistics (slots 3 and 4)
    // in place: moving = (1 - momentum) * moving + momentum * batch (the variance unbiased), as
    // MindSpore's BatchNorm does. The Python op declares those inputs written (RW_WRITE).
    float momentum;
    // What follows the normalization in the same kernel: a ResNet block's ReLU (oneDNN's
    // fuse_norm_relu: the forward writes a workspace of which elements passed, the backward reads
    // it), or its residual addition and ReLU (oneDNN 3.2's CPU normalizations do not fuse the
    // addition: oneDNN's binary addition with a ReLU after the forward, and its ReLU backward on the
    // output before the backward, which masks dy and is the residual's gradient).
    float activation;  // 0: none, 1: ReLU, 2: add the residual, then ReLU
};

// The normalization kernels' argument slots, the same whatever the activation: MindSpore compiles
// every forward of a graph (a Custom op declaring inputs written) as the first one it meets, so
// one op with one signature serves them all and the params say what to compute.
// Forward in: x, gamma, beta, mean, variance, params, residual (read by add_relu alone; otherwise
// any small tensor); out: y, batch mean, batch variance, workspace (uint8, a byte per element of x;
// written by ReLU alone).
// Backward in: x, dy, mean, variance, gamma, params, workspace, y, residual (for its shape); out:
// dx, dgamma, dbeta, dresidual (dy masked by the ReLU for add_relu; otherwise zeros).
namespace norm {
constexpr int kResidual = 6, kY = 7, kMean = 8, kVariance = 9, kWorkspace = 10;
constexpr int kBackWorkspace = 6, kBackY = 7, kBackResidual = 8, kDx = 9, kDgamma = 10, kDbeta = 11, kDresidual = 12;
}  // namespace norm

// The int32 parameter tensor of the max-pooling kernels.
struct PoolParams {
    int32_t kernel, stride, pad;
};

enum Kind {
    kConvForward, kConvBackwardData, kConvBackwardWeights, kNormForward, kNormBackward, kPoolForward,
    kPoolBackward, kToPlain, kToBlocked, kSum
};

// One tensor argument of a primitive: the memory MindSpore owns (`slot` indexes the kernel's
// arguments), and the layout the primitive wants; when they differ, a reorder through a buffer.
struct Operand {
    int arg;
    int slot;
    bool output;
    memory user;
    memory inner;
    bool reorders;
    dnnl::reorder reorder;  // user -> inner for inputs, inner -> user for outputs
};

struct Plan {
    dnnl::primitive primitive;
    std::vector<Operand> operands;
    std::unordered_map<int, memory> owned;  // scratchpad, workspace, outputs nobody reads
    std::unique_ptr<Plan> prelude;          // run first (max pooling's backward: its forward, for the workspace)
    std::unique_ptr<Plan> postlude;         // run last (the residual addition after a normalization)
};

struct State {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    std::map<std::string, std::unique_ptr<Plan>> plans;
    std::mutex lock;  // one kernel at a time: each already uses every thread
};

int g_threads = 0;
std::string g_error;

State &state() {
    static State *instance = [] {
        // MindSpore's copy may be capped at AVX2 (src/device.py) because of its NCHW-only path; this
        // copy chooses its layouts and should use every instruction the CPU has.
        dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_amx_fp16);
        return new State();
    }();
    return *instance;
}

memory::dims dims_of(const int64_t *shape, int n) { return memory::dims(shape, shape + n); }

int64_t element_count(int ndims, const int64_t *shape) {
    int64_t count = 1;
    for (int d = 0; d < ndims; ++d) count *= shape[d];
    return count;
}

// Inf or NaN, from a float32's bits: the exponent all ones.
bool inf_or_nan(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

dt data_type(const char *name) { return std::strcmp(name, "bfloat16") == 0 ? dt::bf16 : dt::f32; }

// Bytes per element of a float32 or bfloat16 tensor.
int64_t element_size(const char *name) { return data_type(name) == dt::bf16 ? 2 : 4; }

// An activation as a kernel's parameters say it is laid out (see the header).
memory::desc activation(const memory::dims &shape, dt type, bool blocked) {
    return memory::desc(shape, type, !blocked ? tag::nchw : type == dt::bf16 ? tag::acdb : tag::aBcd16b);
}

// The same elements seen as one flat run, for element-wise primitives over tensors of one layout.
memory::desc flat(int64_t count, dt type) { return memory::desc({count}, type, tag::a); }

Operand operand(int arg, int slot, bool output, const memory::desc &user_desc, const memory::desc &wanted) {
    auto &engine = state().engine;
    Operand result{arg, slot, output, memory(user_desc, engine, DNNL_MEMORY_NONE), memory(), false, {}};
    result.reorders = wanted != user_desc;
    result.inner = result.reorders ? memory(wanted, engine) : result.user;
    if (result.reorders)
        result.reorder = output ? dnnl::reorder(result.inner, result.user) : dnnl::reorder(result.user, result.inner);
    return result;
}

template <typename PrimitiveDesc>
void own_scratchpad(Plan &plan, const PrimitiveDesc &pd) {
    plan.owned[DNNL_ARG_SCRATCHPAD] = memory(pd.scratchpad_desc(), state().engine);
}

dnnl::primitive_attr user_scratchpad() {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return attr;
}

// The weights as oneDNN sees them: OIHW, or GOIHW over the same buffer for grouped convolutions.
memory::desc weights_desc(const memory::dims &w, int groups, dt type, tag format) {
    if (groups == 1) return memory::desc(w, type, format);
    memory::dims grouped{groups, w[0] / groups, w[1], w[2], w[3]};
    return memory::desc(grouped, type, format == tag::any ? tag::any : tag::goihw);
}

// pad_mode 'same' (pad_top < 0): the output is ceil(input / stride) and the padding depends on the
// input's size; as MindSpore and TensorFlow do, an odd total puts the extra row/column after.
void same_padding(ConvParams &p, const memory::dims &x, const memory::dims &w) {
    auto split = [](int64_t size, int stride, int64_t kernel, int dilation, int32_t &before, int32_t &after) {
        int64_t out = (size + stride - 1) / stride;
        int64_t total = std::max<int64_t>((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0);
        before = static_cast<int32_t>(total / 2);
        after = static_cast<int32_t>(total - total / 2);
    };
    split(x[2], p.stride_h, w[2], p.dilation_h, p.pad_top, p.pad_bottom);
    split(x[3], p.stride_w, w[3], p.dilation_w, p.pad_left, p.pad_right);
}

// Convolution slots: forward x=0, w=1, y=3; backward-data dy=0, w=1, dx=4 (slot 3: x, shape only);
// backward-weights x=0, dy=1, dw=4 (slot 3: w, shape only). Slot 2 holds the parameters.
std::unique_ptr<Plan> conv_plan(Kind kind, const memory::dims &x, const memory::dims &w, const memory::dims &y,
                                const ConvParams &p, dt x_type, dt y_type) {
    auto &engine = state().engine;
    memory::dims strides{p.stride_h, p.stride_w};
    memory::dims dilation{p.dilation_h - 1, p.dilation_w - 1};
    memory::dims pad_l{p.pad_top, p.pad_left};
    memory::dims pad_r{p.pad_bottom, p.pad_right};
    const dt compute = p.bf16 ? dt::bf16 : dt::f32;
    auto x_any = memory::desc(x, compute, tag::any);
    auto y_any = memory::desc(y, compute, tag::any);
    auto w_any = weights_desc(w, p.groups, compute, tag::any);
    auto x_user = activation(x, x_type, p.layout & 1);
    auto y_user = activation(y, y_type, p.layout & 2);
    auto w_user = weights_desc(w, p.groups, dt::f32, tag::oihw);
    auto attr = user_scratchpad();
    auto forward = dnnl::convolution_forward::primitive_desc(
        engine, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_any, w_any, y_any,
        strides, dilation, pad_l, pad_r, attr);
    auto plan = std::make_unique<Plan>();
    if (kind == kConvForward) {
        plan->primitive = dnnl::convolution_forward(forward);
        plan->operands = {operand(DNNL_ARG_SRC, 0, false, x_user, forward.src_desc()),
                          operand(DNNL_ARG_WEIGHTS, 1, false, w_user, forward.weights_desc()),
                          operand(DNNL_ARG_DST, 3, true, y_user, forward.dst_desc())};
        own_scratchpad(*plan, forward);
    } else if (kind == kConvBackwardData) {
        auto backward = dnnl::convolution_backward_data::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, w_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_data(backward);
        plan->operands = {operand(DNNL_ARG_DIFF_DST, 0, false, y_user, backward.diff_dst_desc()),
                          operand(DNNL_ARG_WEIGHTS, 1, false, w_user, backward.weights_desc()),
                          operand(DNNL_ARG_DIFF_SRC, 4, true, x_user, backward.diff_src_desc())};
        own_scratchpad(*plan, backward);
    } else {
        // bf16 weight gradients are accumulated in f32 (the master weights' type).
        auto dw_any = weights_desc(w, p.groups, dt::f32, tag::any);
        auto backward = dnnl::convolution_backward_weights::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, dw_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_weights(backward);
        plan->operands = {operand(DNNL_ARG_SRC, 0, false, x_user, backward.src_desc()),
                          operand(DNNL_ARG_DIFF_DST, 1, false, y_user, backward.diff_dst_desc()),
                          operand(DNNL_ARG_DIFF_WEIGHTS, 4, true, w_user, backward.diff_weights_desc())};
        own_scratchpad(*plan, backward);
    }
    return plan;
}

// Batch normalization on blocked tensors, per channel: scale (gamma) and shift (beta), slots as
// namespace norm says. The batch variance is the biased one oneDNN normalizes with; with global_stats
// the given statistics are used and are not written out. The workspace is the uint8 tensor the
// Python op gives it, one byte per element of x: more than oneDNN asks (a bit each), checked here.
std::unique_ptr<Plan> norm_plan(Kind kind, const memory::dims &x, const NormParams &p, int64_t workspace_bytes,
                                dt type) {
    auto &engine = state().engine;
    const bool relu = p.activation == 1.f, add = p.activation == 2.f;
    auto data = activation(x, type, true);
    auto elements = flat(element_count(4, x.data()), type);
    auto channel = memory::desc({x[1]}, dt::f32, tag::a);
    auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    if (p.global_stats != 0.f) flags = flags | dnnl::normalization_flags::use_global_stats;
    if (relu) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
    auto attr = user_scratchpad();
    auto forward = dnnl::batch_normalization_forward::primitive_desc(
        engine, dnnl::prop_kind::forward_training, data, data, p.epsilon, flags, attr);
    auto plan = std::make_unique<Plan>();
    if (relu) {
        const auto wanted = forward.workspace_desc().get_size();
        if (wanted > static_cast<size_t>(workspace_bytes))
            throw std::runtime_error("the normalization's workspace needs " + std::to_string(wanted) + " bytes, " +
                                     "it was given " + std::to_string(workspace_bytes));
    }
    auto workspace = [&](int slot) {
        auto desc = forward.workspace_desc();
        return operand(DNNL_ARG_WORKSPACE, slot, false, desc, desc);
    };
    if (kind == kNormForward) {
        plan->primitive = dnnl::batch_normalization_forward(forward);
        const bool given = p.global_stats != 0.f;
        plan->operands = {operand(DNNL_ARG_SRC, 0, false, data, forward.src_desc()),
                          operand(DNNL_ARG_SCALE, 1, false, channel, channel),
                          operand(DNNL_ARG_SHIFT, 2, false, channel, channel),
                          operand(DNNL_ARG_MEAN, given ? 3 : norm::kMean, !given, channel, channel),
                          operand(DNNL_ARG_VARIANCE, given ? 4 : norm::kVariance, !given, channel, channel),
                          operand(DNNL_ARG_DST, norm::kY, true, data, forward.dst_desc())};
        if (relu) plan->operands.push_back(workspace(norm::kWorkspace));
        own_scratchpad(*plan, forward);
        if (add) {  // y = max(y + residual, 0), in place
            dnnl::post_ops relu_after;
            relu_after.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
            auto add_attr = user_scratchpad();
            add_attr.set_post_ops(relu_after);
            auto addition = dnnl::binary::primitive_desc(engine, dnnl::algorithm::binary_add, elements, elements,
                                                         elements, add_attr);
            plan->postlude = std::make_unique<Plan>();
            plan->postlude->primitive = dnnl::binary(addition);
            plan->postlude->operands = {operand(DNNL_ARG_SRC_0, norm::kY, false, elements, elements),
                                        operand(DNNL_ARG_SRC_1, norm::kResidual, false, elements, elements),
                                        operand(DNNL_ARG_DST, norm::kY, true, elements, elements)};
            own_scratchpad(*plan->postlude, addition);
        }
    } else {
        auto backward = dnnl::batch_normalization_backward::primitive_desc(
            engine, dnnl::prop_kind::backward, data, data, data, p.epsilon, flags, forward, attr);
        plan->primitive = dnnl::batch_normalization_backward(backward);
        plan->operands = {operand(DNNL_ARG_SRC, 0, false, data, backward.src_desc()),
                          // with the residual: dy masked by the output, written by the prelude
                          operand(DNNL_ARG_DIFF_DST, add ? norm::kDresidual : 1, false, data,
                                  backward.diff_dst_desc()),
                          operand(DNNL_ARG_MEAN, 2, false, channel, channel),
                          operand(DNNL_ARG_VARIANCE, 3, false, channel, channel),
                          operand(DNNL_ARG_SCALE, 4, false, channel, channel),
                          operand(DNNL_ARG_DIFF_SRC, norm::kDx, true, data, backward.diff_src_desc()),
                          operand(DNNL_ARG_DIFF_SCALE, norm::kDgamma, true, channel, channel),
                          operand(DNNL_ARG_DIFF_SHIFT, norm::kDbeta, true, channel, channel)};
        if (relu) plan->operands.push_back(workspace(norm::kBackWorkspace));
        own_scratchpad(*plan, backward);
        if (add) {  // first dresidual = dy where the output passed the ReLU, else 0
            const auto algorithm = dnnl::algorithm::eltwise_relu_use_dst_for_bwd;
            auto relu_forward = dnnl::eltwise_forward::primitive_desc(engine, dnnl::prop_kind::forward_training,
                                                                      algorithm, elements, elements, 0.f, 0.f);
            auto mask = dnnl::eltwise_backward::primitive_desc(engine, algorithm, elements, elements, elements, 0.f,
                                                               0.f, relu_forward, attr);
            plan->prelude = std::make_unique<Plan>();
            plan->prelude->primitive = dnnl::eltwise_backward(mask);
            plan->prelude->operands = {operand(DNNL_ARG_DST, norm::kBackY, false, elements, elements),
                                       operand(DNNL_ARG_DIFF_DST, 1, false, elements, elements),
                                       operand(DNNL_ARG_DIFF_SRC, norm::kDresidual, true, elements, elements)};
            own_scratchpad(*plan->prelude, mask);
        }
    }
    return plan;
}

// Max pooling on blocked tensors; the padding never wins a window (PyTorch's -inf padding).
// Forward slots: x=0, params=1, y=2. Backward slots: x=0, dy=1, params=2, dx=3; the backward runs
// the forward first for the positions of the maxima (oneDNN's workspace).
std::unique_ptr<Plan> pool_plan(Kind kind, const memory::dims &x, const memory::dims &y, const PoolParams &p,
                                dt type) {
    auto &engine = state().engine;
    auto in = activation(x, type, true);
    auto out = activation(y, type, true);
    memory::dims kernel{p.kernel, p.kernel}, strides{p.stride, p.stride}, pad{p.pad, p.pad}, dilation{0, 0};
    auto attr = user_scratchpad();
    auto forward = dnnl::pooling_forward::primitive_desc(engine, dnnl::prop_kind::forward_training,
                                                         dnnl::algorithm::pooling_max, in, out, strides, kernel,
                                                         dilation, pad, pad, attr);
    auto plan = std::make_unique<Plan>();
    if (kind == kPoolForward) {
        plan->primitive = dnnl::pooling_forward(forward);
        plan->operands = {operand(DNNL_ARG_SRC, 0, false, in, forward.src_desc()),
                          operand(DNNL_ARG_DST, 2, true, out, forward.dst_desc())};
        plan->owned[DNNL_ARG_WORKSPACE] = memory(forward.workspace_desc(), engine);
        own_scratchpad(*plan, forward);
        return plan;
    }
    auto workspace = memory(forward.workspace_desc(), engine);
    plan->prelude = std::make_unique<Plan>();
    plan->prelude->primitive = dnnl::pooling_forward(forward);
    plan->prelude->operands = {operand(DNNL_ARG_SRC, 0, false, in, forward.src_desc())};
    plan->prelude->owned[DNNL_ARG_DST] = memory(forward.dst_desc(), engine);
    plan->prelude->owned[DNNL_ARG_WORKSPACE] = workspace;
    own_scratchpad(*plan->prelude, forward);
    auto backward = dnnl::pooling_backward::primitive_desc(engine, dnnl::algorithm::pooling_max, in, out, strides,
                                                           kernel, dilation, pad, pad, forward, attr);
    plan->primitive = dnnl::pooling_backward(backward);
    plan->operands = {operand(DNNL_ARG_DIFF_DST, 1, false, out, backward.diff_dst_desc()),
                      operand(DNNL_ARG_DIFF_SRC, 3, true, in, backward.diff_src_desc())};
    plan->owned[DNNL_ARG_WORKSPACE] = workspace;
    own_scratchpad(*plan, backward);
    return plan;
}

// A reorder between the two layouts (and the types of the two tensors): slots x=0, y=1.
std::unique_ptr<Plan> reorder_plan(Kind kind, const memory::dims &x, dt x_type, dt y_type) {
    auto from = activation(x, x_type, kind == kToPlain), to = activation(x, y_type, kind == kToBlocked);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::reorder(memory(from, state().engine), memory(to, state().engine));
    plan->operands = {operand(DNNL_ARG_FROM, 0, false, from, from), operand(DNNL_ARG_TO, 1, true, to, to)};
    return plan;
}

// The element-wise sum of two tensors of one shape, type and layout: slots a=0, b=1, y=2 (the
// gradient of a tensor two layers read; bfloat16 sums are computed in float32, rounded once).
std::unique_ptr<Plan> sum_plan(int64_t count, dt type) {
    auto elements = flat(count, type);
    auto attr = user_scratchpad();
    auto sum = dnnl::sum::primitive_desc(state().engine, elements, {1.f, 1.f}, {elements, elements}, attr);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::sum(sum);
    plan->operands = {operand(DNNL_ARG_MULTIPLE_SRC, 0, false, elements, elements),
                      operand(DNNL_ARG_MULTIPLE_SRC + 1, 1, false, elements, elements),
                      operand(DNNL_ARG_DST, 2, true, elements, elements)};
    own_scratchpad(*plan, sum);
    return plan;
}

void execute(Plan &plan, void **slots) {
    auto &s = state();
    if (plan.prelude) execute(*plan.prelude, slots);
    std::unordered_map<int, memory> args = plan.owned;
    for (auto &o : plan.operands) {
        o.user.set_data_handle(slots[o.slot]);
        if (o.reorders && !o.output) o.reorder.execute(s.stream, o.user, o.inner);
        args[o.arg] = o.inner;
    }
    plan.primitive.execute(s.stream, args);
    for (auto &o : plan.operands)
        if (o.reorders && o.output) o.reorder.execute(s.stream, o.inner, o.user);
    if (plan.postlude) execute(*plan.postlude, slots);
}

// Without the residual addition the normalization's backward writes zeros as the gradient of the
// residual's stand-in (with it, the plan's prelude writes dresidual).
void zero_stand_in_gradient(void **slots, const int64_t *shape, int ndims, const char *dtype) {
    std::memset(slots[norm::kDresidual], 0, element_count(ndims, shape) * element_size(dtype));
}

// The forward's in-place update of the moving statistics from the batch's (see NormParams).
void move_statistics(void **slots, const int64_t *x, const NormParams &p) {
    if (p.global_stats != 0.f || p.momentum <= 0.f) return;
    const int64_t channels = x[1], count = x[0] * x[2] * x[3];
    const float unbias = static_cast<float>(count) / static_cast<float>(std::max<int64_t>(count - 1, 1));
    auto *moving_mean = static_cast<float *>(slots[3]), *moving_variance = static_cast<float *>(slots[4]);
    const auto *mean = static_cast<const float *>(slots[norm::kMean]),
               *variance = static_cast<const float *>(slots[norm::kVariance]);
    for (int64_t c = 0; c < channels; ++c) {
        moving_mean[c] = moving_mean[c] * (1.f - p.momentum) + mean[c] * p.momentum;
        moving_variance[c] = moving_variance[c] * (1.f - p.momentum) + variance[c] * unbias * p.momentum;
    }
}

bool check(bool ok, const std::string &message) {
    if (!ok) g_error = message;
    return ok;
}

// The parameters and workspace of their types; every other argument float32 or bfloat16 (which
// combinations of those a primitive takes is oneDNN's to say).
bool dtypes_are(int nparam, const char **dtypes, int params_slot, const char *params_dtype, int bytes_slot) {
    for (int i = 0; i < nparam; ++i) {
        const std::string type = dtypes[i];
        const bool ok = i == params_slot  ? type == params_dtype
                        : i == bytes_slot ? type == "uint8"
                                          : type == "float32" || type == "bfloat16";
        if (!check(ok, "argument " + std::to_string(i) + " is " + type + ", not " +
                           (i == params_slot ? params_dtype : i == bytes_slot ? "uint8" : "float32 or bfloat16")))
            return false;
    }
    return true;
}

std::string key_of(Kind kind, int nparam, int *ndims, int64_t **shapes, const char **dtypes, const void *params,
                   size_t size) {
    std::string key = std::to_string(kind);
    for (int i = 0; i < nparam; ++i) {
        key += std::string(";") + dtypes[i];
        for (int d = 0; d < ndims[i]; ++d) key += "," + std::to_string(shapes[i][d]);
    }
    key.append(static_cast<const char *>(params), size);
    return key;
}

int run(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    try {
        // Which argument holds the parameters, and how many bytes they are.
        int params_slot = -1;
        size_t params_size = 0;
        const char *params_dtype = "int32";
        if (kind == kConvForward || kind == kConvBackwardData || kind == kConvBackwardWeights)
            params_slot = 2, params_size = sizeof(ConvParams);
        else if (kind == kNormForward || kind == kNormBackward)
            params_slot = 5, params_size = sizeof(NormParams), params_dtype = "float32";
        else if (kind == kPoolForward)
            params_slot = 1, params_size = sizeof(PoolParams);
        else if (kind == kPoolBackward)
            params_slot = 2, params_size = sizeof(PoolParams);
        if (params_slot >= 0 &&
            !check(ndims[params_slot] == 1 &&
                       static_cast<size_t>(shapes[params_slot][0]) * 4 == params_size,
                   "the parameter tensor holds " + std::to_string(shapes[params_slot][0]) + " values, not " +
                       std::to_string(params_size / 4)))
            return 1;
        // The normalizations' workspace (uint8), when they apply an activation.
        const bool normalizes = kind == kNormForward || kind == kNormBackward;
        int workspace_slot = -1;
        if (normalizes) workspace_slot = kind == kNormForward ? norm::kWorkspace : norm::kBackWorkspace;
        if (!dtypes_are(nparam, dtypes, params_slot, params_dtype, workspace_slot)) return 1;
        const int64_t workspace_bytes =
            workspace_slot >= 0 ? element_count(ndims[workspace_slot], shapes[workspace_slot]) : 0;
        const bool adds_residual =
            normalizes && static_cast<const NormParams *>(params[params_slot])->activation == 2.f;
        if (adds_residual) {
            const int residual = kind == kNormForward ? norm::kResidual : norm::kBackResidual;
            if (!check(element_count(ndims[residual], shapes[residual]) == element_count(ndims[0], shapes[0]) &&
                           std::strcmp(dtypes[residual], dtypes[0]) == 0,
                       "the residual added after the normalization is not of its input's shape and type"))
                return 1;
        }
        auto &s = state();
        std::lock_guard<std::mutex> guard(s.lock);
        if (g_threads > 0) omp_set_num_threads(g_threads);
        const void *raw = params_slot >= 0 ? params[params_slot] : "";
        auto &plan = s.plans[key_of(kind, nparam, ndims, shapes, dtypes, raw, params_size)];
        if (!plan) {
            const int out = nparam - 1;
            if (kind == kConvForward || kind == kConvBackwardData || kind == kConvBackwardWeights) {
                ConvParams p;
                std::memcpy(&p, raw, sizeof(p));
                auto x = dims_of(kind == kConvBackwardData ? shapes[3] : shapes[0], 4);
                auto w = dims_of(kind == kConvBackwardWeights ? shapes[3] : shapes[1], 4);
                auto y = dims_of(kind == kConvForward ? shapes[out] : kind == kConvBackwardData ? shapes[0]
                                                                                                : shapes[1], 4);
                if (p.pad_top < 0) same_padding(p, x, w);
                // the x and y (or dx and dy) arguments, whose types the user descriptors take
                const int x_slot = kind == kConvBackwardData ? 4 : 0;
                const int y_slot = kind == kConvForward ? 3 : kind == kConvBackwardData ? 0 : 1;
                plan = conv_plan(kind, x, w, y, p, data_type(dtypes[x_slot]), data_type(dtypes[y_slot]));
            } else if (normalizes) {
                NormParams p;
                std::memcpy(&p, raw, sizeof(p));
                plan = norm_plan(kind, dims_of(shapes[0], 4), p, workspace_bytes, data_type(dtypes[0]));
            } else if (kind == kPoolForward || kind == kPoolBackward) {
                PoolParams p;
                std::memcpy(&p, raw, sizeof(p));
                plan = pool_plan(kind, dims_of(shapes[0], 4), dims_of(kind == kPoolForward ? shapes[out] : shapes[1], 4),
                                 p, data_type(dtypes[0]));
            } else if (kind == kSum) {
                plan = sum_plan(element_count(ndims[0], shapes[0]), data_type(dtypes[0]));
            } else {
                plan = reorder_plan(kind, dims_of(shapes[0], 4), data_type(dtypes[0]), data_type(dtypes[1]));
            }
        }
        if (kind == kNormBackward && !adds_residual)
            zero_stand_in_gradient(params, shapes[norm::kBackResidual], ndims[norm::kBackResidual],
                                   dtypes[norm::kBackResidual]);
        execute(*plan, params);
        s.stream.wait();
        if (kind == kNormForward) move_statistics(params, shapes[0], *static_cast<const NormParams *>(raw));
        return 0;
    } catch (const dnnl::error &e) {
        g_error = std::string("oneDNN: ") + e.what();
    } catch (const std::exception &e) {
        g_error = e.what();
    }
    return 1;
}

// Two copies of one float32 or bfloat16 tensor (slots x=0, copies 1 and 2): a tensor two layers
// read, each from its own copy, so that MindSpore need not sum the two gradients (its CPU sum of
// gradients, AddN, has no bfloat16 kernel); kSum is the backward.
int fork_copies(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    const std::string type = dtypes[0];
    if (!check(nparam == 3 && (type == "float32" || type == "bfloat16") && type == dtypes[1] && type == dtypes[2],
               "Fork takes one float32 or bfloat16 tensor and returns two of its type"))
        return 1;
    const int64_t bytes = element_count(ndims[0], shapes[0]) * element_size(dtypes[0]);
    const char *x = static_cast<const char *>(params[0]);
    char *a = static_cast<char *>(params[1]), *b = static_cast<char *>(params[2]);
    constexpr int64_t chunk = 1 << 16;
    const int64_t chunks = (bytes + chunk - 1) / chunk;
    if (g_threads > 0) omp_set_num_threads(g_threads);
#pragma omp parallel for if (chunks > 4)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = c * chunk, size = std::min(chunk, bytes - begin);
        std::memcpy(a + begin, x + begin, size);
        std::memcpy(b + begin, x + begin, size);
    }
    return 0;
}

// 1.0 when every element of every float32 input is finite, else 0.0 (the last argument, one float):
// the training step's check of its gradients as one multi-threaded pass, where MindSpore's CPU
// kernels take a reduction per tensor.
int all_finite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    bool finite = true;
    for (int i = 0; i < nparam - 1 && finite; ++i) {
        if (!check(std::strcmp(dtypes[i], "float32") == 0, std::string("AllFinite takes float32, not ") + dtypes[i]))
            return 1;
        const int64_t count = element_count(ndims[i], shapes[i]);
        const uint32_t *bits = static_cast<const uint32_t *>(params[i]);
        int bad = 0;
        if (g_threads > 0) omp_set_num_threads(g_threads);
#pragma omp parallel for reduction(| : bad) if (count > (1 << 16))
        for (int64_t j = 0; j < count; ++j) bad |= inf_or_nan(bits[j]);
        finite = !bad;
    }
    *static_cast<float *>(params[nparam - 1]) = finite ? 1.f : 0.f;
    return 0;
}

// The loss scale divided out of every gradient and the finiteness check in one multi-threaded
// pass: inputs the factor (float32 [1], 1 / scale) and n float32 gradients; outputs the n gradients
// times the factor, then 1.0 when every product is finite, else 0.0. MindSpore's CPU Mul took
// ~100 ms of a ResNet50 step for the 161 products alone (a scalar broadcast, one thread).
int unscale_all_finite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    const int n = (nparam - 2) / 2;
    if (!check(nparam == 2 * n + 2 && n > 0, "UnscaleAllFinite takes a factor and n gradients, returns n + 1"))
        return 1;
    for (int i = 0; i < nparam; ++i)
        if (!check(std::strcmp(dtypes[i], "float32") == 0, std::string("UnscaleAllFinite takes float32, not ") + dtypes[i]))
            return 1;
    const float factor = *static_cast<const float *>(params[0]);
    if (g_threads > 0) omp_set_num_threads(g_threads);
    int bad = 0;
    for (int i = 0; i < n; ++i) {
        const int64_t count = element_count(ndims[1 + i], shapes[1 + i]);
        const float *gradient = static_cast<const float *>(params[1 + i]);
        float *scaled = static_cast<float *>(params[1 + n + i]);
        int tensor_bad = 0;
#pragma omp parallel for simd reduction(| : tensor_bad) if (count > (1 << 16))
        for (int64_t j = 0; j < count; ++j) {
            const float value = gradient[j] * factor;
            scaled[j] = value;
            uint32_t bits;
            std::memcpy(&bits, &value, sizeof(bits));
            tensor_bad |= inf_or_nan(bits);
        }
        bad |= tensor_bad;
    }
    *static_cast<float *>(params[nparam - 1]) = bad ? 0.f : 1.f;
    return 0;
}

}  // namespace

#define EXPORT __attribute__((visibility("default")))
#define KERNEL(name, kind)                                                                                     \
    EXPORT int name(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) { \
        return run(kind, nparam, params, ndims, shapes, dtypes);                                              \
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

EXPORT int Fork(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
    return fork_copies(nparam, params, ndims, shapes, dtypes);
}

EXPORT int AllFinite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
    return all_finite(nparam, params, ndims, shapes, dtypes);
}

EXPORT int UnscaleAllFinite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                            void *) {
    return unscale_all_finite(nparam, params, ndims, shapes, dtypes);
}

// For the Python side (ctypes): threads per kernel (0: OpenMP's default), the oneDNN version this
// library runs (to prove the private copy is the one bound), and the last error.
EXPORT void SetThreads(int threads) { g_threads = threads; }

EXPORT int OneDnnVersion() {
    const dnnl_version_t *v = dnnl_version();
    return v->major * 10000 + v->minor * 100 + v->patch;
}

EXPORT const char *LastError() { return g_error.c_str(); }
}
