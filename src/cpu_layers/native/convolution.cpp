// Convolutions (forward, backward-data, backward-weights) through oneDNN's primitives, and the float32
// weight gradients of the smallest maps as one matrix product over the batch.
#include "core.hpp"

namespace resnet_conv {

namespace {

// The weights as oneDNN sees them: OIHW, or GOIHW over the same buffer for grouped convolutions.
memory::desc weights_desc(const memory::dims &w, int groups, dt type, tag format) {
    if (groups == 1) return memory::desc(w, type, format);
    memory::dims grouped{groups, w[0] / groups, w[1], w[2], w[3]};
    return memory::desc(grouped, type, format == tag::any ? tag::any : tag::goihw);
}

}  // namespace

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

namespace {

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
        bind_scratchpad(*self, args);
        self->primitive.execute(s.stream, args);
        if (inside) {
            s.stream.wait();
            place_taps(static_cast<const float *>(product.get_data_handle()), static_cast<float *>(slots[dw]),
                       w_dims, w_conv, pad_at);
        }
    };
    return plan;
}

// The convolution the primitives run: the one asked for, or where the image lies inside the kernel
// (image_inside_kernel) an unpadded one of the image's size over the taps that meet it.
struct ConvGeometry {
    bool inside;
    memory::dims strides, dilation, pad_l, pad_r;
    memory::dims w_conv;  // the weights the primitive convolves with
};

ConvGeometry conv_geometry(const memory::dims &x, const memory::dims &w, const memory::dims &y, const ConvParams &p) {
    ConvGeometry g{image_inside_kernel(x, w, y, p), {p.stride_h, p.stride_w}, {p.dilation_h - 1, p.dilation_w - 1},
                   {p.pad_top, p.pad_left}, {p.pad_bottom, p.pad_right}, w};
    if (g.inside) {
        g.strides = {1, 1}, g.pad_l = {0, 0}, g.pad_r = {0, 0};
        g.w_conv = {w[0], w[1], x[2], x[3]};
    }
    return g;
}

// What a plan of oneDNN's convolution primitives is made of: the tensors as MindSpore holds them
// (`*_user`) and as the primitives may choose them (`*_any`), and the forward's description, which
// the backwards are made from.
struct ConvDescs {
    memory::desc x_any, y_any, w_any, x_user, y_user, w_user;
    memory::desc taps;  // image_inside_kernel's taps, as the forward hands them to the image gradient's backward
    bool taps_handed;
    dnnl::primitive_attr attr;
    dnnl::convolution_forward::primitive_desc forward;

    // The weights: the taps' copy where the forward hands it, else the OIHW buffer.
    Operand weights(int w_slot, int matrix_slot, const memory::desc &wanted) const {
        return taps_handed ? operand(DNNL_ARG_WEIGHTS, matrix_slot, false, taps, wanted)
                           : operand(DNNL_ARG_WEIGHTS, w_slot, false, w_user, wanted);
    }
};

ConvDescs conv_descs(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims, const memory::dims &y_dims,
                     const ConvParams &p, const ConvGeometry &g, const memory::desc &x_user,
                     const memory::desc &y_user, int64_t matrix_elements) {
    const dt compute = p.bf16 ? dt::bf16 : dt::f32;
    auto w_user = weights_desc(w_dims, p.groups, dt::f32, tag::oihw);
    if (g.inside) w_user = w_user.submemory_desc(g.w_conv, {0, 0, p.pad_top, p.pad_left});  // those taps of OIHW
    // Those taps are strided through the whole OIHW buffer (a ninth of it at 1x1 images), which the
    // forward's and the image gradient's weight reorders each read. A training forward copies them out
    // once, into its `matrix` output, and the image gradient's backward, handed that copy (convolution.py's
    // bprop), reorders from it.
    const bool taps_handed = g.inside && !p.inference && kind != kConvBackwardWeights &&
                             matrix_elements == element_count(4, g.w_conv.data());
    ConvDescs c{memory::desc(x_dims, compute, tag::any), memory::desc(y_dims, compute, tag::any),
                weights_desc(g.w_conv, p.groups, compute, tag::any), x_user, y_user, w_user,
                weights_desc(g.w_conv, p.groups, dt::f32, tag::oihw), taps_handed, user_scratchpad(), {}};
    // forward_training for evaluation too: for inference oneDNN chose kernels that want NHWC here (two
    // more reorders per layer; a ResNet18 32 px evaluation at batch 64 took longer)
    c.forward = dnnl::convolution_forward::primitive_desc(
        state().engine, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, c.x_any, c.w_any,
        c.y_any, g.strides, g.dilation, g.pad_l, g.pad_r, c.attr);
    return c;
}

