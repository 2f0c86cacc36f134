"""The hang dump file: what one rank knew when it stopped (or was asked), for people and tools.

``DUMP_DIR/rank-XXXXX.txt`` has a readable part (why, where in the layout, the recent
operations, every thread's Python stack from faulthandler, which also works while the main
thread is blocked inside a collective) and, last, one JSON line that ``hang_report`` reads.
Dumps are written by the watchdog thread, so nothing here may issue a collective.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

DATA_MARKER = "== data =="
FORMAT = 2  # 2: each operation says whether it completed


def dump_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.txt"


def write_dump(path: Path, header: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """Write atomically (tmp + rename) so a report never reads half a dump."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, **header, "written": time.time(), "host": socket.gethostname(),
            "pid": os.getpid(), "main_stack": _main_stack(), "ops": ops}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        c = header["coords"]
        f.write(f"megatron3d hang dump: rank {header['rank']} of {header['world_size']} "
                f"(tp {c['tp']}, pp {c['pp']}, dp {c['dp']}) on {data['host']} pid "
                f"{data['pid']}\nreason: {header['reason']}\n"
                f"last finished iteration: {header['iteration']}, phase: {header['phase']}\n")
        f.write(f"== last {len(ops)} operations, oldest first (NOT COMPLETED: issued, not "
                "done when the dump was written) ==\n")
        f.writelines(format_op(op) + "\n" for op in ops)
        f.write("== python stacks ==\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write(f"{DATA_MARKER}\n{json.dumps(data)}\n")
    tmp.replace(path)


def read_dump(path: Path) -> dict[str, Any]:
    """The JSON part of a dump; ValueError if the file is not a complete dump."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    try:
        data = json.loads(lines[lines.index(DATA_MARKER) + 1])
    except (ValueError, IndexError) as err:
        raise ValueError(f"{path} is not a complete megatron3d hang dump") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} has dump format {found}, expected {FORMAT}")
    wrong = _wrong(data, _FIELDS) or next(
        (f"ops[{i}] {w}" for i, op in enumerate(data["ops"]) if (w := _wrong(op, _OP_FIELDS))),
        None) or _impossible(data)
    if wrong:
        raise ValueError(f"{path} is a damaged dump ({wrong})")
    return data


# What hang_report reads, with the JSON types it expects.
_INT, _NUM, _TEXT, _LIST, _BOOL = (int,), (int, float), (str,), (list,), (bool,)
_FIELDS = {"rank": _INT, "world_size": _INT, "job": _TEXT, "written": _NUM, "ops": _LIST,
           "sizes": (dict,), "coords": (dict,), "iteration": _INT, "main_stack": _LIST,
           "phase": _TEXT, "reason": _TEXT}
_OP_FIELDS = {"seq": _INT, "kind": _TEXT, "group": _TEXT, "ranks": _LIST, "group_seq": _INT,
              "peer": (int, type(None)), "shape": _LIST, "dtype": _TEXT,
              "iteration": _INT, "program": _INT, "step": (int, type(None)),
              "instruction": _TEXT, "tag": (list, str, type(None)), "completed": _BOOL}


def _wrong(data: Any, fields: dict[str, tuple[type, ...]]) -> str | None:
    """The first field of ``data`` that is missing or mistyped, as words; None if none."""
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not an object"
    for key, types in fields.items():
        value = data.get(key)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"field {key!r} is missing or not {types[0].__name__}"
    return None


MAX_WORLD_SIZE = 2**20
"""Ranks a dump may claim: far past any job, while the report lists every rank (a dump
claiming 2**40 would otherwise take the machine's memory)."""
_P2P = ("send", "recv")


def _impossible(data: dict[str, Any]) -> str | None:
    """The first value of a well-typed dump that no job writes, as words; None if none:
    the report does arithmetic and lookups on ranks, sizes, shapes and tags."""
    world, rank, sizes = data["world_size"], data["rank"], data["sizes"]
    if not 1 <= world <= MAX_WORLD_SIZE:
        return f"world_size {world} is not in [1, {MAX_WORLD_SIZE}]"
    if not 0 <= rank < world:
        return f"rank {rank} is outside world_size {world}"
    axes = [sizes.get(axis) for axis in ("tp", "pp", "dp")]
    if not all(type(n) is int and n >= 1 for n in axes) or axes[0] * axes[1] * axes[2] != world:
        return f"sizes {str(sizes)[:60]} are not tp, pp, dp multiplying to world_size {world}"
    for i, op in enumerate(data["ops"]):
        ranks = [*op["ranks"], *([op["peer"]] if op["kind"] in _P2P else [])]
        if not all(type(r) is int and 0 <= r < world for r in ranks):
            return f"ops[{i}] names a rank outside world_size {world} (or no peer)"
        if not all(type(n) is int for n in op["shape"]) or not all(
                type(t) in (int, str) for t in op["tag"] or ()):
            return f"ops[{i}] has a shape or tag that is not whole numbers and text"
    return None


def format_op(op: dict[str, Any]) -> str:
    """One operation as a line: seq, kind, group and its sequence number, peer, tensor,
    what it served (iteration, program step, instruction, tag), and whether it is still not
    completed."""
    where = f"{op['group']}#{op['group_seq']}"
    if op["peer"] is not None:
        where += f" {'to' if op['kind'] == 'send' else 'from'} rank {op['peer']}"
    tag = "" if op["tag"] is None else " " + "".join(str(t) for t in op["tag"])
    served = ("outside the pipeline program" if op["step"] is None else
              f"program {op['program']} step {op['step']} {op['instruction']}")
    state = "" if op["completed"] else " | NOT COMPLETED"
    return (f"  [{op['seq']}] {op['kind']} {where} ranks {_ranks(op['ranks'])} "
            f"{op['shape']} {op['dtype']} | iteration {op['iteration']}, {served}{tag}{state}")


def _ranks(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]" if len(ranks) <= 8 else f"[{len(ranks)} ranks]"


def _main_stack() -> list[str]:
    """The main thread's innermost frames, 'file:line in function' (for the report)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [f"{Path(f.filename).name}:{f.lineno} in {f.name}"
            for f in traceback.extract_stack(frame)][-8:]
