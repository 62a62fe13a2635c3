"""State-dict adapters: flame's parameter names <-> the names of one HF format (torchtitan's to_hf / from_hf).

Each family's ``state_dict_adapter.py`` holds its adapters; ``flame.hf.formats`` picks one per export format.
An adapter is built for one model's args and refuses (``ExportError``, one line) a model that its format cannot
express exactly: an export must compute what flame trained, or not happen.

The "fla" and "flame" formats use FLA's HF names, which are flame's with ``model.`` in front, except ``lm_head``
(flame/models/common/decoder.py). With tied embeddings the HF state dict holds the embedding only, as
transformers saves it.
"""

import re
from typing import Any, ClassVar

import torch

from flame.errors import FlameError
from flame.models.common.args import ModelArgs
from flame.models.common.choices import ATTN_IMPLS

State = dict[str, torch.Tensor]


class ExportError(FlameError):
    """A model that an HF format cannot express, or an HF checkpoint flame cannot build."""


class StateDictAdapter:
    format: ClassVar[str] = ""

    def __init__(self, args: ModelArgs, check: bool = True):
        """``check=False`` for reading an HF checkpoint whose config flame takes as it is written."""
        self.args = args
        problems = self.incompatibilities() if check else []
        if problems:
            raise ExportError(
                f"cannot export this {args.model_type} model as {self.format}: {'; '.join(problems)}"
            )

    def incompatibilities(self) -> list[str]:
        """Why the format cannot express this model (empty: it can)."""
        return []

    def hf_config(self) -> dict[str, Any]:
        """The content of config.json (without dtype and version, which the exporter adds)."""
        raise NotImplementedError

    def to_hf(self, state_dict: State) -> State:
        raise NotImplementedError

    def from_hf(self, hf_state_dict: State) -> State:
        raise NotImplementedError

    def _untie(self, state_dict: State) -> State:
        """flame's state dict from one without lm_head.weight (tied embeddings)."""
        if (
            self.args.tie_word_embeddings
            and "lm_head.weight" not in state_dict
            and "embeddings.weight" in state_dict
        ):
            state_dict = {**state_dict, "lm_head.weight": state_dict["embeddings.weight"]}
        return state_dict


class PrefixAdapter(StateDictAdapter):
    """FLA's names (``model.`` + flame's name, ``lm_head`` as is)."""

    architecture: ClassVar[str] = ""

    def to_hf(self, state_dict: State) -> State:
        hf = {}
        for key, value in state_dict.items():
            if key == "lm_head.weight":
                if not self.args.tie_word_embeddings:
                    hf[key] = value
            else:
                hf[f"model.{key}"] = value
        return hf

    def from_hf(self, hf_state_dict: State) -> State:
        state_dict = {}
        for key, value in hf_state_dict.items():
            if key == "lm_head.weight":
                state_dict[key] = value
            elif key.startswith("model."):
                state_dict[key.removeprefix("model.")] = value
            else:
                raise ExportError(f"unexpected weight {key} in an HF checkpoint of FLA's layout")
        return self._untie(state_dict)


class FlaAdapter(PrefixAdapter):
    """FLA's own model_type (``transformer``, ``gated_deltanet``, ``delta_net``): loads after ``import fla``."""

    format = "fla"

    def hf_config(self) -> dict[str, Any]:
        return {**self.args.to_dict(), "architectures": [self.architecture]}


class FlameAdapter(PrefixAdapter):
    """flame's registered model_type (``flame_<family>``): loads after ``import flame``, with flame's model code."""

    format = "flame"

    def hf_config(self) -> dict[str, Any]:
        config = self.args.to_dict()
        return {**config, "model_type": f"flame_{config['model_type']}", "architectures": [self.architecture]}


def softmax_attention(attn_impl: str) -> bool:
    """True for plain softmax attention (no softpick/rectified scores, no query scaling)."""
    return ATTN_IMPLS[attn_impl] == ("softmax", False)


def hybrid_fla_incompatibilities(args) -> list[str]:
    """What FLA's hybrid ``attn`` spec lacks: q/k norms, post-norm blocks and the softpick family."""
    from flame.models.common.hybrid import parse_attn

    problems = []
    for spec in parse_attn(args.attn, args.num_hidden_layers, args.hidden_size):
        if spec.qk_norm:
            problems.append(
                f"attention layers {list(spec.layers)} use qk_norm, which FLA's hybrid attention lacks"
            )
        if spec.norm_order != "pre":
            problems.append(
                f"attention layers {list(spec.layers)} use norm_order {spec.norm_order} (FLA's blocks are pre-norm)"
            )
        if not softmax_attention(spec.attn_impl):
            problems.append(f"attention layers {list(spec.layers)} use attn_impl {spec.attn_impl}")
    return problems


class RenameRules:
    """Bidirectional renaming by regular expressions over dotted names, ``{i}`` standing for a layer index."""

    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs
        self._forward = [(self._regex(a), b) for a, b in pairs]
        self._backward = [(self._regex(b), a) for a, b in pairs]

    @staticmethod
    def _regex(pattern: str) -> re.Pattern:
        return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")

    @staticmethod
    def _apply(rules, key: str) -> str | None:
        for regex, target in rules:
            match = regex.match(key)
            if match:
                return target.replace("{i}", match.group("i")) if "i" in regex.groupindex else target
        return None

    def forward(self, key: str) -> str | None:
        return self._apply(self._forward, key)

    def backward(self, key: str) -> str | None:
        return self._apply(self._backward, key)
