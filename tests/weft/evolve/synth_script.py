"""The scripted role answers behind ``fixtures/synth_recorded.jsonl`` (a library environment whose first backend
is deliberately broken) and ``fixtures/revise_recorded.jsonl`` (the certified library serving that broken backend
again, repaired by the evolution loop's LLM reviser), the config both the recorders and the tests use, the
recorders themselves, and the builders the tests share.

Re-record after changing the synthesis or revision prompts: ``python tests/weft/evolve/synth_script.py``.
"""
import json
from pathlib import Path

DOCS = """Library desk API.
add_book(title, author): catalogue a new book, returns {book_id}.
lend_book(book_id, member): lend a book that is in; fails if it is out or unknown. Returns {book_id, status}.
return_book(book_id): take a lent book back. Returns {book_id, status}.
list_books(): every book with its status."""
REQUIREMENT = "A small library desk: members borrow and return books; a book is lent to one member at a time."
FIXTURE = Path(__file__).parent / "fixtures" / "synth_recorded.jsonl"
REVISE_FIXTURE = Path(__file__).parent / "fixtures" / "revise_recorded.jsonl"

DESIGN = {"tasks": ["lend a book to a member", "take a book back", "catalogue a new book"],
          "entities": ["book", "member", "loan"],
          "tools": [{"name": "add_book", "description": "catalogue a book", "params": {"title": "string", "author": "string"},
                     "reads": [], "writes": ["books"], "returns": "{book_id}"},
                    {"name": "lend_book", "description": "lend a book", "params": {"book_id": "integer", "member": "string"},
                     "reads": ["books"], "writes": ["books", "loans"], "returns": "{book_id, status}"},
                    {"name": "return_book", "description": "return a book", "params": {"book_id": "integer"},
                     "reads": ["books", "loans"], "writes": ["books", "loans"], "returns": "{book_id, status}"},
                    {"name": "list_books", "description": "list books", "params": {}, "reads": ["books"], "writes": [],
                     "returns": "[{id, title, status}]"}]}
SCHEMA = {"ddl": "CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT NOT NULL, author TEXT NOT NULL, "
                 "status TEXT NOT NULL CHECK (status IN ('in', 'out')));\n"
                 "CREATE TABLE loans (id INTEGER PRIMARY KEY, book_id INTEGER NOT NULL REFERENCES books(id), "
                 "member TEXT NOT NULL, returned INTEGER NOT NULL DEFAULT 0);",
          "seed": "INSERT INTO books VALUES (1, 'Emma', 'Austen', 'in'), (2, 'Ulysses', 'Joyce', 'in');"}
_COMMON = '''
def add_book(db, title, author):
    cur = db.execute("INSERT INTO books (title, author, status) VALUES (?, ?, 'in')", (title, author))
    return {"book_id": cur.lastrowid}


def _book(db, book_id):
    row = db.execute("SELECT status FROM books WHERE id = ?", (book_id,)).fetchone()
    if row is None:
        raise ValueError(f"no book {book_id}")
    return row[0]


def return_book(db, book_id):
    if _book(db, book_id) != "out":
        raise ValueError(f"book {book_id} is not lent")
    db.execute("UPDATE loans SET returned = 1 WHERE book_id = ? AND returned = 0", (book_id,))
    db.execute("UPDATE books SET status = 'in' WHERE id = ?", (book_id,))
    return {"book_id": book_id, "status": "in"}


def list_books(db):
    return [{"id": i, "title": t, "status": s} for i, t, s in db.execute("SELECT id, title, status FROM books ORDER BY id")]
'''
BROKEN = _COMMON + '''
def lend_book(db, book_id, member):
    if _book(db, book_id) != "in":
        raise ValueError(f"book {book_id} is out")
    db.execute("INSERT INTO loans (book_id, member) VALUES (?, ?)", (book_id, member))
    return {"book_id": book_id, "status": "out"}  # forgets to mark the book out
'''
FIXED = _COMMON + '''
def lend_book(db, book_id, member):
    if _book(db, book_id) != "in":
        raise ValueError(f"book {book_id} is out")
    db.execute("INSERT INTO loans (book_id, member) VALUES (?, ?)", (book_id, member))
    db.execute("UPDATE books SET status = 'out' WHERE id = ?", (book_id,))
    return {"book_id": book_id, "status": "out"}
'''
CHECKS = {"checks": [
    {"tool": "add_book", "args": {"title": "Dune", "author": "Herbert"}, "expect_returns": {"book_id": 3},
     "state": [["SELECT id, title, status FROM books WHERE id = 3", [[3, "Dune", "in"]]]]},
    {"tool": "lend_book", "args": {"book_id": 1, "member": "ann"}, "expect_returns": {"status": "out"},
     "state": [["SELECT status FROM books WHERE id = 1", [["out"]]],
               ["SELECT book_id, member, returned FROM loans", [[1, "ann", 0]]]]},
    {"tool": "lend_book", "args": {"book_id": 1, "member": "bob"}, "kind": "boundary"},
    {"tool": "lend_book", "args": {"book_id": 99, "member": "x"}, "kind": "boundary"},
    {"tool": "return_book", "args": {"book_id": 1}, "expect_returns": {"status": "in"},
     "state": [["SELECT status FROM books WHERE id = 1", [["in"]]]]},
    {"tool": "list_books", "expect_returns": [{"id": 2, "status": "in"}]}]}

