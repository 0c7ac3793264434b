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
// oneDNN's convolutions choose on this CPU for the tensor's type, asked once (nChw16c for float32 on
// AVX-512, nChw8c on AVX2: exactly N*C*H*W floats when C is a multiple of the block; NHWC for
// bfloat16 on AMX). Between the layers of a network whose every layer runs here the tensors stay
// blocked (the normalizations apply the ReLUs and residual additions; sums of gradients are
// element-wise), so no reorder is needed; where a kernel meets another layout or type, it reorders
// through a buffer of its plan. Each primitive is created once per shape, types, parameters and
// thread count, and cached (the least recently used beyond a limit are freed); all share one
// scratchpad. A kernel refuses arguments of another count, type or rank than its slots say, and
// says why through TakeError in one line naming the kernel and its arguments' shapes.
//
// The library links against oneDNN 3.2 under a renamed SONAME (libdnnl_resnet.so.3, see build.sh):
// MindSpore's own libdnnl.so.3 is already in the process and would otherwise be bound instead.
#include <immintrin.h>  // SSE2's streaming stores (this library is built for x86_64 only)
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
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

// The parameter records and argument slots, each defined once here as a list of names; cells.py
// writes the records and passes the arguments by the same names, and checks them against these lists
// (RecordFields, KernelSlots) when the library loads, so a field moved on either side is refused.
//
// ConvParams (int32): the stride, the padding (pad_top < 0: 'same'), the dilation, the groups, bf16
// (1: compute in bfloat16), layout (bit 0: the input (x, dx) is blocked; bit 1: the output (y, dy)), and
// inference (1: an evaluation's forward, which keeps the weights' reorder while they are frozen, see
// FreezeWeights).
#define CONV_PARAMS(F) \
    F(stride_h) F(stride_w) F(pad_top) F(pad_bottom) F(pad_left) F(pad_right) F(dilation_h) F(dilation_w) F(groups) \
    F(bf16) F(layout) F(inference)
// NormParams (float32): epsilon; global_stats (1: normalize with the given (moving) statistics);
// momentum: with batch statistics and momentum > 0 the forward moves the given statistics (slots
// mean and variance) in place, moving = (1 - momentum) * moving + momentum * batch (the variance
// unbiased), as MindSpore's BatchNorm does (the Python op declares those inputs written);
// activation: what follows the normalization in the same kernel, 0 none, 1 a ResNet block's ReLU
// (oneDNN's fuse_norm_relu: the forward writes a workspace of which elements passed, the backward
// reads it), 2 its residual addition and ReLU (oneDNN 3.2's CPU normalizations do not fuse the
// addition: oneDNN's binary addition with a ReLU after the forward, and its ReLU backward on the
// output before the backward, which masks dy and is the residual's gradient).
#define NORM_PARAMS(F) F(epsilon) F(global_stats) F(momentum) F(activation)
// PoolParams (int32): a square max pool's window, stride and padding.
#define POOL_PARAMS(F) F(kernel) F(stride) F(pad)
// QuantParams (float32): a fake quantizer's levels quant_min..quant_max, symmetric (1: its range is
// made symmetric around 0) and channel_axis (the axis along which low and high hold one range per
// channel; -1: one range for the tensor).
#define QUANT_PARAMS(F) F(quant_min) F(quant_max) F(symmetric) F(channel_axis)
// LsqParams (float32): a learned-step-size quantizer's lower end (-1, or 0 for neg_trunc) and its
// channel_axis (along which alpha holds one value per channel; -1: one alpha for the tensor).
#define LSQ_PARAMS(F) F(lower) F(channel_axis)

#define INT32_FIELD(name) int32_t name;
#define FLOAT_FIELD(name) float name;
#define NAME_OF(name) #name ","
struct ConvParams { CONV_PARAMS(INT32_FIELD) };
struct NormParams { NORM_PARAMS(FLOAT_FIELD) };
struct PoolParams { POOL_PARAMS(INT32_FIELD) };
struct QuantParams { QUANT_PARAMS(FLOAT_FIELD) };
struct LsqParams { LSQ_PARAMS(FLOAT_FIELD) };

// Each kernel's argument slots, inputs then outputs. The normalization kernels' slots are the same
// whatever the activation: MindSpore compiles every forward of a graph (a Custom op declaring inputs
// written) as the first one it meets, so one op with one signature serves them all and the params
// say what to compute. The residual is read by add_relu alone (otherwise any small tensor stands
// in); the workspace is uint8, a byte per element of x, written by ReLU alone; the backward's
// dresidual is dy masked by the ReLU for add_relu, otherwise zeros. Slots named `*_shape` are read
// for their shape only. Max pooling's backward runs the forward first (for oneDNN's workspace).
// A convolution's `matrix` is what a training forward makes of the weights and hands the backward of
// its image gradient: a dense layer's matrix (dense_plan), or the taps that meet an image inside the
// kernel (image_inside_kernel) copied out of the OIHW buffer; one unused float for other convolutions
// (a dense layer's matrix that is the weights buffer itself included: matrix_is_weights).
#define CONV_FORWARD_SLOTS(F) F(x) F(w) F(params) F(y) F(matrix)
#define CONV_BACKWARD_DATA_SLOTS(F) F(dy) F(w) F(params) F(x_shape) F(matrix) F(dx)
#define CONV_BACKWARD_WEIGHTS_SLOTS(F) F(x) F(dy) F(params) F(w_shape) F(dw)
#define NORM_FORWARD_SLOTS(F) \
    F(x) F(gamma) F(beta) F(mean) F(variance) F(params) F(residual) F(y) F(batch_mean) F(batch_variance) F(workspace)
#define NORM_BACKWARD_SLOTS(F) \
    F(x) F(dy) F(mean) F(variance) F(gamma) F(params) F(workspace) F(y) F(residual) F(dx) F(dgamma) F(dbeta) F(dresidual)
// A block's output handed out twice (both the next block's convolution and its shortcut read it):
// the forward of an add_relu normalization also writes y_copy, and the backward takes the copy's
// gradient dy_copy and sums it with dy in the pass that masks them by the ReLU, where MindSpore would
// sum the two gradients of one tensor with AddN (a pass of its own, two reads and a write). dy_copy
// takes the residual's slot (the backward reads only its shape, that of dresidual): every other slot
// is where NormForward's and NormBackward's are.
#define NORM_FORWARD_FORKED_SLOTS(F) NORM_FORWARD_SLOTS(F) F(y_copy)
#define NORM_BACKWARD_SUMMED_SLOTS(F) \
    F(x) F(dy) F(mean) F(variance) F(gamma) F(params) F(workspace) F(y) F(dy_copy) F(dx) F(dgamma) F(dbeta) F(dresidual)
#define POOL_FORWARD_SLOTS(F) F(x) F(params) F(y)
#define POOL_BACKWARD_SLOTS(F) F(x) F(dy) F(params) F(dx)
#define REORDER_SLOTS(F) F(x) F(y)
#define SUM_SLOTS(F) F(a) F(b) F(y)
#define FORK_SLOTS(F) F(x) F(a) F(b)
#define FAKE_QUANT_SLOTS(F) F(x) F(low) F(high) F(params) F(y)
#define FAKE_QUANT_GRAD_SLOTS(F) F(x) F(low) F(high) F(params) F(dy) F(dx)
#define LSQ_SLOTS(F) F(x) F(alpha) F(quant_max) F(params) F(y)
#define LSQ_GRAD_SLOTS(F) F(x) F(alpha) F(quant_max) F(params) F(dy) F(dx) F(dalpha)

#define SLOT_ENUM(name) name,
namespace conv_forward { enum { CONV_FORWARD_SLOTS(SLOT_ENUM) count }; }
namespace conv_backward_data { enum { CONV_BACKWARD_DATA_SLOTS(SLOT_ENUM) count }; }
namespace conv_backward_weights { enum { CONV_BACKWARD_WEIGHTS_SLOTS(SLOT_ENUM) count }; }
namespace norm_forward { enum { NORM_FORWARD_SLOTS(SLOT_ENUM) count }; }
namespace norm_backward { enum { NORM_BACKWARD_SLOTS(SLOT_ENUM) count }; }
namespace norm_forward_forked { enum { NORM_FORWARD_FORKED_SLOTS(SLOT_ENUM) count }; }
namespace norm_backward_summed { enum { NORM_BACKWARD_SUMMED_SLOTS(SLOT_ENUM) count }; }
static_assert(norm_backward_summed::dy_copy == norm_backward::residual && norm_backward_summed::dx == norm_backward::dx &&
                  norm_backward_summed::dresidual == norm_backward::dresidual && norm_backward_summed::count == norm_backward::count,
              "NormBackwardSummed's slots are NormBackward's, dy_copy in the residual's");
namespace pool_forward { enum { POOL_FORWARD_SLOTS(SLOT_ENUM) count }; }
namespace pool_backward { enum { POOL_BACKWARD_SLOTS(SLOT_ENUM) count }; }
namespace reorder_slots { enum { REORDER_SLOTS(SLOT_ENUM) count }; }
namespace sum_slots { enum { SUM_SLOTS(SLOT_ENUM) count }; }
namespace fork_slots { enum { FORK_SLOTS(SLOT_ENUM) count }; }
namespace fake_quant { enum { FAKE_QUANT_SLOTS(SLOT_ENUM) count }; }
namespace fake_quant_grad { enum { FAKE_QUANT_GRAD_SLOTS(SLOT_ENUM) count }; }
namespace lsq { enum { LSQ_SLOTS(SLOT_ENUM) count }; }
namespace lsq_grad { enum { LSQ_GRAD_SLOTS(SLOT_ENUM) count }; }

enum Kind {
    kConvForward, kConvBackwardData, kConvBackwardWeights, kNormForward, kNormBackward, kPoolForward,
    kPoolBackward, kToPlain, kToBlocked, kSum, kNormForwardForked, kNormBackwardSummed
};

bool is_norm(int kind) {
    return kind == kNormForward || kind == kNormBackward || kind == kNormForwardForked || kind == kNormBackwardSummed;
}

bool is_norm_forward(int kind) { return kind == kNormForward || kind == kNormForwardForked; }

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
    // Weights of an inference forward: their reorder per weights tensor (by address), with the frozen
    // version it was made under (0: made unfrozen, so made again on the next call).
    bool keeps_reorders = false;
    std::unordered_map<void *, std::pair<memory, uint64_t>> kept;
    // An output that fills part of MindSpore's buffer (image_inside_kernel's weight gradient): the
    // bytes zeroed first (or by copy_blocks_out as it writes them).
    size_t zeroed_bytes = 0;
    // An output reorder from 16x16-blocked weights (8x8 ones where zeroed_bytes) to plain ones that
    // copy_blocks_out does, not oneDNN: the blocks' side (0: oneDNN's reorder).
    int copies_blocks = 0;
};

struct Plan {
    dnnl::primitive primitive;
    std::vector<Operand> operands;
    std::unordered_map<int, memory> owned;  // workspace, outputs nobody reads
    memory::desc scratchpad;                // what the primitive asks of the shared scratchpad
    std::unique_ptr<Plan> prelude;          // run first (max pooling's backward: its forward, for the workspace)
    std::unique_ptr<Plan> postlude;         // run last (the residual addition after a normalization)
    std::function<void(void **)> steps;     // our own steps instead (weight_gradient_product, dense_plan)
};

struct CachedPlan {
    std::unique_ptr<Plan> plan;
    uint64_t used;  // the state's clock when last run: the least recently used goes first
};

struct FreeDeleter {
    void operator()(void *pointer) const { std::free(pointer); }
};

struct State {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    // Plans per shape, types, parameters and thread count, at most plan_limit: a process that meets
    // many shapes (evaluation's last partial batch, several networks) frees the least recently used.
    std::map<std::string, CachedPlan> plans;
    size_t plan_limit = 512;
    uint64_t clock = 0;
    // One scratchpad for every primitive (they run one at a time, under the lock), grown to the
    // largest any has asked for.
    std::unique_ptr<uint8_t, FreeDeleter> scratchpad;
    size_t scratchpad_bytes = 0;
    // One dense layer matrix for the dense plans without a `matrix` slot (they too run one at a time), grown likewise.
    std::unique_ptr<uint8_t, FreeDeleter> dense;
    size_t dense_bytes = 0;
    // The layouts oneDNN's convolutions choose on this CPU, asked once (tag::undef: no such
    // convolution here, e.g. bfloat16 without AVX512_BF16 or AMX).
    tag f32_layout = tag::undef, bf16_layout = tag::undef;
    std::mutex lock;  // one kernel at a time: each already uses every thread
};

int g_threads = 0;                             // SetThreads: 0 is OpenMP's default
// While non-zero, the weights of inference forwards are frozen: each weights tensor is reordered once
// per version and its reorder reused (FreezeWeights, ThawWeights). A training forward thaws them.
uint64_t g_frozen_version = 0, g_last_version = 0;
const int kDefaultThreads = omp_get_max_threads();  // read when the library loads, before anyone sets it
std::string g_error;
// The highest ISA this copy of oneDNN may use: all the CPU has, unless capped before the first
// primitive (CapIsa, for tests and the benchmark's AVX2 rows).
dnnl::cpu_isa g_isa = dnnl::cpu_isa::avx512_core_amx_fp16;
bool g_state_made = false;

tag chosen_layout(const dnnl::engine &engine, dt type);

