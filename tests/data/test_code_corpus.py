"""scripts/build_code_corpus.py: the Python files of a site folder as a train/validation corpus."""

import gzip
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_code_corpus", REPO / "scripts" / "build_code_corpus.py")
build_code_corpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_code_corpus)


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def test_files_in_path_order_split_by_hash_up_to_the_character_budget(tmp_path):
    site = tmp_path / "site"
    texts = {f"pkg{i % 3}/mod{i:02d}.py": f"# module {i}\n" + "x = 1\n" * (200 + i) for i in range(40)}
    for name, text in texts.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    (site / "small.py").write_text("y = 2\n")  # under 1 kB: left out
    budget = 20_000
    files, chars = build_code_corpus.build(site, tmp_path / "out", chars=budget)

    names, total = [], 0
    for name in sorted(texts):  # up to and including the file that passes the budget
        names, total = names + [name], total + len(texts[name])
        if total > budget:
            break
    assert (files, chars) == (len(names), total) and len(names) < len(texts)
    validation = [n for n in names if build_code_corpus.is_validation(n)]
    assert read(tmp_path / "out" / "validation.jsonl.gz") == [texts[n] for n in validation]
    assert read(tmp_path / "out" / "train.jsonl.gz") == [texts[n] for n in names if n not in validation]
    again = build_code_corpus.build(site, tmp_path / "again", chars=budget)
    assert again == (files, chars)
    assert read(tmp_path / "again" / "train.jsonl.gz") == read(tmp_path / "out" / "train.jsonl.gz")
