"""Broken files through the CLI: every command that reads a checkpoint, a ``.safetensors`` file, a sharded
checkpoint, a run folder or token-label maps stops with exit code 2 and one line ``vitrain: error: ...``
that names the broken path, never a traceback, for each kind of damage: an empty file, a text file, random
bytes, a real checkpoint cut off at several points, a zip of other members, a safetensors header that lies
about its sizes, a folder where a file belongs and a file where a folder belongs, an unreadable file.

The broken things are built once from one real 2-step run; each case runs ``vitrain.cli.main`` in this
process. A control test runs every command on the intact files, so a case cannot pass by a mistake in
its arguments (a config error would name the path too)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import shutil
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import SMALL_SYNTHETIC_RUN, make_config
from vitrain.checkpoint import load_checkpoint
from vitrain.checkpoint.sharded import EXTRAS_FILE, save_sharded
from vitrain.cli import main
from vitrain.config import model_overrides
from vitrain.export import export_model, export_timm
from vitrain.models import build_model, model_spec
from vitrain.token_labeling.maps import DatasetFingerprint, LabelMapWriter, MapLayout, in_memory_sample_keys
from vitrain.train import loop

RUN = [*SMALL_SYNTHETIC_RUN, "train.steps=2"]
"""The real run (10 classes, 96 training images at 14 px) and every training command's settings."""
TIMM_ARCH = "vit_tiny_patch16_224"
"""timm weights for ``finetune --from timm:NAME --set train.init_weights=F`` (vitrain's vit_tiny_patch16)."""
TIMM_TEACHER = "test_resnet"
"""A tiny timm model: ``train.distill.teacher=NAME`` with ``train.distill.teacher_weights=F``."""
STUDENT = ["model.distill_token=true", "model.head=cls"]
"""A student with DeiT's distillation token (it reads the CLS token: the recipe's pooled head would not do)."""


def _set(*settings: str) -> list[str]:
    return [item for setting in settings for item in ("--set", setting)]


@dataclasses.dataclass(frozen=True)
class Originals:
    """The intact files the broken ones are made from."""

    checkpoint: Path  # a step-*.pt of the real run
    safetensors: Path  # its `vitrain export`
    timm_checkpoint: Path  # a checkpoint of a model timm has (for export --format timm)
    timm_folder: Path  # its `vitrain export --format timm`: model.safetensors and config.json
    timm_teacher: Path  # timm's test_resnet on 10 classes, random weights
    sharded: Path  # the checkpoint as a sharded run/checkpoints/step-*/ folder (model, optimizer, extras)
    maps: Path  # token-label maps of the run's training images, in 2 shards
    picture: Path  # an image for predict


def _sharded_copy(checkpoint: Path, folder: Path) -> Path:
    """The checkpoint as a sharded folder, as a run with checkpoint.format=sharded saves it (resumable)."""
    payload = load_checkpoint(checkpoint)
    tensors = {key: payload[key] for key in ("model", "optimizer")}
    extras = {key: value for key, value in payload.items() if key not in tensors}
    return save_sharded(folder, tensors, extras, is_main=True)


def _label_maps(folder: Path) -> Path:
    layout = MapLayout(count=96, num_classes=10, k=3, height=2, width=2, samples_per_shard=64)
    header = {"fingerprint": vars(DatasetFingerprint.of_keys(in_memory_sample_keys("synthetic", 96)))}
    writer = LabelMapWriter(folder, layout, header)
    writer.write_header()
    rng = np.random.default_rng(0)
    for shard in range(layout.num_shards):
        shape = (len(layout.shard_range(shard)), 3, 2, 2)
        writer.write_shard(shard, rng.standard_normal(shape), rng.integers(0, 10, shape), [])
    writer.write_index()
    return folder


TIMM_MODEL = ["model.name=vit_tiny_patch16", "model.head=gap", "model.mlp_ratio=2", "data.image_size=32"]
"""A small model that timm has (exports to a timm folder), its weights read as timm's vit_tiny_patch16_224."""


