"""bench/speed.py: the speed table's rows from its parts' results, and a tiny run of train.sh's part on the CPU."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import speed  # noqa: E402


def profiler_table(*rows: tuple[str, str]) -> str:
    """torch.profiler's key_averages table (the columns train_throughput prints) with the step's region first."""
    rule = "-" * 70 + "  " + "  ".join(["-" * 12] * 10)
    header = ["Name", "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "Self CUDA",
              "Self CUDA %", "CUDA total", "CUDA time avg", "# of Calls"]  # fmt: skip
    lines = [rule, "  ".join(f"{h:>12}" for h in header), rule]
    for name, cuda in (("flame.forward_backward", "190.000ms"), *rows):
        cells = [
            name,
            "1.00%",
            "1.000ms",
            "2.00%",
            "2.000ms",
            "10.000us",
            cuda,
            "30.00%",
            cuda,
            "1.000ms",
            "24",
        ]
        lines.append(f"{cells[0]:>70}  " + "  ".join(f"{c:>12}" for c in cells[1:]))
    return "\n".join([*lines, rule, "Self CPU time total: 100.000ms"])


def result(model, mode, tokens_per_s, **fields):
    return {"model": model, "mode": mode, "tokens_per_s": tokens_per_s, "error": "", "profile": "", **fields}


PARTS = {
    "throughput": {"mode": "compiled", "results": [
        result("transformer", "compiled", 160_000.0, profile=profiler_table(("gemm", "45.4ms"), ("attention backward", "11.6ms"), ("adamw", "4ms"))),
        result("transformer", "naive HF loop", 80_000.0),
        result("gated_deltanet", "compiled", 85_000.0, profile=profiler_table(("chunk_bwd", "57ms"), ("gemm", "66ms"), ("conv", "9ms")),
               timelines=["GPU timeline per step: 248.7 ms from first to last kernel; compute kernels running 189.0 ms; idle 59.7 ms"],
               graph_breaks=84),
        result("gated_deltanet", "naive HF loop", 70_000.0),
        result("hybrid", "compiled", 150_000.0),
    ]},
    "train_sh": {"shape": "8 x 2048", "models": {
        "transformer": {"tokens_per_s": 158_400.0, "data_share": 0.002, "mfu": 43.5},
        "gated_deltanet": {"tokens_per_s": 84_000.0, "data_share": 0.0, "mfu": 28.0},
        "hybrid": {"error": "exit status 1: CUDA out of memory"},
    }},
    "torchtitan": {"tokens_per_s": 120_000.0},
    "first_step": {"models": {
        "gated_deltanet": {"seconds": {"fresh": 199.7, "fresh, shipped tuning, no prewarm": 75.0,
                                       "fresh, shipped tuning": 65.5, "warm": 33.4},
                           "phases": {"fresh, shipped tuning": {"start": 9.5, "setup": 2.0, "step 1": 54.0}}},
        "transformer": {"seconds": {"fresh": float("nan"), "fresh, shipped tuning": 42.1, "warm": 34.2},
                        "notes": {"fresh": "no step within 110 s"}},
    }},
    "long_context": {"results": [
        {"model": "transformer", "seq_len": 65536, "activations": "full", "tokens_per_s": 82_619.0, "peak_gib": 18.6,
         "error": ""},
        {"model": "hybrid", "seq_len": 65536, "activations": "offload", "tokens_per_s": float("nan"),
         "peak_gib": float("nan"), "error": "failed: BackendCompilerFailed"},
    ], "status": 124},
    "tokens_to_loss": {"runs": {
        "AdamW": {"tokens_per_step": 16384.0, "validation": {"600": [80.0, 3.4], "1200": [156.8, 2.956]}},
        "Muon": {"tokens_per_step": 16384.0, "validation": {"600": [128.9, 2.9], "1200": [250.0, 1.98]}},
    }},
}  # fmt: skip


def by_measurement(rows):
    return {row[1].split(":")[0] + " " + row[0]: row for row in rows}


def test_each_item_is_its_measurement_beside_its_anchor_target_and_verdict():
    rows = by_measurement(speed.rows(json.loads(json.dumps(PARTS))))  # as read back from --json

    transformer_sh = rows["transformer 1"]
    assert transformer_sh[2:] == ["158,400 (0.20%)", "bench, random tokens: 160,000", "0.990",
                                  ">= 0.97, data < 1%", "yes"]  # fmt: skip
    assert rows["gated_deltanet 1"][4] == "0.988" and rows["gated_deltanet 1"][6] == "yes"
    assert rows["hybrid 1"][2] == "exit status 1: CUDA out of memory" and rows["hybrid 1"][6] == "no"

    first_step = rows["gated_deltanet 2"]
    assert first_step[2:] == ["65.5 (33.4)", "no kernel prewarm: 75.0; fresh, no shipped tuning: 199.7",
                              "3.05x faster", "< 60 s",
                              "no: 5.5 s over (start 9.5 + setup 2.0 + step 1 54.0 s)"]  # fmt: skip
    assert rows["transformer 2"][2:] == [
        "42.1 (34.2)",
        "no kernel prewarm: n/a; fresh, no shipped tuning: no step within 110 s",
        "> 2.61x faster",  # at least: the fresh launch gave no step within its 110 s
        "",
        "",
    ]  # no target for the transformer

    gdn = rows["gated_deltanet 3"]
    assert gdn[2:5] == ["84,000", "naive HF loop: 70,000", "1.20x"]
    assert gdn[6] == (
        "no: 70% of it (GPU idle 60 of 249 ms; 84 graph breaks; top kernels: chunk_bwd 57ms; gemm 66ms; conv 9ms)"
    )
    assert rows["hybrid 3"][2] == "n/a" and rows["hybrid 3"][6] == "not measured"

    mfu = rows["transformer 4"]
    assert mfu[2:5] == [
        "43.5% (158,400)",
        "torchtitan's trainer: 120,000; naive HF loop: 80,000",
        "1.32x torchtitan's",
    ]
    assert mfu[6].startswith("no: 87% of it (top kernels: gemm 45.4ms;")

    # Every model in every activation mode has a row: the cases the bench's launch did not reach say so.
    long_context = {row[1]: row for row in speed.rows(PARTS) if row[0] == "5"}
    assert list(long_context) == [f"{model}: batch 1 x 65536, {mode} activations"
                                  for model in speed.MODELS for mode in ("full", "offload")]  # fmt: skip
    assert long_context["transformer: batch 1 x 65536, full activations"][2::4] == [
        "82,619 tokens/s, 18.6 GiB",
        "yes",
    ]
    assert long_context["hybrid: batch 1 x 65536, offload activations"][2::4] == [
        "failed: BackendCompilerFailed",
        "no",
    ]
    assert long_context["gated_deltanet: batch 1 x 65536, full activations"][2::4] == [
        "no result: the bench stopped before this case (its launch reached the time limit, --timeout_s)", "no"]  # fmt: skip

    (t2l,) = [row for row in speed.rows(PARTS) if row[0] == "6"]
    assert t2l[1].startswith("Muon: tokens (seconds) to validation loss 2.956")
    assert t2l[2:5] == ["9,830,400 (128.9 s)", "AdamW: 19,660,800 (156.8 s)", "0.50x the tokens"]


def test_long_context_runs_one_launch_per_model_and_a_missing_case_names_its_launchs_end(
    tmp_path, monkeypatch
):
    launched = []

    def throughput_bench(args, work, name, flags):
        model = flags[flags.index("--models") + 1]
        launched.append((name, model, flags[flags.index("--activations") + 1]))
        if model == "hybrid":
            return {"error": "exit status 1: CUDA out of memory"}
        cases = [{"model": model, "seq_len": 512, "activations": "full", "tokens_per_s": 10.0, "peak_gib": 1.0,
                  "error": ""}]  # fmt: skip
        return {"results": cases, "status": 124 if model == "gated_deltanet" else 0}

    monkeypatch.setattr(speed, "throughput_bench", throughput_bench)
    part = speed.part_long_context(speed.parse(["--tiny", "--device", "cpu", "--json", "x.json"]), tmp_path)
    assert launched == [(f"long_context_{model}", model, "full,offload") for model in speed.MODELS]
    rows = {row[1]: row[2] for row in speed.rows({"long_context": json.loads(json.dumps(part))})}
    assert rows["transformer: batch 1 x 512, full activations"] == "10 tokens/s, 1.0 GiB"
    assert rows["transformer: batch 1 x 512, offload activations"] == (
        "no result: the bench stopped before this case (exit status 0)"
    )
    assert rows["gated_deltanet: batch 1 x 512, offload activations"] == (
        "no result: the bench stopped before this case (its launch reached the time limit, --timeout_s)"
    )
    assert rows["hybrid: batch 1 x 512, full activations"] == (
        "no result: the bench stopped before this case (exit status 1: CUDA out of memory)"
    )
    part["launches"]["hybrid"] = "exit status -9"  # the process killed (the host's out-of-memory killer)
    rows = {row[1]: row[2] for row in speed.rows({"long_context": json.loads(json.dumps(part))})}
    assert rows["hybrid: batch 1 x 512, offload activations"] == (
        "no result: the bench stopped before this case (its launch was killed by SIGKILL (signal 9))"
    )


def every_case_of(model: str) -> dict:
    """A tiny long-context launch's results: both activation modes of ``model``."""
    cases = [{"model": model, "seq_len": 512, "activations": mode, "tokens_per_s": 10.0, "peak_gib": 1.0, "error": ""}
             for mode in speed.LONG_CONTEXT_ACTIVATIONS]  # fmt: skip
    return {"results": cases, "status": 0}


