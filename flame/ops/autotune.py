"""One tuner per kernel and key on a host: Triton's autotuning serialized across processes.

With ``TRITON_CACHE_AUTOTUNING=1`` (train.sh's default) Triton keeps each kernel's autotuning result in its cache
directory, and a process that finds the result there runs its choice. But processes that meet an untuned kernel at
the same time (the ranks of a job, or jobs sharing a host) each benchmark it, each keep their own choice, and the
cache keeps whichever was written last. Ranks, and the launches that resume the job later, then run different
configurations of the same kernel, whose results differ in the last bits (a resumed job stops repeating the
uninterrupted one: docs/checkpoints.md, "The chaos test"), and every rank benchmarks while the others' collectives
are in flight. Here each (kernel, key, configurations) is tuned under a file lock in Triton's cache directory: the
first process to reach it benchmarks and writes the result, the others wait for the lock and read that result.

The cache directory is the host's, not the device's: torch.compile points an unset ``TRITON_CACHE_DIR`` at a folder
per GPU (``/tmp/torchinductor_<user>/triton/<device index>``) when it makes its first kernel, so rank 1 of a compiled
job would not find the results that rank 0, or a one-GPU run before the job, wrote, and would tune for itself.

Shipped results: ``flame/assets/autotune/`` holds tuning results measured on GPUs flame is measured on (one bundle
per GPU model: its device name, the Triton version, and Triton's cache entries, ``<key folder>/<kernel>.autotune.json``).
``seed_shipped_results`` writes the bundle of the GPU in use into Triton's cache where the cache holds no entry, so a
fresh machine runs those choices instead of benchmarking; then, for kernels that bundle lacks, the bundles of GPU models
of the same chip (``SAME_CHIP``), whose choices compile for the same target and run correctly there, tuned or not. Triton names each folder by a hash of its own version,
the compiler target, the kernel's source, the tuning key and the configurations; an entry is found only when all of
them match, so a different FLA, Triton or kernel tunes as before. ``scripts/autotune_bundle.py`` makes a bundle
from a tuned cache. ``FLAME_SHIPPED_TUNING=0`` turns the seeding off.

Triton's hash of a kernel's source includes the line where the kernel starts, so an edit above a kernel in its
file (a docstring, an import) files its results under a new key, and the shipped ones are no longer found. For
flame's own kernels each result is also kept under a key made from the kernel's code without positions
(``code_of``), the compiler target, Triton's version and cache-invalidating environment, the tuning key and the
configurations (``source_record``; folders ``flame-<hash>`` beside Triton's, shipped in the bundles like its
entries). Where Triton finds no result, that record's choice runs instead of a benchmark, and Triton files it
under its new key.

No deadlock: a tuner's benchmark synchronizes its GPU and so waits for the collectives its rank issued before the
kernel. Every rank that waits for the same lock has reached the same kernel and issued them; a rank that waits for
an earlier kernel's lock waits for that kernel's tuner, which holds no other lock. As a last resort a wait longer
than ``WAIT_S`` is given up with one warning, and the process tunes the kernel itself, as without the lock.
"""

import contextlib
import fcntl
import functools
import hashlib
import inspect
import io
import json
import logging
import os
import time
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

WAIT_S = 300.0
POLL_S = 0.05
LOCK_DIR = "flame-autotune-locks"
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "autotune"


def tune_once_per_host() -> bool:
    """Keep Triton's cache in one folder for every process on the host (``TRITON_CACHE_DIR``, if unset, becomes
    Triton's default), keep tuning results there (``TRITON_CACHE_AUTOTUNING``, if unset, becomes 1: every launch path
    as train.sh's, flame's own kernels too) and wrap Triton's ``Autotuner.check_disk_cache`` (where it looks for a cached result and
    otherwise benchmarks) in a per-key file lock; once per process, before anything is compiled. False where Triton
    is absent or its method is not the one wrapped."""
    try:
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    os.environ.setdefault("TRITON_CACHE_DIR", str(knobs.cache.dir))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    original = getattr(Autotuner, "check_disk_cache", None)
    if original is None:
        return False
    if getattr(original, "flame_locked", False):
        return True
    if list(inspect.signature(original).parameters) != ["self", "tuning_key", "configs", "bench_fn"]:
        logger.warning(
            "Triton's Autotuner.check_disk_cache is not the one flame knows; autotuning is not serialized"
        )
        return False
    Autotuner.check_disk_cache = locked(original, lock_dir())
    return True


def kernel_module(autotuner) -> str:
    return getattr(getattr(autotuner, "base_fn", None), "__module__", "")


def is_fla_kernel(autotuner) -> bool:
    return kernel_module(autotuner).startswith("fla.")


NOT_RUN = [float("inf")] * 3  # Triton's timing of a config that did not run (its _bench's quantiles)


