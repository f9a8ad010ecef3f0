"""One rank of a job started by ``mpirun`` (tests/test_mpi.py): a Buffer built from the MPI
communicator, 2 nodes x 2 ranks through the NIXL proxy, flat and hierarchical, checked against
the reference bit for bit. Rank 0 prints one JSON line with every rank's report."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from internode_jobs import nodes_case  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cases import Case  # noqa: E402

if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    case = Case(4, 16, 128, 4, (13, 0, 9, 21), torch.bfloat16, "zipf", 16, seed=48)
    report = {}
    try:
        for hier in (False, True):
            got = nodes_case(rank, comm.Get_size(), case, 2, hier, iterations=2, comm=comm)
            report["hier" if hier else "flat"] = {
                "internode": got["stats"]["internode_dispatch_bytes"],
                "threads": got["threads"], "remote_ptrs": [
                    p for p, ptr in enumerate(got["peer_ptrs"]) if ptr and p // 2 != rank // 2]}
    except BaseException as error:  # every rank reports; rank 0 prints them all
        report["error"] = f"{type(error).__name__}: {error}"
    reports = comm.gather(report, root=0)
    if rank == 0:
        print("MPI_REPORT " + json.dumps(reports), flush=True)
    sys.exit(1 if "error" in report else 0)
