"""Checkpoints: torchtitan's DCP manager with crash-safe saves and checked loads (``manager``), RNG state
(``rng``), the on-disk layout (``layout``, torch-free) and single-process DCP reading/writing of model weights
(``dcp_io``), which the converters in ``flame.utils`` use. Import the submodule you need: the manager pulls in
torchtitan, the layout nothing."""