std::unique_ptr<Plan> forward_plan(const ConvDescs &c, const ConvParams &p) {
    auto &engine = state().engine;
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::convolution_forward(c.forward);
    using namespace conv_forward;
    plan->operands = {operand(DNNL_ARG_SRC, x, false, c.x_user, c.forward.src_desc()),
                      c.weights(w, matrix, c.forward.weights_desc()),
                      operand(DNNL_ARG_DST, y, true, c.y_user, c.forward.dst_desc())};
    if (c.taps_handed) {
        plan->prelude = std::make_unique<Plan>();
        plan->prelude->primitive = dnnl::reorder(memory(c.w_user, engine), memory(c.taps, engine));
        plan->prelude->operands = {operand(DNNL_ARG_FROM, w, false, c.w_user, c.w_user),
                                   operand(DNNL_ARG_TO, matrix, true, c.taps, c.taps)};
    }
    plan->operands[1].keeps_reorders = p.inference && plan->operands[1].reorders;
    own_scratchpad(*plan, c.forward);
    return plan;
}

std::unique_ptr<Plan> backward_data_plan(const ConvDescs &c, const ConvGeometry &g) {
    auto backward = dnnl::convolution_backward_data::primitive_desc(
        state().engine, dnnl::algorithm::convolution_direct, c.x_any, c.w_any, c.y_any, g.strides, g.dilation, g.pad_l,
        g.pad_r, c.forward, c.attr);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::convolution_backward_data(backward);
    using namespace conv_backward_data;
    plan->operands = {operand(DNNL_ARG_DIFF_DST, dy, false, c.y_user, backward.diff_dst_desc()),
                      c.weights(w, matrix, backward.weights_desc()),
                      operand(DNNL_ARG_DIFF_SRC, dx, true, c.x_user, backward.diff_src_desc())};
    own_scratchpad(*plan, backward);
    return plan;
}

// `w_dims`: the whole kernel, whose other taps get zeros where the primitive convolves some.
std::unique_ptr<Plan> backward_weights_plan(const ConvDescs &c, const ConvGeometry &g, const memory::dims &w_dims,
                                            int groups) {
    // bf16 weight gradients are accumulated in f32 (the master weights' type).
    auto dw_any = weights_desc(g.w_conv, groups, dt::f32, tag::any);
    auto backward = dnnl::convolution_backward_weights::primitive_desc(
        state().engine, dnnl::algorithm::convolution_direct, c.x_any, dw_any, c.y_any, g.strides, g.dilation, g.pad_l,
        g.pad_r, c.forward, c.attr);
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::convolution_backward_weights(backward);
    using namespace conv_backward_weights;
    const size_t zeroed = g.inside ? element_count(4, w_dims.data()) * sizeof(float) : 0;
    plan->operands = {operand(DNNL_ARG_SRC, x, false, c.x_user, backward.src_desc()),
                      operand(DNNL_ARG_DIFF_DST, dy, false, c.y_user, backward.diff_dst_desc()),
                      operand(DNNL_ARG_DIFF_WEIGHTS, dw, true, c.w_user, backward.diff_weights_desc(), zeroed)};
    own_scratchpad(*plan, backward);
    return plan;
}

}  // namespace

std::unique_ptr<Plan> conv_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                const memory::dims &y_dims, const ConvParams &p, dt x_type, dt y_type,
                                int64_t matrix_elements) {
    const ConvGeometry g = conv_geometry(x_dims, w_dims, y_dims, p);
    const auto x_user = activation(x_dims, x_type, p.layout & kInputBlocked);
    const auto y_user = activation(y_dims, y_type, p.layout & kOutputBlocked);
    if (as_dense_layer(x_dims, w_dims, y_dims, p, x_type, y_type))
        return dense_plan(kind, x_dims, w_dims, y_dims, p, x_user, y_user, matrix_elements);
    if (kind == kConvBackwardWeights && weight_gradient_as_product(y_dims, p, x_type, y_type))
        return weight_gradient_product(x_dims, w_dims, g.w_conv, y_dims, g.strides, g.dilation, g.pad_l,
                                       {p.pad_top, p.pad_left}, x_user, y_user, g.inside);
    const ConvDescs c = conv_descs(kind, x_dims, w_dims, y_dims, p, g, x_user, y_user, matrix_elements);
    if (kind == kConvForward) return forward_plan(c, p);
    if (kind == kConvBackwardData) return backward_data_plan(c, g);
    return backward_weights_plan(c, g, w_dims, p.groups);
}

// How many floats the training forward of a convolution (x, w -> y shapes) writes into its `matrix`
// output for the backward of its image gradient: a dense layer's matrix (as_dense_layer, in float32),
// the taps that meet an image inside the kernel (image_inside_kernel), else 0. convolution.py sizes
// that output by it.
int64_t weight_matrix_elements(const int64_t *x, const int64_t *w, const int64_t *y, ConvParams p) {
    memory::dims x_dims = dims_of(x, 4), w_dims = dims_of(w, 4), y_dims = dims_of(y, 4);
    if (p.pad_top < 0) same_padding(p, x_dims, w_dims);
    if (p.inference) return 0;
    if (as_dense_layer(x_dims, w_dims, y_dims, p, dt::f32, dt::f32))
        return matrix_is_weights(x_dims, w_dims, y_dims) ? 0 : element_count(3, y + 1) * element_count(3, x + 1);
    if (image_inside_kernel(x_dims, w_dims, y_dims, p)) return w[0] * w[1] * x[2] * x[3];
    return 0;
}

