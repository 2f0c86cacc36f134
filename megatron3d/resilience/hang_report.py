"""Merge every rank's hang dump and say who stopped where (``tools/hang_report.py``).

On a GPU the host runs ahead of the device: a rank may have issued many operations past the
one it is stuck in. So the reasoning starts from completion (each dump says which of its
operations completed) and uses issue order only to match operations across ranks, through
sequence numbers:
- a collective group's members issue the same sequence; the first number at which their
  operations differ (kind, shape, dtype, tag) is a disagreement;
- a's k-th send to b is b's k-th receive from a: a different micro-batch tag means one side
  skipped a message (the one whose tag is ahead);
- an operation completed on one side completed on every side (the others may not have seen
  it yet: a work is polled a few times a second, and gloo completes a transfer when waited);
- an operation that did not complete waits for each other side that wrote no dump, has not
  issued its side, or is stuck earlier: has an older unfinished operation that itself waits
  for somebody (its device or host has not reached this one);
- a rank is a suspect if it wrote no dump (frozen or dead), is on the wrong side of a
  disagreement, or is waited for while it waits for nobody (it stopped issuing operations,
  e.g. stuck in compute or host code). A rank that waits for somebody is never a suspect.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron3d.resilience.flight_recorder import P2P_KINDS
from megatron3d.resilience.hang_dump import format_op, read_dump

Dump = dict[str, Any]
Key = tuple  # one operation seen from every side: its stream (see _stream) and sequence number


@dataclass
class Analysis:
    world_size: int
    dumps: dict[int, Dump]
    missing: list[int]
    findings: list[str] = field(default_factory=list)
    mismatched: dict[int, str] = field(default_factory=dict)  # rank -> why
    waits: dict[int, list[tuple[Dump, int, str]]] = field(default_factory=dict)
    """rank -> (its oldest unfinished operation that waits, a rank it waits for, why)"""
    unfinished: dict[int, list[Dump]] = field(default_factory=dict)  # rank -> oldest first
    awaited: dict[int, str] = field(default_factory=dict)  # rank -> first place it is awaited

    def suspects(self) -> list[tuple[int, str]]:
        """Most likely first: frozen/dead, then disagreements, then idle laggards."""
        found = [(r, "wrote no dump: frozen (e.g. SIGSTOP), dead, or never started")
                 for r in self.missing]
        found += sorted(self.mismatched.items())
        found += [(r, f"behind its peers ({where}) while waiting for nobody: it stopped "
                   "issuing operations (see its stack)")
                  for r, where in sorted(self.awaited.items())
                  if r not in self.waits and r not in self.mismatched]
        return found

    def position(self, rank: int) -> str:
        """Where a rank is: its oldest unfinished operation that waits, else its oldest
        unfinished one, else its last (all done)."""
        if rank in self.waits:
            return "stuck at " + format_op(self.waits[rank][0][0]).strip()
        if self.unfinished.get(rank):
            return "stuck at " + format_op(self.unfinished[rank][0]).strip()
        ops = self.dumps[rank]["ops"]
        return ("every operation completed; last " + format_op(ops[-1]).strip() if ops
                else "no operation recorded")


def load_dumps(directory: Path) -> tuple[dict[int, Dump], list[str]]:
    """rank -> dump of the newest job in ``directory``; plus notes on skipped files."""
    dumps, notes = {}, []
    for path in sorted(directory.glob("rank-*.txt")):
        if not path.is_file():  # a FIFO would block the read forever
            notes.append(f"skipped {path.name}: not a regular file")
            continue
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
    _waits(result)
    return result


# -- disagreements: what was issued ----------------------------------------------------------
def _collectives(a: Analysis) -> None:
    groups: dict[tuple, dict[int, dict[int, Dump]]] = defaultdict(dict)
    for rank, dump in a.dumps.items():
        for op in dump["ops"]:
            if op["kind"] not in P2P_KINDS:
                groups[(op["group"], tuple(op["ranks"]))].setdefault(rank, {})[
                    op["group_seq"]] = op
    for (name, ranks), by_rank in sorted(groups.items()):
        common = set.intersection(*(set(ops) for ops in by_rank.values()))
        for seq in sorted(common):
            variants = defaultdict(list)
            for rank, ops in by_rank.items():
                variants[_signature(ops[seq])].append(rank)
            if len(variants) > 1:
                _disagreement(a, f"{name} group {list(ranks)}", seq, variants, by_rank)
                break


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
    """Compare what each rank sent another with what that one expects, message by message."""
    sends: dict[tuple, dict[int, Dump]] = defaultdict(dict)  # (group, src, dst) -> seq -> op
    recvs: dict[tuple, dict[int, Dump]] = defaultdict(dict)
    for rank, dump in a.dumps.items():
        for op in dump["ops"]:
            if op["kind"] in P2P_KINDS:
                (sends if op["kind"] == "send" else recvs)[_stream(rank, op)[1:]][
                    op["group_seq"]] = op
    for group, src, dst in sorted(set(sends) & set(recvs)):
        sent, expected = sends[(group, src, dst)], recvs[(group, src, dst)]
        for seq in sorted(set(sent) & set(expected)):
            s, r = sent[seq], expected[seq]
            if _message(s) != _message(r):
                culprit, verb = (src, "skipped or reordered a send") if _order(s) > _order(r) \
                    else (dst, "skipped or reordered a receive")
                label = f"{group} messages {src} -> {dst}"
                a.mismatched[culprit] = f"{verb}: at {label} #{seq}"
                a.findings.append(f"{label}: #{seq} mismatched: rank {src} sends "
                                  f"{_describe(s)}, rank {dst} expects {_describe(r)}")
                break


# -- waits: what did not complete ------------------------------------------------------------
def _waits(a: Analysis) -> None:
    """Who each unfinished operation waits for: sides that wrote no dump or have not issued
    theirs, then, until nothing changes, sides stuck earlier (see the module docstring)."""
    issued: dict[Key, dict[int, Dump]] = defaultdict(dict)  # operation -> rank -> its side
    for rank, dump in a.dumps.items():
        for op in dump["ops"]:
            issued[_key(rank, op)][rank] = op
    done = {key for key, sides in issued.items() if any(op["completed"] for op in sides.values())}
    for rank, dump in a.dumps.items():
        a.unfinished[rank] = [op for op in dump["ops"] if _key(rank, op) not in done]
    found = _not_there(a, issued)
    while _stuck_earlier(a, issued, found):
        pass
    for (rank, seq), whom in sorted(found.items()):
        if rank not in a.waits:  # its oldest operation that waits
            op = next(o for o in a.unfinished[rank] if o["seq"] == seq)
            a.waits[rank] = [(op, other, why) for other, why in whom]
            a.findings.append(f"rank {rank} waits in {_place(rank, op)} for " + "; ".join(
                f"rank {other} ({why})" for other, why in whom))


Waits = dict[tuple[int, int], list[tuple[int, str]]]  # (rank, seq) -> [(whom, why)]


def _not_there(a: Analysis, issued: dict[Key, dict[int, Dump]]) -> Waits:
    """The sides of unfinished operations that wrote no dump or have not issued theirs."""
    last: dict[tuple, int] = defaultdict(lambda: -1)  # (stream, rank) -> its last number
    for key, sides in issued.items():
        for rank in sides:
            last[(key[:-1], rank)] = max(last[(key[:-1], rank)], key[-1])
    found: Waits = defaultdict(list)
    for rank, ops in a.unfinished.items():
        for op in ops:
            key = _key(rank, op)
            for other in _sides(key, rank):
                if other not in a.dumps:
                    found[(rank, op["seq"])].append((other, "wrote no dump"))
                elif (n := last[(key[:-1], other)]) < key[-1]:
                    has = f"its last is #{n}" if n >= 0 else "none there yet"
                    found[(rank, op["seq"])].append((other, f"has not issued it: {has}"))
                    a.awaited.setdefault(other, _label(key))
    return found


def _stuck_earlier(a: Analysis, issued: dict[Key, dict[int, Dump]], found: Waits) -> bool:
    """Add the sides that issued theirs but have an older unfinished operation that waits;
    whether any was added."""
    first: dict[int, int] = {}  # rank -> its oldest unfinished operation that waits
    for rank, seq in found:
        first[rank] = min(first.get(rank, seq), seq)
    added = False
    for rank, ops in a.unfinished.items():
        for op in ops:
            key = _key(rank, op)
            waiting = found.get((rank, op["seq"]), [])
            for other in _sides(key, rank):
                theirs = issued[key].get(other)
                if (theirs is None or any(o == other for o, _ in waiting)
                        or first.get(other, theirs["seq"]) >= theirs["seq"]):
                    continue
                stuck = next(o for o in a.unfinished[other] if o["seq"] == first[other])
                found[(rank, op["seq"])].append((other, f"stuck earlier, at "
                                                        f"{_place(other, stuck)}"))
                waiting = found[(rank, op["seq"])]
                added = True
    return added


def _stream(rank: int, op: Dump) -> tuple:
    """The sequence an operation is numbered in, the same on every side: a group's
    collectives, or the messages from one rank to another in a group."""
    if op["kind"] == "send":
        return "p", op["group"], rank, op["peer"]
    if op["kind"] == "recv":
        return "p", op["group"], op["peer"], rank
    return "c", op["group"], tuple(op["ranks"])


def _key(rank: int, op: Dump) -> Key:
    return (*_stream(rank, op), op["group_seq"])


def _sides(key: Key, rank: int) -> list[int]:
    """The other ranks an operation needs."""
    ranks = key[2] if key[0] == "c" else key[2:4]
    return [r for r in ranks if r != rank]


def _label(key: Key) -> str:
    if key[0] == "c":
        return f"{key[1]} group {list(key[2])} #{key[3]}"
    return f"{key[1]} messages {key[2]} -> {key[3]} #{key[4]}"


def _place(rank: int, op: Dump) -> str:
    """'dp group [0, 1] #9 (all_reduce [4096] float32, iteration 3, B3)'."""
    what = op["kind"] if op["tag"] is None else f"{op['kind']} {_tag(op)}"
    return (f"{_label(_key(rank, op))} ({what} {op['shape']} {op['dtype']}, "
            f"{_context(op)})")


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
    """'rank R (tp T, pp P, dp D)', with 'cp C' under context parallelism; Megatron's rank
    order (tp, cp, dp, pp) gives a missing rank's place."""
    sizes = next(iter(a.dumps.values()))["sizes"]
    tp, dp, cp = sizes["tp"], sizes["dp"], sizes.get("cp", 1)
    split = f", cp {rank // tp % cp}" if cp > 1 else ""
    return (f"rank {rank} (tp {rank % tp}, pp {rank // (tp * cp * dp)}, "
            f"dp {rank // (tp * cp) % dp}{split})")


