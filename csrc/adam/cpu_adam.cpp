// The cpu_adam op: Adam/AdamW over CPU tensors (fp32 masters, optional copy of the result in another dtype),
// Muon's momentum fold and the application of its update, vectorised (csrc/includes/simd.h) and split over
// torch's intra-op thread pool.
//
// One translation unit with the lightest torch headers that give tensors, the thread pool and the Python
// bindings, so a JIT build stays well under a minute on two cores.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_adam.h"

namespace {

// Elements per unit of work handed to a thread: a multiple of every register width, and of 32 so that the
// half-precision arrays are split on 64-byte boundaries.
constexpr int64_t kBlock = 4096;
// Below this many blocks the step runs on the calling thread (waking the pool costs more than it saves).
constexpr int64_t kBlocksPerThread = 16;

void check(bool condition, const std::string& message)
{
    if (!condition) throw std::invalid_argument(message);
}

ds::Array array_of(const at::Tensor& tensor, const char* name, int64_t numel)
{
    check(tensor.device().is_cpu(), std::string("cpu_adam: ") + name + " must be a CPU tensor, got one on " +
                                        tensor.device().str());
    check(tensor.is_contiguous(), std::string("cpu_adam: ") + name + " must be contiguous");
    check(tensor.numel() == numel, std::string("cpu_adam: ") + name + " has " + std::to_string(tensor.numel()) +
                                       " elements, the parameter has " + std::to_string(numel));
    ds::Dtype dtype;
    switch (tensor.scalar_type()) {
        case at::kFloat: dtype = ds::Dtype::f32; break;
        case at::kBFloat16: dtype = ds::Dtype::bf16; break;
        case at::kHalf: dtype = ds::Dtype::f16; break;
        default:
            throw std::invalid_argument(std::string("cpu_adam: ") + name + " must be float32, bfloat16 or float16, got " +
                                        std::string(c10::toString(tensor.scalar_type())));
    }
    return ds::Array{tensor.data_ptr(), dtype};
}

ds::Array optional_array(const std::optional<at::Tensor>& tensor, const char* name, int64_t numel)
{
    return tensor.has_value() ? array_of(*tensor, name, numel) : ds::Array{};
}

std::vector<int64_t> compiled_widths()
{
    std::vector<int64_t> widths;
#if defined(__AVX512__)
    widths.push_back(ds::Avx512::width);
#endif
#if defined(__AVX256__)
    widths.push_back(ds::Avx2::width);
#endif
#if defined(__NEON__)
    widths.push_back(ds::Neon::width);
#endif
    widths.push_back(ds::Scalar::width);
    return widths;
}

int64_t resolve_width(int64_t width)
{
    const std::vector<int64_t> widths = compiled_widths();
    if (width == 0) return widths.front();
    for (int64_t compiled : widths)
        if (compiled == width) return width;
    std::string known;
    for (int64_t compiled : widths) known += (known.empty() ? "" : ", ") + std::to_string(compiled);
    throw std::invalid_argument("cpu_adam: simd_width " + std::to_string(width) + " is not compiled in; this build has " +
                                known + " (0 picks the widest)");
}

// Runs range_fn<V>(begin, end) over [0, numel) in blocks, on torch's thread pool.
template <template <class> class Range, class... Args>
void run(int64_t numel, int64_t width, const Args&... args)
{
    const int64_t blocks = (numel + kBlock - 1) / kBlock;
    auto over_blocks = [&](auto tag) {
        using V = decltype(tag);
        at::parallel_for(0, blocks, kBlocksPerThread, [&](int64_t first, int64_t last) {
            Range<V>::run(args..., first * kBlock, std::min(numel, last * kBlock));
        });
    };
    switch (resolve_width(width)) {
#if defined(__AVX512__)
        case ds::Avx512::width: over_blocks(ds::Avx512{}); break;
#endif
#if defined(__AVX256__)
        case ds::Avx2::width: over_blocks(ds::Avx2{}); break;
#endif
#if defined(__NEON__)
        case ds::Neon::width: over_blocks(ds::Neon{}); break;
#endif
        default: over_blocks(ds::Scalar{});
    }
}

template <class V>
struct AdamRange {
    static void run(const ds::AdamArgs& args, const ds::AdamArrays& arrays, int64_t begin, int64_t end)
    {
        ds::adam_range<V>(args, arrays, begin, end);
    }
};

template <class V>
struct MomentumRange {
    static void run(const ds::MomentumArgs& args, const ds::MomentumArrays& arrays, int64_t begin, int64_t end)
    {
        ds::momentum_range<V>(args, arrays, begin, end);
    }
};

template <class V>
struct UpdateRange {
    static void run(const ds::UpdateArgs& args, const ds::UpdateArrays& arrays, int64_t begin, int64_t end)
    {
        ds::update_range<V>(args, arrays, begin, end);
    }
};

void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& max_exp_avg_sq, const std::optional<at::Tensor>& copy, int64_t step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
               bool adamw_mode, double grad_factor, int64_t simd_width)
{
    check(step >= 1, "cpu_adam: step must be >= 1 (the count including this update), got " + std::to_string(step));
    const int64_t numel = param.numel();
    ds::AdamArrays arrays{array_of(param, "param", numel),
                          array_of(grad, "grad", numel),
                          array_of(exp_avg, "exp_avg", numel),
                          array_of(exp_avg_sq, "exp_avg_sq", numel),
                          optional_array(max_exp_avg_sq, "max_exp_avg_sq", numel),
                          optional_array(copy, "copy", numel)};
    const double bias1 = bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0;
    const double bias2 = bias_correction ? 1.0 - std::pow(beta2, double(step)) : 1.0;
    ds::AdamArgs args{float(lr / bias1),
                      float(1.0 / std::sqrt(bias2)),
                      float(beta1),
                      float(1.0 - beta1),
                      float(beta2),
                      float(1.0 - beta2),
                      float(eps),
                      float(weight_decay),
                      float(1.0 - lr * weight_decay),
                      float(grad_factor),
                      adamw_mode,
                      weight_decay != 0.0};
    run<AdamRange>(numel, simd_width, args, arrays);
}

