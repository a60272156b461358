"""The C core as Python sees it: loading, build info, status -> exception mapping, import safety."""

from __future__ import annotations

import pickle

import pytest
from support.procs import run_python

import llmmem
from llmmem import _native, errors


def test_the_installed_core_is_loaded():
    # If this fails the tests are running against a source tree without a built _C.
    assert _native.available(), _native.load_error
    assert _native.native.version() == llmmem.__version__


def test_build_info_is_consistent():
    info = _native.native.build_info()
    assert set(info) >= {"cuda_built", "cuda_runtime_version", "cuda_archs", "c_compiler", "cuda_compiler"}
    assert info["cuda_built"] == (info["cuda_runtime_version"] > 0)
    if info["cuda_built"]:
        assert "sm_80" in info["cuda_archs"] and "sm_90" in info["cuda_archs"]
        assert info["cuda_compiler"]
    else:
        assert info["cuda_archs"] == ""


def test_cuda_probes_never_crash():
    nat = _native.native
    try:
        n = nat.cuda_device_count()
        assert n >= 0
    except (errors.NotBuiltError, errors.NoDeviceError) as exc:
        assert "llmmem:" in str(exc)
        assert exc.status in (4, 5)


@pytest.mark.parametrize(
    "status, cls, builtin",
    [
        (1, errors.InvalidArgumentError, ValueError),
        (2, errors.OutOfMemoryError, MemoryError),
        (3, errors.CudaError, RuntimeError),
        (4, errors.NoDeviceError, RuntimeError),
        (5, errors.NotBuiltError, NotImplementedError),
        (6, errors.InfeasibleError, ValueError),
        (7, errors.StateError, RuntimeError),
        (8, errors.InternalError, RuntimeError),
    ],
)
def test_status_maps_to_exception_with_detail(status, cls, builtin):
    with pytest.raises(cls) as info:
        _native.native._raise_status(status, "the detail the C core recorded")
    exc = info.value
    assert isinstance(exc, builtin) and isinstance(exc, llmmem.LlmmemError)
    assert exc.status == status
    assert "the detail the C core recorded" in str(exc)
    assert _native.native.strerror(status) in str(exc)


def test_raise_status_rejects_success_and_unknown():
    for bad in (0, 99, -1):
        with pytest.raises(ValueError, match="status must be"):
            _native.native._raise_status(bad, "x")
    assert _native.native.strerror(99) == "unknown status"


def test_import_is_lazy_and_does_not_import_torch():
    proc = run_python("import sys, llmmem; llmmem.LlmmemError; print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_import_never_fails_without_the_core():
    # Simulate a broken build: make `llmmem._C` unimportable, then use the package.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llmmem._C': raise ImportError('simulated broken build')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import llmmem\n"
        "from llmmem import _native, errors\n"
        "assert not _native.available()\n"
        "assert issubclass(errors.InvalidArgumentError, ValueError)\n"
        "try:\n"
        "    _native.native.version()\n"
        "except ImportError as e:\n"
        "    print('deferred:', 'simulated broken build' in str(e), 'pip install' in str(e))\n"
        "from llmmem.diagnostics import info\n"
        "print('NOT LOADED' in info())\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["deferred:", "True", "True", "True"]


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        llmmem.nonexistent
    assert "GradScaler" in dir(llmmem)


def test_every_public_name_resolves():
    # A name in llmmem.__all__ whose module or attribute went missing would only fail for the user
    # who first touches it; resolve them all here.
    for name in llmmem.__all__:
        assert getattr(llmmem, name) is not None, name


ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__ if name.endswith("Error")]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_errors_made_with_several_arguments_read_clearly_and_survive_pickling(cls):
    """Tooling re-creates exceptions from their arguments (pickling across processes, wrappers that
    call ``type(exc)(message, detail)``): with two arguments the text is the message, then the
    detail, not the tuple's repr; one or none read as Python's own."""
    assert str(cls("out of memory", 1024)) == "out of memory (1024)"
    assert str(cls("a", "b", 3)) == "a (b, 3)"
    assert str(cls("out of memory")) == "out of memory" and str(cls()) == ""
    exc = cls("out of memory", 1024)
    exc.status = 2
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and back.args == exc.args and back.status == 2 and str(back) == str(exc)


def test_errors_without_the_core_read_the_same():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llmmem._C': raise ImportError('simulated broken build')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from llmmem import errors\n"
        "print(str(errors.OutOfMemoryError('out of memory', 1024)), '|', str(errors.InvalidArgumentError('x')))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "out of memory (1024) | x"
