"""The two-process test harness of the coding verifier (:func:`treadle.rsi.coding.run_tests`).

The code under test and the code that judges it never share a process. Inside one :mod:`treadle.sandbox`
run (:func:`~treadle.sandbox.run_python` with ``report=True``):

- the **trusted parent** (:data:`HARNESS_MAIN`, run with ``python -I``, so no file of the work folder is
  importable) first makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no other process of the
  sandbox may open its ``/proc/<pid>/mem``, ``environ`` or ``fd/*``; ``ptrace`` and cross-process memory
  calls are refused by the sandbox's seccomp filter anyway), takes the report descriptor out of its
  environment, reads the task (prompt, tests, entry point) from ``spec.json`` and deletes that file, then
  defines the prompt's helpers and the tests' ``check`` in its own namespace. Only then does it start
  the child, with ``close_fds`` (the child holds no descriptor of the report channel) and a pipe pair;
- the **candidate's child** (:data:`CANDIDATE_MAIN`) imports the candidate's code (prompt + solution,
  never the tests) and answers one JSON line per call on its reply pipe; its own prints go to stderr and
  its standard input is ``/dev/null``;
- the parent calls ``check(candidate)`` where ``candidate`` is a proxy: each call sends the arguments as
  plain data with a fresh random request id, and waits (bounded by the run's deadline, the reply
  bounded in bytes and nesting) for the reply carrying that id. The return value is decoded into fresh
  plain objects (numbers, str, bytes, bool, None, list, tuple, dict, set, frozenset; no pickle, no
  object of the candidate's), so an answer whose ``__eq__`` is always true cannot exist on the parent's
  side. An exception the candidate raised is raised again in the parent as its nearest builtin
  exception class (a test expecting ``ValueError`` still sees one; ``StopIteration`` becomes ``RuntimeError``, so
  it cannot end a ``map`` or ``next`` loop of the tests early, as :pep:`479` does for generators);
- the verdict (one JSON line) is written by the parent on the report channel, a host file outside the
  sandbox that no other process can open; stdout and the exit status mean nothing. The child ending,
  hanging past the deadline, raising ``SystemExit``/``KeyboardInterrupt``, returning something that is
  not plain data, or answering out of protocol ends the attempt at once with a failing verdict (the
  tests cannot catch it).

Mutated arguments: after each call the child compares every list, dict and set argument with what it
received; the ones that changed are sent back and copied into the parent's objects in place (a list's
items, a dict's or set's contents; nested objects become fresh copies). Two arguments that were the same
object in the parent are two objects in the child, so aliasing between arguments is not preserved.
The prompt and the tests are the task's (like the verdict they define, trusted to the task's author):
they run in the parent; the solution is the only code of the child.
"""
from __future__ import annotations

import json

__all__ = ["CANDIDATE_MAIN", "CODEC", "HARNESS_MAIN", "parse_report"]

# Plain data over JSON, tagged so that tuples, sets, bytes, non-string keys and non-finite floats survive.
# Shared by both processes (each runs `python -I` on its own file; treadle itself is not imported inside).
CODEC = r'''
import builtins as _bi
class NotPlain(Exception):
    pass
_DEPTH = 200
def enc(o, d=0):
    t = type(o)
    if o is None or t is bool or t is str:
        return o
    if t is int:
        return o if -(1 << 53) <= o <= (1 << 53) else {"X": format(o, "x")}
    if t is float:
        return o if o == o and o not in (float("inf"), float("-inf")) else {"R": repr(o)}
    if d > _DEPTH:
        raise NotPlain("data nested deeper than %d" % _DEPTH)
    if t is list:
        return {"L": [enc(x, d + 1) for x in o]}
    if t is tuple:
        return {"T": [enc(x, d + 1) for x in o]}
    if t is set:
        return {"S": [enc(x, d + 1) for x in o]}
    if t is frozenset:
        return {"F": [enc(x, d + 1) for x in o]}
    if t is dict:
        return {"D": [[enc(k, d + 1), enc(v, d + 1)] for k, v in o.items()]}
    if t is bytes:
        return {"B": o.hex()}
    if t is complex:
        return {"C": [enc(o.real), enc(o.imag)]}
    raise NotPlain("a %s, not plain data" % t.__name__)
def dec(j, d=0):
    t = type(j)
    if j is None or t is bool or t is int or t is float or t is str:
        return j
    if t is not dict or len(j) != 1 or d > _DEPTH:
        raise NotPlain("out of protocol")
    (k, v), = j.items()
    try:
        if k in ("L", "T", "S", "F") and type(v) is list:
            items = [dec(x, d + 1) for x in v]
            return {"L": list, "T": tuple, "S": set, "F": frozenset}[k](items)
        if k == "D" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {dec(p[0], d + 1): dec(p[1], d + 1) for p in v}
        if k == "X" and type(v) is str and len(v) <= 1 << 20:
            return int(v, 16)
        if k == "R" and v in ("nan", "inf", "-inf"):
            return float(v)
        if k == "B" and type(v) is str:
            return bytes.fromhex(v)
        if k == "C" and type(v) is list and len(v) == 2 and all(type(x) in (int, float, dict) for x in v):
            return complex(dec(v[0], d + 1), dec(v[1], d + 1))
    except (TypeError, ValueError, RecursionError):
        pass
    raise NotPlain("out of protocol")
'''

