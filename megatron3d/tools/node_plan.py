"""What ``tools/local_nodes`` builds, as data: the namespaces, links and commands of N "nodes"
on one machine. Pure functions of a ``NodePlan``, so the plan is tested without root.

Each node is a network namespace with its own address on ``eth0``, one end of a veth pair
whose other end sits on a bridge inside a switch namespace: nothing is added to the
machine's own namespace. A token-bucket filter (``tc tbf``: netem, which could add delay, is
absent on these kernels) limits both directions of each node's link: the egress of the node
end (node -> switch) and of the switch end (switch -> node). Traffic between ranks of one
node goes to the node's own address and so over its loopback, unlimited, as inside a real
node. Each node also gets its own host name (a UTS namespace) and an ``/etc/hosts`` naming
every node (``ip netns exec`` mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``), so a
launcher resolves node names and its own name as on a cluster.

Names carry the pid of the run that owns them (``m3d-PID-n0``), so two runs coexist and a
run removes what a run that is gone left behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PREFIX = "m3d"
INTERFACE = "eth0"  # the node's link, as a cluster node names it (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"
SUBNET = "10.77.0"  # node i is SUBNET.(i+1)/24
MAX_NODES = 250
BURST = "256kb"  # tbf's bucket: at least one burst of segments; 256 kB suits 2 Gbit/s
LATENCY = "50ms"  # how long a packet may wait for tokens before tbf drops it
NETNS_ETC = Path("/etc/netns")
_OWNED = re.compile(rf"^{PREFIX}-(\d+)-(?:n\d+|sw)$")


@dataclass(frozen=True)
class NodePlan:
    owner: int  # the pid of the run that owns the namespaces
    nodes: int
    ranks_per_node: int
    rate: str | None  # tc's rate of each node's link (e.g. "2gbit"); None: unlimited
    port: int  # the rendezvous port on the first node

    @property
    def switch(self) -> str:
        return f"{PREFIX}-{self.owner}-sw"

    def namespace(self, node: int) -> str:
        return f"{PREFIX}-{self.owner}-n{node}"

    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.nodes)] + [self.switch]

    @staticmethod
    def hostname(node: int) -> str:
        return f"node{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def nodelist(self) -> str:
        """Slurm's host list of the nodes (``node[0-3]``), as SLURM_JOB_NODELIST gives it."""
        return "node0" if self.nodes == 1 else f"node[0-{self.nodes - 1}]"

    @property
    def endpoint(self) -> str:
        return f"{self.hostname(0)}:{self.port}"

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.address(i)} {self.hostname(i)}" for i in range(self.nodes)]
        return "\n".join(lines) + "\n"


def setup_commands(plan: NodePlan) -> list[list[str]]:
    """The switch with its bridge, then each node: namespace, loopback, link, address, limits."""
    sw = plan.switch
    commands = [["ip", "netns", "add", sw],
                ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
                ["ip", "-n", sw, "link", "set", BRIDGE, "up"]]
    for i in range(plan.nodes):
        ns, port = plan.namespace(i), f"n{i}"
        commands += [["ip", "netns", "add", ns],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "link", "add", INTERFACE, "netns", ns, "type", "veth",
                      "peer", "name", port, "netns", sw],
                     ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
                     ["ip", "-n", sw, "link", "set", port, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{plan.address(i)}/24", "dev", INTERFACE],
                     ["ip", "-n", ns, "link", "set", INTERFACE, "up"]]
        if plan.rate is not None:
            commands += [_limit(ns, INTERFACE, plan.rate), _limit(sw, port, plan.rate)]
    return commands


def _limit(namespace: str, device: str, rate: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
            "tbf", "rate", rate, "burst", BURST, "latency", LATENCY]


def teardown_commands(plan: NodePlan) -> list[list[str]]:
    """Deleting a namespace deletes its end of each veth pair, and so the pair."""
    return [["ip", "netns", "delete", ns] for ns in plan.namespaces()]


def on_node(plan: NodePlan, node: int) -> list[str]:
    """The prefix that runs a command on ``node``: in its namespace, under its host name."""
    return ["ip", "netns", "exec", plan.namespace(node), "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', plan.hostname(node)]


def torchrun_options(plan: NodePlan, node: int, run_id: str) -> list[str]:
    """torchrun's multi-node options for ``node`` (c10d numbers the nodes as they join; the
    node rank is given for the record)."""
    return ["--nnodes", str(plan.nodes), "--node-rank", str(node),
            "--nproc-per-node", str(plan.ranks_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", plan.endpoint, "--rdzv-id", run_id, "--monitor-interval", "0.5"]


def stale_namespaces(listing: str, alive: set[int]) -> list[str]:
    """The namespaces in ``ip netns list``'s output that runs no longer ``alive`` left."""
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names
            if (m := _OWNED.match(name)) and int(m[1]) not in alive]


def srun_script(plan: NodePlan, pid_dir: Path) -> str:
    """An ``srun`` for SLURM's launch.sh: the step's one task per node, each in its node's
    namespace with the variables Slurm gives a task; --kill-on-bad-exit's teardown; the
    step's code is the highest task code. Each task's pid goes to ``pid_dir/node<i>.pid``."""
    starts = "\n".join(
        f"SLURM_NODEID={i} SLURM_PROCID={i} SLURM_LOCALID=0 SLURM_STEP_ID=0 "
        f"SLURMD_NODENAME={plan.hostname(i)} {' '.join(map(_quote, on_node(plan, i)))} "
        f'"$@" &\npids+=($!)\necho $! > {_quote(str(pid_dir / f"node{i}.pid"))}'
        for i in range(plan.nodes))
    return f"""#!/usr/bin/env bash
# srun as scripts/local_nodes.sh emulates it: one task per node ({plan.nodes}).
set -u
while (($#)) && [[ $1 == -* ]]; do shift; done  # options (--nodes=N, --kill-on-bad-exit=1)
pids=()
{starts}
trap 'kill -TERM "${{pids[@]}}" 2>/dev/null' TERM INT
code=0
left=${{#pids[@]}}
declare -A done_pids=()
while ((left)); do
  for pid in "${{pids[@]}}"; do
    [[ -z ${{done_pids[$pid]:-}} ]] && ! kill -0 "$pid" 2>/dev/null || continue
    rc=0
    wait "$pid" || rc=$?
    done_pids[$pid]=1
    left=$((left - 1))
    if ((rc > code)); then
      ((code)) || kill -TERM "${{pids[@]}}" 2>/dev/null  # --kill-on-bad-exit
      code=$rc
    fi
  done
  sleep 0.2
done
exit "$code"
"""


def _quote(word: str) -> str:
    """A word for bash (single quotes unless it needs none)."""
    if re.fullmatch(r"[\w@%+=:,./-]+", word):
        return word
    return "'" + word.replace("'", "'\\''") + "'"
