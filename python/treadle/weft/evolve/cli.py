"""``treadle weft reverify | synth | evolve | filter | judge``: the WEFT evolution commands (see each command's help).

Bad input is one line naming the flag, exit code 2, before any work (reverify only reads its run folder).
Every command that writes results follows the run-folder rule (:mod:`treadle.run_dirs`): its ``--out`` holds a
``run.json`` (version, commit, command line, machine, times, status, and the config: the SHA-256 of each input file
plus the options); a finished run of the same config is shown again without recomputing, another config is refused
(one line naming --out, the differences listed, exit 2, nothing touched), ``--overwrite`` replaces it.

``reverify`` writes ``reverify-<version>.jsonl`` (one :class:`~treadle.weft.evolve.reverify.Rescore` per trajectory)
into ``--out`` (default: ``<run>/reverify-<version>/``) and prints old vs new rewards. ``judge`` writes
``judge-scores.jsonl``, ``filter.jsonl`` and the LLM cache and ledger into ``--out`` (default: ``<run>/judge/``);
``filter`` writes ``filter.jsonl`` into ``--out`` when given (a folder; without it only the table is printed).
``synth`` writes the synthesised artefacts (and, when accepted, ``server.py``: the tool layer the runtime serves, see
:mod:`~treadle.weft.evolve.synth_serve`) and ``evolve`` the rounds (JSONL) and a PNG into ``--out``.
"""
from __future__ import annotations

from pathlib import Path

import typer

from typer import _click as click  # typer vendors click

from treadle.cli_output import make_console
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, recorded, usage_error, usage_exit

console = make_console()


def _fail(flag: str, msg: str) -> None:
    usage_exit(f"{flag}: {msg}")  # one line on stderr, exit 2, as every command


def _open(out: Path, command: str, config: dict, overwrite: bool):
    """``--out`` under the run-folder rule (run.json; same config resumed or shown, another refused,
    ``--overwrite`` replaces); a refusal is one line, exit 2, nothing written."""
    try:
        return open_run(out, command=command, config=config, overwrite=overwrite)
    except click.exceptions.UsageError as err:
        usage_exit(err.message)


def _shown(run, what: str) -> bool:
    """A finished run of the same config: say where its results are (nothing is redone) and return True."""
    if not run.finished:
        return False
    console.print(f"{run.path} already holds this finished {what} (same settings; finished "
                  f"{run.previous.get('ended')}); results unchanged. Add --overwrite to run it again.", markup=False)
    return True


def _sha256(path: Path) -> str:
    """SHA-256 hex of a file's bytes (an input the run's results depend on; recorded in its run.json config)."""
    from treadle.run_dirs import file_sha256

    return file_sha256(path)


def _stored(out: Path, name: str, model) -> list:
    """The records of ``out/name`` (a finished run's results, shown again); exits 2 naming --out when the file is
    missing or unreadable (then only --overwrite redoes the run)."""
    from pydantic import ValidationError

    try:
        lines = (out / name).read_text(encoding="utf-8").splitlines()
        return [model.model_validate_json(x) for x in lines if x.strip()]
    except (OSError, UnicodeDecodeError, ValidationError) as err:
        _fail("--out", f"{str(out)!r} holds a finished run whose {name} is missing or unreadable "
                       f"({str(err).splitlines()[0]}); add --overwrite to run it again")


def reverify_cmd(run: Path = typer.Option(..., "--run", help="A `treadle weft sample` run folder."),
                 revision: Path = typer.Option(..., "--revision", help="Verifier revision JSON: "
                                               "{version, checkpoints: {name: {field: value}}}."),
                 out: Path = typer.Option(None, "--out", show_default=False,
                                          help="Run folder for reverify-<version>.jsonl and run.json (default: "
                                               "<--run>/reverify-<version>/; the config is the SHA-256 of the "
                                               "trajectories and the revision file)." + OUT_HELP_SUFFIX),
                 overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out "
                                                                           "(deleting it).")) -> None:
    """Re-score stored rollouts with a revised verifier: recorded calls are replayed, no policy is called."""
    import re

    import anyio

    from treadle.weft.evolve.reverify import Rescore, load_revision, reverify
    from treadle.weft.rollouts.batch import ENVS, TRAJECTORIES, read_trajectories
    from treadle.weft.rollouts.tasks import from_shop

    path = Path(run) / TRAJECTORIES
    if not path.is_file():
        _fail("--run", f"{str(run)!r} holds no {TRAJECTORIES} (expected a `treadle weft sample` run folder)")
    trajs = read_trajectories(path)
    if not trajs:
        _fail("--run", f"{str(path)!r} holds no readable trajectory")
    tasks = from_shop()
    try:
        rev = load_revision(revision, [a.name for t in tasks for a in t.atomic])
    except ValueError as err:
        _fail("--revision", str(err))
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", rev.version)  # a folder and file name, whatever the version says
    dest = Path(out) if out is not None else Path(run) / f"reverify-{tag}"
    target = dest / f"reverify-{tag}.jsonl"
    runf = _open(dest, "weft reverify", {"trajectories_sha256": _sha256(path), "revision_sha256": _sha256(revision),
                                         "verifier_version": rev.version}, overwrite)
    if _shown(runf, "re-scoring run"):
        _print_rescores(_stored(dest, target.name, Rescore), rev.version, target)
        return
    with recorded(runf, console, saved=lambda: "nothing (the re-scores are written at the end)"):
        rows = anyio.run(lambda: reverify(trajs, tasks, rev, ENVS))
        tmp = target.with_suffix(".tmp")
        tmp.write_text("".join(r.model_dump_json() + "\n" for r in rows), encoding="utf-8")
        tmp.replace(target)
        _print_rescores(rows, rev.version, target)


