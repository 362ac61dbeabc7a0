"""The Weights & Biases mirror (`--config.logging.wandb_project`), in W&B's offline mode: a tiny training run's W&B
run folder (local files, no network) holds its metrics step for step equal to metrics.jsonl, its config and its
artefact paths. The folder's transaction log is read back record by record (its format below)."""

import json
import struct

import pytest


WANDB_BLOCK = 32768  # the .wandb file: a ":W&B" header, then LevelDB-log blocks of length-prefixed records


def wandb_records(path):
    """The protobuf Records of a .wandb transaction log (header ':W&B' magic version, then 32 KiB blocks of
    records: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4, payload)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def test_loggable_keeps_finite_numbers_and_booleans():
    from jaxrl.train.wandb_log import loggable
    assert loggable({"step": 3, "loss": 0.5, "tokens": 7, "loss_finite": True, "nonfinite_reason": "x",
                     "nonfinite_groups": [], "grad_norm": None, "bad": float("nan")}) == {
        "loss": 0.5, "tokens": 7, "loss_finite": 1}


@pytest.mark.slow
def test_offline_wandb_run_holds_the_metrics_of_a_tiny_run_step_for_step(tmp_path, monkeypatch):
    from jaxrl.algorithms.run import run_training
    from jaxrl.train.metrics import read_metrics
    from jaxrl.train.wandb_log import RUN_ID_FILE, loggable

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))  # no settings file in the user's home
    from configs import sft_tiny
    cfg = sft_tiny.get_config()
    cfg.tensorboard, cfg.checkpoint_async = False, False
    cfg.compile_options = {"xla_backend_optimization_level": 0}
    cfg.steps, cfg.checkpoint_every = 3, 2
    cfg.logging.wandb_project = "jaxrl-test"
    cfg.logging.wandb_mode = "offline"
    cfg.logging.wandb_tags = ("tiny",)
    workdir = tmp_path / "run"
    run_training(cfg, str(workdir))

    lines = read_metrics(str(workdir))
    want: dict = {}
    for line in lines:  # a checkpoint's extra line logs at its step too
        want.setdefault(line["step"], {}).update(loggable(line))
    assert sorted(want) == [1, 2, 3]

    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    folders = list((workdir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 1
    got, config = {}, {}
    for record in wandb_records(folders[0] / f"run-{run_id}.wandb"):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            got[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    assert got == want  # every step, every number, exactly
    assert config["lora"]["rank"] == cfg.lora.rank and config["steps"] == 3 and config["logging"]["wandb_tags"] == [
        "tiny"]
    paths = config["paths"]
    assert paths["metrics"] == str(workdir / "metrics.jsonl") and paths["config"] == str(workdir / "config.json")
    assert paths["checkpoints"] == str(workdir / "checkpoints")
