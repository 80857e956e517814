"""A real-LLM run of the WEFT evolution commands (not a test: minutes on a 2-core CPU).

Serves the tiny UNTRAINED checkpoint with ``transformers serve`` (``treadle.llm.local_server``, loopback, no
network) and drives, over HTTP, the three commands that ask LLM roles:

1. ``treadle weft synth --docs --requirement --llm-config`` (roles designer, schema, backend, checker);
2. ``treadle weft evolve --synth DIR --tasks F --backend BROKEN --llm-config`` (roles backend, grounder, verifier);
3. ``treadle weft evolve --llm-config`` on the offline drill (roles grounder, verifier, composer).

The model writes junk: the point is that every call goes over HTTP, each junk answer is recorded and attributed
to its stage / component, no command crashes, and nothing accepted earlier is lost (the drill still repairs what
the deterministic path decides; the synthesised backend stays as it was). Prints one summary line per command.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python tests/weft/evolve/real_llm_run.py OUT_DIR [MAX_TOKENS]``
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import synth_script as S
from treadle.llm import local_server
from treadle.llm.tiny_checkpoint import save_untrained_checkpoint


def cli(*args):
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "treadle.cli", *args], capture_output=True, text=True, timeout=3000,
                       check=False)
    return p.returncode, p.stdout + p.stderr, time.time() - t


def main(out: Path, max_tokens: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path, _ = save_untrained_checkpoint(out / "ckpt")
    t0 = time.time()
    with local_server(path, startup_timeout_s=600, log=out / "server.log") as srv:
        print(f"server up in {time.time() - t0:.1f} s at {srv.base_url}", flush=True)
        roles = ("designer", "schema", "backend", "checker", "grounder", "verifier", "composer")
        cfg = out / "llm.toml"
        cfg.write_text("".join(f'[roles.{r}]\nmodel = "{srv.model}"\nbase_url = "{srv.base_url}"\nmax_retries = 0\n'
                               f'timeout_s = 600\nsampling = {{ temperature = 0.0, max_tokens = {max_tokens} }}\n'
                               for r in roles))
        docs = out / "docs.txt"
        docs.write_text(S.DOCS)
        rc, text, dt = cli("weft", "synth", "--docs", str(docs), "--requirement", S.REQUIREMENT, "--llm-config",
                           str(cfg), "--out", str(out / "synth"), "--max-rounds", "1")
        (out / "synth.txt").write_text(text)
        print(f"[weft synth] exit {rc} in {dt:.1f} s", flush=True)
        synth = out / "library"
        synth.mkdir(exist_ok=True)
        (synth / "result.json").write_text(S.result().model_dump_json(by_alias=True))
        tasks = out / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"name": t.name, "request": t.request, "gold": [
            {"name": c.name, "arguments": c.arguments} for c in t.checkpoint.gold_calls]}) + "\n"
            for t in (S.LEND, S.ADD)))
        broken = out / "broken.py"
        broken.write_text(S.BROKEN)
        rc, text, dt = cli("weft", "evolve", "--synth", str(synth), "--tasks", str(tasks), "--backend", str(broken),
                           "--llm-config", str(cfg), "--out", str(out / "evolve-synth"), "--rate", "wrong_argument=0",
                           "--k", "1", "--max-rounds", "2", "--revise-attempts", "1")
        (out / "evolve-synth.txt").write_text(text)
        print(f"[weft evolve --synth] exit {rc} in {dt:.1f} s", flush=True)
        rc, text, dt = cli("weft", "evolve", "--llm-config", str(cfg), "--out", str(out / "evolve-drill"),
                           "--max-rounds", "2", "--revise-attempts", "1")
        (out / "evolve-drill.txt").write_text(text)
        print(f"[weft evolve drill] exit {rc} in {dt:.1f} s", flush=True)
    print(f"total {time.time() - t0:.1f} s; outputs in {out}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 48)