# answers in the order the pipeline asks: design, schema, backend, checks (first answer malformed), revised backend
SCRIPT = [("Design the environment", json.dumps(DESIGN)), ("SQLite DDL", json.dumps(SCHEMA)),
          ("Python backend", json.dumps({"source": BROKEN})),
          ("validation calls", "Sure! Here are some checks: add a book, lend it."),
          ("validation calls", "```json\n" + json.dumps(CHECKS) + "\n```"),
          ("Python backend", json.dumps({"source": FIXED}))]


def turn(name, request, *calls, depends_on=()):
    """A library atomic task whose gold calls are ``(tool, arguments)`` pairs."""
    from treadle.weft.runtime.callparse import ToolCall
    from treadle.weft.rollouts.tasks import AtomicTask
    from treadle.weft.runtime.verify import CheckpointSpec

    return AtomicTask(name=name, request=request, depends_on=depends_on,
                      checkpoint=CheckpointSpec(name=name,
                                                gold_calls=[ToolCall(name=n, arguments=a) for n, a in calls]))


LEND = turn("lend-emma", "Lend book 1 to ann.", ("lend_book", {"book_id": 1, "member": "ann"}))
ADD = turn("add-dune", "Catalogue Dune by Herbert.", ("add_book", {"title": "Dune", "author": "Herbert"}))
LOOKUP = turn("list", "Which books are there?", ("list_books", {}))
RETURN = turn("return-emma", "Take book 1 back.", ("return_book", {"book_id": 1}), depends_on=("lend-emma",))


# the reviser's answers for the broken backend: prose (malformed), a backend that still fails validation, the fix
REVISE_SCRIPT = [("backend is blamed", "I would mark the book out in lend_book."),
                 ("backend is blamed", json.dumps({"source": BROKEN + "\n# looked at it\n"})),
                 ("backend is blamed", "```json\n" + json.dumps({"source": FIXED}) + "\n```")]


def config(roles=None):
    from treadle.llm import LLMConfig
    from treadle.weft.evolve.synth import ROLES

    return LLMConfig.single("synth-recorded", "http://127.0.0.1:9/v1", roles=roles or ROLES,
                            sampling={"temperature": 0.0, "max_tokens": 4096})


def limits():
    from treadle.sandbox import SandboxLimits

    return SandboxLimits(timeout_s=3, memory_mb=512, max_output_bytes=16 << 20)