// Seconds spent in this library's own loops inside the layers' kernels, outside oneDNN's primitives,
// since it loaded (OwnLoopSeconds: benchmark.py names them in the rest of a training step). Every
// kernel runs under the state's lock, so the sums need none of their own.
enum OwnLoop {
    kResidualRelu, kGradientSums, kWeightGradientCopies, kZeroedGradients, kWeightGradientPatches, kDenseMatrices,
    kOwnLoopCount
};
const char *const kOwnLoopNames =
    "residual addition and ReLU,gradient sums,weight gradient copies,zeroed gradients,weight gradient patches,"
    "dense matrices,";
double g_own_seconds[kOwnLoopCount] = {};

class Timed {  // adds the seconds of its scope to one of g_own_seconds
   public:
    explicit Timed(OwnLoop loop) : loop_(loop), start_(std::chrono::steady_clock::now()) {}
    ~Timed() {
        g_own_seconds[loop_] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    }

   private:
    OwnLoop loop_;
    std::chrono::steady_clock::time_point start_;
};

State &state() {
    static State *instance = [] {
        // MindSpore's copy may be capped at AVX2 (src/device.py) because of its NCHW-only path; this
        // copy chooses its layouts and should use every instruction the CPU has. oneDNN refuses the
        // call once any primitive exists in the process (its own, not MindSpore's: another copy).
        if (dnnl::set_max_cpu_isa(g_isa) != dnnl::status::success)
            throw std::runtime_error("oneDNN did not accept its ISA limit (a primitive was created before)");
        auto *made = new State();
        made->f32_layout = chosen_layout(made->engine, dt::f32);
        made->bf16_layout = chosen_layout(made->engine, dt::bf16);
        g_state_made = true;
        return made;
    }();
    return *instance;
}

int kernel_threads() { return g_threads > 0 ? g_threads : kDefaultThreads; }

void use_threads(int threads = 0) { omp_set_num_threads(threads > 0 ? threads : kernel_threads()); }

// A shared buffer of the state, at least `bytes` long (64-byte aligned, as oneDNN prefers).
void *grown(std::unique_ptr<uint8_t, FreeDeleter> &buffer, size_t &size, size_t bytes) {
    if (bytes > size) {
        const size_t rounded = (bytes + 63) / 64 * 64;
        void *larger = std::aligned_alloc(64, rounded);
        if (!larger) throw std::bad_alloc();
        buffer.reset(static_cast<uint8_t *>(larger));
        size = rounded;
    }
    return buffer.get();
}

void *scratchpad_of(State &s, size_t bytes) { return grown(s.scratchpad, s.scratchpad_bytes, bytes); }

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

// An activation as a kernel's parameters say it is laid out: plain NCHW, or blocked in the layout
// this CPU's convolutions choose for its type (nChw16c for float32 on AVX-512, nChw8c on AVX2, NHWC
// for bfloat16 on AMX: asked of oneDNN once, see chosen_layout).
memory::desc activation(const memory::dims &shape, dt type, bool blocked) {
    if (!blocked) return memory::desc(shape, type, tag::nchw);
    const tag layout = type == dt::bf16 ? state().bf16_layout : state().f32_layout;
    if (layout == tag::undef) throw std::runtime_error("this CPU's oneDNN has no convolution of this type");
    return memory::desc(shape, type, layout);
}

// The layouts a blocked activation may have: element counts equal to N*C*H*W when C is a multiple
// of the block (cells.py keeps other layers plain).
const std::pair<tag, const char *> kLayouts[] = {
    {tag::aBcd16b, "nChw16c"}, {tag::aBcd8b, "nChw8c"}, {tag::acdb, "nhwc"}, {tag::abcd, "nchw"}};

// What oneDNN's convolutions choose on this CPU for a ResNet layer's activations (a 3x3, 64
// channels, 56 px), or tag::undef where it has no such convolution or picks another layout.
tag chosen_layout(const dnnl::engine &engine, dt type) {
    const memory::dims x{8, 64, 56, 56}, w{64, 64, 3, 3};
    try {
        auto pd = dnnl::convolution_forward::primitive_desc(
            engine, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
            memory::desc(x, type, tag::any), memory::desc(w, type, tag::any), memory::desc(x, type, tag::any),
            {1, 1}, {0, 0}, {1, 1}, {1, 1});
        for (const auto &layout : kLayouts)
            if (pd.src_desc() == memory::desc(x, type, layout.first)) return layout.first;
    } catch (const dnnl::error &) {
    }
    return tag::undef;
}

// The same elements seen as one flat run, for element-wise primitives over tensors of one layout.
memory::desc flat(int64_t count, dt type) { return memory::desc({count}, type, tag::a); }

// Threads for one kernel call: all of them, or one where the work is too small to pay for waking the
// others (on a virtual machine a parallel region's wake-up took ~90 us, more than a batch-1
// convolution of a 32 px ResNet layer takes on one core).
constexpr int64_t kOneThreadMacs = 4 << 20, kOneThreadElements = 64 << 10;

// Float32 weights blocked 16 output by 16 input channels (ABcd16b16a, the weight gradients of
// oneDNN's float32 convolutions under AVX-512), or 8 by 8 (ABcd8b8a, under AVX2), into a plain,
// possibly strided, OIHW `user`: oneDNN's reorder writes the plain side one column of a block at a
// time, sixteen rows a power of two apart that fall into one cache set, and ran at 4 GB/s for a 1x1
// layer's 1024 or 2048 inputs; row by row, 30 GB/s. The block's side, 0 where neither fits.
int copyable_blocks(const memory::desc &blocked, const memory::desc &user) {
    const memory::dims dims = user.get_dims();
    if (dims.size() != 4 || user.get_data_type() != dt::f32 || user.get_inner_nblks() != 0) return 0;
    for (const auto &[side, layout] : {std::make_pair(16, tag::ABcd16b16a), std::make_pair(8, tag::ABcd8b8a)})
        if (dims[0] % side == 0 && dims[1] % side == 0 && blocked == memory::desc(dims, dt::f32, layout)) return side;
    return 0;
}

// `zero_rest`: `user` views some taps of a whole OIHW buffer (image_inside_kernel's weight gradient),
// whose other taps get zeros in the same pass: one write of the buffer, not a memset and a second pass.
template <int kSide>
void copy_blocks_out(const memory &blocked, const memory &user, bool zero_rest) {
    const memory::desc desc = user.get_desc();
    const memory::dims d = desc.get_dims(), stride = desc.get_strides();
    const int64_t out_blocks = d[0] / kSide, in_blocks = d[1] / kSide, kh = d[2], kw = d[3];
    const int64_t offset = desc.get_submemory_offset();
    const float *in = static_cast<const float *>(blocked.get_data_handle());
    float *base = static_cast<float *>(user.get_data_handle());
#pragma omp parallel for collapse(2) if (element_count(4, d.data()) > kOneThreadElements)
    for (int64_t ob = 0; ob < out_blocks; ++ob)
        for (int64_t ib = 0; ib < in_blocks; ++ib) {
            const float *block = in + (ob * in_blocks + ib) * kh * kw * kSide * kSide;
            for (int64_t o = 0; o < kSide; ++o) {
                float *rows = base + (ob * kSide + o) * stride[0] + ib * kSide * stride[1];  // the block's inputs
                if (zero_rest) std::memset(rows, 0, kSide * stride[1] * sizeof(float));
                for (int64_t y = 0; y < kh; ++y)
                    for (int64_t x = 0; x < kw; ++x) {
                        float *tap = rows + offset + y * stride[2] + x * stride[3];
                        const float *column = block + (y * kw + x) * kSide * kSide + o;
                        for (int i = 0; i < kSide; ++i) tap[i * stride[1]] = column[i * kSide];  // unrolled: fixed count
                    }
            }
        }
}

void copy_blocks_out(int side, const memory &blocked, const memory &user, bool zero_rest) {
    if (side == 16)
        copy_blocks_out<16>(blocked, user, zero_rest);
    else
        copy_blocks_out<8>(blocked, user, zero_rest);
}

// `zeroed_bytes`: see Operand (an output that fills part of its buffer).
Operand operand(int arg, int slot, bool output, const memory::desc &user_desc, const memory::desc &wanted,
                size_t zeroed_bytes = 0) {
    auto &engine = state().engine;
    Operand result{arg, slot, output, memory(user_desc, engine, DNNL_MEMORY_NONE), memory(), false, {}};
    result.reorders = wanted != user_desc;
    result.inner = result.reorders ? memory(wanted, engine) : result.user;
    result.zeroed_bytes = zeroed_bytes;
    // Our copy takes every 16x16 block; 8x8 ones only where it also writes the zeros, sparing a memset
    // of the whole buffer (ResNet18 64x32 on an AVX2 EPYC: 3.5 ms a step). Elsewhere oneDNN's reorder
    // of 8x8 blocks ran faster than our copy (ResNet50 8x224: 13 ms against 22).
    const int side = result.reorders && output ? copyable_blocks(wanted, user_desc) : 0;
    result.copies_blocks = side == 16 || (side == 8 && zeroed_bytes) ? side : 0;
    if (result.reorders && !result.copies_blocks)
        result.reorder = output ? dnnl::reorder(result.inner, result.user) : dnnl::reorder(result.user, result.inner);
    return result;
}

