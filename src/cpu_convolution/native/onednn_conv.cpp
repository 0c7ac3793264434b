// Convolutions for MindSpore's CPU backend through a private oneDNN, as `ops.Custom(func_type="aot")`
// kernels: forward, backward-data and backward-weights on float32 NCHW tensors and OIHW weights.
//
// MindSpore's own CPU convolutions hand oneDNN plain NCHW descriptors, so oneDNN never picks its
// blocked layouts (and, above AVX2, falls into a reference kernel). Here every primitive is created
// with `format_tag::any`: oneDNN chooses the layouts, the NCHW tensors MindSpore owns are reordered
// in and out around the call, and each primitive is created once per shape and cached.
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
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

// The int32 parameter tensor every kernel takes as its third input (written by cells.py).
struct ConvParams {
    int32_t stride_h, stride_w, pad_top, pad_bottom, pad_left, pad_right, dilation_h, dilation_w, groups, bf16;
};
constexpr int kParamCount = 10;

enum Kind { kForward = 0, kBackwardData = 1, kBackwardWeights = 2 };

// One tensor argument of a primitive: the NCHW/OIHW memory MindSpore owns, and the layout the
// primitive wants; when they differ, a reorder through a buffer owned by the plan.
struct Operand {
    int arg;
    bool output;
    memory user;
    memory inner;
    bool reorders;
    dnnl::reorder reorder;  // user -> inner for inputs, inner -> user for outputs
};

struct Plan {
    dnnl::primitive primitive;
    std::vector<Operand> operands;
    memory scratchpad;
};

struct State {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    std::map<std::string, std::unique_ptr<Plan>> plans;
    std::mutex lock;  // one convolution at a time: each already uses every thread
};

int g_threads = 0;
std::string g_error;

State &state() {
    static State *instance = [] {
        // MindSpore's copy is capped (src/device.py) because of its NCHW-only path; this copy picks
        // blocked layouts and should use every instruction the CPU has.
        dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_amx_fp16);
        return new State();
    }();
    return *instance;
}

memory::dims dims_of(const int64_t *shape, int n) { return memory::dims(shape, shape + n); }

Operand operand(const dnnl::engine &engine, int arg, bool output, const memory::desc &user_desc,
                const memory::desc &wanted) {
    Operand result{arg, output, memory(user_desc, engine, DNNL_MEMORY_NONE), memory(), false, {}};
    result.reorders = wanted != user_desc;
    result.inner = result.reorders ? memory(wanted, engine) : result.user;
    if (result.reorders)
        result.reorder = output ? dnnl::reorder(result.inner, result.user) : dnnl::reorder(result.user, result.inner);
    return result;
}

// The weights as oneDNN sees them: OIHW, or GOIHW over the same buffer for grouped convolutions.
memory::desc weights_desc(const memory::dims &w, int groups, dt type, tag format) {
    if (groups == 1) return memory::desc(w, type, format);
    memory::dims grouped{groups, w[0] / groups, w[1], w[2], w[3]};
    return memory::desc(grouped, type, format == tag::any ? tag::any : tag::goihw);
}

std::unique_ptr<Plan> create_plan(Kind kind, const memory::dims &x, const memory::dims &w, const memory::dims &y,
                                  const ConvParams &p) {
    auto &engine = state().engine;
    memory::dims strides{p.stride_h, p.stride_w};
    memory::dims dilation{p.dilation_h - 1, p.dilation_w - 1};
    memory::dims pad_l{p.pad_top, p.pad_left};
    memory::dims pad_r{p.pad_bottom, p.pad_right};
    const dt compute = p.bf16 ? dt::bf16 : dt::f32;
    auto x_any = memory::desc(x, compute, tag::any);
    auto y_any = memory::desc(y, compute, tag::any);
    auto w_any = weights_desc(w, p.groups, compute, tag::any);
    auto x_user = memory::desc(x, dt::f32, tag::nchw);
    auto y_user = memory::desc(y, dt::f32, tag::nchw);
    auto w_user = weights_desc(w, p.groups, dt::f32, tag::oihw);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto forward = dnnl::convolution_forward::primitive_desc(
        engine, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_any, w_any, y_any,
        strides, dilation, pad_l, pad_r, attr);
    auto plan = std::make_unique<Plan>();
    memory::desc scratch;
    if (kind == kForward) {
        plan->primitive = dnnl::convolution_forward(forward);
        plan->operands = {operand(engine, DNNL_ARG_SRC, false, x_user, forward.src_desc()),
                          operand(engine, DNNL_ARG_WEIGHTS, false, w_user, forward.weights_desc()),
                          operand(engine, DNNL_ARG_DST, true, y_user, forward.dst_desc())};
        scratch = forward.scratchpad_desc();
    } else if (kind == kBackwardData) {
        auto backward = dnnl::convolution_backward_data::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, w_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_data(backward);
        plan->operands = {operand(engine, DNNL_ARG_DIFF_DST, false, y_user, backward.diff_dst_desc()),
                          operand(engine, DNNL_ARG_WEIGHTS, false, w_user, backward.weights_desc()),
                          operand(engine, DNNL_ARG_DIFF_SRC, true, x_user, backward.diff_src_desc())};
        scratch = backward.scratchpad_desc();
    } else {
        // bf16 weight gradients are accumulated in f32 (the master weights' type).
        auto dw_any = weights_desc(w, p.groups, dt::f32, tag::any);
        auto backward = dnnl::convolution_backward_weights::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, dw_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_weights(backward);
        plan->operands = {operand(engine, DNNL_ARG_SRC, false, x_user, backward.src_desc()),
                          operand(engine, DNNL_ARG_DIFF_DST, false, y_user, backward.diff_dst_desc()),
                          operand(engine, DNNL_ARG_DIFF_WEIGHTS, true, w_user, backward.diff_weights_desc())};
        scratch = backward.scratchpad_desc();
    }
    plan->scratchpad = memory(scratch, engine);
    return plan;
}

