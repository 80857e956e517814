"""Test server: a class-level default dict aliased into instance state."""
from treadle.weft.runtime.server import WeftServer


class Phone:
    DEFAULT_VPN = {"connected": False, "server": None}

    def __init__(self):
        self.vpn = None


server = WeftServer("phone", backend="object", state_class=Phone)


@server.tool(writes=("vpn",), returns="the VPN status")
def connect_vpn(p: Phone, name: str) -> dict:
    """Connect to a VPN server."""
    if p.vpn is None:
        p.vpn = p.DEFAULT_VPN
    p.vpn["server"] = name
    return p.vpn


@server.tool(reads=("vpn",), returns="the class-level default VPN record")
def default_vpn(p: Phone) -> dict:
    """The default VPN record of the class."""
    return p.DEFAULT_VPN
