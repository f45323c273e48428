"""A backend in a process of its own, for plugins that change the process they run in.

Some plugins change their process when they start: tpu-inference replaces vLLM's layers and
patches vLLM when imported, JAX fixes its devices for the process. Two such plugins checked in one
process see each other's changes. :class:`IsolatedBackend` builds the backend in a child process
(``multiprocessing``'s ``spawn``: a fresh interpreter that imports only what the backend imports)
and forwards every attribute and call there, so one pytest session can check two plugins, each in
its own process. Who answered (:mod:`pytest_kvconform.provenance`) is decided in the child, where
the backend's code runs; :attr:`IsolatedBackend.process` says which process that is.

What crosses, pickled, is what the standard library and this package define: scenarios, specs,
plans, answers, built-in exceptions. Anything else (a ``VllmConfig``, a worker, a device array, a
class of the plugin) stays in the child and crosses as a :class:`RemoteObject`, whose attributes
and methods are read and called there, and which is that very object again when sent back as an
argument: so the test process never imports the plugin. An exception of another library comes
back as its nearest built-in class with its message: a rejection stays a rejection.
"""

from __future__ import annotations

import contextlib
import functools
import io
import multiprocessing
import os
import pickle
import sys
import types
from multiprocessing.connection import Connection
from typing import Any

from .. import provenance
from .registry import BackendError

#: top-level modules whose objects cross by value: the standard library and this package
CROSSING = frozenset(sys.stdlib_module_names) | {"builtins", "pytest_kvconform"}


class _Method:
    """What a request answers for an attribute that is a method: it is called there, not sent."""


class IsolatedBackendError(BackendError):
    """The backend's process could not start or died; the message says why, on one line."""


#: objects pickled by the name of their module, not their class's
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _crosses(obj: Any) -> bool:
    """Whether ``obj`` is defined by a :data:`CROSSING` module (a class or function: itself) under
    the name it is pickled by: a class made at run time (vLLM's ``subclass_attention_backend``
    gives its classes the module ``abc``) or a closure has none, and stays."""
    by_name = isinstance(obj, _BY_NAME)
    named = obj if by_name else type(obj)
    if "<locals>" in str(getattr(named, "__qualname__", "")):  # a closure pickles by no name: it stays
        return False
    module = str(getattr(named, "__module__", "") or "")
    if module.partition(".")[0] not in CROSSING:
        return False
    if not by_name or module == "builtins":  # an instance: its class decides; builtins all pickle
        return True
    found: Any = sys.modules.get(module)  # a class or function pickles by this name, if it has one
    for part in str(getattr(getattr(obj, "__func__", obj), "__qualname__", "")).split("."):
        found = getattr(found, part, None)
    return found is getattr(obj, "__func__", obj)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when its class crosses, else its nearest built-in class with the same message;
    either way with where it was raised here (``kvconform_where``, read by the verdict)."""
    from ..verdict import where_raised

    where = where_raised(exc)
    crossing: BaseException | None = exc if _crosses(exc) else None
    for cls in type(exc).__mro__[1:]:
        if crossing is None and cls.__module__ == "builtins":
            with contextlib.suppress(TypeError):
                crossing = cls(f"{type(exc).__name__}: {exc}")
    crossing = crossing if crossing is not None else RuntimeError(f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(AttributeError, TypeError):
        crossing.kvconform_where = where  # type: ignore[attr-defined]
    return crossing


class _Objects:
    """The child's side: what did not cross, by key, and the pickling that keeps it there."""

    def __init__(self) -> None:
        self.table: dict[int, Any] = {}

    def dumps(self, value: Any) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        pickler.persistent_id = self._keep  # type: ignore[method-assign]
        pickler.dump(value)
        return buffer.getvalue()

    def loads(self, data: bytes) -> Any:
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = self.table.__getitem__  # type: ignore[method-assign]
        return unpickler.load()

    def _keep(self, obj: Any) -> int | None:
        if _crosses(obj):
            return None
        self.table[id(obj)] = obj
        return id(obj)