template <typename PrimitiveDesc>
void own_scratchpad(Plan &plan, const PrimitiveDesc &pd) {
    plan.scratchpad = pd.scratchpad_desc();
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

// A kernel of which a part alone meets the image: one output pixel whose window holds the whole image
// (every ResNet's last stage at 32 px: 3x3 convolutions of 1x1 maps, and its first, strided, of 2x2
// maps). The other taps multiply padding zeros, so the convolution is an unpadded one of the image's
// size with those taps' weights: a ninth (a 1x1 image) or four ninths of the work and of the weights
// to reorder, and the other taps' weight gradient is zero (ResNet18 at 32 px, batch 64: the 1x1
// maps' convolutions took 12 ms of a 110 ms training step; the step went from about 99 to 85 ms).
bool image_inside_kernel(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p) {
    return p.groups == 1 && y[2] == 1 && y[3] == 1 && p.dilation_h == 1 && p.dilation_w == 1 && 0 <= p.pad_top &&
           p.pad_top + x[2] <= w[2] && 0 <= p.pad_left && p.pad_left + x[3] <= w[3] && x[2] * x[3] < w[2] * w[3];
}

// A float32 weight gradient of at most this many output pixels per image is one matrix product over
// the batch (weight_gradient_product): ResNet's last stages at 32 px, 2x2 and 1x1 maps. oneDNN's
// kernels have little to do per image there: on an AVX2 EPYC, batch 64, layer4's first 3x3 (2x2
// maps to 1x1) took 9.8 ms at 3.4 GMAC/s and layer3's 3x3 of 2x2 maps 11.5 ms (oneDNN's own pick,
// im2col and a small product per image); as one product 1.1 and 5.4 ms. At 4x4 maps they were even.
// Measured where oneDNN blocks float32 by 8 channels (AVX2) alone: its AVX-512 kernels (16) keep
// their own weight gradients (layer3's at 32 px ran at ~45% of that CPU's peak on an Intel Xeon).
constexpr int64_t kProductPixels = 4;

bool weight_gradient_as_product(const memory::dims &y, const ConvParams &p, dt x_type, dt y_type) {
    return !p.bf16 && x_type == dt::f32 && y_type == dt::f32 && p.groups == 1 && y[2] * y[3] <= kProductPixels &&
           state().f32_layout == tag::aBcd8b;
}

// The input's patches unrolled (im2col) from NCHW: a row per output pixel of the batch, its columns in
// OIHW's order (input channel, kernel row, kernel column), zeros where a tap falls in the padding.
void unroll_patches(const float *x, float *rows, const memory::dims &x_dims, const memory::dims &w_dims,
                    const memory::dims &y_dims, const memory::dims &strides, const memory::dims &dilation,
                    const memory::dims &pad_l) {
    Timed timed(kWeightGradientPatches);
    const int64_t channels = x_dims[1], height = x_dims[2], width = x_dims[3], kh = w_dims[2], kw = w_dims[3];
    const int64_t out_h = y_dims[2], out_w = y_dims[3], pixels = out_h * out_w, count = y_dims[0] * pixels;
    const int64_t columns = channels * kh * kw;
#pragma omp parallel for if (count * columns > kOneThreadElements)
    for (int64_t r = 0; r < count; ++r) {
        const int64_t n = r / pixels, oy = r % pixels / out_w, ox = r % out_w;
        float *out = rows + r * columns;
        for (int64_t c = 0; c < channels; ++c) {
            const float *plane = x + (n * channels + c) * height * width;
            for (int64_t ky = 0; ky < kh; ++ky) {
                const int64_t iy = oy * strides[0] - pad_l[0] + ky * (dilation[0] + 1);
                for (int64_t kx = 0; kx < kw; ++kx) {
                    const int64_t ix = ox * strides[1] - pad_l[1] + kx * (dilation[1] + 1);
                    *out++ = 0 <= iy && iy < height && 0 <= ix && ix < width ? plane[iy * width + ix] : 0.f;
                }
            }
        }
    }
}

// The product's taps (image_inside_kernel: those that meet the image, `taps` of the whole kernel
// `w_dims` at `at`) into the whole OIHW buffer, the other taps zero: one write of the buffer.
void place_taps(const float *product, float *whole, const memory::dims &w_dims, const memory::dims &taps,
                const memory::dims &at) {
    Timed timed(kWeightGradientCopies);
    const int64_t pairs = w_dims[0] * w_dims[1], kh = w_dims[2], kw = w_dims[3], th = taps[2], tw = taps[3];
#pragma omp parallel for if (pairs * kh * kw > kOneThreadElements)
    for (int64_t i = 0; i < pairs; ++i) {
        float *kernel = whole + i * kh * kw;
        std::memset(kernel, 0, kh * kw * sizeof(float));
        for (int64_t y = 0; y < th; ++y)
            for (int64_t x = 0; x < tw; ++x) kernel[(at[0] + y) * kw + at[1] + x] = product[(i * th + y) * tw + x];
    }
}

// dW[O, I*KH*KW] = dY[N*OH*OW, O]^T x patches[N*OH*OW, I*KH*KW]: the output gradient as rows of
// pixels (NHWC), the input's patches unrolled in OIHW's order, so the product is the OIHW gradient
// itself. `w_conv`, strides and padding are the convolution as conv_plan runs it; with `inside`, its
// taps go among zeros at `pad_at` of the whole kernel `w_dims` (place_taps).
std::unique_ptr<Plan> weight_gradient_product(const memory::dims &x_dims, const memory::dims &w_dims,
                                              const memory::dims &w_conv, const memory::dims &y_dims,
                                              const memory::dims &strides, const memory::dims &dilation,
                                              const memory::dims &pad_l, const memory::dims &pad_at,
                                              const memory::desc &x_user, const memory::desc &y_user, bool inside) {
    auto &engine = state().engine;
    const int64_t out_channels = y_dims[1], rows = y_dims[0] * y_dims[2] * y_dims[3];
    const int64_t columns = w_conv[1] * w_conv[2] * w_conv[3];
    const auto x_plain = memory::desc(x_dims, dt::f32, tag::nchw), dy_rows = memory::desc(y_dims, dt::f32, tag::nhwc);
    auto x_in = memory(x_user, engine, DNNL_MEMORY_NONE), dy_in = memory(y_user, engine, DNNL_MEMORY_NONE);
    auto x_nchw = x_user == x_plain ? x_in : memory(x_plain, engine);
    auto dy_nhwc = y_user == dy_rows ? dy_in : memory(dy_rows, engine);
    auto patches = memory(memory::desc({rows, columns}, dt::f32, tag::ab), engine);
    auto product_desc = memory::desc({out_channels, columns}, dt::f32, tag::ab);
    auto product = inside ? memory(product_desc, engine) : memory(product_desc, engine, DNNL_MEMORY_NONE);
    auto gradient = memory(memory::desc({out_channels, rows}, dt::f32, memory::dims{1, out_channels}), engine,
                           DNNL_MEMORY_NONE);  // dY^T, over dY's NHWC rows
    auto pd = dnnl::matmul::primitive_desc(engine, gradient.get_desc(), patches.get_desc(), product_desc,
                                           user_scratchpad());
    const auto x_reorder = x_nchw != x_in ? dnnl::reorder(x_in, x_nchw) : dnnl::reorder();
    const auto dy_reorder = dy_nhwc != dy_in ? dnnl::reorder(dy_in, dy_nhwc) : dnnl::reorder();
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::matmul(pd);
    plan->scratchpad = pd.scratchpad_desc();
    Plan *self = plan.get();
    plan->steps = [=](void **slots) mutable {
        using namespace conv_backward_weights;
        auto &s = state();
        x_in.set_data_handle(slots[x]);
        dy_in.set_data_handle(slots[dy]);
        if (x_reorder) x_reorder.execute(s.stream, x_in, x_nchw);
        if (dy_reorder) dy_reorder.execute(s.stream, dy_in, dy_nhwc);
        s.stream.wait();
        unroll_patches(static_cast<const float *>(x_nchw.get_data_handle()),
                       static_cast<float *>(patches.get_data_handle()), x_dims, w_conv, y_dims, strides, dilation,
                       pad_l);
        gradient.set_data_handle(dy_nhwc.get_data_handle());
        if (!inside) product.set_data_handle(slots[dw]);
        std::unordered_map<int, memory> args{{DNNL_ARG_SRC, gradient}, {DNNL_ARG_WEIGHTS, patches},
                                             {DNNL_ARG_DST, product}};
        if (const size_t bytes = self->scratchpad.get_size())
            args[DNNL_ARG_SCRATCHPAD] = memory(self->scratchpad, s.engine, scratchpad_of(s, bytes));
        self->primitive.execute(s.stream, args);
        if (inside) {
            s.stream.wait();
            place_taps(static_cast<const float *>(product.get_data_handle()), static_cast<float *>(slots[dw]),
                       w_dims, w_conv, pad_at);
        }
    };
    return plan;
}

// A convolution of which every output pixel's window holds the whole image: 3x3 convolutions of 2x2
// maps, at stride 1 or 2 (a ResNet's third stage at 32 px and its last stage's first layer). Each
// input pixel then meets each output pixel through exactly one tap, so for one image the layer is a
// dense matrix from its I*H*W values to its O*OH*OW ones, and over the batch one matrix product. Of a
// 3x3 kernel over 2x2 maps only 16 of the 36 tap-and-pixel pairs meet the image; oneDNN's direct
// kernels spend time on the others and on their loops around rows of two pixels. ResNet18 at 32 px
// on an AVX2 EPYC, batch 64, each of layer3's 3x3: forward 5.3 ms as oneDNN convolves it, 2.3 as the
// product plus 0.5 to build the matrix; backward data 3.4 against 2.3 + 0.5; the weight gradient 4.2
// as weight_gradient_product against 3.2 + 0.7 to sum the taps. A training step: 232 -> 214 ms at
// batch 64, 135 -> 125 at batch 32, even at batch 16 (whence the batch), and one image cannot pay
// for the matrix. Where oneDNN blocks float32 by 16 (AVX-512) its kernels ran these layers at 20-40%
// of an Intel Xeon's peak and the same product, tried there, was 2% faster at batch 64 and 4-8%
// slower at 32: so under AVX2 alone. Images of one pixel take this path too (a ResNet's last stage at
// 32 px): a 3x3 kernel meets them by its centre tap alone, the only tap read or written here, and
// oneDNN's 1x1 kernel, on image_inside_kernel's path, ran them at 16-17 GMAC/s. ResNet18's step at
// 32 px on the EPYC, in turn: 142 -> 132 ms at batch 32, 226 -> 220 at 64; ResNet50's, batch 32,
// 366-382 -> 347-370 ms.
constexpr int64_t kDenseBatch = 32;

bool as_dense_layer(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p, dt x_type,
                    dt y_type) {
    auto covers = [](int64_t size, int64_t out, int stride, int pad, int64_t kernel) {
        return 0 <= pad && size - 1 <= kernel - 1 - pad && (out - 1) * stride <= pad;
    };
    return !p.bf16 && x_type == dt::f32 && y_type == dt::f32 && p.groups == 1 && p.dilation_h == 1 &&
           p.dilation_w == 1 && x[0] >= kDenseBatch &&
           covers(x[2], y[2], p.stride_h, p.pad_top, w[2]) && covers(x[3], y[3], p.stride_w, p.pad_left, w[3]) &&
           state().f32_layout == tag::aBcd8b;
}

// A 1x1 kernel over 1x1 images: its dense matrix [O, I] is the OIHW weights buffer itself (and its
// gradient dW's), so the products read and write MindSpore's buffers, with nothing to build or sum.
bool matrix_is_weights(const memory::dims &x, const memory::dims &w, const memory::dims &y) {
    return w[2] * w[3] == 1 && x[2] * x[3] == 1 && y[2] * y[3] == 1;
}

// The dense layer's shape: a row per output value of an image, a column per input value, each in
// its tensor's order (channels blocked by `*_block`, 1: plain NCHW); the kernel's taps (ky * KW + kx)
// that join some output pixel to some input pixel, and which of them joins output pixel p and input
// pixel q. Only those taps are read or written in between: at a 1x1 image, the centre one of nine.
struct DenseLayer {
    int64_t in_channels, out_channels, in_pixels, out_pixels, kernel_taps, x_block, y_block;
    std::vector<int64_t> used;  // kernel taps, ascending
    std::vector<int64_t> taps;  // [p * in_pixels + q]: an index into `used`
    int64_t rows() const { return out_channels * out_pixels; }
    int64_t columns() const { return in_channels * in_pixels; }
    int64_t row(int64_t o, int64_t p) const { return (o / y_block * out_pixels + p) * y_block + o % y_block; }
};

DenseLayer dense_layer_of(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p,
                          int64_t x_block, int64_t y_block) {
    DenseLayer d{x[1], y[1], x[2] * x[3], y[2] * y[3], w[2] * w[3], x_block, y_block, {}, {}};
    d.taps.resize(static_cast<size_t>(d.out_pixels * d.in_pixels));
    for (int64_t out = 0; out < d.out_pixels; ++out)
        for (int64_t in = 0; in < d.in_pixels; ++in) {
            const int64_t ky = in / x[3] - out / y[3] * p.stride_h + p.pad_top;
            const int64_t kx = in % x[3] - out % y[3] * p.stride_w + p.pad_left;
            d.taps[out * d.in_pixels + in] = ky * w[3] + kx;  // as_dense_layer: within the kernel
        }
    d.used = d.taps;
    std::sort(d.used.begin(), d.used.end());
    d.used.erase(std::unique(d.used.begin(), d.used.end()), d.used.end());
    for (auto &tap : d.taps) tap = std::lower_bound(d.used.begin(), d.used.end(), tap) - d.used.begin();
    return d;
}

// Both loops below go one output channel at a time through its kernels tap by tap (by_tap[t * I +
// i]), so that a row of the matrix is built, or read, in runs of a channel block: a row's columns
// run (input block, pixel, channel within the block). The walk is written out in each: as one
// template over lambdas (the threads' region, or the rows) GCC left both at half the speed.

// `step(c)` for each channel of a block; a block of 8 as a fixed count, which the compiler unrolls
// into vector moves (as runs of `block` floats, a memmove call each for the copies, building layer3's
// matrix took 0.55 ms and summing its gradient 0.70; so, 0.36 and 0.38).
template <typename Step>
inline void each_in_block(int64_t block, Step step) {
    if (block == 8) {
        for (int c = 0; c < 8; ++c) step(c);
    } else {
        for (int64_t c = 0; c < block; ++c) step(c);
    }
}

// The weights (OIHW) spread into the dense matrix.
void spread_weights(const DenseLayer &d, const float *w, float *dense) {
    Timed timed(kDenseMatrices);
    const int64_t columns = d.columns(), taps = d.kernel_taps, in = d.in_channels, block = d.x_block;
    const int64_t used = static_cast<int64_t>(d.used.size());
#pragma omp parallel if (d.rows() * columns > kOneThreadElements)
    {
        std::vector<float> by_tap(static_cast<size_t>(used * in));
#pragma omp for
        for (int64_t o = 0; o < d.out_channels; ++o) {
            const float *kernels = w + o * in * taps;
            for (int64_t i = 0; i < in; ++i)
                for (int64_t u = 0; u < used; ++u) by_tap[u * in + i] = kernels[i * taps + d.used[u]];
            for (int64_t out = 0; out < d.out_pixels; ++out) {
                float *row = dense + d.row(o, out) * columns;
                const int64_t *tap = d.taps.data() + out * d.in_pixels;
                for (int64_t ib = 0; ib < in; ib += block)
                    for (int64_t q = 0; q < d.in_pixels; ++q, row += block) {
                        const float *from = by_tap.data() + tap[q] * in + ib;
                        each_in_block(block, [&](int64_t c) { row[c] = from[c]; });
                    }
            }
        }
    }
}

// `count` floats copied with streaming stores: for a buffer read long after (the optimizer reads the
// weight gradients at the step's end), past the caches and without reading its lines first. At a 1x1
// image, eight of a 3x3 kernel's nine taps are zeros written this way.
void stream_out(const float *from, float *to, int64_t count) {
    int64_t i = 0;
    for (; i < count && reinterpret_cast<uintptr_t>(to + i) % 16 != 0; ++i) to[i] = from[i];
    for (; i + 4 <= count; i += 4) _mm_stream_ps(to + i, _mm_loadu_ps(from + i));
    for (; i < count; ++i) to[i] = from[i];
}

// The dense matrix's gradient summed back onto the kernel's taps (OIHW), taps no pixel pair uses zero;
// each kernel's sums in one order, whatever the threads.
void gather_taps(const DenseLayer &d, const float *dense, float *dw) {
    Timed timed(kDenseMatrices);
    const int64_t columns = d.columns(), taps = d.kernel_taps, in = d.in_channels, block = d.x_block;
    const int64_t used = static_cast<int64_t>(d.used.size());
#pragma omp parallel if (d.rows() * columns > kOneThreadElements)
    {
        std::vector<float> by_tap(static_cast<size_t>(used * in)), kernels(static_cast<size_t>(in * taps), 0.f);
#pragma omp for
        for (int64_t o = 0; o < d.out_channels; ++o) {
            std::fill(by_tap.begin(), by_tap.end(), 0.f);
            for (int64_t out = 0; out < d.out_pixels; ++out) {
                const float *row = dense + d.row(o, out) * columns;
                const int64_t *tap = d.taps.data() + out * d.in_pixels;
                for (int64_t ib = 0; ib < in; ib += block)
                    for (int64_t q = 0; q < d.in_pixels; ++q, row += block) {
                        float *sums = by_tap.data() + tap[q] * in + ib;
                        each_in_block(block, [&](int64_t c) { sums[c] += row[c]; });
                    }
            }
            for (int64_t i = 0; i < in; ++i)
                for (int64_t u = 0; u < used; ++u) kernels[i * taps + d.used[u]] = by_tap[u * in + i];
            stream_out(kernels.data(), dw + o * in * taps, in * taps);
        }
        _mm_sfence();  // this thread's streamed stores are visible before the kernel returns
    }
}

// The batch's images as rows: X[N, I*H*W] and Y[N, O*OH*OW] over MindSpore's buffers as they are, and D
// the dense matrix [O*OH*OW, I*H*W]. Forward Y = X D^T, backward data dX = dY D, backward weights
// D = dY^T X summed onto the taps.
std::unique_ptr<Plan> dense_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                 const memory::dims &y_dims, const ConvParams &p, const memory::desc &x_user,
                                 const memory::desc &y_user, int64_t matrix_elements) {
    auto block = [](const memory::desc &d) { return d.get_inner_nblks() ? d.get_inner_blks()[0] : int64_t{1}; };
    const DenseLayer d = dense_layer_of(x_dims, w_dims, y_dims, p, block(x_user), block(y_user));
    const int64_t images = x_dims[0], rows = d.rows(), columns = d.columns();
    auto matrix = [](int64_t r, int64_t c) { return memory::desc({r, c}, dt::f32, tag::ab); };
    auto transposed = [](int64_t r, int64_t c) { return memory::desc({r, c}, dt::f32, memory::dims{1, r}); };
    // Each operand's matrix and its place in the product (source x weights = destination).
    struct Side {
        memory::desc desc;
        int arg, slot;
    } x, y, layer;
    if (kind == kConvForward) {
        x = {matrix(images, columns), DNNL_ARG_SRC, conv_forward::x};
        layer = {transposed(columns, rows), DNNL_ARG_WEIGHTS, conv_forward::w};
        y = {matrix(images, rows), DNNL_ARG_DST, conv_forward::y};
    } else if (kind == kConvBackwardData) {
        y = {matrix(images, rows), DNNL_ARG_SRC, conv_backward_data::dy};
        layer = {matrix(rows, columns), DNNL_ARG_WEIGHTS, conv_backward_data::w};
        x = {matrix(images, columns), DNNL_ARG_DST, conv_backward_data::dx};
    } else {
        y = {transposed(rows, images), DNNL_ARG_SRC, conv_backward_weights::dy};
        x = {matrix(images, columns), DNNL_ARG_WEIGHTS, conv_backward_weights::x};
        layer = {matrix(rows, columns), DNNL_ARG_DST, conv_backward_weights::dw};
    }
    auto descs = [&](int arg) { return (x.arg == arg ? x : y.arg == arg ? y : layer).desc; };
    auto pd = dnnl::matmul::primitive_desc(state().engine, descs(DNNL_ARG_SRC), descs(DNNL_ARG_WEIGHTS),
                                           descs(DNNL_ARG_DST), user_scratchpad());
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::matmul(pd);
    plan->scratchpad = pd.scratchpad_desc();
    // An evaluation's forward keeps its matrix per weights tensor while they are frozen, as the other
    // convolutions keep their weights' reorders (in the weights operand's `kept`, which freezing and
    // thawing drop): built once per evaluation, not per batch.
    const bool itself = matrix_is_weights(x_dims, w_dims, y_dims);
    const bool keeps = kind == kConvForward && p.inference && !itself;
    if (keeps) {
        plan->operands.push_back(Operand{DNNL_ARG_WEIGHTS, layer.slot, false, memory(), memory(), false, {}});
        plan->operands.back().keeps_reorders = true;
    }
    Plan *self = plan.get();
    const bool gradient = kind == kConvBackwardWeights;
    // A training forward writes its matrix into its `matrix` output, which the backward of the image
    // gradient is given (cells.py's bprop): built once per step, not twice. The slot is used when it
    // holds the whole matrix (cells.py sizes it by WeightMatrixElements); else the shared buffer.
    const bool in_slot = !keeps && !gradient && matrix_elements == rows * columns;
    const int matrix_slot = kind == kConvForward ? int(conv_forward::matrix) : int(conv_backward_data::matrix);
    const bool given = in_slot && kind == kConvBackwardData;  // built by the forward
    plan->steps = [=](void **slots) {
        auto &s = state();
        float *dense = nullptr;
        if (itself) {
            dense = static_cast<float *>(slots[layer.slot]);
        } else if (keeps && g_frozen_version != 0) {
            auto &kept = self->operands.front().kept;
            auto found = kept.find(slots[layer.slot]);
            if (found == kept.end()) {
                auto matrix = std::make_pair(memory(layer.desc, s.engine), uint64_t{0});
                found = kept.emplace(slots[layer.slot], std::move(matrix)).first;
            }
            auto &[matrix, version] = found->second;
            dense = static_cast<float *>(matrix.get_data_handle());
            if (version != g_frozen_version) {
                spread_weights(d, static_cast<const float *>(slots[layer.slot]), dense);
                version = g_frozen_version;
            }
        } else {
            dense = in_slot ? static_cast<float *>(slots[matrix_slot])
                            : static_cast<float *>(grown(s.dense, s.dense_bytes, rows * columns * sizeof(float)));
            if (!gradient && !given) spread_weights(d, static_cast<const float *>(slots[layer.slot]), dense);
        }
        std::unordered_map<int, memory> args{{x.arg, memory(x.desc, s.engine, slots[x.slot])},
                                             {y.arg, memory(y.desc, s.engine, slots[y.slot])},
                                             {layer.arg, memory(layer.desc, s.engine, dense)}};
        if (const size_t bytes = self->scratchpad.get_size())
            args[DNNL_ARG_SCRATCHPAD] = memory(self->scratchpad, s.engine, scratchpad_of(s, bytes));
        self->primitive.execute(s.stream, args);
        if (gradient && !itself) {
            s.stream.wait();
            gather_taps(d, dense, static_cast<float *>(slots[layer.slot]));
        }
    };
    return plan;
}

