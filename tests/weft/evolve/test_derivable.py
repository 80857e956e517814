"""Derivability of gold values, kind by kind (treadle.weft.evolve.derivable through task_checks.derive_values):
each kind a competent policy can derive is ``given``, what only world knowledge gives is ``undecided``, and the
rest is ``missing`` (the task's)."""
from __future__ import annotations

import pytest

from treadle.weft.evolve import derivable
from treadle.weft.evolve.task_checks import derive_values
from treadle.weft.runtime.callparse import ToolCall


def _tool(props: dict, description: str = "", required: tuple = ()) -> dict:
    return {"description": description, "input_schema": {"type": "object", "properties": props,
                                                          "required": list(required)}}


def _verdict(request, name, args, tools, *, results=(), world=None, policy=()):
    d = derive_values(request, [ToolCall(name=name, arguments=args)], list(results), tools, world=world,
                      policy=policy)
    return d.missing, d.undecided


DOORS = _tool({"doors": {"type": "array", "items": {"type": "string",
                                                     "enum": ["driver", "passenger", "rear_left", "rear_right"]}},
               "unlock": {"type": "string", "enum": ["locked", "unlocked"]}})


def test_documented_option_a_request_word_names_is_given():
    assert _verdict("please unlock the rear left door", "lock", {"doors": ["rear_left"], "unlock": "unlocked"},
                    {"lock": DOORS}) == ([], [])


def test_documented_option_named_only_by_its_argument_is_undecided():
    tools = {"fly": _tool({"travel_class": {"type": "string", "enum": ["economy", "business", "first"]}})}
    # the request names the argument (class), not the option: world knowledge of "cheapest" decides
    assert _verdict("book me the cheapest travel class", "fly", {"travel_class": "economy"}, tools) == \
        ([], ["fly.travel_class='economy'"])
    # neither the option nor the argument: the task's
    assert _verdict("book me a flight", "fly", {"travel_class": "economy"}, tools) == \
        (["fly.travel_class='economy'"], [])


def test_whole_collection_the_request_quantifies_over_is_given():
    args = {"doors": ["driver", "passenger", "rear_left", "rear_right"], "unlock": "locked"}
    assert _verdict("lock all of my car doors", "lock", args, {"lock": DOORS}) == ([], [])
    # three of the four doors are not "all": each door is then only a documented option of the named argument
    missing, undecided = _verdict("lock all of my car doors", "lock",
                          {"doors": ["driver", "passenger", "rear_left"], "unlock": "locked"}, {"lock": DOORS})
    assert missing == [] and len(undecided) == 3


def test_canonical_forms_of_request_words_are_given():
    tools = {"book": _tool({"date": {"type": "string"}, "ref": {"type": "string"}, "city": {"type": "string"}})}
    assert _verdict("on the 6th day of October in 2026, reference P followed by 12345678, to new_york",
                    "book", {"date": "2026-10-06", "ref": "P12345678", "city": "new york"}, tools) == ([], [])


def test_dates_the_request_leaves_incomplete():
    tools = {"book": _tool({"date": {"type": "string"}})}
    # a month without its day or year, or "tomorrow": world knowledge (today's date) decides
    assert _verdict("some day in October", "book", {"date": "2026-10-06"}, tools)[1] == ["book.date='2026-10-06'"]
    assert _verdict("tomorrow please", "book", {"date": "2026-10-06"}, tools)[1] == ["book.date='2026-10-06'"]
    assert _verdict("whenever suits", "book", {"date": "2026-10-06"}, tools)[0] == ["book.date='2026-10-06'"]


def test_an_earlier_results_documented_field_is_given():
    tools = {"zip": _tool({"city": {"type": "string"}}),
             "dist": _tool({"cityA": {"type": "string", "description": "The zipcode of the first city."}}),
             "fill": _tool({"fuelAmount": {"type": "integer", "description": "Fuel to add, in gallons."}})}
    gold = [ToolCall(name="zip", arguments={"city": "Rivermist"}),
            ToolCall(name="dist", arguments={"cityA": "94016"}),
            ToolCall(name="fill", arguments={"fuelAmount": 10})]
    d = derive_values("how far is Rivermist, then add the fuel", gold,
                      [{"zipcode": "94016"}, {"gallon": 10.04}], tools)
    assert d.missing == [] and d.undecided == []
    # a field the description does not name gives nothing
    d = derive_values("how far is Rivermist", gold[:2], [{"postcode": "94016"}], tools)
    assert d.missing == ["dist.cityA='94016'"]


def test_codes_abbreviating_a_request_word():
    tools = {"quote": _tool({"symbol": {"type": "string"}})}
    held = derivable.World(values={"NVDA"})
    assert _verdict("what does Nvidia trade at", "quote", {"symbol": "NVDA"}, tools, world=held) == ([], [])
    # the environment does not hold it: only world knowledge says NVDA is Nvidia's ticker
    assert _verdict("what does Nvidia trade at", "quote", {"symbol": "NVDA"}, tools) == \
        ([], ["quote.symbol='NVDA'"])


def test_a_looked_up_value_is_given():
    tools = {"book": _tool({"airport": {"type": "string"}})}
    world = derivable.World(looked_up={"LAX"})
    assert _verdict("fly from Los Angeles", "book", {"airport": "LAX"}, tools, world=world) == ([], [])


@pytest.mark.parametrize("request_text,verdict", [("fill the tank", "given"), ("add some fuel", "undecided")])
def test_a_documented_limits_complement(request_text, verdict):
    tools = {"fill": _tool({"fuelAmount": {"type": "number", "description": "Fuel to add (gallons)."}},
                           description="The tank can hold up to 50 gallons.")}
    world = derivable.World(numbers=[("state.fuelLevel", 12.0)])
    missing, undecided = _verdict(request_text, "fill", {"fuelAmount": 38.0}, tools, world=world)
    assert missing == []
    assert undecided == ([] if verdict == "given" else ["fill.fuelAmount=38.0"])
    # a number that is no limit's complement is the task's
    assert _verdict(request_text, "fill", {"fuelAmount": 7.0}, tools, world=world)[0] == ["fill.fuelAmount=7.0"]


def test_what_the_policy_itself_gave_is_given():
    tools = {"note": _tool({"tag": {"type": "string"}})}
    assert _verdict("file it", "note", {"tag": "urgent"}, tools)[0] == ["note.tag='urgent'"]
    assert _verdict("file it", "note", {"tag": "urgent"}, tools,
                    policy=[ToolCall(name="note", arguments={"tag": "urgent"})]) == ([], [])


def test_documented_options_forms():
    assert derivable.documented({"enum": ["a", "b"]}) == ["a", "b"]
    assert derivable.documented({"description": 'Kind. [Enum]: ["x", "y"]'}) == ["x", "y"]
    assert derivable.documented({"description": "Kind. [Enum]: Rivermist, Stonebrook"}) == \
        ["Rivermist", "Stonebrook"]
    assert derivable.documented({"description": "Options are: low, medium or high."}) == ["low", "medium", "high"]
    assert derivable.documented({"description": "free text"}) == []


def test_hostile_sizes_stay_bounded():
    """A request and documentation of megabytes are read only up to their caps."""
    big = "October " * 200_000
    dates, months, _ = derivable.request_dates(big)
    assert months == {10} and dates == set()
    # only the first 4,000 characters of a description are read: at most ~1,300 options of "a, "
    assert 0 < len(derivable.documented({"description": "Options are: " + "a, " * 500_000})) <= 4000 // 3