def _timm_model_checkpoint(path: Path) -> Path:
    """A checkpoint file of an untrained vit_tiny_patch16 as training saves it (weights and config)."""
    config = make_config(*RUN, *TIMM_MODEL)
    options = model_overrides(config.model, model_spec(config.model.name).args)
    model = build_model(config.model.name, img_size=32, num_classes=10, **options)
    torch.save({"model": model.state_dict(), "config": config.model_dump(mode="json"), "plan": {}}, path)
    return path


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> Originals:
    from safetensors.torch import save_file

    timm = pytest.importorskip("timm", reason="timm is a test dependency ([dev] extra)")
    root = tmp_path_factory.mktemp("originals")
    assert main(["train", *_set(*RUN, f"train.out_dir={root / 'run'}")]) == 0  # the CLI's recipe, as every case's
    checkpoint = sorted((root / "run" / "checkpoints").glob("step-*.pt"))[-1]
    export_model(checkpoint, root / "model.safetensors")
    torch.manual_seed(0)
    timm_checkpoint = _timm_model_checkpoint(root / "timm-model.pt")
    export_timm(timm_checkpoint, root / "timm-model")
    save_file(timm.create_model(TIMM_TEACHER, num_classes=10).state_dict(), str(root / "test_resnet.safetensors"))
    picture = root / "picture.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(picture)
    return Originals(
        checkpoint=checkpoint,
        safetensors=root / "model.safetensors",
        timm_checkpoint=timm_checkpoint,
        timm_folder=root / "timm-model",
        timm_teacher=root / "test_resnet.safetensors",
        sharded=_sharded_copy(checkpoint, root / "sharded-run" / "checkpoints" / "step-000000002"),
        maps=_label_maps(root / "maps"),
        picture=picture,
    )


# --- the kinds of damage ---------------------------------------------------------------------------

Damage = Callable[[Path, bytes], None]
"""Writes the broken thing at the path, from the intact file's bytes."""


def _write(data: bytes) -> Damage:
    return lambda path, _: path.write_bytes(data)


def _cut(fraction: float = 0.0, keep: int | None = None, drop: int | None = None) -> Damage:
    def damage(path: Path, intact: bytes) -> None:
        end = keep if keep is not None else len(intact) - drop if drop is not None else int(len(intact) * fraction)
        path.write_bytes(intact[:end])

    return damage


def _zip_of_text(path: Path, _: bytes) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", "a zip file, but not one torch.save wrote\n")
    path.write_bytes(buffer.getvalue())


def _folder(path: Path, _: bytes) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("a folder where a file belongs\n")


def _unreadable(path: Path, intact: bytes) -> None:
    path.write_bytes(intact)
    path.chmod(0)


RANDOM = np.random.default_rng(1).bytes(4096)
COMMON: dict[str, Damage] = {
    "empty": _write(b""),
    "text": _write(b"notes, not a checkpoint\n" * 20),
    "random-bytes": _write(RANDOM),
    "pickle-header-then-random-bytes": _write(b"\x80\x02" + RANDOM),
    "cut-at-10-bytes": _cut(keep=10),
    "cut-in-half": _cut(0.5),
    "all-but-the-last-100-bytes": _cut(drop=100),
    "folder": _folder,
    "unreadable": _unreadable,
}


def _a_tensor(path: Path, _: bytes) -> None:
    torch.save(torch.zeros(3), path)  # a torch file, but no checkpoint


CHECKPOINT_DAMAGE: dict[str, Damage] = {**COMMON, "zip-of-a-text-file": _zip_of_text, "a-tensor-file": _a_tensor}


def _safetensors_header(intact: bytes) -> tuple[dict, bytes]:
    length = struct.unpack("<Q", intact[:8])[0]
    return json.loads(intact[8 : 8 + length]), intact[8 + length :]


def _with_header(header: dict, body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


def _tensor_beyond_the_file(path: Path, intact: bytes) -> None:
    header, body = _safetensors_header(intact)
    name = next(key for key in header if key != "__metadata__")
    start = header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [start, len(body) + 4096]
    path.write_bytes(_with_header(header, body))


def _header_length_beyond_the_file(path: Path, intact: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(intact) * 10) + intact[8:])


def _header_not_json(path: Path, intact: bytes) -> None:
    _, body = _safetensors_header(intact)
    text = b"this header is not JSON at all"
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def _config_not_json(path: Path, intact: bytes) -> None:
    header, body = _safetensors_header(intact)
    header["__metadata__"]["config"] = "{'model': cut off"
    path.write_bytes(_with_header(header, body))


