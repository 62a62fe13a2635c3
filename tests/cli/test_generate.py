"""flame.cli.generate: sampling from an export or a DCP checkpoint with flame's model code, or from an export with
transformers."""

import pytest
import torch

from flame.cli import convert_dcp_to_hf, generate
from tests.utils.helpers import TOKENIZER, save_checkpoint, tiny_model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generate")
    model = tiny_model("transformer", attn_impl="parallel_softpick_attn")
    save_checkpoint(folder / "dump", model, step=1)
    assert convert_dcp_to_hf.main(["--path", str(folder / "dump"), "--output", str(folder / "hf")]) == 0
    return model, folder / "hf"


def run(capsys, *argv: str) -> str:
    assert generate.main(list(argv)) == 0
    return capsys.readouterr().out.rstrip("\n")


def test_greedy_text_is_the_same_with_flame_and_transformers(exported, capsys):
    model, hf = exported
    argv = ["--model", str(hf), "--prompt", "Return a new", "--max_new_tokens", "6", "--temperature", "0"]
    flame_text = run(capsys, *argv, "--backend", "flame")
    assert flame_text.startswith("Return a new") and len(flame_text) > len("Return a new")
    assert run(capsys, *argv, "--backend", "transformers") == flame_text
    # The greedy continuation is the training model's argmax, token by token.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode("Return a new")]])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert flame_text == "Return a new" + tokenizer.decode(ids[0, -6:], skip_special_tokens=True)


def test_sampling_is_seeded(exported, capsys):
    _, hf = exported
    argv = ["--model", str(hf), "--prompt", "The", "--max_new_tokens", "8", "--top_k", "50", "--top_p", "0.9"]
    first = run(capsys, *argv, "--seed", "3")
    assert run(capsys, *argv, "--seed", "3") == first


def test_a_dump_folder_generates_what_its_export_does(exported, capsys):
    _, hf = exported
    argv = ["--prompt", "Return a new", "--max_new_tokens", "6", "--temperature", "0"]
    from_export = run(capsys, "--model", str(hf), *argv)
    assert run(capsys, "--model", str(hf.parent / "dump"), "--step", "1", *argv) == from_export


def test_missing_model_folder(tmp_path, capsys):
    assert generate.main(["--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"error: the checkpoint folder {tmp_path / 'none'} does not exist")
    )