// pad_mode 'same' (pad_top < 0): the output is ceil(input / stride) and the padding depends on the
// input's size; as MindSpore and TensorFlow do, an odd total puts the extra row/column after.
void same_padding(ConvParams &p, const int64_t *x, const int64_t *w) {
    auto split = [](int64_t size, int stride, int64_t kernel, int dilation, int32_t &before, int32_t &after) {
        int64_t out = (size + stride - 1) / stride;
        int64_t total = std::max<int64_t>((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0);
        before = static_cast<int32_t>(total / 2);
        after = static_cast<int32_t>(total - total / 2);
    };
    split(x[2], p.stride_h, w[2], p.dilation_h, p.pad_top, p.pad_bottom);
    split(x[3], p.stride_w, w[3], p.dilation_w, p.pad_left, p.pad_right);
}

std::string key_of(Kind kind, const memory::dims &x, const memory::dims &w, const memory::dims &y,
                   const ConvParams &p) {
    std::string key = std::to_string(kind);
    for (const auto *dims : {&x, &w, &y})
        for (auto d : *dims) key += "," + std::to_string(d);
    const int32_t *values = &p.stride_h;
    for (int i = 0; i < kParamCount; ++i) key += ";" + std::to_string(values[i]);
    return key;
}

// params: the two tensor inputs in the order the primitive reads them, the parameters, a tensor of
// the output's shape (forward: none), then the output.
int run(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    try {
        for (int i = 0; i < nparam; ++i) {
            if (std::strcmp(dtypes[i], i == 2 ? "int32" : "float32") != 0) {
                g_error = "unexpected dtype " + std::string(dtypes[i]) + " for argument " + std::to_string(i);
                return 1;
            }
        }
        if (ndims[2] != 1 || shapes[2][0] != kParamCount) {
            g_error = "the parameter tensor must hold " + std::to_string(kParamCount) + " int32 values";
            return 1;
        }
        const int out = nparam - 1;
        ConvParams p;
        std::memcpy(&p, params[2], sizeof(p));
        if (p.pad_top < 0) same_padding(p, kind == kBackwardData ? shapes[out] : shapes[0],
                                        kind == kBackwardWeights ? shapes[out] : shapes[1]);
        memory::dims x, w, y;
        void *x_data, *w_data, *y_data;
        if (kind == kForward) {
            x = dims_of(shapes[0], 4), w = dims_of(shapes[1], 4), y = dims_of(shapes[out], 4);
            x_data = params[0], w_data = params[1], y_data = params[out];
        } else if (kind == kBackwardData) {  // dy, w, params, x (shape only), dx
            y = dims_of(shapes[0], 4), w = dims_of(shapes[1], 4), x = dims_of(shapes[out], 4);
            y_data = params[0], w_data = params[1], x_data = params[out];
        } else {  // x, dy, params, w (shape only), dw
            x = dims_of(shapes[0], 4), y = dims_of(shapes[1], 4), w = dims_of(shapes[out], 4);
            x_data = params[0], y_data = params[1], w_data = params[out];
        }
        auto &s = state();
        std::lock_guard<std::mutex> guard(s.lock);
        if (g_threads > 0) omp_set_num_threads(g_threads);
        auto &plan = s.plans[key_of(kind, x, w, y, p)];
        if (!plan) plan = create_plan(kind, x, w, y, p);
        std::unordered_map<int, memory> args{{DNNL_ARG_SCRATCHPAD, plan->scratchpad}};
        for (auto &o : plan->operands) {
            void *data = o.arg == DNNL_ARG_SRC || o.arg == DNNL_ARG_DIFF_SRC ? x_data
                       : o.arg == DNNL_ARG_DST || o.arg == DNNL_ARG_DIFF_DST ? y_data : w_data;
            o.user.set_data_handle(data);
            if (o.reorders && !o.output) o.reorder.execute(s.stream, o.user, o.inner);
            args[o.arg] = o.inner;
        }
        plan->primitive.execute(s.stream, args);
        for (auto &o : plan->operands)
            if (o.reorders && o.output) o.reorder.execute(s.stream, o.inner, o.user);
        s.stream.wait();
        return 0;
    } catch (const dnnl::error &e) {
        g_error = std::string("oneDNN: ") + e.what();
    } catch (const std::exception &e) {
        g_error = e.what();
    }
    return 1;
}

}  // namespace

#define EXPORT __attribute__((visibility("default")))

extern "C" {

EXPORT int ConvForward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
    return run(kForward, nparam, params, ndims, shapes, dtypes);
}

EXPORT int ConvBackwardData(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                     void *) {
    return run(kBackwardData, nparam, params, ndims, shapes, dtypes);
}

EXPORT int ConvBackwardWeights(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                        void *) {
    return run(kBackwardWeights, nparam, params, ndims, shapes, dtypes);
}

// For the Python side (ctypes): threads per convolution (0: OpenMP's default), the oneDNN version
// this library runs (to prove the private copy is the one bound), and the last error.
EXPORT void SetThreads(int threads) { g_threads = threads; }

EXPORT int OneDnnVersion() {
    const dnnl_version_t *v = dnnl_version();
    return v->major * 10000 + v->minor * 100 + v->patch;
}

EXPORT const char *LastError() { return g_error.c_str(); }

}
