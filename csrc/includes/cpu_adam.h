// Element-wise CPU optimizer kernels over raw arrays: the Adam/AdamW step, Muon's momentum fold and the
// application of its update to the master.
//
// Pure C++ (no torch headers): csrc/adam/cpu_adam.cpp checks the tensors, splits the work over torch's thread
// pool and calls these on each range. Every array may be fp32, bf16 or fp16 (converted in registers; the
// arithmetic is fp32), and each range is walked in whole registers of V followed by a Scalar tail that computes
// the same bits (simd.h).
#pragma once

#include <cstdint>

#include "simd.h"

namespace ds {

// A typed array.
struct Array {
    void* data = nullptr;
    Dtype dtype = Dtype::f32;
    explicit operator bool() const { return data != nullptr; }
};

// The copy of an updated param is the param as stored, cast (`param.to(copy.dtype)`): a 16-bit param is read back
// from what was just stored, so the copy is rounded from its value, not from the fp32 result (whose own rounding
// to the copy's dtype can differ). An fp32 param is the result itself.
template <class V>
inline void store_copy(const Array& param_array, const Array& copy, int64_t i, typename V::reg param)
{
    if (param_array.dtype != Dtype::f32) param = V::load_as_float(param_array.dtype, param_array.data, i);
    V::store_from_float(copy.dtype, copy.data, i, param);
}

// Scalars of one Adam step, derived once on the host in double precision.
struct AdamArgs {
    float step_size;           // lr / (1 - beta1^step), or lr without bias correction
    float inv_sqrt_bias2;      // 1 / sqrt(1 - beta2^step), or 1
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
    float eps;
    float weight_decay;        // Adam (L2) mode: added to the gradient as weight_decay * param
    float decay;               // AdamW mode: param *= 1 - lr * weight_decay
    float grad_factor;          // multiplies every gradient first (unscale and clip in one factor)
    bool adamw_mode;
    bool has_weight_decay;
};

struct AdamArrays {
    Array param, grad, exp_avg, exp_avg_sq;
    Array max_exp_avg_sq;      // AMSGrad's running maximum, when used
    Array copy;                // receives the updated param in its own dtype, when given
};

template <class V>
inline void adam_lanes(const AdamArgs& a, const AdamArrays& t, int64_t i)
{
    using R = typename V::reg;
    R grad = V::mul(V::load_as_float(t.grad.dtype, t.grad.data, i), V::set1(a.grad_factor));
    R param = V::load_as_float(t.param.dtype, t.param.data, i);
    if (a.has_weight_decay && !a.adamw_mode) grad = V::fma(V::set1(a.weight_decay), param, grad);
    const R exp_avg =
        V::fma(V::set1(a.beta1), V::load_as_float(t.exp_avg.dtype, t.exp_avg.data, i), V::mul(V::set1(a.one_minus_beta1), grad));
    const R exp_avg_sq = V::fma(V::set1(a.beta2), V::load_as_float(t.exp_avg_sq.dtype, t.exp_avg_sq.data, i),
                                V::mul(V::mul(V::set1(a.one_minus_beta2), grad), grad));
    V::store_from_float(t.exp_avg.dtype, t.exp_avg.data, i, exp_avg);
    V::store_from_float(t.exp_avg_sq.dtype, t.exp_avg_sq.data, i, exp_avg_sq);
    R second = exp_avg_sq;
    if (t.max_exp_avg_sq) {
        second = V::max(V::load_as_float(t.max_exp_avg_sq.dtype, t.max_exp_avg_sq.data, i), exp_avg_sq);
        V::store_from_float(t.max_exp_avg_sq.dtype, t.max_exp_avg_sq.data, i, second);
    }
    const R denom = V::fma(V::sqrt(second), V::set1(a.inv_sqrt_bias2), V::set1(a.eps));
    if (a.has_weight_decay && a.adamw_mode) param = V::mul(param, V::set1(a.decay));
    param = V::fma(V::set1(-a.step_size), V::div(exp_avg, denom), param);
    V::store_from_float(t.param.dtype, t.param.data, i, param);
    if (t.copy) store_copy<V>(t.param, t.copy, i, param);
}

// Elements [begin, end) of one Adam step.
template <class V>
inline void adam_range(const AdamArgs& a, const AdamArrays& t, int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + V::width <= end; i += V::width) adam_lanes<V>(a, t, i);
    for (; i < end; ++i) adam_lanes<Scalar>(a, t, i);
}

