"""``treadle rsi ...``: the offline harness self-improvement loop (issue 16).

    treadle rsi run --out runs/rsi [--rounds 3] [--seeds 16 | --seed-file seeds.jsonl] [--heldout-fraction 0.3]
                    [--decontaminate bench.jsonl ... [--embedding-threshold 0.85]] [--ray auto]
    treadle rsi ablate --out runs/rsi-ablate [--rounds 3] [--runs 3]
    treadle rsi diff runs/rsi/harness/v0.json runs/rsi/harness/v3.json
    treadle rsi llm --out runs/rsi-llm --llm-config models.toml [--domain math|code] [--rounds 2]
                    [--answer-check math-verify|last-number]
    treadle rsi llm --out runs/rsi-tiny --llm-config solver.toml --scripted-roles --solver-prompt ''
                    (only the solver is a model, e.g. the tiny model behind `treadle llm serve`)

``run`` and ``llm`` print the difficulty curve on the fixed queue and write curve.png.
"""
from __future__ import annotations

import json
from pathlib import Path

import typer
from treadle.cli_output import make_console
from treadle.cli_runs import usage_exit
from rich.table import Table

app = typer.Typer(help="RSI: harness self-improvement for reasoning-data synthesis (offline math backend).",
                  no_args_is_help=True, add_completion=False)
console = make_console()


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