def test_resume_keeps_the_models_a_long_context_run_finished_and_names_both_runs(tmp_path, monkeypatch):
    # A GPU lent for less time than the part takes: the model whose launch reached its limit runs again in a second
    # sitting, the finished ones are kept, and the part names both commands, both dates and both sittings' seconds.
    launched, slow = [], {"gated_deltanet"}

    def throughput_bench(args, work, name, flags):
        model = flags[flags.index("--models") + 1]
        launched.append(model)
        if model in slow:
            return {"error": "exit status 124: step 1"}
        return every_case_of(model)

    monkeypatch.setattr(speed, "throughput_bench", throughput_bench)
    path = tmp_path / "speed.json"
    first = ["--tiny", "--device", "cpu", "--parts", "long_context", "--json", str(path), "--no_write"]
    speed.main(first)
    saved = json.loads(path.read_text())
    for made in saved["parts"]["long_context"]["launch_runs"].values():
        made.update(date="2026-01-01", seconds=50.0)
    path.write_text(json.dumps(saved))
    launched.clear()
    slow.clear()
    second = [*first, "--timeout_s", "500", "--resume"]
    speed.main(second)
    part = json.loads(path.read_text())["parts"]["long_context"]
    assert launched == ["gated_deltanet"]
    assert part["kept"] == ["transformer", "hybrid"]
    assert sorted((r["model"], r["activations"]) for r in part["results"]) == sorted(
        (model, mode) for model in speed.MODELS for mode in speed.LONG_CONTEXT_ACTIVATIONS
    )
    assert part["launches"] == dict.fromkeys(speed.MODELS, "exit status 0")
    assert part["run"] == "; ".join(speed.command_line("bench/speed.py", argv) for argv in (first, second))
    assert part["date"] == f"2026-01-01, {speed.time.strftime('%Y-%m-%d')}" and 100 <= part["seconds"] < 110
    # Without --resume the part is measured again whole and names this run alone.
    launched.clear()
    speed.main(first)
    assert launched == list(speed.MODELS)
    part = json.loads(path.read_text())["parts"]["long_context"]
    assert part["run"] == speed.command_line("bench/speed.py", first) and part["kept"] == []


