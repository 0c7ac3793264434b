// ResNet's layers for MindSpore's CPU backend through a private oneDNN, as `ops.Custom(func_type="aot")`
// kernels on float32 or bfloat16 tensors: convolution (forward, backward-data, backward-weights), batch
// normalization with the ReLU or residual addition after it (forward, backward), max pooling
// (forward, backward), the reorders between MindSpore's NCHW and oneDNN's blocked layout, two copies
// of a tensor two layers read (and the sum of their gradients), and the training step's pass over
// its gradients (the loss scale divided out, the finiteness check), the momentum step, and Golden
// Stick's fake quantizers (simulated and LSQ).
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
// scratchpad. Every kernel is entered one way (call_kernel): under the state's lock, its arguments'
// count, types and ranks checked against its line of the kernel table, then the kernel; whatever it
// refuses or throws becomes one line TakeError gives back, naming the kernel and its arguments'
// shapes, and a non-zero return: nothing is thrown across the C ABI.
//
// The library links against oneDNN 3.2 under a renamed SONAME (libdnnl_resnet.so.3, see build.sh):
// MindSpore's own libdnnl.so.3 is already in the process and would otherwise be bound instead.
//
// The library is one translation unit per family of kernels over this header, which holds what they
// share: the parameter records and argument slots, the plans and the state, and the small helpers
// their loops call. core.cpp holds the way into every kernel (the kernel table, its checks, the
// error text) and runs the plans (the state, its buffers, operands and reorders, the plan cache);
// convolution.cpp the convolutions (and weight gradients as one matrix product), dense.cpp small maps
// as dense layers, normalization.cpp batch normalization and its own loops, pooling.cpp max pooling,
// elementwise.cpp reorders, sums, fork and the finiteness checks, quantization.cpp fake quantization
// and LSQ, optimizer.cpp the momentum step, probes.cpp the timings, and c_abi.cpp the exported
// functions. All of it is in namespace resnet_conv, hidden from the library's users by
// -fvisibility=hidden (only c_abi.cpp's EXPORT functions are visible); what one file alone uses is in
// its anonymous namespace.
#pragma once

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

