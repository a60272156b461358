/*
 * quantize.c — the optimizer's codes in plain C: their values, and blockwise quantization and
 * dequantization of whole tensors (llmmem_optim_quantize / _dequantize), which load_state_dict
 * uses to convert a moment from one format into another and the reference step uses per block.
 *
 * What it does not do: anything fast. The step's vector loops (adamw_cpu.c) and the CUDA kernel
 * quantize with the same inline code (codes.h) and are tested against this.
 */
#include <math.h>
#include <string.h>

#include "internal.h"
#include "optim_internal.h"

int _llmmem_optim_code_of(int32_t state, int second_moment) {
  if (state == LLMMEM_OPTIM_STATE_Q8) return second_moment ? LLMMEM_OPTIM_CODE_R8 : LLMMEM_OPTIM_CODE_M8;
  if (state == LLMMEM_OPTIM_STATE_Q4) return second_moment ? LLMMEM_OPTIM_CODE_R4 : LLMMEM_OPTIM_CODE_M4;
  return -1;
}

int _llmmem_optim_code_bits(int32_t code) {
  return code == LLMMEM_OPTIM_CODE_M8 || code == LLMMEM_OPTIM_CODE_R8 ? 8 : 4;
}

static uint32_t encode(int32_t code, float x, float inv) {
  switch (code) {
    case LLMMEM_OPTIM_CODE_M8: return llmmem_q_encode_signed(x, inv, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B);
    case LLMMEM_OPTIM_CODE_R8: return llmmem_q_encode_unsigned(x, inv, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B);
    case LLMMEM_OPTIM_CODE_M4: return llmmem_q_encode_signed(x, inv, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B);
    default: return llmmem_q_encode_unsigned(x, inv, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B);
  }
}

static float decode(int32_t code, uint32_t c, float scale) {
  switch (code) {
    case LLMMEM_OPTIM_CODE_M8: return llmmem_q_decode_signed(c, scale, LLMMEM_Q_M8_MAG, LLMMEM_Q_M8_M, LLMMEM_Q_M8_B);
    case LLMMEM_OPTIM_CODE_R8: return llmmem_q_decode_unsigned(c, scale, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B);
    case LLMMEM_OPTIM_CODE_M4: return llmmem_q_decode_signed(c, scale, LLMMEM_Q_M4_MAG, LLMMEM_Q_M4_M, LLMMEM_Q_M4_B);
    default: return llmmem_q_decode_unsigned(c, scale, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B);
  }
}

static uint32_t code_at(const void *codes, int64_t i, int bits) {
  const uint8_t *b = codes;
  return bits == 8 ? b[i] : (uint32_t)(b[i >> 1] >> ((i & 1) * 4)) & 0xfu;
}

static void set_code(void *codes, int64_t i, int bits, uint32_t c) {
  uint8_t *b = codes;
  if (bits == 8) {
    b[i] = (uint8_t)c;
  } else if (i & 1) {
    b[i >> 1] = (uint8_t)((b[i >> 1] & 0x0fu) | (c << 4));
  } else {
    b[i >> 1] = (uint8_t)c; /* the high nibble is written by the next element, or stays 0 */
  }
}

static uint32_t encode_sr(int32_t code, float x, float inv, uint32_t rnd) {
  return code == LLMMEM_OPTIM_CODE_R8 ? llmmem_q_encode_unsigned_sr(x, inv, 8, LLMMEM_Q_R8_M, LLMMEM_Q_R8_B, rnd)
                                      : llmmem_q_encode_unsigned_sr(x, inv, 4, LLMMEM_Q_R4_M, LLMMEM_Q_R4_B, rnd);
}

void _llmmem_optim_quantize_block_ref(const float *x, int64_t n, int32_t code, void *codes, int64_t first,
                                      float *scale, const uint32_t *key) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    float a = fabsf(x[i]);
    if (isfinite(a) && a > absmax) absmax = a;
  }
  float inv;
  llmmem_q_block_scale(absmax, llmmem_q_max_value(code), scale, &inv);
  const int bits = _llmmem_optim_code_bits(code);
  for (int64_t i = 0; i < n; i++) {
    const uint32_t c =
        key ? encode_sr(code, x[i], inv, llmmem_sr_code_bits((uint32_t)(first + i), *key)) : encode(code, x[i], inv);
    set_code(codes, first + i, bits, c);
  }
}

