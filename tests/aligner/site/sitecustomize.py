"""TEST-ONLY import hook: NeMo's TensorRT-LLM export chain resolves to inert dummy modules.

NeMo-Aligner 0.7.0's actor modules import ``nemo_aligner.utils.trt_llm``, which imports NeMo's
TensorRT-LLM export code (``tensorrt_llm``, ``tensorrt``, ``mpi4py``): GPU-only packages, never
called on the CPU test path (generation with TRT-LLM is off). This file is put on PYTHONPATH
only by ``scripts/test_aligner.sh`` (Python imports ``sitecustomize`` at start-up); it makes any
import of those module trees return a dummy module whose every attribute is a permissive dummy
class. Nothing else is stubbed. Never use it outside the tests.
"""
import importlib.abc
import importlib.machinery
import sys
import types

STUBBED_ROOTS = ("tensorrt", "tensorrt_llm", "tensorrt_bindings", "tensorrt_libs", "mpi4py")
VERSIONS = {"tensorrt": "10.3.0", "tensorrt_llm": "0.13.0", "mpi4py": "3.1.6"}


class _DummyMeta(type):
    """Classes that accept any attribute, call, subscript, union or use as a base class."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _dummy_class(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return super().__call__()

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _DummyBase(metaclass=_DummyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _dummy_class(name)


def _dummy_class(name):
    return _DummyMeta(name.rsplit(".", 1)[-1], (_DummyBase,), {"__qualname__": name})


class _DummyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _dummy_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _DummyModule(spec.name)
        module.__path__ = []  # a package, so submodules import too
        root = spec.name.split(".")[0]
        if spec.name in VERSIONS:
            module.__version__ = VERSIONS[spec.name]
        module.__file__ = f"<test stub for {root}>"
        return module

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


sys.meta_path.insert(0, _StubFinder())