def test_rerun_launches_a_finished_model_again_and_the_table_names_the_runs_of_the_launches_kept(
    tmp_path, monkeypatch
):
    # Run A measures every model; run B launches the hybrid again; run C GatedDeltaNet. The part then names the runs
    # whose launches it holds, earliest first: A (the transformer's), B, C, each launch with its own run's date and
    # seconds. Launching every model again drops A, B and C.
    launched = []

    def throughput_bench(args, work, name, flags):
        launched.append(flags[flags.index("--models") + 1])
        return every_case_of(launched[-1])

    monkeypatch.setattr(speed, "throughput_bench", throughput_bench)
    path = tmp_path / "speed.json"
    base = ["--tiny", "--device", "cpu", "--parts", "long_context", "--json", str(path), "--no_write"]
    run_a, run_b, run_c = base, [*base, "--rerun", "hybrid"], [*base, "--rerun", "gated_deltanet"]
    speed.main(run_a)
    saved = json.loads(path.read_text())
    for day, made in enumerate(saved["parts"]["long_context"]["launch_runs"].values(), 1):
        made.update(date=f"2026-01-0{day}", seconds=10.0 * day)
    path.write_text(json.dumps(saved))
    launched.clear()
    speed.main(run_b)
    speed.main(run_c)
    assert launched == ["hybrid", "gated_deltanet"]
    part = json.loads(path.read_text())["parts"]["long_context"]
    assert part["kept"] == ["transformer", "hybrid"]
    names = [speed.command_line("bench/speed.py", argv) for argv in (run_a, run_b, run_c)]
    assert [part["launch_runs"][model]["run"] for model in speed.MODELS] == [names[0], names[2], names[1]]
    assert part["run"] == "; ".join(names)
    assert part["date"] == f"2026-01-01, {speed.time.strftime('%Y-%m-%d')}" and 10 <= part["seconds"] < 20
    # The doc names the runs and the dates the part's launches ran.
    lines = speed.run_lines(json.loads(path.read_text()), {5})
    assert lines == [f"- `{part['run']}` (item 5; {part['date']}; torch {speed.torch.__version__}; "
                     f"long_context {part['seconds']:.0f} s)"]  # fmt: skip
    launched.clear()
    speed.main([*base, "--rerun", ",".join(speed.MODELS)])
    assert launched == list(speed.MODELS)
    assert json.loads(path.read_text())["parts"]["long_context"]["run"] == speed.command_line(
        "bench/speed.py", [*base, "--rerun", ",".join(speed.MODELS)]
    )


def test_rerun_names_models_or_optimizers():
    args = speed.parse(["--json", "x.json", "--rerun", "hybrid,Muon"])
    assert args.rerun == ["hybrid", "Muon"] and args.resume
    with pytest.raises(SystemExit):
        speed.parse(["--json", "x.json", "--rerun", "mamba"])


def test_a_long_context_run_stopped_mid_part_keeps_its_finished_launches_for_resume(tmp_path, monkeypatch):
    # A device call's time limit kills the run during the second model's launch: the first model's cases are saved,
    # the table says which launches the run did not reach, and --resume launches only those.
    launched = []

    def throughput_bench(args, work, name, flags):
        model = flags[flags.index("--models") + 1]
        launched.append(model)
        if model == "gated_deltanet" and len(launched) == 2:
            raise KeyboardInterrupt  # the call's end
        return every_case_of(model)

    monkeypatch.setattr(speed, "throughput_bench", throughput_bench)
    path = tmp_path / "speed.json"
    argv = ["--tiny", "--device", "cpu", "--parts", "long_context", "--json", str(path), "--no_write"]
    with pytest.raises(KeyboardInterrupt):
        speed.main(argv)
    part = json.loads(path.read_text())["parts"]["long_context"]
    assert {r["model"] for r in part["results"]} == {"transformer"}
    assert part["run"] == speed.command_line("bench/speed.py", argv)
    rows = {row[1]: row[2] for row in speed.rows({"long_context": part})}
    assert rows["transformer: batch 1 x 512, offload activations"] == "10 tokens/s, 1.0 GiB"
    assert rows["hybrid: batch 1 x 512, full activations"] == (
        f"no result: the bench stopped before this case ({speed.NOT_RUN})"
    )
    launched.clear()
    speed.main([*argv, "--resume"])
    assert launched == ["gated_deltanet", "hybrid"]
    part = json.loads(path.read_text())["parts"]["long_context"]
    assert part["kept"] == ["transformer"] and len(part["results"]) == 6


