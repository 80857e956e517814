"""``treadle rsi ...``: the offline harness self-improvement loop.

    treadle rsi run --out runs/rsi [--rounds 3] [--seeds 16 | --seed-file seeds.jsonl] [--heldout-fraction 0.3]
                    [--decontaminate bench.jsonl ... [--embedding-threshold 0.85]] [--ray auto]
                    [--solver capacity | --solver tiny-model [--quick]] [--overwrite]
    treadle rsi ablate --out runs/rsi-ablate [--rounds 3] [--runs 3] [--overwrite]
    treadle rsi diff runs/rsi/harness/v0.json runs/rsi/harness/v3.json
    treadle rsi llm --out runs/rsi-llm --llm-config models.toml [--domain math|code] [--rounds 2]
                    [--answer-check math-verify|last-number]
    treadle rsi llm --out runs/rsi-tiny --llm-config solver.toml --scripted-roles --solver-prompt ''
                    (only the solver is a model, e.g. the tiny model behind `treadle llm serve`)

``run`` and ``llm`` print the difficulty curve on the fixed queue and write curve.png.

The run folders of ``run``, ``ablate`` and ``llm`` follow the rule of every command
(:mod:`treadle.run_dirs`): ``run.json`` records treadle's version and commit, the command line, the
machine, start and end times; a run of the same settings is resumed (a finished one is shown),
another config is refused, ``--overwrite`` replaces it. Every check (options, seeds, the solver's
checkpoint) runs before anything is written; options that would be ignored are errors.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.table import Table
from typer import _click as click  # typer vendors click

from treadle.cli_output import make_console
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, recorded, usage_error, usage_exit

app = typer.Typer(help="RSI: harness self-improvement for reasoning-data synthesis (offline math backend).",
                  no_args_is_help=True, add_completion=False)
console = make_console()

# help of the fixed-solver options shared by `rsi run` and `rsi ablate`
_SOLVER_HELP = ("Fixed solver: capacity (programmatic) or tiny-model ($TREADLE_MODEL, else the embedded tiny model, "
                "trained on first use: minutes on a CPU).")
_QUICK_HELP = ("With --solver tiny-model: the quick tiny model (trained in seconds, its own cache slot; a weak solver "
               "for smoke tests).")


def _fail(flag: str, msg: str) -> None:
    usage_exit(f"{flag}: {msg}")


def _seeds(n: int, seed_file: Path | None, seed: int):
    from treadle.rsi.math_tasks import SeedError, load_seed_file, make_seeds

    if seed_file is not None:
        try:
            return load_seed_file(seed_file)
        except SeedError as err:
            _fail("--seed-file", str(err))
    return make_seeds(n, seed)


def _hygiene(pool, benchmark_files, heldout_fraction: float, seed: int, seed_flag: str = "--seeds",
             embedding_index=None):
    """Dedup, decontaminate (13-grams, and embeddings when ``embedding_index`` is given), split by
    near-duplicate family; exits 2 naming the flag on bad input."""
    from treadle.rsi.decontam import BenchmarkIndex, DecontaminationFileError, dedup, split_by_family

    notes = []
    pool, dropped = dedup(pool)
    if dropped:
        notes.append(f"dedup: dropped {len(dropped)} duplicated seed(s)")
    if benchmark_files:
        index = BenchmarkIndex()
        try:
            for p in benchmark_files:
                index.add_file(p)
        except DecontaminationFileError as err:
            _fail("--decontaminate", str(err))
        kept = [t for t in pool if not index.contaminated(t.text)]
        notes.append(f"decontamination: dropped {len(pool) - len(kept)} seed(s) overlapping the benchmark files")
        pool = kept
        if embedding_index is not None:
            for p in benchmark_files:
                embedding_index.add_file(p)
            flags = embedding_index.contaminated_many([t.text for t in pool])
            notes.append(f"embedding decontamination ({embedding_index.embedder.name}, threshold "
                         f"{embedding_index.threshold}): dropped {sum(flags)} seed(s)")
            pool = [t for t, f in zip(pool, flags) if not f]
    train, heldout = split_by_family(pool, heldout_fraction, seed)
    if not train:
        _fail(seed_flag, f"no training seeds left after dedup, decontamination and the held-out split "
                         f"({len(pool)} seed(s) before the split; give more seeds or a lower --heldout-fraction "
                         f"than {heldout_fraction})")
    return train, heldout, notes


def _check_answer_check(value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        _fail("--answer-check", f"unknown answer check {value!r}; choose one of {list(known)}")
    if value == "math-verify":
        try:
            import math_verify  # noqa: F401
            import pebble  # noqa: F401
        except ImportError as err:
            _fail("--answer-check", f"math-verify needs the math-verify and pebble packages ({err})")


def _check_out(out: Path) -> None:
    from treadle.run_dirs import check_out_dir

    try:
        check_out_dir(out, "run folder")
    except ValueError as err:
        _fail("--out", str(err))


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set option ``name`` (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def _refuse_ignored(ctx: typer.Context, rules) -> None:
    """Options the command would ignore are errors: for each ``(name, flag, ignored, why)``, a user-set
    option ``name`` that is ``ignored`` given the others exits 2 with ``<flag>: ignored <why>``."""
    for name, flag, ignored, why in rules:
        if ignored and _given(ctx, name):
            _fail(flag, f"ignored {why}")


def _check_quick(solver: str, quick: bool) -> None:
    """``--quick`` picks the quick tiny model as the solver; with another solver, or with ``$TREADLE_MODEL``
    set (which it would override), it would be ignored: an error."""
    if not quick:
        return
    if solver != "tiny-model":
        _fail("--quick", f"ignored with --solver {solver}: it picks the quick tiny model for --solver tiny-model")
    if os.environ.get("TREADLE_MODEL"):
        _fail("--quick", f"the quick tiny model would replace $TREADLE_MODEL ({os.environ['TREADLE_MODEL']!r}), "
                         f"which would then be ignored; unset $TREADLE_MODEL or drop --quick")


def _solver_spec(solver: str, quick: bool):
    """The solver's ``{name, args}`` as recorded in the run folder (a rerun rebuilds the same solver): the
    tiny model records ``quick`` or the ``$TREADLE_MODEL`` checkpoint it uses."""
    from treadle.rsi.runs import SolverSpec

    args: dict = {}
    if solver == "tiny-model":
        if quick:
            args["quick"] = True
        elif os.environ.get("TREADLE_MODEL"):
            args["path"] = str(Path(os.environ["TREADLE_MODEL"]).expanduser().resolve())
    return SolverSpec(name=solver, args=args)


def _load_solver(spec, quick: bool):
    """The tiny-model solver, loaded before the run folder is touched (None for other solvers). The
    embedded tiny model is trained on first use, saying so on the console. An unusable checkpoint is one
    line naming ``$TREADLE_MODEL`` (or ``--solver``), exit 2."""
    if spec.name != "tiny-model":
        return None
    from treadle.cli_models import QUICK_SLOT, load_model
    from treadle.models.tiny import cache_root
    from treadle.rsi.solvers import TinyModelSolver

    if "path" not in spec.args:
        slot = cache_root() / (QUICK_SLOT if quick else "tiny-qwen3")
        if not slot.exists():
            console.print(f"solver: no cached {'quick ' if quick else ''}tiny model at {slot}; training it first "
                          f"({'seconds' if quick else 'minutes on a CPU; --quick: seconds'})", markup=False)
    try:
        model, tok = load_model(None, quick, console)
    except click.exceptions.UsageError as err:
        msg = err.format_message()
        usage_exit(msg if msg.startswith("$TREADLE_MODEL") else f"--solver tiny-model: {msg}")
    return TinyModelSolver(model=model, tokenizer=tok)


def _open(out: Path, command: str, doc: dict, overwrite: bool, legacy: tuple[str, ...], ignore: tuple = ()):
    """``--out`` under the run-folder rule (:func:`treadle.cli_runs.open_run`), checked before any work.
    A run folder of this command from before ``run.json`` (it holds one of ``legacy``) is taken as it is:
    the command's own config check resumes it or refuses another config; ``--overwrite`` empties it."""
    from treadle.run_dirs import RUN_RECORD, RunDir, check_out_dir

    p = Path(out).expanduser()
    if not (p / RUN_RECORD).exists() and any((p / name).exists() for name in legacy):
        try:
            p = check_out_dir(p, "--out")
        except ValueError as err:
            _fail("--out", str(err))
        doc = json.loads(json.dumps(doc, default=str))
        return RunDir(p, "--out", command, doc, {} if overwrite else None, overwrite)
    return open_run(p, command=command, config=doc, overwrite=overwrite, ignore=ignore)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finished(run_dir, rounds: int, *files: str) -> dict | None:
    """The summary of a finished run of these settings that reached ``rounds`` (None: it must run). A
    damaged folder (unreadable ``config.json``, ``state.json`` or ``files``) is not shown: the run
    itself then reports what is wrong."""
    if not run_dir.finished:
        return None
    p = run_dir.path
    state, config = _read_json(p / "state.json"), _read_json(p / "config.json")
    docs = [_read_json(p / f) for f in files]
    if not isinstance(state, dict) or not isinstance(config, dict) or state.get("round") != rounds or None in docs:
        return None
    return docs[0]