def _print_rescores(rows, version: str, target: Path) -> None:
    """``weft reverify``'s table (old vs new rewards per trajectory) and the changed count."""
    from rich.table import Table

    t = Table(title=f"re-scored with verifier {version} ({len(rows)} trajectories, no new rollouts)")
    for col in ("task", "old r_k", "new r_k", "old R", "new R"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.task, "".join(map(str, r.old_rewards)), "".join(map(str, r.new_rewards)), f"{r.old_reward:.2f}",
                  f"{r.new_reward:.2f}", style="bold" if r.changed else None)
    console.print(t)
    console.print(f"{sum(r.changed for r in rows)} trajectories changed; written to {target}", markup=False)


def synth_cmd(docs: Path = typer.Option(..., "--docs", help="Tool documentation: plain text, or OpenAPI (.json)."),
              requirement: str = typer.Option(..., "--requirement", help="The business requirement, in words."),
              llm_config: Path = typer.Option(None, "--llm-config", help="treadle.llm config with the roles designer, "
                                              "schema, backend and checker (an OpenAI-compatible endpoint)."),
              out: Path = typer.Option(Path("runs/weft-synth"), "--out", help="Run folder for the artefacts."
                                       + OUT_HELP_SUFFIX),
              max_rounds: int = typer.Option(3, "--max-rounds", min=1, help="Validation / revision rounds."),
              overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out "
                                                                        "(deleting it).")) -> None:
    """Synthesise an environment (design, schema, backend, checks) with LLM roles, validated in the sandbox."""
    import json

    import anyio

    from treadle.weft.evolve.synth import ROLES, synthesize

    try:
        text = Path(docs).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        _fail("--docs", f"cannot read {str(docs)!r}: {err}")
    if Path(docs).suffix.lower() == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            _fail("--docs", f"{str(docs)!r} is not valid JSON (OpenAPI documents are JSON): {err}")
    if not text.strip():
        _fail("--docs", f"{str(docs)!r} is empty")
    if not requirement.strip():
        _fail("--requirement", "empty; say what the environment is for")
    if llm_config is None:
        _fail("--llm-config", "treadle weft synth needs an OpenAI-compatible endpoint for its roles "
                              f"{', '.join(ROLES)}; none is configured (give a treadle.llm config file)")
    from treadle.llm import ConfigError, LLMClient, LLMConfig

    try:
        cfg = LLMConfig.load(llm_config)
    except ConfigError as err:
        _fail("--llm-config", str(err))
    missing = [r for r in ROLES if r not in cfg.roles]
    if missing:
        _fail("--llm-config", f"no role(s) {missing} in {str(llm_config)!r}; expected {list(ROLES)}")
    import hashlib

    run = _open(out, "weft synth", {"docs": str(docs), "docs_sha256": hashlib.sha256(text.encode()).hexdigest(),
                                    "requirement": requirement, "llm_config": str(llm_config),
                                    "max_rounds": max_rounds}, overwrite)
    if _shown(run, "synthesis"):
        return

    async def main():
        async with LLMClient(cfg, cache=out / "llm_cache.sqlite", ledger=out / "llm_ledger.jsonl") as llm:
            return await synthesize(llm, text, requirement, max_rounds=max_rounds)

    with recorded(run, console, saved=lambda: "the LLM answers (llm_cache.sqlite: a rerun does not pay again)"):
        _synth_run(out, anyio.run(main))