// torch's lerp, start + weight * (end - start), evaluated as torch's vectorised CPU kernel does: one fused
// multiply-add from the nearer end, so the results are its bits.
struct LerpWeight {
    float coefficient;  // weight, or weight - 1 when |weight| >= 0.5
    bool from_start;    // |weight| < 0.5

    explicit LerpWeight(float weight)
        : coefficient(std::fabs(weight) < 0.5f ? weight : weight - 1.0f), from_start(std::fabs(weight) < 0.5f)
    {
    }
};

template <class V>
inline typename V::reg lerp(typename V::reg start, typename V::reg end, const LerpWeight& w)
{
    return V::fma(V::set1(w.coefficient), V::sub(end, start), w.from_start ? start : end);
}

// Muon's momentum step: new = lerp(momentum, grad, 1 - beta); with `fold` it is stored as the momentum; the
// direction Newton-Schulz takes is lerp(grad, new, beta) (Nesterov) or new, written in the direction's dtype.
struct MomentumArgs {
    LerpWeight fold_weight;       // 1 - beta
    LerpWeight nesterov_weight;   // beta
    bool nesterov;
    bool fold;
    float grad_factor;             // multiplies every gradient as it is read (the unscale and clip), when has_grad_factor
    bool has_grad_factor;
};

struct MomentumArrays {
    Array grad, momentum;
    Array direction;  // optional
};

template <class V>
inline void momentum_lanes(const MomentumArgs& a, const MomentumArrays& t, int64_t i)
{
    using R = typename V::reg;
    R grad = V::load_as_float(t.grad.dtype, t.grad.data, i);
    if (a.has_grad_factor) grad = V::mul(grad, V::set1(a.grad_factor));
    const R momentum = lerp<V>(V::load_as_float(t.momentum.dtype, t.momentum.data, i), grad, a.fold_weight);
    if (a.fold) V::store_from_float(t.momentum.dtype, t.momentum.data, i, momentum);
    if (t.direction) {
        const R direction = a.nesterov ? lerp<V>(grad, momentum, a.nesterov_weight) : momentum;
        V::store_from_float(t.direction.dtype, t.direction.data, i, direction);
    }
}

template <class V>
inline void momentum_range(const MomentumArgs& a, const MomentumArrays& t, int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + V::width <= end; i += V::width) momentum_lanes<V>(a, t, i);
    for (; i < end; ++i) momentum_lanes<Scalar>(a, t, i);
}

// A Muon update applied to its master: param <- param * decay (with weight decay), then param + alpha * update,
// one fused multiply-add, as torch's `param.mul_(decay)` and `param.add_(update, alpha=alpha)` compute it (its
// vectorised add is one fmadd, whatever the dtype the update is converted from). The update in any dtype. With a
// copy, the updated master is also written there in the copy's dtype (torch's `.to(dtype)` rounding): the model-dtype
// weights ZeRO-Offload publishes, in the same pass instead of another one over every master.
struct UpdateArgs {
    float alpha;   // -lr * the update's scale
    float decay;   // 1 - lr * weight_decay
    bool has_decay;
};

struct UpdateArrays {
    Array param, update;
    Array copy;  // receives the updated param in its own dtype, when given
};

template <class V>
inline void update_lanes(const UpdateArgs& a, const UpdateArrays& t, int64_t i)
{
    using R = typename V::reg;
    R param = V::load_as_float(t.param.dtype, t.param.data, i);
    if (a.has_decay) param = V::mul(param, V::set1(a.decay));
    param = V::fma(V::load_as_float(t.update.dtype, t.update.data, i), V::set1(a.alpha), param);
    V::store_from_float(t.param.dtype, t.param.data, i, param);
    if (t.copy) V::store_from_float(t.copy.dtype, t.copy.data, i, param);  // the param is the fp32 master
}

template <class V>
inline void update_range(const UpdateArgs& a, const UpdateArrays& t, int64_t begin, int64_t end)
{
    int64_t i = begin;
    for (; i + V::width <= end; i += V::width) update_lanes<V>(a, t, i);
    for (; i < end; ++i) update_lanes<Scalar>(a, t, i);
}

}  // namespace ds
