// The NEON path of csrc/includes/cpu_adam.h against its Scalar path, bit for bit (test_neon_under_qemu.py builds
// this for aarch64 and runs it under qemu where both are installed). Exit status 0: every value agrees.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpu_adam.h"

using namespace ds;

int main()
{
    const int n = 1003;  // whole registers and a tail
    std::vector<float> p(n), g(n), m(n), v(n), vmax(n);
    std::srand(1);
    for (int i = 0; i < n; ++i) {
        p[i] = std::rand() / float(RAND_MAX) - 0.5f;
        g[i] = (std::rand() / float(RAND_MAX) - 0.5f) * 10;
        m[i] = g[i] * 0.1f;
        v[i] = vmax[i] = g[i] * g[i] * 0.01f;
    }
    std::vector<float> p2 = p, m2 = m, v2 = v, vmax2 = vmax;
    std::vector<uint16_t> copy(n), copy2(n), direction(n), direction2(n);
    const AdamArgs args{1e-2f, 1.2f, 0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.01f, 0.9999f, 0.5f, true, true};
    int differences = 0;
    for (Dtype copy_dtype : {Dtype::bf16, Dtype::f16}) {
        AdamArrays neon{{p.data(), Dtype::f32}, {g.data(), Dtype::f32}, {m.data(), Dtype::f32},
                        {v.data(), Dtype::f32}, {vmax.data(), Dtype::f32}, {copy.data(), copy_dtype}};
        AdamArrays scalar{{p2.data(), Dtype::f32}, {g.data(), Dtype::f32}, {m2.data(), Dtype::f32},
                          {v2.data(), Dtype::f32}, {vmax2.data(), Dtype::f32}, {copy2.data(), copy_dtype}};
        adam_range<Neon>(args, neon, 0, n);
        adam_range<Scalar>(args, scalar, 0, n);
        for (int i = 0; i < n; ++i)
            differences += (p[i] != p2[i]) + (m[i] != m2[i]) + (v[i] != v2[i]) + (vmax[i] != vmax2[i]) +
                           (copy[i] != copy2[i]);
    }
    // Half-precision gradients, read through the same conversions.
    AdamArrays neon{{p.data(), Dtype::f32}, {copy.data(), Dtype::f16}, {m.data(), Dtype::f32},
                    {v.data(), Dtype::f32}, {nullptr, Dtype::f32}, {nullptr, Dtype::f32}};
    AdamArrays scalar{{p2.data(), Dtype::f32}, {copy2.data(), Dtype::f16}, {m2.data(), Dtype::f32},
                      {v2.data(), Dtype::f32}, {nullptr, Dtype::f32}, {nullptr, Dtype::f32}};
    adam_range<Neon>(args, neon, 0, n);
    adam_range<Scalar>(args, scalar, 0, n);
    for (int i = 0; i < n; ++i) differences += (p[i] != p2[i]) + (m[i] != m2[i]);
    for (float beta : {0.95f, 0.3f}) {
        const MomentumArgs momentum{LerpWeight(1.0f - beta), LerpWeight(beta), true, true};
        MomentumArrays a{{g.data(), Dtype::f32}, {m.data(), Dtype::f32}, {direction.data(), Dtype::bf16}};
        MomentumArrays b{{g.data(), Dtype::f32}, {m2.data(), Dtype::f32}, {direction2.data(), Dtype::bf16}};
        momentum_range<Neon>(momentum, a, 0, n);
        momentum_range<Scalar>(momentum, b, 0, n);
        for (int i = 0; i < n; ++i) differences += (m[i] != m2[i]) + (direction[i] != direction2[i]);
    }
    std::printf("differences: %d\n", differences);
    return differences != 0;
}
