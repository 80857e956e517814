"""``treadle weft sample``: prefix-preserving (and end-to-end) rejection sampling into a run folder.

Bad input is one line naming the flag, exit code 2, before any rollout. The run folder follows the rule of
every command (:mod:`treadle.run_dirs`: ``run.json`` records the version, commit, command line, times and
machine; a rerun of the same settings resumes, another config is refused, ``--overwrite`` replaces it).
Writes ``run.json``, ``config.json``, ``trajectories.jsonl``, ``metrics.jsonl``, ``summary.png`` and, with
``--sft``, ``sft.jsonl`` (TRL ``SFTTrainer`` conversational format: ``messages`` + ``tools``).
"""
from __future__ import annotations

from pathlib import Path

import typer
from typer import _click as click  # typer vendors click

from treadle.cli_output import make_console
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, recorded, usage_error, usage_exit

app = typer.Typer(help="WEFT rollouts: rejection sampling of SFT trajectories.", add_completion=False)
console = make_console()


#: policies the command line can build (the others take Python objects, e.g. ``hf`` a model)
CLI_POLICIES = ("replay", "llm")


@app.callback()
def _group() -> None:
    """WEFT rollouts (a command group, so ``sample`` stays a sub-command)."""


def _fail(flag: str, msg: str) -> None:
    usage_exit(f"{flag}: {msg}")


