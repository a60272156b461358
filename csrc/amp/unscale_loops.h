/*
 * unscale_loops.h — the per-dtype inner loops of the CPU unscale + check, written once and
 * included by unscale_cpu.c for each instruction set it dispatches to (plain x86-64/other, and
 * AVX2+F16C). Each loop is a single pass: read an element, flag it if non-finite, write it times
 * inv_scale. The check is an integer test of the exponent bits accumulated with |=, which the
 * compiler turns into vector code; fp16 on F16C uses the conversion instructions directly.
 *
 * Include with LOOP_SUFFIX (name suffix) and LOOP_TARGET (an attribute or nothing) defined, and
 * LOOP_F16C defined to 1 when the F16C intrinsics may be used.
 */
#define LOOP_CAT2(a, b) a##b
#define LOOP_CAT(a, b)  LOOP_CAT2(a, b)
#define LOOP_NAME(name) LOOP_CAT(name, LOOP_SUFFIX)

/* Returns nonzero when any of p[0..n) is inf or NaN; multiplies in place when `write`. */
LOOP_TARGET static int LOOP_NAME(loop_f32)(float *restrict p, size_t n, float inv, int write) {
  uint32_t bad = 0;
  if (write) {
    for (size_t i = 0; i < n; i++) {
      float v = p[i];
      uint32_t u;
      memcpy(&u, &v, 4);
      bad |= (u & 0x7f800000u) == 0x7f800000u;
      p[i] = v * inv;
    }
  } else {
    for (size_t i = 0; i < n; i++) {
      uint32_t u;
      memcpy(&u, &p[i], 4);
      bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
  }
  return bad != 0;
}

LOOP_TARGET static int LOOP_NAME(loop_f64)(double *restrict p, size_t n, float inv, int write) {
  uint64_t bad = 0;
  const double dinv = (double)inv; /* torch multiplies fp64 grads by the fp32 inverse widened to fp64 */
  if (write) {
    for (size_t i = 0; i < n; i++) {
      double v = p[i];
      uint64_t u;
      memcpy(&u, &v, 8);
      bad |= (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
      p[i] = v * dinv;
    }
  } else {
    for (size_t i = 0; i < n; i++) {
      uint64_t u;
      memcpy(&u, &p[i], 8);
      bad |= (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
    }
  }
  return bad != 0;
}

LOOP_TARGET static int LOOP_NAME(loop_bf16)(uint16_t *restrict p, size_t n, float inv, int write) {
  uint32_t bad = 0;
  if (write) {
    for (size_t i = 0; i < n; i++) {
      uint32_t u = (uint32_t)p[i] << 16;
      bad |= (u & 0x7f800000u) == 0x7f800000u;
      float v;
      memcpy(&v, &u, 4);
      v *= inv;
      uint32_t r;
      memcpy(&r, &v, 4);
      /* round to nearest even, NaN -> 0x7fc0 (as half.h), written branch-free to vectorise */
      uint32_t rounded = (r + 0x7fffu + ((r >> 16) & 1u)) >> 16;
      p[i] = (uint16_t)(((r & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
    }
  } else {
    for (size_t i = 0; i < n; i++) bad |= (p[i] & 0x7f80u) == 0x7f80u;
  }
  return bad != 0;
}

LOOP_TARGET static int LOOP_NAME(loop_f16)(uint16_t *restrict p, size_t n, float inv, int write) {
  uint32_t bad = 0;
  size_t i = 0;
  if (!write) {
    for (; i < n; i++) bad |= (p[i] & 0x7c00u) == 0x7c00u;
    return bad != 0;
  }
#if LOOP_F16C
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i vbad = _mm256_setzero_si256();
  const __m256i expmask = _mm256_set1_epi32(0x7f800000);
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128((const __m128i *)(p + i));
    __m256 v = _mm256_cvtph_ps(h);
    __m256i e = _mm256_and_si256(_mm256_castps_si256(v), expmask);
    vbad = _mm256_or_si256(vbad, _mm256_cmpeq_epi32(e, expmask));
    __m128i out = _mm256_cvtps_ph(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(p + i), out);
  }
  bad |= !_mm256_testz_si256(vbad, vbad);
#endif
  for (; i < n; i++) {
    bad |= (p[i] & 0x7c00u) == 0x7c00u;
    p[i] = llmmem_f32_to_f16(llmmem_f16_to_f32(p[i]) * inv);
  }
  return bad != 0;
}

/* Runs `fn` over p[0..n) of type T in blocks of STREAM_BLOCK bytes, asking before each block for
 * the block STREAM_AHEAD bytes on while that block lies wholly inside the range (see
 * unscale_cpu.c); the range's first STREAM_AHEAD bytes are the caller's to ask for. */
#define LOOP_STREAM(fn, T)                                                         \
  do {                                                                             \
    T *q = (T *)t->data + off;                                                     \
    const size_t blk = STREAM_BLOCK / sizeof(T), ahead = STREAM_AHEAD / sizeof(T); \
    size_t k = 0;                                                                  \
    for (; k + ahead + blk <= (size_t)n; k += blk) {                               \
      prefetch_lines((const char *)(q + k + ahead), STREAM_BLOCK, write);          \
      bad |= fn(q + k, blk, inv, write);                                           \
    }                                                                              \
    bad |= fn(q + k, (size_t)n - k, inv, write);                                   \
  } while (0)

/* Dispatches one contiguous range [off, off + n) of tensor t. */
LOOP_TARGET static int LOOP_NAME(run_range)(const llmmem_scaler_tensor_t *t, int64_t off, int64_t n, float inv,
                                            int write) {
  int bad = 0;
  switch (t->dtype) {
    case LLMMEM_SCALER_F32: LOOP_STREAM(LOOP_NAME(loop_f32), float); break;
    case LLMMEM_SCALER_F64: LOOP_STREAM(LOOP_NAME(loop_f64), double); break;
    case LLMMEM_SCALER_BF16: LOOP_STREAM(LOOP_NAME(loop_bf16), uint16_t); break;
    default: LOOP_STREAM(LOOP_NAME(loop_f16), uint16_t); break;
  }
  return bad;
}

#undef LOOP_STREAM
#undef LOOP_NAME
#undef LOOP_CAT
#undef LOOP_CAT2