def _say_finished(run_dir) -> None:
    console.print(f"{run_dir.path} already holds this finished run (same settings; finished "
                  f"{run_dir.previous.get('ended')}); its results are unchanged. Add --overwrite to run it again.",
                  markup=False)


def _print_run(summ: dict, out: Path) -> None:
    t = Table(title="difficulty curve (fixed-solver accuracy on the fixed queue)")
    t.add_column("round")
    t.add_column("accuracy")
    t.add_column("95% CI (bootstrap over tasks)")
    for i, (a, ci) in enumerate(zip(summ["curve"], summ["curve_ci95"])):
        t.add_row(str(i), f"{a:.3f}", f"[{ci[0]:.3f}, {ci[1]:.3f}]")
    console.print(t)
    led = summ["ledger"]
    console.print(f"cost units by operator: {json.dumps(led['by_operator'])}", markup=False)
    if "transfer" in summ:
        console.print(f"held-out transfer (final accuracy, lower = harder): H_n {summ['transfer']['h_final']:.3f} "
                      f"vs H_0 {summ['transfer']['h0']:.3f}", markup=False)
    console.print(f"{summ['n_problems']} verified problems -> {out / 'problems.jsonl'}; curve -> {out / 'curve.png'}",
                  markup=False)


@app.command("run")
def run_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out",
                             help="Run folder (created; more --rounds continue a run)." + OUT_HELP_SUFFIX),
    rounds: int = typer.Option(3, "--rounds", min=1, max=100, help="Rounds of synthesis."),
    n_seeds: int = typer.Option(16, "--seeds", min=1, max=10000, help="Generated seeds (not with --seed-file)."),
    seed_file: Path = typer.Option(None, "--seed-file", help='JSONL of {"id": ..., "expression": "3+4"} seeds.'),
    heldout_fraction: float = typer.Option(0.3, "--heldout-fraction", min=0.0, max=0.9,
                                           help="Share of seed families held out (transfer evaluation only)."),
    decontaminate: list[Path] = typer.Option(None, "--decontaminate",
                                             help="Benchmark file (.jsonl or text lines); repeatable. Seeds and "
                                                  "exported problems sharing a 13-gram with it are dropped."),
    embedding_threshold: float = typer.Option(None, "--embedding-threshold", min=0.01, max=1.0,
                                              help="Also drop seeds and problems whose MiniLM cosine similarity to "
                                                   "a --decontaminate item reaches this (needs treadle[embed])."),
    seed: int = typer.Option(0, "--seed", help="Seeds every random choice."),
    solver: str = typer.Option("capacity", "--solver", help=_SOLVER_HELP),
    quick: bool = typer.Option(False, "--quick", help=_QUICK_HELP),
    online: bool = typer.Option(True, "--online/--no-online", help="Online skill admission."),
    post_batch: bool = typer.Option(True, "--post-batch/--no-post-batch", help="Post-batch proposals + Critic."),
    margin: float = typer.Option(0.02, "--margin", min=0.0, max=1.0,
                                 help="Critic's noise margin on accuracy (post-batch only)."),
    resume: bool = typer.Option(True, "--resume/--no-resume",
                                help="Resume a run of the same settings found in --out (--no-resume: refuse it)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out (every round again)."),
    answer_check: str = typer.Option("last-number", "--answer-check",
                                     help="Solver answers judged by: last-number (exact, the answer's last number) "
                                          "or math-verify (exact number extracted by math-verify, in workers)."),
    ray: str = typer.Option(None, "--ray", help="Run seed chains and candidate evaluations as Ray tasks: auto "
                                                "(the running cluster), local, ray://HOST:PORT or HOST:PORT "
                                                "(needs Ray, the ray extra; same results as without)."),
) -> None:
    """Run the offline loop; writes problems.jsonl, log.jsonl, ledger.jsonl, harness/, curve.png, run.json."""
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.runs import SOLVERS, RunMismatchError, run

    if solver not in SOLVERS:
        _fail("--solver", f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    _refuse_ignored(ctx, [
        ("n_seeds", "--seeds", seed_file is not None, "with --seed-file (the seeds are the file's); give one of them"),
        ("margin", "--margin", not post_batch, "with --no-post-batch (it is the post-batch Critic's margin)"),
        ("resume", "--resume/--no-resume", overwrite, "with --overwrite, which replaces the run in --out"),
    ])
    _check_quick(solver, quick)
    _check_answer_check(answer_check, ("last-number", "math-verify"))
    if ray is not None:
        from treadle.ray_cluster import RayUnavailableError, check_ray_option

        try:
            ray = check_ray_option(ray)
        except (ValueError, RayUnavailableError) as err:
            _fail("--ray", str(err))
    _check_out(out)
    embedder = None
    if embedding_threshold is not None:
        if not decontaminate:
            _fail("--embedding-threshold", "needs at least one --decontaminate benchmark file to compare with")
        from treadle.rsi.embedding import EmbedderUnavailableError, EmbeddingIndex, MiniLMEmbedder

        try:
            embedder = MiniLMEmbedder()
        except EmbedderUnavailableError as err:
            _fail("--embedding-threshold", str(err))
    pool = _seeds(n_seeds, seed_file, seed)
    seeds, heldout, notes = _hygiene(pool, decontaminate or [], heldout_fraction, seed,
                                     "--seed-file" if seed_file is not None else "--seeds",
                                     None if embedder is None else EmbeddingIndex(embedder, embedding_threshold))
    for n in notes:
        console.print(n, markup=False)
    cfg = LoopConfig(seed=seed, rounds=rounds, online=online, post_batch=post_batch, margin=margin,
                     answer_check=answer_check)
    spec = _solver_spec(solver, quick)
    doc = {"rounds": rounds, "seeds": None if seed_file is not None else n_seeds,
           "seed_file": None if seed_file is None else str(seed_file), "heldout_fraction": heldout_fraction,
           "decontaminate": [str(p) for p in decontaminate or []], "embedding_threshold": embedding_threshold,
           "loop": cfg.model_dump(mode="json", exclude={"rounds"}), "solver": spec.model_dump(mode="json")}
    run_dir = _open(out, "rsi run", doc, overwrite, ("config.json",), ignore=("rounds",))
    out = run_dir.path
    if not resume and not run_dir.overwrite and (out / "config.json").exists():
        _fail("--no-resume", f"{str(out)!r} already holds a run; drop --no-resume to resume it, add --overwrite to "
                             f"replace it, or give another --out")
    summ = _finished(run_dir, rounds, "summary.json")
    if summ is not None:
        _print_run(summ, out)
        _say_finished(run_dir)
        return
    chains = None
    if ray is not None:
        from treadle.ray_cluster import no_cluster_message
        from treadle.rsi.ray_tasks import RayChains

        try:
            chains = RayChains(ray)
        except ConnectionError as err:
            _fail("--ray", no_cluster_message(ray, err))
    solver_obj = _load_solver(spec, quick)
    with recorded(run_dir, console, saved=lambda: "every finished round", resumable=True):
        try:
            summ = run(out, seeds, heldout, cfg, spec, resume=resume, solver_obj=solver_obj, chains=chains,
                       decontamination=tuple(str(p) for p in decontaminate or []),
                       embedding_threshold=embedding_threshold, embedder=embedder,
                       on_round=lambda r: console.print(f"after round {r['round'] + 1}: accuracy "
                                                        f"{r['accuracy']:.3f}, {len(r['exports'])} verified, "
                                                        f"{len(r['repairs'])} repairs, harness "
                                                        f"v{r['harness'].version}", markup=False))
        except RunMismatchError as err:
            raise usage_error(f"--out: {err}") from None
        except ConnectionError as err:
            from treadle.ray_cluster import no_cluster_message

            raise usage_error(f"--ray: {no_cluster_message(ray, err)}") from None
    _print_run(summ, out)


_ABLATION_COLS = ["final_accuracy", "cost_online", "cost_post_batch", "cost_extend", "cost_revise", "cost_verify",
                  "cost_director", "cost_skill_update"]


def _print_ablation(rows: list[dict], runs: int, rounds: int, out: Path) -> None:
    t = Table(title=f"ablation ({runs} seeds each, {rounds} rounds; mean)")
    t.add_column("variant")
    for c in _ABLATION_COLS:
        t.add_column(c.replace("cost_", "cost "))
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        t.add_row(v, *[f"{sum(r[c] for r in rs) / len(rs):.3f}" if c == "final_accuracy"
                       else f"{sum(r[c] for r in rs) / len(rs):.0f}" for c in _ABLATION_COLS])
    console.print(t)
    console.print(f"-> {out / 'ablation.json'}, {out / 'ablation.png'}", markup=False)


@app.command("ablate")
def ablate_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Folder for one run folder per variant and seed." + OUT_HELP_SUFFIX),
    rounds: int = typer.Option(3, "--rounds", min=1, max=100),
    n_seeds: int = typer.Option(12, "--seeds", min=1, max=10000, help="Training seeds (same for every variant)."),
    runs: int = typer.Option(3, "--runs", min=1, max=20, help="Random seeds per variant."),
    solver: str = typer.Option("capacity", "--solver", help=_SOLVER_HELP),
    quick: bool = typer.Option(False, "--quick", help=_QUICK_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the ablation in --out (every run again)."),
) -> None:
    """Full vs Task-only vs Online-only vs Post-batch-only: final accuracy and cost per operator."""
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.math_tasks import make_seeds
    from treadle.rsi.runs import SOLVERS, RunMismatchError, ablate

    if solver not in SOLVERS:
        _fail("--solver", f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    _check_quick(solver, quick)
    _check_out(out)
    spec = _solver_spec(solver, quick)
    doc = {"rounds": rounds, "seeds": n_seeds, "runs": runs, "solver": spec.model_dump(mode="json")}
    run_dir = _open(out, "rsi ablate", doc, overwrite, ("ablation.json", "full-seed0"))
    out = run_dir.path
    if run_dir.finished:
        done = _read_json(out / "ablation.json")
        if isinstance(done, dict) and isinstance(done.get("rows"), list):
            _print_ablation(done["rows"], runs, rounds, out)
            _say_finished(run_dir)
            return
    solver_obj = _load_solver(spec, quick)
    with recorded(run_dir, console, saved=lambda: "the finished runs (one sub-folder per variant and seed)",
                  resumable=True):
        try:
            rows = ablate(out, make_seeds(n_seeds, 0), LoopConfig(rounds=rounds), spec, run_seeds=tuple(range(runs)),
                          solver_obj=solver_obj,
                          on_run=lambda r: console.print(f"{r['variant']} (seed {r['seed']}): final accuracy "
                                                         f"{r['final_accuracy']:.3f}", markup=False))
        except RunMismatchError as err:
            raise usage_error(f"--out: {err}") from None
    _print_ablation(rows, runs, rounds, out)


def _print_llm(summ: dict, attempts: int, n_tasks: int, out: Path) -> None:
    led = summ.get("ledger", {})
    console.print(f"calls by operator: {json.dumps(led.get('by_operator', {}))}; tokens {led.get('tokens', 0)}; "
                  f"library: {summ['skills']}; measuring calls (not synthesis cost): {summ.get('measure_calls', 0)}",
                  markup=False, soft_wrap=True)
    if summ.get("curve"):
        from treadle.rsi.llm_curve import curve_table

        console.print(f"difficulty curve (fixed solver, {attempts} attempts, on the fixed queue of {n_tasks} "
                      f"seed chains; point 0 = seeds):", markup=False, soft_wrap=True)
        console.print(curve_table(summ["curve"]), markup=False, soft_wrap=True)
    console.print(f"-> {out / 'problems.jsonl'}, {out / 'summary.json'}, {out / 'curve.png'}", markup=False)


@app.command("llm")
def llm_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out",
                             help="Run folder (created; more --rounds continue a run)." + OUT_HELP_SUFFIX),
    llm_config: Path = typer.Option(..., "--llm-config",
                                    help="treadle.llm config (TOML/YAML/JSON) with roles director, generator, "
                                         "solver, meta."),
    domain: str = typer.Option("math", "--domain", help="math (sympy-verified) or code (HumanEval, sandboxed tests)."),
    rounds: int = typer.Option(2, "--rounds", min=1, max=100),
    n_seeds: int = typer.Option(8, "--seeds", min=1, max=10000,
                                help="math: generated seeds (not with --seed-file); code: the first N HumanEval "
                                     "tasks."),
    seed_file: Path = typer.Option(None, "--seed-file", help='math: JSONL of {"id": ..., "expression": "3+4"} seeds.'),
    attempts: int = typer.Option(4, "--attempts", min=1, max=64, help="Solver samples per verified task."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, max=256, help="Seed chains at once."),
    seed: int = typer.Option(0, "--seed", help="math: seeds the generated math seeds (not with --seed-file)."),
    post_batch: bool = typer.Option(True, "--post-batch/--no-post-batch",
                                    help="LLM post-batch harness edits judged by the Critic after each round."),
    margin: float = typer.Option(0.02, "--margin", min=0.0, max=1.0,
                                 help="Critic's noise margin on accuracy (post-batch only)."),
    scripted_roles: bool = typer.Option(False, "--scripted-roles",
                                        help="math only: programmatic Director, generator and Meta "
                                             "(treadle.rsi.scripted_roles) on a local endpoint; --llm-config then "
                                             "needs only the solver role (e.g. the tiny model of `treadle llm "
                                             "serve`)."),
    answer_check: str = typer.Option("math-verify", "--answer-check",
                                     help="math: solver answers judged by math-verify (exact number extracted by "
                                          "math-verify, in workers with a parent-enforced timeout) or last-number."),
    solver_prompt: str = typer.Option(None, "--solver-prompt",
                                      help="System prompt of the fixed solver in H_0 ('' = none, for models trained "
                                           "on bare user turns such as the tiny model)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out (every round again)."),
) -> None:
    """Online RSI rounds with LLM roles (cache and ledger in the run folder; rerun to resume); prints the
    difficulty curve on the fixed queue and writes curve.png."""
    import asyncio

    from treadle.llm import ConfigError, LLMClient, LLMConfig
    from treadle.rsi.llm_loop import ROLES, CodingDomain, LLMLoopConfig, MathDomain, TextMathTask, initial_llm_harness
    from treadle.rsi.llm_runs import run_llm
    from treadle.rsi.runs import RunMismatchError

    if domain not in ("math", "code"):
        _fail("--domain", f"unknown domain {domain!r}; choose math or code")
    if domain == "code" and seed_file is not None:
        _fail("--seed-file", "is for --domain math; code seeds are the first --seeds HumanEval tasks")
    _refuse_ignored(ctx, [
        ("n_seeds", "--seeds", seed_file is not None, "with --seed-file (the seeds are the file's); give one of them"),
        ("seed", "--seed", seed_file is not None, "with --seed-file (it seeds generated seeds only)"),
        ("seed", "--seed", domain == "code", "with --domain code (it seeds generated math seeds only)"),
        ("answer_check", "--answer-check", domain == "code",
         "with --domain code (code answers are judged by their sandboxed tests)"),
        ("margin", "--margin", not post_batch, "with --no-post-batch (it is the post-batch Critic's margin)"),
    ])
    try:
        cfg = LLMConfig.load(llm_config)
    except ConfigError as err:
        _fail("--llm-config", str(err))
    needed = ["solver"] if scripted_roles else list(ROLES)
    missing = [r for r in needed if r not in cfg.roles]
    if missing:
        _fail("--llm-config", f"{llm_config} has no role(s) {missing}; RSI needs {needed} (has "
                              f"{sorted(cfg.roles)})")
    if scripted_roles and domain != "math":
        _fail("--scripted-roles", f"the scripted roles write math tasks only, not --domain {domain}")
    if domain == "math":
        _check_answer_check(answer_check, ("math-verify", "last-number"))
    _check_out(out)
    if domain == "code":
        from treadle.rsi.coding import load_humaneval_seeds
        from treadle.sandbox import SandboxUnavailableError, isolation_mode

        try:
            isolation_mode()
        except SandboxUnavailableError as err:
            _fail("--domain", f"code needs the sandbox: {err}")
        queue = load_humaneval_seeds(limit=n_seeds)
    else:
        queue = [TextMathTask(seed_id=t.seed_id, text=t.text, answer=t.answer)
                 for t in _seeds(n_seeds, seed_file, seed)]
    doc = {"domain": domain, "rounds": rounds, "seeds": None if seed_file is not None else n_seeds,
           "seed_file": None if seed_file is None else str(seed_file),
           "seed": seed if domain == "math" and seed_file is None else None, "attempts": attempts,
           "concurrency": concurrency, "post_batch": post_batch, "margin": margin if post_batch else None,
           "scripted_roles": scripted_roles, "answer_check": answer_check if domain == "math" else None,
           "solver_prompt": solver_prompt, "models": {r: cfg.roles[r].model for r in needed}}
    run_dir = _open(out, "rsi llm", doc, overwrite, ("config.json",), ignore=("rounds",))
    out = run_dir.path
    summ = _finished(run_dir, rounds, "summary.json")
    if summ is not None and len(summ.get("rounds") or []) == rounds:
        _print_llm(summ, attempts, len(queue), out)
        _say_finished(run_dir)
        return

    if domain == "code":
        dom = CodingDomain()
    else:
        checker = None
        if answer_check == "math-verify":
            from treadle.rsi.answer_check import AnswerChecker, exact_number_equal

            checker = AnswerChecker(timeout_s=10, max_workers=1, fn=exact_number_equal)
        dom = MathDomain(checker)
    h0 = initial_llm_harness(domain)
    if solver_prompt is not None:
        h0 = h0.model_copy(update={"prompts": h0.prompts.model_copy(update={"solver": solver_prompt})})
    endpoint = None
    try:
        if scripted_roles:
            from treadle.llm import RoleConfig
            from treadle.rsi.scripted_roles import scripted_endpoint

            endpoint = scripted_endpoint()
            cfg = cfg.model_copy(update={"roles": {**cfg.roles, **{r: RoleConfig(
                model=f"scripted-{r}", base_url=endpoint.base_url, max_retries=0, structured_mode="prompt",
                max_repairs=0) for r in ("director", "generator", "meta")}}})

        async def go():
            async with LLMClient(cfg, cache=out / "llm_cache.sqlite", ledger=out / "llm_ledger.jsonl") as client:
                return await run_llm(out, queue, dom, client, rounds, harness=h0,
                                     config=LLMLoopConfig(attempts=attempts, concurrency=concurrency),
                                     post_batch=post_batch, margin=margin,
                                     on_round=lambda r: console.print(
                                         f"round {r['round']}: {r['verified']} verified, {r['repairs']} repairs, "
                                         f"{r['failed_calls']} failed calls, admitted {r['admitted']}, harness "
                                         f"v{r['harness_version']}", markup=False))

        with recorded(run_dir, console, saved=lambda: "every finished round (and the call cache)", resumable=True):
            try:
                summ = asyncio.run(go())
            except RunMismatchError as err:
                raise usage_error(f"--out: {err}") from None
    finally:
        if endpoint is not None:
            endpoint.close()
        if getattr(dom, "checker", None) is not None:
            dom.checker.close()
    _print_llm(summ, attempts, len(queue), out)


@app.command("diff")
def diff_cmd(old: Path = typer.Argument(..., help="Harness JSON (e.g. harness/v0.json)."),
             new: Path = typer.Argument(..., help="Harness JSON to compare with.")) -> None:
    """Readable differences between two harness versions."""
    from pydantic import ValidationError

    from treadle.rsi.harness import Harness, diff

    hs = []
    for name, p in (("OLD", old), ("NEW", new)):
        try:
            hs.append(Harness.from_json(p.read_text()))
        except FileNotFoundError:
            _fail(name, f"no file {p}")
        except IsADirectoryError:
            _fail(name, f"{p} is a folder; expected a harness JSON file (e.g. harness/v0.json)")
        except (OSError, UnicodeDecodeError) as err:
            _fail(name, f"cannot read {p}: {err}")
        except ValidationError as err:
            _fail(name, f"{p} is not a harness record ({err.error_count()} errors, first: {err.errors()[0]['msg']})")
    for line in diff(*hs) or ["(no differences)"]:
        console.print(line, markup=False)
