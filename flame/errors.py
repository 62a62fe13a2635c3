"""User-facing errors: raised for bad input or a machine the run cannot go on with, printed as one line by the entry
points."""


class FlameError(Exception):
    """A mistake in the user's input (config, files, flags), or something of the machine the run cannot go on with.
    The message says what is wrong and what to do."""


class ConfigError(FlameError):
    """A bad job config option, TOML key or value."""


class ModelConfigError(FlameError):
    """A bad value in a model config JSON."""


class KernelBuildError(FlameError):
    """A kernel that does not build on this machine, where the run cannot go on without it; the message names the
    backend to turn off."""


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (its type's name when it has none), for one-line reports;
    a first line that only introduces the next (torch's BackendCompilerFailed: "backend='inductor' raised:") runs on
    into it, so that the report names the actual error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = lines[0] if not lines[0].endswith(":") or len(lines) == 1 else f"{lines[0]} {lines[1]}"
    return line[:300]
