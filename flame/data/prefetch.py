"""The training loop's batches, fetched and copied to the device while the step before them runs.

:class:`DevicePrefetcher` takes batches from the dataloader ``ahead`` at a time (the trainer: one step's
micro-batches) and starts their copies to the GPU on a stream of its own, from the loader's pinned memory, so that
neither the wait for the workers nor the copies hold up the next step. Each batch it holds carries the loader's
state as of that batch; the prefetcher's own state (what a checkpoint saves) is the one of the last batch it handed
out, so a run resumed from it gets exactly the batches the uninterrupted run would have got, the prefetched ones
included. On the CPU the batches stay where they are and only the order of work changes.
"""

import time
from collections import deque

import torch
from torch.distributed.checkpoint.stateful import Stateful

from flame.data.loader import FlameDataLoader

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class DevicePrefetcher(Stateful):
    """Iterates over ``loader``'s batches on ``device``; :meth:`prefetch` fetches up to ``ahead`` batches in advance.

    ``device`` None leaves the batches on the host (context parallelism slices them there first).
    ``wait_seconds`` adds up the time spent waiting for the loader, the data-loading share of the metrics.
    """

    def __init__(self, loader: FlameDataLoader, device: torch.device | None, ahead: int):
        self.loader = loader
        self.device = device
        self.ahead = ahead
        on_gpu = device is not None and device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if on_gpu else None
        self._iterator = None
        self._exhausted = False
        # (batch, the event its copies end with or None, the loader's state as of this batch), oldest first.
        self._held: deque[tuple[Batch, torch.cuda.Event | None, dict]] = deque()
        self._handed_out_state: dict | None = None  # None until iterating: the loader's own state
        self.wait_seconds = 0.0

    def __iter__(self) -> "DevicePrefetcher":
        if self._iterator is None:
            self._iterator = iter(self.loader)
            self._handed_out_state = self.loader.loader_state()  # where reading starts
        return self

    def __next__(self) -> Batch:
        if not self._held and not self._fetch():
            raise StopIteration
        batch, copied, state = self._held.popleft()
        if copied is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(copied)
            for tensor in _tensors(batch):
                # Allocated on the copy stream: its memory must not be reused while this stream still reads it.
                tensor.record_stream(stream)
        self._handed_out_state = state
        return batch

    def prefetch(self) -> None:
        """Fetch batches and start their copies until ``ahead`` are held: call it once the step's work is queued."""
        while len(self._held) < self.ahead and self._fetch():
            pass

    def _fetch(self) -> bool:
        if self._exhausted:
            return False
        iter(self)
        start = time.perf_counter()
        try:
            inputs, labels = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            return False
        finally:
            self.wait_seconds += time.perf_counter() - start
        state = self.loader.loader_state()
        copied = None
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                inputs = {key: value.to(self.device, non_blocking=True) for key, value in inputs.items()}
                labels = labels.to(self.device, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
        self._held.append(((inputs, labels), copied, state))
        return True

    def state_dict(self) -> dict:
        if self._handed_out_state is None:
            return self.loader.state_dict()
        return self.loader.checkpoint_state(self._handed_out_state)

    def load_state_dict(self, state_dict: dict) -> None:
        if self._iterator is not None:
            raise RuntimeError("load the dataloader state before iterating")
        self.loader.load_state_dict(state_dict)
        self._handed_out_state = None


def _tensors(batch: Batch):
    inputs, labels = batch
    yield from inputs.values()
    yield labels
