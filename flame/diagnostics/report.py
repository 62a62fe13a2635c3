"""The diagnostics' results as one JSON-able dict, a Markdown report (also what the command prints) and a PNG.

The dict (``diagnostics.json``): ``source``, ``settings``, ``layers`` (one entry per decoder layer: ``layer``,
``mixer``, ``attention`` = null for a layer without attention map, else ``first_token_attention`` per head,
``mean_first_token_attention``, ``sink_heads``, ``heads``, ``zero_fraction``, ``near_zero_fraction``; and
``max_abs``, ``max_abs_position``, ``max_abs_channel``, ``kurtosis``), ``attention_layers``, ``sink_heads``,
``attention_heads``, ``sink_rate`` (null without attention layers) and ``passkey`` (``length``, ``prompt_tokens``,
``trials``, ``correct``, ``accuracy`` per length).
"""

import math
from pathlib import Path

from torch import nn

from flame.diagnostics.activations import ActivationStats
from flame.diagnostics.attention import AttentionStats
from flame.diagnostics.passkey import PasskeyResult
from flame.errors import FlameError


def finite_or_none(value):
    """JSON has no NaN: a kurtosis of constant values is written as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def summarize(
    model: nn.Module,
    attention: AttentionStats,
    activations: ActivationStats,
    passkey: list[PasskeyResult],
    source: str,
    settings: dict,
) -> dict:
    threshold = settings["sink_threshold"]
    layers = []
    for name, block in model.layers.items():
        i = int(name)
        stats, act = attention.layers.get(i), activations.layers[i]
        entry = {
            "layer": i,
            "mixer": stats.description if stats else type(block.attn).__name__,
            "attention": None,
        }
        if stats is not None:
            per_head = stats.first_token_attention
            entry["attention"] = {
                "heads": len(per_head),
                "first_token_attention": per_head,
                "mean_first_token_attention": sum(per_head) / len(per_head),
                "sink_heads": stats.sink_heads(threshold),
                "zero_fraction": stats.zero_fraction,
                "near_zero_fraction": stats.near_zero_fraction,
            }
        entry.update(
            max_abs=act.max_abs,
            max_abs_position=act.max_position,
            max_abs_channel=act.max_channel,
            kurtosis=finite_or_none(act.kurtosis),
        )
        layers.append(entry)
    with_attention = [entry["attention"] for entry in layers if entry["attention"]]
    sink_heads = sum(a["sink_heads"] for a in with_attention)
    heads = sum(a["heads"] for a in with_attention)
    return {
        "source": source,
        "settings": settings,
        "layers": layers,
        "attention_layers": [entry["layer"] for entry in layers if entry["attention"]],
        "sink_heads": sink_heads,
        "attention_heads": heads,
        "sink_rate": sink_heads / heads if heads else None,
        "passkey": [
            {
                "length": r.length,
                "prompt_tokens": r.prompt_tokens,
                "trials": r.trials,
                "correct": r.correct,
                "accuracy": r.accuracy,
            }
            for r in passkey
        ],
    }


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table padded to aligned columns, readable as printed text too."""
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    line = lambda cells: "| " + " | ".join(cell.ljust(w) for cell, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def layer_table(result: dict) -> str:
    near_zero = result["settings"]["near_zero"]
    header = [
        "layer",
        "mixer",
        "sink heads",
        "first-token attn",
        "zero",
        f"< {near_zero:g}",
        "max abs(h) (token)",
        "kurtosis",
    ]
    rows = []
    for entry in result["layers"]:
        a = entry["attention"]
        attention_cells = (
            [
                f"{a['sink_heads']}/{a['heads']}",
                f"{a['mean_first_token_attention']:.3f}",
                f"{a['zero_fraction']:.3f}",
                f"{a['near_zero_fraction']:.3f}",
            ]
            if a
            else ["-"] * 4
        )
        rows.append(
            [
                str(entry["layer"]),
                entry["mixer"],
                *attention_cells,
                f"{entry['max_abs']:.4g} ({entry['max_abs_position']})",
                "n/a" if entry["kurtosis"] is None else f"{entry['kurtosis']:.4g}",
            ]
        )
    return markdown_table(header, rows)


def sink_line(result: dict) -> str:
    threshold = result["settings"]["sink_threshold"]
    if result["sink_rate"] is None:
        return "Sink rate: n/a (no attention layers; linear-attention layers have no attention map)"
    layers = result["attention_layers"]
    named = f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}"
    return (
        f"Sink rate: {result['sink_rate']:.3f} ({result['sink_heads']} of {result['attention_heads']} heads "
        f"of attention {named} have mean first-token attention > {threshold:g})"
    )


