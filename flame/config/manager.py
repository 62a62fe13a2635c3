"""Parse a job: TOML file + ``--section.field`` flags over torchtitan's JobConfig merged with flame's sections.

Precedence is torchtitan's: flags > TOML > defaults. Before tyro sees anything, every TOML key and every flag is
checked against the merged schema, so a typo fails at once with one line naming it and the nearest valid name.
"""

import dataclasses
import difflib
import functools
import importlib
import os
import sys
import types
import typing
from typing import Any

import tyro

from flame.config.job_config import ALIASES, FLOAT8_CONVERTER, NO_EFFECT, REPO_ROOT, UpstreamJobConfig
from flame.errors import ConfigError
from flame.hf.hub import resolve_model_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

FLAME_CONFIG_MODULE = "flame.config.job_config"
# The embedded default job, used when no --job.config_file is given.
DEFAULT_JOB = REPO_ROOT / "flame" / "assets" / "default_job.toml"
# TOML keys holding paths that the embedded job gives relative to the repository.
PATH_KEYS = (("model", "config"), ("model", "tokenizer_path"), ("training", "dataset"))


@functools.cache  # one class per module: tyro caches what it reads from a class (docstrings) per class
def job_config_class(custom_module: str | None = None) -> type:
    """torchtitan's JobConfig merged with flame's sections, upstream flame's option names (and a user's custom
    module, if any)."""
    from flame.compat import torchtitan_job_config

    merged = merge_configs(torchtitan_job_config(), importlib.import_module(FLAME_CONFIG_MODULE).JobConfig)
    merged = merge_configs(merged, UpstreamJobConfig)
    if custom_module and custom_module != FLAME_CONFIG_MODULE:
        try:
            user = importlib.import_module(custom_module).JobConfig
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"job.custom_config_module '{custom_module}' has no importable JobConfig ({e})"
            ) from e
        merged = merge_configs(merged, user)
    return merged


def merge_configs(base: type, custom: type) -> type:
    """torchtitan's merge rule (custom fields override, sections merge recursively), with the custom class
    first in the bases so that tyro finds the docstrings of the fields it adds for --help."""
    base_fields = {f.name: f for f in dataclasses.fields(base)}
    custom_fields = {f.name: f for f in dataclasses.fields(custom)}
    merged = []
    for name in {**base_fields, **custom_fields}:
        b, c = base_fields.get(name), custom_fields.get(name)
        if b and c and dataclasses.is_dataclass(b.type) and dataclasses.is_dataclass(c.type):
            section = merge_configs(b.type, c.type)
            merged.append((name, section, dataclasses.field(default_factory=section)))
        else:
            f = c or b
            merged.append((name, f.type, f))
    return dataclasses.make_dataclass(base.__name__, merged, bases=(custom, base))


def parse_args(argv: list[str]) -> Any:
    """The merged JobConfig for a command line; raises ConfigError with one line for any mistake."""
    toml_path = _flag_value(argv, "job.config_file") or str(DEFAULT_JOB)
    toml_values = _resolve_paths(_load_toml(toml_path), toml_path)
    custom_module = _flag_value(argv, "job.custom_config_module") or toml_values.get("job", {}).get(
        "custom_config_module"
    )
    config_cls = job_config_class(custom_module)
    valid = valid_options(config_cls)
    _check_toml_keys(toml_values, config_cls, toml_path or "")
    argv = normalize_switches(argv, valid)
    _check_flags(argv, valid)

    default = _dict_to_dataclass(config_cls, toml_values) if toml_values else config_cls()
    config = tyro.cli(config_cls, args=argv, default=default, registry=_tyro_registry())
    resolve_aliases(config, given_flags=_given_options(argv, valid))
    # A hub name for the model config reads its config.json from the HF cache (fetched once if missing).
    config.model.config = resolve_model_config(config.model.config)
    return config


def _resolve_paths(values: dict[str, Any], toml_path: str) -> dict[str, Any]:
    """The default job names files relative to the repository, so it runs from any directory."""
    if toml_path != str(DEFAULT_JOB):
        return values
    for section, key in PATH_KEYS:
        if key in values.get(section, {}):
            values[section][key] = str(REPO_ROOT / values[section][key])
    return values


def valid_options(config_cls: type) -> dict[str, dataclasses.Field]:
    """Every dotted option name of a JobConfig class ('training.steps', 'training.dataloader.num_workers')."""
    options = {}

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            name = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(f.type):
                walk(f.type, f"{name}.")
            else:
                options[name] = f

    walk(config_cls, "")
    return options


