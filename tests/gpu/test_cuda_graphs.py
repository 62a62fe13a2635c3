"""--compile.mode reduce-overhead trains as the plain compiled step does: the trainer's step on one GPU, two
micro-batches per step (the blocks' CUDA graphs replay twice before the optimizer reads the gradients) for four
steps, from the same weights and batches. The graphs replay the kernels inductor compiled for the plain mode, so the
losses and gradient norms agree to float32 rounding of the accumulation (relative 1e-4); a replay that overwrote a
micro-batch's activations or gradients before they were used would change them at once."""

import torch

from flame.loss import IGNORE_INDEX

STEPS = 4


def curve(make_trainer, mode: str) -> list[tuple[float, float]]:
    trainer = make_trainer(
        "--compile.enable", "--compile.mode", mode, "--training.gradient_accumulation_steps", "2"
    )
    device = trainer.topology.device
    generator = torch.Generator(device).manual_seed(3)
    vocab = trainer.model_args.vocab_size
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2, 65), device=device, generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, :20] = IGNORE_INDEX  # micro-batches of different label counts
        batches.append(({"input": tokens[:, :-1]}, labels))
    values = []
    for step in range(1, STEPS + 1):
        trainer.step = step
        result = trainer.train_step_fn(batches)
        values.append((trainer.train_step_fn.global_metrics(result)["loss"], float(result.grad_norm)))
    return values


def test_cuda_graph_steps_train_as_the_plain_compiled_steps(make_trainer):
    plain = curve(make_trainer, "default")
    graphs = curve(make_trainer, "reduce-overhead")
    assert plain[-1][0] < plain[0][0], plain  # it trains
    for (loss, norm), (graph_loss, graph_norm) in zip(plain, graphs, strict=True):
        assert abs(graph_loss - loss) <= 1e-4 * abs(loss) and abs(graph_norm - norm) <= 1e-4 * norm, (
            plain,
            graphs,
        )