std::unique_ptr<Plan> conv_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                const memory::dims &y_dims, const ConvParams &p, dt x_type, dt y_type,
                                int64_t matrix_elements = 0) {
    auto &engine = state().engine;
    const bool inside = image_inside_kernel(x_dims, w_dims, y_dims, p);
    memory::dims strides{p.stride_h, p.stride_w};
    memory::dims dilation{p.dilation_h - 1, p.dilation_w - 1};
    memory::dims pad_l{p.pad_top, p.pad_left};
    memory::dims pad_r{p.pad_bottom, p.pad_right};
    memory::dims w_conv = w_dims;  // the weights the primitive convolves with
    if (inside) {
        strides = {1, 1}, pad_l = {0, 0}, pad_r = {0, 0};
        w_conv = {w_dims[0], w_dims[1], x_dims[2], x_dims[3]};
    }
    const dt compute = p.bf16 ? dt::bf16 : dt::f32;
    if (as_dense_layer(x_dims, w_dims, y_dims, p, x_type, y_type))
        return dense_plan(kind, x_dims, w_dims, y_dims, p, activation(x_dims, x_type, p.layout & 1),
                          activation(y_dims, y_type, p.layout & 2), matrix_elements);
    if (kind == kConvBackwardWeights && weight_gradient_as_product(y_dims, p, x_type, y_type))
        return weight_gradient_product(x_dims, w_dims, w_conv, y_dims, strides, dilation, pad_l,
                                       {p.pad_top, p.pad_left}, activation(x_dims, x_type, p.layout & 1),
                                       activation(y_dims, y_type, p.layout & 2), inside);
    auto x_any = memory::desc(x_dims, compute, tag::any);
    auto y_any = memory::desc(y_dims, compute, tag::any);
    auto w_any = weights_desc(w_conv, p.groups, compute, tag::any);
    auto x_user = activation(x_dims, x_type, p.layout & 1);
    auto y_user = activation(y_dims, y_type, p.layout & 2);
    auto w_user = weights_desc(w_dims, p.groups, dt::f32, tag::oihw);
    if (inside) w_user = w_user.submemory_desc(w_conv, {0, 0, p.pad_top, p.pad_left});  // those taps of the OIHW buffer
    // Those taps are strided through the whole OIHW buffer (a ninth of it at 1x1 images), which the
    // forward's and the image gradient's weight reorders each read. A training forward copies them out
    // once, into its `matrix` output, and the image gradient's backward, handed that copy (cells.py's
    // bprop), reorders from it.
    const auto taps = weights_desc(w_conv, p.groups, dt::f32, tag::oihw);
    const bool taps_handed = inside && !p.inference && kind != kConvBackwardWeights &&
                             matrix_elements == element_count(4, w_conv.data());
    auto attr = user_scratchpad();
    // forward_training for evaluation too: for inference oneDNN chose kernels that want NHWC here (two
    // more reorders per layer; a ResNet18 32 px evaluation at batch 64 took longer)
    auto forward = dnnl::convolution_forward::primitive_desc(
        engine, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x_any, w_any, y_any,
        strides, dilation, pad_l, pad_r, attr);
    auto plan = std::make_unique<Plan>();
    if (kind == kConvForward) {
        plan->primitive = dnnl::convolution_forward(forward);
        using namespace conv_forward;
        plan->operands = {operand(DNNL_ARG_SRC, x, false, x_user, forward.src_desc()),
                          taps_handed ? operand(DNNL_ARG_WEIGHTS, matrix, false, taps, forward.weights_desc())
                                      : operand(DNNL_ARG_WEIGHTS, w, false, w_user, forward.weights_desc()),
                          operand(DNNL_ARG_DST, y, true, y_user, forward.dst_desc())};
        if (taps_handed) {
            plan->prelude = std::make_unique<Plan>();
            plan->prelude->primitive = dnnl::reorder(memory(w_user, engine), memory(taps, engine));
            plan->prelude->operands = {operand(DNNL_ARG_FROM, w, false, w_user, w_user),
                                       operand(DNNL_ARG_TO, matrix, true, taps, taps)};
        }
        plan->operands[1].keeps_reorders = p.inference && plan->operands[1].reorders;
        own_scratchpad(*plan, forward);
    } else if (kind == kConvBackwardData) {
        auto backward = dnnl::convolution_backward_data::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, w_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_data(backward);
        using namespace conv_backward_data;
        plan->operands = {operand(DNNL_ARG_DIFF_DST, dy, false, y_user, backward.diff_dst_desc()),
                          taps_handed ? operand(DNNL_ARG_WEIGHTS, matrix, false, taps, backward.weights_desc())
                                      : operand(DNNL_ARG_WEIGHTS, w, false, w_user, backward.weights_desc()),
                          operand(DNNL_ARG_DIFF_SRC, dx, true, x_user, backward.diff_src_desc())};
        own_scratchpad(*plan, backward);
    } else {
        // bf16 weight gradients are accumulated in f32 (the master weights' type).
        auto dw_any = weights_desc(w_conv, p.groups, dt::f32, tag::any);
        auto backward = dnnl::convolution_backward_weights::primitive_desc(
            engine, dnnl::algorithm::convolution_direct, x_any, dw_any, y_any, strides, dilation, pad_l, pad_r,
            forward, attr);
        plan->primitive = dnnl::convolution_backward_weights(backward);
        using namespace conv_backward_weights;
        const size_t zeroed = inside ? element_count(4, w_dims.data()) * sizeof(float) : 0;
        plan->operands = {operand(DNNL_ARG_SRC, x, false, x_user, backward.src_desc()),
                          operand(DNNL_ARG_DIFF_DST, dy, false, y_user, backward.diff_dst_desc()),
                          operand(DNNL_ARG_DIFF_WEIGHTS, dw, true, w_user, backward.diff_weights_desc(), zeroed)};
        own_scratchpad(*plan, backward);
    }
    return plan;
}

