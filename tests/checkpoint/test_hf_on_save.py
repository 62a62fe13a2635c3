"""--checkpoint.convert_to_hf_on_save (the softpick fork's flag): every checkpoint gets an HF export beside it,
written in the background on rank 0, removed with its checkpoint by keep_latest_k; a failed export is one warning
and the run goes on."""

from pathlib import Path

import flame.hf.export


def files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_each_checkpoint_has_its_export_beside_it_and_retention_removes_both(train, tmp_path):
    from transformers import AutoModelForCausalLM

    dump = tmp_path / "run"
    flags = [
        "--checkpoint.convert_to_hf_on_save",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
    ]
    status, log = train(dump, *flags, "--training.steps", "6")
    assert status == 0, log
    checkpoint = dump / "checkpoint"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step-4", "step-4-hf", "step-6", "step-6-hf"]
    for step in (4, 6):
        flame.hf.export.export_checkpoint(dump, step, tmp_path / f"export-{step}")
        assert files(checkpoint / f"step-{step}-hf") == files(tmp_path / f"export-{step}")
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "step-6-hf")
    assert sum(p.numel() for p in model.parameters()) > 0

    # A resumed run (same dump folder) goes on exporting and pruning.
    status, log = train(dump, *flags, "--training.steps", "8")
    assert status == 0, log
    assert sorted(p.name for p in checkpoint.iterdir()) == ["step-6", "step-6-hf", "step-8", "step-8-hf"]


def test_a_failed_export_is_one_warning_and_the_run_finishes(train, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full\nsecond line")

    monkeypatch.setattr(flame.hf.export, "export_checkpoint", fail)
    dump = tmp_path / "run"
    status, log = train(
        dump, "--checkpoint.convert_to_hf_on_save", "--checkpoint.interval", "2", "--training.steps", "2"
    )
    assert status == 0, log
    assert "HF export of checkpoint step-2 failed (RuntimeError: disk full); training goes on" in log
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
