"""A local HF cache holding given files under a hub name, as huggingface_hub lays it out, for offline tests of hub
names (no download: HF_HUB_OFFLINE)."""

import shutil
from pathlib import Path


def add_to_cache(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """Put ``files`` (name in the repo -> local file) into ``cache`` as repository ``repo``'s main snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(snapshot.name)
    for name, source in files.items():
        shutil.copy(source, snapshot / name)
    return snapshot
