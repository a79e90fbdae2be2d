"""FSDP2, tensor parallelism and both together on the CPU (gloo), against one process.

Every strategy must train to the weights one process reaches on the same global batches (up to float
summation order): FSDP2 shards parameters/gradients/optimizer state and reduces gradients itself, TP
splits each block's heads and FFN columns and all-reduces activations, and the checkpoints they write
(sharded DCP folders) must load at another process count and continue to the same weights.
The model: the 6-block ViT-Ti with 6 heads, so that 2 tensor-parallel ranks split the heads evenly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.conftest import FSDP_TP_RUNS, make_config
from tests.dist.test_ddp import _assert_close, _overrides, _set_args, _train_in_one_process, torchrun
from vitrain.checkpoint.sharded import COMPLETE_MARKER, read_checkpoint_model
from vitrain.cli import main
from vitrain.config import DatasetInfo, Hardware, World, resolve
from vitrain.metrics import read_jsonl
from vitrain.models import build_model, model_facts
from vitrain.parallel.parallelize import apply_fsdp

FINAL = "checkpoints/step-000000018"
HEADS = "model.num_heads=6"


def _final_weights(out_dir):
    path = out_dir / FINAL if (out_dir / FINAL).is_dir() else out_dir / f"{FINAL}.pt"
    return read_checkpoint_model(path)[0]


def _losses(out_dir):
    return [record["loss"] for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one thread (the kernels each torchrun worker runs)."""
    out_dir = tmp_path_factory.mktemp("single") / "run"
    _train_in_one_process(out_dir, HEADS)
    return out_dir


