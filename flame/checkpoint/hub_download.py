"""Downloading a run's checkpoints from a hub repository into its checkpoint folder, so that a launch on another
machine resumes from them (``python download_checkpoint.py``, the softpick fork's tool).

The repository holds ``step-<N>/`` folders as ``--checkpoint.hf_upload_enabled`` uploads them (flame's upload or the
fork's). Each DCP step is downloaded into ``<checkpoint folder>/hub-download/``, verified as a resumed run would
(flame.checkpoint.verify: the manifest's sizes and SHA-256 where the upload has one, else the files its
``.metadata`` names) and only then renamed to ``step-<N>``: a download cut short or a corrupt file never becomes a
checkpoint that a launch would load, and a step already in the folder is left as it is. Steps uploaded as HF exports
(``hf_upload_format hf``: no ``.metadata``) are not checkpoints to resume from; they are named and skipped.
"""

import os
import re
import shutil
from pathlib import Path

from flame.checkpoint.layout import METADATA, STEP_DIR, CheckpointError, list_steps, step_dir
from flame.checkpoint.verify import checkpoint_problem
from flame.errors import FlameError, first_line

STAGING = "hub-download"
STEP_FILE = re.compile(r"(step-\d+)/(.+)")


def hub_steps(files: list[str]) -> dict[int, list[str]]:
    """{step: the repository paths of its files} of the ``step-<N>/`` folders among a repository's ``files``."""
    steps: dict[int, list[str]] = {}
    for path in files:
        if match := STEP_FILE.fullmatch(path):
            steps.setdefault(int(STEP_DIR.fullmatch(match[1])[1]), []).append(path)
    return steps


def download_checkpoints(
    repo_id: str, checkpoint_folder: str | os.PathLike, steps: list[int] | None = None, log=print
) -> list[int]:
    """Downloads the DCP step folders of ``repo_id`` (all, or ``steps``; -1 is the newest) into ``checkpoint_folder``;
    the steps it added, ascending. Raises FlameError when the hub cannot be reached or has no such steps."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT")  # read here: huggingface_hub reads it once, at its import
    try:
        files = HfApi(endpoint=endpoint).list_repo_files(repo_id)
    except RepositoryNotFoundError as e:
        raise FlameError(
            f"hub repository {repo_id} not found, or not readable with this machine's token "
            f"(`hf auth login`, or HF_TOKEN): {first_line(e)}"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise FlameError(f"cannot list hub repository {repo_id}: {type(e).__name__}: {first_line(e)}") from e
    available = hub_steps(files)
    if not available:
        raise FlameError(f"hub repository {repo_id} has no step-<N>/ checkpoint folders")
    wanted = sorted(available) if steps is None else sorted({max(available) if s == -1 else s for s in steps})
    missing = [s for s in wanted if s not in available]
    if missing:
        raise FlameError(
            f"hub repository {repo_id} has no step {', '.join(map(str, missing))}; it has steps "
            f"{', '.join(map(str, sorted(available)))}"
        )
    folder = Path(checkpoint_folder)
    local = list_steps(folder)
    staging = folder / STAGING
    added = []
    for step in wanted:
        names = [path.split("/", 1)[1] for path in available[step]]
        if METADATA not in names:
            log(f"step-{step} of {repo_id} is an HF export, not a DCP checkpoint: skipped")
            continue
        if local.get(step):
            log(f"step-{step} is in {folder} already: kept as it is")
            continue
        shutil.rmtree(staging / f"step-{step}", ignore_errors=True)  # what an interrupted download left
        log(f"Downloading step-{step} of {repo_id} ({len(names)} files) into {folder}")
        try:
            for path in available[step]:
                hf_hub_download(repo_id, path, local_dir=staging, endpoint=endpoint)
        except (HfHubHTTPError, OSError) as e:
            raise FlameError(
                f"downloading step-{step} of {repo_id} failed ({type(e).__name__}: {first_line(e)}); the steps "
                f"downloaded before it are in {folder}, run the command again to continue"
            ) from e
        problem = checkpoint_problem(staging / f"step-{step}")
        if problem:
            raise CheckpointError(
                f"step-{step} of {repo_id} does not verify: {problem}; nothing was added for it"
            )
        target = step_dir(folder, step)
        if target.exists():  # an incomplete save of this step: the verified download replaces it
            shutil.rmtree(target)
        os.rename(staging / f"step-{step}", target)
        added.append(step)
    shutil.rmtree(staging, ignore_errors=True)
    return added