def tuning_round_for_fla(prune: Callable) -> Callable:
    """``Autotuner.prune_configs`` (called once before each benchmark of a key) starting a round in which FLA's
    kernels look for their first config that runs."""

    @functools.wraps(prune)
    def pruned(self, *args, **kwargs):
        self.flame_config_ran = False
        return prune(self, *args, **kwargs)

    return pruned


def first_running_config_for_fla(bench: Callable) -> Callable:
    """``Autotuner._bench`` that, for FLA's kernels, times configs in their order only until one runs and reports
    the others as not run, without compiling them: Triton then picks the first config that compiles and fits the
    GPU (a kernel's first config may ask for more shared memory than the GPU has, which Triton's benchmark skips)."""

    @functools.wraps(bench)
    def first_running(self, *args, **kwargs):
        if not is_fla_kernel(self):
            return bench(self, *args, **kwargs)
        if getattr(self, "flame_config_ran", False):
            return NOT_RUN
        timing = bench(self, *args, **kwargs)
        self.flame_config_ran = timing != NOT_RUN
        return timing

    return first_running


def uncached_for_fla(check_disk_cache: Callable) -> Callable:
    """``Autotuner.check_disk_cache`` that neither reads nor writes Triton's cache of tuning results for FLA's kernels:
    an untuned choice filed under the tuning key would serve later training runs on the machine."""

    @functools.wraps(check_disk_cache)
    def uncached(self, tuning_key, configs, bench_fn):
        if not is_fla_kernel(self):
            return check_disk_cache(self, tuning_key, configs, bench_fn)
        bench_fn()
        return False

    return uncached


@contextlib.contextmanager
def fla_kernels_on_first_config() -> Iterator[None]:
    """FLA's Triton kernels run the first of their configs (after their own pruning) that compiles and fits the GPU
    instead of autotuning, for checks of what they compute (which holds for any valid config), not of their speed:
    on a fresh machine FLA compiles and times every config of every kernel for each new shape and flag set, minutes
    per model. flame's own kernels keep their autotuning. The choices stay out of Triton's cache of tuning results."""
    from triton.runtime.autotuner import Autotuner

    originals = Autotuner.prune_configs, Autotuner._bench, Autotuner.check_disk_cache
    Autotuner.prune_configs = tuning_round_for_fla(originals[0])
    Autotuner._bench = first_running_config_for_fla(originals[1])
    Autotuner.check_disk_cache = uncached_for_fla(originals[2])
    try:
        yield
    finally:
        Autotuner.prune_configs, Autotuner._bench, Autotuner.check_disk_cache = originals


def lock_dir() -> Path:
    return Path(os.environ["TRITON_CACHE_DIR"]) / LOCK_DIR


def locked(check_disk_cache: Callable, directory: Path) -> Callable:
    @functools.wraps(check_disk_cache)
    def wrapper(tuner, tuning_key, configs, bench_fn):
        if not tuning_key or any(config.pre_hook for config in configs):  # Triton caches nothing for these
            return check_disk_cache(tuner, tuning_key, configs, bench_fn)
        identity = "-".join([kernel_identity(tuner), str(tuning_key), *map(str, configs)])
        record = source_record(tuner, tuning_key, configs)
        replayed = []

        def bench_or_replay():
            if record is not None and replay(tuner, tuning_key, record):
                replayed.append(record)
            else:
                bench_fn()

        with host_lock(directory / (hashlib.sha256(identity.encode()).hexdigest() + ".lock")):
            began = time.monotonic()
            found = check_disk_cache(tuner, tuning_key, configs, bench_or_replay)
            if record is not None and not record.exists():
                write_record(record, tuning_key, getattr(tuner, "configs_timings", None))
        if replayed:
            logger.debug(
                f"ran the tuning result of {kernel_name(tuner)} kept for its code ({record.parent.name})"
            )
        elif not found and len(configs) > 1:  # one setting (the others pruned for the shape) is no choice
            logger.info(
                f"tuned Triton kernel {kernel_name(tuner)} over {len(configs)} settings in "
                f"{time.monotonic() - began:.1f} s: neither Triton's cache nor flame's shipped tuning held a "
                f"result for this GPU, kernel source and key {tuning_key}"
            )
        return found

    wrapper.flame_locked = True
    return wrapper


def kernel_name(tuner) -> str:
    return getattr(getattr(tuner, "base_fn", None), "__name__", "(unnamed)")


def jit_function(tuner):
    fn = tuner.fn
    while not hasattr(fn, "cache_key"):  # heuristics and other wrappers hold the JIT function as .fn
        fn = fn.fn
    return fn


def kernel_identity(tuner) -> str:
    return jit_function(tuner).cache_key


RECORD_PREFIX = "flame-"


