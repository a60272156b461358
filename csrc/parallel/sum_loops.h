/*
 * sum_loops.h — the per-dtype loops of the collectives' sum, written once and included by
 * sum_cpu.c for each instruction set it dispatches to (plain C, AVX2+F16C, AVX-512).
 *
 * Same arithmetic as the reference (sum_ref.c), element by element, so every instruction set
 * gives the reference's bits: acc = src0 + src1, then acc += src2, ... in fp32, rounded once to
 * the element type. What differs from the reference, for speed: the first two sources are added
 * in one pass (no copy of src0 into the accumulator first), the loops are free of calls and
 * branches so the compiler vectorises them, and fp16 uses the F16C conversion instructions.
 * Work goes block by block through an fp32 accumulator in L1: every source of a block is read
 * before the block of `out` is written, so `out` may alias a source.
 *
 * Include with LOOP_SUFFIX (name suffix) and LOOP_TARGET (an attribute or nothing) defined, and
 * LOOP_F16C defined to 1 when the F16C intrinsics may be used.
 */
#define LOOP_CAT2(a, b) a##b
#define LOOP_CAT(a, b)  LOOP_CAT2(a, b)
#define LOOP_NAME(name) LOOP_CAT(name, LOOP_SUFFIX)

LOOP_TARGET static void LOOP_NAME(sum_f32)(const void *const *srcs, int nsrc, void *out, void *out2, size_t count) {
  float acc[SUM_BLOCK];
  for (size_t off = 0; off < count; off += SUM_BLOCK) {
    const size_t n = count - off < SUM_BLOCK ? count - off : SUM_BLOCK;
    const float *a = (const float *)srcs[0] + off;
    if (nsrc == 1) {
      for (size_t i = 0; i < n; i++) acc[i] = a[i];
    } else {
      const float *b = (const float *)srcs[1] + off;
      for (size_t i = 0; i < n; i++) acc[i] = a[i] + b[i];
    }
    for (int r = 2; r < nsrc; r++) {
      const float *s = (const float *)srcs[r] + off;
      for (size_t i = 0; i < n; i++) acc[i] += s[i];
    }
    memcpy((float *)out + off, acc, n * sizeof(float));
    if (out2) memcpy((float *)out2 + off, acc, n * sizeof(float));
  }
}

LOOP_TARGET static inline float LOOP_NAME(bf16_load)(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* half.h's llmmem_f32_to_bf16 written branch-free so it vectorises: nearest even, NaN -> 0x7fc0. */
LOOP_TARGET static void LOOP_NAME(bf16_store)(uint16_t *restrict d, const float *restrict acc, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t r;
    memcpy(&r, &acc[i], 4);
    uint32_t rounded = (r + 0x7fffu + ((r >> 16) & 1u)) >> 16;
    d[i] = (uint16_t)(((r & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
  }
}

LOOP_TARGET static void LOOP_NAME(sum_bf16)(const void *const *srcs, int nsrc, void *out, void *out2, size_t count) {
  float acc[SUM_BLOCK];
  for (size_t off = 0; off < count; off += SUM_BLOCK) {
    const size_t n = count - off < SUM_BLOCK ? count - off : SUM_BLOCK;
    const uint16_t *a = (const uint16_t *)srcs[0] + off;
    if (nsrc == 1) {
      for (size_t i = 0; i < n; i++) acc[i] = LOOP_NAME(bf16_load)(a[i]);
    } else {
      const uint16_t *b = (const uint16_t *)srcs[1] + off;
      for (size_t i = 0; i < n; i++) acc[i] = LOOP_NAME(bf16_load)(a[i]) + LOOP_NAME(bf16_load)(b[i]);
    }
    for (int r = 2; r < nsrc; r++) {
      const uint16_t *s = (const uint16_t *)srcs[r] + off;
      for (size_t i = 0; i < n; i++) acc[i] += LOOP_NAME(bf16_load)(s[i]);
    }
    LOOP_NAME(bf16_store)((uint16_t *)out + off, acc, n);
    if (out2) LOOP_NAME(bf16_store)((uint16_t *)out2 + off, acc, n);
  }
}

/* acc[0..n) (+)= the fp16 values at s (converted exactly; F16C where allowed). */
LOOP_TARGET static void LOOP_NAME(f16_load)(float *restrict acc, const uint16_t *s, size_t n, int add) {
  size_t i = 0;
#if LOOP_F16C
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i)));
    if (add) v = _mm256_add_ps(_mm256_loadu_ps(acc + i), v);
    _mm256_storeu_ps(acc + i, v);
  }
#endif
  for (; i < n; i++) acc[i] = add ? acc[i] + llmmem_f16_to_f32(s[i]) : llmmem_f16_to_f32(s[i]);
}

LOOP_TARGET static void LOOP_NAME(f16_store)(uint16_t *d, const float *restrict acc, size_t n) {
  size_t i = 0;
#if LOOP_F16C
  /* round to nearest even, overflow to inf, subnormals kept, NaN quieted: as half.h */
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i *)(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(acc + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; i++) d[i] = llmmem_f32_to_f16(acc[i]);
}

LOOP_TARGET static void LOOP_NAME(sum_f16)(const void *const *srcs, int nsrc, void *out, void *out2, size_t count) {
  float acc[SUM_BLOCK];
  for (size_t off = 0; off < count; off += SUM_BLOCK) {
    const size_t n = count - off < SUM_BLOCK ? count - off : SUM_BLOCK;
    for (int r = 0; r < nsrc; r++) LOOP_NAME(f16_load)(acc, (const uint16_t *)srcs[r] + off, n, r > 0);
    LOOP_NAME(f16_store)((uint16_t *)out + off, acc, n);
    if (out2) LOOP_NAME(f16_store)((uint16_t *)out2 + off, acc, n);
  }
}

LOOP_TARGET static void LOOP_NAME(sum)(const void *const *srcs, int nsrc, void *out, void *out2, size_t count,
                                       llmmem_comm_dtype_t dtype) {
  if (dtype == LLMMEM_COMM_F32)
    LOOP_NAME(sum_f32)(srcs, nsrc, out, out2, count);
  else if (dtype == LLMMEM_COMM_BF16)
    LOOP_NAME(sum_bf16)(srcs, nsrc, out, out2, count);
  else
    LOOP_NAME(sum_f16)(srcs, nsrc, out, out2, count);
}

#undef LOOP_NAME
#undef LOOP_CAT
#undef LOOP_CAT2
