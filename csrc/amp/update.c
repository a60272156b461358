/*
 * update.c — the scale update on host memory (the CPU path of GradScaler.update) and the
 * config validation shared with the CUDA launcher. The rule itself lives in update_rule.h.
 */
#include <math.h>

#include "internal.h"
#include "update_rule.h"

LLMMEM_API llmmem_status_t llmmem_scaler_config_check(const llmmem_scaler_config_t *cfg) {
  LLMMEM_CHECK_ARG(cfg != NULL, "scaler config: cfg must not be NULL");
  LLMMEM_CHECK_ARG(cfg->growth_factor > 1.0 && isfinite(cfg->growth_factor),
                   "growth_factor must be a finite number > 1.0, got %g", cfg->growth_factor);
  LLMMEM_CHECK_ARG(cfg->backoff_factor > 0.0 && cfg->backoff_factor < 1.0, "backoff_factor must be in (0, 1), got %g",
                   cfg->backoff_factor);
  LLMMEM_CHECK_ARG(cfg->growth_interval >= 1, "growth_interval must be >= 1, got %lld",
                   (long long)cfg->growth_interval);
  LLMMEM_CHECK_ARG(cfg->hysteresis >= 1, "hysteresis must be >= 1, got %d", (int)cfg->hysteresis);
  LLMMEM_CHECK_ARG(cfg->hysteresis_on_growth == 0 || cfg->hysteresis_on_growth == 1,
                   "hysteresis_on_growth must be 0 or 1, got %d", (int)cfg->hysteresis_on_growth);
  LLMMEM_CHECK_ARG(cfg->min_scale >= 0.0f && isfinite(cfg->min_scale),
                   "min_scale must be a finite number >= 0 (0 = no floor), got %g", (double)cfg->min_scale);
  return LLMMEM_OK;
}

LLMMEM_API llmmem_status_t llmmem_scaler_update(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                                int64_t *stats, const float *const *found_infs, size_t n_found,
                                                const llmmem_scaler_config_t *cfg) {
  LLMMEM_TRY(llmmem_scaler_config_check(cfg));
  LLMMEM_CHECK_ARG(scale != NULL, "llmmem_scaler_update: scale must not be NULL");
  LLMMEM_CHECK_ARG(growth_tracker != NULL, "llmmem_scaler_update: growth_tracker must not be NULL");
  LLMMEM_CHECK_ARG(hysteresis_tracker != NULL || cfg->hysteresis == 1,
                   "llmmem_scaler_update: hysteresis_tracker is required when hysteresis is %d", (int)cfg->hysteresis);
  /* torch raises "No inf checks were recorded prior to update." in this case; the core refuses too. */
  LLMMEM_CHECK_ARG(n_found >= 1 && found_infs != NULL, "llmmem_scaler_update: no found_inf flags were given");
  int found = 0;
  for (size_t i = 0; i < n_found; i++) {
    LLMMEM_CHECK_ARG(found_infs[i] != NULL, "llmmem_scaler_update: found_infs[%zu] is NULL", i);
    found |= found_infs[i][0] != 0.0f;
  }
  llmmem_scaler_apply_rule(scale, growth_tracker, hysteresis_tracker, stats, found, cfg->growth_factor,
                           cfg->backoff_factor, cfg->growth_interval, cfg->hysteresis, cfg->min_scale,
                           cfg->hysteresis_on_growth);
  return LLMMEM_OK;
}
