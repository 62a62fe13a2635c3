"""Mixing the document streams of several datasets by probability.

Each document is drawn from dataset ``i`` with probability ``data_probs[i]`` (probabilities of documents, not
of tokens), with an RNG seeded by (seed, data shard): a run with the same seed draws the same sequence, and
the RNG's state is part of the loader's state. When a finite stream (evaluation) runs out, the others go on
with their probabilities renormalized.
"""

import numpy as np


class DocumentMixer:
    def __init__(self, streams: list, probs: tuple[float, ...], seed: int, shard: int):
        self._streams = streams
        self._probs = np.asarray(probs, dtype=np.float64)
        self._exhausted = [False] * len(streams)
        self._rng = np.random.default_rng((seed, shard))

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if len(self._streams) == 1:
            return next(self._streams[0])
        while True:
            weights = np.where(self._exhausted, 0.0, self._probs)
            cumulative = np.cumsum(weights)
            if cumulative[-1] <= 0:
                raise StopIteration
            chosen = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
            try:
                return next(self._streams[chosen])
            except StopIteration:
                self._exhausted[chosen] = True

    def state_dict(self) -> dict:
        return {
            "rng": self._rng.bit_generator.state,
            "exhausted": list(self._exhausted),
            "streams": [stream.state_dict() for stream in self._streams],
        }

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["rng"]
        self._exhausted = list(state["exhausted"])
        for stream, stream_state in zip(self._streams, state["streams"]):
            stream.load_state_dict(stream_state)
