"""Test server: a thermostat whose tools state units, a read-only claim and a conversion in their documentation
(the documentation/behaviour judge's tests patch the documentation or the code to disagree)."""
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from treadle.weft.runtime.server import WeftServer


@dataclass
class Thermo:
    thermostat: float = 18.0
    rooms: dict = field(default_factory=lambda: {"kitchen": 20.0, "hall": 16.5})
    reads: int = 0


server = WeftServer("thermo", backend="object", state_class=Thermo)


@server.tool(writes=("thermostat",), returns="{thermostat}")
def set_thermostat(t: Thermo, temperature: Annotated[float, Field(
        description="target temperature in degrees Celsius")]) -> dict:
    """Set the thermostat's target temperature."""
    t.thermostat = temperature
    return {"thermostat": t.thermostat}


@server.tool(reads=("rooms",), returns="{celsius}")
def read_temperature(t: Thermo, room: str) -> dict:
    """Read a room's temperature in degrees Celsius; read-only, it does not change anything."""
    return {"celsius": t.rooms[room]}


@server.tool(returns="{fahrenheit}")
def to_fahrenheit(t: Thermo, celsius: float) -> dict:
    """Convert degrees Celsius to degrees Fahrenheit (F = C * 1.8 + 32)."""
    return {"fahrenheit": celsius * 1.8 + 32}
