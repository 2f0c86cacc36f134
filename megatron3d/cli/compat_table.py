"""The README's "Megatron flags" table, made from ``compat``'s verdicts (a test keeps the
README equal to it)."""

from __future__ import annotations

from collections.abc import Mapping

from megatron3d.cli.compat import REFUSED_VALUES, TABLE, VALUE_SPELLINGS, CompatFlag
from megatron3d.cli.line_rewrites import TOKENIZER_TYPES


def markdown_table() -> str:
    """The README's table: every foreign flag and what megatron3d does with it."""
    rows = ["| Megatron flag | megatron3d |", "| --- | --- |"]
    verbs = {"alias": "same as", "notice": "accepted, ignored:", "refuse": "refused:"}
    for flag in TABLE:
        if flag.convert is not None:
            rows.append(f"| `{flag.name} FILE` | read from the file as {flag.becomes[0]} "
                        "W1 P1 W2 P2 (BigScience's one group of whole datasets, 0:1) |")
            continue
        value = " VALUE" if flag.nargs else ""
        if flag.values:  # the first value's verdict leads; then the others', then the rest
            each = [f"{_verdict(verbs, sub)} (`{v}`)" if i == 0 else
                    f"`{v}`: {_verdict(verbs, sub)}"
                    for i, (v, sub) in enumerate(flag.values.items())]
            rows.append(f"| `{flag.name}{value}` (only {', '.join(flag.values)}) | "
                        f"{'; '.join(each)}; other values refused: {flag.text} |")
            continue
        only = f" (only {', '.join(flag.only)})" if flag.only else ""
        rows.append(f"| `{flag.name}{value}`{only} | {_verdict(verbs, flag)} |")
    for name, spellings in VALUE_SPELLINGS.items():
        pairs = ", ".join(f"`{a}` = `{b}`" for a, b in spellings.items())
        rows.append(f"| `{name}` values | Megatron's spelling accepted: {pairs} |")
    for name, refused in REFUSED_VALUES.items():
        for value, why in refused.items():
            rows.append(f"| `{name} {value}` | refused: {why} |")
    pairs = ", ".join(f"`{a}` = `{b}`" for a, b in TOKENIZER_TYPES.items())
    rows.append(f"| `--tokenizer-type` values | read with a notice: {pairs} (a "
                "HuggingFaceTokenizer's `--tokenizer-model` is `--tokenizer-name-or-path`) |")
    return "\n".join(rows)


def _verdict(verbs: Mapping[str, str], flag: CompatFlag) -> str:
    """What the table says megatron3d does with ``flag``: the verb, the flags it stands for
    (an alias) and its text."""
    what = " ".join(flag.becomes) if flag.action == "alias" else ""
    return " ".join([verbs[flag.action], "; ".join(x for x in (what, flag.text) if x)])
