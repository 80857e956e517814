"""object_state.py, value by value: the server-class pickling round trip, the
restricted unpickler's refusals, declared attributes of every kind of class, schema checks and diffs."""
import dataclasses
import pickle
import sys
import types
from typing import ClassVar

import pydantic
import pytest

from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.object_state import (
    SERVER_MODULE_PREFIX,
    ObjectState,
    _dumps,
    _load,
    check_object_schema,
    declared_attributes,
    diff_attributes,
    snapshot_from_object,
)
from treadle.weft.runtime.state import RowChange, Snapshot


def _server_module(name="units"):
    """A module named like an independently imported server module, with a class and a nested class."""
    mod = types.ModuleType(SERVER_MODULE_PREFIX + name)
    exec("class Item:\n    class Inner:\n        pass\n    def __init__(self):\n        self.v = 1\n"
         "def helper():\n    return 1\nimport collections\nOD = collections.OrderedDict\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    return mod


@pytest.fixture
def home():
    mod = _server_module()
    yield mod
    sys.modules.pop(mod.__name__, None)


def test_server_classes_pickle_by_qualified_name_and_load_in_the_home_module(home):
    data = _dumps({"cls": home.Item, "inner": home.Item.Inner, "n": 1})
    assert b"weft-server-global" in data and home.__name__.encode() not in data  # by name, not module
    other = _server_module("units_copy")  # an independent import of the same source
    try:
        got = _load(Snapshot("object", data), other)
        assert got == {"cls": other.Item, "inner": other.Item.Inner, "n": 1}
        assert got["cls"] is not home.Item
    finally:
        sys.modules.pop(other.__name__, None)
    # functions of a server module are written by name too (and refused on load: not a class)
    fdata = _dumps({"f": home.helper})
    with pytest.raises(SnapshotSchemaError, match="'helper' is not a class defined by the server module: refused"):
        _load(Snapshot("object", fdata), home)
    # classes of other modules are pickled normally (and refused by the restricted unpickler unless safe)
    assert b"weft-server-global" not in _dumps({"c": dict})


@pytest.mark.parametrize("pid, message", [
    (("weft-server-global", "Item", 3), "unknown persistent id"),
    (("other", "Item"), "unknown persistent id"),
    ("weft-server-global", "unknown persistent id"),
    (("weft-server-global", 5), "unknown persistent id"),
    (("weft-server-global", "Item.__class__"), "server class path 'Item.__class__' is not allowed"),
    (("weft-server-global", "__builtins__"), "server class path '__builtins__' is not allowed"),
    (("weft-server-global", "Nope"), "'Nope' is not a class defined by the server module"),
    (("weft-server-global", "OD"), "'OD' is not a class defined by the server module"),  # imported, not defined
])
def test_persistent_ids_other_than_the_home_modules_own_classes_are_refused(home, pid, message):
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "MARK" else None

    import io
    buf = io.BytesIO()
    P(buf, protocol=5).dump({"x": "MARK"})
    with pytest.raises(SnapshotSchemaError, match="snapshot is not an object-state image: .*" + message.replace(
            "(", r"\(").replace(".", r"\.")):
        _load(Snapshot("object", buf.getvalue()), home)


def test_a_server_class_without_its_home_module_is_refused(home):
    data = _dumps({"cls": home.Item})
    with pytest.raises(SnapshotSchemaError, match="snapshot refers to server class 'Item': load it with the server's "
                                                  "state class"):
        _load(Snapshot("object", data), None)


def test_globals_outside_the_safe_list_are_refused_before_anything_runs():
    import os

    # os.system, not print: importing Ray (its tests run in the same session) replaces builtins.print
    evil = pickle.dumps({"x": os.system}, protocol=5)
    with pytest.raises(SnapshotSchemaError, match=r"global (posix|nt)\.system is not allowed in an object-state image "
                                                  r"\(only plain containers and the server's own classes\)"):
        _load(Snapshot("object", evil))
    import collections
    import datetime
    import decimal
    ok = {"d": datetime.date(2020, 1, 2), "od": collections.OrderedDict(a=1), "s": {1}, "f": frozenset({2}),
          "dec": decimal.Decimal("1.5"), "c": collections.Counter("aab"), "b": bytearray(b"x"), "z": 1j}
    assert _load(Snapshot("object", pickle.dumps(ok, protocol=5))) == ok


@pytest.mark.parametrize("payload, message", [
    ([1, 2], "must hold a dict with str keys, got list"),
    ({1: "a"}, "must hold a dict with str keys, got dict"),
])
def test_images_that_are_not_attribute_dicts_are_refused(payload, message):
    with pytest.raises(SnapshotSchemaError, match=message):
        _load(Snapshot("object", pickle.dumps(payload)))
    with pytest.raises(SnapshotSchemaError, match="snapshot is not an object-state image"):
        _load(Snapshot("object", b"not a pickle"))


def test_declared_attributes_of_every_kind_of_class():
    @dataclasses.dataclass
    class D:
        a: int
        b: ClassVar[int] = 0  # not a field

    class M(pydantic.BaseModel):
        x: int = 0
        y: str = ""

    class A:
        p: int
        q: "list[int]"
        r: ClassVar[int] = 1
        s: ClassVar = 2

    class Broken:
        p: int
        q: "NoSuchName"  # noqa: F821  (get_type_hints fails: the raw annotations are used)

    class Plain:
        pass

    class OnlyClassVars:
        r: ClassVar[int] = 1

    assert declared_attributes(D) == {"a"}
    assert declared_attributes(M) == {"x", "y"}
    assert declared_attributes(A) == {"p", "q"}
    assert declared_attributes(Broken) == {"p", "q"}
    assert declared_attributes(Plain) is None
    assert declared_attributes(OnlyClassVars) is None


def test_check_object_schema_messages():
    class A:
        p: int
        q: int

    class M(pydantic.BaseModel):
        x: int

    class Plain:
        pass

    ok = snapshot_from_object(types.SimpleNamespace(p=1, q=2))
    check_object_schema(ok, A)
    check_object_schema(ok, Plain)  # no declarations: any attributes
    with pytest.raises(SnapshotSchemaError, match=r"snapshot attributes do not match A: missing \['q'\], "
                                                  r"unexpected \['r', 's'\]"):
        check_object_schema(snapshot_from_object(types.SimpleNamespace(p=1, r=2, s=3)), A)
    with pytest.raises(SnapshotSchemaError, match=r"snapshot attributes do not match A: missing \[\], unexpected \['z'\]"):
        check_object_schema(snapshot_from_object(types.SimpleNamespace(p=1, q=2, z=3)), A)
    check_object_schema(snapshot_from_object(types.SimpleNamespace(x=3)), M)
    with pytest.raises(SnapshotSchemaError, match="(?s)snapshot fails M validation: 1 validation error for M.x.*int_parsing"):
        check_object_schema(snapshot_from_object(types.SimpleNamespace(x="nope")), M)
    with pytest.raises(TypeError, match="snapshot must be a treadle.weft.runtime.state.Snapshot, got dict"):
        check_object_schema({}, A)
    with pytest.raises(TypeError, match="cls must be a class, got int"):
        check_object_schema(ok, 3)
    with pytest.raises(SnapshotSchemaError, match="expected an 'object' snapshot, got kind 'sqlite'"):
        check_object_schema(Snapshot("sqlite", b""), A)


def test_snapshot_from_object_refusals():
    class Slots:
        __slots__ = ("a",)

    with pytest.raises(TypeError, match=r"object state needs instance attributes in __dict__; Slots has none "
                                        r"\(__slots__ classes are not supported\)"):
        snapshot_from_object(Slots())
    with pytest.raises(TypeError, match="object state attributes of SimpleNamespace must be picklable plain data"):
        snapshot_from_object(types.SimpleNamespace(f=lambda: 1))


def test_diff_attributes_walks_str_keyed_dicts_only():
    base = {"a": {"b": 1, "c": {"d": 2}}, "e": {}, "f": {1: "x"}, "g": [1]}
    other = {"a": {"b": 1, "c": {"d": 3}, "n": 0}, "e": {}, "f": {1: "y"}, "h": 5}
    td = diff_attributes(base, other).tables["attributes"]
    assert td.added == {"a.n": 0, "h": 5}
    assert td.removed == {"g": [1]}
    assert td.changed == {"a.c.d": RowChange(before=2, after=3), "f": RowChange(before={1: "x"}, after={1: "y"})}
    assert diff_attributes(base, base).tables == {}


class Counter:
    def __init__(self):
        self.n = 0
        self.items = {"a": [1]}


def test_object_state_snapshot_restore_fork_and_diff():
    snap = snapshot_from_object(Counter())
    s = ObjectState(snap, Counter)
    try:
        assert isinstance(s.handle, Counter) and vars(s.handle) == {"n": 0, "items": {"a": [1]}}
        s.handle.n = 5
        s.handle.extra = 1
        d = s.diff(snap).tables["attributes"]
        assert (d.changed, d.removed, d.added) == ({"n": RowChange(before=5, after=0)}, {"extra": 1}, {})
        f = s.fork()
        assert vars(f.handle) == vars(s.handle) and f.handle is not s.handle
        f.handle.items["a"].append(2)
        assert s.handle.items == {"a": [1]}  # deep copy
        assert s.diff(f).tables["attributes"].changed == {"items.a": RowChange(before=[1], after=[1, 2])}
        assert f.snapshot().env == f.env.freeze()
        s.restore(snap)
        assert vars(s.handle) == {"n": 0, "items": {"a": [1]}}  # the extra attribute is gone too
        assert s.snapshot().data == snap.data
        with pytest.raises(TypeError, match="can only diff an ObjectState against an ObjectState or object Snapshot, "
                                            "got int"):
            s.diff(3)
        with pytest.raises(TypeError, match="cls must be a class, got str"):
            ObjectState(snap, "Counter")
        f.close()
    finally:
        s.close()


def test_diff_of_an_object_without_attributes_names_only_real_paths():
    td = diff_attributes({}, {"a": 1, "b": {}}).tables["attributes"]
    assert (td.added, td.removed, td.changed) == ({"a": 1, "b": {}}, {}, {})
    td = diff_attributes({"x": {"y": {}}}, {}).tables["attributes"]
    assert td.removed == {"x.y": {}}
    assert diff_attributes({}, {}).tables == {}


def test_declared_attributes_tell_fields_from_other_annotations():
    from dataclasses import InitVar

    @dataclasses.dataclass
    class D:
        a: int
        setup: InitVar[int] = 0  # annotated, not a field

        def __post_init__(self, setup):
            pass

    class M(pydantic.BaseModel):
        x: int = 0
        _cache: int = pydantic.PrivateAttr(0)  # annotated, not a field

    class Base:
        p: int

    class Child(Base):
        q: int
        r: "ClassVar[int]" = 1  # a ClassVar written as a string: only resolved hints tell

    assert declared_attributes(D) == {"a"}
    assert declared_attributes(M) == {"x"}
    assert declared_attributes(Child) == {"p", "q"}  # inherited annotations count


def test_object_state_carries_env_and_server_classes_through_every_operation(home):
    class_ref_state = types.SimpleNamespace(kind=home.Item, n=0)
    snap = snapshot_from_object(class_ref_state).with_env(seed=9, draws=4)
    assert snap.data[:2] == b"\x80\x05"  # pickle protocol 5
    Item = home.Item
    s = ObjectState(snap, Item)  # the state class lives in the server module: its home resolves the class refs
    try:
        assert s.handle.kind is Item and s.env.freeze() == snap.env
        assert s.snapshot().env == snap.env and s.snapshot().data == snap.data
        s.env.random.random()
        moved = s.snapshot()
        assert moved.env.draws > snap.env.draws
        s.restore(snap)
        assert s.env.freeze() == snap.env and s.handle.kind is Item
        f = s.fork()
        g = f.fork()  # a fork of a fork keeps the class and the home module
        assert type(g.handle) is Item and g.handle.kind is Item
        g.restore(snap)
        assert g.handle.kind is Item and g.env.freeze() == snap.env
        assert s.diff(g).tables == {}
        f.close()
        g.close()
    finally:
        s.close()


def test_same_value_compares_objects_without_value_equality_by_their_state():
    import random

    from treadle.weft.runtime.object_state import diff_attributes, same_value

    class Plain:
        def __init__(self, x):
            self.x = x

    a, b = random.Random(3), random.Random(3)
    assert a != b and same_value(a, b)                      # identity equality, equal state
    b.random()
    assert not same_value(a, b)                             # the generator moved on: a real change
    assert same_value(Plain([1, {"k": 2}]), Plain([1, {"k": 2}])) and not same_value(Plain(1), Plain(2))
    assert not same_value(Plain(1), 1) and same_value(1, 1.0)
    assert diff_attributes({"_random": random.Random(1), "n": 1}, {"_random": random.Random(1), "n": 1}).empty
    assert not diff_attributes({"_random": random.Random(1)}, {"_random": random.Random(2)}).empty
