"""The export's options, in a module without torch: command lines parse them, and train.sh's end-of-run export
(flame.cli.convert_dcp_to_hf --after_training) finds that there is nothing to export, without importing torch."""

EXPORT_FORMATS = ("auto", "fla", "flame", "llama", "olmo_hybrid", "hf")
# Each dtype name an export accepts, and the torch dtype it names.
EXPORT_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"