def _synth_run(out: Path, res) -> None:
    """``weft synth``'s artefacts and report; exits 0 (accepted) or 1."""
    (out / "result.json").write_text(res.model_dump_json(indent=1, by_alias=True), encoding="utf-8")
    if res.backend is not None:
        (out / "backend.py").write_text(res.backend.source, encoding="utf-8")
    if res.schema_ is not None:
        (out / "schema.sql").write_text(res.schema_.ddl + "\n" + res.schema_.seed + "\n", encoding="utf-8")
    for r in res.rounds:
        console.print(f"round {r.round}: {len(r.failures)} failure(s)"
                      + (f"; revised {r.revised.value}" if r.revised else ""), markup=False)
        for f in r.failures:
            console.print(f"  [{f.stage.value}] {f.detail}", markup=False)
    for f in res.role_failures:
        console.print(f"role answer rejected [{f.stage.value}]: {f.detail}", markup=False)
    if res.accepted:  # the tool layer, servable by the runtime (generated code stays in the sandbox)
        import re

        from treadle.weft.evolve.synth_serve import SynthServeError, server_source

        try:
            (out / "server.py").write_text(server_source(res, re.sub(r"[^A-Za-z0-9_-]", "-", out.name) or "synth"),
                                           encoding="utf-8")
        except SynthServeError as err:
            console.print(f"accepted, but not servable: {err}; artefacts in {out}", markup=False)
            raise typer.Exit(1) from None
        console.print(f"served module: {out / 'server.py'} (treadle.weft.evolve.synth_serve.synth_env registers it)",
                      markup=False)
    console.print(("accepted" if res.accepted else "not accepted") + f"; artefacts in {out}", markup=False)
    raise typer.Exit(0 if res.accepted else 1)


