"""MindRecord shards (src/data/mindrecord.py converts, src/data/shards.py reads): the conversion of
the sample data, the same batches as the source folders (recipe, workers, ranks, resume), a
training run with equal weights, and each kind of bad shard set named in one line."""
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from mindspore.mindrecord import FileWriter

from conftest import NO_CURVES, PYTHON, REPO, read_metrics, run, start
from src.data import mindrecord
from src.data.bad_samples import scan_unreadable
from src.data.mindrecord import prepare_partial
from src.data.recipe import Augmentation
from src.data.sample_data import write_sample_data
from src.data.shards import CLASS_LIST, MANIFEST, MindRecordSource, read_header, records_in
from src.data.sources import ImageFolderSource
from src.dataset import create_dataset, create_source
from src.errors import UserInputError, user_error_message
from src.files import TMP_PREFIX
from src.training.checkpoint import read_checkpoint
from test_faults import small_disk

V2 = Augmentation(auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2, cutmix_alpha=1.0, ra_reps=2)
SIZES = {"cifar10": 32, "imagenet2012": 40}


def convert(source: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return run([PYTHON, "-m", "src.data.mindrecord", "--data_path", str(source), "--output", str(output), *extra])


@pytest.fixture(scope="module")
def shard_root(sample_root, tmp_path_factory) -> Path:
    """The sample data converted: cifar10/{train,val} (one shard each) and imagenet/{train,val} (3 each)."""
    root = tmp_path_factory.mktemp("shards")
    for name, shards in (("cifar10", "1"), ("imagenet", "3")):
        result = convert(sample_root / name, root / name, "--shards", shards, "--workers", "2")
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def sources_of(sample_root: Path, shard_root: Path, dataset: str):
    folder = "cifar10" if dataset == "cifar10" else "imagenet"
    return str(sample_root / folder), str(shard_root / folder)


def all_batches(data, epochs: int = 1) -> list:
    iterator = data.create_tuple_iterator(num_epochs=epochs, output_numpy=True)
    return [[tuple(np.asarray(column) for column in batch) for batch in iterator] for _ in range(epochs)]


def assert_same_batches(first: list, second: list) -> None:
    assert [len(epoch) for epoch in first] == [len(epoch) for epoch in second]
    for epoch_a, epoch_b in zip(first, second):
        for batch_a, batch_b in zip(epoch_a, epoch_b):
            assert len(batch_a) == len(batch_b)
            for column_a, column_b in zip(batch_a, batch_b):
                np.testing.assert_array_equal(column_a, column_b)


def batches_of(dataset: str, path: str, epochs: int = 1, **options) -> list:
    options.setdefault("training", True)
    return all_batches(create_dataset(dataset, path, batch_size=16, image_size=SIZES[dataset], class_num=10,
                                      **options), epochs)


# ---------------------------------------------------------------- the conversion

@pytest.mark.parametrize("name", ["cifar10", "imagenet"])
def test_conversion_holds_every_record_in_order_with_its_class_list(sample_root, shard_root, name):
    dataset = "cifar10" if name == "cifar10" else "imagenet2012"
    for split, training in (("train", True), ("val", False)):
        folder = shard_root / name / split
        manifest = json.loads((folder / MANIFEST).read_text())
        original = create_source(dataset, str(sample_root / name), training=training)
        shards = create_source(dataset, str(shard_root / name), training=training)
        assert isinstance(shards, MindRecordSource) and len(shards) == len(original)
        np.testing.assert_array_equal(shards.labels, original.labels)
        assert (folder / CLASS_LIST).read_text().splitlines() == list(original.class_names)
        counts = [records_in(read_header(str(folder / shard["file"]))) for shard in manifest["shards"]]
        assert counts == [shard["records"] for shard in manifest["shards"]] and sum(counts) == len(original)
        if name == "imagenet":
            assert shards.paths == [os.path.relpath(p, original.root) for p in original.paths]
            raw, index = next(shards.read([17]))
            assert (raw, index) == (17, Path(original.paths[17]).read_bytes())  # the file's bytes, not re-encoded


def test_converting_again_leaves_a_finished_conversion_as_it_is(sample_root, shard_root):
    before = {p.name: p.stat().st_mtime_ns for p in (shard_root / "imagenet" / "train").iterdir()}
    result = convert(sample_root / "imagenet", shard_root / "imagenet", "--shards", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in (shard_root / "imagenet" / "train").iterdir()} == before


def done_markers(partial: Path) -> int:
    """Shards marked done in `partial`: the markers themselves, not a marker's hidden temporary
    (write_atomic's, renamed a moment later; pathlib's glob matches hidden names), which a Ctrl-C
    before its rename removes."""
    return len([p for p in partial.glob("*" + mindrecord.DONE) if not p.name.startswith(TMP_PREFIX)])


@pytest.mark.slow
def test_an_interrupted_conversion_never_looks_finished_and_goes_on_when_run_again(sample_root, tmp_path):
    """SIGINT after two of many one-worker shards: no manifest, nothing at --output; the second run
    keeps the shards done and ends with the records a straight conversion writes."""
    output, partial = tmp_path / "train", tmp_path / "train.partial"
    command = [PYTHON, "-m", "src.data.mindrecord", "--data_path", str(sample_root / "imagenet" / "train"),
               "--output", str(output), "--shards", "100", "--workers", "1"]
    process = start(command, new_session=True)
    deadline = time.time() + 120
    while done_markers(partial) < 2:
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert not output.exists() and not (partial / MANIFEST).exists()
    done = done_markers(partial)
    assert 2 <= done < 100
    result = run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{done} of 100 shards already written" in result.stdout
    assert not partial.exists()
    source = MindRecordSource(str(output), kind="encoded")
    assert [index for index, _ in source.read(np.arange(len(source)))] == list(range(200))


def test_converter_bad_input_is_one_line_and_writes_nothing(sample_root, tmp_path):
    missing = convert(tmp_path / "missing", tmp_path / "out")
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: source folder not found: {tmp_path / 'missing'}; pass --data_path with a class folder, a dataset "
        f"root or CIFAR-10's binary files"]
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    result = convert(sample_root / "imagenet" / "train", occupied)
    assert result.returncode == 2 and "is no finished conversion" in result.stderr.strip().splitlines()[-1]
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"] and not (tmp_path / "occupied.partial").exists()
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_one_line_and_leaves_no_finished_conversion(sample_root, tmp_path):
    with small_disk(tmp_path / "disk", 1) as disk:  # the sample's 200 JPEGs take about 1 MB
        result = convert(sample_root / "imagenet" / "train", disk / "train", "--shards", "2", "--workers", "1")
        assert result.returncode == 2
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: cannot write shard {disk / 'train.partial'}") and "free space" in line
        assert not (disk / "train").exists()