SAFETENSORS_DAMAGE: dict[str, Damage] = {
    **COMMON,
    "header-says-a-tensor-runs-past-the-end": _tensor_beyond_the_file,
    "header-length-beyond-the-file": _header_length_beyond_the_file,
    "header-not-json": _header_not_json,
}
VITRAIN_SAFETENSORS_DAMAGE = {**SAFETENSORS_DAMAGE, "metadata-config-not-json": _config_not_json}
"""What `vitrain export` writes also carries the run's config in its metadata."""


def _damaged(damage: Damage, path: Path, intact: Path) -> Path:
    if damage is _unreadable and os.geteuid() == 0:
        pytest.skip("runs as root, where chmod 000 does not stop reads: an unreadable file cannot be made")
    path.parent.mkdir(parents=True, exist_ok=True)
    damage(path, intact.read_bytes())
    return path


# --- the commands ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    originals: Originals
    tmp: Path  # this case's folder for outputs

    def run(self, *settings: str) -> list[str]:
        """The real run's settings for a new run in this case's folder."""
        return _set(*RUN, f"train.out_dir={self.tmp / 'out'}", *settings)


Command = Callable[[Path, Context], list[str]]
"""The argv of a command reading the thing at the path."""

CHECKPOINT_COMMANDS: dict[str, Command] = {
    "eval": lambda f, c: ["eval", "--checkpoint", str(f)],
    "export": lambda f, c: ["export", "--checkpoint", str(f), "--out", str(c.tmp / "x.safetensors")],
    "export-timm": lambda f, c: ["export", "--checkpoint", str(f), "--format", "timm", "--out", str(c.tmp / "t")],
    "export-onnx": lambda f, c: ["export", "--checkpoint", str(f), "--format", "onnx", "--out", str(c.tmp / "x.onnx")],
    "predict": lambda f, c: ["predict", "--checkpoint", str(f), str(c.originals.picture)],
    "finetune-from": lambda f, c: ["finetune", "--from", str(f), *_set(f"train.out_dir={c.tmp / 'out'}")],
    "train-resume": lambda f, c: ["train", "--resume", str(f), *c.run()],
    "train-init-from": lambda f, c: ["train", *c.run(f"train.init_from={f}")],
    "train-teacher": lambda f, c: [
        "train",
        *c.run(*STUDENT, "train.distill.kind=soft", f"train.distill.teacher={f}"),
    ],
    "label-teacher": lambda f, c: ["label", "--teacher", str(f), "--out", str(c.tmp / "maps"), *c.run()],
}
SAFETENSORS_COMMANDS: dict[str, Command] = {
    name: CHECKPOINT_COMMANDS[name] for name in ("finetune-from", "train-init-from", "train-teacher", "label-teacher")
}
TIMM_WEIGHTS_COMMANDS: dict[str, Command] = {
    "finetune-from-timm": lambda f, c: [
        "finetune",
        "--from",
        f"timm:{TIMM_ARCH}",
        "--recipe",
        "fmnist",
        *c.run(*TIMM_MODEL, f"train.init_weights={f}"),
    ],
    "train-timm-teacher": lambda f, c: [
        "train",
        *c.run(
            *STUDENT,
            "train.distill.kind=hard",
            f"train.distill.teacher={TIMM_TEACHER}",
            f"train.distill.teacher_weights={f}",
        ),
    ],
}
FOLDER_COMMANDS: dict[str, Command] = {  # commands that take a sharded checkpoint or a run folder
    name: CHECKPOINT_COMMANDS[name]
    for name in ("eval", "export", "predict", "finetune-from", "train-init-from", "train-teacher")
}


def _token_labels(maps: Path, c: Context) -> list[str]:
    return ["train", *c.run("model.aux_head=true", f"token_labels.maps={maps}")]


def _label_into(maps: Path, c: Context) -> list[str]:
    teacher = ["--teacher", str(c.originals.checkpoint), "--topk", "3", "--shard-size", "64"]
    return ["label", *teacher, "--out", str(maps), *c.run()]


MAPS_COMMANDS: dict[str, Command] = {"train-token-labels": _token_labels, "label-out": _label_into}


# --- the broken folders ------------------------------------------------------------------------------

FolderDamage = Callable[[Path, Originals], Path]
"""Makes a broken folder (or a file in its place) under the path; returns what the command is given."""