// Batch normalization on blocked tensors, per channel: scale (gamma) and shift (beta), slots as
// NORM_FORWARD_SLOTS and NORM_BACKWARD_SLOTS say. The batch variance is the biased one oneDNN
// normalizes with; with global_stats the given statistics are used and are not written out. The
// workspace is the uint8 tensor the Python op gives it, one byte per element of x: more than oneDNN
// asks (a bit each), checked here.
std::unique_ptr<Plan> norm_plan(Kind kind, const memory::dims &x_dims, const NormParams &p, int64_t workspace_bytes,
                                dt type) {
    auto &engine = state().engine;
    const bool relu = p.activation == 1.f, add = p.activation == 2.f;
    auto data = activation(x_dims, type, true);
    auto elements = flat(element_count(4, x_dims.data()), type);
    auto channel = memory::desc({x_dims[1]}, dt::f32, tag::a);
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
    if (is_norm_forward(kind)) {
        plan->primitive = dnnl::batch_normalization_forward(forward);
        const bool given = p.global_stats != 0.f;
        using namespace norm_forward;
        plan->operands = {operand(DNNL_ARG_SRC, x, false, data, forward.src_desc()),
                          operand(DNNL_ARG_SCALE, gamma, false, channel, channel),
                          operand(DNNL_ARG_SHIFT, beta, false, channel, channel),
                          operand(DNNL_ARG_MEAN, given ? mean : batch_mean, !given, channel, channel),
                          operand(DNNL_ARG_VARIANCE, given ? variance : batch_variance, !given, channel, channel),
                          operand(DNNL_ARG_DST, y, true, data, forward.dst_desc())};
        if (relu) plan->operands.push_back(workspace(norm_forward::workspace));
        own_scratchpad(*plan, forward);
        if (add && kind == kNormForward) {  // y = max(y + residual, 0), in place (forked: add_relu_twice)
            dnnl::post_ops relu_after;
            relu_after.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
            auto add_attr = user_scratchpad();
            add_attr.set_post_ops(relu_after);
            auto addition = dnnl::binary::primitive_desc(engine, dnnl::algorithm::binary_add, elements, elements,
                                                         elements, add_attr);
            plan->postlude = std::make_unique<Plan>();
            plan->postlude->primitive = dnnl::binary(addition);
            plan->postlude->operands = {operand(DNNL_ARG_SRC_0, y, false, elements, elements),
                                        operand(DNNL_ARG_SRC_1, residual, false, elements, elements),
                                        operand(DNNL_ARG_DST, y, true, elements, elements)};
            own_scratchpad(*plan->postlude, addition);
        }
    } else {
        auto backward = dnnl::batch_normalization_backward::primitive_desc(
            engine, dnnl::prop_kind::backward, data, data, data, p.epsilon, flags, forward, attr);
        plan->primitive = dnnl::batch_normalization_backward(backward);
        using namespace norm_backward;
        plan->operands = {operand(DNNL_ARG_SRC, x, false, data, backward.src_desc()),
                          // with the residual: dy masked by the output, written by the prelude
                          operand(DNNL_ARG_DIFF_DST, add ? dresidual : dy, false, data, backward.diff_dst_desc()),
                          operand(DNNL_ARG_MEAN, mean, false, channel, channel),
                          operand(DNNL_ARG_VARIANCE, variance, false, channel, channel),
                          operand(DNNL_ARG_SCALE, gamma, false, channel, channel),
                          operand(DNNL_ARG_DIFF_SRC, dx, true, data, backward.diff_src_desc()),
                          operand(DNNL_ARG_DIFF_SCALE, dgamma, true, channel, channel),
                          operand(DNNL_ARG_DIFF_SHIFT, dbeta, true, channel, channel)};
        if (relu) plan->operands.push_back(workspace(norm_backward::workspace));
        own_scratchpad(*plan, backward);
        if (add && kind == kNormBackward) {  // first dresidual = dy where the output passed the ReLU, else 0
            const auto algorithm = dnnl::algorithm::eltwise_relu_use_dst_for_bwd;
            auto relu_forward = dnnl::eltwise_forward::primitive_desc(engine, dnnl::prop_kind::forward_training,
                                                                      algorithm, elements, elements, 0.f, 0.f);
            auto mask = dnnl::eltwise_backward::primitive_desc(engine, algorithm, elements, elements, elements, 0.f,
                                                               0.f, relu_forward, attr);
            plan->prelude = std::make_unique<Plan>();
            plan->prelude->primitive = dnnl::eltwise_backward(mask);
            plan->prelude->operands = {operand(DNNL_ARG_DST, y, false, elements, elements),
                                       operand(DNNL_ARG_DIFF_DST, dy, false, elements, elements),
                                       operand(DNNL_ARG_DIFF_SRC, dresidual, true, elements, elements)};
            own_scratchpad(*plan->prelude, mask);
        }
    }
    return plan;
}

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
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::sum(sum);
    plan->operands = {operand(DNNL_ARG_MULTIPLE_SRC, sum_slots::a, false, elements, elements),
                      operand(DNNL_ARG_MULTIPLE_SRC + 1, sum_slots::b, false, elements, elements),
                      operand(DNNL_ARG_DST, sum_slots::y, true, elements, elements)};
    own_scratchpad(*plan, sum);
    return plan;
}

// The weights of an inference forward in the primitive's layout: reordered into a buffer of their own
// unless that buffer holds them already, reordered under the frozen version in force.
memory kept_reorder(Operand &o, void *handle) {
    auto &s = state();
    auto found = o.kept.find(handle);
    if (found == o.kept.end())
        found = o.kept.emplace(handle, std::make_pair(memory(o.inner.get_desc(), s.engine), uint64_t{0})).first;
    auto &[buffer, version] = found->second;
    if (g_frozen_version == 0 || version != g_frozen_version) {
        o.reorder.execute(s.stream, o.user, buffer);
        version = g_frozen_version;
    }
    return buffer;
}

void execute(Plan &plan, void **slots) {
    if (plan.steps) {
        plan.steps(slots);
        return;
    }
    auto &s = state();
    if (plan.prelude) execute(*plan.prelude, slots);
    std::unordered_map<int, memory> args = plan.owned;
    if (const size_t bytes = plan.scratchpad.get_size())
        args[DNNL_ARG_SCRATCHPAD] = memory(plan.scratchpad, s.engine, scratchpad_of(s, bytes));
    for (auto &o : plan.operands) {
        o.user.set_data_handle(slots[o.slot]);
        if (o.zeroed_bytes && !o.copies_blocks) {
            Timed timed(kZeroedGradients);
            std::memset(slots[o.slot], 0, o.zeroed_bytes);
        }
        if (o.keeps_reorders) {
            args[o.arg] = kept_reorder(o, slots[o.slot]);
            continue;
        }
        if (o.reorders && !o.output) o.reorder.execute(s.stream, o.user, o.inner);
        args[o.arg] = o.inner;
    }
    plan.primitive.execute(s.stream, args);
    for (auto &o : plan.operands) {
        if (!o.reorders || !o.output) continue;
        if (o.copies_blocks) {
            s.stream.wait();
            Timed timed(kWeightGradientCopies);
            copy_blocks_out(o.copies_blocks, o.inner, o.user, o.zeroed_bytes != 0);
        } else {
            o.reorder.execute(s.stream, o.inner, o.user);
        }
    }
    if (plan.postlude) execute(*plan.postlude, slots);
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

// What each kernel takes, checked before anything is read: the slot count, where its parameter
// record is (and of which type and size), which slot is the uint8 workspace, which hold [N, C, H, W]
// tensors. Every other argument is float32 or bfloat16 (which combinations of those a primitive
// takes is oneDNN's to say).
struct KernelInfo {
    const char *name;
    const char *slots;  // the names, each followed by a comma
    int count;
    int params_slot;  // -1: none
    size_t params_size;
    const char *params_dtype;
    int workspace_slot;  // -1: none
    std::vector<int> four_d;
};

const KernelInfo &info(Kind kind) {
    static const KernelInfo table[] = {
        {"ConvForward", CONV_FORWARD_SLOTS(NAME_OF), conv_forward::count, conv_forward::params, sizeof(ConvParams),
         "int32", -1, {conv_forward::x, conv_forward::w, conv_forward::y}},
        {"ConvBackwardData", CONV_BACKWARD_DATA_SLOTS(NAME_OF), conv_backward_data::count, conv_backward_data::params,
         sizeof(ConvParams), "int32", -1,
         {conv_backward_data::dy, conv_backward_data::w, conv_backward_data::x_shape, conv_backward_data::dx}},
        {"ConvBackwardWeights", CONV_BACKWARD_WEIGHTS_SLOTS(NAME_OF), conv_backward_weights::count,
         conv_backward_weights::params, sizeof(ConvParams), "int32", -1,
         {conv_backward_weights::x, conv_backward_weights::dy, conv_backward_weights::w_shape,
          conv_backward_weights::dw}},
        {"NormForward", NORM_FORWARD_SLOTS(NAME_OF), norm_forward::count, norm_forward::params, sizeof(NormParams),
         "float32", norm_forward::workspace, {norm_forward::x, norm_forward::y}},
        {"NormBackward", NORM_BACKWARD_SLOTS(NAME_OF), norm_backward::count, norm_backward::params,
         sizeof(NormParams), "float32", norm_backward::workspace,
         {norm_backward::x, norm_backward::dy, norm_backward::y, norm_backward::dx}},
        {"PoolForward", POOL_FORWARD_SLOTS(NAME_OF), pool_forward::count, pool_forward::params, sizeof(PoolParams),
         "int32", -1, {pool_forward::x, pool_forward::y}},
        {"PoolBackward", POOL_BACKWARD_SLOTS(NAME_OF), pool_backward::count, pool_backward::params,
         sizeof(PoolParams), "int32", -1, {pool_backward::x, pool_backward::dy, pool_backward::dx}},
        {"ToPlain", REORDER_SLOTS(NAME_OF), reorder_slots::count, -1, 0, "", -1, {reorder_slots::x, reorder_slots::y}},
        {"ToBlocked", REORDER_SLOTS(NAME_OF), reorder_slots::count, -1, 0, "", -1,
         {reorder_slots::x, reorder_slots::y}},
        {"Sum", SUM_SLOTS(NAME_OF), sum_slots::count, -1, 0, "", -1, {}},
        {"NormForwardForked", NORM_FORWARD_FORKED_SLOTS(NAME_OF), norm_forward_forked::count, norm_forward::params,
         sizeof(NormParams), "float32", norm_forward::workspace,
         {norm_forward::x, norm_forward::y, norm_forward_forked::y_copy}},
        {"NormBackwardSummed", NORM_BACKWARD_SUMMED_SLOTS(NAME_OF), norm_backward_summed::count,
         norm_backward::params, sizeof(NormParams), "float32", norm_backward::workspace,
         {norm_backward::x, norm_backward::dy, norm_backward::y, norm_backward::dx, norm_backward_summed::dy_copy}},
    };
    return table[kind];
}

// "x float32[8,64,56,56], w float32[64,64,3,3], ...": the arguments a failed kernel was given.
std::string arguments_text(const char *slots, int nparam, int *ndims, int64_t **shapes, const char **dtypes) {
    std::vector<std::string> names;
    for (const char *name = slots; name && *name;) {
        const char *comma = std::strchr(name, ',');
        names.emplace_back(name, comma - name);
        name = comma + 1;
    }
    std::string text;
    for (int i = 0; i < nparam; ++i) {
        text += (i ? ", " : "") + (static_cast<size_t>(i) < names.size() ? names[i] : "#" + std::to_string(i)) + " " +
                dtypes[i] + "[";
        for (int d = 0; d < ndims[i]; ++d) text += (d ? "," : "") + std::to_string(shapes[i][d]);
        text += "]";
    }
    return text;
}

// Records the one-line message LastError gives back: the kernel, its arguments, what went wrong.
int fail(const char *name, const char *slots, int nparam, int *ndims, int64_t **shapes, const char **dtypes,
         const std::string &problem) {
    g_error = std::string(name) + "(" + arguments_text(slots, nparam, ndims, shapes, dtypes) + "): " + problem;
    return 1;
}

// Why a kernel cannot take these arguments, or "" when it can.
std::string arguments_problem(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes,
                              const char **dtypes) {
    const KernelInfo &k = info(kind);
    if (nparam != k.count)
        return "takes " + std::to_string(k.count) + " arguments, was given " + std::to_string(nparam);
    for (int i = 0; i < nparam; ++i) {
        const std::string type = dtypes[i];
        const char *wanted = i == k.params_slot ? k.params_dtype : i == k.workspace_slot ? "uint8" : nullptr;
        if (wanted ? type != wanted : type != "float32" && type != "bfloat16")
            return "argument " + std::to_string(i) + " is " + type + ", not " + (wanted ? wanted : "float32 or bfloat16");
    }
    for (int i : k.four_d)
        if (ndims[i] != 4) return "argument " + std::to_string(i) + " has " + std::to_string(ndims[i]) + " dimensions, not 4";
    if (k.params_slot >= 0 &&
        (ndims[k.params_slot] != 1 || static_cast<size_t>(shapes[k.params_slot][0]) * 4 != k.params_size))
        return "the parameter record holds " + std::to_string(element_count(ndims[k.params_slot], shapes[k.params_slot])) +
               " values, not " + std::to_string(k.params_size / 4);
    if (is_norm(kind)) {
        const auto &p = *static_cast<const NormParams *>(params[k.params_slot]);
        if (p.activation != 0.f && p.activation != 1.f && p.activation != 2.f)
            return "the normalization's activation " + std::to_string(p.activation) + " is not 0, 1 or 2";
        if ((kind == kNormForwardForked || kind == kNormBackwardSummed) &&
            (p.activation != 2.f || std::strcmp(dtypes[0], "float32") != 0))
            return "a forked normalization ends a block (activation 2, add_relu) on float32 tensors";
        const int residual = is_norm_forward(kind) ? int(norm_forward::residual) : int(norm_backward::residual);
        if (p.activation == 2.f && (element_count(ndims[residual], shapes[residual]) != element_count(4, shapes[0]) ||
                                    std::strcmp(dtypes[residual], dtypes[0]) != 0))
            return "the residual added after the normalization is not of its input's shape and type";
    }
    if (kind == kConvForward || kind == kConvBackwardData || kind == kConvBackwardWeights) {
        const auto &p = *static_cast<const ConvParams *>(params[k.params_slot]);
        if (p.stride_h < 1 || p.stride_w < 1 || p.dilation_h < 1 || p.dilation_w < 1 || p.groups < 1 ||
            (p.bf16 != 0 && p.bf16 != 1) || p.layout < 0 || p.layout > 3 || (p.inference != 0 && p.inference != 1))
            return "the convolution's parameter record is out of range (stride, dilation and groups >= 1, bf16 0 or "
                   "1, layout 0-3, inference 0 or 1)";
    }
    if (kind == kPoolForward || kind == kPoolBackward) {
        const auto &p = *static_cast<const PoolParams *>(params[k.params_slot]);
        if (p.kernel < 1 || p.stride < 1 || p.pad < 0 || p.pad >= p.kernel)
            return "the pooling's parameter record is out of range";
    }
    return "";
}

std::string key_of(Kind kind, int nparam, int *ndims, int64_t **shapes, const char **dtypes, const void *params,
                   size_t size) {
    std::string key = std::to_string(kind) + ";threads " + std::to_string(omp_get_max_threads());
    for (int i = 0; i < nparam; ++i) {
        key += std::string(";") + dtypes[i];
        for (int d = 0; d < ndims[i]; ++d) key += "," + std::to_string(shapes[i][d]);
    }
    key.append(static_cast<const char *>(params), size);
    return key;
}

std::unique_ptr<Plan> make_plan(Kind kind, int *ndims, int64_t **shapes, const char **dtypes, const void *raw,
                                int64_t workspace_bytes) {
    if (kind == kConvForward || kind == kConvBackwardData || kind == kConvBackwardWeights) {
        ConvParams p;
        std::memcpy(&p, raw, sizeof(p));
        memory::dims x, w, y;
        int x_slot, y_slot;  // the x and y (or dx and dy) arguments, whose types the user descriptors take
        int64_t matrix_elements = 0;
        if (kind == kConvForward) {
            x = dims_of(shapes[conv_forward::x], 4), w = dims_of(shapes[conv_forward::w], 4);
            y = dims_of(shapes[conv_forward::y], 4), x_slot = conv_forward::x, y_slot = conv_forward::y;
            matrix_elements = element_count(ndims[conv_forward::matrix], shapes[conv_forward::matrix]);
        } else if (kind == kConvBackwardData) {
            x = dims_of(shapes[conv_backward_data::x_shape], 4), w = dims_of(shapes[conv_backward_data::w], 4);
            y = dims_of(shapes[conv_backward_data::dy], 4);
            x_slot = conv_backward_data::dx, y_slot = conv_backward_data::dy;
            matrix_elements = element_count(ndims[conv_backward_data::matrix], shapes[conv_backward_data::matrix]);
        } else {
            x = dims_of(shapes[conv_backward_weights::x], 4), w = dims_of(shapes[conv_backward_weights::w_shape], 4);
            y = dims_of(shapes[conv_backward_weights::dy], 4);
            x_slot = conv_backward_weights::x, y_slot = conv_backward_weights::dy;
        }
        if (p.pad_top < 0) same_padding(p, x, w);
        return conv_plan(kind, x, w, y, p, data_type(dtypes[x_slot]), data_type(dtypes[y_slot]), matrix_elements);
    }
    if (is_norm(kind)) {
        NormParams p;
        std::memcpy(&p, raw, sizeof(p));
        return norm_plan(kind, dims_of(shapes[0], 4), p, workspace_bytes, data_type(dtypes[0]));
    }
    if (kind == kPoolForward || kind == kPoolBackward) {
        PoolParams p;
        std::memcpy(&p, raw, sizeof(p));
        auto y = kind == kPoolForward ? shapes[pool_forward::y] : shapes[pool_backward::dy];
        return pool_plan(kind, dims_of(shapes[0], 4), dims_of(y, 4), p, data_type(dtypes[0]));
    }
    if (kind == kSum) return sum_plan(element_count(ndims[0], shapes[0]), data_type(dtypes[0]));
    return reorder_plan(kind, dims_of(shapes[0], 4), data_type(dtypes[0]), data_type(dtypes[1]));
}

// The cached plan for `key`, made by `make` when missing; the least recently used go beyond the limit.
template <typename Make>
Plan &cached_plan(State &s, const std::string &key, Make make) {
    auto found = s.plans.find(key);
    if (found == s.plans.end()) {
        auto plan = make();
        while (!s.plans.empty() && s.plans.size() >= s.plan_limit)
            s.plans.erase(std::min_element(s.plans.begin(), s.plans.end(), [](const auto &a, const auto &b) {
                return a.second.used < b.second.used;
            }));
        found = s.plans.emplace(key, CachedPlan{std::move(plan), 0}).first;
    }
    found->second.used = ++s.clock;
    return *found->second.plan;
}


int plan_threads(Kind kind, int *ndims, int64_t **shapes) {
    int64_t work = 0, limit = kOneThreadElements;
    if (kind == kConvForward || kind == kConvBackwardData || kind == kConvBackwardWeights) {
        // (x, y, w) slots: a convolution's multiply-accumulates are y's elements x w's per output channel
        const int64_t *w = kind == kConvForward ? shapes[conv_forward::w]
                           : kind == kConvBackwardData ? shapes[conv_backward_data::w]
                                                       : shapes[conv_backward_weights::w_shape];
        const int64_t *y = kind == kConvForward ? shapes[conv_forward::y]
                           : kind == kConvBackwardData ? shapes[conv_backward_data::dy]
                                                       : shapes[conv_backward_weights::dy];
        work = element_count(4, y) * w[1] * w[2] * w[3];
        limit = kOneThreadMacs;
    } else {
        work = element_count(ndims[0], shapes[0]);
    }
    return work < limit ? 1 : kernel_threads();
}

int run(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    const KernelInfo &k = info(kind);
    try {
        auto &s = state();
        std::lock_guard<std::mutex> guard(s.lock);
        const std::string problem = arguments_problem(kind, nparam, params, ndims, shapes, dtypes);
        if (!problem.empty()) return fail(k.name, k.slots, nparam, ndims, shapes, dtypes, problem);
        const void *raw = k.params_slot >= 0 ? params[k.params_slot] : "";
        use_threads(plan_threads(kind, ndims, shapes));
        if (kind == kConvForward && !static_cast<const ConvParams *>(raw)->inference) g_frozen_version = 0;
        const int64_t workspace_bytes =
            k.workspace_slot >= 0 ? element_count(ndims[k.workspace_slot], shapes[k.workspace_slot]) : 0;
        auto &plan = cached_plan(s, key_of(kind, nparam, ndims, shapes, dtypes, raw, k.params_size),
                                 [&] { return make_plan(kind, ndims, shapes, dtypes, raw, workspace_bytes); });
        if (kind == kNormBackward && static_cast<const NormParams *>(raw)->activation != 2.f)
            zero_stand_in_gradient(params, shapes[norm_backward::residual], ndims[norm_backward::residual],
                                   dtypes[norm_backward::residual]);
        if (kind == kNormBackwardSummed) masked_sum(params, element_count(4, shapes[0]));
        execute(plan, params);
        s.stream.wait();
        if (kind == kNormForwardForked) add_relu_twice(params, element_count(4, shapes[0]));
        if (is_norm_forward(kind)) move_statistics(params, shapes[0], *static_cast<const NormParams *>(raw));
        return 0;
    } catch (const dnnl::error &e) {
        return fail(k.name, k.slots, nparam, ndims, shapes, dtypes, std::string("oneDNN: ") + e.what());
    } catch (const std::exception &e) {
        return fail(k.name, k.slots, nparam, ndims, shapes, dtypes, e.what());
    }
}

// The kernels below do not use oneDNN but share its threads and the error message: they take the lock too.

// Two copies of one float32 or bfloat16 tensor: a tensor two layers read, each from its own copy, so
// that MindSpore need not sum the two gradients (its CPU sum of gradients, AddN, has no bfloat16
// kernel); Sum is the backward.
int fork_copies(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    std::lock_guard<std::mutex> guard(state().lock);
    const char *slots = FORK_SLOTS(NAME_OF);
    const std::string type = nparam == fork_slots::count ? dtypes[0] : "";
    if (nparam != fork_slots::count || (type != "float32" && type != "bfloat16") || type != dtypes[1] ||
        type != dtypes[2])
        return fail("Fork", slots, nparam, ndims, shapes, dtypes,
                    "takes one float32 or bfloat16 tensor and returns two of its type");
    const int64_t bytes = element_count(ndims[0], shapes[0]) * element_size(dtypes[0]);
    const char *x = static_cast<const char *>(params[fork_slots::x]);
    char *a = static_cast<char *>(params[fork_slots::a]), *b = static_cast<char *>(params[fork_slots::b]);
    constexpr int64_t chunk = 1 << 16;
    const int64_t chunks = (bytes + chunk - 1) / chunk;
    use_threads();
#pragma omp parallel for if (chunks > 4)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = c * chunk, size = std::min(chunk, bytes - begin);
        std::memcpy(a + begin, x + begin, size);
        std::memcpy(b + begin, x + begin, size);
    }
    return 0;
}

