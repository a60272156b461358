/*
 * update_rule.h — the scale-update rule, written once for the host (update.c) and the device
 * (scaler.cu) so the two cannot drift apart.
 *
 * With hysteresis == 1 and min_scale == 0 this is torch's _amp_update_scale_ step for step:
 * backoff is `(float)(scale * backoff_factor)` computed in double, growth is
 * `(float)(scale * growth_factor)` kept only if finite, and the growth tracker must *equal*
 * growth_interval to grow (torch compares with ==; a tracker already past a lowered interval
 * keeps counting, and so does this one).
 *
 * Hysteresis follows the "consecutive" variant (apex's update_scale_hysteresis, DeepSpeed's
 * consecutive_hysteresis=True): back off only after `hysteresis` non-finite steps in a row; any
 * finite step refills the budget. (Megatron-LM and DeepSpeed's default refill it only when the
 * scale grows, so non-consecutive overflows add up there; see GradScaler's docstring.) With
 * `on_growth` set the rule is theirs: only a growth step (growth_interval clean steps) refills.
 */
#ifndef LLMMEM_SCALER_UPDATE_RULE_H
#define LLMMEM_SCALER_UPDATE_RULE_H

#include <llmmem/amp.h>

#ifdef __CUDACC__
#define LLMMEM_HD            __host__ __device__
#define LLMMEM_ISFINITE_F(x) isfinite(x)
#else
#include <math.h>
#define LLMMEM_HD
#define LLMMEM_ISFINITE_F(x) isfinite(x)
#endif

/* Applies one update in place. `stats` may be NULL. `hyst` may be NULL when cfg hysteresis is 1. */
static inline LLMMEM_HD void llmmem_scaler_apply_rule(float *scale, int32_t *growth, int32_t *hyst, int64_t *stats,
                                                      int found, double growth_factor, double backoff_factor,
                                                      int64_t growth_interval, int32_t hysteresis, float min_scale,
                                                      int on_growth) {
  int min_hit = 0;
  if (found) {
    int32_t left = hyst ? *hyst - 1 : 0;
    if (left < 0) left = 0;
    if (hyst) *hyst = left;
    *growth = 0;
    if (left == 0) {
      float backed = (float)((double)*scale * backoff_factor);
      if (min_scale > 0.0f && !(backed >= min_scale)) {
        backed = min_scale;
        min_hit = 1;
      }
      *scale = backed;
    }
  } else {
    if (hyst && !on_growth) *hyst = hysteresis;
    int64_t successful = (int64_t)*growth + 1; /* int64 so a tracker at INT32_MAX cannot overflow */
    if (successful == growth_interval) {
      float grown = (float)((double)*scale * growth_factor);
      if (LLMMEM_ISFINITE_F(grown)) *scale = grown;
      *growth = 0;
      if (hyst && on_growth) *hyst = hysteresis;
    } else {
      *growth = (int32_t)successful;
    }
  }
  if (stats) {
    stats[LLMMEM_SCALER_STAT_UPDATES] += 1;
    stats[LLMMEM_SCALER_STAT_SKIPPED] += found ? 1 : 0;
    stats[LLMMEM_SCALER_STAT_LAST_SKIPPED] = found ? 1 : 0;
    stats[LLMMEM_SCALER_STAT_MIN_HITS] += min_hit;
  }
}

#endif /* LLMMEM_SCALER_UPDATE_RULE_H */
