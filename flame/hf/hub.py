"""Hub names where paths are expected (``--model.config``, the converters' ``--config``, ``--tokenizer`` and
``--model``): ``owner/name`` is resolved to its folder in the local HF cache, downloading only what is missing
(``HF_HUB_OFFLINE=1``: the cache alone). A name neither on disk nor obtainable is one line saying so."""

import os
import re
from pathlib import Path

from flame.errors import FlameError, first_line

# owner/name as the hub spells repository ids; a path that exists always wins.
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(value: str) -> bool:
    return not os.path.exists(value) and not value.startswith((".", "/", "~")) and bool(HUB_NAME.match(value))


def hub_folder(name: str, patterns: list[str], what: str) -> Path:
    """The cached snapshot folder of hub repository ``name`` holding the files matching ``patterns``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        reason = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise FlameError(
            f"{what} '{name}' is not a local path and not in the HF cache ({reason}); download it where the hub is "
            f"reachable (huggingface-cli download {name}) or pass a local path"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FlameError(f"{what} '{name}' could not be fetched from the hub: {first_line(e)}") from None


def resolve_model_config(value: str) -> str:
    """A model config path, or a hub name's config.json from the cache."""
    if not is_hub_name(value):
        return value
    return str(hub_folder(value, ["config.json"], "model config") / "config.json")


def resolve_tokenizer(value: str) -> str:
    """A tokenizer folder, or a hub name's tokenizer files from the cache."""
    if not is_hub_name(value):
        return value
    patterns = ["tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "config.json"]
    return str(hub_folder(value, patterns, "tokenizer"))


def resolve_model_folder(value: str) -> str:
    """An HF model folder, or a hub name's config, weights and tokenizer from the cache."""
    if not is_hub_name(value):
        return value
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "vocab.*", "merges.txt"]
    return str(hub_folder(value, patterns, "HF model"))
