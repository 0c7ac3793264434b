// Golden Stick's fake quantizers on CPU, each way: the simulated one (FakeQuant) and LSQ's.
#include "core.hpp"

#include <cmath>

namespace resnet_conv {

namespace {

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

// The checks and the loop both directions share (after the kernel table's): `each(range, begin,
// end)` for each run of x's elements [begin, end) that share a range; why the arguments were
// refused, or "".
template <typename Each>
std::string each_quantized(const KernelCall &call, int params_slot, Each each) {
    int *ndims = call.ndims;
    int64_t **shapes = call.shapes;
    const int64_t count = call.elements(0), ranges = call.elements(1);
    bool ok = ranges == call.elements(2) && ranges > 0;
    for (int i = params_slot + 1; ok && i < call.nparam; ++i) ok = call.elements(i) == count;
    const QuantParams p = *static_cast<const QuantParams *>(call.record);
    const int axis = static_cast<int>(p.channel_axis);
    ok = ok && (axis < 0 ? ranges == 1 : axis < ndims[0] && shapes[0][axis] == ranges);
    if (!ok)
        return "takes float32 tensors: x, low and high (one value, or one per channel of channel_axis), the "
               "QuantParams and x's shape for the rest";
    const float *low = static_cast<const float *>(call.params[1]), *high = static_cast<const float *>(call.params[2]);
    const int64_t inner = axis < 0 ? count : element_count(ndims[0] - axis - 1, shapes[0] + axis + 1);
    std::vector<QuantRange> nudged(ranges);
    for (int64_t c = 0; c < ranges; ++c) nudged[c] = nudged_range(low[c], high[c], p);
    for_each_run(count, ranges, inner, [&](int64_t, int64_t c, int64_t begin, int64_t end) {
        each(nudged[c], begin, end);
    });
    return "";
}

}  // namespace

std::string fake_quant_forward(const KernelCall &call) {
    const float *x = static_cast<const float *>(call.params[fake_quant::x]);
    float *y = static_cast<float *>(call.params[fake_quant::y]);
    return each_quantized(call, fake_quant::params, [&](const QuantRange &r, int64_t begin, int64_t end) {
        fake_quant_run(x + begin, y + begin, end - begin, r);
    });
}

std::string fake_quant_backward(const KernelCall &call) {
    const float *x = static_cast<const float *>(call.params[fake_quant_grad::x]);
    const float *dy = static_cast<const float *>(call.params[fake_quant_grad::dy]);
    float *dx = static_cast<float *>(call.params[fake_quant_grad::dx]);
    return each_quantized(call, fake_quant_grad::params, [&](const QuantRange &r, int64_t begin, int64_t end) {
        fake_quant_grad_run(x + begin, dy + begin, dx + begin, end - begin, r);
    });
}

namespace {

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

// One LSQ call's checked arguments: its record, the alpha count, the elements per alpha run, the levels.
struct LsqCall {
    LsqParams p;
    int64_t count, alphas, inner;
    float quant_max;
};

// The checks both directions share (after the kernel table's): true with `out` filled.
bool lsq_call(bool backward, const KernelCall &call, LsqCall *out) {
    const int params_slot = backward ? int(lsq_grad::params) : int(lsq::params), nparam = call.nparam;
    int *ndims = call.ndims;
    int64_t **shapes = call.shapes;
    out->count = call.elements(0);
    out->alphas = call.elements(1);
    bool ok = call.elements(2) == 1 && out->alphas > 0;
    for (int i = params_slot + 1; ok && i < nparam; ++i)
        ok = call.elements(i) == (backward && i == nparam - 1 ? out->alphas : out->count);
    if (!ok) return false;
    out->p = *static_cast<const LsqParams *>(call.record);
    out->quant_max = *static_cast<const float *>(call.params[2]);
    const int axis = static_cast<int>(out->p.channel_axis);
    if (axis < 0 ? out->alphas != 1 : axis >= ndims[0] || shapes[0][axis] != out->alphas) return false;
    out->inner = axis < 0 ? out->count : element_count(ndims[0] - axis - 1, shapes[0] + axis + 1);
    return true;
}

const char kLsqProblem[] =
    "takes float32 tensors: x, alpha (one value, or one per channel of channel_axis), quant_max (one value), the "
    "LsqParams and x's shape for the rest (alpha's for dalpha)";

}  // namespace

std::string lsq_forward(const KernelCall &call) {
    LsqCall checked;
    if (!lsq_call(false, call, &checked)) return kLsqProblem;
    void **params = call.params;
    const float *x = static_cast<const float *>(params[lsq::x]), *alpha = static_cast<const float *>(params[lsq::alpha]);
    float *y = static_cast<float *>(params[lsq::y]);
    for_each_run(checked.count, checked.alphas, checked.inner, [&](int64_t, int64_t c, int64_t begin, int64_t end) {
        lsq_run(x + begin, y + begin, end - begin, alpha[c], checked.quant_max, checked.p.lower);
    });
    return "";
}

std::string lsq_backward(const KernelCall &call) {
    LsqCall checked;
    if (!lsq_call(true, call, &checked)) return kLsqProblem;
    void **params = call.params;
    const float *x = static_cast<const float *>(params[lsq_grad::x]);
    const float *alpha = static_cast<const float *>(params[lsq_grad::alpha]);
    const float *dy = static_cast<const float *>(params[lsq_grad::dy]);
    float *dx = static_cast<float *>(params[lsq_grad::dx]), *dalpha = static_cast<float *>(params[lsq_grad::dalpha]);
    const int64_t alphas = checked.alphas, per_segment = runs_per_segment(checked.inner);
    const int64_t units = run_units(checked.count, checked.inner);
    std::vector<double> partial(static_cast<size_t>(units), 0.0);  // one sum per run, added in order below
    for_each_run(checked.count, alphas, checked.inner, [&](int64_t unit, int64_t c, int64_t begin, int64_t end) {
        partial[unit] =
            lsq_grad_run(x + begin, dy + begin, dx + begin, end - begin, alpha[c], checked.quant_max, checked.p.lower);
    });
    std::vector<double> sums(static_cast<size_t>(alphas), 0.0);
    for (int64_t unit = 0; unit < units; ++unit) sums[unit / per_segment % alphas] += partial[unit];
    for (int64_t c = 0; c < alphas; ++c) dalpha[c] = static_cast<float>(sums[c]);
    return "";
}

}  // namespace resnet_conv
