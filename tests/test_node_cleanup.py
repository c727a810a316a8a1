"""A run's shared memory on Ray nodes other than the launcher's (a two-node cluster on this host)."""

import subprocess
import sys
import threading
import uuid
from pathlib import Path

from tests.script_run import run_script

# Run apart from the test session's one-node Ray: a head node (the launcher's) and a second node,
# where an actor writes what a trainer rank and a policy leave in shared memory.
SCRIPT = r"""
import json, os, sys, threading, time
from pathlib import Path
import ray
from ray.cluster_utils import Cluster
from apps.grpo.node_cleanup import clean_other_nodes, wait_for_exit

shm_dir, engine_file = Path(sys.argv[1]), sys.argv[2]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1, resources={"away": 1})
ray.init(address=cluster.address, log_to_driver=False)
cluster.wait_for_nodes()

@ray.remote(resources={"away": 1}, num_cpus=0)
class Writer:
    def write(self):
        (shm_dir / "v1").mkdir(parents=True)
        (shm_dir / "v1" / "model-00001-of-00001.safetensors").write_bytes(bytes(2**20))
        Path(engine_file).write_bytes(bytes(2 * 2**20))
        (shm_dir / "engine-files.json").write_text(json.dumps([engine_file, "/etc/hostname"]))
        threading.Thread(target=self._keep_writing, daemon=True).start()  # as a push in progress
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def _keep_writing(self):
        while True:
            (shm_dir / "v2").mkdir(parents=True, exist_ok=True)
            (shm_dir / "v2" / "part").write_bytes(b"")
            time.sleep(0.01)

nothing = clean_other_nodes([], shm_dir, shm_dir / "engine-files.json")  # as at a rerun's start
writer = Writer.remote()
node, pid = ray.get(writer.write.remote())
freed = clean_other_nodes([writer], shm_dir, shm_dir / "engine-files.json")
exited = wait_for_exit([pid], 0) == []  # before the removal, so already now
head = ray.get_runtime_context().get_node_id()
time.sleep(1)  # a writer still alive would have made its folder again by now
out = {"node": node, "head": head, "pid": pid, "freed": freed, "nothing": nothing, "exited": exited}
out["left"] = shm_dir.exists()
print(json.dumps(out))
ray.shutdown()
cluster.shutdown()
"""


def test_a_runs_shared_memory_on_another_node_is_removed_there(tmp_path):
    shm_dir = tmp_path / "ws-run"
    engine_file = Path(f"/dev/shm/psm_rlsys-test-{uuid.uuid4().hex[:8]}")
    try:
        out = run_script(SCRIPT, str(shm_dir), str(engine_file))
        assert list(out["nothing"].values()) == [0]  # one other node, nothing there yet
        assert out["node"] != out["head"]  # the files were written on the other node
        assert out["freed"] == {out["node"]: 3 * 2**20}  # removed by a task there, and only there
        assert out["exited"]  # the removal waited for the killed writer's process to end
        assert not out["left"]  # so it could not make its folder again
        assert not shm_dir.exists() and not engine_file.exists()
        assert Path("/etc/hostname").exists()  # a record is data: only vLLM's /dev/shm files go
    finally:
        engine_file.unlink(missing_ok=True)


def test_wait_for_exit_returns_the_processes_still_alive():
    from apps.grpo.node_cleanup import wait_for_exit

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    reaper = threading.Thread(target=child.wait)  # as the raylet reaps its workers (no zombie left)
    reaper.start()
    try:
        assert wait_for_exit([child.pid], 0.05) == [child.pid]
        assert wait_for_exit([child.pid], 10) == []
    finally:
        child.kill()
        reaper.join()