namespace resnet_conv {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;
// The parameter records and argument slots, each defined once here as a list of names; custom_ops.py
// writes the records and passes the arguments by the same names, and library.py checks its lists
// against these (RecordFields, KernelSlots) when the library loads, so a field moved on either side is refused.
//
// ConvParams (int32): the stride, the padding (pad_top < 0: 'same'), the dilation, the groups, bf16
// (1: compute in bfloat16), layout (LayoutBits: kInputBlocked, the input (x, dx) is blocked;
// kOutputBlocked, the output (y, dy)), and inference (1: an evaluation's forward, which keeps the
// weights' reorder while they are frozen, see FreezeWeights).
#define CONV_PARAMS(F) \
    F(stride_h) F(stride_w) F(pad_top) F(pad_bottom) F(pad_left) F(pad_right) F(dilation_h) F(dilation_w) F(groups) \
    F(bf16) F(layout) F(inference)
// NormParams (float32): epsilon; global_stats (1: normalize with the given (moving) statistics);
// momentum: with batch statistics and momentum > 0 the forward moves the given statistics (slots
// mean and variance) in place, moving = (1 - momentum) * moving + momentum * batch (the variance
// unbiased), as MindSpore's BatchNorm does (the Python op declares those inputs written);
// activation (Activation): what follows the normalization in the same kernel, 0 none (kNone), 1 a
// ResNet block's ReLU (kRelu; oneDNN's fuse_norm_relu: the forward writes a workspace of which
// elements passed, the backward reads it), 2 its residual addition and ReLU (kAddRelu; oneDNN 3.2's
// CPU normalizations do not fuse the addition: oneDNN's binary addition with a ReLU after the
// forward, and its ReLU backward on the output before the backward, which masks dy and is the
// residual's gradient).
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
// ConvParams' layout bits (custom_ops.py's INPUT_BLOCKED, OUTPUT_BLOCKED).
enum LayoutBits : int32_t { kInputBlocked = 1, kOutputBlocked = 2 };
// NormParams' activation codes (normalization.py's ACTIVATIONS), which the record holds as floats.
enum class Activation { kNone = 0, kRelu = 1, kAddRelu = 2 };
inline bool activation_is(const NormParams &p, Activation code) { return p.activation == static_cast<float>(code); }

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
namespace pool_forward { enum { POOL_FORWARD_SLOTS(SLOT_ENUM) count }; }
namespace pool_backward { enum { POOL_BACKWARD_SLOTS(SLOT_ENUM) count }; }
namespace reorder_slots { enum { REORDER_SLOTS(SLOT_ENUM) count }; }
namespace sum_slots { enum { SUM_SLOTS(SLOT_ENUM) count }; }
namespace fork_slots { enum { FORK_SLOTS(SLOT_ENUM) count }; }
namespace fake_quant { enum { FAKE_QUANT_SLOTS(SLOT_ENUM) count }; }
namespace fake_quant_grad { enum { FAKE_QUANT_GRAD_SLOTS(SLOT_ENUM) count }; }
namespace lsq { enum { LSQ_SLOTS(SLOT_ENUM) count }; }
namespace lsq_grad { enum { LSQ_GRAD_SLOTS(SLOT_ENUM) count }; }
// As ints: the slot enums are of different types (GCC's -Wenum-compare).
static_assert(int(norm_backward_summed::dy_copy) == int(norm_backward::residual) &&
                  int(norm_backward_summed::dx) == int(norm_backward::dx) &&
                  int(norm_backward_summed::dresidual) == int(norm_backward::dresidual) &&
                  int(norm_backward_summed::count) == int(norm_backward::count),
              "NormBackwardSummed's slots are NormBackward's, dy_copy in the residual's");

// Every kernel MindSpore's Custom ops call: those that run a plan of the cache, then the library's
// own loops (no oneDNN primitive). Each has its line in the kernel table (info, core.cpp).
enum Kind {
    kConvForward, kConvBackwardData, kConvBackwardWeights, kNormForward, kNormBackward, kPoolForward,
    kPoolBackward, kToPlain, kToBlocked, kSum, kNormForwardForked, kNormBackwardSummed,
    kFork, kAllFinite, kUnscaleAllFinite, kFakeQuant, kFakeQuantGrad, kLearnedScaleQuant, kLearnedScaleQuantGrad,
    kMomentumStep, kKindCount
};

inline bool is_norm_forward(int kind) { return kind == kNormForward || kind == kNormForwardForked; }

// One tensor argument of a primitive: the memory MindSpore owns (`slot` indexes the kernel's
// arguments), and the layout the primitive wants; when they differ, a reorder through a buffer.
struct Operand {
    Operand(int arg, int slot, bool output, memory user) : arg(arg), slot(slot), output(output), user(user) {}
    int arg;
    int slot;
    bool output;
    memory user;
    memory inner;
    bool reorders = false;
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

inline int g_threads = 0;  // SetThreads: 0 is OpenMP's default
// While non-zero, the weights of inference forwards are frozen: each weights tensor is reordered once
// per version and its reorder reused (FreezeWeights, ThawWeights). A training forward thaws them.
inline uint64_t g_frozen_version = 0, g_last_version = 0;
inline const int kDefaultThreads = omp_get_max_threads();  // read when the library loads, before anyone sets it
inline std::string g_error;
// The highest ISA this copy of oneDNN may use: all the CPU has, unless capped before the first
// primitive (CapIsa, for tests and the benchmark's AVX2 rows).
inline dnnl::cpu_isa g_isa = dnnl::cpu_isa::avx512_core_amx_fp16;
inline bool g_state_made = false;

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
inline double g_own_seconds[kOwnLoopCount] = {};

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

inline int kernel_threads() { return g_threads > 0 ? g_threads : kDefaultThreads; }

inline void use_threads(int threads = 0) { omp_set_num_threads(threads > 0 ? threads : kernel_threads()); }

inline memory::dims dims_of(const int64_t *shape, int n) { return memory::dims(shape, shape + n); }

// Whole 64-byte lines for `bytes` (aligned_buffer's size).
inline size_t aligned_size(size_t bytes) { return (bytes + 63) / 64 * 64; }

inline int64_t element_count(int ndims, const int64_t *shape) {
    int64_t count = 1;
    for (int d = 0; d < ndims; ++d) count *= shape[d];
    return count;
}

// Inf or NaN, from a float32's bits: the exponent all ones.
inline bool inf_or_nan(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

inline dt data_type(const char *name) { return std::strcmp(name, "bfloat16") == 0 ? dt::bf16 : dt::f32; }

// Bytes per element of a float32 or bfloat16 tensor.
inline int64_t element_size(const char *name) { return data_type(name) == dt::bf16 ? 2 : 4; }

// The layouts a blocked activation may have: element counts equal to N*C*H*W when C is a multiple
// of the block (blocked_network.py keeps other layers plain).
const std::pair<tag, const char *> kLayouts[] = {
    {tag::aBcd16b, "nChw16c"}, {tag::aBcd8b, "nChw8c"}, {tag::acdb, "nhwc"}, {tag::abcd, "nchw"}};

// The same elements seen as one flat run, for element-wise primitives over tensors of one layout.
inline memory::desc flat(int64_t count, dt type) { return memory::desc({count}, type, tag::a); }

// Threads for one kernel call: all of them, or one where the work is too small to pay for waking the
// others (on a virtual machine a parallel region's wake-up took ~90 us, more than a batch-1
// convolution of a 32 px ResNet layer takes on one core).
constexpr int64_t kOneThreadMacs = 4 << 20, kOneThreadElements = 64 << 10;

template <typename PrimitiveDesc>
inline void own_scratchpad(Plan &plan, const PrimitiveDesc &pd) {
    plan.scratchpad = pd.scratchpad_desc();
}

// A plan of one oneDNN primitive: the primitive made from `pd`, its operands and its scratchpad.
template <typename Primitive>
std::unique_ptr<Plan> primitive_plan(const typename Primitive::primitive_desc &pd, std::vector<Operand> operands) {
    auto plan = std::make_unique<Plan>();
    plan->primitive = Primitive(pd);
    plan->operands = std::move(operands);
    own_scratchpad(*plan, pd);
    return plan;
}

inline dnnl::primitive_attr user_scratchpad() {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return attr;
}

// One call of a kernel (call_kernel): its kind, its arguments and its parameter record (`record`;
// "" for kernels without one).
struct KernelCall {
    Kind kind;
    int nparam;
    void **params;
    int *ndims;
    int64_t **shapes;
    const char **dtypes;
    const void *record;

    int64_t elements(int slot) const { return element_count(ndims[slot], shapes[slot]); }
};

// What a family of plan kernels gives call_kernel (core.cpp); each family's file defines its own.
struct Family {
    std::string (*record_problem)(const KernelCall &);  // why the record is out of range, or ""; nullptr: no record
    std::unique_ptr<Plan> (*make_plan)(const KernelCall &, int64_t workspace_bytes);
    int64_t (*macs)(const KernelCall &);  // multiply-accumulates, for the thread count (nullptr: count elements)
    void (*before)(const KernelCall &);   // the family's own loops before the plan runs (nullptr: none)
    void (*after)(const KernelCall &);    // and after it
};
extern const Family kConvolutionFamily, kNormalizationFamily, kPoolingFamily, kElementwiseFamily;

// The slots `slots` as bits of a mask (bit i: slot i).
constexpr uint32_t slot_bits(std::initializer_list<int> slots) {
    uint32_t bits = 0;
    for (int slot : slots) bits |= 1u << slot;
    return bits;
}

// A kernel of the library's own loops: after the kernel table's checks, its own (why it refuses the
// arguments, or "" once it has run).
using OwnKernel = std::string (*)(const KernelCall &);

// What each kernel takes, checked before anything is read: the slot count, where its parameter
// record is (and of which type and size), which slot is the uint8 workspace, which hold [N, C, H, W]
// tensors (a bit per slot, slot_bits). Every other argument is float32 or bfloat16 (which
// combinations of those a primitive takes is oneDNN's to say), or float32 alone. `family` makes and
// runs its plans; a kernel without one runs `own`. A kernel of n tensors each way (the training
// step's, over every parameter) takes count + repeated * n arguments, n >= 1; their slots are ""
// (the message numbers them).
struct KernelInfo {
    const char *name;
    const char *slots;  // the names, each followed by a comma
    int count;
    int params_slot;  // -1: none
    size_t params_size;
    const char *params_dtype;
    int workspace_slot;  // -1: none
    uint32_t four_d;
    const Family *family;
    OwnKernel own = nullptr;
    int repeated = 0;
    bool float32_only = false;
};

// Defined in core.cpp: the state, its buffers and layouts, the operands and how a plan runs, the
// kernel table, the plan cache and the way into every kernel (call_kernel).
State &state();
std::unique_ptr<uint8_t, FreeDeleter> aligned_buffer(size_t bytes);
void *grown(std::unique_ptr<uint8_t, FreeDeleter> &buffer, size_t &size, size_t bytes);
memory::desc activation(const memory::dims &shape, dt type, bool blocked);
Operand operand(int arg, int slot, bool output, const memory::desc &user_desc, const memory::desc &wanted,
                size_t zeroed_bytes = 0);
void bind_scratchpad(const Plan &plan, std::unordered_map<int, memory> &args);
void execute(Plan &plan, void **slots);
const KernelInfo &info(Kind kind);
int call_kernel(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes);
void drop_kept_reorders(State &s);
int64_t kept_reorder_bytes(State &s);  // the inference forwards' kept weight reorders

// What an inference forward keeps for the weights at `handle` (in the weights operand's `kept`: their
// reorder, or a dense layer's matrix): a buffer of `desc`, `fill`ed again unless it was filled under
// the frozen version in force (see FreezeWeights).
template <typename Fill>
memory kept_buffer(Operand &o, void *handle, const memory::desc &desc, Fill fill) {
    auto found = o.kept.find(handle);
    if (found == o.kept.end())
        found = o.kept.emplace(handle, std::make_pair(memory(desc, state().engine), uint64_t{0})).first;
    auto &[buffer, version] = found->second;
    if (g_frozen_version == 0 || version != g_frozen_version) {
        fill(buffer);
        version = g_frozen_version;
    }
    return buffer;
}

// convolution.cpp
void same_padding(ConvParams &p, const memory::dims &x, const memory::dims &w);
bool image_inside_kernel(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p);
std::unique_ptr<Plan> conv_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                const memory::dims &y_dims, const ConvParams &p, dt x_type, dt y_type,
                                int64_t matrix_elements = 0);
int64_t weight_matrix_elements(const int64_t *x, const int64_t *w, const int64_t *y, ConvParams p);
const char *convolution_path(const int64_t *x, const int64_t *w, const int64_t *y, ConvParams p);

// dense.cpp
bool as_dense_layer(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p, dt x_type,
                    dt y_type);
bool matrix_is_weights(const memory::dims &x, const memory::dims &w, const memory::dims &y);
std::unique_ptr<Plan> dense_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                 const memory::dims &y_dims, const ConvParams &p, const memory::desc &x_user,
                                 const memory::desc &y_user, int64_t matrix_elements);

// elementwise.cpp
std::string fork_copies(const KernelCall &call);
std::string all_finite(const KernelCall &call);
std::string unscale_all_finite(const KernelCall &call);

// quantization.cpp
std::string fake_quant_forward(const KernelCall &call);
std::string fake_quant_backward(const KernelCall &call);
std::string lsq_forward(const KernelCall &call);
std::string lsq_backward(const KernelCall &call);

// optimizer.cpp
std::string momentum_step(const KernelCall &call);

// probes.cpp
double probe_convolution(const memory::dims &x, int64_t out_channels, int64_t kernel, int64_t stride, dt type,
                         int repeats);
double peak_gmacs(dt type);

}  // namespace resnet_conv
