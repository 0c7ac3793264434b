// Max pooling through oneDNN (forward, backward).
#include "core.hpp"

namespace resnet_conv {

namespace {

// Max pooling on blocked tensors; the padding never wins a window (PyTorch's -inf padding). The
// backward runs the forward first for the positions of the maxima (oneDNN's workspace).
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
        plan->operands = {operand(DNNL_ARG_SRC, pool_forward::x, false, in, forward.src_desc()),
                          operand(DNNL_ARG_DST, pool_forward::y, true, out, forward.dst_desc())};
        plan->owned[DNNL_ARG_WORKSPACE] = memory(forward.workspace_desc(), engine);
        own_scratchpad(*plan, forward);
        return plan;
    }
    auto workspace = memory(forward.workspace_desc(), engine);
    plan->prelude = std::make_unique<Plan>();
    plan->prelude->primitive = dnnl::pooling_forward(forward);
    plan->prelude->operands = {operand(DNNL_ARG_SRC, pool_backward::x, false, in, forward.src_desc())};
    plan->prelude->owned[DNNL_ARG_DST] = memory(forward.dst_desc(), engine);
    plan->prelude->owned[DNNL_ARG_WORKSPACE] = workspace;
    own_scratchpad(*plan->prelude, forward);
    auto backward = dnnl::pooling_backward::primitive_desc(engine, dnnl::algorithm::pooling_max, in, out, strides,
                                                           kernel, dilation, pad, pad, forward, attr);
    plan->primitive = dnnl::pooling_backward(backward);
    plan->operands = {operand(DNNL_ARG_DIFF_DST, pool_backward::dy, false, out, backward.diff_dst_desc()),
                      operand(DNNL_ARG_DIFF_SRC, pool_backward::dx, true, in, backward.diff_src_desc())};
    plan->owned[DNNL_ARG_WORKSPACE] = workspace;
    own_scratchpad(*plan, backward);
    return plan;
}

// Max pooling's part of call_kernel (core.cpp).
std::string pool_record_problem(const KernelCall &call) {
    const auto &p = *static_cast<const PoolParams *>(call.record);
    const bool in_range = p.kernel >= 1 && p.stride >= 1 && p.pad >= 0 && p.pad < p.kernel;
    return in_range ? "" : "the pooling's parameter record is out of range";
}

std::unique_ptr<Plan> make_pool_plan(const KernelCall &call, int64_t) {
    PoolParams p;
    std::memcpy(&p, call.record, sizeof(p));
    auto y = call.kind == kPoolForward ? call.shapes[pool_forward::y] : call.shapes[pool_backward::dy];
    return pool_plan(call.kind, dims_of(call.shapes[0], 4), dims_of(y, 4), p, data_type(call.dtypes[0]));
}

}  // namespace

const Family kPoolingFamily = {pool_record_problem, make_pool_plan, nullptr, nullptr, nullptr};

}  // namespace resnet_conv
