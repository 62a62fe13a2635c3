"""In-loop validation (loss, perplexity on the held-out split) and text samples, in-process on the tiny job."""

import json
import math

import pytest

from tests.trainer_helpers import tensorboard_scalars, text_events


def test_validation_is_logged_every_freq_steps_and_at_the_end(make_trainer, tmp_path):
    trainer = make_trainer("--training.steps", "5", "--validation.enable", "--validation.freq", "2",
                           "--validation.steps", "3", dump=tmp_path / "run")  # fmt: skip
    trainer.train()
    losses = tensorboard_scalars(tmp_path / "run", "loss/validation")
    perplexities = tensorboard_scalars(tmp_path / "run", "perplexity/validation")
    tokens = tensorboard_scalars(tmp_path / "run", "validation/tokens")
    assert sorted(losses) == sorted(perplexities) == [2, 4, 5]
    assert all(perplexities[s] == pytest.approx(math.exp(losses[s]), rel=1e-5) for s in losses)
    assert set(tokens.values()) == {3 * 2 * 64}  # 3 batches of 2 x 64 tokens, every one labelled
    assert losses[5] < losses[2] < math.log(4096) + 0.5  # falling from ~ln(vocab)
    # The same weights give the same result: the split is read again from its start each time.
    again = trainer.validator.validate(trainer.model_parts[0], trainer.device, trainer.amp)
    assert again["loss/validation"] == pytest.approx(losses[5], rel=1e-5)
    assert trainer.model_parts[0].training  # back in training mode


def test_validation_reads_the_whole_split_or_another_dataset(make_trainer, tmp_path):
    whole = make_trainer(
        "--validation.enable", "--validation.seq_len", "128", "--validation.local_batch_size", "4"
    )
    result = whole.validator.validate(whole.model_parts[0], whole.device, whole.amp)
    assert result["validation/tokens"] > 10_000  # the sample corpus' validation split is ~14k tokens
    assert result["validation/tokens"] % 128 == 0  # rows of validation.seq_len (the last batch may be short)

    folder = tmp_path / "held_out"
    folder.mkdir()
    texts = ["Return the number of items in a container. " * 20, "Open a file and return a stream. " * 20]
    (folder / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    other = make_trainer(
        "--validation.enable", "--validation.dataset", str(folder), "--validation.split", "test"
    )
    result = other.validator.validate(other.model_parts[0], other.device, other.amp)
    assert 0 < result["validation/tokens"] < 1000


def test_samples_are_generated_and_logged_as_text(make_trainer, tmp_path, caplog):
    trainer = make_trainer("--inference.interval", "2", "--inference.prompt", "The sorted list|Return a",
                           "--inference.max_new_tokens", "6", dump=tmp_path / "run")  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.train()
    first, second = text_events(tmp_path / "run", "samples/0"), text_events(tmp_path / "run", "samples/1")
    assert sorted(first) == sorted(second) == [2, 4]
    assert first[2].startswith("**The sorted list**") and second[4].startswith("**Return a**")
    assert "sample 1 at step 4: 'Return a' -> " in caplog.text
    # Greedy decoding is deterministic, and the model is back in training mode afterwards.
    model = trainer.model_parts[0]
    once = trainer.sampler.generate(model, trainer.device, trainer.amp, step=4)
    assert once == trainer.sampler.generate(model, trainer.device, trainer.amp, step=4)
    assert [prompt for prompt, _ in once] == ["The sorted list", "Return a"]
    assert model.training


def test_sampling_settings_reach_the_sampler(make_trainer):
    trainer = make_trainer("--inference.interval", "1", "--inference.temperature", "1.0", "--inference.top_k", "1",
                           "--inference.max_new_tokens", "8")  # fmt: skip
    sampler, model = trainer.sampler, trainer.model_parts[0]
    top_1 = sampler.generate(model, trainer.device, trainer.amp, step=1)
    sampler.temperature = 0.0
    assert top_1 == sampler.generate(model, trainer.device, trainer.amp, step=1)  # top-1 sampling is greedy
    sampler.temperature, sampler.top_k = 1.0, 0
    sampled = sampler.generate(model, trainer.device, trainer.amp, step=1)
    assert sampled == sampler.generate(model, trainer.device, trainer.amp, step=1)  # seeded by (seed, step)
    assert sampled != top_1