def evolve_cmd(out: Path = typer.Option(Path("runs/weft-evolve"), "--out", help="Run folder for rounds.jsonl, "
                                        "attributions.jsonl and error_rate.png." + OUT_HELP_SUFFIX),
               rate: list[str] = typer.Option(["wrong_argument=0.15"], "--rate",
                                              help="Replay-policy perturbation NAME=RATE (repeatable)."),
               k: int = typer.Option(2, "--k", min=1, help="Attempts per task and round (the first pass is selected)."),
               max_rounds: int = typer.Option(5, "--max-rounds", min=1, help="Rounds at most."),
               seed: int = typer.Option(0, "--seed"),
               llm_config: Path = typer.Option(None, "--llm-config", help="treadle.llm config with the roles grounder "
                                               "and verifier: blamed task states and verifiers are then revised by "
                                               "the LLM and validated (default: offline revisions); an optional role "
                                               "composer gets what the certified composed task cannot decide, and an "
                                               "optional role doc_judge compares tool documentation with behaviour "
                                               "(its claims accepted only when execution confirms them)."),
               revise_attempts: int = typer.Option(2, "--revise-attempts", min=1,
                                                   help="LLM answers per blamed component and round."),
               synth: Path = typer.Option(None, "--synth", help="A `treadle weft synth` --out folder: evolve that "
                                          "synthesised environment (its result.json is what --tasks are certified "
                                          "on) instead of the drill; with --llm-config its blamed backend goes to "
                                          "the role backend and is validated in the sandbox."),
               tasks_file: Path = typer.Option(None, "--tasks", help="With --synth: atomic tasks, JSON Lines "
                                               '{"name", "request", "gold": [{"name", "arguments"}]}.'),
               backend_file: Path = typer.Option(None, "--backend", help="With --synth: the backend source served "
                                                 "now (default: the synthesised one), e.g. one edited since."),
               overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out "
                                                                         "(deleting it)."),
               drill: bool = typer.Option(False, "--drill", help="Instead of rounds: attribution accuracy per "
                                          "component and the cross-blames (non-policy faults blamed on the policy, "
                                          "policy errors blamed elsewhere) on the two held-apart fault sets, on the "
                                          "fault catalogue and on the BFCL catalogue (when bfcl-eval is installed), "
                                          "reported apart; writes attribution_drill.json.")
               ) -> None:
    """Attribution and revision rounds on the offline drill (certified shop and CRM with one injected fault of
    each kind), or on a synthesised environment (``--synth``), until the tool-call error rate of the selected
    trajectories stops falling. The drill's native backends are trusted code: a blamed one is restored to its
    certified source, never rewritten by an LLM; a synthesised backend is revised by the ``backend`` role."""
    from treadle.weft.rollouts.policies import PERTURBATIONS

    if drill:
        for flag, given in (("--synth", synth), ("--tasks", tasks_file), ("--backend", backend_file),
                            ("--llm-config", llm_config)):
            if given is not None:
                _fail(flag, "not with --drill (the drill's fault sets are built in and attributed offline)")
        run = _open(out, "weft evolve --drill", {"drill": True}, overwrite)
        if _shown(run, "attribution drill"):
            return
        with recorded(run, console, saved=lambda: "nothing (the drill is written at the end)"):
            _drill_run(out)
        return
    rates: dict[str, float] = {}
    for item in rate:
        name, _, value = item.partition("=")
        try:
            rates[name.strip()] = float(value)
        except ValueError:
            _fail("--rate", f"{item!r} is not NAME=RATE (e.g. wrong_argument=0.2)")
        if name.strip() not in PERTURBATIONS:
            _fail("--rate", f"unknown perturbation {name.strip()!r}; expected one of {list(PERTURBATIONS)}")
    if any(not 0 <= v <= 1 for v in rates.values()) or sum(rates.values()) > 1:
        _fail("--rate", f"rates must be in [0, 1] and sum to <= 1, got {rates}")
    for flag, given in (("--tasks", tasks_file), ("--backend", backend_file)):
        if given is not None and synth is None:
            _fail(flag, "only with --synth (the drill's tasks and backends are built in)")
    synth_env = None
    if synth is not None:
        synth_env = _synth_input(synth, tasks_file, backend_file)
    cfg = None
    if llm_config is not None:
        from treadle.llm import ConfigError, LLMConfig

        try:
            cfg = LLMConfig.load(llm_config)
        except ConfigError as err:
            _fail("--llm-config", str(err).splitlines()[0] if str(err) else "not a treadle.llm config")
        from treadle.weft.evolve.revise import REVISE_ROLES

        kinds = ("backend", "task", "verifier") if synth is not None else ("task", "verifier")
        need = [REVISE_ROLES[k] for k in kinds]
        missing = [r for r in need if r not in cfg.roles]
        if missing:
            _fail("--llm-config", f"no role(s) {missing} in {str(llm_config)!r}; expected {' and '.join(need)}"
                  + (" (with --synth the blamed backend goes to the role backend)" if synth is not None else ""))
    if revise_attempts != 2 and cfg is None:  # the offline revisions make one answer each
        _fail("--revise-attempts", "only with --llm-config (LLM answers per blamed component)")
    import hashlib

    def digest(path):
        try:
            return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path is not None else None
        except OSError:
            return None

    run = _open(out, "weft evolve", {"rates": rates, "k": k, "max_rounds": max_rounds, "seed": seed,
                                     "llm_config": str(llm_config) if llm_config else None,
                                     "revise_attempts": revise_attempts if cfg is not None else None,
                                     "synth": str(synth) if synth else None,
                                     "synth_result": digest(Path(synth) / "result.json") if synth else None,
                                     "tasks": digest(tasks_file), "backend": digest(backend_file)}, overwrite)
    if _shown(run, "evolution"):
        return
    fresh = not out.exists()
    try:
        with recorded(run, console, saved=lambda: "nothing but the LLM answers (rounds are written at the end)"):
            _evolve_run(out, rates, k, max_rounds, seed, cfg, revise_attempts, synth_env)
    except click.exceptions.UsageError as err:  # found once it started (a task that does not certify): one line
        _drop_if_empty(out, fresh)
        usage_exit(err.message)


def _drop_if_empty(out: Path, fresh: bool) -> None:
    """Remove ``out`` when this command created it and wrote nothing but ``run.json`` (a refused start leaves no
    folder behind); a folder that existed keeps its record of the refusal."""
    import shutil

    from treadle.run_dirs import RUN_RECORD

    if fresh and out.is_dir() and all(p.name == RUN_RECORD for p in out.iterdir()):
        shutil.rmtree(out, ignore_errors=True)