def passkey_table(result: dict) -> str:
    rows = [
        [str(p["length"]), str(p["prompt_tokens"]), f"{p['accuracy']:.2f}", f"{p['correct']}/{p['trials']}"]
        for p in result["passkey"]
    ]
    return markdown_table(["context length", "prompt tokens", "passkey accuracy", "correct"], rows)


def markdown(result: dict) -> str:
    settings = result["settings"]
    parts = [
        f"Diagnostics of {result['source']}: {settings['num_sequences']} sequences x {settings['seq_len']} "
        f"tokens of {settings['text']}",
        "",
        layer_table(result),
        "",
        sink_line(result),
    ]
    if result["passkey"]:
        parts += ["", passkey_table(result)]
    return "\n".join(parts) + "\n"


def require_matplotlib() -> None:
    """FlameError (one line) unless matplotlib imports; checked before the model runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise FlameError(
            "flame.diagnostics draws diagnostics.png with matplotlib: pip install 'flame[plot]' "
            "(or pip install matplotlib)"
        ) from e


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [entry["layer"] for entry in result["layers"]]
    attended = [entry for entry in result["layers"] if entry["attention"]]
    figure, axes = plt.subplots(2, 3, figsize=(16, 8))
    ax = axes[0, 0]
    if attended:
        for entry in attended:
            per_head = entry["attention"]["first_token_attention"]
            ax.scatter([entry["layer"]] * len(per_head), per_head, s=14, alpha=0.7, color="tab:blue")
        ax.axhline(
            result["settings"]["sink_threshold"],
            color="tab:red",
            linestyle="--",
            linewidth=1,
            label="sink threshold",
        )
        ax.legend(fontsize="small")
        ax.set_title(f"mean attention to the first token, per head (sink rate {result['sink_rate']:.3f})")
    else:
        ax.text(0.5, 0.5, "no attention layers", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("mean attention to the first token, per head")
    ax.set_ylim(-0.02, 1.02)
    ax = axes[0, 1]
    if attended:
        x = [entry["layer"] for entry in attended]
        ax.plot(x, [e["attention"]["zero_fraction"] for e in attended], marker="o", label="exactly 0")
        ax.plot(
            x,
            [e["attention"]["near_zero_fraction"] for e in attended],
            marker="o",
            label=f"< {result['settings']['near_zero']:g}",
        )
        ax.legend(fontsize="small")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("attention sparsity (fraction of visible weights)")
    axes[0, 2].plot(layers, [entry["max_abs"] for entry in result["layers"]], marker="o")
    axes[0, 2].set_yscale("log")
    axes[0, 2].set_title("max |h| after each layer")
    kurtoses = [math.nan if e["kurtosis"] is None else e["kurtosis"] for e in result["layers"]]
    axes[1, 0].plot(layers, kurtoses, marker="o")
    axes[1, 0].set_title("kurtosis of h after each layer (Fisher)")
    for ax in (axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0]):
        ax.set_xlabel("layer")
        ax.set_xticks(layers)
    ax = axes[1, 1]
    if result["passkey"]:
        lengths = [p["length"] for p in result["passkey"]]
        ax.plot(lengths, [p["accuracy"] for p in result["passkey"]], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(length) for length in lengths])
    else:
        ax.text(0.5, 0.5, "passkey retrieval not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_title("passkey retrieval accuracy")
    axes[1, 2].set_visible(False)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    figure.suptitle(result["source"], fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    plt.close(figure)
