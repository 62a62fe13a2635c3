"""The softpick fork's README training commands, pasted as they are, as short trials: each trains, checkpoints,
resumes exactly, uploads and exports.

    python scripts/readme_commands.py                       # every command, with the README's NGPU=8
    python scripts/readme_commands.py --ngpu 4 --only 0,4   # the first and the last with NGPU=4
    python scripts/readme_commands.py --ngpu 2 --steps 4 --interval 2 -- --model.config flame/assets/tiny.json \\
        --training.seq_len 64 --training.context_len 64 --training.batch_size 2   # 2 CPU ranks: a smoke test

The commands are tests/config/upstream_readme.md's (the README verbatim; tests/config/test_upstream.py dry-runs
them). Each runs through ``bash -c`` as typed, with ``NGPU=8`` set to ``--ngpu`` and these flags appended: the
bundled tokenizer and corpus in place of the hub's (flame/assets, its one config ``default`` for the
``sample-100BT`` that one command names: no download), ``--training.steps`` and
``--checkpoint.interval`` (default 20 and 10), a dump folder under ``--workdir``, then the flags after ``--``.
The commands that upload to the hub (``--checkpoint.hf_upload_enabled``) upload to a stand-in hub on this machine
(tests/checkpoint/hub_server.py, through ``HF_ENDPOINT``), which holds what it receives in memory (about 4 GB per
checkpoint of a 340M model with AdamW's state) until the command's check is done.

For each command: run 1 trains every step, writes a checkpoint every interval and exports the last one (train.sh's
HF export); run 2 starts in a folder that holds only run 1's first checkpoint, resumes from it and trains to the
end. Checked: run 2's last checkpoint equals run 1's bit for bit (scripts/chaos.py's comparison: model, optimizer,
schedule, dataloader, RNG states), the export loads with transformers after ``import flame``, and the hub holds
every checkpoint of run 1. Prints a table (tokens/s per GPU and peak memory from run 1's last step line) and
writes it into docs/performance.md between ``<!-- readme_commands_<N>gpu -->`` markers (``..._<N>gpu_0_1`` for
``--only 0,1``, so that runs of different commands keep their own sections) with the command, device and date. Exit status 0 when every command passed every check.
"""

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "tests" / "config" / "upstream_readme.md"
LOCAL_DATA = ["--model.tokenizer_path", "flame/assets/tokenizer", "--training.dataset", "flame/assets/corpus",
              "--training.dataset_name", "default"]  # fmt: skip
STEP_LINE = re.compile(r"step +(\d+)/(\d+) .*?tok/s ([\d,]+) .*?mem ([\d.]+)GiB")
TOKEN = "hf_readmeCommandsStandIn"


