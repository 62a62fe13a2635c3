"""Build flame's embedded sample corpus and its byte-level BPE tokenizer.

The corpus is real English prose that is available offline, taken from the running CPython's standard library:

* one document per importable, public stdlib module: its docstring, then the docstrings of its public classes,
  methods and functions under small headers (a docstring repeated verbatim elsewhere is kept once);
* one document per pydoc help topic (``pydoc_data.topics``, the language reference pages behind
  ``help("if")``).

About 3% of the documents, picked by a hash of their source name, form the validation split.

    python scripts/build_sample_corpus.py            # corpus, then tokenizer
    python scripts/build_sample_corpus.py corpus     # only flame/assets/corpus/*.jsonl.gz
    python scripts/build_sample_corpus.py tokenizer  # only flame/assets/tokenizer/ (from train.jsonl.gz)

The output is deterministic for a given CPython version and set of importable extension modules: modules are
walked in sorted order, the split uses a stable hash and the gzip headers carry no timestamp.
"""

import argparse
import contextlib
import gzip
import hashlib
import importlib
import inspect
import io
import itertools
import json
import pkgutil
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "flame" / "assets"
CORPUS_DIR = ASSETS / "corpus"
TOKENIZER_DIR = ASSETS / "tokenizer"

# Modules that open GUIs or browsers, print on import, patch the interpreter, are test suites, or are
# installer/bootstrap helpers. A name is skipped when it or any parent package is listed here.
DENYLIST = {
    "__main__",
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "venv",
    "pydoc_data",  # no docstrings; its help topics are added whole by topic_documents()
    "distutils",  # setuptools may replace it with its own copy, which would make the corpus env-dependent
    "readline",  # may write terminal control codes to stdout on import
    "encodings",  # ~100 near-identical generated codec modules
    "msilib",
    "winreg",
    "winsound",
    "msvcrt",
    "nt",
}
# Submodule names that are test suites or entry points wherever they appear.
DENIED_PARTS = {"test", "tests", "idle_test", "__main__"}

MIN_DOC_CHARS = 200
MAX_TOTAL_CHARS = 9_000_000  # keeps the two .gz files under ~3 MB
VALIDATION_PERCENT = 3
SPLITS = ("train", "validation")
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the FLA/flame convention


def is_allowed(name: str) -> bool:
    parts = name.split(".")
    if any(".".join(parts[: i + 1]) in DENYLIST for i in range(len(parts))):
        return False
    if any(part in DENIED_PARTS for part in parts):
        return False
    # Private modules (_io, json._decoder ...) duplicate the docs of their public wrappers.
    return not any(part.startswith("_") and part != "__future__" for part in parts)