async def library_system(rt):
    """An :class:`~treadle.weft.evolve.loop.EvolvingSystem`: the synthesised library, its tasks LEND and ADD
    certified (evidence, generated verifiers) with the fixed backend, now serving the broken one."""
    from treadle.weft.evolve.attribute import generate_verifier, record_evidence
    from treadle.weft.evolve.loop import EvolvingSystem, TaskSlot
    from treadle.weft.evolve.revise import SynthEnv
    from treadle.weft.evolve.synth_serve import server_source, synth_env

    healthy = server_source(result(), "library", limits=limits())
    env = await synth_env(rt, healthy)
    slots = []
    for task in (LEND, ADD):
        ev = await record_evidence(rt, env.server_hash, env.snapshot, task.name, task.checkpoint.gold_calls)
        slots.append(TaskSlot(env="library", task=task, start=env.snapshot, evidence=ev, certified_start=env.snapshot,
                              spec=generate_verifier(task.checkpoint, env.snapshot, ev)))
    broken = SynthEnv(result(backend=BROKEN), "library", limits())
    return EvolvingSystem(sources={"library": broken.source()}, certified={"library": healthy}, tasks=slots,
                          synth={"library": broken})


def revise_rounds(client, attempts=3, n=1):
    """``(rounds, digests before, system)``: ``n`` loop rounds on :func:`library_system` with an LLMReviser."""
    import anyio

    from treadle.weft.evolve.loop import run_round
    from treadle.weft.evolve.revise import LLMReviser
    from treadle.weft.runtime import Runtime

    async def main():
        async with Runtime(timeout_s=30) as rt, client as llm:
            system = await library_system(rt)
            first = system.digests()
            reviser = LLMReviser(llm, attempts=attempts)
            rounds = [await run_round(rt, system, i + 1, rates={}, k=1, reviser=reviser) for i in range(n)]
            return rounds, first, system
    return anyio.run(main)


def revise_config():
    from treadle.weft.evolve.revise import REVISE_ROLES

    return config(tuple(REVISE_ROLES.values()))


class ScriptedBackend:
    """Answers from SCRIPT in order; fails on an unexpected request (the strict scripted model)."""

    recorded = False

    def __init__(self, script):
        self.script = list(script)

    async def send(self, cfg, kind, payload, key):
        want, text = self.script.pop(0)
        task = json.loads(payload["messages"][1]["content"])["task"]
        assert want in task, (want, task)
        return {"id": "x", "object": "chat.completion", "model": cfg.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    async def probe(self, cfg):
        return None

    async def aclose(self):
        return None


def artefacts(backend=FIXED, checks=CHECKS, design=DESIGN, schema=SCHEMA):
    """``(Design, Schema, Backend, Checks)`` of the library, any of them replaced."""
    from treadle.weft.evolve.synth_validate import Backend, Checks, Design, Schema

    return (Design.model_validate(design), Schema.model_validate(schema), Backend(source=backend),
            Checks.model_validate(checks))


def result(backend=FIXED, schema=SCHEMA, accepted=True):
    """A :class:`SynthResult` of the library with ``backend`` and ``schema`` (``accepted`` as given, unchecked)."""
    from treadle.weft.evolve.synth import SynthResult

    d, s, b, c = artefacts(backend=backend, schema=schema)
    return SynthResult(accepted=accepted, design=d, schema=s, backend=b, checks=c)


def recorded_synthesis():
    """:func:`~treadle.weft.evolve.synth.synthesize` against the recorded answers (``FIXTURE``)."""
    import anyio

    from treadle.llm import LLMClient, RecordedBackend
    from treadle.weft.evolve.synth import synthesize

    async def main():
        async with LLMClient(config(), backend=RecordedBackend(FIXTURE)) as llm:
            return await synthesize(llm, DOCS, REQUIREMENT)
    return anyio.run(main)


def record():
    import anyio

    from treadle.llm import LLMClient
    from treadle.weft.evolve.synth import synthesize

    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.unlink(missing_ok=True)

    async def main():
        backend = ScriptedBackend(SCRIPT)
        async with LLMClient(config(), backend=backend, record_to=FIXTURE) as llm:
            res = await synthesize(llm, DOCS, REQUIREMENT)
        assert not backend.script and res.accepted, res
    anyio.run(main)


def record_revision():
    from treadle.llm import LLMClient

    REVISE_FIXTURE.unlink(missing_ok=True)
    backend = ScriptedBackend(REVISE_SCRIPT)
    [r], _, system = revise_rounds(LLMClient(revise_config(), backend=backend, record_to=REVISE_FIXTURE))
    assert not backend.script and r.revised == ["backend:library"], r


if __name__ == "__main__":
    record()
    record_revision()
