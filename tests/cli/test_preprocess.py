"""python -m flame.cli.preprocess (flame.utils.preprocess) with upstream flame's options: token shards flame trains from, one folder per
dataset, the training flags printed, upstream's options without meaning here each a notice, hub tokenizers from
the cache."""

import json

from flame.cli import preprocess
from flame.data.shards import INDEX_FILE
from tests.data.helpers import numbered_texts, write_jsonl
from tests.utils.helpers import TOKENIZER
from tests.utils.hub_cache import add_to_cache


def test_two_datasets_with_upstream_options(tmp_path, capsys):
    write_jsonl(tmp_path / "a" / "train.jsonl.gz", numbered_texts(20))
    write_jsonl(tmp_path / "b" / "train.jsonl.gz", numbered_texts(7, start=100))
    out = tmp_path / "tokens"
    argv = ["--dataset", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--data_probs", "0.7,0.3",
            "--path", str(out), "--tokenizer", str(TOKENIZER), "--batch_size", "4",
            "--streaming", "--num_workers", "8", "--seed", "42"]  # fmt: skip
    assert preprocess.main(argv) == 0
    captured = capsys.readouterr()
    assert [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("notice")] == [
        "notice"
    ] * 3
    assert "--streaming has no effect" in captured.err and "--seed has no effect" in captured.err
    documents = [json.loads((out / d / INDEX_FILE).read_text())["splits"]["train"]["documents"] for d in "01"]
    assert documents == [20, 7]
    assert captured.out.splitlines()[-1] == (
        f"train from it with: --training.dataset {out}/0,{out}/1 --training.dataset_split train,train "
        f"--training.data_probs 0.7,0.3 --model.tokenizer_path {TOKENIZER}"
    )


def test_one_dataset_with_a_hub_tokenizer_from_the_cache(offline_cache, tmp_path, capsys):
    add_to_cache(
        offline_cache, "acme/tok", {n: TOKENIZER / n for n in ("tokenizer.json", "tokenizer_config.json")}
    )
    write_jsonl(tmp_path / "a" / "train.jsonl.gz", numbered_texts(5))
    argv = [
        "--dataset",
        str(tmp_path / "a"),
        "--dataset_name",
        "",
        "--path",
        str(tmp_path / "t"),
        "--tokenizer",
    ]
    assert preprocess.main([*argv, "acme/tok"]) == 0
    assert json.loads((tmp_path / "t" / INDEX_FILE).read_text())["splits"]["train"]["documents"] == 5
    assert capsys.readouterr().err == ""
    assert preprocess.main([*argv, "acme/absent"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: tokenizer 'acme/absent' is not a local path and not in the HF"
    )