# The child: the candidate's code and nothing else of the task.
CANDIDATE_MAIN = CODEC + r'''
import json, os, sys
_out = os.dup(1)                          # the reply pipe
_in = os.fdopen(os.dup(0), "rb")          # the request pipe
_null = os.open("/dev/null", os.O_RDONLY)
os.dup2(_null, 0)
os.dup2(2, 1)                             # the candidate's prints go to stderr
sys.stdout = sys.stderr
def _send(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(_out, data):]
_ns = {"__name__": "__candidate__"}
try:
    exec(compile(open("candidate.py", encoding="utf-8").read(), "candidate.py", "exec"), _ns)
    _broken = None
except BaseException as e:
    _broken = {"syntax": isinstance(e, SyntaxError), "error": ("%s: %s" % (type(e).__name__, e))[:1000]}
def _builtin_base(e):
    for c in type(e).__mro__:
        if getattr(_bi, c.__name__, None) is c:
            return c.__name__
    return "Exception"
for _line in _in:
    _req = json.loads(_line)
    _rid = _req["id"]
    if _req["op"] == "import":
        _send({"id": _rid, "broken": _broken})
        continue
    _fn = _ns.get(_req["entry"])
    if not callable(_fn):
        _send({"id": _rid, "fatal": "the solution defines no function %r" % _req["entry"]})
        continue
    _args = [dec(a) for a in _req["args"]]
    _kw = {k: dec(v) for k, v in _req["kwargs"].items()}
    try:
        _res = _fn(*_args, **_kw)
    except Exception as e:
        try:
            _msg = str(e)[:1000]
        except BaseException:
            _msg = ""
        _send({"id": _rid, "raised": _builtin_base(e), "msg": _msg})
        continue
    except BaseException as e:
        _send({"id": _rid, "fatal": "the candidate raised %s" % type(e).__name__})
        continue
    try:
        _rep = {"id": _rid, "value": enc(_res), "mutated": {}}
        for _i, _a in [*enumerate(_args), *_kw.items()]:
            if type(_a) in (list, dict, set):
                _now = enc(_a)
                _was = _req["args"][_i] if type(_i) is int else _req["kwargs"][_i]
                if _now != _was:
                    _rep["mutated"][str(_i)] = _now
    except (NotPlain, RecursionError, ValueError) as e:
        _send({"id": _rid, "fatal": "the candidate returned %s" % (e if isinstance(e, NotPlain) else "data too deep")})
        continue
    _send(_rep)
'''