def test_a_half_written_done_marker_is_not_taken_for_a_done_shard(tmp_path):
    plan = {"records": 4, "shards": 2, "kind": "encoded", "fingerprint": "f"}
    assert prepare_partial(str(tmp_path / "p"), plan) == []
    (tmp_path / "p" / "part-00000-of-00002.mindrecord.done").write_text('{"file": "part-0')
    assert prepare_partial(str(tmp_path / "p"), plan) == []
    assert (tmp_path / "p" / "plan.json").exists()  # the same plan: kept, not started over


def test_a_shard_killed_between_its_two_files_is_written_again(tmp_path):
    """Only the index file (.db) of a shard marked done: no traceback, the shard is not taken as done."""
    plan = {"records": 4, "shards": 2, "kind": "encoded", "fingerprint": "f"}
    partial = tmp_path / "p"
    prepare_partial(str(partial), plan)
    shard = "part-00000-of-00002.mindrecord"
    (partial / f"{shard}.done").write_text(json.dumps({"file": shard, "records": 2, "bytes": 100}))
    (partial / f"{shard}.db").write_bytes(b"index")
    assert prepare_partial(str(partial), plan) == []


class Killed(BaseException):
    """A SIGKILL at a file-system change: nothing after it runs (not an Exception: no handler sees it)."""


class KillingOs:
    """The converter's `os`, killing the process (raising Killed) at its `at`-th change of the file
    system once armed; every other name is os's."""

    def __init__(self, at: int):
        self.at, self.changes, self.armed = at, 0, False

    def __getattr__(self, name):
        return getattr(os, name)

    def change(self, what):
        if self.armed:
            self.changes += 1
            if self.changes == self.at:
                raise Killed(what)

    def remove(self, path):
        self.change(("remove", path))
        os.remove(path)

    def rename(self, source, target):
        self.change(("rename", source))
        os.rename(source, target)


def records_of(folder: Path) -> list:
    source = MindRecordSource(str(folder), kind="encoded")
    return list(source.read(np.arange(len(source))))