def _broken_member(member: str, damage: Damage) -> FolderDamage:
    """The folder (sharded checkpoint or label maps) copied, its ``member`` file replaced by a broken one."""

    def make(path: Path, intact: Path) -> Path:
        folder = shutil.copytree(intact, path / intact.name)
        original = folder / member
        data_source = path / "intact-member"
        if original.is_file():
            shutil.move(original, data_source)
        else:
            shutil.rmtree(original)
            data_source.write_bytes(b"")
        _damaged(damage, original, data_source)
        return folder

    return make


def _sharded(member: str, damage: Damage) -> FolderDamage:
    return lambda path, o: _broken_member(member, damage)(path, o.sharded)


def _distcp(damage: Damage) -> FolderDamage:
    def make(path: Path, o: Originals) -> Path:
        member = sorted(path.name for path in o.sharded.glob("*.distcp"))[0]
        return _sharded(member, damage)(path, o)

    return make


def _sharded_as_a_file(path: Path, o: Originals) -> Path:
    return _damaged(CHECKPOINT_DAMAGE["text"], path / o.sharded.name, o.checkpoint)


def _run_with_broken_newest(damage: Damage) -> FolderDamage:
    def make(path: Path, o: Originals) -> Path:
        run = path / "run"
        _damaged(damage, run / "checkpoints" / "step-000000009.pt", o.checkpoint)
        record = {"step": 9, "top1": 50.0, "file": "step-000000009.pt"}  # evaluated: no warning that it is not
        (run / "checkpoints" / "best.json").write_text(json.dumps(record))
        return run

    return make


def _run_with_checkpoints_a_file(path: Path, o: Originals) -> Path:
    (path / "run").mkdir(parents=True)
    (path / "run" / "checkpoints").write_text("a file where the checkpoints folder belongs\n")
    return path / "run"


def _timm_folder(member: str | None, damage: Damage | None) -> FolderDamage:
    def make(path: Path, o: Originals) -> Path:
        if member is None:
            return shutil.copytree(o.timm_folder, path / "timm-model")
        return _broken_member(member, damage)(path, o.timm_folder)

    return make


FOLDER_DAMAGE: dict[str, FolderDamage] = {
    "sharded-metadata-empty": _sharded(".metadata", COMMON["empty"]),
    "sharded-metadata-text": _sharded(".metadata", COMMON["text"]),
    "sharded-metadata-random-bytes": _sharded(".metadata", COMMON["random-bytes"]),
    "sharded-metadata-cut-in-half": _sharded(".metadata", COMMON["cut-in-half"]),
    "sharded-metadata-folder": _sharded(".metadata", COMMON["folder"]),
    "sharded-distcp-cut-at-10-bytes": _distcp(COMMON["cut-at-10-bytes"]),
    "sharded-distcp-empty": _distcp(COMMON["empty"]),
    "sharded-extras-text": _sharded(EXTRAS_FILE, COMMON["text"]),
    "sharded-extras-cut-in-half": _sharded(EXTRAS_FILE, COMMON["cut-in-half"]),
    "sharded-extras-folder": _sharded(EXTRAS_FILE, COMMON["folder"]),
    "sharded-folder-is-a-file": _sharded_as_a_file,
    "run-newest-checkpoint-text": _run_with_broken_newest(COMMON["text"]),
    "run-newest-checkpoint-cut-in-half": _run_with_broken_newest(COMMON["cut-in-half"]),
    "run-checkpoints-is-a-file": _run_with_checkpoints_a_file,
    "timm-folder": _timm_folder(None, None),
    "timm-folder-weights-cut-in-half": _timm_folder("model.safetensors", COMMON["cut-in-half"]),
    "timm-folder-config-random-bytes": _timm_folder("config.json", COMMON["random-bytes"]),
}


def _maps_member(member: str, damage: Damage) -> FolderDamage:
    return lambda path, o: _broken_member(member, damage)(path, o.maps)


def _maps_index(text: str) -> FolderDamage:
    return _maps_member("index.json", _write(text.encode()))


def _maps_a_file(path: Path, o: Originals) -> Path:
    return _damaged(COMMON["text"], path / "maps", o.checkpoint)