def _run(out_dir, nproc, *extra):
    result = torchrun(["train", *_set_args(_overrides(out_dir, HEADS, *extra))], nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return out_dir


@pytest.mark.parametrize(
    ("nproc", "settings"),
    [
        (2, ["parallel.strategy=fsdp"]),
        (2, ["parallel.strategy=fsdp", "parallel.fsdp_reshard=zero2", "train.micro_batch_size=3"]),
        (2, ["parallel.strategy=tp"]),
        pytest.param(4, ["parallel.strategy=fsdp+tp", "parallel.tp_size=2"], marks=FSDP_TP_RUNS),
    ],
    ids=["fsdp-zero3", "fsdp-zero2-accumulation", "tp", "fsdp+tp"],
)
def test_sharded_strategies_match_one_process(reference, tmp_path, nproc, settings):
    out_dir = _run(tmp_path / "run", nproc, *settings)
    checkpoint = out_dir / FINAL
    assert (checkpoint / COMPLETE_MARKER).is_file() and len(list(checkpoint.glob("*.distcp"))) == nproc
    _assert_close(_final_weights(out_dir), _final_weights(reference))
    assert _losses(out_dir) == pytest.approx(_losses(reference), rel=1e-4)
    evals = [record for record in read_jsonl(out_dir / "metrics.jsonl") if record["event"] == "eval"]
    assert [record["num_samples"] for record in evals] == [30, 30, 30]  # TP peers counted once


def test_fsdp_with_layer_decay_matches_one_process(reference, tmp_path):
    """Layer-decay groups are formed by parameter name after sharding: the shards train at their layers' LRs."""
    decay = "optim.layer_decay=0.5"
    single = tmp_path / "single"
    _train_in_one_process(single, HEADS, decay)
    out_dir = _run(tmp_path / "fsdp", 2, "parallel.strategy=fsdp", decay)
    _assert_close(_final_weights(out_dir), _final_weights(single))
    decayed, plain = _final_weights(out_dir)["pos_embed"], _final_weights(reference)["pos_embed"]
    assert not torch.allclose(decayed, plain, rtol=1e-4, atol=2e-5)  # the embeddings took smaller steps


@FSDP_TP_RUNS
def test_fsdp_checkpoint_resumes_in_one_process_and_fsdp_tp_in_tp(reference, tmp_path):
    """Save at world 2 (FSDP) -> load at world 1; save at world 4 (FSDP x TP) -> load at world 2 (TP)."""
    fsdp = _run(tmp_path / "fsdp", 2, "parallel.strategy=fsdp")
    resumed = tmp_path / "fsdp-resumed"
    shutil.copytree(fsdp / "checkpoints" / "step-000000006", resumed / "checkpoints" / "step-000000006")
    assert main(["train", "--resume", "auto", *_set_args(_overrides(resumed, HEADS))]) == 0
    assert (resumed / f"{FINAL}.pt").is_file()  # one process writes single files again
    _assert_close(_final_weights(resumed), _final_weights(reference))

    two_d = _run(tmp_path / "fsdp-tp", 4, "parallel.strategy=fsdp+tp", "parallel.tp_size=2")
    tp_resumed = tmp_path / "tp-resumed"
    shutil.copytree(two_d / "checkpoints" / "step-000000012", tp_resumed / "checkpoints" / "step-000000012")
    result = torchrun(["train", "--resume", "auto", *_set_args(_overrides(tp_resumed, HEADS, "parallel.strategy=tp"))])
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_close(_final_weights(tp_resumed), _final_weights(reference))


def test_fsdp_cut_of_strided_rows_is_gathered_and_cut_whatever_torch_names_it(tmp_path):
    """fsdp+tp's fused qkv: FSDP2 cuts each TP rank's strided rows in blocks and names that cut
    ``_StridedShard`` (torch 2.14) or ``Shard(0)`` (torch 2.11, whose DTensor cannot gather it; 2.14's
    gathers that name in another order). Checkpoints must gather and cut the rows FSDP2 holds either way."""
    worker, results = Path(__file__).with_name("strided_rows_worker.py"), tmp_path / "results.jsonl"
    result = torchrun([str(results)], nproc=4, program=(str(worker),))
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_jsonl(results)
    assert sorted((record["labeling"], record["rank"]) for record in records) == sorted(
        (labeling, rank) for labeling in ("this torch's FSDP2", "torch 2.11's") for rank in range(4)
    )
    for record in records:
        assert record["gathered_equal"] and record["cut_equal"] and record["cut_placements_kept"], record


def test_tp_run_can_write_single_file_checkpoints_and_finetune_from_a_sharded_one(reference, tmp_path):
    """checkpoint.format=file gathers the shards onto rank 0; a sharded folder serves as init_from."""
    out_dir = _run(tmp_path / "run", 2, "parallel.strategy=tp", "checkpoint.format=file")
    _assert_close(_final_weights(out_dir), _final_weights(reference))
    sharded = _run(tmp_path / "sharded", 2, "parallel.strategy=fsdp", "train.epochs=1")
    tuned = tmp_path / "tuned"
    args = ["finetune", "--from", str(sharded / "checkpoints" / "step-000000006")]
    assert main([*args, *_set_args(_overrides(tuned, HEADS, "train.epochs=1", "data.image_size=21"))]) == 0
    assert read_checkpoint_model(tuned / "checkpoints" / "step-000000006.pt")[0]["pos_embed"].shape[1] == 9


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", 0.02), ("fp8", 0.05)])
def test_fsdp_o2_computes_in_low_precision_and_keeps_fp32_master_weights(reference, tmp_path, precision, tolerance):
    """precision_mode=o2 under FSDP is its mixed-precision policy: bf16 compute (fp8: with the blocks' linears
    in FP8, torchao emulating it here), fp32 shards and reduction."""
    if precision == "fp8":
        pytest.importorskip("torchao", reason="precision=fp8 needs torchao (the dev extra installs it)")
    out_dir = _run(tmp_path / "run", 2, "parallel.strategy=fsdp", f"precision={precision}", "precision_mode=o2")
    weights = _final_weights(out_dir)
    assert {value.dtype for value in weights.values()} == {torch.float32}
    assert _losses(out_dir) == pytest.approx(_losses(reference), rel=tolerance)  # rounding, not another run
    assert _losses(out_dir) != _losses(reference)  # and it did compute in low precision


EMA = ["train.ema.decay=0.9", "train.ema.warmup=true"]


def _ema(path):
    return read_checkpoint_model(path if path.exists() else path.with_suffix(".pt"), weights="ema")[0]


def _ema_evals(out_dir):
    return [(r["ema_top1"], r["ema_loss"]) for r in read_jsonl(out_dir / "metrics.jsonl") if r["event"] == "eval"]


def test_fsdp_weight_ema_matches_one_process_and_its_sharded_checkpoint_resumes(tmp_path):
    """The EMA is sharded as the parameters (each rank averages its shards), evaluated under FSDP, saved
    in the sharded folder, and loaded at another process count to continue to the same average."""
    single = tmp_path / "single"
    _train_in_one_process(single, HEADS, *EMA)
    fsdp = _run(tmp_path / "fsdp", 2, "parallel.strategy=fsdp", *EMA)
    step_6 = "checkpoints/step-000000006"
    assert (fsdp / step_6 / COMPLETE_MARKER).is_file()
    _assert_close(_ema(fsdp / step_6), _ema(single / step_6))
    _assert_close(_ema(fsdp / FINAL), _ema(single / FINAL))
    ours, reference = _ema_evals(fsdp), _ema_evals(single)
    assert len(ours) == len(reference) == 3
    assert [top1 for top1, _ in ours] == pytest.approx([top1 for top1, _ in reference], abs=3.4)  # 1 image of 30
    assert [loss for _, loss in ours] == pytest.approx([loss for _, loss in reference], rel=1e-3)

    resumed = tmp_path / "fsdp-resumed"
    shutil.copytree(fsdp / step_6, resumed / step_6)
    assert main(["train", "--resume", "auto", *_set_args(_overrides(resumed, HEADS, *EMA))]) == 0
    _assert_close(_ema(resumed / FINAL), _ema(single / FINAL))


def test_fsdp_on_a_cpu_mesh_reduces_gradients_by_sum_then_divides(tmp_path):
    """torch 2.8's gloo summed FSDP2's averaging reduce-scatter (every gradient times the world size; only
    its parity tests with SGD caught it): on a CPU mesh every FSDP group reduces with SUM and divides after,
    on every torch. In this process, as a world of one: the flag on each group, and gradients equal to the
    unsharded model's."""
    config = make_config("model.name=vit_tiny6_patch7", "train.batch_size=16", "parallel.strategy=fsdp")
    data = DatasetInfo(num_train=96, num_eval=32, num_classes=10, channels=1, mean=(0.5,), std=(0.25,))
    plan = resolve(
        config, data, Hardware(cuda_available=False, bf16_supported=True), model_facts, world=World(rank=0, size=2)
    )
    torch.manual_seed(0)
    reference = build_model("vit_tiny6_patch7", img_size=28, in_chans=1, num_classes=10)
    sharded = build_model("vit_tiny6_patch7", img_size=28, in_chans=1, num_classes=10)
    sharded.load_state_dict(reference.state_dict())
    images, labels = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        apply_fsdp(sharded, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), plan.parallel, plan.precision)
        groups = [module._get_fsdp_state()._fsdp_param_group for module in (*sharded.block_modules(), sharded)]
        assert len(groups) == 7 and all(group.force_sum_reduction_for_comms for group in groups)
        for model in (reference, sharded):
            torch.nn.functional.cross_entropy(model(images), labels).backward()
        for (name, ours), theirs in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert torch.allclose(ours.grad.full_tensor(), theirs.grad, atol=1e-6), name
    finally:
        dist.destroy_process_group()