@app.command("run")
def run_cmd(
    out: Path = typer.Option(..., "--out", help="Run folder (created; an existing run there is resumed)."),
    rounds: int = typer.Option(3, "--rounds", min=1, max=100, help="Rounds of synthesis."),
    n_seeds: int = typer.Option(16, "--seeds", min=1, max=10000, help="Generated seeds (if no --seed-file)."),
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
    solver: str = typer.Option("capacity", "--solver", help="Fixed solver: capacity (programmatic) or tiny-model."),
    online: bool = typer.Option(True, "--online/--no-online", help="Online skill admission."),
    post_batch: bool = typer.Option(True, "--post-batch/--no-post-batch", help="Post-batch proposals + Critic."),
    margin: float = typer.Option(0.02, "--margin", min=0.0, max=1.0, help="Critic's noise margin on accuracy."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Resume a run found in --out."),
    answer_check: str = typer.Option("last-number", "--answer-check",
                                     help="Solver answers judged by: last-number (exact, the answer's last number) "
                                          "or math-verify (exact number extracted by math-verify, in workers)."),
    ray: str = typer.Option(None, "--ray", help="Run seed chains and candidate evaluations as Ray tasks: auto "
                                                "(the running cluster), local, ray://HOST:PORT or HOST:PORT "
                                                "(needs Ray, the ray extra; same results as without)."),
) -> None:
    """Run the offline loop; writes problems.jsonl, log.jsonl, ledger.jsonl, harness/, curve.png."""
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.runs import SOLVERS, RunMismatchError, SolverSpec, run

    if solver not in SOLVERS:
        _fail("--solver", f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
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
    try:
        summ = run(out, seeds, heldout, cfg, SolverSpec(name=solver), resume=resume,
                   decontamination=tuple(str(p) for p in decontaminate or []),
                   embedding_threshold=embedding_threshold, embedder=embedder, ray_address=ray,
                   on_round=lambda r: console.print(f"after round {r['round'] + 1}: accuracy {r['accuracy']:.3f}, "
                                                    f"{len(r['exports'])} verified, {len(r['repairs'])} repairs, "
                                                    f"harness v{r['harness'].version}", markup=False))
    except RunMismatchError as err:
        _fail("--out", str(err))
    except ConnectionError as err:
        from treadle.ray_cluster import no_cluster_message

        _fail("--ray", no_cluster_message(ray, err))
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


@app.command("ablate")
def ablate_cmd(
    out: Path = typer.Option(..., "--out", help="Folder for one run folder per variant and seed."),
    rounds: int = typer.Option(3, "--rounds", min=1, max=100),
    n_seeds: int = typer.Option(12, "--seeds", min=1, max=10000, help="Training seeds (same for every variant)."),
    runs: int = typer.Option(3, "--runs", min=1, max=20, help="Random seeds per variant."),
    solver: str = typer.Option("capacity", "--solver"),
) -> None:
    """Full vs Task-only vs Online-only vs Post-batch-only: final accuracy and cost per operator."""
    from treadle.rsi.loop import LoopConfig
    from treadle.rsi.math_tasks import make_seeds
    from treadle.rsi.runs import SOLVERS, SolverSpec, ablate

    if solver not in SOLVERS:
        _fail("--solver", f"unknown solver {solver!r}; choose one of {sorted(SOLVERS)}")
    _check_out(out)
    rows = ablate(out, make_seeds(n_seeds, 0), LoopConfig(rounds=rounds), SolverSpec(name=solver),
                  run_seeds=tuple(range(runs)))
    t = Table(title=f"ablation ({runs} seeds each, {rounds} rounds; mean)")
    cols = ["final_accuracy", "cost_online", "cost_post_batch", "cost_extend", "cost_revise", "cost_verify",
            "cost_director", "cost_skill_update"]
    t.add_column("variant")
    for c in cols:
        t.add_column(c.replace("cost_", "cost "))
    for v in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == v]
        t.add_row(v, *[f"{sum(r[c] for r in rs) / len(rs):.3f}" if c == "final_accuracy"
                       else f"{sum(r[c] for r in rs) / len(rs):.0f}" for c in cols])
    console.print(t)
    console.print(f"-> {out / 'ablation.json'}, {out / 'ablation.png'}", markup=False)


@app.command("llm")
def llm_cmd(
    out: Path = typer.Option(..., "--out", help="Run folder (created; an existing run there is resumed)."),
    llm_config: Path = typer.Option(..., "--llm-config",
                                    help="treadle.llm config (TOML/YAML/JSON) with roles director, generator, "
                                         "solver, meta."),
    domain: str = typer.Option("math", "--domain", help="math (sympy-verified) or code (HumanEval, sandboxed tests)."),
    rounds: int = typer.Option(2, "--rounds", min=1, max=100),
    n_seeds: int = typer.Option(8, "--seeds", min=1, max=10000,
                                help="math: generated seeds (if no --seed-file); code: the first N HumanEval tasks."),
    seed_file: Path = typer.Option(None, "--seed-file", help='math: JSONL of {"id": ..., "expression": "3+4"} seeds.'),
    attempts: int = typer.Option(4, "--attempts", min=1, max=64, help="Solver samples per verified task."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, max=256, help="Seed chains at once."),
    seed: int = typer.Option(0, "--seed", help="Seeds the generated math seeds."),
    post_batch: bool = typer.Option(True, "--post-batch/--no-post-batch",
                                    help="LLM post-batch harness edits judged by the Critic after each round."),
    margin: float = typer.Option(0.02, "--margin", min=0.0, max=1.0, help="Critic's noise margin on accuracy."),
    scripted_roles: bool = typer.Option(False, "--scripted-roles",
                                        help="math only: programmatic Director, generator and Meta "
                                             "(treadle.rsi.scripted_roles) on a local endpoint; --llm-config then "
                                             "needs only the solver role (e.g. the tiny model of `treadle llm serve`)."),
    answer_check: str = typer.Option("math-verify", "--answer-check",
                                     help="math: solver answers judged by math-verify (exact number extracted by "
                                          "math-verify, in workers with a parent-enforced timeout) or last-number."),
    solver_prompt: str = typer.Option(None, "--solver-prompt",
                                      help="System prompt of the fixed solver in H_0 ('' = none, for models trained "
                                           "on bare user turns such as the tiny model)."),
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
        if seed_file is not None:
            _fail("--seed-file", "is for --domain math; code seeds are the first --seeds HumanEval tasks")
        queue, dom = load_humaneval_seeds(limit=n_seeds), CodingDomain()
    else:
        queue = [TextMathTask(seed_id=t.seed_id, text=t.text, answer=t.answer)
                 for t in _seeds(n_seeds, seed_file, seed)]
        checker = None
        if answer_check == "math-verify":
            from treadle.rsi.answer_check import AnswerChecker, exact_number_equal

            checker = AnswerChecker(timeout_s=10, max_workers=1, fn=exact_number_equal)
        dom = MathDomain(checker)

    h0 = initial_llm_harness(domain)
    if solver_prompt is not None:
        h0 = h0.model_copy(update={"prompts": h0.prompts.model_copy(update={"solver": solver_prompt})})
    endpoint = None
    if scripted_roles:
        from treadle.llm import RoleConfig
        from treadle.rsi.scripted_roles import scripted_endpoint

        endpoint = scripted_endpoint()
        cfg = cfg.model_copy(update={"roles": {**cfg.roles, **{r: RoleConfig(
            model=f"scripted-{r}", base_url=endpoint.base_url, max_retries=0, structured_mode="prompt", max_repairs=0)
            for r in ("director", "generator", "meta")}}})

    async def go():
        async with LLMClient(cfg, cache=out / "llm_cache.sqlite", ledger=out / "llm_ledger.jsonl") as client:
            return await run_llm(out, queue, dom, client, rounds, harness=h0,
                                 config=LLMLoopConfig(attempts=attempts, concurrency=concurrency),
                                 post_batch=post_batch, margin=margin,
                                 on_round=lambda r: console.print(
                                     f"round {r['round']}: {r['verified']} verified, {r['repairs']} repairs, "
                                     f"{r['failed_calls']} failed calls, admitted {r['admitted']}, harness "
                                     f"v{r['harness_version']}", markup=False))

    try:
        summ = asyncio.run(go())
    except RunMismatchError as err:
        _fail("--out", str(err))
    finally:
        if endpoint is not None:
            endpoint.close()
        if getattr(dom, "checker", None) is not None:
            dom.checker.close()
    led = summ.get("ledger", {})
    console.print(f"calls by operator: {json.dumps(led.get('by_operator', {}))}; tokens {led.get('tokens', 0)}; "
                  f"library: {summ['skills']}; measuring calls (not synthesis cost): {summ.get('measure_calls', 0)}",
                  markup=False, soft_wrap=True)
    if summ.get("curve"):
        from treadle.rsi.llm_curve import curve_table

        console.print(f"difficulty curve (fixed solver, {attempts} attempts, on the fixed queue of {len(queue)} "
                      f"seed chains; point 0 = seeds):", markup=False, soft_wrap=True)
        console.print(curve_table(summ["curve"]), markup=False, soft_wrap=True)
    console.print(f"-> {out / 'problems.jsonl'}, {out / 'summary.json'}, {out / 'curve.png'}", markup=False)


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
