"""Test server: object state kept (badly) in class attributes, BFCL-style; must run isolated."""
from treadle.weft.runtime.server import WeftServer


class Ledger:
    entries = []   # class-level container shared by every instance of this module's class
    total = 0

    def __init__(self):
        self.owner = "nobody"

    def add(self, amount: int) -> int:
        Ledger.total += amount
        self.entries.append(amount)
        return Ledger.total


server = WeftServer("ledger", backend="object", state_class=Ledger)


@server.tool(writes=("entries", "total"), returns="running total")
def add(ledger: Ledger, amount: int) -> dict:
    """Add an amount to the ledger."""
    return {"total": ledger.add(amount), "n": len(ledger.entries)}


@server.tool(reads=("entries", "total"))
def read(ledger: Ledger) -> dict:
    """The ledger's entries and total."""
    return {"entries": list(type(ledger).entries), "total": type(ledger).total, "owner": ledger.owner}


@server.tool(writes=("owner",))
def set_owner(ledger: Ledger, owner: str) -> dict:
    """Set the owner (instance attribute)."""
    ledger.owner = owner
    return {"owner": owner}