float _llmmem_optim_dequantize_one(const void *codes, int64_t i, int32_t code, float scale) {
  return decode(code, code_at(codes, i, _llmmem_optim_code_bits(code)), scale);
}

static llmmem_status_t check_codec(const char *fn, int64_t n, int32_t code, int32_t block_size) {
  LLMMEM_CHECK_ARG(code >= 0 && code < LLMMEM_OPTIM_CODE_COUNT_, "%s: code %d is not a code (0=M8 1=R8 2=M4 3=R4)", fn,
                   (int)code);
  LLMMEM_CHECK_ARG(n >= 0, "%s: n is negative (%lld)", fn, (long long)n);
  LLMMEM_CHECK_ARG(block_size >= LLMMEM_OPTIM_MIN_BLOCK && block_size <= LLMMEM_OPTIM_MAX_BLOCK &&
                       (block_size & (block_size - 1)) == 0,
                   "%s: block_size must be a power of two in [%d, %d], got %d", fn, LLMMEM_OPTIM_MIN_BLOCK,
                   LLMMEM_OPTIM_MAX_BLOCK, (int)block_size);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_optim_code_values(int32_t code, float *values, size_t *count) {
  LLMMEM_CHECK_ARG(values != NULL && count != NULL, "llmmem_optim_code_values: values and count must not be NULL");
  LLMMEM_TRY(check_codec("llmmem_optim_code_values", 0, code, LLMMEM_OPTIM_MIN_BLOCK));
  const size_t n = (size_t)1 << _llmmem_optim_code_bits(code);
  for (size_t c = 0; c < n; c++) values[c] = decode(code, (uint32_t)c, 1.0f);
  *count = n;
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_optim_quantize(const float *x, int64_t n, int32_t code, int32_t block_size,
                                                 void *codes, float *scales) {
  LLMMEM_TRY(check_codec("llmmem_optim_quantize", n, code, block_size));
  if (n == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(x != NULL && codes != NULL && scales != NULL,
                   "llmmem_optim_quantize: x, codes and scales must not be NULL");
  if (code == LLMMEM_OPTIM_CODE_R8 || code == LLMMEM_OPTIM_CODE_R4) {
    for (int64_t i = 0; i < n; i++)
      LLMMEM_CHECK_ARG(!(x[i] < 0.0f),
                       "llmmem_optim_quantize: x[%lld] = %g is negative: an R code stores sqrt(v) >= 0", (long long)i,
                       (double)x[i]);
  }
  for (int64_t b = 0; b * block_size < n; b++) {
    int64_t first = b * block_size, len = n - first < block_size ? n - first : block_size;
    _llmmem_optim_quantize_block_ref(x + first, len, code, codes, first, &scales[b], NULL);
  }
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_optim_dequantize(const void *codes, const float *scales, int64_t n, int32_t code,
                                                   int32_t block_size, float *out) {
  LLMMEM_TRY(check_codec("llmmem_optim_dequantize", n, code, block_size));
  if (n == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(codes != NULL && scales != NULL && out != NULL,
                   "llmmem_optim_dequantize: codes, scales and out must not be NULL");
  for (int64_t i = 0; i < n; i++) out[i] = _llmmem_optim_dequantize_one(codes, i, code, scales[i / block_size]);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_optim_round_bf16(const float *x, int64_t n, uint64_t seed, float step,
                                                   int64_t offset, uint16_t *out) {
  LLMMEM_CHECK_ARG(n >= 0 && offset >= 0, "llmmem_optim_round_bf16: n and offset must be >= 0");
  if (n == 0) return LLMMEM_OK;
  LLMMEM_CHECK_ARG(x != NULL && out != NULL, "llmmem_optim_round_bf16: x and out must not be NULL");
  for (int64_t i = 0; i < n; i++) {
    uint64_t idx = (uint64_t)(offset + i);
    uint32_t key = llmmem_sr_key(seed, step, LLMMEM_SR_PARAM, (uint32_t)(idx >> 32));
    out[i] = llmmem_bf16_stochastic(x[i], llmmem_sr_mix((uint32_t)idx ^ key));
  }
  return LLMMEM_OK;
}
