"""What each exchange cannot do, as one-line messages for ``validation.py`` (None: fine)."""

from __future__ import annotations


def ring_dropout_error(attention_dropout: float, comm_type: str, cp_size: int) -> str | None:
    """The ring (p2p) merges blocks with the online softmax and has no attention dropout."""
    if attention_dropout > 0 and comm_type == "p2p" and cp_size > 1:
        return (f"--attention-dropout {attention_dropout} is not supported by "
                "--cp-comm-type p2p; set --attention-dropout 0 or use --cp-comm-type "
                "all_gather (or a2a)")
    return None


def ulysses_heads_error(num_heads: int, query_groups: int, cp_size: int,
                        tp_size: int = 1) -> str | None:
    """a2a gives each CP rank whole heads of its TP rank: the TP rank's query heads and key/
    value heads (query groups) must both divide by C."""
    heads, groups = num_heads // tp_size, query_groups // tp_size
    if heads % cp_size:
        return (f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank "
                f"({heads}) to divide by --context-parallel-size {cp_size}; use p2p or "
                "all_gather, or another head count")
    if groups % cp_size:
        return (f"--cp-comm-type a2a needs the query groups (key/value heads) per tensor-"
                f"parallel rank ({groups}) to divide by --context-parallel-size {cp_size}; "
                "use p2p or all_gather, or another --num-query-groups")
    return None
