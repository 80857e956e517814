"""Test server: object state in instance attributes only (shareable)."""
from dataclasses import dataclass, field

from treadle.weft.runtime.server import ToolError, WeftServer


@dataclass
class Wallet:
    balances: dict = field(default_factory=dict)
    history: list = field(default_factory=list)


server = WeftServer("wallet", backend="object", state_class=Wallet)


@server.tool(writes=("balances", "history"), returns="new balance")
def deposit(w: Wallet, who: str, amount: int) -> dict:
    """Deposit an amount."""
    if amount <= 0:
        raise ToolError("amount must be positive")
    w.balances[who] = w.balances.get(who, 0) + amount
    w.history.append([who, amount])
    return {"balance": w.balances[who]}


@server.tool(reads=("balances",))
def balance(w: Wallet, who: str) -> dict:
    """Balance of one account."""
    return {"balance": w.balances.get(who, 0)}
