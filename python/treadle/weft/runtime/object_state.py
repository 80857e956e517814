"""Python-object session state: environments written as classes (e.g. BFCL-style tool classes).

The state is an instance of the environment's class; its *instance attributes* are the state. A
snapshot stores them as pickle (protocol 5) of the attribute dict, so a snapshot never references a
particular module's class object: the same snapshot can be materialised into the class of an
independently imported copy of the server module (isolated sessions). Fork = ``copy.deepcopy`` of the
attributes; diff = per attribute path (dicts are walked, other values compared with ``==``).
Class attributes are *not* state: a server that mutates them is flagged by
:mod:`treadle.weft.runtime.isolation` and runs isolated (one module import per session).

Snapshots are unpickled by a restricted unpickler: plain containers and values and the server
module's own classes only (whatever else an image names is refused before anything is called), and
no opcode that changes an object in place (``BUILD``, ``APPEND(S)``, ``SETITEM(S)``, ``ADDITEMS``) may
target a class object (walked before loading: a class attribute is never rewritten process-wide);
checkpoints from a shared store are also authenticated (see :mod:`treadle.weft.runtime.checkpoint`).
"""
from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import pickletools
import sys
import types
import typing
from typing import Any

from treadle.weft.runtime.determinism import SessionEnv
from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.state import RowChange, Snapshot, StateBackend, StateDiff, TableDiff

NAMESPACE = "attributes"
_PROTOCOL = 5
SERVER_MODULE_PREFIX = "treadle_weft_server_"
"""Name prefix of independently imported server modules (see :mod:`treadle.weft.runtime.registry`)."""


class _ServerPickler(pickle.Pickler):
    """Writes classes (and functions) of server modules by qualified name only, so the bytes do not depend
    on which independently imported copy of the module the state lives in."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", "").startswith(
                SERVER_MODULE_PREFIX):
            return ("weft-server-global", obj.__qualname__)
        return None


SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", n) for n in ("set", "frozenset", "bytearray", "complex", "slice", "range", "list", "dict", "tuple",
                              "int", "float", "str", "bytes", "bool")
} | {("datetime", n) for n in ("datetime", "date", "time", "timedelta", "timezone")} | {
    ("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")
} | {("decimal", "Decimal"), ("fractions", "Fraction"), ("uuid", "UUID"), ("copyreg", "_reconstructor"),
     ("builtins", "object"), ("_codecs", "encode"), ("copyreg", "__newobj__"), ("random", "Random")})
"""Globals an object-state image may name besides the server's own classes: plain value types and containers."""


class _HomeUnpickler(pickle.Unpickler):
    """Restricted unpickler: plain containers and values (:data:`SAFE_GLOBALS`) and the classes the server
    module itself defines, resolved in ``home`` (the module copy the session runs). Anything else, a
    function of any module, or a class the server merely imports, is refused before it is called, so a
    tampered or foreign image cannot run code (``os.system``, ``builtins.eval``, ...)."""

    def __init__(self, f: Any, home: types.ModuleType | None):
        super().__init__(f)
        self.home = home

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in an object-state image (only plain "
                                         f"containers and the server's own classes)")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "weft-server-global"
                and isinstance(pid[1], str)):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if self.home is None:
            raise pickle.UnpicklingError(f"snapshot refers to server class {pid[1]!r}: load it with the server's "
                                         f"state class")
        obj: Any = self.home
        for part in pid[1].split("."):
            if part.startswith("__"):
                raise pickle.UnpicklingError(f"server class path {pid[1]!r} is not allowed")
            obj = getattr(obj, part, None)
        if not (isinstance(obj, type) and obj.__module__ == self.home.__name__):
            raise pickle.UnpicklingError(f"{pid[1]!r} is not a class defined by the server module: refused")
        return obj


