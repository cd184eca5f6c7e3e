"""launch/torchrun_3node.sh on one machine: three torchrun agents, one a "node" of one rank (gloo). The fixed node
ranks decide the global ranks, so the rollout rank is the last node's whatever order the agents start in."""
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.recovery import ROOT, SMALL, metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_node_launch_puts_the_rollout_rank_on_the_last_node(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NPROC_PER_NODE="1", CONFIG="configs/tiny.yaml",
               PYTHONUNBUFFERED="1")
    env.pop("NODE_RANK", None)
    r = subprocess.run(["bash", "launch/torchrun_3node.sh"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "set NODE_RANK" in r.stderr, r.stderr
    out = tmp_path / "run"
    cmd = ["bash", "launch/torchrun_3node.sh", f"out_dir={out}", "train.steps=2", *SMALL]
    procs = {n: subprocess.Popen(cmd, env=dict(env, NODE_RANK=str(n)), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for n in (2, 1, 0)}  # the rollout node's agent first
    logs = {}
    try:
        for n, p in procs.items():
            logs[n] = p.communicate(timeout=240)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert all(p.returncode == 0 for p in procs.values()), {n: log[-2000:] for n, log in logs.items()}
    assert "roles: actor ranks 0-1 on nodes ['0', '1'], rollout ranks 2-2 on nodes ['2']" in logs[0], logs[0][-2000:]
    assert "--resume auto: no complete checkpoint" in logs[0]  # the script always resumes (a restart goes on)
    assert [m["step"] for m in metrics(out)] == [1, 2]