MUON = ("optim.name=muon", "optim.lr=0.05")


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("muon-single") / "run"
    _train_in_one_process(out_dir, HEADS, *MUON)
    return out_dir


@pytest.mark.parametrize(
    ("nproc", "settings"),
    [
        (2, ["parallel.strategy=fsdp"]),
        (2, ["parallel.strategy=tp"]),
        (4, ["parallel.strategy=fsdp"]),
        pytest.param(4, ["parallel.strategy=fsdp+tp", "parallel.tp_size=2"], marks=FSDP_TP_RUNS),
    ],
    ids=["fsdp", "tp", "fsdp-4", "fsdp+tp"],
)
def test_sharded_muon_takes_the_one_process_steps(muon_reference, tmp_path, nproc, settings):
    """Muon under FSDP2 and TP orthogonalizes each whole update (gathered, then cut back to the shard), so
    the sharded run takes the steps of one process; its momentum stays sharded in the checkpoint."""
    out_dir = _run(tmp_path / "run", nproc, *MUON, *settings)
    _assert_close(_final_weights(out_dir), _final_weights(muon_reference))
    assert _losses(out_dir) == pytest.approx(_losses(muon_reference), rel=1e-4)


DEFAULT_MODEL = ("model.name=localvit_tiny6_convstem_patch8", "data.image_size=16", "train.epochs=1", *MUON)
"""The default recipe's model (convolutional stem with BatchNorm, locality FFN) and optimizer, small data."""
FINAL_OF_ONE_EPOCH = "checkpoints/step-000000006"


def test_the_default_model_and_muon_shard_in_fp32_and_bf16_o2(tmp_path):
    """FSDP over 2 processes against DDP over the same 2: BatchNorm normalizes each process's slice in both
    (no SyncBatchNorm, so one process, normalizing the whole batch, is not the reference), Muon takes
    whole-matrix steps in both. In bf16 O2 (BatchNorm gathered in fp32; before, batch_norm refused its bf16
    weights) the losses stay within bf16's rounding of fp32's."""
    ddp = _run(tmp_path / "ddp", 2, *DEFAULT_MODEL, "precision=fp32")
    fsdp = _run(tmp_path / "fsdp", 2, *DEFAULT_MODEL, "precision=fp32", "parallel.strategy=fsdp")
    assert _losses(fsdp) == pytest.approx(_losses(ddp), rel=1e-4)
    # AdamW's near-zero-gradient tensors (biases) turn reduction-order bits into 1e-4 steps
    _assert_close(read_checkpoint_model(fsdp / FINAL_OF_ONE_EPOCH)[0], _weights_of(ddp), atol=1e-3)
    low = _run(tmp_path / "fsdp-o2", 2, *DEFAULT_MODEL, "precision=bf16", "precision_mode=o2", "parallel.strategy=fsdp")
    assert _losses(low) == pytest.approx(_losses(fsdp), rel=0.03) and _losses(low) != _losses(fsdp)


def _weights_of(out_dir):
    return read_checkpoint_model(out_dir / f"{FINAL_OF_ONE_EPOCH}.pt")[0]
