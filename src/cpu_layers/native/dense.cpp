// Convolutions of small maps as dense layers: one matrix product over the batch, with the matrix
// spread from the weights and its gradient gathered back onto the kernel's taps.
#include "core.hpp"

#include <immintrin.h>  // SSE2's streaming stores (this library is built for x86_64 only)

namespace resnet_conv {

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

namespace {

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

// Each operand's matrix and its place in the product (source x weights = destination): the images'
// inputs x, their outputs y and the dense layer.
struct DenseSide {
    memory::desc desc;
    int arg, slot;
};

struct DenseSides {
    DenseSide x, y, layer;
    const memory::desc &of(int arg) const { return (x.arg == arg ? x : y.arg == arg ? y : layer).desc; }
};

// The product of a kind of convolution (see dense_plan).
DenseSides dense_sides(Kind kind, int64_t images, int64_t rows, int64_t columns) {
    auto matrix = [](int64_t r, int64_t c) { return memory::desc({r, c}, dt::f32, tag::ab); };
    auto transposed = [](int64_t r, int64_t c) { return memory::desc({r, c}, dt::f32, memory::dims{1, r}); };
    if (kind == kConvForward)
        return {{matrix(images, columns), DNNL_ARG_SRC, conv_forward::x},
                {matrix(images, rows), DNNL_ARG_DST, conv_forward::y},
                {transposed(columns, rows), DNNL_ARG_WEIGHTS, conv_forward::w}};
    if (kind == kConvBackwardData)
        return {{matrix(images, columns), DNNL_ARG_DST, conv_backward_data::dx},
                {matrix(images, rows), DNNL_ARG_SRC, conv_backward_data::dy},
                {matrix(rows, columns), DNNL_ARG_WEIGHTS, conv_backward_data::w}};
    return {{matrix(images, columns), DNNL_ARG_WEIGHTS, conv_backward_weights::x},
            {transposed(rows, images), DNNL_ARG_SRC, conv_backward_weights::dy},
            {matrix(rows, columns), DNNL_ARG_DST, conv_backward_weights::dw}};
}

// A dense plan's steps (Plan::steps): the matrix found, or built from the weights, the product, and
// for the weight gradient the matrix's gradient summed onto the taps.
struct DenseSteps {
    DenseLayer d;
    DenseSides sides;
    Plan *plan;       // the primitive, its scratchpad, and where `keeps`, the operand whose `kept` holds the matrices
    bool gradient;    // the weight gradient's: the product writes the matrix
    bool itself;      // matrix_is_weights
    bool keeps;       // an evaluation's forward, which keeps its matrix per weights tensor while they are frozen
    bool in_slot;     // the matrix is in the `matrix_slot` argument, not the shared buffer
    bool given;       // built there by the training forward
    int matrix_slot;

    float *matrix(void **slots) const {
        auto &s = state();
        const int weights = sides.layer.slot;
        if (itself) return static_cast<float *>(slots[weights]);
        const auto *w = static_cast<const float *>(slots[weights]);
        if (keeps && g_frozen_version != 0) {
            auto spread = [&](memory &kept) { spread_weights(d, w, static_cast<float *>(kept.get_data_handle())); };
            return static_cast<float *>(
                kept_buffer(plan->operands.front(), slots[weights], sides.layer.desc, spread).get_data_handle());
        }
        const size_t bytes = d.rows() * d.columns() * sizeof(float);
        float *dense = static_cast<float *>(in_slot ? slots[matrix_slot] : grown(s.dense, s.dense_bytes, bytes));
        if (!gradient && !given) spread_weights(d, w, dense);
        return dense;
    }

    void operator()(void **slots) const {
        auto &s = state();
        float *dense = matrix(slots);
        std::unordered_map<int, memory> args{{sides.x.arg, memory(sides.x.desc, s.engine, slots[sides.x.slot])},
                                             {sides.y.arg, memory(sides.y.desc, s.engine, slots[sides.y.slot])},
                                             {sides.layer.arg, memory(sides.layer.desc, s.engine, dense)}};
        bind_scratchpad(*plan, args);
        plan->primitive.execute(s.stream, args);
        if (gradient && !itself) {
            s.stream.wait();
            gather_taps(d, dense, static_cast<float *>(slots[sides.layer.slot]));
        }
    }
};

}  // namespace

// The batch's images as rows: X[N, I*H*W] and Y[N, O*OH*OW] over MindSpore's buffers as they are, and D
// the dense matrix [O*OH*OW, I*H*W]. Forward Y = X D^T, backward data dX = dY D, backward weights
// D = dY^T X summed onto the taps.
std::unique_ptr<Plan> dense_plan(Kind kind, const memory::dims &x_dims, const memory::dims &w_dims,
                                 const memory::dims &y_dims, const ConvParams &p, const memory::desc &x_user,
                                 const memory::desc &y_user, int64_t matrix_elements) {
    auto block = [](const memory::desc &d) { return d.get_inner_nblks() ? d.get_inner_blks()[0] : int64_t{1}; };
    const DenseLayer d = dense_layer_of(x_dims, w_dims, y_dims, p, block(x_user), block(y_user));
    const DenseSides sides = dense_sides(kind, x_dims[0], d.rows(), d.columns());
    auto pd = dnnl::matmul::primitive_desc(state().engine, sides.of(DNNL_ARG_SRC), sides.of(DNNL_ARG_WEIGHTS),
                                           sides.of(DNNL_ARG_DST), user_scratchpad());
    auto plan = std::make_unique<Plan>();
    plan->primitive = dnnl::matmul(pd);
    plan->scratchpad = pd.scratchpad_desc();
    // An evaluation's forward keeps its matrix per weights tensor while they are frozen, as the other
    // convolutions keep their weights' reorders (in the weights operand's `kept`, which freezing and
    // thawing drop): built once per evaluation, not per batch.
    const bool itself = matrix_is_weights(x_dims, w_dims, y_dims);
    const bool keeps = kind == kConvForward && p.inference && !itself;
    if (keeps) {
        plan->operands.push_back(Operand(DNNL_ARG_WEIGHTS, sides.layer.slot, false, memory()));
        plan->operands.back().keeps_reorders = true;
    }
    // A training forward writes its matrix into its `matrix` output, which the backward of the image
    // gradient is given (convolution.py's bprop): built once per step, not twice. The slot is used when it
    // holds the whole matrix (convolution.py sizes it by WeightMatrixElements); else the shared buffer.
    const bool gradient = kind == kConvBackwardWeights;
    const bool in_slot = !keeps && !gradient && matrix_elements == d.rows() * d.columns();
    const bool given = in_slot && kind == kConvBackwardData;  // built by the forward
    const int matrix_slot = kind == kConvForward ? int(conv_forward::matrix) : int(conv_backward_data::matrix);
    plan->steps = DenseSteps{d, sides, plan.get(), gradient, itself, keeps, in_slot, given, matrix_slot};
    return plan;
}

}  // namespace resnet_conv
