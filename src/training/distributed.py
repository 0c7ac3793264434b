"""Data-parallel set-up: communication init, rank info, allreduce fusion buckets (the cross-rank
sums of host values are src/collective.py's)."""
import os
from typing import List, Optional, Sequence, Tuple

import mindspore as ms

from src.errors import UserInputError, end_process_now

LAUNCHER_VARIABLES = ("MS_ROLE", "RANK_TABLE_FILE")
OUTPUT_STORAGES = ("shared", "node_local")


def launched_by_launcher() -> bool:
    """True inside msrun (MS_ROLE) or a rank-table launch (RANK_TABLE_FILE)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def stopped_exit_code(code: int) -> int:
    """The exit code of a rank that stopped on a signal (`code`: 128 + signal). Under msrun it is 0:
    msrun counts any other code as a failure, and when a rank exited non-zero while another still
    ran its scheduler waited out the node heartbeat (2 ranks exiting 0.5-5 s apart: 15 s -> 40-45 s,
    measured); our launcher reads the stop from the ranks' logs and exits 128 + signal itself. A
    rank-table launch keeps `code`."""
    return 0 if "MS_ROLE" in os.environ else code


def launcher_device_id(configured: int) -> Optional[int]:
    """The device a launched rank must use: msrun assigns one per rank itself (None lets it), a
    rank-table launch names it in DEVICE_ID; a standalone run uses the configured device_id."""
    if "MS_ROLE" in os.environ:
        return None
    if "RANK_TABLE_FILE" in os.environ and "DEVICE_ID" in os.environ:
        return int(os.environ["DEVICE_ID"])
    return configured


def local_rank_count(run_distribute: bool, device_num: int) -> int:
    """Ranks sharing this node: our launcher exports LOCAL_WORKER_NUM (msrun's --local_worker_num);
    otherwise all `device_num` ranks are taken to be local."""
    if not run_distribute:
        return 1
    local = os.environ.get("LOCAL_WORKER_NUM", "")
    return int(local) if local.isdigit() and int(local) > 0 else device_num


def check_output_storage(storage: str) -> str:
    """The config's output_storage, validated."""
    if storage not in OUTPUT_STORAGES:
        raise UserInputError(f"unknown output_storage '{storage}'; choose shared (one folder all nodes see) or "
                             f"node_local (each node's own disk)")
    return storage


def writes_run_folder(rank: int, local_ranks: int, storage: str) -> bool:
    """Whether this rank writes checkpoints, the config and the run record: rank 0 into a shared
    folder; with node-local folders the first rank of every node, so every node can resume."""
    if storage == "node_local":
        return rank % local_ranks == 0
    return rank == 0


def check_resume_agreement(steps: Sequence[int], local_ranks: int, folder: str) -> None:
    """`steps[r]`: the global step rank r resumes from (-1: it found no checkpoint). Every rank must
    resume from the same step, or the ranks would train different weights; the error names the
    ranks and nodes that differ."""
    found = {step for step in steps if step >= 0}
    missing = [rank for rank, step in enumerate(steps) if step < 0]
    if len(set(steps)) <= 1:
        return
    leader = next(rank for rank, step in enumerate(steps) if step >= 0)
    if missing:
        nodes = sorted({rank // local_ranks for rank in missing})
        raise UserInputError(f"resume: rank(s) {', '.join(map(str, missing))} on node(s) "
                             f"{', '.join(map(str, nodes))} found no checkpoint in {folder} while rank {leader} "
                             f"resumes from global step {steps[leader]}; with output_storage node_local copy "
                             f"the run folder's checkpoints to every node (or pass --resume_ckpt on every node)")
    raise UserInputError(f"resume: the ranks found different checkpoints (global steps "
                         f"{', '.join(str(s) for s in sorted(found))}: {list(steps)} by rank) in {folder}; give "
                         f"every node the same newest checkpoint, or pass --resume_ckpt on every node")


def init_distributed(run_distribute: bool, device_num: int) -> Tuple[int, int]:
    """Initialize communication when `run_distribute`; returns (rank, group size)."""
    if not run_distribute:
        return 0, 1
    if not launched_by_launcher():
        raise UserInputError("run_distribute needs ranks started by a launcher; use "
                             "bash scripts/run_distribute_train.sh DATASET_PATH CONFIG_PATH")
    from mindspore.communication import get_group_size, get_rank, init
    try:
        init()
    except RuntimeError:
        # When the cluster does not form, MindSpore's heartbeat thread keeps retrying the scheduler
        # after init() has failed, and the interpreter's exit waits for it (~35 s; msrun and the
        # launcher wait with it). The traceback, which the launcher's one line is made from
        # (node_check.explain_failure), is written first.
        end_process_now(1)
    rank, size = get_rank(), get_group_size()
    if size != device_num:
        raise UserInputError(f"device_num is {device_num} but the launcher started {size} ranks; "
                             f"pass --device_num {size} (the launcher does this for you)")
    return rank, size


def fusion_split_points(sizes: Sequence[int], buckets: int = 2) -> List[int]:
    """Allreduce fusion split indices for tensors of `sizes` (in the network's order).

    The tensors are cut into `buckets` runs of about equal element count, so no bucket waits for
    most of the gradients; the last split point is the last tensor's index, as MindSpore expects
    (ResNet50's 161 trainable tensors give [139, 160]; the model zoo hard-codes [85, 160])."""
    if len(sizes) < 2:
        return []
    total = float(sum(sizes[:-1]))
    points, running = [], 0.0
    for index, size in enumerate(sizes[:-1]):
        running += size
        if len(points) < buckets - 1 and running >= total * (len(points) + 1) / buckets:
            points.append(index + 1)
    points = [p for p in points if 0 < p < len(sizes) - 1]
    return sorted(set(points)) + [len(sizes) - 1]


def check_fusion_points(points: Sequence[int], num_tensors: int) -> List[int]:
    """Validate user-given split indices: strictly increasing, within [1, num_tensors - 1]."""
    points = list(points)
    if any(not isinstance(p, int) or isinstance(p, bool) for p in points):
        raise UserInputError(f"all_reduce_fusion_config must list integers, got {points}")
    if any(b <= a for a, b in zip(points, points[1:])):
        raise UserInputError(f"all_reduce_fusion_config {points} must be strictly increasing")
    if points and (points[0] < 1 or points[-1] > num_tensors - 1):
        raise UserInputError(f"all_reduce_fusion_config {points} is out of range: this network has "
                             f"{num_tensors} trainable tensors, so indices must lie in 1..{num_tensors - 1}")
    return points


def set_data_parallel(device_num: int, fusion_points: Sequence[int]) -> None:
    """Data-parallel training with gradients averaged over `device_num` ranks."""
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=device_num)
    if fusion_points:
        ms.set_auto_parallel_context(all_reduce_fusion_config=list(fusion_points))