MAPS_DAMAGE: dict[str, FolderDamage] = {
    **{f"index-{kind}": _maps_member("index.json", COMMON[kind]) for kind in COMMON},
    "index-a-json-list": _maps_index("[1, 2, 3]\n"),
    "index-without-the-layout": _maps_index('{"format_version": 1, "complete": true}\n'),
    "index-layout-of-strings": _maps_index(
        '{"format_version": 1, "complete": true, "count": "96", "num_classes": 10, "k": 3, "height": 2, "width": 2,'
        ' "samples_per_shard": 64, "fingerprint": {}}\n'
    ),
    **{f"shard-scores-{kind}": _maps_member("shard-00001/scores.npy", COMMON[kind]) for kind in COMMON},
    "shard-indices-text": _maps_member("shard-00000/indices.npy", COMMON["text"]),
    "shard-folder-is-a-file": _maps_member("shard-00001", COMMON["text"]),
    "maps-folder-is-a-file": _maps_a_file,
}


# --- the cases -------------------------------------------------------------------------------------

Make = Callable[[Path, Originals], Path]
"""Makes the broken thing under the path from the originals; returns what the command is given."""
CASES: dict[str, tuple[Command, Make]] = {}


def _add(commands: dict[str, Command], damages: dict[str, Callable], make: Callable[[Callable], Make]) -> None:
    for command_name, command in commands.items():
        for kind, damage in damages.items():
            CASES[f"{command_name}:{kind}"] = (command, make(damage))


def _file_of(attribute: str, name: str) -> Callable[[Damage], Make]:
    """A broken copy, named ``name``, of the original file ``attribute``."""

    def make(damage: Damage) -> Make:
        return lambda path, o: _damaged(damage, path / name, getattr(o, attribute))

    return make


def _as_is(damage: FolderDamage) -> Make:
    return damage


RESUME_AUTO: dict[str, Command] = {
    "train-resume-auto": lambda f, c: ["train", "--resume", "auto", *c.run(f"train.out_dir={f}")]
}
_add(CHECKPOINT_COMMANDS, CHECKPOINT_DAMAGE, _file_of("checkpoint", "broken.pt"))
_add(SAFETENSORS_COMMANDS, VITRAIN_SAFETENSORS_DAMAGE, _file_of("safetensors", "broken.safetensors"))
_add(
    {"finetune-from-timm": TIMM_WEIGHTS_COMMANDS["finetune-from-timm"]},
    SAFETENSORS_DAMAGE,
    lambda damage: lambda path, o: _damaged(damage, path / "model.safetensors", o.timm_folder / "model.safetensors"),
)
_add(
    {"train-timm-teacher": TIMM_WEIGHTS_COMMANDS["train-timm-teacher"]},
    SAFETENSORS_DAMAGE,
    _file_of("timm_teacher", "broken.safetensors"),
)
# the commands that build the model before they read the file (a teacher, init_from) or, for label --out,
# label first: every file damage above, and of the folders one of each part (the same readers as eval's)
ONE_OF_EACH_FOLDER = [
    "sharded-metadata-random-bytes",
    "sharded-distcp-cut-at-10-bytes",
    "sharded-extras-text",
    "sharded-folder-is-a-file",
    "run-newest-checkpoint-cut-in-half",
    "run-checkpoints-is-a-file",
    "timm-folder",
]
READ_FIRST = ("eval", "export", "predict", "finetune-from")
_add({name: FOLDER_COMMANDS[name] for name in READ_FIRST}, FOLDER_DAMAGE, _as_is)
_add(
    {name: FOLDER_COMMANDS[name] for name in FOLDER_COMMANDS if name not in READ_FIRST},
    {kind: FOLDER_DAMAGE[kind] for kind in ONE_OF_EACH_FOLDER},
    _as_is,
)


def _in_a_run(damage: FolderDamage) -> Make:
    """A run folder whose newest checkpoint is the broken sharded one."""
    return lambda path, o: damage(path / "run" / "checkpoints", o).parent.parent


_add(RESUME_AUTO, {kind: FOLDER_DAMAGE[kind] for kind in FOLDER_DAMAGE if kind.startswith("run-newest")}, _as_is)
_add(
    RESUME_AUTO,
    {
        kind: FOLDER_DAMAGE[kind]
        for kind in ("sharded-metadata-text", "sharded-distcp-cut-at-10-bytes", "sharded-extras-text")
    },
    _in_a_run,
)
_add({"train-token-labels": _token_labels}, MAPS_DAMAGE, _as_is)
_add(
    {"label-out": _label_into},
    {
        kind: damage
        for kind, damage in MAPS_DAMAGE.items()
        if kind.startswith("index-") or kind in ("shard-scores-text", "shard-indices-text", "shard-folder-is-a-file")
    },
    _as_is,
)


