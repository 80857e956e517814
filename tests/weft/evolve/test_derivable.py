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
    assert derivable.documented({"description": "Type of the order (Buy/Sell)."}) == ["Buy", "Sell"]
    # a unit in parentheses is not a list of options; the options after it still are
    assert derivable.documented({"description": "Speed (km/h)."}) == []
    assert derivable.documented({"description": "Rate (m/s), mode (Fast/Slow)."}) == ["Fast", "Slow"]


def test_hostile_sizes_stay_bounded():
    """A request and documentation of megabytes are read only up to their caps."""
    big = "October " * 200_000
    dates, months, _ = derivable.request_dates(big)
    assert months == {10} and dates == set()
    # only the first 4,000 characters of a description are read: at most ~1,300 options of "a, "
    assert 0 < len(derivable.documented({"description": "Options are: " + "a, " * 500_000})) <= 4000 // 3


def test_a_held_identifier_abbreviating_any_request_word_is_given():
    tools = {"cd": _tool({"folder": {"type": "string"}}), "quote": _tool({"symbol": {"type": "string"}})}
    # lower case, from an uncapitalised word; the state holds the folder
    assert _verdict("go to the temporary directory", "cd", {"folder": "tmp"}, tools,
                    world=derivable.World(values={"tmp"})) == ([], [])
    assert _verdict("go to the temporary directory", "cd", {"folder": "tmp"}, tools)[0] == ["cd.folder='tmp'"]
    # a doubled letter of a ticker read once: AAPL <- Apple
    assert _verdict("buy 100 Apple shares", "quote", {"symbol": "AAPL"}, tools,
                    world=derivable.World(values={"AAPL"})) == ([], [])
    assert _verdict("buy 100 Apple shares", "quote", {"symbol": "AAPL"}, tools) == ([], ["quote.symbol='AAPL'"])
    # a held value no request word abbreviates stays the task's
    assert _verdict("go to the documents", "cd", {"folder": "tmp"}, tools,
                    world=derivable.World(values={"tmp"}))[0] == ["cd.folder='tmp'"]


def test_a_member_of_a_collection_the_request_quantifies_over_is_given():
    tools = {"wc": _tool({"file_name": {"type": "string"}})}
    world = derivable.World(values={"temp", "dev_summary.txt"},
                            collections=[("state.root.contents.temp.contents", ["dev_summary.txt"])])
    assert _verdict("go to temp, and for each file in there, count the lines", "wc",
                    {"file_name": "dev_summary.txt"}, tools, world=world) == ([], [])
    # without the quantifier the request names no file: the task's
    assert _verdict("go to temp and count the lines", "wc", {"file_name": "dev_summary.txt"}, tools,
                    world=world)[0] == ["wc.file_name='dev_summary.txt'"]


def test_a_symbol_of_the_tools_domain_is_undecided():
    tools = {"cd": _tool({"folder": {"type": "string"}})}
    assert _verdict("remove the file and then the directory", "cd", {"folder": ".."}, tools) == \
        ([], ["cd.folder='..'"])


def test_an_earlier_result_rounded_to_the_values_decimals_is_given():
    tools = {"conv": _tool({"liter": {"type": "number"}}),
             "fill": _tool({"fuelAmount": {"type": "number", "description": "Fuel to add, in gallons."}})}
    gold = [ToolCall(name="conv", arguments={"liter": 30}), ToolCall(name="fill", arguments={"fuelAmount": 7.93})]
    request = "fill 30 liters, use 2 decimal digits of the gallon amount"
    assert derive_values(request, gold, [{"gallon": 7.92516}, {}], tools).missing == []
    # a number the result does not round to stays the task's
    gold[1] = ToolCall(name="fill", arguments={"fuelAmount": 7.8})
    assert derive_values(request, gold, [{"gallon": 7.92516}, {}], tools).missing == ["fill.fuelAmount=7.8"]


def test_documented_options_of_the_tools_name_and_of_required_arguments():
    start = _tool({"ignitionMode": {"type": "string", "description": 'The ignition mode. [Enum]: ["START", "STOP"]'}},
                  required=("ignitionMode",))
    order = {"order_type": {"type": "string", "description": "Type of the order (Buy/Sell)."}}
    # the tool's name names the option: startEngine(ignitionMode="START")
    assert _verdict("bring the engine to life", "startEngine", {"ignitionMode": "START"},
                    {"startEngine": start}) == ([], [])
    # a required argument's option the request names only by its meaning ("purchase": Buy): an LLM decides
    assert derivable.documented(order["order_type"]) == ["Buy", "Sell"]
    assert _verdict("purchase 100 shares", "place_order", {"order_type": "Buy"},
                    {"place_order": _tool(order, required=("order_type",))}) == ([], ["place_order.order_type='Buy'"])
    # an optional one the request does not ask for is the task's (its default applies otherwise)
    assert _verdict("purchase 100 shares", "place_order", {"order_type": "Buy"},
                    {"place_order": _tool(order)}) == (["place_order.order_type='Buy'"], [])


def test_the_first_or_last_day_of_a_month_and_year_is_given():
    tools = {"book": _tool({"date": {"type": "string"}})}
    assert _verdict("on the last day of October 2026", "book", {"date": "2026-10-31"}, tools) == ([], [])
    assert _verdict("the first day of February in 2027", "book", {"date": "2027-02-01"}, tools) == ([], [])
    assert _verdict("on the last day of February 2028", "book", {"date": "2028-02-29"}, tools) == ([], [])
    assert _verdict("on the last day of October 2026", "book", {"date": "2026-10-30"}, tools)[1] == \
        ["book.date='2026-10-30'"]