def _evolve_run(out: Path, rates: dict, k: int, max_rounds: int, seed: int, cfg, revise_attempts: int,
                synth_env) -> None:
    """``weft evolve``'s rounds, artefacts and report (in its started run folder)."""
    import json
    import logging

    import anyio

    from treadle.weft.evolve.drill import drill_system
    from treadle.weft.evolve.loop import evolve, plot_rounds
    from treadle.weft.runtime import Runtime

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)  # the drill's crashing tool is expected

    async def build(rt):
        if synth_env is None:
            return await drill_system(rt)
        from treadle.weft.evolve.synth_system import synth_system

        result, name, tasks, backend = synth_env
        try:
            return await synth_system(rt, result, name, tasks, backend_source=backend)
        except ValueError as err:  # a task that does not certify: said after the runtime closed, nothing written
            holder["error"] = str(err)
            return None

    holder = {}

    async def main():
        from treadle.sandbox import SandboxUnavailableError

        try:
            return await rounds_of()
        except SandboxUnavailableError as err:  # generated code runs only in the sandbox: said after, nothing written
            holder["sandbox"] = str(err)
            return []

    async def rounds_of():
        async with Runtime() as rt:
            system = holder["system"] = await build(rt)
            if system is None:
                return []
            if cfg is None:
                return await evolve(rt, system, rates=rates, max_rounds=max_rounds, k=k, seed=seed)
            from treadle.llm import LLMClient
            from treadle.weft.evolve.revise import LLMReviser

            out.mkdir(parents=True, exist_ok=True)
            async with LLMClient(cfg, cache=out / "llm_cache.sqlite", ledger=out / "llm_ledger.jsonl") as llm:
                return await evolve(rt, system, rates=rates, max_rounds=max_rounds, k=k, seed=seed,
                                    reviser=LLMReviser(llm, attempts=revise_attempts))

    rounds = anyio.run(main)
    if "sandbox" in holder:
        raise usage_error(f"--synth: the synthesised backend runs only in the sandbox, unavailable here: "
                          f"{holder['sandbox']}")
    if "error" in holder:
        raise usage_error(f"--tasks: {holder['error']}")
    (out / "rounds.jsonl").write_text("".join(r.model_dump_json(exclude={"attributions"}) + "\n" for r in rounds),
                                      encoding="utf-8")
    (out / "attributions.jsonl").write_text("".join(json.dumps({"round": r.round, **a.model_dump(mode="json")}) + "\n"
                                                    for r in rounds for a in r.attributions), encoding="utf-8")
    plot_rounds(rounds, out / "error_rate.png")
    from rich.table import Table

    t = Table(title="evolution rounds (" + ("offline drill" if synth_env is None else
                                            f"synthesised environment {synth_env[1]}") + ")")
    for col in ("round", "tool-call error rate", "passed", "attributed", "revised"):
        t.add_column(col)
    for r in rounds:
        t.add_row(str(r.round), f"{r.error_rate:.3f}", f"{r.passed}/{r.tasks}",
                  ", ".join(f"{a.checkpoint}:{a.blame.value}" for a in r.attributions) or "-",
                  ", ".join(r.revised) or "-")
    console.print(t)
    for r in rounds:
        for a in r.revisions:
            console.print(f"round {r.round}: {a.component} ({a.role}, answer {a.attempt + 1}): "
                          + ("accepted" if a.accepted else f"rejected: {a.detail}"), markup=False)
        for name, why in r.quarantined.items():
            console.print(f"round {r.round}: harness {name} quarantined: {why}", markup=False)
        for x in r.harness_reruns:
            console.print(f"round {r.round}: {x.checkpoint} re-run under the healthy harness {x.harness}: "
                          + ("passes (not counted against the policy)" if x.r else
                             f"fails ({x.attribution.blame.value if x.attribution else '?'})"), markup=False)
    if synth_env is not None:  # the artefacts as served after the rounds (revised or not), like `weft synth` writes
        env = holder["system"].synth[synth_env[1]]
        (out / "result.json").write_text(env.result.model_dump_json(indent=1, by_alias=True), encoding="utf-8")
        (out / "backend.py").write_text(env.result.backend.source, encoding="utf-8")
        (out / "server.py").write_text(holder["system"].sources[synth_env[1]], encoding="utf-8")
        changed = env.result.backend.source != synth_env[3] if synth_env[3] is not None else \
            env.result.backend.source != synth_env[0].backend.source
        console.print(("backend revised" if changed else "backend unchanged") + f": {out / 'backend.py'}",
                      markup=False)
    console.print(f"written to {out}", markup=False)


def _drill_run(out: Path) -> None:
    """``weft evolve --drill``: the attribution drill's tables (held-apart, fresh held-apart, catalogue,
    BFCL) and ``attribution_drill.json``."""
    import json
    import logging

    import anyio
    from rich.table import Table

    from treadle.weft.evolve.drill_report import COLUMNS, attribution_drill, rows
    from treadle.weft.runtime import Runtime

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)  # injected crashes are expected

    async def main():
        async with Runtime() as rt:
            return await attribution_drill(rt)

    res = anyio.run(main)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attribution_drill.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    for key, title in (("held_apart", "held-apart fault set"), ("fresh", "fresh held-apart fault set"),
                       ("catalogue", "fault catalogue"),
                       ("bfcl", "BFCL fault catalogue")):
        s = res.get(key)
        if s is None:
            continue
        t = Table(title=f"attribution on the {title}" + ("" if "skipped" in s else
                                                         f" ({s['observed']} observed of {s['cases']} faults)"))
        for col in COLUMNS:
            t.add_column(col)
        for row in rows(s):
            t.add_row(*row)
        console.print(t)
        if "skipped" in s:
            continue
        console.print(f"{title}: non-policy faults blamed on the policy: {len(s['blamed_on_policy'])} "
                      f"{s['blamed_on_policy'][:5]}; policy errors blamed elsewhere: "
                      f"{len(s['policy_blamed_elsewhere'])} {s['policy_blamed_elsewhere'][:5]}; undecided "
                      f"(offline): {len(s['undecided'])} {s['undecided'][:5]}", markup=False)
    console.print(f"written to {out / 'attribution_drill.json'}", markup=False)