_CLASS_SOURCES = {"GLOBAL", "STACK_GLOBAL", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4", "INST", "OBJ"}
_IN_PLACE = {"BUILD": 2, "APPEND": 2, "SETITEM": 3}  # op -> depth of its target on the stack (1 = top)
_IN_PLACE_MARKED = {"APPENDS", "SETITEMS", "ADDITEMS"}  # target: the item below the topmost mark
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
_MAX_OPS = 10_000_000


def _check_no_class_mutation(data: bytes) -> None:
    """Refuse an image whose opcodes would change a class object in place.

    The restricted unpickler resolves classes only from :data:`SAFE_GLOBALS` and the server module, but
    ``BUILD`` on a class object sets its attributes (``setattr`` of the slot state) process-wide, and
    ``APPEND(S)``/``SETITEM(S)``/``ADDITEMS`` call methods of whatever object they target. This walks the
    opcodes (:func:`pickletools.genops`, nothing is built or called) with a symbolic stack that records
    which items are class objects, through the memo, and refuses any in-place opcode aimed at one.

    Raises:
        pickle.UnpicklingError: such an opcode, or a stream the walk cannot follow.
    """
    stack: list[str] = []  # "class", "mark" or "value"
    memo: dict[int, str] = {}
    ops = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            ops += 1
            if ops > _MAX_OPS:
                raise pickle.UnpicklingError("object-state image has too many opcodes")
            name = op.name
            if name in _IN_PLACE and len(stack) >= _IN_PLACE[name] and stack[-_IN_PLACE[name]] == "class":
                raise pickle.UnpicklingError(f"{name} on a class object is not allowed in an object-state image "
                                             f"(it would change the class for the whole process)")
            if name in _IN_PLACE_MARKED and "mark" in stack:
                below = len(stack) - 1 - stack[::-1].index("mark") - 1
                if below >= 0 and stack[below] == "class":
                    raise pickle.UnpicklingError(f"{name} on a class object is not allowed in an object-state image")
            if name in _MEMO_PUT:
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1] if stack else "value"
                continue
            if name in _MEMO_GET:
                stack.append(memo.get(arg, "value"))
                continue
            if name == "DUP":
                stack.append(stack[-1] if stack else "value")
                continue
            for item in reversed(op.stack_before):  # pop what the opcode consumes
                if item is pickletools.stackslice:
                    while stack and stack[-1] != "mark":
                        stack.pop()
                elif stack:
                    stack.pop()
            for item in op.stack_after:
                stack.append("mark" if item is pickletools.markobject else
                             "class" if name in _CLASS_SOURCES and name not in ("INST", "OBJ") else "value")
    except ValueError as err:  # a truncated or malformed stream
        raise pickle.UnpicklingError(f"not a pickle stream: {err}") from err


