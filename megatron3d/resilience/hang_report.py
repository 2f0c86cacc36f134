"""Merge every rank's hang dump and say who stopped where (``tools/hang_report.py``).

The reasoning uses only what each rank issued (on GPUs the host runs ahead of the device, so
"issued" is what every rank can know), compared through sequence numbers:
- a collective group's members issue the same sequence; the first number at which their
  operations differ (kind, shape, dtype, tag) is a disagreement, and members that stopped
  short of the others are behind;
- a's k-th send to b is b's k-th receive from a: a different micro-batch tag means one side
  skipped a message (the one whose tag is ahead), a count difference means one side waits;
- a rank is a suspect if it wrote no dump (frozen or dead), is on the wrong side of a
  disagreement, or is behind somewhere while waiting for nobody (it stopped issuing
  operations, e.g. stuck in compute or host code).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron3d.resilience.flight_recorder import P2P_KINDS
from megatron3d.resilience.hang_dump import format_op, read_dump

Dump = dict[str, Any]


@dataclass
class Analysis:
    world_size: int
    dumps: dict[int, Dump]
    missing: list[int]
    findings: list[str] = field(default_factory=list)
    mismatched: dict[int, str] = field(default_factory=dict)  # rank -> why
    ahead: set[int] = field(default_factory=set)  # waits for someone
    behind: dict[int, str] = field(default_factory=dict)  # rank -> first place it lags

    def suspects(self) -> list[tuple[int, str]]:
        """Most likely first: frozen/dead, then disagreements, then idle laggards."""
        found = [(r, "wrote no dump: frozen (e.g. SIGSTOP), dead, or never started")
                 for r in self.missing]
        found += sorted(self.mismatched.items())
        found += [(r, f"behind its peers ({why}) while waiting for nobody: it stopped "
                   "issuing operations (see its stack)")
                  for r, why in sorted(self.behind.items())
                  if r not in self.ahead and r not in self.mismatched]
        return found


def load_dumps(directory: Path) -> tuple[dict[int, Dump], list[str]]:
    """rank -> dump of the newest job in ``directory``; plus notes on skipped files."""
    dumps, notes = {}, []
    for path in sorted(directory.glob("rank-*.txt")):
        try:
            data = read_dump(path)
        except (OSError, ValueError) as err:
            notes.append(f"skipped {path.name}: {err}")
            continue
        dumps[data["rank"]] = data
    jobs = {d["job"] for d in dumps.values()}
    if len(jobs) > 1:
        newest = max(dumps.values(), key=lambda d: d["written"])["job"]
        notes.append(f"dumps of several jobs {sorted(jobs)}: using job {newest!r}")
        dumps = {r: d for r, d in dumps.items() if d["job"] == newest}
    return dumps, notes


def analyse(dumps: dict[int, Dump]) -> Analysis:
    world_size = max(d["world_size"] for d in dumps.values())
    result = Analysis(world_size, dumps, [r for r in range(world_size) if r not in dumps])
    _collectives(result)
    _point_to_point(result)
    return result


def _collectives(a: Analysis) -> None:
    groups: dict[tuple, dict[int, dict[int, Dump]]] = defaultdict(dict)
    for rank, dump in a.dumps.items():
        for op in dump["ops"]:
            if op["kind"] not in P2P_KINDS:
                groups[(op["group"], tuple(op["ranks"]))].setdefault(rank, {})[
                    op["group_seq"]] = op
    for (name, ranks), by_rank in sorted(groups.items()):
        label = f"{name} group {list(ranks)}"
        common = set.intersection(*(set(ops) for ops in by_rank.values()))
        for seq in sorted(common):
            variants = defaultdict(list)
            for rank, ops in by_rank.items():
                variants[_signature(ops[seq])].append(rank)
            if len(variants) > 1:
                _disagreement(a, label, seq, variants, by_rank)
                break
        last = {rank: max(ops) for rank, ops in by_rank.items()}
        front = max(last.values())
        lagging = [r for r in ranks if r in a.dumps and last.get(r, -1) < front]
        if not lagging:
            continue
        leaders = [r for r, n in last.items() if n == front]
        op = by_rank[leaders[0]][front]
        a.ahead.update(leaders)
        for r in lagging:
            a.behind.setdefault(r, f"{label} #{front}")
        a.findings.append(
            f"{label}: ranks {leaders} issued #{front} ({op['kind']} {op['shape']}, "
            f"{_context(op)}); ranks {lagging} did not (stopped at "
            + ", ".join(f"{r}: #{last.get(r, 'none')}" for r in lagging) + ")")


def _disagreement(a: Analysis, label: str, seq: int, variants: dict,
                  by_rank: dict[int, dict[int, Dump]]) -> None:
    majority = max(variants.values(), key=len)
    parts = [f"ranks {ranks}: {sig[0]} {list(sig[1])} {sig[2]} (tag {sig[3]}, "
             f"{_context(by_rank[ranks[0]][seq])})" for sig, ranks in variants.items()]
    a.findings.append(f"{label}: members disagree at #{seq}: " + "; ".join(parts))
    for ranks in variants.values():
        if ranks is not majority:
            for r in ranks:
                a.mismatched[r] = f"issued a different operation at {label} #{seq}"


def _point_to_point(a: Analysis) -> None:
    sends: dict[tuple, dict[int, Dump]] = defaultdict(dict)  # (group, src, dst) -> seq -> op
    recvs: dict[tuple, dict[int, Dump]] = defaultdict(dict)
    for rank, dump in a.dumps.items():
        for op in dump["ops"]:
            if op["kind"] == "send":
                sends[(op["group"], rank, op["peer"])][op["group_seq"]] = op
            elif op["kind"] == "recv":
                recvs[(op["group"], op["peer"], rank)][op["group_seq"]] = op
    for key in sorted(set(sends) | set(recvs)):
        if key[1] in a.dumps and key[2] in a.dumps:
            _pair(a, key, sends.get(key, {}), recvs.get(key, {}))


def _pair(a: Analysis, key: tuple, sent: dict[int, Dump], expected: dict[int, Dump]) -> None:
    """Compare what ``src`` sent to ``dst`` with what ``dst`` waits for, message by message."""
    group, src, dst = key
    label = f"{group} messages {src} -> {dst}"
    for seq in sorted(set(sent) & set(expected)):
        s, r = sent[seq], expected[seq]
        if _message(s) != _message(r):
            culprit, verb = (src, "skipped or reordered a send") if _order(s) > _order(r) \
                else (dst, "skipped or reordered a receive")
            a.mismatched[culprit] = f"{verb}: at {label} #{seq}"
            a.findings.append(f"{label}: #{seq} mismatched: rank {src} sends "
                              f"{_describe(s)}, rank {dst} expects {_describe(r)}")
            break
    last_sent, last_expected = max(sent, default=-1), max(expected, default=-1)
    if last_expected == last_sent:
        return
    if last_expected > last_sent:
        waiter, lagger, n = dst, src, last_expected
        what = (f"rank {dst} waits for #{n} ({_describe(expected[n])}); rank {src} sent up to "
                f"#{last_sent}")
    else:
        waiter, lagger, n = src, dst, last_sent
        what = (f"rank {src} sent #{n} ({_describe(sent[n])}); rank {dst} has not posted its "
                f"receive (last #{last_expected})")
    a.ahead.add(waiter)
    a.behind.setdefault(lagger, f"{label} #{n}")
    a.findings.append(f"{label}: {what}")


def _signature(op: Dump) -> tuple:
    return op["kind"], tuple(op["shape"]), op["dtype"], _tag(op)


def _message(op: Dump) -> tuple:
    return op["iteration"], _tag(op), tuple(op["shape"]), op["dtype"]


def _order(op: Dump) -> tuple:
    """How far along its program an operation is: (iteration, program, micro-batch)."""
    mb = op["tag"][1] if isinstance(op["tag"], list) and len(op["tag"]) == 2 else -1
    return op["iteration"], op["program"], mb


def _tag(op: Dump) -> str:
    return "" if op["tag"] is None else "".join(map(str, op["tag"]))


def _context(op: Dump) -> str:
    return f"iteration {op['iteration']}, {op['instruction']}"


def _describe(op: Dump) -> str:
    return f"{_tag(op) or op['kind']} {op['shape']} {op['dtype']} ({_context(op)})"


def coords(a: Analysis, rank: int) -> str:
    """'rank R (tp T, pp P, dp D)'; Megatron's rank order gives a missing rank's place."""
    sizes = next(iter(a.dumps.values()))["sizes"]
    tp, dp = sizes["tp"], sizes["dp"]
    return f"rank {rank} (tp {rank % tp}, pp {rank // (tp * dp)}, dp {rank // tp % dp})"


def format_report(a: Analysis, notes: list[str]) -> str:
    lines = [f"hang report: {len(a.dumps)} of {a.world_size} ranks wrote a dump", *notes, "",
             "where each rank is (its last issued operation, and the innermost frame of its "
             "main thread):"]
    for rank in range(a.world_size):
        dump = a.dumps.get(rank)
        if dump is None:
            lines.append(f"  {coords(a, rank)}: NO DUMP (frozen, dead or never started)")
            continue
        last = format_op(dump["ops"][-1]).strip() if dump["ops"] else "no operation recorded"
        frame = dump["main_stack"][-1] if dump["main_stack"] else "?"
        lines.append(f"  {coords(a, rank)}: iteration {dump['iteration']} done, "
                     f"{dump['phase']}; last {last}; main thread at {frame}; "
                     f"dump: {dump['reason']}")
    lines += ["", "disagreements and waits:"]
    lines += [f"  {f}" for f in a.findings] or ["  none: every group agrees"]
    suspects = a.suspects()
    lines += ["", "likely culprits:" if suspects else "likely culprits: none found"]
    lines += [f"  {coords(a, r)}: {why}" for r, why in suspects]
    return "\n".join(lines)