def triton_cache_dir() -> Path:
    from triton import knobs

    return Path(os.environ.get("TRITON_CACHE_DIR") or knobs.cache.dir)


def source_record(tuner, tuning_key, configs) -> Path | None:
    """Where the tuning result of one of flame's kernels is kept by its code (``code_of``) rather than Triton's
    hash of its source and position: its target, Triton, environment, key and configurations as in Triton's key.
    None for other kernels (FLA's are pinned: their positions do not move)."""
    if not kernel_module(tuner).startswith("flame."):
        return None
    import triton
    from triton.runtime import autotuner

    fn = jit_function(tuner)
    # A Triton whose JIT functions hold their source otherwise keeps no record.
    try:
        code = code_of(fn, set())
    except (AttributeError, SyntaxError, tokenize.TokenError):
        return None
    environment = getattr(autotuner, "get_cache_invalidating_env_vars", dict)()
    parts = [
        triton.__version__,
        str(autotuner.driver.active.get_current_target()),
        str(sorted(environment.items())),
        *code,
        str(tuning_key),
        *map(str, configs),
    ]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:48]
    return triton_cache_dir() / f"{RECORD_PREFIX}{digest}" / f"{fn.__name__[:150]}.autotune.json"


def code_of(fn, seen: set) -> list[str]:
    """A JIT function's code without its position in its file: its tokens less comments and blank lines, then the
    same for each JIT function it names, and the values of the constants it reads (as Triton's own hash does,
    less the line numbers)."""
    from triton import language

    seen.add(fn)
    tokens = [
        token
        for token in tokenize.generate_tokens(io.StringIO(fn.src).readline)
        if token.type not in (tokenize.COMMENT, tokenize.NL)
    ]
    parts = [f"{fn.__module__}.{fn.__name__}", " ".join(token.string for token in tokens)]
    for name in sorted({token.string for token in tokens if token.type == tokenize.NAME}):
        value = fn.__globals__.get(name)
        if hasattr(value, "cache_key") and hasattr(value, "src"):
            if value not in seen:
                parts += code_of(value, seen)
        elif isinstance(value, bool | int | float | str | language.constexpr):
            parts.append(f"{name}={value!r}")
    return parts


def replay(tuner, tuning_key, record: Path) -> bool:
    """Takes the choice kept in ``record`` as Triton takes a cached one (False where there is none)."""
    from triton.runtime.autotuner import Config

    try:
        timings = json.loads(record.read_text())["configs_timings"]
    except (OSError, ValueError, KeyError):
        return False
    timings = {Config(**config): timing for config, timing in timings}
    tuner.cache[tuning_key] = min(timings, key=timings.get)
    tuner.configs_timings = timings
    tuner.bench_time = 0.0
    return True


def write_record(record: Path, tuning_key, configs_timings) -> None:
    if not configs_timings:
        return
    result = {
        "key": list(tuning_key),
        "configs_timings": [(config.__dict__, timing) for config, timing in configs_timings.items()],
    }
    with contextlib.suppress(OSError):  # an unwritable cache: Triton's own entry still serves this machine
        write_whole(record, json.dumps(result))


