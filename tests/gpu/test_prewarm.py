"""The kernel prewarm on a GPU (flame/train/prewarm.py): after ``python -m flame.train.prewarm`` has run a job's
blocks into an empty Triton cache, the job's rank (train.sh, compiled, with its own prewarm off) compiles none of
FLA's or flame's Triton kernels itself: every one it calls is a hit in that cache. Triton's compile listener
(``triton.knobs.compilation.listener``) reports each kernel the rank asks for, installed by a sitecustomize module
on the rank's PYTHONPATH."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LISTENER = """
import json, os, sys, importlib.abc, importlib.util

def listener(src, metadata, metadata_group, times, cache_hit):
    with open(os.environ["FLAME_TEST_COMPILE_LOG"], "a") as log:
        log.write(json.dumps({"module": getattr(src.fn, "module", ""), "name": src.name, "hit": cache_hit}) + "\\n")

class AfterTritonKnobs(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "triton.knobs":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.compilation.listener = listener

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, AfterTritonKnobs())
"""


def test_the_rank_finds_every_kernel_the_prewarm_compiled(tmp_path):
    config = json.loads((REPO / "configs" / "gated_deltanet_340M.json").read_text())
    config.update(num_hidden_layers=2, vocab_size=4096, fuse_cross_entropy=False)
    (tmp_path / "model.json").write_text(json.dumps(config))
    flags = ["--model.config", str(tmp_path / "model.json"), "--training.seq_len", "2048",
             "--training.batch_size", "2", "--compile.enable"]  # fmt: skip
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(LISTENER)
    log = tmp_path / "compiles.jsonl"
    env = {**os.environ, "NGPU": "1", "FLAME_EXPORT_HF": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "TRITON_CACHE_AUTOTUNING": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip

    prewarm = subprocess.run([sys.executable, "-m", "flame.train.prewarm", *flags], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=500)  # fmt: skip
    assert prewarm.returncode == 0, prewarm.stdout[-3000:] + prewarm.stderr[-3000:]
    assert "gated_deltanet: layers 0 (GatedDeltaNet) forward and backward at 2 x 2048, traced by dynamo" in (
        prewarm.stdout
    )

    rank_env = {**env, "FLAME_PREWARM": "0", "FLAME_TEST_COMPILE_LOG": str(log),
                "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])}  # fmt: skip
    train = subprocess.run(
        ["bash", str(REPO / "train.sh"), "--job.dump_folder", str(tmp_path / "dump"), "--training.steps", "1",
         "--checkpoint.no-enable", *flags],
        env=rank_env, cwd=REPO, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    ours = [call for call in calls if call["module"].startswith(("fla.", "flame."))]
    assert len(ours) >= 10  # the gated delta rule's forward and backward, the short conv, the norms
    assert [call["name"] for call in ours if not call["hit"]] == []