def _pydantic_msg(e: dict) -> str:
    """A pydantic error's message without the ``Value error, `` prefix pydantic puts before a validator's text."""
    msg = str(e["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


@app.command("sample")
def sample_cmd(run_dir: Path = typer.Argument(None, show_default=False,
                                              help="Run folder (same as --out; kept for scripts)."),
               out: Path = typer.Option(None, "--out", "--run-dir", show_default=False,
                                        help="Run folder (default runs/weft-sample)." + OUT_HELP_SUFFIX),
               overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in the "
                                                                        "run folder (deleting it)."),
               env: str = typer.Option("shop", "--env", help="Environment (tasks): shop | bfcl (BFCL v4 multi-turn, "
                                                           "single-class entries; needs bfcl-eval)."),
               bfcl_category: str = typer.Option("base", "--bfcl-category", help="BFCL multi-turn category (--env bfcl)."),
               bfcl_limit: int = typer.Option(None, "--bfcl-limit", show_default=False,
                                              help="At most this many BFCL entries (--env bfcl; default all eligible)."),
               view: str = typer.Option("agentic", "--view", help="agentic | simuser | simuser-llm (an LLM user: --llm-config)."),
               disclosure: str = typer.Option(None, "--disclosure", show_default=False,
                                              help="SimUser disclosure: vague | partial | full (default full; "
                                                   "--view simuser or simuser-llm)."),
               harness: str = typer.Option("hermes", "--harness", help="hermes | react | native | openclaw."),
               openclaw_workspace: Path | None = typer.Option(None, "--openclaw-workspace",
                                                              help="openclaw harness: folder of bootstrap files "
                                                                   "(AGENTS.md, SOUL.md, ...)."),
               policy: str = typer.Option("replay", "--policy", help="replay | llm."),
               rate: list[str] = typer.Option([], "--rate", help="Replay perturbation NAME=RATE (repeatable)."),
               method: list[str] = typer.Option(["prefix", "end_to_end"], "--method", help="prefix | end_to_end."),
               k: list[int] = typer.Option([1, 3, 5], "--k", help="Attempts per turn (prefix) / per task (end_to_end)."),
               replicas: int = typer.Option(1, "--replicas", help="Independent draws per task."),
               seed: int = typer.Option(0, "--seed"),
               concurrency: int = typer.Option(4, "--concurrency", help="Rollouts in flight."),
               llm_config: Path | None = typer.Option(None, "--llm-config", help="treadle.llm config (llm policy)."),
               role: str = typer.Option(None, "--role", show_default=False,
                                        help="Role of the llm config to sample from (--policy llm; default policy)."),
               user_role: str = typer.Option(None, "--user-role", show_default=False,
                                             help="Role of the llm config that plays the user (--view simuser-llm; "
                                                  "default user)."),
               sft: bool = typer.Option(None, "--sft/--no-sft", show_default=False,
                                        help="Also write accepted prefix trajectories as sft.jsonl (default on; "
                                             "needs --method prefix)."),
               ray: str = typer.Option(None, "--ray", help="Run the rollouts on Ray actors: auto (the running "
                                                           "cluster), local, ray://HOST:PORT or HOST:PORT "
                                                           "(needs Ray, the ray extra; same trajectories)."),
               ray_workers: int = typer.Option(None, "--ray-workers", show_default=False,
                                               help="Ray actors to start (--ray; default: the cluster's CPUs, at "
                                                    "most --concurrency).")) -> None:
    """Sample trajectories with rejection sampling and print accepted trajectories per policy call."""
    import anyio
    from pydantic import ValidationError

    from treadle.weft.rollouts.batch import Component, ConfigMismatchError, SampleConfig, sample_async
    from treadle.weft.rollouts.metrics import plot_summary, print_table, summarize, write_jsonl
    from treadle.weft.rollouts.registry import HARNESSES, POLICIES, VIEWS
    from treadle.weft.rollouts.tasks import DISCLOSURES, DependencyCycleError, from_shop, replicate
    from treadle.weft.rollouts.tokens import write_sft

    if run_dir is not None and out is not None and Path(run_dir) != Path(out):
        _fail("--out", f"give the run folder once: RUN_DIR {str(run_dir)!r} and --out {str(out)!r} differ")
    dir_flag = "RUN_DIR" if out is None and run_dir is not None else "--out"  # the one the user gave
    run_dir = Path(out if out is not None else run_dir if run_dir is not None else "runs/weft-sample")
    for flag, name, reg in (("--view", view, VIEWS), ("--harness", harness, HARNESSES), ("--policy", policy, POLICIES)):
        if name not in reg.names():
            _fail(flag, f"unknown {reg.kind} {name!r}; expected one of {reg.names()}")
    if policy not in CLI_POLICIES:  # e.g. 'hf' takes a model object: no command-line form
        _fail("--policy", f"{policy!r} is a Python-API policy (it takes a model object: "
                          f"treadle.weft.rollouts.policies); on the command line use one of {list(CLI_POLICIES)} "
                          f"(a local checkpoint: `treadle llm serve --model PATH`, then --policy llm)")
    if openclaw_workspace is not None and (harness != "openclaw" or not openclaw_workspace.is_dir()):
        _fail("--openclaw-workspace", f"expected a folder, with --harness openclaw; got {str(openclaw_workspace)!r} "
                                      f"with --harness {harness!r}")
    if env not in ("shop", "bfcl"):
        _fail("--env", f"unknown env {env!r}; expected 'shop' or 'bfcl'")
    if env != "bfcl" and (bfcl_limit is not None or bfcl_category != "base"):
        _fail("--bfcl-category" if bfcl_category != "base" else "--bfcl-limit", f"only with --env bfcl (--env is {env!r})")
    if bfcl_limit is not None and not 1 <= bfcl_limit <= 10_000:
        _fail("--bfcl-limit", f"expected an int in [1, 10000], got {bfcl_limit}")
    if disclosure is not None and disclosure not in DISCLOSURES:
        _fail("--disclosure", f"expected one of {list(DISCLOSURES)}, got {disclosure!r}")
    # options that the other settings would ignore are errors, not silently dropped
    if role is not None and policy != "llm":
        _fail("--role", f"ignored here: the role is the llm policy's model (--policy llm); --policy is {policy!r}")
    if user_role is not None and view != "simuser-llm":
        _fail("--user-role", f"ignored here: the user role plays the user in --view simuser-llm; --view is {view!r}")
    if disclosure is not None and view == "agentic":
        _fail("--disclosure", "ignored here: the agentic view gives the whole brief up front; disclosure levels "
                              "apply to --view simuser and simuser-llm")
    if sft and "prefix" not in method:
        _fail("--sft", f"sft.jsonl holds accepted prefix trajectories; --method is {method} (add --method prefix "
                       f"or drop --sft)")
    role, user_role = role or "policy", user_role or "user"
    disclosure, sft = disclosure or "full", ("prefix" in method) if sft is None else sft
    if ray_workers is not None and ray is None:
        _fail("--ray-workers", "only with --ray")
    if ray is not None:
        from treadle.ray_cluster import RayUnavailableError, check_ray_option

        try:
            ray = check_ray_option(ray)
        except (ValueError, RayUnavailableError) as err:
            _fail("--ray", str(err))
    for flag, val, top in (("--replicas", replicas, 10_000), ("--concurrency", concurrency, 1_024),
                           *((("--ray-workers", ray_workers, 10_000),) if ray_workers is not None else ())):
        if not 1 <= val <= top:
            _fail(flag, f"expected an int in [1, {top}], got {val}")
    if any(not 1 <= x <= 1_000 for x in k):
        _fail("--k", f"expected ints in [1, 1000], got {k}")
    rates = {}
    for r in rate:
        name, _, val = r.partition("=")
        try:
            value = float(val)
        except ValueError:
            _fail("--rate", f"expected NAME=RATE (e.g. wrong_argument=0.1), got {r!r}")
        if name in rates:
            _fail("--rate", f"{name!r} given twice ({rates[name]:g} and {value:g}); give each perturbation once")
        rates[name] = value
    if rates and policy != "replay":
        _fail("--rate", f"ignored here: perturbation rates apply to --policy replay only (--policy is {policy!r})")
    llm_roles = ([("--role", role)] if policy == "llm" else []) + ([("--user-role", user_role)]
                                                                   if view == "simuser-llm" else [])
    if llm_roles and llm_config is None:
        _fail("--llm-config", f"{'the llm policy' if policy == 'llm' else 'the simuser-llm view'} needs a "
                              "treadle.llm config file")
    if not llm_roles and llm_config is not None:
        _fail("--llm-config", f"only the llm policy and the simuser-llm view read a model config; --policy is "
                              f"{policy!r}, --view {view!r}")
    llm_cfg = None
    if llm_roles:
        from treadle.llm import ConfigError, LLMConfig

        try:
            llm_cfg = LLMConfig.load(llm_config)
        except ConfigError as err:
            _fail("--llm-config", str(err).replace("\n", " "))
        for flag, r in llm_roles:
            if r not in llm_cfg.roles:
                _fail(flag, f"unknown role {r!r}; {llm_config} defines {sorted(llm_cfg.roles)}")
    from treadle.weft.rollouts.batch import RunDirError, check_run_dir

    try:
        check_run_dir(run_dir)
    except RunDirError as err:
        _fail(dir_flag, str(err))
    pargs = {"rates": rates, "seed": seed} if policy == "replay" else {"role": role}
    try:
        vargs = {"role": user_role} if view == "simuser-llm" else {}
        cfg = SampleConfig(view=Component(name=view, args=vargs), harness=Component(name=harness, args={"workspace_dir": str(openclaw_workspace)}
                                                                  if openclaw_workspace is not None else {}),
                           policy=Component(name=policy, args=pargs), methods=tuple(method), ks=tuple(k), seed=seed,
                           concurrency=concurrency)
    except ValidationError as err:
        e = err.errors()[0]
        _fail("--" + str(e["loc"][0]).rstrip("s").replace("_", "-"), _pydantic_msg(e))
    if env == "bfcl":
        try:
            from treadle.weft.rollouts.bfcl_tasks import from_bfcl

            base_tasks = from_bfcl(bfcl_category, limit=bfcl_limit, disclosure=disclosure)
        except ModuleNotFoundError as err:
            _fail("--env", f"bfcl needs the bfcl-eval package, not installed here ({err.name or err}): "
                           f"pip install --no-deps bfcl-eval")
        except ValueError as err:
            _fail("--bfcl-category", str(err))
    else:
        base_tasks = from_shop(disclosure)
    try:
        tasks = replicate(base_tasks, replicas)
    except ValidationError as err:
        e = err.errors()[0]
        _fail("--" + str(e["loc"][0]).rstrip("s").replace("_", "-"), _pydantic_msg(e))
    except ValueError as err:
        _fail("--replicas", str(err))
    # the run-folder rule (run.json): what changes the trajectories is the config; concurrency may change
    run_config = {**cfg.model_dump(mode="json"), "env": env, "disclosure": disclosure, "replicas": replicas,
                  **({"bfcl_category": bfcl_category, "bfcl_limit": bfcl_limit} if env == "bfcl" else {})}
    try:
        run = open_run(run_dir, command="weft sample", config=run_config, overwrite=overwrite, ignore=("concurrency",))
    except click.exceptions.UsageError as err:  # names --out (RUN_DIR is its positional form)
        usage_exit(err.message)

    if llm_roles:  # the endpoints answer, before the run folder is touched
        from treadle.llm import LLMClient
        from treadle.llm.backends import EndpointError

        async def probe():
            async with LLMClient(llm_cfg) as probe_client:
                for _, r in llm_roles:
                    try:
                        await probe_client.probe(r)
                    except EndpointError as err:
                        return f"role {r!r}: {err}".replace("\n", " ")
            return None

        bad = anyio.run(probe)
        if bad is not None:
            _fail("--llm-config", bad)

    async def go():
        on_ray = {"ray_address": ray, "ray_workers": ray_workers, "llm_config": llm_cfg} if ray is not None else {}
        if not llm_roles:
            return await sample_async(run_dir, tasks, cfg, console=console, **on_ray)
        from treadle.llm import LLMClient

        async with LLMClient(llm_cfg, cache=run_dir / "llm_cache.sqlite",
                             ledger=run_dir / "llm_ledger.jsonl") as client:
            return await sample_async(run_dir, tasks, cfg, client=client, console=console, **on_ray)
    try:
        # usage errors found once the run started (no Ray cluster, bad component arguments) are recorded in
        # run.json as refused (the corrected command may reuse the folder), then printed as one line
        with recorded(run, console, saved=lambda: f"every finished rollout ({run_dir / 'trajectories.jsonl'})",
                      resumable=True):
            try:
                trs = anyio.run(go)
            except ConnectionError as err:
                from treadle.ray_cluster import no_cluster_message

                raise usage_error(f"--ray: {no_cluster_message(ray, err)}") from None
            except (ConfigMismatchError, RunDirError) as err:
                raise usage_error(f"{dir_flag}: {err}") from None
            except DependencyCycleError as err:
                raise usage_error(f"--env: {err}") from None
            except ValueError as err:  # component arguments, raised before any rollout
                msg = str(err)
                flag = "--rate" if "perturbation" in msg else "--role" if "role" in msg else "--policy"
                raise usage_error(f"{flag}: {msg}") from None
            rows = summarize(trs)
            write_jsonl(rows, run_dir / "metrics.jsonl")
            print_table(rows, console)
            plot_summary(rows, run_dir / "summary.png")
            if sft:
                n = write_sft([t for t in trs if t.accepted and t.method == "prefix"], run_dir / "sft.jsonl")
                console.print(f"{n} accepted trajectories -> {run_dir / 'sft.jsonl'}")
    except click.exceptions.UsageError as err:
        usage_exit(err.message)