@pytest.fixture(autouse=True)
def one_thread_here(one_thread):
    """Tiny models: one intra-op thread is faster than two that wait on each other (conftest's one_thread)."""


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """A command that gets past reading its inputs must not train: it fails the test here instead."""

    def refuse(self):
        raise AssertionError("the command started training: nothing refused the broken input")

    monkeypatch.setattr(loop.Trainer, "train", refuse)


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_file_exits_2_with_one_line_naming_it(case, originals, tmp_path, capsys, caplog):
    command, make = CASES[case]
    broken = make(tmp_path / "broken", originals)
    argv = command(broken, Context(originals, tmp_path))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("vitrain: error: "), captured.err
    assert str(broken) in lines[0], lines[0]
    assert "; " in lines[0], f"no fix after '; ': {lines[0]}"
    assert "arbitrary unpickling" not in lines[0], f"damage taken for a malicious file: {lines[0]}"
    assert "Traceback" not in captured.err + captured.out
    # what the CLI would print besides: Python warnings and vitrain's log warnings (both go to stderr)
    user_warnings = [str(w.message) for w in shown if not issubclass(w.category, DeprecationWarning)]
    assert not user_warnings, user_warnings
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name in ("vitrain", "root")]
    assert not logged, logged


def _copy(attribute: str) -> Callable[[Originals, Path], Path]:
    def copy(o: Originals, tmp: Path) -> Path:
        source = getattr(o, attribute)
        return shutil.copytree(source, tmp / "intact" / source.name)

    return copy


def _intact(attribute: str) -> Callable[[Originals, Path], Path]:
    return lambda o, tmp: getattr(o, attribute)


CONTROLS: dict[str, tuple[Command, Callable[[Originals, Path], Path]]] = {
    **{
        f"{name}:checkpoint": (command, _intact("checkpoint"))
        for name, command in CHECKPOINT_COMMANDS.items()
        if name != "export-timm"  # timm has no vit_tiny6_patch7
    },
    **{f"{name}:safetensors": (command, _intact("safetensors")) for name, command in SAFETENSORS_COMMANDS.items()},
    "export-timm:timm-model": (CHECKPOINT_COMMANDS["export-timm"], _intact("timm_checkpoint")),
    "finetune-from-timm:timm-folder": (
        TIMM_WEIGHTS_COMMANDS["finetune-from-timm"],
        lambda o, tmp: o.timm_folder / "model.safetensors",
    ),
    "train-timm-teacher:timm-weights": (TIMM_WEIGHTS_COMMANDS["train-timm-teacher"], _intact("timm_teacher")),
    **{f"{name}:sharded": (command, _intact("sharded")) for name, command in FOLDER_COMMANDS.items()},
    **{
        f"{name}:run": (command, lambda o, tmp: o.checkpoint.parent.parent) for name, command in FOLDER_COMMANDS.items()
    },
    "train-resume-auto:sharded-run": (
        RESUME_AUTO["train-resume-auto"],
        lambda o, tmp: shutil.copytree(o.sharded.parent.parent, tmp / "intact" / "run"),
    ),
    "train-resume-auto:run": (
        RESUME_AUTO["train-resume-auto"],
        lambda o, tmp: shutil.copytree(o.checkpoint.parent.parent, tmp / "intact" / "run"),
    ),
    **{f"{name}:maps": (command, _copy("maps")) for name, command in MAPS_COMMANDS.items()},
}


@pytest.mark.parametrize("case", list(CONTROLS))
def test_each_command_reads_the_intact_files(case, originals, tmp_path, capsys):
    """The same arguments with the intact file get past reading it: the command succeeds, or starts training."""
    command, intact = CONTROLS[case]
    try:
        code = main(command(intact(originals, tmp_path), Context(originals, tmp_path)))
    except AssertionError as error:
        assert "started training" in str(error)
    else:
        assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "record", [b"[1, 2]", b'{"file": 3, "step": 1, "top1": 5.0}', b'{"file": "../x.pt"}', b"\x80\x02 not UTF-8"]
)
def test_a_damaged_best_record_is_no_record(record, tmp_path):
    """best.json that is not {"step", "top1", "file"}: a run folder then resolves to its newest checkpoint."""
    from vitrain.checkpoint.manager import find_best_checkpoint, read_best_record

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.json").write_bytes(record)
    assert read_best_record(tmp_path / "checkpoints") is None
    assert find_best_checkpoint(tmp_path) is None