def format_report(a: Analysis, notes: list[str]) -> str:
    lines = [f"hang report: {len(a.dumps)} of {a.world_size} ranks wrote a dump", *notes, "",
             "where each rank is (its oldest operation that did not complete, and the "
             "innermost frame of its main thread):"]
    for rank in range(a.world_size):
        dump = a.dumps.get(rank)
        if dump is None:
            lines.append(f"  {coords(a, rank)}: NO DUMP (frozen, dead or never started)")
            continue
        frame = dump["main_stack"][-1] if dump["main_stack"] else "?"
        lines.append(f"  {coords(a, rank)}: iteration {dump['iteration']} done, "
                     f"{dump['phase']}; {a.position(rank)}; main thread at {frame}; "
                     f"dump: {dump['reason']}")
    lines += ["", "disagreements and waits:"]
    lines += [f"  {f}" for f in a.findings] or ["  none: every group agrees and nothing waits"]
    suspects = a.suspects()
    if suspects:
        lines += ["", "likely culprits:", *(f"  {coords(a, r)}: {why}" for r, why in suspects)]
    elif any(a.unfinished.values()):
        lines += ["", "likely culprits: none found: every side issued the operations that did "
                  "not complete (a network or backend fault, or a device stuck in compute: "
                  "see torch's flight recorder, nccl_trace_rank_* beside these dumps)"]
    else:
        lines += ["", "likely culprits: none found"]
    return "\n".join(lines)