def import_quietly(name: str):
    """Import a module, or return None if it fails; swallow anything it prints or warns."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # ImportError, OSError, SystemExit ...: all mean "skip this module"
            return None


def iter_stdlib_modules() -> Iterator[tuple[str, object]]:
    """Yield (name, module) for every allowed, importable stdlib module and submodule, in sorted order."""
    stack = sorted((n for n in sys.stdlib_module_names if is_allowed(n)), reverse=True)
    while stack:
        name = stack.pop()
        module = import_quietly(name)
        if module is None:
            continue
        yield name, module
        if hasattr(module, "__path__"):  # a package: visit its submodules right after it
            children = [f"{name}.{info.name}" for info in pkgutil.iter_modules(module.__path__)]
            stack.extend(sorted((c for c in children if is_allowed(c)), reverse=True))


def clean_doc(obj) -> str:
    # obj.__doc__ rather than inspect.getdoc: getdoc inherits a parent's docstring, which would repeat it.
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if not isinstance(names, list | tuple):
        names = [n for n in vars(module) if not n.startswith("_")]
    return sorted({n for n in names if isinstance(n, str)})


def belongs_to(obj, module) -> bool:
    """True for objects defined in this module, or in a private module that it exposes (_io -> io)."""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return False
    return owner == module.__name__ or owner.split(".")[0].startswith("_")


def class_sections(cls) -> Iterator[tuple[str, str]]:
    for name in sorted(vars(cls)):
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            continue
        member = vars(cls)[name]
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if inspect.isroutine(member) or inspect.isdatadescriptor(member):
            yield f"### {cls.__name__}.{name}", clean_doc(member)


def module_sections(module, seen_objects: set[int]) -> Iterator[tuple[str, str]]:
    """Yield (header, docstring) pairs of a module's public classes, methods and functions."""
    for name in public_names(module):
        obj = getattr(module, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not belongs_to(obj, module):
            continue
        if id(obj) in seen_objects:  # the same object re-exported by several modules is documented once
            continue
        seen_objects.add(id(obj))
        if inspect.isclass(obj):
            yield f"## class {name}", clean_doc(obj)
            yield from class_sections(obj)
        else:
            yield f"## {name}", clean_doc(obj)


def normalize(text: str) -> str:
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def module_document(name: str, module, seen_objects: set[int], seen_docs: set[str]) -> str:
    parts = [f"# {name}", clean_doc(module)]
    for header, doc in module_sections(module, seen_objects):
        # Slot wrappers and descriptors repeat the same line hundreds of times ("Return repr(self).",
        # "list of weak references to the object"); keep the first occurrence of each docstring only.
        if doc and doc not in seen_docs:
            seen_docs.add(doc)
            parts += [header, doc]
    return normalize("\n\n".join(parts))


def is_validation(source: str) -> bool:
    # sha256, not hash(): str hashes are salted per process.
    return int(hashlib.sha256(source.encode()).hexdigest(), 16) % 100 < VALIDATION_PERCENT


def module_documents() -> Iterator[tuple[str, str]]:
    """Yield (source, text) for each stdlib module with enough documentation of its own."""
    seen_objects: set[int] = set()
    seen_docs: set[str] = set()
    seen_bodies: set[str] = set()
    modules = []  # keep modules alive so that the id() of their objects is never reused
    for name, module in iter_stdlib_modules():
        modules.append(module)
        text = module_document(name, module, seen_objects, seen_docs)
        body = text.split("\n", 1)[1]  # compare without the "# name" header: os.path is posixpath
        if body not in seen_bodies:
            seen_bodies.add(body)
            yield f"python-stdlib:{name}", text


def topic_documents() -> Iterator[tuple[str, str]]:
    """Yield (source, text) for pydoc's help topics: the language reference pages that help('if') shows."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"python-stdlib:pydoc_data.topics:{name}", normalize(topics[name])


def collect_documents() -> Iterator[dict]:
    total = 0
    for source, text in itertools.chain(module_documents(), topic_documents()):
        if len(text) < MIN_DOC_CHARS:
            continue
        if total + len(text) > MAX_TOTAL_CHARS:
            break
        total += len(text)
        yield {"text": text, "source": source}


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
    # mtime=0 and no file name in the header: rebuilding gives identical bytes.
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(payload)


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build_corpus() -> None:
    splits = {split: [] for split in SPLITS}
    for doc in collect_documents():
        splits["validation" if is_validation(doc["source"]) else "train"].append(doc)
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = CORPUS_DIR / f"{split}.jsonl.gz"
        write_jsonl_gz(path, rows)
        chars = sum(len(r["text"]) for r in rows)
        print(f"{path}: {len(rows)} documents, {chars:,} characters, {path.stat().st_size:,} bytes")


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # No normalizer and a byte-level pre-tokenizer/decoder: decode(encode(x)) == x for any UTF-8 text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols are in the vocabulary, so no text ever needs <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def build_tokenizer() -> None:
    from transformers import PreTrainedTokenizerFast

    texts = {
        split: [row["text"] for row in read_jsonl_gz(CORPUS_DIR / f"{split}.jsonl.gz")] for split in SPLITS
    }
    tokenizer = train_tokenizer(texts["train"])
    # No BOS/EOS post-processing: flame's data pipeline adds BOS/EOS itself. (transformers installs a
    # TemplateProcessing that adds nothing, since add_bos_token/add_eos_token default to False.)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,  # it would turn " ." into "." on decode
    )
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(TOKENIZER_DIR)
    print(f"{TOKENIZER_DIR}: vocab {tokenizer.get_vocab_size()}")
    for split, docs in texts.items():
        n_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(docs, add_special_tokens=False))
        n_chars = sum(len(t) for t in docs)
        print(f"  {split}: {n_tokens:,} tokens, {n_chars / n_tokens:.2f} characters per token")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("step", nargs="?", choices=["all", "corpus", "tokenizer"], default="all")
    args = parser.parse_args()
    if args.step in ("all", "corpus"):
        build_corpus()
    if args.step in ("all", "tokenizer"):
        build_tokenizer()


if __name__ == "__main__":
    main()
