/*
 * optim.h — the C ABI of llmmem's optimizer: a multi-tensor Adam / AdamW step whose moments are
 * kept in fp32, bf16, or blockwise-quantized 8 or 4 bits, on parameters in fp32 or bf16 (no fp32
 * master copy: the update is rounded stochastically into bf16), on the CPU and (when built) CUDA.
 *
 * The update of one element, with t the tensor's step count after it is incremented, is torch's
 * single-tensor AdamW (torch/optim/adam.py, _single_tensor_adam) operation for operation, each
 * operation rounded to fp32 on its own (torch's scalar kernels round so; its vectorised CPU lerp
 * fuses its multiply-add, so results agree with torch's to rounding, not bit for bit):
 *   g  = maximize ? -grad : grad                      (widened to fp32)
 *   AdamW: p = p * (float)(1 - lr * wd)               Adam: g = g + (float)wd * p
 *   m  = lerp(m, g, (float)(1 - beta1))               (torch's scalar lerp: m + w * (g - m) for w < 0.5)
 *   v  = v * (float)beta2 + ((float)(1 - beta2) * g) * g
 *   d  = sqrt(v) / (float)sqrt(1 - beta2^t) + (float)eps
 *   p  = p + (float)(-lr / (1 - beta1^t)) * (m / d)
 * (the scalars are computed in double, as Python computes them, then rounded once). No operation
 * is fused (no FMA), so the reference, the vector loops and the CUDA kernel agree bit for bit.
 *
 * State formats (llmmem_optim_state_t), per parameter of n elements:
 *   F32   exp_avg, exp_avg_sq: n fp32 each.
 *   BF16  exp_avg, exp_avg_sq: n bf16 each, written with stochastic rounding (round to nearest
 *         would freeze the second moment: with beta2 = 0.999 a decay of 0.1% is under half a bf16
 *         step, so v could never shrink).
 *   Q8    exp_avg: n int8 codes; exp_avg_sq: n uint8 codes of r = sqrt(v) (its dynamic range is
 *         the square root of v's, so a block keeps its small elements); each with one fp32 scale
 *         per block of block_size elements (the block's largest finite magnitude / the largest
 *         code value). Codes are minifloats (llmmem_optim_code_t): a relative, not absolute,
 *         precision, so small and large magnitudes both keep theirs.
 *   Q4    the same with 4-bit codes, two per byte (element 2i in the low nibble): ceil(n / 2)
 *         bytes each, plus the scales.
 * Quantized state: a non-finite first moment is stored as the M code's NaN, a non-finite r as the
 * R code's all-ones code, which reads back as +inf (a second moment that overflowed on a huge
 * finite gradient stays +inf, as torch's does: that weight's updates become 0, not NaN). A NaN or
 * inf gradient spoils that element only, as it does in torch's AdamW; a positive r never
 * rounds to 0 (it would turn m / d into m / eps), but to the smallest code above it.
 *
 * Stochastic rounding (bf16 parameters without a master, bf16 moments) adds 16 random bits below
 * the bf16 mantissa and truncates. The bits are a hash of (tensor seed, step, stream, element
 * index): the same for any thread count, device or call order, so a run is reproducible and a
 * step taken in backward equals one taken after it.
 *
 * What this header does not do: allocate, own or initialise state (zeroed memory is the initial
 * state of every format), strided tensors, or anything about parameter groups.
 * Plain C11, no Python and no PyTorch.
 */
#ifndef LLMMEM_OPTIM_H
#define LLMMEM_OPTIM_H

#include <llmmem/llmmem.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of parameters, gradients (same codes as llmmem_scaler_dtype_t). */
typedef enum llmmem_optim_dtype_e {
  LLMMEM_OPTIM_F32 = 0,
  LLMMEM_OPTIM_F16 = 1, /* gradients, and parameters that have a master */
  LLMMEM_OPTIM_BF16 = 2,
  LLMMEM_OPTIM_DTYPE_COUNT_ = 3
} llmmem_optim_dtype_t;

typedef enum llmmem_optim_state_e {
  LLMMEM_OPTIM_STATE_F32 = 0,
  LLMMEM_OPTIM_STATE_BF16 = 1,
  LLMMEM_OPTIM_STATE_Q8 = 2,
  LLMMEM_OPTIM_STATE_Q4 = 3,
  LLMMEM_OPTIM_STATE_COUNT_ = 4
} llmmem_optim_state_t;

/* The quantization codes: which moment, in how many bits. */
typedef enum llmmem_optim_code_e {
  LLMMEM_OPTIM_CODE_M8 = 0, /* first moment, 8 bits: sign + 4 exponent + 3 mantissa bits; 0x80 = NaN */
  LLMMEM_OPTIM_CODE_R8 = 1, /* sqrt of the second moment, 8 bits: 4 exponent + 4 mantissa; 0xff = +inf */
  LLMMEM_OPTIM_CODE_M4 = 2, /* first moment, 4 bits: sign + 3 magnitude bits; 0x8 = NaN */
  LLMMEM_OPTIM_CODE_R4 = 3, /* sqrt of the second moment, 4 bits; 0xf = +inf */
  LLMMEM_OPTIM_CODE_COUNT_ = 4
} llmmem_optim_code_t;

/* Block sizes the quantized formats accept: a power of two in [LLMMEM_OPTIM_MIN_BLOCK, LLMMEM_OPTIM_MAX_BLOCK]. */
#define LLMMEM_OPTIM_MIN_BLOCK 32
#define LLMMEM_OPTIM_MAX_BLOCK 4096

/* One parameter and its state. Every pointer is to contiguous memory of numel elements unless said
 * otherwise; none of them may overlap another tensor's. */