bool all_float32(int nparam, const char **dtypes) {
    for (int i = 0; i < nparam; ++i)
        if (std::strcmp(dtypes[i], "float32") != 0) return false;
    return true;
}

// 1.0 when every element of every float32 input is finite, else 0.0 (the last argument, one float):
// the training step's check of its gradients as one multi-threaded pass, where MindSpore's CPU
// kernels take a reduction per tensor.
int all_finite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    std::lock_guard<std::mutex> guard(state().lock);
    if (nparam < 2 || !all_float32(nparam, dtypes) || element_count(ndims[nparam - 1], shapes[nparam - 1]) != 1)
        return fail("AllFinite", "", nparam, ndims, shapes, dtypes,
                    "takes float32 tensors and returns one float32 value");
    use_threads();
    bool finite = true;
    for (int i = 0; i < nparam - 1 && finite; ++i) {
        const int64_t count = element_count(ndims[i], shapes[i]);
        const uint32_t *bits = static_cast<const uint32_t *>(params[i]);
        int bad = 0;
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
    std::lock_guard<std::mutex> guard(state().lock);
    const int n = (nparam - 2) / 2;
    bool ok = nparam == 2 * n + 2 && n > 0 && all_float32(nparam, dtypes) && element_count(ndims[0], shapes[0]) == 1;
    for (int i = 0; ok && i < n; ++i)
        ok = element_count(ndims[1 + i], shapes[1 + i]) == element_count(ndims[1 + n + i], shapes[1 + n + i]);
    if (!ok)
        return fail("UnscaleAllFinite", "", nparam, ndims, shapes, dtypes,
                    "takes a float32 factor and n float32 gradients, returns the n products and one value");
    const float factor = *static_cast<const float *>(params[0]);
    use_threads();
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

// Golden Stick's simulated fake quantizer on CPU (src/compression/qat.py's CpuFakeQuant): its
// standard operators, a dozen per quantizer, took most of a QAT graph's compile (resnet10: 8.7 s
// against 2.7 s without them); here they are one kernel each way, computing the same float32
// operations in the same order (no fused multiply-add), so both ways give the same bits. Per range
// (channel): made symmetric if asked, scale = max((high - low) / (quant_max - quant_min), 1e-12), the
// zero point rounded (half to even) and clipped to the levels, the range nudged onto it; each element
// clipped to the nudged range with two ReLUs, rounded onto its level, and returned as
// passed + (rounded - passed) with passed = x inside the range (its ends included), 0 outside. The
// gradient: dy times 1 inside, times 0 outside.
struct QuantRange {
    float scale, low, high;
};

// Calls each(unit, c, begin, end) for the runs [begin, end) of a tensor's elements that share range
// (or alpha) c, where each range covers `inner` consecutive elements in turn (the elements after a
// channel axis; the whole tensor for one range), in units of at most kRun elements, in parallel. No
// division per element: a per-element index divide made the kernels several times slower.
constexpr int64_t kRun = 1 << 14;

int64_t runs_per_segment(int64_t inner) { return (inner + kRun - 1) / kRun; }

// How many units for_each_run calls `each` with for `count` elements.
int64_t run_units(int64_t count, int64_t inner) { return count ? count / inner * runs_per_segment(inner) : 0; }

template <typename Each>
void for_each_run(int64_t count, int64_t ranges, int64_t inner, Each each) {
    const int64_t per_segment = runs_per_segment(inner), units = run_units(count, inner);
#pragma omp parallel for if (count > (1 << 16))
    for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t segment = unit / per_segment, begin = segment * inner + unit % per_segment * kRun;
        each(unit, segment % ranges, begin, std::min(begin + kRun, (segment + 1) * inner));
    }
}

QuantRange nudged_range(float low, float high, const QuantParams &p) {
    if (p.symmetric != 0.f) {
        high = std::max(std::fabs(low), std::fabs(high));
        low = -high;
    }
    const float scale = std::max((high - low) / (p.quant_max - p.quant_min), 1e-12f);
    const float zero_point = std::min(std::max(std::nearbyint(p.quant_min - low / scale), p.quant_min), p.quant_max);
    return {scale, (p.quant_min - zero_point) * scale, (p.quant_max - zero_point) * scale};
}

// Comparisons as values, not jumps where it can be helped: on real weights they go either way at
// random, and mispredicted branches made LSQ's loop 1.5x slower (10 ns an element on ResNet18's).
float max_of(float a, float b) { return a < b ? b : a; }
float min_of(float a, float b) { return b < a ? b : a; }
float relu(float v) { return max_of(v, 0.f); }
float one_if(bool condition) { return static_cast<float>(condition); }

