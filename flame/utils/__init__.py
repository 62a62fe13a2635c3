"""Upstream flame's module paths for its command-line tools: ``python -m flame.utils.<tool>`` runs
``flame.cli.<tool>`` (``convert_dcp_to_hf``, ``convert_hf_to_dcp``, ``generate``, ``preprocess``), so upstream users'
scripts work as typed."""
