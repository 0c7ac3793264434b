"""The input-pipeline comparison: each (cores, workers) setting in a measuring process of its own,
the ratios of ours over native, the host cores one Ascend card needs, and the storage calls."""
import argparse
import json
from typing import Dict, List, Tuple

from tools.benchmarking.pipeline_data import write_pipeline_data
from tools.benchmarking.pipelines import PHOTO_SIZE
from tools.benchmarking.storage import storage_calls
from tools.benchmarking.worker import entry_command, progress, run_worker

CARD_IMG_PER_S = 2170  # the model zoo's ResNet50 on one Ascend 910 card: 118 ms per 256-image step


def pipeline_settings() -> List[Tuple[int, int]]:
    """(cores, workers) to measure: one worker pinned to one core, then 1 and 2 workers on 2 cores."""
    from src.device import available_cores
    return [(1, 1)] + ([(2, 1), (2, 2)] if available_cores() >= 2 else [])


def benchmark_pipelines(args: argparse.Namespace, data_root: str) -> Dict:
    """Our input pipeline against MindSpore's native one on the same files, per core and with 1
    and 2 workers, each setting in a process of its own."""
    folders, files = write_pipeline_data(args, data_root)
    rows = []
    for cores, workers in pipeline_settings():
        progress(f"input pipelines: {workers} worker(s) on {cores} core(s)")
        command = entry_command("--worker", "pipelines",
                                "--photo_dir", json.dumps(folders), "--photos", str(args.photos),
                                "--ceiling_images", str(args.ceiling_images), "--photo_batch", str(args.photo_batch),
                                "--cores", str(cores), "--workers", str(workers),
                                "--repeats", str(args.repeats))
        rows.append(run_worker(command, "pipelines"))
    from src.data.image_decode import decoder_name
    section = {"files": files, "decoder": decoder_name(), "batch_size": args.photo_batch, "image_size": PHOTO_SIZE,
               "rows": rows}
    section["ratios"] = pipeline_ratios(rows)
    section["cores_per_card"] = cores_per_card(rows)
    batches = max(2, 2 * args.photos // args.photo_batch)  # two epochs: the shards' reader starts once per epoch
    section["storage_calls"] = {name: storage_calls(folders[name], batch=args.photo_batch, batches=batches)
                                for name in ("photos", "photos_shards")}
    return section


def rate(row: Dict, case: str, name: str) -> float:
    """img/s of pipeline `name` of `case` in a pipeline process's row."""
    return row[case][name]["img_per_s"]


def pipeline_ratios(rows: List[Dict]) -> List[Dict[str, float]]:
    """Per row: ours over native (ceiling plain and v2, photographs generated and real, train and
    eval, CIFAR)."""
    pairs = {"ceiling_ours": ("ceiling", "ours", "native"), "ceiling_v2": ("ceiling", "v2", "native"),
             "photos_train": ("photos", "ours_train", "native_train"),
             "photos_eval": ("photos", "ours_eval", "native_eval"),
             "real_train": ("real", "ours_train", "native_train"), "real_eval": ("real", "ours_eval", "native_eval"),
             "cifar": ("cifar", "ours", "native")}
    ratios = [{key: round(rate(row, case, ours) / rate(row, case, native), 3)
               for key, (case, ours, native) in pairs.items()} for row in rows]
    for row, ratio in zip(rows, ratios):  # MindRecord shards over the class folder they were converted from
        for name in ("photos", "real"):
            for phase in ("train", "eval"):
                ratio[f"{name}_shards_{phase}"] = round(rate(row, f"{name}_shards", f"ours_{phase}") /
                                                        rate(row, name, f"ours_{phase}"), 3)
    return ratios


def cores_per_card(rows: List[Dict]) -> Dict[str, float]:
    """Host cores one card's ResNet50 (CARD_IMG_PER_S) needs from our training pipeline: the
    pinned one-core row's rate on photographs (worker and training process sharing the core),
    and the per-process ceiling as a multiple of the card's rate."""
    pinned = rows[0]
    widest = rows[-1]
    return {"card_img_per_s": CARD_IMG_PER_S,
            "generated_photos": round(CARD_IMG_PER_S / rate(pinned, "photos", "ours_train"), 1),
            "real_photos": round(CARD_IMG_PER_S / rate(pinned, "real", "ours_train"), 1),
            "v2_generated_photos": round(CARD_IMG_PER_S / rate(pinned, "photos", "v2_train"), 1),
            "ceiling_over_card": round(rate(widest, "ceiling", "ours") / CARD_IMG_PER_S, 2),
            "main_cpu_ceiling_img_per_s": round(1e6 / max(widest["ceiling"]["ours"]["main_cpu_us"], 1e-3))}

