"""Job configuration: torchtitan's TOML + flags, extended with flame's sections."""

from flame.config.manager import parse_args

__all__ = ["parse_args"]