// nearbyint (half to even, the default rounding mode) and floor of a float whose magnitude is below
// 2^22, inlined: adding and subtracting 1.5 x 2^23 leaves the nearest integer. std::nearbyint and
// std::floor are library calls in SSE2's x86_64, one per element.
float round_small(float v) { return (v + 12582912.f) - 12582912.f; }
float floor_small(float v) {
    const float rounded = round_small(v);
    return rounded - one_if(rounded > v);
}

// One run of n elements sharing range r, each way.
void fake_quant_run(const float *__restrict x, float *__restrict y, int64_t n, QuantRange r) {
    for (int64_t j = 0; j < n; ++j) {
        const float v = x[j];
        const float clipped = r.low + relu(v - r.low) - relu(v - r.high);
        const float rounded = round_small((clipped - r.low) / r.scale) * r.scale + r.low;  // 0..quant_max
        const float passed = v * one_if((v >= r.low) & (v <= r.high));
        y[j] = passed + (rounded - passed);
    }
}

void fake_quant_grad_run(const float *__restrict x, const float *__restrict dy, float *__restrict dx, int64_t n,
                         QuantRange r) {
    for (int64_t j = 0; j < n; ++j) dx[j] = dy[j] * one_if((x[j] >= r.low) & (x[j] <= r.high));
}

// The checks and the loop both directions share: `each(range, begin, end)` for each run of x's
// elements [begin, end) that share a range.
template <typename Each>
int each_quantized(const char *name, const char *slots, int nparam, void **params, int *ndims, int64_t **shapes,
                   const char **dtypes, int params_slot, Each each) {
    const int64_t count = element_count(ndims[0], shapes[0]);
    const int64_t ranges = element_count(ndims[1], shapes[1]);
    bool ok = all_float32(nparam, dtypes) && ranges == element_count(ndims[2], shapes[2]) && ranges > 0 &&
              element_count(ndims[params_slot], shapes[params_slot]) == sizeof(QuantParams) / sizeof(float);
    for (int i = params_slot + 1; ok && i < nparam; ++i) ok = element_count(ndims[i], shapes[i]) == count;
    const QuantParams p = ok ? *static_cast<const QuantParams *>(params[params_slot]) : QuantParams{};
    const int axis = static_cast<int>(p.channel_axis);
    ok = ok && (axis < 0 ? ranges == 1 : axis < ndims[0] && shapes[0][axis] == ranges);
    if (!ok)
        return fail(name, slots, nparam, ndims, shapes, dtypes,
                    "takes float32 tensors: x, low and high (one value, or one per channel of channel_axis), "
                    "the QuantParams and x's shape for the rest");
    const float *low = static_cast<const float *>(params[1]), *high = static_cast<const float *>(params[2]);
    const int64_t inner = axis < 0 ? count : element_count(ndims[0] - axis - 1, shapes[0] + axis + 1);
    std::vector<QuantRange> nudged(ranges);
    for (int64_t c = 0; c < ranges; ++c) nudged[c] = nudged_range(low[c], high[c], p);
    use_threads();
    for_each_run(count, ranges, inner, [&](int64_t, int64_t c, int64_t begin, int64_t end) {
        each(nudged[c], begin, end);
    });
    return 0;
}

int fake_quant_forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    if (nparam != fake_quant::count)
        return fail("FakeQuant", FAKE_QUANT_SLOTS(NAME_OF), nparam, ndims, shapes, dtypes, "takes 5 arguments");
    const float *x = static_cast<const float *>(params[fake_quant::x]);
    float *y = static_cast<float *>(params[fake_quant::y]);
    return each_quantized("FakeQuant", FAKE_QUANT_SLOTS(NAME_OF), nparam, params, ndims, shapes, dtypes,
                          fake_quant::params, [&](const QuantRange &r, int64_t begin, int64_t end) {
        fake_quant_run(x + begin, y + begin, end - begin, r);
    });
}

int fake_quant_backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    if (nparam != fake_quant_grad::count)
        return fail("FakeQuantGrad", FAKE_QUANT_GRAD_SLOTS(NAME_OF), nparam, ndims, shapes, dtypes,
                    "takes 6 arguments");
    const float *x = static_cast<const float *>(params[fake_quant_grad::x]);
    const float *dy = static_cast<const float *>(params[fake_quant_grad::dy]);
    float *dx = static_cast<float *>(params[fake_quant_grad::dx]);
    return each_quantized("FakeQuantGrad", FAKE_QUANT_GRAD_SLOTS(NAME_OF), nparam, params, ndims, shapes, dtypes,
                          fake_quant_grad::params, [&](const QuantRange &r, int64_t begin, int64_t end) {
        fake_quant_grad_run(x + begin, dy + begin, dx + begin, end - begin, r);
    });
}

// Golden Stick's LSQ fake quantizer on CPU (qat.py's CpuLearnedScaleQuant), as FakeQuant above: one
// kernel each way instead of its standard operators, the same float32 steps in the same order. With
// alpha per tensor or per channel: r = x / alpha, q = floor(min(max(r, lower), 1) * quant_max + 0.5) /
// quant_max, y = q * alpha. The gradient: dx = dy inside [lower, 1] (ends included), else 0; dalpha
// sums dy * (above - below + inside * (q - r)) per alpha, in a fixed order whatever the thread count
// (a double sum per run of for_each_run, the runs added in order), so it matches the standard
// operators' ReduceSum to float32 rounding, not bit for bit.
struct LsqElement {
    float ratio, quantized;
};

LsqElement lsq_element(float v, float alpha, float quant_max, float lower) {
    const float ratio = v / alpha;
    return {ratio, floor_small(min_of(max_of(ratio, lower), 1.f) * quant_max + 0.5f) / quant_max};
}

// One run of n elements sharing alpha a, each way (the gradient returns the run's sum for dalpha).
void lsq_run(const float *__restrict x, float *__restrict y, int64_t n, float a, float quant_max, float lower) {
    for (int64_t j = 0; j < n; ++j) y[j] = lsq_element(x[j], a, quant_max, lower).quantized * a;
}

double lsq_grad_run(const float *__restrict x, const float *__restrict dy, float *__restrict dx, int64_t n, float a,
                    float quant_max, float lower) {
    double sum = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        const LsqElement e = lsq_element(x[j], a, quant_max, lower);
        const float above = one_if(e.ratio > 1.f), below = one_if(e.ratio < lower);
        const float inside = 1.f - above - below;
        dx[j] = dy[j] * inside;
        sum += dy[j] * (above - below + inside * (e.quantized - e.ratio));
    }
    return sum;
}

// The checks both directions share; sets the alpha count, the elements per alpha run and the levels.
bool lsq_arguments(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, int params_slot,
                   LsqParams *p, int64_t *alphas, int64_t *inner, float *quant_max) {
    const int64_t count = element_count(ndims[0], shapes[0]);
    *alphas = element_count(ndims[1], shapes[1]);
    bool ok = all_float32(nparam, dtypes) && element_count(ndims[2], shapes[2]) == 1 && *alphas > 0 &&
              element_count(ndims[params_slot], shapes[params_slot]) == sizeof(LsqParams) / sizeof(float);
    for (int i = params_slot + 1; ok && i < nparam; ++i)
        ok = element_count(ndims[i], shapes[i]) == (i == nparam - 1 && nparam == lsq_grad::count ? *alphas : count);
    if (!ok) return false;
    *p = *static_cast<const LsqParams *>(params[params_slot]);
    *quant_max = *static_cast<const float *>(params[2]);
    const int axis = static_cast<int>(p->channel_axis);
    if (axis < 0 ? *alphas != 1 : axis >= ndims[0] || shapes[0][axis] != *alphas) return false;
    *inner = axis < 0 ? count : element_count(ndims[0] - axis - 1, shapes[0] + axis + 1);
    return true;
}

const char kLsqProblem[] =
    "takes float32 tensors: x, alpha (one value, or one per channel of channel_axis), quant_max (one value), the "
    "LsqParams and x's shape for the rest (alpha's for dalpha)";

int lsq_forward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    LsqParams p;
    int64_t alphas, inner;
    float quant_max;
    if (nparam != lsq::count ||
        !lsq_arguments(nparam, params, ndims, shapes, dtypes, lsq::params, &p, &alphas, &inner, &quant_max))
        return fail("LearnedScaleQuant", LSQ_SLOTS(NAME_OF), nparam, ndims, shapes, dtypes, kLsqProblem);
    const int64_t count = element_count(ndims[0], shapes[0]);
    const float *x = static_cast<const float *>(params[lsq::x]), *alpha = static_cast<const float *>(params[lsq::alpha]);
    float *y = static_cast<float *>(params[lsq::y]);
    use_threads();
    for_each_run(count, alphas, inner, [&](int64_t, int64_t c, int64_t begin, int64_t end) {
        lsq_run(x + begin, y + begin, end - begin, alpha[c], quant_max, p.lower);
    });
    return 0;
}

int lsq_backward(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    LsqParams p;
    int64_t alphas, inner;
    float quant_max;
    if (nparam != lsq_grad::count ||
        !lsq_arguments(nparam, params, ndims, shapes, dtypes, lsq_grad::params, &p, &alphas, &inner, &quant_max))
        return fail("LearnedScaleQuantGrad", LSQ_GRAD_SLOTS(NAME_OF), nparam, ndims, shapes, dtypes, kLsqProblem);
    const int64_t count = element_count(ndims[0], shapes[0]);
    const float *x = static_cast<const float *>(params[lsq_grad::x]);
    const float *alpha = static_cast<const float *>(params[lsq_grad::alpha]);
    const float *dy = static_cast<const float *>(params[lsq_grad::dy]);
    float *dx = static_cast<float *>(params[lsq_grad::dx]), *dalpha = static_cast<float *>(params[lsq_grad::dalpha]);
    const int64_t per_segment = runs_per_segment(inner), units = run_units(count, inner);
    std::vector<double> partial(static_cast<size_t>(units), 0.0);  // one sum per run, added in order below
    use_threads();
    for_each_run(count, alphas, inner, [&](int64_t unit, int64_t c, int64_t begin, int64_t end) {
        partial[unit] = lsq_grad_run(x + begin, dy + begin, dx + begin, end - begin, alpha[c], quant_max, p.lower);
    });
    std::vector<double> sums(static_cast<size_t>(alphas), 0.0);
    for (int64_t unit = 0; unit < units; ++unit) sums[unit / per_segment % alphas] += partial[unit];
    for (int64_t c = 0; c < alphas; ++c) dalpha[c] = static_cast<float>(sums[c]);
    return 0;
}

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

// One momentum SGD step over every parameter, as the training step with MindSpore's nn.Momentum takes
// it, in two multi-threaded passes instead of five kernels per parameter. Inputs: the factor (1 / loss
// scale), lr, momentum, the decays (one per parameter, 0: none), then n gradients, n weights and n
// moments; the weights and moments are written in place. First every gradient times the factor is
// checked; only when all are finite does each parameter move, with MindSpore's float32 operations in
// its order (no fused multiply-add: the same bits): g = grad * factor; g = weight * decay + g where it
// decays; moment = moment * momentum + g; weight = weight - lr * moment. The output: 1.0 when the step
// was applied, 0.0 when a gradient was not finite and nothing moved.
int momentum_step(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    std::lock_guard<std::mutex> guard(state().lock);
    const int n = (nparam - 5) / 3;
    bool ok = nparam == 3 * n + 5 && n > 0 && all_float32(nparam, dtypes) &&
              element_count(ndims[3], shapes[3]) == n && element_count(ndims[nparam - 1], shapes[nparam - 1]) == 1;
    for (int slot = 0; ok && slot < 3; ++slot) ok = element_count(ndims[slot], shapes[slot]) == 1;
    std::vector<int64_t> counts(ok ? n : 0);
    for (int i = 0; ok && i < n; ++i) {
        counts[i] = element_count(ndims[4 + i], shapes[4 + i]);
        ok = counts[i] == element_count(ndims[4 + n + i], shapes[4 + n + i]) &&
             counts[i] == element_count(ndims[4 + 2 * n + i], shapes[4 + 2 * n + i]);
    }
    if (!ok)
        return fail("MomentumStep", "", nparam, ndims, shapes, dtypes,
                    "takes float32 factor, lr, momentum, n decays, n gradients, n weights and n moments of their "
                    "shapes, returns one value");
    const MomentumArgs args{n,
                            *static_cast<const float *>(params[0]),
                            *static_cast<const float *>(params[1]),
                            *static_cast<const float *>(params[2]),
                            static_cast<const float *>(params[3]),
                            counts.data(),
                            params + 4,
                            params + 4 + n,
                            params + 4 + 2 * n};
    use_threads();
    const bool applied = own_loops_use_avx512() ? momentum_passes_avx512(args) : momentum_passes(args);
    *static_cast<float *>(params[nparam - 1]) = applied ? 1.f : 0.f;
    return 0;
}

// A buffer for the probes below, 64-byte aligned and zeroed.
std::unique_ptr<uint8_t, FreeDeleter> zeroed(size_t bytes) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    std::unique_ptr<uint8_t, FreeDeleter> buffer(static_cast<uint8_t *>(std::aligned_alloc(64, rounded)));
    if (!buffer) throw std::bad_alloc();
    std::memset(buffer.get(), 0, rounded);
    return buffer;
}

