"""User-facing errors: raised for bad input, printed as one line by the entry points."""


class FlameError(Exception):
    """A mistake in the user's input (config, files, flags). The message says what is wrong and what to do."""


class ConfigError(FlameError):
    """A bad job config option, TOML key or value."""


class ModelConfigError(FlameError):
    """A bad value in a model config JSON."""
