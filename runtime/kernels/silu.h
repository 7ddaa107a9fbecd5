/* SiLU as ONNX Runtime computes it on x86-64, shared by the ops that write a SwiGLU's silu(gate) * up
   (int8_blocks.c with gated = 1, swiglu.c). */

#ifndef KILN_SILU_H
#define KILN_SILU_H

#include <immintrin.h>

/* x * logistic(x) with the instructions of ONNX Runtime's Sigmoid and QuickGelu on x86-64 (MLAS's FMA3
   logistic kernel: clamp to +-18, an odd polynomial over an even one, + 0.5, floor 0), so a fused
   gate gives bit for bit the values of the Split, QuickGelu and Mul it replaces (tested), but in
   MatMulInt4BlocksBf16, whose shards flush denormals to zero (int8_blocks.c, run_shard_bf16_with): there
   a gate, an up or a product under fp32's smallest normal (about 1e-38) becomes 0. */
static inline __m512 silu(__m512 x) {
    __m512 c = _mm512_min_ps(_mm512_set1_ps(18.0f), _mm512_max_ps(_mm512_set1_ps(-18.0f), x));
    __m512 x2 = _mm512_mul_ps(c, c);
    __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(4.37031012579801e-11f), _mm512_set1_ps(1.15627324459942e-07f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(6.08574864600143e-05f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(8.51377133304701e-03f));
    p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(2.48287947061529e-01f));
    __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(6.10247389755681e-13f), _mm512_set1_ps(5.76102136993427e-09f));
    q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(6.29106785017040e-06f));
    q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(1.70198817374094e-03f));
    q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(1.16817656904453e-01f));
    q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(9.93151921023180e-01f));
    __m512 logistic = _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(c, p), q), _mm512_set1_ps(0.5f));
    return _mm512_mul_ps(x, _mm512_max_ps(_mm512_setzero_ps(), logistic));
}

#endif
