"""Checkpoints: torchtitan's DCP manager with crash-safe saves and verified loads (``manager``), RNG state as
tensors (``rng``), the on-disk layout (``layout``, torch-free), whole-checkpoint checks (``verify``; the command
``python -m flame.checkpoint verify``), saving on a preemption signal (``preemption``), one run per dump folder
(``lock``), uploads to the hub in the background (``hub_upload``) and single-process DCP reading/writing of model
weights (``dcp_io``), which the converters in ``flame.cli`` use. Import the submodule you need: the manager pulls
in torchtitan, the layout nothing."""
