/*
 * info.c — version, build configuration and CUDA discovery, for `python -m llmmem info`.
 */
#include "binding.h"

static PyObject *py_version(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  int major, minor, patch;
  llmmem_status_t st = llmmem_version(&major, &minor, &patch);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyUnicode_FromFormat("%d.%d.%d", major, minor, patch);
}

static PyObject *py_build_info(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  llmmem_build_info_t info;
  llmmem_status_t st = llmmem_build_info(&info);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return Py_BuildValue("{s:O,s:i,s:s,s:s,s:s,s:i}", "cuda_built", info.cuda_built ? Py_True : Py_False,
                       "cuda_runtime_version", info.cuda_runtime_version, "cuda_archs", info.cuda_archs, "c_compiler",
                       info.c_compiler, "cuda_compiler", info.cuda_compiler, "debug_level", info.debug_level);
}

static PyObject *py_cuda_device_count(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  int count = 0;
  llmmem_status_t st;
  /* The first CUDA call initialises the driver, which can take a while: let other threads run. */
  Py_BEGIN_ALLOW_THREADS st = llmmem_cuda_device_count(&count);
  Py_END_ALLOW_THREADS if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyLong_FromLong(count);
}

static PyObject *py_cuda_driver_version(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  int version = 0;
  llmmem_status_t st = llmmem_cuda_driver_version(&version);
  if (st != LLMMEM_OK) return llmmem_py_raise(st);
  return PyLong_FromLong(version);
}

PyMethodDef llmmem_py_info_methods[] = {
    {"version", py_version, METH_NOARGS, "version() -> str: version of the C core."},
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> dict: what the C core was compiled with."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int. Raises NotBuiltError without CUDA, NoDeviceError without driver or GPU."},
    {"cuda_driver_version", py_cuda_driver_version, METH_NOARGS,
     "cuda_driver_version() -> int (e.g. 13000). Raises NoDeviceError without a driver."},
    {NULL, NULL, 0, NULL},
};
