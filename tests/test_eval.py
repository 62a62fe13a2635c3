"""python -m flame.eval (flame/eval.py, flame/evaluation.py): lm-eval on a dump folder's checkpoint with the task
shipped in flame/assets/eval, on CPU without network; bad input is one line and exit code 2."""

import json

import pytest

from flame import eval as eval_cli
from flame import evaluation
from tests.utils.helpers import save_checkpoint, tiny_model

pytest.importorskip("lm_eval", reason='the eval extra: pip install -e ".[eval]"')
TASK = "flame_corpus_last_word"


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A tiny Gated DeltaNet hybrid (recurrent and attention layers) saved as a dump folder's checkpoint."""
    dump = tmp_path_factory.mktemp("eval") / "dump"
    save_checkpoint(dump, tiny_model("gated_deltanet", attn={"layers": [1], "num_heads": 4}), step=3)
    return dump


def scores(folder) -> dict:
    return json.loads((folder / "results.json").read_text())["results"][TASK]


def test_a_dump_folder_is_exported_and_scored_offline_the_same_at_any_batch_size(dump, tmp_path, capsys):
    assert eval_cli.main([str(dump), "--tasks", TASK, "--limit", "12", "--batch_size", "5"]) == 0
    results = dump / "eval" / "step-3"
    assert (results / "hf" / "config.json").is_file() and TASK in (results / "results.md").read_text()
    batched = scores(results)
    assert 0 <= batched["acc,none"] <= 1 and batched["perplexity,none"] > 1
    # The export folder itself, one example per batch: lm-eval pads batches, which must not change a score.
    single = tmp_path / "single"
    argv = [
        str(results / "hf"),
        "--tasks",
        TASK,
        "--limit",
        "12",
        "--batch_size",
        "1",
        "--output",
        str(single),
    ]
    assert eval_cli.main(argv) == 0
    assert scores(single)["acc,none"] == batched["acc,none"]
    assert scores(single)["perplexity,none"] == pytest.approx(batched["perplexity,none"], rel=1e-5)
    assert "Results:" in capsys.readouterr().out


def test_an_unknown_task_is_one_line_before_any_export(tmp_path, capsys):
    dump = tmp_path / "dump"
    save_checkpoint(dump, tiny_model("transformer"), step=2)
    assert eval_cli.main([str(dump), "--tasks", f"{TASK},no_such_task"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown lm-eval task no_such_task")
    assert not (dump / "eval").exists()


def test_without_lm_eval_the_line_says_what_to_install(dump, monkeypatch, capsys):
    real = evaluation.importlib.util.find_spec
    monkeypatch.setattr(
        evaluation.importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    assert eval_cli.main([str(dump), "--tasks", TASK]) == 2
    assert capsys.readouterr().err.strip() == (
        'error: lm-evaluation-harness is not installed: pip install -e ".[eval]" '
        '(or pip install "lm-eval[hf]==0.4.13")'
    )


def test_a_folder_that_is_no_model_is_refused(tmp_path, capsys):
    assert eval_cli.main([str(tmp_path), "--tasks", TASK]) == 2
    assert "neither an HF model folder" in capsys.readouterr().err