typedef struct llmmem_optim_tensor_s {
  void *param;          /* param_dtype; updated in place */
  const void *grad;     /* grad_dtype */
  float *master;        /* NULL, or fp32 master weights: the update is applied to them, and param
                             (bf16 or fp16) becomes master rounded to nearest */
  void *exp_avg;        /* first moment in the state format (see above) */
  void *exp_avg_sq;     /* second moment: v for F32/BF16, codes of sqrt(v) for Q8/Q4 */
  float *exp_avg_scale; /* Q8/Q4: ceil(numel / block_size) scales; else ignored (may be NULL) */
  float *exp_avg_sq_scale;
  float *step;         /* host memory, also for CUDA: incremented by 1 before the update, as
                             torch's float step tensor is */
  int64_t numel;       /* elements, >= 0 */
  uint64_t seed;       /* stochastic-rounding key of this tensor */
  int32_t param_dtype; /* llmmem_optim_dtype_t; F16 only with a master */
  int32_t grad_dtype;  /* llmmem_optim_dtype_t */
} llmmem_optim_tensor_t;

typedef struct llmmem_optim_adamw_config_s {
  double lr;                   /* >= 0 */
  double beta1, beta2;         /* in [0, 1) */
  double eps;                  /* >= 0 */
  double weight_decay;         /* >= 0 */
  int32_t decoupled;           /* 1: AdamW (decay applied to the weights); 0: Adam (added to the gradient) */
  int32_t maximize;            /* 1: ascend */
  int32_t state;               /* llmmem_optim_state_t of every tensor of the call */
  int32_t block_size;          /* Q8/Q4: elements per scale (see LLMMEM_OPTIM_*_BLOCK); else ignored */
  int32_t stochastic_rounding; /* bf16 parameters without a master: 1 = stochastic, 0 = to nearest */
} llmmem_optim_adamw_config_t;

/* Checks a config (the CUDA path calls this on the host before launching). */
LLMMEM_API llmmem_status_t llmmem_optim_adamw_config_check(const llmmem_optim_adamw_config_t *cfg);

/* Bytes of one moment of a numel-element tensor in `state` (codes only, scales apart), and the
 * number of scales per moment (0 for F32/BF16). */
LLMMEM_API llmmem_status_t llmmem_optim_state_bytes(int32_t state, int64_t numel, int32_t block_size, size_t *bytes,
                                                    int64_t *scales);

/*
 * CPU multi-tensor step: every tensor of the list, one pass over its memory, spread over threads
 * (the process's OpenMP team when it has a usable one, else threads started and joined here;
 * 0 = as many as the CPUs this process may use and the size warrants). Blocks until done.
 * Checks everything before it writes anything: on an error no tensor and no step has changed.
 */
LLMMEM_API llmmem_status_t llmmem_optim_adamw_step(const llmmem_optim_tensor_t *tensors, size_t count,
                                                   const llmmem_optim_adamw_config_t *cfg, int num_threads);

/* The plain scalar reference of the above (one thread, no vector code): the oracle of the tests. */
LLMMEM_API llmmem_status_t llmmem_optim_adamw_step_ref(const llmmem_optim_tensor_t *tensors, size_t count,
                                                       const llmmem_optim_adamw_config_t *cfg);

/*
 * CUDA multi-tensor step: tensor pointers are device pointers on `device` (step stays host memory:
 * it is read and incremented here, before the launch); `tensors` itself is host memory, read
 * before the call returns. Work is queued on `stream` (a cudaStream_t; 0 = the legacy default
 * stream); nothing waits for the device. Results equal llmmem_optim_adamw_step_ref bit for bit.
 * Without a CUDA build: LLMMEM_ERR_NOT_BUILT.
 */
LLMMEM_API llmmem_status_t llmmem_optim_adamw_step_cuda(const llmmem_optim_tensor_t *tensors, size_t count,
                                                        const llmmem_optim_adamw_config_t *cfg, int device,
                                                        void *stream);

/* ---- the codes, for state conversion (load_state_dict) and tests -------------------------- */

/* The value of every code of `code`, times 1 (scale 1): 256 or 16 floats written to values[0..*count)
 * (values must hold 256). The M codes' NaN code reads NaN, the R codes' all-ones code +inf. */
LLMMEM_API llmmem_status_t llmmem_optim_code_values(int32_t code, float *values, size_t *count);

/* Blockwise quantization of x[0..n) (host memory) into codes (n bytes for 8 bits, ceil(n / 2) for
 * 4) and scales (ceil(n / block_size)), exactly as the step stores a moment. For the R codes x is
 * sqrt(v), which must be >= 0 or NaN (a negative value is refused). */
LLMMEM_API llmmem_status_t llmmem_optim_quantize(const float *x, int64_t n, int32_t code, int32_t block_size,
                                                 void *codes, float *scales);
/* The inverse: out[i] = value(code i) * scale of its block. */
LLMMEM_API llmmem_status_t llmmem_optim_dequantize(const void *codes, const float *scales, int64_t n, int32_t code,
                                                   int32_t block_size, float *out);

/* Stochastic rounding of x[0..n) to bf16 bit patterns with the step's random bits for (seed, step,
 * stream 0 = parameters), element i using the bits of index offset + i: what the step writes into
 * a bf16 parameter. For tests of the rounding's distribution. */
LLMMEM_API llmmem_status_t llmmem_optim_round_bf16(const float *x, int64_t n, uint64_t seed, float step,
                                                   int64_t offset, uint16_t *out);

#ifdef __cplusplus
}
#endif

#endif /* LLMMEM_OPTIM_H */
