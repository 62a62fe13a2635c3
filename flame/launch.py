"""Pre-flight check that train.sh runs before torchrun starts any rank.

Parses the job (fast: no torchtitan package init), prints a notice line for each upstream flame option given
that has no effect here, checks the model config, the tokenizer's vocabulary, NGPU and the parallelism degrees
against NGPU x NNODE and the model (flame.parallelize.checks), and answers ``--help`` and ``--job.dry_run``
itself (the dry run checks the degrees against NGPU x NNODE but not the visible devices). A mistake is one line on
stderr and exit code 2, before any rank could turn it into a wall of tracebacks. With FLAME_LAUNCH_ENV set
(train.sh), takes the dump folder's lock for train.sh's process on node 0 (``flame.checkpoint.lock``: a second run
on the folder stops here) and writes the resolved dump folder and the lock's path there for train.sh.
"""

import dataclasses
import json
import os
import shlex
import socket
import sys
from pathlib import Path

from flame.checkpoint.lock import HELD_BY_LAUNCHER, DumpFolderLock
from flame.config import parse_args
from flame.config.checks import validate_job
from flame.config.manager import upstream_notices
from flame.errors import FlameError
from flame.process_end import exit_without_final_collection

# train.sh stops after the pre-flight without starting ranks when it exits with this code.
EXIT_DONE = 10


def tokenizer_vocab_size(path: str) -> int | None:
    """Vocabulary size (with added tokens) of a local HF tokenizer; None for hub names (checked by the ranks)."""
    tokenizer_file = Path(path) / "tokenizer.json"
    if not tokenizer_file.is_file():
        if Path(path).exists():
            return None
        if path.count("/") == 1 and not path.startswith((".", "/")):
            return None  # looks like a hub name
        raise FlameError(
            f"tokenizer path {path} does not exist; pass --model.tokenizer_path <dir or hub name>"
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)


# The CUDA devices train.sh counted (nvidia-smi -L, within CUDA_VISIBLE_DEVICES); set where nvidia-smi exists.
VISIBLE_GPUS_ENV = "FLAME_VISIBLE_GPUS"
NVIDIA_DRIVER = Path("/proc/driver/nvidia")


def visible_gpus() -> int:
    """The CUDA devices this launch sees, without importing torch where it can (its import is most of a pre-flight:
    ~1 s on a 2-core CPU machine, ~5 s on a GPU host): train.sh's count, or 0 without NVIDIA's driver; else torch's
    count."""
    if counted := os.environ.get(VISIBLE_GPUS_ENV):
        return int(counted)
    if not NVIDIA_DRIVER.exists():
        return 0
    import torch

    return torch.cuda.device_count()


def check_devices(ngpu: int, visible: int) -> None:
    if visible and ngpu > visible:
        raise FlameError(f"NGPU={ngpu} but only {visible} GPU(s) are visible; set NGPU <= {visible}")


def check_data_options(job_config) -> None:
    """The data options the ranks would otherwise refuse only after starting (context_len over seq_len, varlen with
    batch_size > 1, mismatched comma lists): flame.data.config reads no data and imports no torch, so this runs
    first, within a second."""
    from flame.data.config import data_spec

    data_spec(job_config)


def check_launch(job_config, degrees: dict[str, int], world_size: int, gpus: int) -> None:
    """Contradictions the ranks would otherwise find only after starting: a global batch the data-parallel ranks
    cannot split, a seed checkpoint on several processes and a CUDA memory snapshot without a GPU."""
    training = job_config.training
    per_step = training.local_batch_size * degrees["dp_replicate"] * degrees["dp_shard"]
    global_batch = training.global_batch_size
    if training.gradient_accumulation_steps is None and global_batch > 0 and global_batch % per_step:
        raise FlameError(
            f"training.global_batch_size {global_batch} is not a multiple of local batch size x data-parallel "
            f"degree = {per_step}; use --training.gradient_accumulation_steps instead"
        )
    if job_config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise FlameError(
            f"checkpoint.create_seed_checkpoint runs on one process, not {world_size}: launch it with NGPU=1"
        )
    if job_config.profiling.enable_memory_snapshot and not gpus:
        raise FlameError("profiling.enable_memory_snapshot records CUDA memory; it needs a GPU")


