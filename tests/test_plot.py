"""python -m flame.plot: curves of several runs from their TensorBoard event files into one PNG."""

import math

import pytest

from flame.plot import main, read_scalars, smoothed

pytest.importorskip("matplotlib")


def write_run(folder, curve, launches=((1, 30),)):
    """Event files as flame writes them: <run>/tb/<launch>/, one folder per launch (a resume repeats steps)."""
    from torch.utils.tensorboard import SummaryWriter

    for i, (first, last) in enumerate(launches):
        with SummaryWriter(str(folder / "tb" / f"2026112{i}-0000")) as writer:
            for step in range(first, last + 1):
                writer.add_scalar("loss/train", curve(step) + i * 1e-3, step)
                writer.add_scalar("lr", 1e-3 * min(1.0, step / 5), step)
                if step % 10 == 0:
                    writer.add_scalar("loss/validation", curve(step) + 0.1, step)


def test_two_runs_into_one_png(tmp_path, capsys):
    write_run(tmp_path / "softpick", lambda s: 8 * math.exp(-s / 20) + 3)
    write_run(tmp_path / "vanilla", lambda s: 8 * math.exp(-s / 25) + 3, launches=((1, 20), (16, 30)))
    out = tmp_path / "curves.png"
    code = main([str(tmp_path / "softpick"), str(tmp_path / "vanilla"), "--out", str(out),
                 "--metrics", "loss/train,loss/validation,lr,grad_norm", "--smooth", "0.5"])  # fmt: skip
    assert code == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert "wrote" in capsys.readouterr().out  # grad_norm was never logged: left out, not an error
    # The resumed run's second launch overrides the steps it repeated.
    vanilla = read_scalars(tmp_path / "vanilla")["loss/train"]
    assert sorted(vanilla) == list(range(1, 31))
    assert vanilla[18] == pytest.approx(8 * math.exp(-18 / 25) + 3 + 1e-3, rel=1e-6)


def test_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == f"error: run folder {tmp_path / 'missing'} does not exist"
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no TensorBoard event files under" in capsys.readouterr().err


def test_smoothing_is_tensorboards_debiased_ema():
    assert smoothed([1.0, 2.0, 3.0], 0.0) == [1.0, 2.0, 3.0]
    assert smoothed([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])