def write_whole(path: Path, text: str) -> None:
    """Writes ``path`` through a file of this process renamed into place: processes writing it at once leave one
    whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staged.write_text(text)
    os.replace(staged, path)


@contextlib.contextmanager
def host_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (released by the OS if the process dies), given up after WAIT_S seconds; no
    lock at all where the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        fd = None
    if fd is None:
        yield
        return
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning(
                        f"another process has been tuning a Triton kernel for over {WAIT_S:.0f} s ({path.name}); "
                        "tuning it here too"
                    )
                    break
                time.sleep(POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def collect_results(cache_dir: Path) -> dict[str, dict]:
    """Every autotuning result in Triton's cache folder ``cache_dir``, or in one at any depth under it (an unpacked
    archive of ~/.triton), by its path in the cache (kernel hash/name). A result that timed one configuration is
    left out: it chose nothing (a kernel with one configuration), or a GPU test chose it (tests/gpu/conftest.py runs
    FLA's kernels on their first configuration)."""
    results = {}
    for path in sorted(cache_dir.rglob("*.autotune.json")):
        result = json.loads(path.read_text())
        if len(result["configs_timings"]) > 1:
            results[f"{path.parent.name}/{path.name}"] = result
    return results


def bundle_path(device_name: str, directory: Path = SHIPPED_DIR) -> Path:
    """Where the bundle of the GPU model ``device_name`` lives: its name in lower case, runs of other characters
    as one '-' ("NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.json)."""
    slug = "-".join("".join(c if c.isalnum() else " " for c in device_name.lower()).split())
    return directory / f"{slug}.json"


def write_bundle(path: Path, device_name: str, triton_version: str, results: dict[str, dict]) -> int:
    """Adds ``results`` to the bundle at ``path`` (replacing entries of the same path; a bundle of another Triton
    is replaced whole); the number of entries it then holds."""
    entries = {}
    if path.exists():
        bundle = json.loads(path.read_text())
        if bundle["device"] != device_name:
            raise ValueError(f"{path} holds results of {bundle['device']!r}, not {device_name!r}")
        if bundle["triton"] == triton_version:
            entries = bundle["results"]
    entries.update(results)
    lines = [f"{json.dumps(name)}: {json.dumps(result)}" for name, result in sorted(entries.items())]
    head = f'{{"device": {json.dumps(device_name)}, "triton": {json.dumps(triton_version)}, "results": {{\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + ",\n".join(lines) + "\n}}\n")  # one result per line: diffs show what changed
    return len(entries)


# GPU models built on one chip: the same compiler target and SM count, so one's tuning choice is a near-best
# choice on the other (the H200 is the H100's GH100 with 132 SMs and faster memory, which can move the best
# configuration of a memory-bound kernel by a step, not its results).
SAME_CHIP = (("NVIDIA H100 80GB HBM3", "NVIDIA H200"),)


def bundle_devices(device_name: str) -> list[str]:
    """The GPU models whose bundles seed ``device_name``'s cache, in order: its own, then those of its chip."""
    siblings = [name for group in SAME_CHIP if device_name in group for name in group if name != device_name]
    return [device_name, *siblings]


def sibling_entries(device_name: str, triton_version: str, directory: Path = SHIPPED_DIR) -> dict[str, dict]:
    """The entries of the bundles of ``device_name``'s chip (``SAME_CHIP``, not its own) measured with
    ``triton_version``: what seeding writes into its cache beside its own bundle's."""
    entries = {}
    for name in reversed(bundle_devices(device_name)[1:]):  # the first sibling's entry wins, as when seeding
        entries.update(bundle_results(bundle_path(name, directory), name, triton_version))
    return entries


def bundle_results(path: Path, device_name: str, triton_version: str) -> dict[str, dict]:
    """The entries of the bundle at ``path`` where it holds ``device_name``'s results with ``triton_version`` (none
    otherwise: another Triton's choices are filed under other cache keys)."""
    if not path.exists():
        return {}
    bundle = json.loads(path.read_text())
    if bundle["device"] != device_name or bundle["triton"] != triton_version:
        return {}
    return bundle["results"]


def seed_shipped_results(
    device_name: str, triton_version: str, cache_dir: Path, directory: Path = SHIPPED_DIR
) -> int:
    """Writes the bundles measured with ``triton_version`` on ``device_name`` and then on the models of its chip
    into Triton's cache folder ``cache_dir``, each entry where the cache holds none (so the GPU's own choice wins
    over a sibling's); the number written (0 without such a bundle)."""
    return sum(
        _seed_bundle(bundle_path(name, directory), name, triton_version, cache_dir)
        for name in bundle_devices(device_name)
    )


def _seed_bundle(path: Path, device_name: str, triton_version: str, cache_dir: Path) -> int:
    written = 0
    for name, result in bundle_results(path, device_name, triton_version).items():
        folder, file_name = name.split("/")
        target = cache_dir / folder / file_name
        if target.exists():
            continue
        write_whole(target, json.dumps(result))  # ranks seeding at once
        written += 1
    return written


def tuning_cache_is_read() -> bool:
    """Whether kernels read Triton's cache of tuning results: every kernel with TRITON_CACHE_AUTOTUNING=1 (train.sh's
    default); FLA's without it too, unless FLA_CACHE_RESULTS=0 (FLA passes ``cache_results`` to its autotuners)."""
    from triton import knobs

    return knobs.autotuning.cache or os.environ.get("FLA_CACHE_RESULTS", "1") == "1"


def use_shipped_results(device_name: str) -> int:
    """seed_shipped_results for the GPU in use, into the cache tune_once_per_host chose, where kernels read it
    (tuning_cache_is_read) and FLAME_SHIPPED_TUNING is not 0; logs what it wrote."""
    try:
        import triton
    except ImportError:
        return 0
    if os.environ.get("FLAME_SHIPPED_TUNING", "1") == "0" or not tuning_cache_is_read():
        return 0
    cache_dir = triton_cache_dir()
    try:
        written = seed_shipped_results(device_name, triton.__version__, cache_dir, SHIPPED_DIR)
    except OSError as e:  # an unwritable cache: the kernels tune as without the bundle
        logger.warning(f"could not write flame's shipped tuning results into {cache_dir}: {e}")
        return 0
    if written:
        logger.info(
            f"wrote {written} of flame's tuning results for {device_name} into Triton's cache {cache_dir} "
            f"(flame/assets/autotune/: {', '.join(bundle_path(name).name for name in bundle_devices(device_name))})"
        )
    return written