# The trusted parent: the tests, the proxy and the verdict.
HARNESS_MAIN = CODEC + r'''
import ctypes, json, os, secrets, select, signal, subprocess, sys, time
_t0 = time.monotonic()
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:          # PR_SET_DUMPABLE = 0
    sys.exit("treadle harness: prctl(PR_SET_DUMPABLE) failed")
REPORT = int(os.environ.pop("TREADLE_SANDBOX_REPORT_FD"))
with open("spec.json", encoding="utf-8") as f:
    SPEC = json.load(f)
os.unlink("spec.json")
DEADLINE = _t0 + SPEC["deadline_s"]
MAX_REPLY = SPEC["max_reply_bytes"]
child = None
calls = 0
def verdict(v, detail=""):
    if child is not None:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except OSError:
            pass
    line = json.dumps({"verdict": v, "detail": str(detail)[:2000], "calls": calls}) + "\n"
    os.write(REPORT, line.encode())
    os._exit(0)
ns = {"__name__": "__tests__"}
prompt = SPEC["prompt"]
for src in (prompt, prompt + "\n    pass\n"):     # the prompt's helpers (a stub without a body needs `pass`)
    try:
        code = compile(src, "prompt.py", "exec")
    except (SyntaxError, ValueError):
        continue
    try:
        exec(code, ns)
    except Exception:
        pass
    break
try:
    exec(compile(SPEC["tests"], "tests.py", "exec"), ns)
except BaseException as e:
    verdict("error", "the tests do not run: %s: %s" % (type(e).__name__, e))
check = ns.get("check")
if not callable(check):
    verdict("error", "the tests define no check(candidate) function")
env = dict(os.environ)
try:
    child = subprocess.Popen([sys.executable, "-I", "candidate_main.py"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, close_fds=True, env=env)
except OSError as e:
    verdict("sandbox_unavailable", "the verifier needs a second process in the sandbox (a memory cgroup): %s" % e)
_rfd = child.stdout.fileno()
_buf = bytearray()
def _reply(rid):
    global _buf
    seen = 0
    while True:
        nl = _buf.find(b"\n", seen)
        if nl >= 0:
            break
        seen = len(_buf)
        if seen > MAX_REPLY:
            verdict("error", "the candidate's reply is over %d bytes" % MAX_REPLY)
        left = DEADLINE - time.monotonic()
        if left <= 0:
            verdict("timeout", "the candidate did not answer within the time limit")
        if not select.select([_rfd], [], [], left)[0]:
            continue
        chunk = os.read(_rfd, 1 << 16)
        if not chunk:
            child.wait()
            verdict("error", "the candidate's process ended (status %s)" % child.returncode)
        _buf += chunk
    line, _buf = bytes(_buf[:nl]), _buf[nl + 1:]
    try:
        rep = json.loads(line)
    except (ValueError, RecursionError):
        rep = None
    if type(rep) is not dict or rep.get("id") != rid:
        verdict("error", "the candidate's process answered out of protocol")
    return rep
def _ask(req):
    rid = secrets.token_hex(16)
    data = (json.dumps({**req, "id": rid}) + "\n").encode()
    try:
        child.stdin.write(data)
        child.stdin.flush()
    except OSError:
        verdict("error", "the candidate's process ended")
    return _reply(rid)
_first = _ask({"op": "import"})
_broken = _first.get("broken")
if _broken is not None:
    if type(_broken) is not dict:
        verdict("error", "the candidate's process answered out of protocol")
    verdict("syntax_error" if _broken.get("syntax") is True else "error", _broken.get("error"))
def _decode(j):
    try:
        return dec(j)
    except (NotPlain, RecursionError):
        verdict("error", "the candidate's process answered out of protocol")
def _restore(orig, new):
    if type(orig) is list and type(new) is list:
        orig[:] = new
    elif type(orig) in (dict, set) and type(new) is type(orig):
        orig.clear()
        orig.update(new)
    else:
        verdict("error", "the candidate's process answered out of protocol")
def candidate(*args, **kwargs):
    global calls
    try:
        req = {"op": "call", "entry": SPEC["entry"], "args": [enc(a) for a in args],
               "kwargs": {k: enc(v) for k, v in kwargs.items()}}
    except (NotPlain, RecursionError) as e:
        verdict("error", "the tests pass the candidate an argument the verifier cannot send: %s" % e)
    rep = _ask(req)
    if "fatal" in rep:
        verdict("error", rep["fatal"])
    calls += 1
    if "raised" in rep:
        cls = getattr(_bi, str(rep["raised"]), None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)) or issubclass(cls, (StopIteration,
                                                                                          StopAsyncIteration)):
            cls = RuntimeError          # a StopIteration would end the tests' map()/next() loop early, silently
        try:
            exc = cls(str(rep.get("msg", "")))
        except Exception:
            exc = RuntimeError("%s: %s" % (rep["raised"], rep.get("msg", "")))
        raise exc
    if "value" not in rep or type(rep.get("mutated")) is not dict:
        verdict("error", "the candidate's process answered out of protocol")
    for key, new in rep["mutated"].items():
        if key.isdigit() and int(key) < len(args):
            _restore(args[int(key)], _decode(new))
        elif key in kwargs:
            _restore(kwargs[key], _decode(new))
        else:
            verdict("error", "the candidate's process answered out of protocol")
    return _decode(rep["value"])
ns[SPEC["entry"]] = candidate
try:
    check(candidate)
except AssertionError as e:
    verdict("failed", ("AssertionError: %s" % e).rstrip(": "))
except BaseException as e:
    verdict("error", "%s: %s" % (type(e).__name__, e))
if calls < 1:
    verdict("error", "check() never called the candidate")
verdict("passed")
'''


def parse_report(text: str) -> dict | None:
    """The harness's verdict from its report channel: the first line, a JSON object with a known
    ``verdict``; ``None`` when there is none (the parent died or was killed before it wrote one)."""
    line = text.split("\n", 1)[0]
    try:
        rep = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    ok = {"passed", "failed", "error", "timeout", "syntax_error", "sandbox_unavailable"}
    if not isinstance(rep, dict) or rep.get("verdict") not in ok:
        return None
    return rep