def readme_commands() -> list[str]:
    """The README's train.sh command lines, the multi-line one joined."""
    text = README.read_text()
    one_line = re.findall(r"^NGPU=8 bash train\.sh .*$", text, re.M)
    block = re.search(r"^bash train\.sh \\\n(.*?)\n```", text, re.M | re.S).group(0).removesuffix("```")
    return [*one_line, " ".join(block.replace("\\\n", " ").split())]


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch(command: str, ngpu: int, dump: Path, args, env: dict) -> tuple[int, str]:
    """One run of ``command`` as typed, NGPU set to ``ngpu``, the trial's flags appended: (status, output)."""
    typed = re.sub(r"^NGPU=\d+ ", "", command)
    flags = [*LOCAL_DATA, "--training.steps", str(args.steps), "--checkpoint.interval", str(args.interval),
             "--job.dump_folder", str(dump), *args.extra]  # fmt: skip
    line = f"NGPU={ngpu} {typed} " + shlex.join(flags)
    dump.mkdir(parents=True, exist_ok=True)
    with open(dump.parent / f"{dump.name}.log", "w") as log:
        log.write(line + "\n\n")
        log.flush()
        status = subprocess.run(
            ["bash", "-c", line], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    return status, (dump.parent / f"{dump.name}.log").read_text()


def export_loads(folder: Path) -> str:
    """'yes (N parameters)' if the HF folder loads with transformers after ``import flame``, else why not."""
    code = (
        "import sys, flame, transformers\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "print(sum(p.numel() for p in model.parameters()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, cwd=REPO
    )
    if result.returncode != 0:
        return "no: " + (result.stderr.strip().splitlines() or ["no output"])[-1]
    return f"yes ({int(result.stdout.split()[-1]):,} parameters)"


def run_command(index: int, command: str, args, hub, chaos) -> dict:
    work = args.workdir / str(index)
    shutil.rmtree(work, ignore_errors=True)
    # The stand-in hub is on this machine: reachable whatever HF_HUB_OFFLINE says (the test suite sets it).
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    started = time.time()
    status, output = launch(command, args.ngpu, work / "full", args, env)
    row = {"command": index, "problems": []}
    lines = STEP_LINE.findall(output)
    if status != 0 or not lines or int(lines[-1][0]) != args.steps:
        row["problems"].append(f"run 1 ended with status {status}; see {work / 'full.log'}")
        return row
    _, _, tokens, memory = lines[-1]
    row.update(
        tokens_per_s=int(tokens.replace(",", "")), peak_gib=float(memory), run_s=round(time.time() - started)
    )
    if "--checkpoint.hf_upload_enabled" in command:  # run 1's uploads; the hub's copy is dropped (gigabytes)
        repo = re.search(r"--checkpoint\.hf_repo_base_name \"?([^\" ]+)", command).group(1)
        uploaded = hub.steps(repo) if repo in hub.repos else []
        row["upload"] = f"steps {', '.join(map(str, uploaded)) or 'none'} in {repo}"
        if uploaded != list(range(args.interval, args.steps + 1, args.interval)):
            row["problems"].append(f"upload: {row['upload']}")
        hub.repos.pop(repo, None)
    first = work / "full" / "checkpoint" / f"step-{args.interval}"
    resumed = work / "resumed"
    shutil.copytree(first, resumed / "checkpoint" / first.name)
    status, output = launch(command, args.ngpu, resumed, args, {**env, "FLAME_EXPORT_HF": "0"})
    hub.repos.clear()  # run 2's uploads (of its last step again) are not checked
    if status != 0 or f"Training starts at step {args.interval + 1}\n" not in output:
        row["problems"].append(f"run 2 did not resume from step {args.interval}; see {work / 'resumed.log'}")
    else:
        last = f"checkpoint/step-{args.steps}"
        differ = chaos.mismatches(work / "full" / last, resumed / last)
        row["resume"] = "equal" if not differ else f"{len(differ)} entries differ (first: {differ[0]})"
        if differ:
            row["problems"].append(f"resume: {row['resume']}")
    row["export"] = export_loads(work / "full")
    if not row["export"].startswith("yes"):
        row["problems"].append(f"export: {row['export']}")
    return row


def table(rows: list[dict], commands: list[str]) -> str:
    lines = [
        "| command | model config | tokens/s per GPU | peak GiB | resume from the first checkpoint | export loads | "
        "hub upload | problems |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for row in rows:
        config = re.search(r"--model\.config (\S+)", commands[row["command"]]).group(1)
        tokens = f"{row['tokens_per_s']:,}" if "tokens_per_s" in row else "n/a"
        peak = f"{row['peak_gib']:.1f}" if "peak_gib" in row else "n/a"
        lines.append(
            f"| {row['command'] + 1} | {config} | {tokens} | {peak} | {row.get('resume', 'n/a')} | "
            f"{row.get('export', 'n/a')} | {row.get('upload', 'no upload')} | {'; '.join(row['problems']) or 'none'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ngpu", type=int, default=8, help="NGPU for every command (the README's: 8)")
    parser.add_argument("--only", default=None, help="comma separated command numbers, from 0 (default: all)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval; run 2 resumes from it")
    parser.add_argument("--workdir", type=Path, default=REPO / "exp" / "readme_commands")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "performance.md")
    parser.add_argument("--no_write", action="store_true", help="print only")
    parser.add_argument("extra", nargs="*", help="more train.sh flags for every command (after --)")
    args = parser.parse_args(argv)
    if args.steps % args.interval or args.steps <= args.interval:
        parser.error("--steps must be a multiple of --interval and larger than it")
    commands = readme_commands()
    chosen = range(len(commands)) if args.only is None else [int(i) for i in args.only.split(",")]
    chaos = load_script(REPO / "scripts" / "chaos.py", "chaos")
    hub_server = load_script(REPO / "tests" / "checkpoint" / "hub_server.py", "hub_server")
    rows = []
    with hub_server.FakeHub(TOKEN, namespace="zaydzuhri") as hub:
        for index in chosen:
            rows.append(run_command(index, commands[index], args, hub, chaos))
            print(table(rows[-1:], commands).splitlines()[-1], flush=True)
    text = table(rows, commands)
    print("\n" + text)
    if not args.no_write:
        sys.path.insert(0, str(REPO / "bench"))
        import torch
        from train_throughput import device_name, write_section

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        invocation = " ".join(
            ["python scripts/readme_commands.py", *(sys.argv[1:] if argv is None else argv)]
        )
        write_section(
            args.doc,
            f"readme_commands_{args.ngpu}gpu"
            + ("" if args.only is None else "_" + "_".join(map(str, chosen))),
            f"The README's commands on {args.ngpu} {'GPU' if device.type == 'cuda' else 'CPU rank'}"
            f"{'s' * (args.ngpu > 1)}",
            f"Command: `{invocation}` on {device_name(device)}, torch {torch.__version__} "
            f"({time.strftime('%Y-%m-%d')}): each README command as pasted with NGPU={args.ngpu}, the bundled "
            f"tokenizer and corpus, {args.steps} steps and a checkpoint every {args.interval} appended; a second "
            f"run resumes from step {args.interval} and must end with the first run's weights bit for bit.",
            text,
        )
    return 0 if all(not row["problems"] for row in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