// How conv_plan runs a convolution on this CPU, under its ISA cap: "dense" (as_dense_layer: one matrix
// product over a matrix built from the weights), "dense on the weights" (matrix_is_weights: the
// weights are the matrix), "image inside kernel" (image_inside_kernel: oneDNN convolves the taps that
// meet the image) or "convolution" (oneDNN's kernels).
const char *convolution_path(const int64_t *x, const int64_t *w, const int64_t *y, ConvParams p) {
    memory::dims x_dims = dims_of(x, 4), w_dims = dims_of(w, 4), y_dims = dims_of(y, 4);
    if (p.pad_top < 0) same_padding(p, x_dims, w_dims);
    const dt type = p.bf16 ? dt::bf16 : dt::f32;
    if (as_dense_layer(x_dims, w_dims, y_dims, p, type, type))
        return matrix_is_weights(x_dims, w_dims, y_dims) ? "dense on the weights" : "dense";
    return image_inside_kernel(x_dims, w_dims, y_dims, p) ? "image inside kernel" : "convolution";
}

namespace {

// The convolutions' part of call_kernel (core.cpp).
std::string conv_record_problem(const KernelCall &call) {
    const auto &p = *static_cast<const ConvParams *>(call.record);
    if (p.stride_h < 1 || p.stride_w < 1 || p.dilation_h < 1 || p.dilation_w < 1 || p.groups < 1 ||
        (p.bf16 != 0 && p.bf16 != 1) || (p.layout & ~(kInputBlocked | kOutputBlocked)) != 0 ||
        (p.inference != 0 && p.inference != 1))
        return "the convolution's parameter record is out of range (stride, dilation and groups >= 1, bf16 0 or "
               "1, layout 0-3, inference 0 or 1)";
    return "";
}

std::unique_ptr<Plan> make_conv_plan(const KernelCall &call, int64_t) {
    ConvParams p;
    std::memcpy(&p, call.record, sizeof(p));
    int64_t **shapes = call.shapes;
    memory::dims x, w, y;
    int x_slot, y_slot;  // the x and y (or dx and dy) arguments, whose types the user descriptors take
    int64_t matrix_elements = 0;
    if (call.kind == kConvForward) {
        x = dims_of(shapes[conv_forward::x], 4), w = dims_of(shapes[conv_forward::w], 4);
        y = dims_of(shapes[conv_forward::y], 4), x_slot = conv_forward::x, y_slot = conv_forward::y;
        matrix_elements = call.elements(conv_forward::matrix);
    } else if (call.kind == kConvBackwardData) {
        x = dims_of(shapes[conv_backward_data::x_shape], 4), w = dims_of(shapes[conv_backward_data::w], 4);
        y = dims_of(shapes[conv_backward_data::dy], 4);
        x_slot = conv_backward_data::dx, y_slot = conv_backward_data::dy;
        matrix_elements = call.elements(conv_backward_data::matrix);
    } else {
        x = dims_of(shapes[conv_backward_weights::x], 4), w = dims_of(shapes[conv_backward_weights::w_shape], 4);
        y = dims_of(shapes[conv_backward_weights::dy], 4);
        x_slot = conv_backward_weights::x, y_slot = conv_backward_weights::dy;
    }
    if (p.pad_top < 0) same_padding(p, x, w);
    return conv_plan(call.kind, x, w, y, p, data_type(call.dtypes[x_slot]), data_type(call.dtypes[y_slot]),
                     matrix_elements);
}

// y's elements x w's per output channel.
int64_t conv_macs(const KernelCall &call) {
    const Kind kind = call.kind;
    const int64_t *w = kind == kConvForward ? call.shapes[conv_forward::w]
                       : kind == kConvBackwardData ? call.shapes[conv_backward_data::w]
                                                   : call.shapes[conv_backward_weights::w_shape];
    const int64_t *y = kind == kConvForward ? call.shapes[conv_forward::y]
                       : kind == kConvBackwardData ? call.shapes[conv_backward_data::dy]
                                                   : call.shapes[conv_backward_weights::dy];
    return element_count(4, y) * w[1] * w[2] * w[3];
}

// A training forward thaws the frozen weights (FreezeWeights).
void before_conv(const KernelCall &call) {
    if (call.kind == kConvForward && !static_cast<const ConvParams *>(call.record)->inference) g_frozen_version = 0;
}

}  // namespace

const Family kConvolutionFamily = {conv_record_problem, make_conv_plan, conv_macs, before_conv, nullptr};

}  // namespace resnet_conv