@pytest.mark.slow
def test_a_conversion_killed_at_each_step_after_its_last_shard_loses_no_shard(sample_root, tmp_path, monkeypatch):
    """Killed at each of the file-system changes after the last shard is done (the class list, the
    manifest, the rename into place, the plan and the 6 markers), the same command again writes no
    shard and ends with the records of an uninterrupted conversion."""
    train = sample_root / "imagenet" / "train"
    straight = tmp_path / "straight"
    mindrecord.convert_split(ImageFolderSource(str(train), training=True), str(straight), shards=6, workers=1,
                             overwrite=False, log=lambda line: None)
    expected = records_of(straight)
    real_write_shards, real_write_atomic = mindrecord.write_shards, mindrecord.write_atomic
    at = 1
    while True:
        killer = KillingOs(at)
        written = []

        def write_shards(tasks, *args, killer=killer, written=written, **kwargs):
            written.append(len(tasks))
            entries = real_write_shards(tasks, *args, **kwargs)
            killer.armed = True  # the last shard is done: count the changes from here
            return entries

        def write_atomic(path, text, killer=killer):
            killer.change(("write", path))
            real_write_atomic(path, text)

        output = tmp_path / f"killed{at}"
        with monkeypatch.context() as patch:
            patch.setattr(mindrecord, "os", killer)
            patch.setattr(mindrecord, "write_shards", write_shards)
            patch.setattr(mindrecord, "write_atomic", write_atomic)
            try:
                mindrecord.convert_split(ImageFolderSource(str(train), training=True), str(output), shards=6,
                                         workers=1, overwrite=False, log=lambda line: None)
                killed = False
            except Killed:
                killed = True
        if not killed:  # every change came and went: the last one was `at - 1`
            break
        with monkeypatch.context() as patch:
            patch.setattr(mindrecord, "write_shards", write_shards)
            mindrecord.convert_split(ImageFolderSource(str(train), training=True), str(output), shards=6,
                                     workers=1, overwrite=False, log=lambda line: None)
        assert sum(written[1:]) == 0, f"killed at change {at}: the rerun wrote {written[1:]} shards"
        assert records_of(output) == expected, f"killed at change {at}"
        assert not (output.parent / f"{output.name}.partial").exists()
        assert not [p for p in output.iterdir() if p.name.endswith(".done") or p.name == "plan.json"]
        at += 1
    assert at - 1 == 10  # class list, manifest, rename, plan, 6 done markers