def _synth_input(synth: Path, tasks_file: Path | None, backend_file: Path | None):
    """``(artefacts, server name, tasks, served backend or None)`` of ``evolve --synth``; exits 2 on bad input."""
    import re

    from treadle.weft.evolve.synth_system import load_synth_dir, load_tasks

    try:
        result = load_synth_dir(synth)
    except ValueError as err:
        _fail("--synth", str(err))
    if tasks_file is None:
        _fail("--tasks", "required with --synth (the atomic tasks to certify on the synthesised environment)")
    try:
        tasks = load_tasks(tasks_file, [t.name for t in result.design.tools])
    except ValueError as err:
        _fail("--tasks", str(err))
    backend = None
    if backend_file is not None:
        try:
            backend = Path(backend_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            _fail("--backend", f"cannot read {str(backend_file)!r}: {err}")
        if not backend.strip():
            _fail("--backend", f"{str(backend_file)!r} is empty")
    name = re.sub(r"[^A-Za-z0-9_-]", "-", Path(synth).resolve().name) or "synth"
    return result, name, tasks, backend


def filter_cmd(scores: Path = typer.Option(..., "--scores", help="JSONL, one pilot rollout per line: "
                                           '{"task": ..., "judge": 0..1, "executable": 0..1}.'),
               min_pearson: float = typer.Option(0.5, "--min-pearson", min=-1, max=1),
               min_spearman: float = typer.Option(0.5, "--min-spearman", min=-1, max=1),
               min_rollouts: int = typer.Option(8, "--min-rollouts", min=3),
               confidence: float = typer.Option(0.95, "--confidence", min=0.5, max=0.999),
               out: Path = typer.Option(None, "--out", show_default=False,
                                        help="Run folder for the decisions (filter.jsonl) and run.json (default: "
                                             "none, the table is only printed). A path ending in .jsonl (the "
                                             "old one-file form) is refused: give a folder. The config is the "
                                             "SHA-256 of --scores and the thresholds." + OUT_HELP_SUFFIX),
               overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out "
                                                                         "(deleting it).")) -> None:
    """RL task filtering: keep tasks whose judge and executable scores agree (Pearson and Spearman, with CIs)."""
    import json

    from treadle.weft.evolve.filtering import FilterConfig, FilterDecision, filter_tasks

    if out is not None and Path(out).suffix.lower() == ".jsonl" and not Path(out).is_dir():
        _fail("--out", f"{str(out)!r} names a file; --out is a run folder (filter.jsonl and run.json go inside): "
                       f"give a folder, e.g. --out {str(Path(out).with_suffix(''))!r}")
    if overwrite and out is None:
        _fail("--overwrite", "only with --out (without it nothing is written)")
    try:
        lines = Path(scores).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        _fail("--scores", f"cannot read {str(scores)!r}: {err}")
    per: dict[str, tuple[list, list]] = {}
    bad: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            task = str(row["task"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            _fail("--scores", f"line {n} is not a JSON object with a 'task' ({err})")
        j, e = per.setdefault(task, ([], []))
        if "judge" not in row or "executable" not in row:
            bad.setdefault(task, f"line {n} has no 'judge' or 'executable' score")
        j.append(row.get("judge"))
        e.append(row.get("executable"))
    if not per:
        _fail("--scores", f"{str(scores)!r} holds no pilot rollouts")
    cfg = FilterConfig(min_pearson=min_pearson, min_spearman=min_spearman, min_rollouts=min_rollouts,
                       confidence=confidence)
    if out is None:  # nothing written: no run folder
        _print_decisions(filter_tasks({t: (("missing",) if t in bad else j, e) for t, (j, e) in per.items()}, cfg),
                         cfg, bad)
        return
    run = _open(Path(out), "weft filter", {"scores_sha256": _sha256(scores), "min_pearson": min_pearson,
                                           "min_spearman": min_spearman, "min_rollouts": min_rollouts,
                                           "confidence": confidence}, overwrite)
    if _shown(run, "filter run"):
        _print_decisions(_stored(Path(out), "filter.jsonl", FilterDecision), cfg, bad)
        return
    with recorded(run, console, saved=lambda: "nothing (the decisions are written at the end)"):
        decisions = filter_tasks({t: (("missing",) if t in bad else j, e) for t, (j, e) in per.items()}, cfg)
        (Path(out) / "filter.jsonl").write_text("".join(d.model_dump_json() + "\n" for d in decisions),
                                                encoding="utf-8")
        _print_decisions(decisions, cfg, bad)
        console.print(f"written to {Path(out) / 'filter.jsonl'}", markup=False)


def _print_decisions(decisions, cfg, bad: dict[str, str]) -> None:
    """The filter's table (kept / dropped with reasons and CIs) and the kept count."""
    from rich.table import Table

    def ci(x):
        return f"[{x[0]:.2f}, {x[1]:.2f}]" if x else "-"

    t = Table(title=f"RL task filter (pearson >= {cfg.min_pearson}, spearman >= {cfg.min_spearman}, "
                    f"n >= {cfg.min_rollouts}; {cfg.confidence:.0%} CIs)")
    for col in ("task", "n", "pearson", "CI", "spearman", "CI", "kept", "reasons"):
        t.add_column(col)
    for d in decisions:
        reasons = "; ".join(d.reasons) + (" -> evaluator attribution" if d.to_attribution else "")
        if d.task in bad:
            reasons = f"malformed scores: {bad[d.task]}"
        t.add_row(d.task, str(d.n), "-" if d.pearson is None else f"{d.pearson:.2f}", ci(d.pearson_ci),
                  "-" if d.spearman is None else f"{d.spearman:.2f}", ci(d.spearman_ci), "yes" if d.kept else "no",
                  reasons)
    console.print(t)
    console.print(f"kept {sum(d.kept for d in decisions)} of {len(decisions)} tasks", markup=False)


def judge_cmd(run: Path = typer.Option(..., "--run", help="A `treadle weft sample` run folder: its rollouts' "
                                       "attempts are the pilot rollouts."),
              llm_config: Path = typer.Option(None, "--llm-config", help="treadle.llm config with the judge role "
                                              "(an OpenAI-compatible endpoint)."),
              role: str = typer.Option("judge", "--role", help="The config's role that grades."),
              min_pearson: float = typer.Option(0.5, "--min-pearson", min=-1, max=1),
              min_spearman: float = typer.Option(0.5, "--min-spearman", min=-1, max=1),
              min_rollouts: int = typer.Option(8, "--min-rollouts", min=3),
              confidence: float = typer.Option(0.95, "--confidence", min=0.5, max=0.999),
              out: Path = typer.Option(None, "--out", show_default=False,
                                       help="Run folder for judge-scores.jsonl, filter.jsonl, the LLM cache and "
                                            "ledger and run.json (default: <--run>/judge/; the config is the SHA-256 "
                                            "of the trajectories and the LLM config, --role and the thresholds)."
                                            + OUT_HELP_SUFFIX + " When only the thresholds changed, --overwrite "
                                            "keeps the LLM cache: the judge is not called again."),
              overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out "
                                                                        "(deleting it).")) -> None:
    """RL task filtering with the rubric-guided LLM judge: grade every pilot rollout of a run against its task's
    rubric (never shown the executable verdict), then keep the tasks whose judge and executable scores agree."""
    import json

    import anyio

    from treadle.weft.evolve.filtering import FilterConfig, FilterDecision, filter_tasks
    from treadle.weft.evolve.judge import atomic_tasks_of, pilot_scores, pilots_of, rubric_of
    from treadle.weft.rollouts.batch import TRAJECTORIES, read_trajectories

    path = Path(run) / TRAJECTORIES
    if not path.is_file():
        _fail("--run", f"{str(run)!r} holds no {TRAJECTORIES} (expected a `treadle weft sample` run folder)")
    trajs = read_trajectories(path)
    pilots = pilots_of(trajs)
    if not pilots:
        _fail("--run", f"{str(path)!r} holds no pilot rollout (no trajectory attempt without an endpoint failure)")
    if llm_config is None:
        _fail("--llm-config", f"treadle weft judge needs an OpenAI-compatible endpoint for its role {role!r}; none is "
                              "configured (give a treadle.llm config file; `treadle weft filter --scores` filters "
                              "given scores offline)")
    from treadle.llm import ConfigError, LLMClient, LLMConfig

    try:
        cfg = LLMConfig.load(llm_config)
    except ConfigError as err:
        _fail("--llm-config", str(err))
    if role not in cfg.roles:
        _fail("--role", f"no role {role!r} in {str(llm_config)!r}; its roles are {sorted(cfg.roles)}")
    try:
        tasks = atomic_tasks_of(trajs)
    except (ValueError, ModuleNotFoundError) as err:
        _fail("--run", f"cannot rebuild the run's tasks: {err}")
    no_rubric = sorted({p.task for p in pilots} - set(tasks))
    pilots = [p for p in pilots if p.task in tasks]
    if not pilots:
        _fail("--run", f"no task of this run is known here (rubrics come from the shop and BFCL tasks): {no_rubric}")
    fcfg = FilterConfig(min_pearson=min_pearson, min_spearman=min_spearman, min_rollouts=min_rollouts,
                        confidence=confidence)
    dest = Path(out) if out is not None else Path(run) / "judge"
    config = {"trajectories_sha256": _sha256(path), "llm_config_sha256": _sha256(llm_config), "role": role,
              "min_pearson": min_pearson, "min_spearman": min_spearman, "min_rollouts": min_rollouts,
              "confidence": confidence}
    runf = _open(dest, "weft judge", config, overwrite)

    def report(graded_errors: list, n_graded: int, decisions) -> None:
        bad = {}
        for task, error in graded_errors:
            if error is not None:
                bad.setdefault(task, error)
        _print_decisions(decisions, fcfg, bad)
        if no_rubric:
            console.print(f"no rubric (task not known here), not judged: {no_rubric}", markup=False)
        console.print(f"{n_graded} pilot rollouts judged, {sum(e is not None for _, e in graded_errors)} malformed or "
                      f"failed judge answers (recorded; their tasks dropped); written to {dest / 'judge-scores.jsonl'} "
                      f"and {dest / 'filter.jsonl'}", markup=False)

    if _shown(runf, "judge run (no judge call made)"):
        try:
            rows = [json.loads(x) for x in (dest / "judge-scores.jsonl").read_text(encoding="utf-8").splitlines()
                    if x.strip()]
            errors = [(str(x["task"]), x.get("error")) for x in rows]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            _fail("--out", f"{str(dest)!r} holds a finished run whose judge-scores.jsonl is missing or unreadable "
                           f"({str(err).splitlines()[0]}); add --overwrite to run it again")
        report(errors, len(rows), _stored(dest, "filter.jsonl", FilterDecision))
        return
    kept = _keep_llm_cache(runf, dest, config)

    async def main():
        async with LLMClient(cfg, cache=dest / "llm_cache.sqlite", ledger=dest / "llm_ledger.jsonl") as llm:
            return await pilot_scores(llm, [rubric_of(tasks[n]) for n in sorted({p.task for p in pilots})], pilots,
                                      role=role)

    try:
        with recorded(runf, console, saved=lambda: "the judge's answers so far (llm_cache.sqlite: a rerun does not "
                                                   "pay for them again)"):
            kept()
            scores, graded = anyio.run(main)
            lines = [json.dumps({"task": g.task, "judge": g.score, "executable": p.r, "reason": g.reason,
                                 "error": g.error}) for g, p in zip(graded, pilots)]
            (dest / "judge-scores.jsonl").write_text("".join(x + "\n" for x in lines), encoding="utf-8")
            decisions = filter_tasks(scores, fcfg)
            (dest / "filter.jsonl").write_text("".join(d.model_dump_json() + "\n" for d in decisions),
                                               encoding="utf-8")
            report([(g.task, g.error) for g in graded], len(graded), decisions)
    finally:
        kept()  # also when the start failed: the cache is never left aside


#: the run-config keys of ``weft judge`` that change the judge's answers (the thresholds do not)
_JUDGE_CALLS = ("trajectories_sha256", "llm_config_sha256", "role")


def _keep_llm_cache(run, dest: Path, config: dict):
    """With ``--overwrite`` of a judge run whose judge calls would be the same (only the thresholds changed): move
    the LLM cache aside before the folder is emptied; returns the function that puts it back once the run started
    (so the judge is not paid again). Otherwise a no-op."""
    import os
    import tempfile

    old = (run.previous or {}).get("config") or {}
    files = [p for p in dest.glob("llm_cache.sqlite*")] if run.overwrite and dest.is_dir() else []
    if not files or any(old.get(k) != config[k] for k in _JUDGE_CALLS):
        return lambda: None
    aside = Path(tempfile.mkdtemp(prefix=".treadle-judge-cache-", dir=dest.parent))
    for p in files:
        os.replace(p, aside / p.name)

    def put_back():  # idempotent
        if not aside.is_dir():
            return
        dest.mkdir(parents=True, exist_ok=True)
        for p in aside.iterdir():
            os.replace(p, dest / p.name)
        aside.rmdir()

    return put_back
