"""The table of configs/*.json for docs/configs.md, computed, never typed by hand.

    python scripts/config_table.py

prints the table: config file, family, the recipe it reproduces, and the parameter count of flame's model built
on the meta device. tests/models/test_configs.py checks that docs/configs.md contains the current table.
"""

from pathlib import Path

import torch

from flame.models import build_model, load_model_args

CONFIG_DIR = Path(__file__).parents[1] / "configs"

RECIPES = {
    "transformer_340M": "flame (fla-org/flame) transformer 340M",
    "transformer_1B": "flame transformer 1B",
    "transformer_7B": "flame transformer 7B (GQA, 8 KV heads)",
    "gated_deltanet_340M": 'flame Gated DeltaNet "340M" (6 heads x 256; 512M by count)',
    "gated_deltanet_1B": "flame Gated DeltaNet 1B",
    "delta_net_340M": "flame DeltaNet 340M",
    "delta_net_1B": "flame DeltaNet 1B",
    "vanilla_transformer_340M": "softpick paper: softmax baseline",
    "softpick_transformer_340M": "softpick paper: softpick attention",
    "rectified_transformer_340M": "softpick paper: rectified softmax (appendix)",
    "scaled_softpick_transformer_340M": "softpick paper: scaled softpick",
    "softpick_scaled_transformer_340M": "the softpick fork's name of scaled_softpick_transformer_340M (a link)",
    "scaled_vanilla_transformer_340M": "softpick paper: scaled softmax",
    "olmo_1b_control": "OLMo-core linear-RNN 1B: control (SWA [4097,4097,4097,full], QK-norm)",
    "olmo_1b_gated_deltanet": "OLMo-core linear-RNN 1B: gated_deltanet",
    "olmo_1b_gated_deltanet_pp": "OLMo-core linear-RNN 1B: gated_deltanet++ (negative eigenvalues)",
    "olmo_1b_deltanet": "OLMo-core linear-RNN 1B: deltanet (GDN, head_dim 128, no output gate)",
    "olmo_1b_deltanet_pp": "OLMo-core linear-RNN 1B: deltanet++",
    "olmo_1b_hybrid_gated_deltanet_pp": "OLMo-core linear-RNN 1B: hybrid_gated_deltanet++ (SWA at even layers)",
    "olmo3_7b_hybrid": "OLMo 3.1 7B hybrid (attention at i % 4 == 3)",
    "olmo_hybrid_7b": "OLMo 3.1 7B hybrid with OLMo's attention blocks = transformers' olmo_hybrid",
    "openelm_270m_lws_gqa": "OpenELM-270M shape: layer-wise scaling + GQA",
}


def config_rows() -> list[tuple[str, str, str, int]]:
    """(file, model_type, recipe, parameter count) for every config, built on the meta device."""
    rows = []
    for path in sorted(CONFIG_DIR.glob("*.json")):
        args, _ = load_model_args(path)
        with torch.device("meta"):
            model = build_model(args)
        count = sum(p.numel() for p in model.parameters())
        rows.append((path.name, args.model_type, RECIPES.get(path.stem, ""), count))
    return rows


def render_table(rows: list[tuple[str, str, str, int]]) -> str:
    lines = ["| config | family | reproduces | parameters |", "|---|---|---|---:|"]
    lines += [f"| `{name}` | {family} | {recipe} | {count:,} |" for name, family, recipe, count in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_table(config_rows()), end="")
