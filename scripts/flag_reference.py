"""Write the option reference of docs/configs-and-flags.md from the config classes (torchtitan's merged with flame's).

python scripts/flag_reference.py           # rewrite the generated part of the page
python scripts/flag_reference.py --check   # exit 1 if the page is out of date (tests/test_docs.py)
"""

import dataclasses
import re
import sys

from tyro._docstrings import get_field_docstring

from flame.config.job_config import ALIASES, REPO_ROOT
from flame.config.manager import job_config_class

PAGE = REPO_ROOT / "docs" / "configs-and-flags.md"
BEGIN, END = "<!-- BEGIN GENERATED: python scripts/flag_reference.py -->", "<!-- END GENERATED -->"


def summary(doc: str | None) -> str:
    """The docstring as one line, cut after its first sentence when long."""
    text = re.sub(r"\s+", " ", doc or "").strip()
    if len(text) > 160 and ". " in text[:200]:
        text = text[: text.index(". ", 0, 200) + 1]
    return text.replace("|", "\\|")


def default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    text = repr(value).replace(str(REPO_ROOT) + "/", "")
    return f"`{text}`".replace("|", "\\|")


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    out = []
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(field.type):
            out += rows(field.type, f"{name}.")
            continue
        doc = summary(get_field_docstring(cls, field.name, ()))
        if name in ALIASES:
            doc = f"{doc} (sets `{ALIASES[name]}`)" if "alias" not in doc.lower() else doc
        out.append((name, default(field), doc))
    return out


def reference() -> str:
    config = job_config_class()
    lines = [BEGIN, ""]
    for section in dataclasses.fields(config):
        lines += [f"### [{section.name}]", "", "| option | default | meaning |", "|---|---|---|"]
        lines += [
            f"| `--{name}` | {value} | {doc} |" for name, value, doc in rows(section.type, f"{section.name}.")
        ]
        lines.append("")
    return "\n".join([*lines, END])


def updated(page: str) -> str:
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + reference() + page[end:]


def main() -> int:
    page = PAGE.read_text()
    new = updated(page)
    if "--check" in sys.argv[1:]:
        if new != page:
            print(f"{PAGE} is out of date: run python scripts/flag_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