def _dumps(attrs: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    _ServerPickler(buf, protocol=_PROTOCOL).dump(attrs)
    return buf.getvalue()


def _attrs(obj: Any) -> dict[str, Any]:
    try:
        return vars(obj)
    except TypeError:
        raise TypeError(f"object state needs instance attributes in __dict__; {type(obj).__name__} has none "
                        f"(__slots__ classes are not supported)") from None


def snapshot_from_object(obj: Any) -> Snapshot:
    """Snapshot of ``obj``'s instance attributes (deep: later changes to ``obj`` do not affect it).

    Raises:
        TypeError: ``obj`` has no ``__dict__``, or an attribute cannot be pickled.
    """
    try:
        data = _dumps(dict(_attrs(obj)))
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(f"object state attributes of {type(obj).__name__} must be picklable plain data: {err}") from err
    return Snapshot("object", data)


def _home_of(cls: type) -> types.ModuleType | None:
    return sys.modules.get(cls.__module__)


def _load(snapshot: Snapshot, home: types.ModuleType | None = None) -> dict[str, Any]:
    try:
        _check_no_class_mutation(snapshot.data)
        attrs = _HomeUnpickler(io.BytesIO(snapshot.data), home).load()
    except Exception as err:  # noqa: BLE001  (any unpickling failure means "not an object snapshot")
        raise SnapshotSchemaError(f"snapshot is not an object-state image: {err}") from err
    if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
        raise SnapshotSchemaError(f"object-state snapshot must hold a dict with str keys, got {type(attrs).__name__}")
    return attrs


def declared_attributes(cls: type) -> set[str] | None:
    """Attribute names ``cls`` declares (dataclass fields, pydantic fields or annotations), else None."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    fields = getattr(cls, "model_fields", None)
    if isinstance(fields, dict):
        return set(fields)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001
        hints = dict(getattr(cls, "__annotations__", {}))
    names = {k for k, v in hints.items() if typing.get_origin(v) is not typing.ClassVar and v is not typing.ClassVar}
    return names or None


def check_object_schema(snapshot: Snapshot, cls: type) -> None:
    """Check that ``snapshot`` holds exactly the attributes ``cls`` declares.

    Classes without declarations (no dataclass fields, pydantic fields or annotations) accept any
    attribute dict. Pydantic models are also validated field by field.

    Raises:
        TypeError: ``snapshot`` is not a Snapshot or ``cls`` is not a class.
        SnapshotSchemaError: wrong kind, not an object image, or attributes missing/unexpected/invalid.
    """
    if not isinstance(snapshot, Snapshot):
        raise TypeError(f"snapshot must be a treadle.weft.runtime.state.Snapshot, got {type(snapshot).__name__}")
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    if snapshot.kind != "object":
        raise SnapshotSchemaError(f"expected an 'object' snapshot, got kind {snapshot.kind!r}")
    attrs = _load(snapshot, _home_of(cls))
    want = declared_attributes(cls)
    if want is not None:
        missing, extra = sorted(want - attrs.keys()), sorted(attrs.keys() - want)
        if missing or extra:
            raise SnapshotSchemaError(f"snapshot attributes do not match {cls.__name__}: missing {missing}, "
                                      f"unexpected {extra}")
    validate = getattr(cls, "model_validate", None)
    if validate is not None:
        try:
            validate(attrs)
        except Exception as err:  # noqa: BLE001  (pydantic.ValidationError)
            raise SnapshotSchemaError(f"snapshot fails {cls.__name__} validation: {err}") from err


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = value


def same_value(a: Any, b: Any, _depth: int = 0) -> bool:
    """Value equality for state comparison: ``a == b``, or, for two objects of one class that keeps
    Python's identity equality (``random.Random``, plain classes), equality of their pickled state
    (``__reduce_ex__``), compared the same way. Two replays that leave equal generators or records
    behind are then equal states, whatever the objects' identities."""
    try:
        if a == b:
            return True
    except Exception:  # noqa: BLE001  (a value whose __eq__ raises is not equal)
        return False
    if type(a) is not type(b) or type(a).__eq__ is not object.__eq__ or _depth > 20:
        return False
    try:
        ra, rb = a.__reduce_ex__(4), b.__reduce_ex__(4)
    except Exception:  # noqa: BLE001  (not picklable: identity is all there is)
        return False
    if not (isinstance(ra, tuple) and isinstance(rb, tuple)) or len(ra) != len(rb):
        return False
    return all(same_value(x, y, _depth + 1) for x, y in zip(ra[1:], rb[1:])) and ra[0] == rb[0]


def diff_attributes(base: dict[str, Any], other: dict[str, Any]) -> StateDiff:
    """Per-path differences ``base -> other`` (dicts with str keys are walked; paths are dotted)."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    for attrs, flat in ((base, a), (other, b)):
        for k, v in attrs.items():  # top level by name: an object without attributes has no path at all
            _flatten(v, k, flat)
    td = TableDiff(
        added={k: b[k] for k in b.keys() - a.keys()},
        removed={k: a[k] for k in a.keys() - b.keys()},
        changed={k: RowChange(before=a[k], after=b[k]) for k in a.keys() & b.keys() if not same_value(a[k], b[k])},
    )
    return StateDiff(tables={} if td.empty else {NAMESPACE: td})


class ObjectState(StateBackend):
    """Instance-attribute state of an object of class ``cls``, cloned from a snapshot.

    Args:
        snapshot: an ``"object"`` snapshot (see :func:`snapshot_from_object`).
        cls: the environment class to instantiate (``cls.__new__``; ``__init__`` is not run).
    """

    kind = "object"

    def __init__(self, snapshot: Snapshot, cls: type):
        self._check_kind(snapshot)
        if not isinstance(cls, type):
            raise TypeError(f"cls must be a class, got {type(cls).__name__}")
        self._cls = cls
        self._home = _home_of(cls)  # held: the module may leave sys.modules while this state lives
        self.env = SessionEnv(snapshot.env)
        self._obj = cls.__new__(cls)
        _attrs(self._obj).update(_load(snapshot, self._home))

    @property
    def handle(self) -> Any:
        return self._obj

    def snapshot(self) -> Snapshot:
        return dataclasses.replace(snapshot_from_object(self._obj), env=self.env.freeze())

    def restore(self, snapshot: Snapshot) -> None:
        self._check_kind(snapshot)
        loaded = _load(snapshot, self._home)
        attrs = _attrs(self._obj)
        attrs.clear()
        attrs.update(loaded)
        self.env.load(snapshot.env)

    def fork(self) -> ObjectState:
        new = ObjectState.__new__(ObjectState)
        new._cls = self._cls
        new._home = self._home
        new.env = self.env.copy()
        new._obj = self._cls.__new__(self._cls)
        _attrs(new._obj).update(copy.deepcopy(dict(_attrs(self._obj))))
        return new

    def diff(self, other: StateBackend | Snapshot) -> StateDiff:
        if isinstance(other, Snapshot):
            self._check_kind(other)
            return diff_attributes(dict(_attrs(self._obj)), _load(other, self._home))
        if not isinstance(other, ObjectState):
            raise TypeError(f"can only diff an ObjectState against an ObjectState or object Snapshot, got "
                            f"{type(other).__name__}")
        if other._cls is not self._cls:
            # another import of the server module (isolated sessions): its objects are instances of other
            # class objects and never compare equal to ours; materialise its state in our module first
            return self.diff(other.snapshot())
        return diff_attributes(dict(_attrs(self._obj)), dict(_attrs(other._obj)))