def test_an_image_replaced_under_the_same_name_is_not_taken_as_converted(tmp_path):
    """The fingerprint holds each file's size and time: a converted folder whose image was replaced
    is no longer "already converted"; the error names the file, --overwrite converts it again."""
    folder = tmp_path / "images"
    write_sample_data(str(tmp_path / "sample"), train_per_class=2, test_per_class=1, formats=("imagenet",))
    shutil.copytree(tmp_path / "sample" / "imagenet" / "train", folder)
    first = convert(folder, tmp_path / "shards", "--shards", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    replaced = sorted(classes[0].iterdir())[0]
    replaced.write_bytes(sorted(classes[1].iterdir())[0].read_bytes())  # another class's image, same name
    stale = convert(folder, tmp_path / "shards", "--shards", "2")
    assert stale.returncode == 2
    line = stale.stderr.strip().splitlines()[-1]
    assert "already holds a conversion of other images" in line
    assert f"changed: {replaced.relative_to(folder)}" in line and "--overwrite" in line
    again = convert(folder, tmp_path / "shards", "--shards", "2", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    source = MindRecordSource(str(tmp_path / "shards"), kind="encoded")
    index = source.paths.index(str(replaced.relative_to(folder)))
    assert dict(source.read(np.array([index])))[index] == replaced.read_bytes()


# ---------------------------------------------------------------- the same batches as the folders

@pytest.mark.parametrize("dataset", ["cifar10", "imagenet2012"])
def test_training_batches_equal_the_folders_with_the_whole_recipe(sample_root, shard_root, dataset):
    folder, shards = sources_of(sample_root, shard_root, dataset)
    assert_same_batches(batches_of(dataset, folder, epochs=2, augmentation=V2, num_parallel_workers=1),
                        batches_of(dataset, shards, epochs=2, augmentation=V2, num_parallel_workers=1))


def test_batches_do_not_depend_on_workers_or_their_kind(sample_root, shard_root):
    _, shards = sources_of(sample_root, shard_root, "imagenet2012")
    one = batches_of("imagenet2012", shards, augmentation=V2, num_parallel_workers=1)
    assert_same_batches(one, batches_of("imagenet2012", shards, augmentation=V2, num_parallel_workers=2))
    assert_same_batches(one, batches_of("imagenet2012", shards, augmentation=V2, num_parallel_workers=2,
                                        worker_kind="thread"))


@pytest.mark.parametrize("training", [True, False])
def test_each_rank_reads_the_folders_share(sample_root, shard_root, training):
    """Train ranks take their slice of the epoch's permutation, eval ranks every sample once
    between them: as the folder's ranks do (tests/test_dataset.py checks those)."""
    folder, shards = sources_of(sample_root, shard_root, "imagenet2012")
    for rank in range(3):
        options = dict(training=training, num_shards=3, shard_id=rank, num_parallel_workers=1)
        assert_same_batches(batches_of("imagenet2012", folder, **options),
                            batches_of("imagenet2012", shards, **options))


def test_a_resumed_epoch_and_a_later_start_epoch_equal_the_folders(sample_root, shard_root):
    folder, shards = sources_of(sample_root, shard_root, "cifar10")
    for options in (dict(start_epoch=1, skip_samples=48), dict(start_epoch=3)):
        assert_same_batches(batches_of("cifar10", folder, epochs=2, augmentation=V2, **options),
                            batches_of("cifar10", shards, epochs=2, augmentation=V2, **options))


@pytest.mark.slow
def test_training_from_shards_ends_with_the_folders_weights(sample_root, shard_root, tmp_path):
    """train.py with the data recipe from the CIFAR-10 files and from their shards: the very same
    weights after an epoch, and the same evaluation of them."""
    config = ["--config_path", str(REPO / "config" / "sample_resnet18.yaml"), "--net_name", "resnet10",
              "--epoch_size", "1", "--batch_size", "16", "--warmup_epochs", "0", "--auto_augment", "cifar10",
              "--random_erase", "0.25", "--mixup_alpha", "0.2", "--cutmix_alpha", "1.0", *NO_CURVES]
    weights, evaluations = [], []
    for name, data in (("folder", sample_root / "cifar10"), ("shards", shard_root / "cifar10")):
        result = run([PYTHON, "train.py", "--data_path", str(data), "--output_dir", str(tmp_path / name), *config])
        assert result.returncode == 0, result.stderr[-3000:]
        folder = tmp_path / name / "resnet10" / "cifar10"
        weights.append({k: v.asnumpy() for k, v in read_checkpoint(str(folder / "resnet10-1_12.ckpt")).items()})
        evaluations.append([(row["top_1"], row["top_5"], row["ece"]) for row in read_metrics(folder) if row["top_1"]])
    assert weights[0].keys() == weights[1].keys()
    difference = max(float(np.max(np.abs(weights[0][k] - weights[1][k]))) for k in weights[0])
    assert difference == 0.0
    assert len(evaluations[0]) == 1 and evaluations[0] == evaluations[1]


# ---------------------------------------------------------------- bad shard sets

@pytest.fixture
def copied(shard_root, tmp_path) -> Path:
    """A copy of the converted imagenet sample to damage."""
    target = tmp_path / "imagenet"
    shutil.copytree(shard_root / "imagenet", target)
    return target


def error_of(path: Path, training: bool = True) -> str:
    with pytest.raises(UserInputError) as raised:
        create_source("imagenet2012", str(path), training=training)
    return str(raised.value)


def test_a_truncated_shard_is_named(copied):
    shard = copied / "train" / "part-00001-of-00003.mindrecord"
    os.truncate(shard, shard.stat().st_size - 100)
    assert str(shard) in error_of(copied) and "truncated" in error_of(copied)


def test_a_missing_index_file_is_named(copied):
    (copied / "train" / "part-00002-of-00003.mindrecord.db").unlink()
    assert "part-00002-of-00003.mindrecord.db is missing" in error_of(copied)


def test_a_missing_member_of_the_set_is_named(copied):
    (copied / "val" / "part-00000-of-00003.mindrecord").unlink()
    assert "part-00000-of-00003.mindrecord is missing" in error_of(copied, training=False)


def test_a_class_list_that_disagrees_with_the_records_is_named(copied):
    names = (copied / "train" / CLASS_LIST).read_text().splitlines()
    (copied / "train" / CLASS_LIST).write_text("\n".join(names[:-1]) + "\n")
    assert f"class list {copied / 'train' / CLASS_LIST} (9 names) disagrees" in error_of(copied)


def test_an_unfinished_conversion_is_named(copied):
    (copied / "train" / MANIFEST).unlink()
    assert "did not finish" in error_of(copied)


def test_shards_of_another_tool_are_named(tmp_path):
    """The model zoo's conversion scripts write {"data": bytes, "label": int32}."""
    folder = tmp_path / "zoo" / "train"
    folder.mkdir(parents=True)
    writer = FileWriter(str(folder / "imagenet.mindrecord"), shard_num=1)
    writer.add_schema({"data": {"type": "bytes"}, "label": {"type": "int32"}}, "zoo")
    writer.write_raw_data([{"data": b"\xff\xd8", "label": 0}])
    writer.commit()
    assert "another tool's schema (fields ['data', 'label'])" in error_of(tmp_path / "zoo")


def test_cifar_shards_under_a_class_folder_dataset_say_which_dataset_to_use(shard_root):
    with pytest.raises(UserInputError, match="holds CIFAR-10 pixels; use --dataset cifar10"):
        create_source("imagenet2012", str(shard_root / "cifar10"), training=True)


def test_a_damaged_image_in_a_shard_names_the_shard_when_read(copied):
    shard = copied / "train" / "part-00001-of-00003.mindrecord"
    data = bytearray(shard.read_bytes())
    header = 1 << 24  # the blob pages follow MindRecord's 16 MB header
    for at in range(header, header + 40_000, 7):
        data[at] ^= 0x5A
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as raised:
        all_batches(create_dataset("imagenet2012", str(copied), training=True, batch_size=16, image_size=40,
                                   num_parallel_workers=1))
    message = user_error_message(raised.value)
    assert message.startswith(f"cannot decode {shard} (record ")


def test_a_damaged_record_is_counted_listed_and_replaced_as_a_broken_file_is(copied, sample_root, tmp_path):
    """max_bad_samples applies to shards as to class folders: the record is recorded under its
    source file, replaced by the next readable sample, and the batches equal those of the class
    folder with the same file broken; past the limit, the same one-line stop."""
    shard = copied / "train" / "part-00002-of-00003.mindrecord"
    data = bytearray(shard.read_bytes())
    header = 1 << 24
    data[header:header + 2000] = bytes(2000)  # the first image of the shard: undecodable
    shard.write_bytes(bytes(data))
    damaged = MindRecordSource(str(copied / "train"), "encoded").paths[200 * 2 // 3]
    folder = tmp_path / "folder"
    shutil.copytree(sample_root / "imagenet", folder)
    broken = folder / "train" / damaged
    broken.write_bytes(broken.read_bytes()[:400])  # as test_faults.break_image
    options = dict(num_parallel_workers=2, max_bad_samples=1)
    from_shards = batches_of("imagenet2012", str(copied), bad_sample_file=str(tmp_path / "shards.tsv"), **options)
    from_folder = batches_of("imagenet2012", str(folder), bad_sample_file=str(tmp_path / "folder.tsv"), **options)
    assert_same_batches(from_shards, from_folder)
    for record in ("shards.tsv", "folder.tsv"):
        rows = [line.split("\t") for line in (tmp_path / record).read_text().splitlines()]
        assert [row[2] for row in rows] == [damaged if record == "shards.tsv" else str(broken)]
    with pytest.raises(RuntimeError) as raised:
        batches_of("imagenet2012", str(copied), bad_sample_file=str(tmp_path / "strict.tsv"),
                   num_parallel_workers=1, max_bad_samples=0)
    assert user_error_message(raised.value).startswith(f"1 unreadable images, more than max_bad_samples 0: {damaged}")


@pytest.mark.slow
def test_check_data_finds_the_damaged_image(copied):
    # in this process (the clean set), then in 2 spawned workers (each imports MindSpore: ~5 CPU s)
    assert scan_unreadable(create_source("imagenet2012", str(copied), training=True), workers=1) == []
    data = bytearray((copied / "train" / "part-00002-of-00003.mindrecord").read_bytes())
    header = 1 << 24
    data[header:header + 2000] = bytes(2000)  # the first image's JPEG header and more
    (copied / "train" / "part-00002-of-00003.mindrecord").write_bytes(bytes(data))
    found = scan_unreadable(create_source("imagenet2012", str(copied), training=True), workers=2)
    first_of_shard = 200 * 2 // 3
    assert [name for name, _ in found] == [MindRecordSource(str(copied / "train"), "encoded").paths[first_of_shard]]


def test_eval_of_a_damaged_set_is_one_line_and_exit_2(copied):
    os.truncate(copied / "val" / "part-00000-of-00003.mindrecord", 1000)
    result = run([PYTHON, "eval.py", "--config_path", str(REPO / "config" / "sample_resnet18.yaml"),
                  "--dataset", "imagenet2012", "--data_path", str(copied), "--checkpoint_file_path", "none.ckpt"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: shard {copied / 'val'}")
