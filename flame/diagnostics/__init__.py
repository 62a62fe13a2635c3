"""Diagnostics of a checkpoint: attention sinks, attention sparsity, massive activations, passkey retrieval.

``python -m flame.diagnostics --checkpoint <folder>`` (see __main__.py and docs/diagnostics.md). One concern per
module: ``attention`` (sink rate and sparsity, from the q/k every attention call receives), ``activations``
(max |h| and kurtosis after each layer), ``passkey`` (retrieval accuracy vs context length), ``inputs`` (the text
measured on) and ``report`` (JSON, table, PNG); checkpoints are read by flame.hf.load.
"""