void muon_momentum(const at::Tensor& grad, const at::Tensor& momentum, const std::optional<at::Tensor>& direction,
                   double beta, bool nesterov, bool fold, std::optional<double> grad_factor, int64_t simd_width)
{
    const int64_t numel = momentum.numel();
    ds::MomentumArrays arrays{array_of(grad, "grad", numel), array_of(momentum, "momentum", numel),
                              optional_array(direction, "direction", numel)};
    // The weights as torch receives them from Python: computed in double, then rounded to float.
    // The gradient scale as the fp32 factor it is (an unscaled gradient is grad.float() * factor, one rounding).
    ds::MomentumArgs args{ds::LerpWeight(float(1.0 - beta)), ds::LerpWeight(float(beta)), nesterov, fold,
                          float(grad_factor.value_or(1.0)), grad_factor.has_value()};
    run<MomentumRange>(numel, simd_width, args, arrays);
}

void apply_update(const at::Tensor& param, const at::Tensor& update, double alpha, double decay, bool has_decay,
                  const std::optional<at::Tensor>& copy, int64_t simd_width)
{
    const int64_t numel = param.numel();
    check(param.scalar_type() == at::kFloat, "cpu_adam: param must be float32 (the master), got " +
                                                 std::string(c10::toString(param.scalar_type())));
    ds::UpdateArrays arrays{array_of(param, "param", numel), array_of(update, "update", numel),
                            optional_array(copy, "copy", numel)};
    // Both as torch receives Python numbers for a float32 tensor: rounded to float once.
    ds::UpdateArgs args{float(alpha), float(decay), has_decay};
    run<UpdateRange>(numel, simd_width, args, arrays);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "DeepSpeed CPU optimizer kernels: Adam/AdamW, Muon's momentum fold and its update";
    m.def("adam_step", &adam_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
          "One Adam/AdamW step in place over CPU tensors (see deepspeed/ops/adam/cpu_adam.py)", pybind11::arg("param"),
          pybind11::arg("grad"), pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"),
          pybind11::arg("max_exp_avg_sq"), pybind11::arg("copy"), pybind11::arg("step"), pybind11::arg("lr"),
          pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"),
          pybind11::arg("bias_correction"), pybind11::arg("adamw_mode"), pybind11::arg("grad_factor") = 1.0,
          pybind11::arg("simd_width") = 0);
    m.def("muon_momentum", &muon_momentum, pybind11::call_guard<pybind11::gil_scoped_release>(),
          "Muon's momentum lerp (in place with fold=True) and its Newton-Schulz direction", pybind11::arg("grad"),
          pybind11::arg("momentum"), pybind11::arg("direction"), pybind11::arg("beta"), pybind11::arg("nesterov"),
          pybind11::arg("fold"), pybind11::arg("grad_factor") = pybind11::none(), pybind11::arg("simd_width") = 0);
    m.def("apply_update", &apply_update, pybind11::call_guard<pybind11::gil_scoped_release>(),
          "Muon's update into its fp32 master in place: param * decay (with has_decay), plus alpha * update; the "
          "result also into copy in its dtype, when given",
          pybind11::arg("param"), pybind11::arg("update"), pybind11::arg("alpha"), pybind11::arg("decay"),
          pybind11::arg("has_decay"), pybind11::arg("copy") = pybind11::none(), pybind11::arg("simd_width") = 0);
    m.def("simd_widths", &compiled_widths, "Register widths (float lanes) compiled into this build, widest first");
}