def suggest(name: str, candidates: list[str]) -> str:
    """'; did you mean 'x'?' for a near match only: a close field name in the same section, the same field
    name in another section, or a close dotted name when the section itself is mistyped."""
    section, _, field_name = name.rpartition(".")
    sections = {c.rpartition(".")[0] for c in candidates}
    if section in sections:
        fields = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == section}
        match = difflib.get_close_matches(field_name, list(fields), n=1, cutoff=0.6)
        if match:
            return f"; did you mean '{fields[match[0]]}'?"
        elsewhere = sorted(c for c in candidates if c.rpartition(".")[2] == field_name)
        if elsewhere:
            return f"; did you mean '{elsewhere[0]}'?"
    else:
        match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
        if match:
            return f"; did you mean '{match[0]}'?"
    return "; run with --help to list every option"


def _flag_value(argv: list[str], name: str) -> str | None:
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key in spellings:
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
            raise ConfigError(f"--{name} needs a value")
    return None


def _load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"job config file {path} does not exist; check --job.config_file") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job config file {path} is not valid TOML: {e}") from e


def _check_toml_keys(values: dict[str, Any], cls: type, path: str, prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            candidates = [f"{prefix}{k}" for k in fields]
            raise ConfigError(f"unknown key '{name}' in {path}{suggest(name, candidates)}")
        field_type = fields[key].type
        if dataclasses.is_dataclass(field_type):
            if not isinstance(value, dict):
                raise ConfigError(f"'{name}' in {path} must be a [{name}] table, not a value")
            _check_toml_keys(value, field_type, path, f"{name}.")
        elif mismatch := _toml_value_mismatch(value, field_type):
            raise ConfigError(f"'{name}' in {path} {mismatch}, got {value!r}")


# Annotations written as strings by modules with postponed annotations.
_NAMED_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def _toml_value_mismatch(value: Any, annotation: Any) -> str | None:
    """What a TOML value of an option with this annotation must be, where it is not; None where it fits (or the
    annotation is one flame does not check: the trainer's own checks, flame.config.checks, see the value then).
    Flags are parsed by tyro; TOML values become tyro's defaults, which it does not check."""
    annotation = _NAMED_TYPES.get(annotation, annotation)
    if (choices := _literal_choices(annotation)) is not None:
        return None if value in choices else f"must be one of {', '.join(map(str, choices))}"
    if typing.get_origin(annotation) is list:
        return None if isinstance(value, list) else "takes a list"
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = (
        {_NAMED_TYPES.get(a, a) for a in typing.get_args(annotation)} - {type(None)}
        if union
        else {annotation}
    )
    if bool in members:
        return None if isinstance(value, bool) else "takes true or false"
    if isinstance(value, bool):  # a bool is an int to Python, not to an int or float option
        return "takes a number" if float in members else "takes an integer" if int in members else None
    if float in members:
        return None if isinstance(value, (int, float)) else "takes a number"
    if int in members:
        return None if isinstance(value, int) else "takes an integer"
    if str in members:
        return None if isinstance(value, str) else "takes a string"
    return None


def _tyro_registry() -> "tyro.constructors.ConstructorRegistry":
    """torchtitan's rule: list[str] options take one comma-separated value."""
    registry = tyro.constructors.ConstructorRegistry()

    @registry.primitive_rule
    def list_str_rule(type_info: tyro.constructors.PrimitiveTypeInfo):
        if type_info.type != list[str]:
            return None
        return tyro.constructors.PrimitiveConstructorSpec(
            nargs=1,
            metavar="A,B,C,...",
            instance_from_str=lambda args: args[0].split(","),
            is_instance=lambda instance: all(isinstance(i, str) for i in instance),
            str_from_instance=lambda instance: [",".join(instance)],
        )

    return registry


def _is_switch(annotation: Any) -> bool:
    """bool, or ``bool | None`` (an alias switch whose None means 'not given')."""
    return annotation in (bool, "bool") or set(typing.get_args(annotation)) == {bool, type(None)}


def _switch(flag: str, valid: dict[str, dataclasses.Field]) -> tuple[str, bool] | None:
    """(option, negated) for a switch spelled --x, --section.no-x or --no-section.x; None for anything else."""
    name = flag.replace("-", "_")
    section, _, field_name = name.rpartition(".")
    for option, negated in (
        (name, False),
        (name.removeprefix("no_"), name.startswith("no_")),
        (f"{section}.{field_name.removeprefix('no_')}", field_name.startswith("no_")),
    ):
        if (negated or option == name) and option in valid and _is_switch(valid[option].type):
            return option, negated
    return None


def normalize_switches(argv: list[str], valid: dict[str, dataclasses.Field]) -> list[str]:
    """Switches as tyro takes them, from every spelling upstream's users type: ``--x``, ``--x true|false``,
    ``--x=false``, ``--no-x`` and ``--section.no-x``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        switch = _switch(arg[2:].partition("=")[0], valid) if arg.startswith("--") else None
        if switch is None:
            out.append(arg)
            continue
        name, negated = switch
        _, eq, word = arg.partition("=")
        if not eq and i < len(argv) and argv[i].lower() in ("true", "false"):
            word = argv[i]
            i += 1
        if (eq or word) and word.lower() not in ("true", "false"):
            raise ConfigError(
                f"{arg.partition('=')[0]} is a switch: give it alone or with true/false, got '{word}'"
            )
        on = (word.lower() != "false" if word else True) != negated
        if valid[name].type in (bool, "bool"):
            section, _, field_name = name.rpartition(".")
            out.append(f"--{name}" if on else f"--{section}.no-{field_name}")
        else:
            out += [f"--{name}", str(on)]
    return out


def _check_flags(argv: list[str], valid: dict[str, dataclasses.Field]) -> None:
    """Every --flag exists, values of int, float and choice options parse, and no value is left over.
    Runs on normalized switches (:func:`normalize_switches`)."""
    names = list(valid)
    takes_value, previous = False, None
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            takes_value, previous = False, None
            continue
        if not arg.startswith("--"):
            if takes_value:
                takes_value = False
            elif previous is not None and _switch(previous, valid):
                raise ConfigError(f"--{previous} is a switch: give it alone or with true/false, got '{arg}'")
            elif previous is not None and os.path.exists(arg):
                raise ConfigError(
                    f"unexpected argument '{arg}' after --{previous}'s value: it takes one value; if the shell "
                    f"expanded a glob into several files, quote the glob (--{previous} 'dir/*.jsonl')"
                )
            else:
                raise ConfigError(f"unexpected argument '{arg}': options are --section.field [value]")
            continue
        takes_value, previous = False, arg[2:]
        flag, eq, value = arg[2:].partition("=")
        name = flag.replace("-", "_")
        if switch := _switch(flag, valid):
            takes_value = not _is_bool(valid[switch[0]].type)  # a bool | None switch: True/False follows
            continue
        if name not in valid:
            raise ConfigError(f"unknown option --{flag}{suggest(name, names)}")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"option --{flag} needs a value")
            value = argv[i + 1]
            takes_value = True
        _check_value(flag, value, valid[name].type)


def _given_options(argv: list[str], valid: dict[str, dataclasses.Field]) -> set[str]:
    """Dotted names of the options on a (normalized) command line."""
    given = set()
    for arg in argv:
        if arg.startswith("--"):
            flag = arg[2:].partition("=")[0]
            switch = _switch(flag, valid)
            given.add(switch[0] if switch else flag.replace("-", "_"))
    return given


def _is_bool(annotation: Any) -> bool:
    return annotation is bool or annotation == "bool"


def _literal_choices(annotation: Any) -> tuple | None:
    """The choices of a Literal option, or of an optional one (Literal[...] | None); None for any other."""
    literal = next(
        (a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal),
        None,
    )
    return None if literal is None else typing.get_args(literal)


def _check_value(flag: str, value: str, annotation: Any) -> None:
    types = set(typing.get_args(annotation)) or {annotation}
    if value == "None" and type(None) in types:
        return
    if (options := _literal_choices(annotation)) is not None:
        if value not in [str(o) for o in options]:
            raise ConfigError(f"--{flag} must be one of {', '.join(map(str, options))}, got '{value}'")
        return
    for kind in (int, float):
        if kind in types:
            try:
                kind(value)
            except ValueError:
                if not (kind is int and float in types):
                    raise ConfigError(
                        f"--{flag} takes {'an integer' if kind is int else 'a number'}, got '{value}'"
                    ) from None
            return


def _dict_to_dataclass(cls: type, data: dict[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = _dict_to_dataclass(f.type, value) if dataclasses.is_dataclass(f.type) else value
    return cls(**kwargs)


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _set(config: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        config = getattr(config, part)
    setattr(config, last, value)


def resolve_aliases(config: Any, given_flags: set[str] = frozenset()) -> None:
    """Copy flame's user-facing aliases (``training.batch_size`` ...) and upstream flame's option names onto
    torchtitan's fields. ``given_flags``: options on the command line; an alias from the TOML file does not
    override its target given as a flag (flags > TOML)."""
    for alias, target in ALIASES.items():
        value = _get(config, alias)
        if value is not None and not (alias not in given_flags and target in given_flags):
            _set(config, target, value)
    accumulation = config.training.gradient_accumulation_steps
    if accumulation is not None and accumulation < 1:
        raise ConfigError(f"training.gradient_accumulation_steps must be >= 1, got {accumulation}")
    if config.optimizer.fused is not None:
        config.optimizer.implementation = "fused" if config.optimizer.fused else "foreach"
    _resolve_scheduler_name(config)
    _convert_upstream_values(config)


# Upstream options whose values mean something else in flame's fields: converted by _convert_upstream_values.
UPSTREAM_CONVERTED = (
    "metrics.rank_0_only",
    "experimental.pipeline_parallel_microbatches",
    "float8.enable_float8_linear",
    "float8.scaling_type_input",
    "float8.scaling_type_weight",
    "float8.scaling_type_grad_output",
    "checkpoint.interval_type",
)


def _convert_upstream_values(config: Any) -> None:
    if config.metrics.rank_0_only is not None:
        config.metrics.save_for_all_ranks = not config.metrics.rank_0_only
    microbatches = config.experimental.pipeline_parallel_microbatches
    if microbatches is not None:
        batch = config.training.local_batch_size
        if microbatches < 1 or batch % microbatches:
            raise ConfigError(
                f"experimental.pipeline_parallel_microbatches must divide training.batch_size ({batch}), "
                f"got {microbatches}"
            )
        config.parallelism.pipeline_parallel_microbatch_size = batch // microbatches
    float8_linear = config.float8.enable_float8_linear
    converters = [c for c in config.model.converters if c != FLOAT8_CONVERTER]
    if float8_linear is not None:
        config.model.converters = [*converters, FLOAT8_CONVERTER] if float8_linear else converters
    for kind in ("input", "weight", "grad_output"):
        if getattr(config.float8, f"scaling_type_{kind}") == "delayed":
            raise ConfigError(
                f"float8.scaling_type_{kind} delayed is not supported (torchao removed delayed scaling); "
                "flame scales dynamically: drop the option or pass dynamic"
            )
    if config.checkpoint.interval_type == "seconds":
        raise ConfigError(
            "checkpoint.interval_type seconds is not supported: flame counts checkpoint.interval in steps; "
            "drop --checkpoint.interval_type and give the interval in steps"
        )


def upstream_notices(config: Any) -> list[str]:
    """One line per upstream option that was given but has no effect in flame (NO_EFFECT)."""
    notices = []
    for name, reason in NO_EFFECT.items():
        section, _, field_name = name.rpartition(".")
        field = next(f for f in dataclasses.fields(_get(config, section)) if f.name == field_name)
        if _get(config, name) != field.default:
            notices.append(f"notice: --{name} has no effect in flame: {reason}")
    return notices


# Fraction of the steps that older flame's "wsd" schedule decays over when lr_scheduler.decay_ratio is unset.
WSD_DEFAULT_DECAY_RATIO = 0.1


def _resolve_scheduler_name(config: Any) -> None:
    """Older flame's ``--optimizer.scheduler {wsd,cosine,linear}`` on torchtitan's warmup-stable-decay schedule."""
    name, scheduler = config.optimizer.scheduler, config.lr_scheduler
    if name is None:
        return
    if name == "wsd":
        if scheduler.decay_ratio is None:
            scheduler.decay_ratio = WSD_DEFAULT_DECAY_RATIO
        return
    if scheduler.decay_ratio is not None:
        raise ConfigError(
            f"optimizer.scheduler {name} decays from the end of warmup and takes no lr_scheduler.decay_ratio; "
            "use --optimizer.scheduler wsd (with --lr_scheduler.decay_type) for a stable phase"
        )
    scheduler.decay_type = name


def main(argv: list[str] | None = None) -> None:
    """``python -m flame.config.manager [flags]``: print the merged config (debugging aid)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(config)


if __name__ == "__main__":
    main()
