"""Test server: object state holding instances of classes defined in the server module itself."""
from treadle.weft.runtime.server import ToolError, WeftServer


class Node:
    def __init__(self, name, children=None):
        self.name = name
        self.children = children or {}

    def __eq__(self, other):
        return isinstance(other, Node) and (self.name, self.children) == (other.name, other.children)


class Tree:
    def __init__(self):
        self.root = Node("/")
        self._cursor = "/"

    def _load_scenario(self, config):
        for name in config.get("dirs", []):
            self.root.children[name] = Node(name)


server = WeftServer("tree", backend="object", state_class=Tree)


@server.tool(writes=("root",))
def mkdir(t: Tree, name: str) -> dict:
    """Create a directory under the root."""
    if name in t.root.children:
        raise ToolError(f"{name} exists")
    t.root.children[name] = Node(name)
    return {"dirs": sorted(t.root.children)}


@server.tool(reads=("root",))
def ls(t: Tree) -> list:
    """List directories."""
    return sorted(t.root.children)
