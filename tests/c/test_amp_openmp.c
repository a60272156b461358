/*
 * test_amp_openmp.c — the scaler tests of test_amp.c again, in a program linked with an
 * OpenMP runtime, as a process that imported torch is: the threaded unscale then runs on the
 * OpenMP team (omp_team.c). Built with -fopenmp where the compiler has it (see the Makefile);
 * without it this is test_amp.c once more.
 */
#ifdef _OPENMP
#define LLMMEM_TEST_OPENMP 1
#endif
#include "test_amp.c"
