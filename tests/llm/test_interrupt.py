"""Ctrl-C mid-batch leaves cache and ledger consistent, and the next run resumes from the cache."""
import signal
import subprocess
import sys
import time

from treadle.llm import Cache, read_ledger

from .conftest import default_sigint

BATCH = """
import asyncio, sys
from treadle.llm import LLMClient, LLMConfig
base_url, d = sys.argv[1], sys.argv[2]
cfg = LLMConfig.single("fake-model", base_url, max_concurrency=2, sampling={"temperature": 1.0, "seed": 0})
async def main():
    async with LLMClient(cfg, cache=d + "/c.sqlite", ledger=d + "/l.jsonl") as llm:
        out = await llm.sample([{"role": "user", "content": "q"}], 30, tag="batch")
    print("done", sum(r.cached for r in out), flush=True)
asyncio.run(main())
"""


def test_ctrl_c_mid_batch_then_resume(fake, tmp_path):
    fake.default_delay = 0.2
    proc = subprocess.Popen([sys.executable, "-c", BATCH, fake.base_url, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)
    ledger = tmp_path / "l.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if ledger.exists() and len(ledger.read_text().splitlines()) >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the batch finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) != 0
    recs = read_ledger(ledger)
    cache = Cache(tmp_path / "c.sqlite")
    assert cache.check()
    done = {r.key for r in recs if r.ok}
    assert 6 <= len(done) < 30 and len(recs) == len(done)
    assert set(cache.keys()) == done  # every stored entry is accounted, and nothing accounted is missing

    sent_before = len(fake.requests)
    fake.default_delay = 0.0
    out = subprocess.run([sys.executable, "-c", BATCH, fake.base_url, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["done", str(len(done))]
    assert len(fake.requests) - sent_before == 30 - len(done)  # only the missing samples were paid for
    assert len(Cache(tmp_path / "c.sqlite")) == 30 and len(read_ledger(ledger)) == len(recs) + 30
