"""An import-only stand-in for the ``sgl_kernel`` package (its CPU build is not on PyPI), for
the benchmarks that drive SGLang's real classes on the CPU: ``install()`` puts a meta-path
finder first whose modules answer every name with a placeholder that raises
``NotImplementedError`` when called. The SGLang paths these benchmarks run call none of them."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    def __init__(self, name: str) -> None:
        self._n = name

    def __getattr__(self, n: str):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Missing(f"{self._n}.{n}")

    def __call__(self, *a, **k):
        raise NotImplementedError(f"sgl_kernel stand-in: {self._n}")


class _Stub(types.ModuleType):
    def __getattr__(self, n: str):
        if n.startswith("__"):
            raise AttributeError(n)
        return _Missing(f"{self.__name__}.{n}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, m):
        pass


def install() -> None:
    """Resolve ``sgl_kernel`` imports to the stand-in (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