double milliseconds_since(const std::chrono::steady_clock::time_point &start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The best of `repeats` timings of one convolution's forward and both backwards, activations
// blocked in `type` between layers as in a network (weights float32 OIHW, reordered per call):
// what a layer of a training step costs in float32 or in bfloat16.
double probe_convolution(const memory::dims &x, int64_t out_channels, int64_t kernel, int64_t stride, dt type,
                         int repeats) {
    const int64_t pad = kernel / 2, out_size = (x[2] + 2 * pad - kernel) / stride + 1;
    const memory::dims w{out_channels, x[1], kernel, kernel}, y{x[0], out_channels, out_size, out_size};
    const int32_t s32 = static_cast<int32_t>(stride), p32 = static_cast<int32_t>(pad);
    const ConvParams p{s32, s32, p32, p32, p32, p32, 1, 1, 1, type == dt::bf16, 3, 0};
    const int64_t bytes = type == dt::bf16 ? 2 : 4;
    auto x_buffer = zeroed(element_count(4, x.data()) * bytes), dx_buffer = zeroed(element_count(4, x.data()) * bytes);
    auto y_buffer = zeroed(element_count(4, y.data()) * bytes), w_buffer = zeroed(element_count(4, w.data()) * 4);
    auto dw_buffer = zeroed(element_count(4, w.data()) * 4);
    auto forward = conv_plan(kConvForward, x, w, y, p, type, type);
    auto backward_data = conv_plan(kConvBackwardData, x, w, y, p, type, type);
    auto backward_weights = conv_plan(kConvBackwardWeights, x, w, y, p, type, type);
    void *forward_slots[] = {x_buffer.get(), w_buffer.get(), nullptr, y_buffer.get(), nullptr};
    void *data_slots[] = {y_buffer.get(), w_buffer.get(), nullptr, nullptr, nullptr, dx_buffer.get()};
    void *weights_slots[] = {x_buffer.get(), y_buffer.get(), nullptr, nullptr, dw_buffer.get()};
    auto &s = state();
    double best = 1e30;
    for (int r = 0; r <= repeats; ++r) {  // the first run is a warm-up
        const auto start = std::chrono::steady_clock::now();
        execute(*forward, forward_slots);
        execute(*backward_data, data_slots);
        execute(*backward_weights, weights_slots);
        s.stream.wait();
        if (r > 0) best = std::min(best, milliseconds_since(start));
    }
    return best;
}

// This CPU's practical multiply-accumulate rate in `type`: a large 1x1 convolution (a matrix
// multiply, 32 x 512 x 28 x 28 -> 512 channels), forward only, best of five, in GMAC/s.
double peak_gmacs(dt type) {
    const memory::dims x{32, 512, 28, 28}, w{512, 512, 1, 1}, y{32, 512, 28, 28};
    const ConvParams p{1, 1, 0, 0, 0, 0, 1, 1, 1, type == dt::bf16, 3, 0};
    const int64_t bytes = type == dt::bf16 ? 2 : 4;
    auto x_buffer = zeroed(element_count(4, x.data()) * bytes), y_buffer = zeroed(element_count(4, y.data()) * bytes);
    auto w_buffer = zeroed(element_count(4, w.data()) * 4);
    auto forward = conv_plan(kConvForward, x, w, y, p, type, type);
    void *slots[] = {x_buffer.get(), w_buffer.get(), nullptr, y_buffer.get(), nullptr};
    auto &s = state();
    double best = 1e30;
    for (int r = 0; r <= 5; ++r) {
        const auto start = std::chrono::steady_clock::now();
        execute(*forward, slots);
        s.stream.wait();
        if (r > 0) best = std::min(best, milliseconds_since(start));
    }
    return 32.0 * 512 * 512 * 28 * 28 / (best * 1e6);
}

const std::pair<const char *, dnnl::cpu_isa> kIsas[] = {
    {"avx2", dnnl::cpu_isa::avx2}, {"avx512_core", dnnl::cpu_isa::avx512_core},
    {"avx512_core_bf16", dnnl::cpu_isa::avx512_core_bf16}, {"avx512_core_amx", dnnl::cpu_isa::avx512_core_amx},
    {"all", dnnl::cpu_isa::avx512_core_amx_fp16}};

const char *record_fields(const std::string &record) {
    if (record == "ConvParams") return CONV_PARAMS(NAME_OF);
    if (record == "NormParams") return NORM_PARAMS(NAME_OF);
    if (record == "PoolParams") return POOL_PARAMS(NAME_OF);
    if (record == "QuantParams") return QUANT_PARAMS(NAME_OF);
    if (record == "LsqParams") return LSQ_PARAMS(NAME_OF);
    return "";
}

const char *kernel_slots(const std::string &kernel) {
    for (int kind = kConvForward; kind <= kNormBackwardSummed; ++kind)
        if (kernel == info(static_cast<Kind>(kind)).name) return info(static_cast<Kind>(kind)).slots;
    if (kernel == "FakeQuant") return FAKE_QUANT_SLOTS(NAME_OF);
    if (kernel == "FakeQuantGrad") return FAKE_QUANT_GRAD_SLOTS(NAME_OF);
    if (kernel == "LearnedScaleQuant") return LSQ_SLOTS(NAME_OF);
    if (kernel == "LearnedScaleQuantGrad") return LSQ_GRAD_SLOTS(NAME_OF);
    return kernel == "Fork" ? FORK_SLOTS(NAME_OF) : "";
}

// Each operand of every cached plan, and of the plans they run first and last.
template <typename Visit>
void each_operand(Plan &plan, Visit &visit) {
    for (auto &o : plan.operands) visit(o);
    if (plan.prelude) each_operand(*plan.prelude, visit);
    if (plan.postlude) each_operand(*plan.postlude, visit);
}

template <typename Visit>
void each_operand(State &s, Visit visit) {
    for (auto &entry : s.plans) each_operand(*entry.second.plan, visit);
}

// The kept reorders dropped (FreezeWeights, ThawWeights): none made under an earlier version can serve
// again, and each holds a copy of a weights tensor at an address MindSpore may have freed since: a
// network that loads new weights before each evaluation (the EMA's) grew by a copy per address
// (ResNet18, 12 loads and evaluations: 849 MB resident, 699 MB with the drop).
void drop_kept_reorders(State &s) {
    each_operand(s, [](Operand &o) { o.kept.clear(); });
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
KERNEL(NormForwardForked, kNormForwardForked)
KERNEL(NormBackwardSummed, kNormBackwardSummed)

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

EXPORT int FakeQuant(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
    return fake_quant_forward(nparam, params, ndims, shapes, dtypes);
}

EXPORT int FakeQuantGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                         void *) {
    return fake_quant_backward(nparam, params, ndims, shapes, dtypes);
}

EXPORT int LearnedScaleQuant(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                             void *) {
    return lsq_forward(nparam, params, ndims, shapes, dtypes);
}

EXPORT int LearnedScaleQuantGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                 void *) {
    return lsq_backward(nparam, params, ndims, shapes, dtypes);
}

EXPORT int MomentumStep(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                        void *) {
    return momentum_step(nparam, params, ndims, shapes, dtypes);
}

// For the Python side (ctypes, library.py).

// Threads per kernel (0: OpenMP's default, as when the library loaded).
EXPORT void SetThreads(int threads) { g_threads = std::max(threads, 0); }

// Freezes the weights of inference forwards until ThawWeights or the next training forward: each
// weights tensor is reordered on its first call and the reorder reused after. Returns the version (a
// new one each call, so weights loaded between two freezes are reordered again).
EXPORT uint64_t FreezeWeights() {
    auto &s = state();
    std::lock_guard<std::mutex> guard(s.lock);
    drop_kept_reorders(s);
    g_frozen_version = ++g_last_version;
    return g_frozen_version;
}
EXPORT void ThawWeights() {
    auto &s = state();
    std::lock_guard<std::mutex> guard(s.lock);
    drop_kept_reorders(s);
    g_frozen_version = 0;
}
EXPORT uint64_t FrozenVersion() { return g_frozen_version; }

// How many floats the training forward of a convolution (x, w -> y shapes, ConvParams `record`) writes
// into its `matrix` output for the backward of its image gradient: a dense layer's matrix
// (as_dense_layer, in float32), the taps that meet an image inside the kernel (image_inside_kernel),
// else 0. cells.py sizes that output by it.
EXPORT int64_t WeightMatrixElements(const int64_t *x, const int64_t *w, const int64_t *y, const int32_t *record) {
    ConvParams p;
    std::memcpy(&p, record, sizeof(p));
    memory::dims x_dims = dims_of(x, 4), w_dims = dims_of(w, 4), y_dims = dims_of(y, 4);
    if (p.pad_top < 0) same_padding(p, x_dims, w_dims);
    if (p.inference) return 0;
    if (as_dense_layer(x_dims, w_dims, y_dims, p, dt::f32, dt::f32))
        return matrix_is_weights(x_dims, w_dims, y_dims) ? 0 : element_count(3, y + 1) * element_count(3, x + 1);
    if (image_inside_kernel(x_dims, w_dims, y_dims, p)) return w[0] * w[1] * x[2] * x[3];
    return 0;
}

// How the library runs a convolution (x, w -> y shapes, ConvParams `record`) on this CPU, under its ISA
// cap: "dense" (as_dense_layer: one matrix product over a matrix built from the weights), "dense on the
// weights" (matrix_is_weights: the weights are the matrix), "image inside kernel" (image_inside_kernel:
// oneDNN convolves the taps that meet the image) or "convolution" (oneDNN's kernels).
EXPORT const char *ConvolutionPath(const int64_t *x, const int64_t *w, const int64_t *y, const int32_t *record) {
    ConvParams p;
    std::memcpy(&p, record, sizeof(p));
    memory::dims x_dims = dims_of(x, 4), w_dims = dims_of(w, 4), y_dims = dims_of(y, 4);
    if (p.pad_top < 0) same_padding(p, x_dims, w_dims);
    const dt type = p.bf16 ? dt::bf16 : dt::f32;
    if (as_dense_layer(x_dims, w_dims, y_dims, p, type, type))
        return matrix_is_weights(x_dims, w_dims, y_dims) ? "dense on the weights" : "dense";
    return image_inside_kernel(x_dims, w_dims, y_dims, p) ? "image inside kernel" : "convolution";
}

// The names of the layers' own loops (each followed by a comma), and their seconds since the library
// loaded, into `seconds` (at most `capacity`); returns how many there are.
EXPORT const char *OwnLoopNames() { return kOwnLoopNames; }
EXPORT int OwnLoopSeconds(double *seconds, int capacity) {
    std::lock_guard<std::mutex> guard(state().lock);
    for (int i = 0; i < std::min<int>(capacity, kOwnLoopCount); ++i) seconds[i] = g_own_seconds[i];
    return kOwnLoopCount;
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
// nChw8c, nhwc or nchw; "" where oneDNN has no such convolution here or chose another layout.
EXPORT const char *BlockedLayout(const char *dtype) {
    try {
        const tag layout = data_type(dtype) == dt::bf16 ? state().bf16_layout : state().f32_layout;
        for (const auto &known : kLayouts)
            if (known.first == layout) return known.second;
    } catch (const std::exception &e) {
        g_error = e.what();
    }
    return "";
}

// Plans cached now, and the most that are kept (a limit below 1 leaves it as it is).
EXPORT int PlanCount() {
    std::lock_guard<std::mutex> guard(state().lock);
    return static_cast<int>(state().plans.size());
}
EXPORT int SetPlanLimit(int limit) {
    auto &s = state();
    std::lock_guard<std::mutex> guard(s.lock);
    if (limit > 0) s.plan_limit = static_cast<size_t>(limit);
    return static_cast<int>(s.plan_limit);
}
EXPORT int64_t ScratchpadBytes() { return static_cast<int64_t>(state().scratchpad_bytes); }

// Bytes held by the inference forwards' kept weight reorders (see drop_kept_reorders).
EXPORT int64_t KeptReorderBytes() {
    auto &s = state();
    std::lock_guard<std::mutex> guard(s.lock);
    int64_t bytes = 0;
    each_operand(s, [&bytes](Operand &o) {
        for (const auto &kept : o.kept) bytes += static_cast<int64_t>(kept.second.first.get_desc().get_size());
    });
    return bytes;
}

// Milliseconds for one convolution's forward and both backwards (probe_convolution), or -1 with
// TakeError's message.
EXPORT double ProbeConvolution(int64_t batch, int64_t channels, int64_t size, int64_t out_channels, int64_t kernel,
                               int64_t stride, int bf16, int repeats) {
    try {
        auto &s = state();
        std::lock_guard<std::mutex> guard(s.lock);
        use_threads();
        return probe_convolution({batch, channels, size, size}, out_channels, kernel, stride, bf16 ? dt::bf16 : dt::f32,
                                 std::max(repeats, 1));
    } catch (const std::exception &e) {
        g_error = std::string("ProbeConvolution: ") + e.what();
        return -1;
    }
}

// GMAC/s of a large 1x1 convolution (peak_gmacs), or -1 with TakeError's message.
EXPORT double PeakGmacs(int bf16) {
    try {
        auto &s = state();
        std::lock_guard<std::mutex> guard(s.lock);
        use_threads();
        return peak_gmacs(bf16 ? dt::bf16 : dt::f32);
    } catch (const std::exception &e) {
        g_error = std::string("PeakGmacs: ") + e.what();
        return -1;
    }
}
}