def test_resume_keeps_the_finished_optimizer_run_of_tokens_to_loss(tmp_path, monkeypatch):
    import tokens_to_loss

    trained = []

    def train(optimizer, t2l):
        trained.append(optimizer)
        return tmp_path / optimizer, 0

    monkeypatch.setattr(tokens_to_loss, "train", train)
    monkeypatch.setattr(
        tokens_to_loss, "curve", lambda dump: {"tokens_per_step": 2.0, "validation": {4: [1.0, 3.0]}}
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl.gz").write_bytes(b"")
    args = speed.parse(
        ["--tiny", "--device", "cpu", "--json", "x.json", "--t2l_dataset", str(tmp_path / "data")]
    )
    adamw = {"tokens_per_step": 2.0, "validation": {"4": [9.0, 2.5]}}
    earlier = {"runs": {"AdamW": adamw, "Muon": "exit status 124: step 700"}}
    progress = []
    part = speed.part_tokens_to_loss(args, tmp_path / "work", earlier, progress.append)
    assert trained == ["Muon"] and part["kept"] == ["AdamW"] and progress[-1]["runs"] == part["runs"]
    assert part["runs"] == {"AdamW": adamw, "Muon": {"tokens_per_step": 2.0, "validation": {"4": [1.0, 3.0]}}}
    trained.clear()
    progress.clear()
    assert speed.part_tokens_to_loss(args, tmp_path / "work", None, progress.append)["kept"] == []
    assert trained == ["AdamW", "Muon"]
    # After the first run the part is saved with the second not yet run: its row says so.
    assert progress[0]["runs"]["Muon"] == speed.NOT_RUN
    assert speed.rows({"tokens_to_loss": progress[0]})[0][1:3] == [
        "tokens to a validation loss: Muon",
        speed.NOT_RUN,
    ]


def test_a_gpus_run_names_itself_after_the_runs_a_resumed_part_kept():
    assert speed.renamed("python a; python w --gpu0", "python w --gpu0", "python g --gpus 2") == (
        "python a; python g --gpus 2"
    )
    assert speed.renamed("python w --gpu0", "python w --gpu0", "python g --gpus 2") == "python g --gpus 2"


def test_offloading_rows_stand_beside_full_checkpointing_of_the_same_launch():
    def case(model, activations, tokens_per_s, peak_gib, error="", host_gib=None):
        return {"model": model, "seq_len": 65536, "activations": activations, "tokens_per_s": tokens_per_s,
                "peak_gib": peak_gib, "error": error, "host_gib": host_gib}  # fmt: skip

    part = {"results": [case("transformer", "full", 74_988.0, 18.6),
                        case("transformer", "offload", 37_428.0, 24.7, host_gib=38.25),
                        case("hybrid", "full", 1.0, 1.0, error="failed: OOM"), case("hybrid", "offload", 2.0, 2.0)],
            "launches": dict.fromkeys(speed.MODELS, "exit status 0")}  # fmt: skip
    rows = {row[1]: row[2:5] for row in speed.rows({"long_context": part})}
    assert rows["transformer: batch 1 x 65536, offload activations"] == [
        "37,428 tokens/s, 24.7 GiB + 38.2 GiB of host memory",
        "full checkpointing: 74,988 tokens/s, 18.6 GiB",
        "0.50x the tokens/s, +6.1 GiB",
    ]
    assert rows["transformer: batch 1 x 65536, full activations"][1:] == ["", ""]
    assert rows["hybrid: batch 1 x 65536, offload activations"][1:] == [
        "",
        "",
    ]  # no full result to stand beside


def test_only_the_parts_measured_have_rows_and_a_failed_part_says_why():
    assert speed.rows({}) == []
    rows = speed.rows(
        {"long_context": {"error": "exit status 1: boom"}, "tokens_to_loss": {"error": "no dataset"}}
    )
    assert [(row[0], row[2], row[6]) for row in rows] == [
        ("5", "exit status 1: boom", "no"),
        ("6", "no dataset", "no"),
    ]
    table = speed.table(speed.row_lines({"tokens_to_loss": {"error": "a | b"}}))
    assert table.splitlines()[-1] == "| 6 | tokens to a validation loss | a \\| b |  |  |  | no |"


@pytest.mark.slow
def test_train_sh_part_runs_each_model_and_keeps_other_parts(tmp_path):
    state = tmp_path / "speed.json"
    state.write_text(json.dumps({"parts": {"torchtitan": {"tokens_per_s": 1.0}}}))
    assert speed.main(["--tiny", "--device", "cpu", "--parts", "train_sh", "--json", str(state), "--no_write",
                       "--steps", "4", "--skip_steps", "1"]) == 0  # fmt: skip
    parts = json.loads(state.read_text())["parts"]
    assert parts["torchtitan"] == {"tokens_per_s": 1.0}
    assert parts["train_sh"]["shape"] == "2 x 64"
    for model in speed.MODELS:
        run = parts["train_sh"]["models"][model]
        assert run["lines"] == 3 and run["tokens_per_s"] > 0 and 0 <= run["data_share"] <= 1


def test_first_step_part_runs_every_case_for_each_bench_model(tmp_path, monkeypatch):
    launched = []

    def measure_model(name, args, work):
        launched.append((name, args.cases))
        return {"model": name, "seconds": {}, "notes": {}, "phases": {}}

    monkeypatch.setattr(speed, "measure_model", measure_model)
    args = speed.parse(
        ["--tiny", "--device", "cpu", "--parts", "first_step", "--json", str(tmp_path / "s.json")]
    )
    models = ["gated_deltanet", "transformer", "hybrid"]
    assert list(speed.part_first_step(args, tmp_path)["models"]) == models
    cases = ["fresh", "fresh, shipped tuning, no prewarm", "fresh, shipped tuning", "warm"]
    assert launched == [(model, cases) for model in models]


def test_first_step_resume_keeps_the_models_with_every_case_and_launches_the_rest(tmp_path, monkeypatch):
    launched, stop_after = [], {"transformer"}

    def measure_model(name, args, work):
        (work / name).mkdir(parents=True)  # as bench/first_step.py does: a stopped launch leaves its folder
        launched.append(name)
        if name in stop_after:
            raise KeyboardInterrupt  # the device call's time limit, mid-model
        return {"model": name, "seconds": dict.fromkeys(args.cases, 9.0), "notes": {}, "phases": {}}

    monkeypatch.setattr(speed, "measure_model", measure_model)
    path = tmp_path / "speed.json"
    base = ["--tiny", "--device", "cpu", "--parts", "first_step", "--json", str(path), "--no_write",
            "--work", str(tmp_path / "work")]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        speed.main(base)
    part = json.loads(path.read_text())["parts"]["first_step"]
    assert part["models"]["gated_deltanet"]["seconds"]["warm"] == 9.0
    assert part["models"]["transformer"] == part["models"]["hybrid"] == {"error": speed.NOT_RUN}
    rows = by_measurement(speed.rows({"first_step": part}))
    assert rows["hybrid 2"][2] == speed.NOT_RUN and rows["hybrid 2"][6] == "no"
    stop_after.clear()
    launched.clear()
    speed.main([*base, "--resume"])
    part = json.loads(path.read_text())["parts"]["first_step"]
    assert launched == ["transformer", "hybrid"] and part["kept"] == ["gated_deltanet"]
    assert all(row["seconds"]["fresh"] == 9.0 for row in part["models"].values())
    launched.clear()
    speed.main([*base, "--rerun", "hybrid"])
    assert launched == ["hybrid"]


def test_without_train_sh_items_3_and_4_come_from_the_bench():
    # A run cut by its time limit before train.sh's part still says what the bench measured, and says so.
    parts = json.loads(json.dumps({key: PARTS[key] for key in ("throughput", "torchtitan")}))
    for result in parts["throughput"]["results"]:
        result.update(batch=8, seq_len=2048, mfu=0.44 if result["model"] == "transformer" else 0.2)
    rows = by_measurement(speed.rows(parts))
    assert rows["gated_deltanet 3"][1:5] == ["gated_deltanet: bench tokens/s, 8 x 2048", "85,000",
                                             "naive HF loop: 70,000", "1.21x"]  # fmt: skip
    assert rows["transformer 4"][2] == "44.0% (160,000)" and rows["transformer 4"][4] == "1.33x torchtitan's"
    assert set(rows) == {"gated_deltanet 3", "hybrid 3", "transformer 4"}


def test_a_slower_launch_reads_slower():
    assert speed.speedup(199.7, 65.5) == "3.05x faster"
    assert speed.speedup(53.5, 61.4) == "1.15x slower"
    assert speed.speedup(float("nan"), 61.4) == "n/a"


def test_runs_of_other_parts_share_one_file(tmp_path):
    # Two runs started together (one per GPU) each read the file before the other wrote: each write keeps the
    # other's parts, and a part written again replaces its own.
    path = tmp_path / "speed.json"
    speed.save_parts(path, {"throughput": {"seconds": 1}}, "GPU")
    speed.save_parts(path, {"long_context": {"seconds": 2}}, "GPU")
    speed.save_parts(path, {"throughput": {"seconds": 3}}, "GPU")
    saved = json.loads(path.read_text())
    assert saved["parts"] == {"throughput": {"seconds": 3}, "long_context": {"seconds": 2}}
    assert saved["device"] == "GPU" and saved["torch"] == speed.torch.__version__


def test_empty_parts_write_the_table_of_the_saved_parts_on_their_device(tmp_path):
    # A run cut part-way by its time limit saved its finished parts; the table comes from them, measured on the
    # device the file names (not the machine that renders it).
    path, doc = tmp_path / "speed.json", tmp_path / "performance.md"
    speed.save_parts(path, {"train_sh": {**PARTS["train_sh"], "seconds": 5, "run": "bench/speed.py --parts train_sh"}},
                     "NVIDIA H100 80GB HBM3")  # fmt: skip
    doc.write_text("# Performance\n")
    assert (
        speed.main(["--parts", "", "--json", str(path), "--doc", str(doc), "--write_doc", "--device", "cpu"])
        == 0
    )
    assert "Measured on NVIDIA H100 80GB HBM3 by" in doc.read_text() and "(items 1, 3, 4; " in doc.read_text()
    assert "train_sh 5 s)" in doc.read_text()
    with pytest.raises(SystemExit):
        speed.parse(["--parts", "", "--json", str(tmp_path / "none.json")])


def test_each_run_is_named_with_the_dates_its_parts_ran(tmp_path):
    # One file can hold parts measured on different days (a part rerun replaces only its own).
    path, doc = tmp_path / "speed.json", tmp_path / "performance.md"
    # run B's part ran on the file's date
    no_date = {"long_context": {"results": [], "status": 0, "seconds": 2, "run": "run B"}}
    speed.save_parts(path, no_date, "GPU")
    speed.save_parts(path, {"first_step": {**PARTS["first_step"], "seconds": 5, "run": "run A", "date": "2026-01-02"}},
                     "GPU")  # fmt: skip
    saved = json.loads(path.read_text())
    dates = speed.runs_and_dates(saved["parts"], "2026-01-01")
    assert dates == {"run A": "2026-01-02", "run B": "2026-01-01"}
    speed.main(["--parts", "", "--json", str(path), "--doc", str(doc), "--write_doc", "--device", "cpu"])
    torch = saved["torch"]
    assert f"- `run A` (item 2; 2026-01-02; torch {torch}; first_step 5 s)" in doc.read_text()
    assert f"- `run B` (item 5; {saved['date']}; torch {torch}; long_context 2 s)" in doc.read_text()


def section_rows(doc: Path, device: str) -> list[str]:
    return [
        line
        for line in speed.section_in(doc.read_text(), f"bench_speed_{device}").splitlines()
        if speed.ROW_ITEM.match(line)
    ]


def test_a_run_replaces_its_items_rows_and_keeps_the_others_with_their_runs(tmp_path):
    # Parts of one device measured on different days (a GPU lent for less time than every part takes) make one
    # table: a run of the first step keeps the section's rows of items 1, 3 and 4 and the run that measured them.
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n")
    day1, day2 = tmp_path / "day1.json", tmp_path / "day2.json"
    earlier = {part: {**PARTS[part], "seconds": 10, "run": "run A", "date": "2026-01-01"}
               for part in ("throughput", "train_sh", "torchtitan")}  # fmt: skip
    speed.save_parts(day1, earlier, "GPU X")
    speed.main(["--parts", "", "--json", str(day1), "--doc", str(doc), "--write_doc", "--device", "cpu"])
    first_day = section_rows(doc, "gpu_x")
    assert [row[:4] for row in first_day] == ["| 1 "] * 3 + ["| 3 "] * 2 + ["| 4 "]

    speed.save_parts(day2, {"first_step": {**PARTS["first_step"], "seconds": 7, "run": "run B", "date": "2026-01-05"},
                            "long_context": {**PARTS["long_context"], "seconds": 8, "run": "run B", "date": "2026-01-05"}},
                     "GPU X")  # fmt: skip
    speed.main(["--parts", "", "--json", str(day2), "--doc", str(doc), "--write_doc", "--device", "cpu"])
    both_days = section_rows(doc, "gpu_x")
    new_rows = speed.row_lines(json.loads(day2.read_text())["parts"])
    assert both_days == first_day[:3] + new_rows[:2] + first_day[3:] + new_rows[2:]  # items 1, 2, 3, 4, 5
    text = doc.read_text()
    assert "- `run A` (items 1, 3, 4; 2026-01-01; torch " in text and "throughput 10 s, train_sh 10 s" in text
    assert "- `run B` (items 2, 5; 2026-01-05; torch " in text

    # A run of every part run A measured leaves none of its rows, so it is named no more.
    day3 = tmp_path / "day3.json"
    later = {part: {**PARTS[part], "seconds": 11, "run": "run C", "date": "2026-01-09"}
             for part in ("throughput", "train_sh")}  # fmt: skip
    later["train_sh"]["models"] = {"transformer": {"tokens_per_s": 1.0, "data_share": 0.0, "mfu": 1.0}}
    speed.save_parts(day3, later, "GPU X")
    speed.main(["--parts", "", "--json", str(day3), "--doc", str(doc), "--write_doc", "--device", "cpu"])
    text = doc.read_text()
    assert "`run A`" not in text and "- `run B` (items 2, 5;" in text and "- `run C` (items 1, 3, 4;" in text
    assert [row[:4] for row in section_rows(doc, "gpu_x")] == [
        "| 1 ",
        "| 2 ",
        "| 2 ",
        "| 3 ",
        "| 3 ",
        "| 4 ",
    ] + ["| 5 "] * 6
    # a model train.sh did not measure says so, without the bench profile's limits
    assert "| not measured |" in section_rows(doc, "gpu_x")[3]
    # the device's section is replaced, not written again
    assert text.count("## The speed table, GPU X") == 1


def test_a_section_lists_its_runs_in_the_order_of_their_items():
    old = "\n".join(["- `run A` (items 1, 3; d; torch t; x 1 s)", "- `run B` (item 5; d; torch t; y 1 s)",
                     "- `run C` (item 6; d; torch t; z 1 s)", "| 1 | a |", "| 3 | c |", "| 5 | e |", "| 6 | f |"])  # fmt: skip
    runs, rows = speed.merged_with_section(old, ["- `run D` (item 5; d; torch t; y 2 s)"], ["| 5 | g |"])
    assert runs == ["- `run A` (items 1, 3; d; torch t; x 1 s)", "- `run D` (item 5; d; torch t; y 2 s)",
                    "- `run C` (item 6; d; torch t; z 1 s)"]  # fmt: skip
    assert rows == ["| 1 | a |", "| 3 | c |", "| 5 | g |", "| 6 | f |"]


def test_parts_spread_over_gpus_longest_first():
    assert speed.spread(list(speed.PARTS), 1) == [list(speed.PARTS)]
    assert speed.spread(list(speed.PARTS), 4) == [
        ["first_step"],
        ["tokens_to_loss"],
        ["throughput", "long_context"],
        ["train_sh", "train_sh_graphs", "train_sh_no_block_graphs", "torchtitan"],
    ]
    assert speed.spread(["torchtitan", "throughput"], 4) == [["throughput"], ["torchtitan"]]


def test_each_gpu_gets_its_own_cores():
    assert speed.core_shares(list(range(64)), 4) == [list(range(16 * g, 16 * g + 16)) for g in range(4)]
    assert speed.core_shares([0, 1], 4) == [[0, 1]] * 4  # fewer cores than GPUs: each has all


def test_gpus_run_the_parts_in_processes_of_their_own_and_name_the_one_command(tmp_path):
    """--gpus 2 on the CPU: each part in its own process, with its own log; the results name the parent command."""
    saved = tmp_path / "speed.json"
    argv = ["--tiny", "--device", "cpu", "--gpus", "2", "--parts", "torchtitan,tokens_to_loss", "--t2l_dataset",
            "nowhere", "--json", str(saved), "--work", str(tmp_path / "work"), "--no_write"]  # fmt: skip
    assert speed.main(argv) == 0
    parts = json.loads(saved.read_text())["parts"]
    assert set(parts) == {"torchtitan", "tokens_to_loss"}
    assert "no dataset at nowhere" in parts["tokens_to_loss"]["error"]
    assert parts["torchtitan"]["tokens_per_s"] > 0
    assert {parts[p]["run"] for p in parts} == {speed.command_line("bench/speed.py", argv)}
    for gpu, part in enumerate(("tokens_to_loss", "torchtitan")):  # the longer part first
        assert f"\n{part}: " in "\n" + (tmp_path / "work" / f"gpu{gpu}.log").read_text()


def test_the_transformer_at_twice_the_batch_is_a_row_beside_the_usual_one():
    parts = json.loads(json.dumps(PARTS))
    parts["throughput"]["results"][0].update(batch=8, seq_len=2048)
    larger = result("transformer", "compiled", 176_000.0, batch=16, seq_len=2048, mfu=0.475, peak_gib=35.4)
    parts["throughput"]["larger_batch"] = {"results": [larger], "status": 0}
    rows = [row for row in speed.rows(parts) if row[0] == "4"]
    assert rows[-1] == ["4", "transformer: bench MFU (tokens/s), 16 x 2048, peak 35.4 GiB", "47.5% (176,000)",
                        "bench, 8 x 2048: 160,000", "1.10x", ">= 50% MFU", "no: 95% of it"]  # fmt: skip
    assert len(rows) == 2
    assert [row for row in speed.rows(PARTS) if row[0] == "4"] == rows[:1]  # no larger-batch result: no row


def test_cuda_graph_rows_stand_beside_the_default_modes_launch():
    graphs = {"shape": "8 x 2048", "models": {
        "gated_deltanet": {"tokens_per_s": 91_000.0, "mfu": 30.0, "peak_gib": 43.9, "data_share": 0.0},
        "hybrid": {"error": "exit status 1: CUDA out of memory"},
        "transformer": {"tokens_per_s": 180_000.0, "mfu": 48.3, "peak_gib": 30.2, "data_share": 0.0},
    }}  # fmt: skip
    train_sh = json.loads(json.dumps(PARTS["train_sh"]))
    train_sh["models"]["gated_deltanet"]["peak_gib"] = 33.0
    rows = {row[1].split(":")[0] + " " + row[0]: row for row in speed.flag_rows({"train_sh_graphs": graphs,
                                                                                  "train_sh": train_sh})}  # fmt: skip
    assert rows["gated_deltanet 3"][1:] == [
        "gated_deltanet: train.sh with --compile.mode reduce-overhead tokens/s, peak memory, 8 x 2048",
        "91,000, 43.9 GiB", "default mode: 84,000, 33.0 GiB", "1.08x", ">= 120,000", "no: 76% of it",
    ]  # fmt: skip
    assert rows["hybrid 3"][2:5] == [
        "exit status 1: CUDA out of memory",
        "default mode: exit status 1: CUDA out of memory",
        "",
    ]
    assert rows["transformer 4"][2:] == [
        "48.3% (180,000), 30.2 GiB", "default mode: 43.5% (158,400), n/a GiB", "1.14x", ">= 50% MFU", "no: 97% of it",
    ]  # fmt: skip
    # The part's launches are train.sh's with the flag; without a CUDA GPU it says why it has none.
    assert speed.flag_rows({"train_sh_graphs": {"error": "CUDA graphs need a CUDA GPU"}})[0][2] == (
        "CUDA graphs need a CUDA GPU"
    )
    # flame's graphed compiled blocks: the same rows, named by their flag.
    block_rows = speed.flag_rows(
        {"train_sh_no_block_graphs": graphs, "train_sh": train_sh}, "train_sh_no_block_graphs"
    )
    assert block_rows[0][1] == (
        "gated_deltanet: train.sh with --compile.no-graph_compiled_blocks tokens/s, peak memory, 8 x 2048"
    )
    assert [row[2:] for row in block_rows] == [row[2:] for row in rows.values()]
    assert speed.rows({"train_sh_no_block_graphs": graphs, "train_sh": train_sh})[-1][1].startswith(
        "transformer: train.sh with --compile.no-graph_compiled_blocks"
    )


@pytest.mark.parametrize(
    "part, flags",
    [("train_sh_graphs", ["--compile.mode", "reduce-overhead"]),
     ("train_sh_no_block_graphs", ["--compile.no-graph_compiled_blocks"])],
)  # fmt: skip
def test_the_graph_parts_launch_train_sh_with_their_flags_on_a_cuda_gpu(tmp_path, monkeypatch, part, flags):
    args = speed.parse(["--json", str(tmp_path / "s.json"), "--device", "cpu", "--tiny"])
    assert speed.RUNNERS[part](args, tmp_path) == {"error": "CUDA graphs need a CUDA GPU"}
    launched = []

    def run_logged(command, log, timeout_s, env):
        launched.append(command)
        log.write_text("error: no GPU here\n")
        return 1

    monkeypatch.setattr(speed, "run_logged", run_logged)
    args.device = "cuda"
    result = speed.RUNNERS[part](args, tmp_path)
    assert [command[-len(flags) :] for command in launched] == [flags] * len(speed.MODELS)
    assert result["models"] == dict.fromkeys(speed.MODELS, {"error": "exit status 1: error: no GPU here"})


def test_train_sh_resume_keeps_the_models_run_to_the_end_at_the_same_shape(tmp_path, monkeypatch):
    launched, failing = [], {"gated_deltanet"}

    def run_logged(command, log, timeout_s, env):
        model = Path(command[command.index("--model.config") + 1]).stem
        launched.append(model)
        log.write_text("step 3\n")
        return 124 if model in failing else 0

    monkeypatch.setattr(speed, "run_logged", run_logged)
    monkeypatch.setattr(
        speed, "log_means", lambda dump, skip: {"tokens_per_s": 5.0, "data_share": 0.0, "mfu": 1.0}
    )
    path = tmp_path / "speed.json"
    base = ["--tiny", "--device", "cpu", "--parts", "train_sh", "--json", str(path), "--no_write"]
    speed.main(base)
    part = json.loads(path.read_text())["parts"]["train_sh"]
    assert part["models"]["gated_deltanet"] == {"error": "exit status 124: step 3"}
    failing.clear()
    launched.clear()
    speed.main([*base, "--resume"])
    part = json.loads(path.read_text())["parts"]["train_sh"]
    assert launched == ["gated_deltanet"] and part["kept"] == ["transformer", "hybrid"]
    assert part["models"]["gated_deltanet"]["tokens_per_s"] == 5.0
    assert part["run"] == "; ".join(
        speed.command_line("bench/speed.py", argv) for argv in (base, [*base, "--resume"])
    )
    launched.clear()
    speed.main([*base, "--rerun", "hybrid"])
    assert launched == ["hybrid"]
    # Another shape measures every model again.
    launched.clear()
    speed.main([*base, "--resume", "--batch_size", "4"])
    assert launched == list(speed.MODELS)
    part = json.loads(path.read_text())["parts"]["train_sh"]
    assert part["shape"] == "4 x 64" and part["kept"] == []


def test_resume_launches_all_of_a_part_saved_without_its_launches_runs(tmp_path, monkeypatch, capsys):
    launched = []

    def run_logged(command, log, timeout_s, env):
        launched.append(Path(command[command.index("--model.config") + 1]).stem)
        log.write_text("step 3\n")
        return 0

    monkeypatch.setattr(speed, "run_logged", run_logged)
    run = {"tokens_per_s": 5.0, "data_share": 0.0, "mfu": 1.0}
    monkeypatch.setattr(speed, "log_means", lambda dump, skip: run)
    path = tmp_path / "speed.json"
    models = dict.fromkeys(speed.MODELS, run)
    path.write_text(json.dumps({"parts": {"train_sh": {"models": models, "shape": "2 x 64", "run": "old"}}}))
    speed.main(
        ["--tiny", "--device", "cpu", "--parts", "train_sh", "--json", str(path), "--no_write", "--resume"]
    )
    assert launched == list(speed.MODELS)
    assert (
        "train_sh: its saved results name no run per launch; launching all of it" in capsys.readouterr().out
    )


def test_resume_keeps_the_parts_saved_whole_without_an_error_and_measures_the_rest(
    tmp_path, monkeypatch, capsys
):
    measured = []

    def runner(part):
        def run(args, work, *resumable):
            measured.append(part)
            return {"error": "no GPU"} if part == "torchtitan" else {"results": []}

        return run

    monkeypatch.setattr(speed, "RUNNERS", {part: runner(part) for part in ("throughput", "torchtitan")})
    monkeypatch.setattr(speed, "rows", lambda parts: [])
    path = tmp_path / "speed.json"
    base = ["--device", "cpu", "--parts", "throughput,torchtitan", "--json", str(path), "--no_write"]
    speed.main(base)
    assert measured == ["throughput", "torchtitan"]
    measured.clear()
    speed.main([*base, "--resume"])  # the throughput part finished; torchtitan's ended on an error
    assert measured == ["torchtitan"]
    assert f"throughput: kept from `{speed.command_line('bench/speed.py', base)}`" in capsys.readouterr().out
    measured.clear()
    speed.main(base)  # without --resume every part named is measured again
    assert measured == ["throughput", "torchtitan"]
