// Timings of convolutions on this CPU (ProbeConvolution, PeakGmacs).
#include "core.hpp"

namespace resnet_conv {

namespace {

// A buffer for the probes below, zeroed.
std::unique_ptr<uint8_t, FreeDeleter> zeroed(size_t bytes) {
    auto buffer = aligned_buffer(bytes);
    std::memset(buffer.get(), 0, aligned_size(bytes));
    return buffer;
}

double milliseconds_since(const std::chrono::steady_clock::time_point &start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// The best of `repeats` timings of one convolution's forward and both backwards, activations
// blocked in `type` between layers as in a network (weights float32 OIHW, reordered per call):
// what a layer of a training step costs in float32 or in bfloat16.
double probe_convolution(const memory::dims &x, int64_t out_channels, int64_t kernel, int64_t stride, dt type,
                         int repeats) {
    if (*std::min_element(x.begin(), x.end()) < 1 || std::min({out_channels, kernel, stride}) < 1)
        throw std::invalid_argument("a probe's sizes, kernel and stride are 1 or more");  // not a division by 0
    const int64_t pad = kernel / 2, out_size = (x[2] + 2 * pad - kernel) / stride + 1;
    const memory::dims w{out_channels, x[1], kernel, kernel}, y{x[0], out_channels, out_size, out_size};
    const int32_t s32 = static_cast<int32_t>(stride), p32 = static_cast<int32_t>(pad);
    const ConvParams p{s32, s32, p32, p32, p32, p32, 1, 1, 1, type == dt::bf16, kInputBlocked | kOutputBlocked, 0};
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
    const ConvParams p{1, 1, 0, 0, 0, 0, 1, 1, 1, type == dt::bf16, kInputBlocked | kOutputBlocked, 0};
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

}  // namespace resnet_conv
