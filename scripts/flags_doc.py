"""Write docs/flags.md from the server's argument parser, so the flags' page cannot drift from
``--help`` (tests/test_flags.py checks it is current).

    python scripts/flags_doc.py            # rewrite docs/flags.md
    python scripts/flags_doc.py --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl.config.args import build_parser  # noqa: E402

DOC = ROOT / "docs" / "flags.md"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    ap = build_parser()
    lines = [
        "# Server flags",
        "",
        "Generated from `python -m minisgl.launch --help` by `scripts/flags_doc.py`; do not edit by hand.",
        "Names follow SGLang's; where SGLang spells a flag two ways, both are accepted.",
        "",
    ]
    for group in ap._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | default | what it does |", "| --- | --- | --- |"]
        for a in actions:
            names = ", ".join(f"`{o}`" for o in a.option_strings)
            if a.choices:
                names += " (" + ", ".join(str(c) for c in a.choices) + ")"
            default = "" if a.default in (None, False, argparse.SUPPRESS) or a.required else f"`{a.default}`"
            help_text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%")
            lines.append(f"| {names} | {default} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python scripts/flags_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
