// The library's core (see core.hpp): the state, its buffers and the layouts this CPU's convolutions
// choose, a kernel's operands and how its plan runs, the kernel table, the plan cache, and the one way
// into every kernel (call_kernel: its lock, the table's checks, the error text).
#include "core.hpp"

namespace resnet_conv {

namespace {

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

}  // namespace

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

// A buffer of aligned_size(bytes), 64-byte aligned as oneDNN prefers; std::bad_alloc where there is none.
std::unique_ptr<uint8_t, FreeDeleter> aligned_buffer(size_t bytes) {
    std::unique_ptr<uint8_t, FreeDeleter> buffer(static_cast<uint8_t *>(std::aligned_alloc(64, aligned_size(bytes))));
    if (!buffer) throw std::bad_alloc();
    return buffer;
}

// A shared buffer of the state, at least `bytes` long.
void *grown(std::unique_ptr<uint8_t, FreeDeleter> &buffer, size_t &size, size_t bytes) {
    if (bytes > size) {
        buffer = aligned_buffer(bytes);
        size = aligned_size(bytes);
    }
    return buffer.get();
}

// An activation as a kernel's parameters say it is laid out: plain NCHW, or blocked in the layout
// this CPU's convolutions choose for its type (nChw16c for float32 on AVX-512, nChw8c on AVX2, NHWC
// for bfloat16 on AMX: asked of oneDNN once, see chosen_layout).
memory::desc activation(const memory::dims &shape, dt type, bool blocked) {
    if (!blocked) return memory::desc(shape, type, tag::nchw);
    const tag layout = type == dt::bf16 ? state().bf16_layout : state().f32_layout;
    if (layout == tag::undef) throw std::runtime_error("this CPU's oneDNN has no convolution of this type");
    return memory::desc(shape, type, layout);
}

namespace {

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

}  // namespace

// `zeroed_bytes`: see Operand (an output that fills part of its buffer).
Operand operand(int arg, int slot, bool output, const memory::desc &user_desc, const memory::desc &wanted,
                size_t zeroed_bytes) {
    auto &engine = state().engine;
    Operand result(arg, slot, output, memory(user_desc, engine, DNNL_MEMORY_NONE));
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

// The shared scratchpad, grown to what `plan`'s primitive asks, among its arguments (where it asks).
void bind_scratchpad(const Plan &plan, std::unordered_map<int, memory> &args) {
    if (const size_t bytes = plan.scratchpad.get_size()) {
        auto &s = state();
        args[DNNL_ARG_SCRATCHPAD] = memory(plan.scratchpad, s.engine, grown(s.scratchpad, s.scratchpad_bytes, bytes));
    }
}

void execute(Plan &plan, void **slots) {
    if (plan.steps) {
        plan.steps(slots);
        return;
    }
    auto &s = state();
    if (plan.prelude) execute(*plan.prelude, slots);
    std::unordered_map<int, memory> args = plan.owned;
    bind_scratchpad(plan, args);
    for (auto &o : plan.operands) {
        o.user.set_data_handle(slots[o.slot]);
        if (o.zeroed_bytes && !o.copies_blocks) {
            Timed timed(kZeroedGradients);
            std::memset(slots[o.slot], 0, o.zeroed_bytes);
        }
        if (o.keeps_reorders) {  // the weights of an inference forward, reordered once per frozen version
            args[o.arg] = kept_buffer(o, slots[o.slot], o.inner.get_desc(),
                                      [&](memory &buffer) { o.reorder.execute(s.stream, o.user, buffer); });
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

const KernelInfo &info(Kind kind) {
    static const KernelInfo table[] = {
        {"ConvForward", CONV_FORWARD_SLOTS(NAME_OF), conv_forward::count, conv_forward::params, sizeof(ConvParams),
         "int32", -1, slot_bits({conv_forward::x, conv_forward::w, conv_forward::y}), &kConvolutionFamily},
        {"ConvBackwardData", CONV_BACKWARD_DATA_SLOTS(NAME_OF), conv_backward_data::count, conv_backward_data::params,
         sizeof(ConvParams), "int32", -1,
         slot_bits({conv_backward_data::dy, conv_backward_data::w, conv_backward_data::x_shape,
                    conv_backward_data::dx}),
         &kConvolutionFamily},
        {"ConvBackwardWeights", CONV_BACKWARD_WEIGHTS_SLOTS(NAME_OF), conv_backward_weights::count,
         conv_backward_weights::params, sizeof(ConvParams), "int32", -1,
         slot_bits({conv_backward_weights::x, conv_backward_weights::dy, conv_backward_weights::w_shape,
                    conv_backward_weights::dw}), &kConvolutionFamily},
        {"NormForward", NORM_FORWARD_SLOTS(NAME_OF), norm_forward::count, norm_forward::params, sizeof(NormParams),
         "float32", norm_forward::workspace, slot_bits({norm_forward::x, norm_forward::y}), &kNormalizationFamily},
        {"NormBackward", NORM_BACKWARD_SLOTS(NAME_OF), norm_backward::count, norm_backward::params,
         sizeof(NormParams), "float32", norm_backward::workspace,
         slot_bits({norm_backward::x, norm_backward::dy, norm_backward::y, norm_backward::dx}), &kNormalizationFamily},
        {"PoolForward", POOL_FORWARD_SLOTS(NAME_OF), pool_forward::count, pool_forward::params, sizeof(PoolParams),
         "int32", -1, slot_bits({pool_forward::x, pool_forward::y}), &kPoolingFamily},
        {"PoolBackward", POOL_BACKWARD_SLOTS(NAME_OF), pool_backward::count, pool_backward::params,
         sizeof(PoolParams), "int32", -1, slot_bits({pool_backward::x, pool_backward::dy, pool_backward::dx}),
         &kPoolingFamily},
        {"ToPlain", REORDER_SLOTS(NAME_OF), reorder_slots::count, -1, 0, "", -1,
         slot_bits({reorder_slots::x, reorder_slots::y}), &kElementwiseFamily},
        {"ToBlocked", REORDER_SLOTS(NAME_OF), reorder_slots::count, -1, 0, "", -1,
         slot_bits({reorder_slots::x, reorder_slots::y}), &kElementwiseFamily},
        {"Sum", SUM_SLOTS(NAME_OF), sum_slots::count, -1, 0, "", -1, 0, &kElementwiseFamily},
        {"NormForwardForked", NORM_FORWARD_FORKED_SLOTS(NAME_OF), norm_forward_forked::count, norm_forward::params,
         sizeof(NormParams), "float32", norm_forward::workspace,
         slot_bits({norm_forward::x, norm_forward::y, norm_forward_forked::y_copy}), &kNormalizationFamily},
        {"NormBackwardSummed", NORM_BACKWARD_SUMMED_SLOTS(NAME_OF), norm_backward_summed::count,
         norm_backward::params, sizeof(NormParams), "float32", norm_backward::workspace,
         slot_bits({norm_backward::x, norm_backward::dy, norm_backward::y, norm_backward::dx,
                    norm_backward_summed::dy_copy}), &kNormalizationFamily},
        // the library's own loops
        {"Fork", FORK_SLOTS(NAME_OF), fork_slots::count, -1, 0, "", -1, 0, nullptr, fork_copies},
        {"AllFinite", "", 1, -1, 0, "", -1, 0, nullptr, all_finite, 1, true},
        {"UnscaleAllFinite", "", 2, -1, 0, "", -1, 0, nullptr, unscale_all_finite, 2, true},
        {"FakeQuant", FAKE_QUANT_SLOTS(NAME_OF), fake_quant::count, fake_quant::params, sizeof(QuantParams), "float32",
         -1, 0, nullptr, fake_quant_forward, 0, true},
        {"FakeQuantGrad", FAKE_QUANT_GRAD_SLOTS(NAME_OF), fake_quant_grad::count, fake_quant_grad::params,
         sizeof(QuantParams), "float32", -1, 0, nullptr, fake_quant_backward, 0, true},
        {"LearnedScaleQuant", LSQ_SLOTS(NAME_OF), lsq::count, lsq::params, sizeof(LsqParams), "float32", -1, 0,
         nullptr, lsq_forward, 0, true},
        {"LearnedScaleQuantGrad", LSQ_GRAD_SLOTS(NAME_OF), lsq_grad::count, lsq_grad::params, sizeof(LsqParams),
         "float32", -1, 0, nullptr, lsq_backward, 0, true},
        {"MomentumStep", "", 5, -1, 0, "", -1, 0, nullptr, momentum_step, 3, true},
    };
    static_assert(sizeof(table) / sizeof(table[0]) == kKindCount, "a line of the kernel table per Kind, in its order");
    return table[kind];
}

namespace {

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

// Records the one-line message TakeError gives back: the kernel, its arguments, what went wrong
// (`prefix` and `problem`). It runs in call_kernel's catch handlers, at the edge of the C ABI, so it
// throws nothing: a message it cannot build (no memory) is left empty.
int fail(const KernelInfo &k, int nparam, int *ndims, int64_t **shapes, const char **dtypes, const char *prefix,
         const char *problem) noexcept {
    try {
        g_error = std::string(k.name) + "(" + arguments_text(k.slots, nparam, ndims, shapes, dtypes) + "): " + prefix +
                  problem;
    } catch (...) {
        g_error.clear();
    }
    return 1;
}

// How many arguments a kernel takes, in words.
std::string argument_count(const KernelInfo &k) {
    if (!k.repeated) return std::to_string(k.count) + " arguments";
    const std::string per_tensor = k.repeated > 1 ? std::to_string(k.repeated) : "";
    return std::to_string(k.count) + " + " + per_tensor + "n arguments (n >= 1)";
}

// Why a kernel cannot take these arguments by its line of the table, or "" when it can.
std::string arguments_problem(const KernelInfo &k, const KernelCall &call) {
    const int nparam = call.nparam;
    int *ndims = call.ndims;
    int64_t **shapes = call.shapes;
    const char **dtypes = call.dtypes;
    const bool counted = k.repeated ? nparam >= k.count + k.repeated && (nparam - k.count) % k.repeated == 0
                                    : nparam == k.count;
    if (!counted) return "takes " + argument_count(k) + ", was given " + std::to_string(nparam);
    for (int i = 0; i < nparam; ++i) {
        const std::string type = dtypes[i];
        const char *wanted = i == k.params_slot      ? k.params_dtype
                             : i == k.workspace_slot ? "uint8"
                             : k.float32_only        ? "float32"
                                                     : nullptr;
        if (wanted ? type != wanted : type != "float32" && type != "bfloat16")
            return "argument " + std::to_string(i) + " is " + type + ", not " + (wanted ? wanted : "float32 or bfloat16");
    }
    for (int i = 0; i < 32; ++i)  // a slot of four_d is below count, which nparam reached
        if (k.four_d >> i & 1 && ndims[i] != 4)
            return "argument " + std::to_string(i) + " has " + std::to_string(ndims[i]) + " dimensions, not 4";
    if (k.params_slot >= 0 &&
        (ndims[k.params_slot] != 1 || static_cast<size_t>(shapes[k.params_slot][0]) * 4 != k.params_size))
        return "the parameter record holds " + std::to_string(element_count(ndims[k.params_slot], shapes[k.params_slot])) +
               " values, not " + std::to_string(k.params_size / 4);
    return k.family && k.family->record_problem ? k.family->record_problem(call) : "";
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

int plan_threads(const Family &family, const KernelCall &call) {
    const bool small = family.macs ? family.macs(call) < kOneThreadMacs
                                   : call.elements(0) < kOneThreadElements;
    return small ? 1 : kernel_threads();
}

// A plan kernel whose arguments passed the checks: its plan, from the cache or made, run between the
// family's own loops.
void run_plan(State &s, const KernelInfo &k, const KernelCall &call) {
    const Family &family = *k.family;
    use_threads(plan_threads(family, call));
    if (family.before) family.before(call);
    const int64_t workspace_bytes = k.workspace_slot >= 0 ? call.elements(k.workspace_slot) : 0;
    const std::string key = key_of(call.kind, call.nparam, call.ndims, call.shapes, call.dtypes, call.record,
                                   k.params_size);
    auto &plan = cached_plan(s, key, [&] { return family.make_plan(call, workspace_bytes); });
    execute(plan, call.params);
    s.stream.wait();
    if (family.after) family.after(call);
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

}  // namespace

// The one way in for every kernel MindSpore calls (c_abi.cpp): under the state's lock (one kernel at
// a time, each already using every thread), the table's checks, then the kernel. Nothing is thrown
// across the C ABI, where an exception ends the process without a word: whatever a kernel throws
// (oneDNN's errors, a failed allocation, anything else) becomes the one line TakeError gives back,
// and a non-zero return MindSpore reports.
int call_kernel(Kind kind, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
    const KernelInfo &k = info(kind);
    std::unique_lock<std::mutex> guard;  // declared outside the try: the handlers write the message under it
    try {
        auto &s = state();
        guard = std::unique_lock<std::mutex>(s.lock);
        // the record is read only once the table's checks found it where and of the size it should be
        const KernelCall call{kind, nparam, params, ndims, shapes, dtypes,
                              nparam == k.count && k.params_slot >= 0 ? params[k.params_slot] : ""};
        std::string problem = arguments_problem(k, call);
        if (problem.empty() && k.family) {
            run_plan(s, k, call);
        } else if (problem.empty()) {
            use_threads();
            problem = k.own(call);
        }
        return problem.empty() ? 0 : fail(k, nparam, ndims, shapes, dtypes, "", problem.c_str());
    } catch (const dnnl::error &e) {
        return fail(k, nparam, ndims, shapes, dtypes, "oneDNN: ", e.what());
    } catch (const std::exception &e) {
        return fail(k, nparam, ndims, shapes, dtypes, "", e.what());
    } catch (...) {
        return fail(k, nparam, ndims, shapes, dtypes, "", "an exception of unknown type");
    }
}

// The kept reorders dropped (FreezeWeights, ThawWeights): none made under an earlier version can serve
// again, and each holds a copy of a weights tensor at an address MindSpore may have freed since: a
// network that loads new weights before each evaluation (the EMA's) grew by a copy per address
// (ResNet18, 12 loads and evaluations: 849 MB resident, 699 MB with the drop).
void drop_kept_reorders(State &s) {
    each_operand(s, [](Operand &o) { o.kept.clear(); });
}

int64_t kept_reorder_bytes(State &s) {
    int64_t bytes = 0;
    each_operand(s, [&bytes](Operand &o) {
        for (const auto &kept : o.kept) bytes += static_cast<int64_t>(kept.second.first.get_desc().get_size());
    });
    return bytes;
}

}  // namespace resnet_conv