def _answer(backend: Any, objects: _Objects, op: str, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """One request, in the child: ``get`` an attribute or ``call`` a method of the backend or
    (``kvconform_target``) of an object kept here, ``ask`` a rule method with its
    provenance, ``set`` an attribute, ``release`` (the judged rules), ``composes_plan``."""
    if op in ("get", "call"):
        target = kwargs.pop("kvconform_target", backend)
        if op == "call":
            return getattr(target, name)(*args, **kwargs)
        value = getattr(target, name)
        return _Method() if callable(value) and not isinstance(value, type) else value
    if op == "ask":
        answer = provenance.ask(backend, name, *args, **kwargs)
        if answer.error is None:
            return answer
        return provenance.Answer(answer.by, error=_portable(answer.error), pid=answer.pid)
    if op == "set":
        setattr(backend, name, args[0])
    elif op == "release":
        from ..reference.rules import ReferenceRules

        if isinstance(backend, ReferenceRules):
            backend.release = args[0]
    elif op == "composes_plan":
        return provenance.composes_plan(backend)
    return None


def _serve(conn: Connection, name: str, options: dict[str, str]) -> None:
    """The child: build the backend, then answer requests until told to stop."""
    from .registry import build_backend

    try:
        backend = build_backend(name, options)
    except BackendError as exc:
        conn.send(("error", str(exc)))
        return
    except BaseException as exc:  # reported to the parent on one line
        conn.send(("error", f"backend {name!r} failed to start in its own process: {exc!r}"))
        return
    conn.send(("ready", os.getpid()))
    objects = _Objects()
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        if not data:
            return
        try:
            reply = objects.dumps(("value", _answer(backend, objects, *objects.loads(data))))
        except Exception as exc:  # the caller re-raises it
            reply = objects.dumps(("raised", _portable(exc)))
        conn.send_bytes(reply)


#: what a backend declares about itself, read once when its process starts
DECLARATIONS = ("name", "version", "declines", "inherits", "known_departures")


class IsolatedBackend:
    """The backend called ``name`` (options as for :func:`~.registry.resolve_backend`), built
    and run in a child process. Attributes and methods are the backend's; :attr:`process` says
    which process answers and why it is a separate one."""

    def __init__(
        self, name: str, options: dict[str, str] | None = None, why: str = "", timeout: float = 600.0
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child, name, dict(options or {})), daemon=True,
                              name=f"kvconform-backend-{name}")  # fmt: skip
        process.start()
        child.close()
        vars(self).update(_conn=parent, _process=process, _label=name, _timeout=timeout, _stopped="")
        if not parent.poll(timeout):
            self._stop()
            raise IsolatedBackendError(
                f"backend {name!r}: its process did not start within {timeout:g} s (--kvconform-timeout); "
                "it was stopped"
            )
        try:
            status, detail = parent.recv()
        except EOFError:
            process.join(5)
            raise IsolatedBackendError(
                f"backend {name!r}: its process exited with status {process.exitcode} before it started"
            ) from None
        if status == "error":
            process.join(5)
            raise IsolatedBackendError(str(detail))
        #: ``{"pid": ..., "isolated": True, "why": ...}``: the process that answers
        vars(self)["process"] = {"pid": int(detail), "isolated": True, "why": why}
        for attr in DECLARATIONS:  # read here once: a verdict needs them after the process stopped
            with contextlib.suppress(AttributeError):
                vars(self)[attr] = self._request("get", attr)

    def _request(self, op: str, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._stopped:
            raise IsolatedBackendError(f"backend {self._label!r}: {self._stopped}")
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        pickler.persistent_id = _sent_back  # type: ignore[method-assign]
        pickler.dump((op, name, args, kwargs))
        try:
            self._conn.send_bytes(buffer.getvalue())
            if not self._conn.poll(self._timeout):
                self._stop()
                vars(self)["_stopped"] = (
                    f"its process stopped answering ({op} {name!r} took over {self._timeout:g} s, "
                    "--kvconform-timeout) and was stopped"
                )
                raise IsolatedBackendError(f"backend {self._label!r}: {self._stopped}")
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            code = self._process.exitcode
            vars(self)["_stopped"] = f"its process (pid {self.process['pid']}) died" + (
                f" with status {code}" if code is not None else "")  # fmt: skip
            raise IsolatedBackendError(f"backend {self._label!r}: {self._stopped}") from None
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = functools.partial(RemoteObject, self)  # type: ignore[method-assign]
        kind, value = unpickler.load()
        if kind == "raised":
            raise value
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = self._request("get", name)
        return functools.partial(self._request, "call", name) if isinstance(value, _Method) else value

    def __setattr__(self, name: str, value: Any) -> None:
        self._request("set", name, value)

    def kvconform_ask(self, method: str, *args: Any, **kwargs: Any) -> provenance.Answer:
        """:func:`provenance.ask`, run where the backend's code runs."""
        return self._request("ask", method, *args, **kwargs)

    def kvconform_composes_plan(self) -> bool:
        """:func:`provenance.composes_plan` of the backend, in its process."""
        return bool(self._request("composes_plan", "plan"))

    def kvconform_set_release(self, release: Any) -> None:
        """Give the backend the judged release's rules, when it is built on the reference."""
        self._request("release", "release", release)

    def close(self) -> None:
        """Stop the backend's process (also done at interpreter exit: it is a daemon)."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send_bytes(b"")
            self._process.join(5)
        self._stop()

    def _stop(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def __repr__(self) -> str:
        return f"<IsolatedBackend {self._label!r} pid={self.process['pid']}>"


class RemoteObject:
    """An object that stayed in the backend's process: its attributes and methods are read and
    called there; sent back as an argument, it is that very object again."""

    def __init__(self, owner: IsolatedBackend, key: int) -> None:
        vars(self).update(_owner=owner, _key=key)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = self._owner._request("get", name, kvconform_target=self)
        if not isinstance(value, _Method):
            return value

        def method(*args: Any, **kwargs: Any) -> Any:
            return self._owner._request("call", name, *args, kvconform_target=self, **kwargs)

        return method

    def __repr__(self) -> str:
        return f"<object {self._key} in process {self._owner.process['pid']}>"


def _sent_back(obj: Any) -> int | None:
    """A :class:`RemoteObject` crosses back as its key."""
    return obj._key if isinstance(obj, RemoteObject) else None