def dry_run(job_config, model_args) -> None:
    import torch

    from flame.models import build_model

    print(json.dumps(dataclasses.asdict(job_config), indent=2, default=str))
    with torch.device("meta"):
        model = build_model(model_args)
    nparams, flops = model_args.get_nparams_and_flops(model, job_config.training.attention_context())
    print(f"params: {nparams}")
    print(f"flops_per_token: {flops}")


def preflight(argv: list[str]) -> int:
    job_config = parse_args(argv)
    for notice in upstream_notices(job_config):
        print(notice, file=sys.stderr)
    check_data_options(job_config)
    # A config of the generic family imports transformers, and FLA's classes torch (seconds): the checks above
    # answer first.
    from flame.models import check_device, load_model_args
    from flame.models.custom import import_custom_modules

    validate_job(job_config)
    import_custom_modules(job_config.experimental)
    model_args, notices = load_model_args(job_config.model.config, job_config.model.impl)
    for notice in notices:
        print(f"notice: {job_config.model.config}: {notice}", file=sys.stderr)
    vocab = tokenizer_vocab_size(job_config.model.tokenizer_path)
    if vocab is not None and vocab > model_args.vocab_size:
        if not job_config.model.resize_vocab:
            raise FlameError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is {model_args.vocab_size}; "
                "use a matching tokenizer, raise vocab_size in the model config, or pass --model.resize_vocab"
            )
        model_args.vocab_size = vocab
    ngpu = int(os.environ.get("NGPU", "1"))
    world_size = ngpu * int(os.environ.get("NNODE", "1"))
    from flame.parallelize.checks import check_parallelism

    # The dry run checks the degrees against NGPU x NNODE too, but not the visible devices: a job for 8 GPUs
    # can be checked on a laptop.
    degrees = check_parallelism(job_config, model_args, world_size=world_size)
    gpus = visible_gpus()
    check_launch(job_config, degrees, world_size, gpus=gpus)
    if job_config.job.dry_run:
        dry_run(job_config, model_args)
        print(f"world_size: {world_size} ({', '.join(f'{k} {v}' for k, v in degrees.items())})")
        return EXIT_DONE
    check_devices(ngpu, gpus)
    check_device(model_args, "cuda" if gpus else "cpu")
    if job_config.job.print_config:
        print(json.dumps(dataclasses.asdict(job_config), indent=2, default=str))
    if env_file := os.environ.get("FLAME_LAUNCH_ENV"):
        lines = [f"DUMP_FOLDER={job_config.job.dump_folder}"]
        if os.environ.get("NODE_RANK", "0") == "0":
            lock = DumpFolderLock(job_config.job.dump_folder, pid=os.getppid())  # held by train.sh
            lock.acquire()
            lines.append(f"export {HELD_BY_LAUNCHER}={shlex.quote(str(lock.path.resolve()))}")
        if "MASTER_PORT" not in os.environ and os.environ.get("NNODE", "1") == "1":
            # One node: a port nobody holds, so that jobs on one machine never meet on torchrun's default.
            lines.append(f"MASTER_PORT={free_port()}")
        if job_config.debug.enable:  # read when CUDA starts: exported before any rank does
            lines.append("export CUDA_LAUNCH_BLOCKING=1")
        Path(env_file).write_text("\n".join(lines) + "\n")
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def main() -> int:
    try:
        return preflight(sys.argv[1:])
    except FlameError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # tyro after --help (code 0) or after its own message for a bad value
        return EXIT_DONE if e.code == 0 else 2


if __name__ == "__main__":
    # Without torch's teardown (docs/performance.md, "Start-up imports").
    exit_without_final_collection(main())
