/*
 * test_scaler_openmp.c — the scaler tests of test_scaler.c again, in a program linked with an
 * OpenMP runtime (built with -fopenmp, see the Makefile), as a process that imported torch is:
 * the pipe's workers then run on the OpenMP team (unscale_pipe.c), which this checks first.
 */
#define LLMMEM_TEST_OPENMP 1
#include "test_scaler.c"
