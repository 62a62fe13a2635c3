"""In-loop validation: cross-entropy and perplexity on a held-out split every ``validation.freq`` steps.

``--validation.enable`` reads ``validation.split`` ("validation") of the training dataset(s), or of
``validation.dataset``, once and in order through flame's data pipeline, each data-parallel rank its own shard;
``validation.steps`` caps the batches per rank (-1: the whole split). The loss is summed over every labelled token
of every rank and divided by their count, so it does not depend on how the split is sharded.
"""

import copy
import itertools
import math

import torch
from torch.distributed.device_mesh import DeviceMesh

from flame.data import build_dataloader
from flame.errors import FlameError
from flame.loss import IGNORE_INDEX, labelled_tokens, loss_sums
from flame.models.common.decoder import fuses_linear_cross_entropy


def validation_job_config(job_config):
    """A copy of the job whose training.* data fields describe the validation data."""
    config = copy.deepcopy(job_config)
    validation, training = job_config.validation, config.training
    if validation.dataset is not None:
        training.dataset, training.dataset_name = validation.dataset, validation.dataset_name
        training.data_dir = training.data_files = training.data_probs = training.text_column = None
    training.local_batch_size = validation.local_batch_size or training.local_batch_size
    training.seq_len = validation.seq_len or training.seq_len
    training.dataloader = validation.dataloader
    return config


class Validator:
    def __init__(self, job_config, tokenizer, dp_rank: int, dp_degree: int, batch_mesh: DeviceMesh | None):
        self.freq = job_config.validation.freq
        self.steps = job_config.validation.steps
        self.split = job_config.validation.split
        self.batch_mesh = batch_mesh
        self.dataloader = build_dataloader(
            validation_job_config(job_config), tokenizer, dp_rank, dp_degree, split=self.split
        )

    def should_validate(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    def _all_ranks_have(self, has_batch: bool, device: torch.device) -> bool:
        """Ranks may hold different numbers of batches; all stop together (sharded models need every rank)."""
        if self.batch_mesh is None:
            return has_batch
        flag = torch.tensor(float(has_batch), device=device)
        torch.distributed.all_reduce(
            flag, op=torch.distributed.ReduceOp.MIN, group=self.batch_mesh.get_group()
        )
        return bool(flag.item())

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, device: torch.device, amp) -> dict[str, float]:
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        tokens = torch.zeros((), dtype=torch.float64, device=device)
        batches = iter(self.dataloader)
        for _ in itertools.count() if self.steps == -1 else range(self.steps):
            batch = next(batches, None)
            if not self._all_ranks_have(batch is not None, device):
                break
            inputs, labels = ({k: v.to(device) for k, v in batch[0].items()}, batch[1].to(device))
            fused = fuses_linear_cross_entropy(model)  # then without the logits, as in training
            with amp:
                output = model(
                    inputs["input"],
                    position_ids=inputs.get("position_ids"),
                    cu_seqlens=inputs.get("cu_seqlens"),
                    **({"return_hidden": True} if fused else {}),
                )
                if fused:
                    loss_sum += model.lm_head(output, labels, ignore_index=IGNORE_INDEX)[1]
            if not fused:
                loss_sum += loss_sums(output, labels, z_loss=False)[0]
            tokens += labelled_tokens(labels)
        model.train()
        if self.batch_mesh is not None:
            totals = torch.stack([loss_sum, tokens])
            torch.distributed.all_reduce(totals, group=self.batch_mesh.get_group())
            loss_sum, tokens = totals
        if tokens.item() == 0:
            raise FlameError(f"the validation split '{self.split}' holds no tokens; check --validation.split")
        loss = (loss_sum / tokens).item()
        return {
            "loss/validation": loss,
            "perplexity/validation": math.exp(loss),
            "validation/tokens": tokens.item(),
        }
