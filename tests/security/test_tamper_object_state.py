"""Tampered object-state images: nothing an image holds may change a class (or anything else outside the
restored object) for the whole process, whatever opcode route it takes; every refusal is a typed error."""
from __future__ import annotations

import fractions
import pickle

import pytest

from treadle.weft.runtime.errors import SnapshotSchemaError
from treadle.weft.runtime.object_state import ObjectState, check_object_schema, snapshot_from_object
from treadle.weft.runtime.state import Snapshot


class Victim:
    """A server class: its class attributes are shared by every session of the process."""

    limit = 10

    def extend(self, items=None):  # a method an APPENDS opcode would call with the class as target
        Victim.limit = 0


def _u(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


_SERVER = _u("weft-server-global") + _u("Victim") + b"\x86Q"  # (tag, qualname) BINPERSID: the server class
_FRACTION = b"cfractions\nFraction\n"  # GLOBAL of an allowed class
_SET_LIMIT = b"N}" + _u("limit") + b"K\x00s\x86b"  # (None, {"limit": 0}) BUILD: setattr on the target
_TAIL = b"0}."  # drop it, leave an empty attribute dict

ROUTES = {
    "BUILD on an allowed class": b"\x80\x05" + _FRACTION + _SET_LIMIT + _TAIL,
    "BUILD on a server class": b"\x80\x05" + _SERVER + _SET_LIMIT + _TAIL,
    "BUILD through the memo": b"\x80\x05" + _SERVER + b"\x940h\x00" + _SET_LIMIT + _TAIL,
    "BUILD through DUP": b"\x80\x05" + _SERVER + b"20" + _SET_LIMIT + _TAIL,
    "APPENDS on a server class": b"\x80\x05" + _SERVER + b"(K\x01e" + _TAIL,
    "APPEND on a server class": b"\x80\x05" + _SERVER + b"K\x01a" + _TAIL,
    "SETITEMS on an allowed class": b"\x80\x05" + _FRACTION + b"(" + _u("k") + b"K\x01u" + _TAIL,
    "SETITEM on a server class": b"\x80\x05" + _SERVER + _u("k") + b"K\x01s" + _TAIL,
    "ADDITEMS on a server class": b"\x80\x05" + _SERVER + b"(K\x01\x90" + _TAIL,
}


@pytest.fixture(autouse=True)
def _restore_classes():
    yield
    Victim.limit = 10
    for name in ("limit",):
        if name in vars(fractions.Fraction):
            delattr(fractions.Fraction, name)


def test_the_routes_are_real_attacks_without_the_walk():
    # control: a plain unpickler does change the class (so each refusal below is what protects it)
    pickle.loads(ROUTES["BUILD on an allowed class"])
    assert fractions.Fraction.limit == 0


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_image_that_changes_a_class_in_place_is_refused(route):
    snap = Snapshot("object", ROUTES[route])
    with pytest.raises(SnapshotSchemaError, match="class object"):
        ObjectState(snap, Victim)
    with pytest.raises(SnapshotSchemaError, match="class object"):
        check_object_schema(snap, Victim)
    assert Victim.limit == 10 and "limit" not in vars(fractions.Fraction)


def test_ordinary_images_still_load():
    v = Victim()
    v.rows = {"a": [1, 2, {3}], "b": fractions.Fraction(1, 3)}
    state = ObjectState(snapshot_from_object(v), Victim)
    assert state.handle.rows == v.rows and Victim.limit == 10


@pytest.mark.parametrize("data", [b"", b"\x80\x05", b"garbage", b"\x80\x05(" * 1000 + b".", b"\x80\x05]" + b"h\x09" * 3,
                                  b"\x80\x05cos\nsystem\n" + _u("true") + b"\x85R."])
def test_malformed_or_foreign_images_are_typed_refusals(data):
    with pytest.raises(SnapshotSchemaError):
        ObjectState(Snapshot("object", data), Victim)
