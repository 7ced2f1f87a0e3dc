"""The training frameworks' DoctorCallback: a real ``transformers.Trainer`` run and a real Lightning
``Trainer.fit`` of a tiny model on CPU. With the callback the run ends with the same weights, bit for bit,
as without it (the run without is the reference); the report lands in the run's directory; the findings
reach the framework's logs; ``stop_on="non-finite"`` stops the run in the step where a planted inf first
reaches a norm (the step computed here from where it was planted)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn


class Bomb(nn.Module):
    """inf at one training forward (counted from 0)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.count = at, 0

    def forward(self, x):
        if self.training:
            self.count += 1
            if self.count - 1 == self.at:
                return x * float("inf")
        return x


class TinyLM(nn.Module):
    """A Pre-LN block over embeddings, returning what the Trainer reads: ``{"loss", "logits"}``."""

    def __init__(self, bomb_at: int = -1) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.bomb = Bomb(bomb_at)
        self.ln1, self.fc, self.ln2 = nn.LayerNorm(16), nn.Linear(16, 16), nn.LayerNorm(16)
        self.out = nn.Linear(16, 50)

    def forward(self, input_ids, labels=None):
        h = self.bomb(self.emb(input_ids))
        h = h + self.fc(self.ln1(h))
        logits = self.out(self.ln2(h))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


@pytest.fixture
def hf_log(caplog):
    """The records of the ``transformers.normscope`` logger: transformers' own loggers do not propagate to the
    root logger, where pytest listens, so the handler goes on the logger itself."""
    logger = logging.getLogger("transformers.normscope")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.INFO)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.setLevel(old)
    logger.removeHandler(caplog.handler)


def _lm_data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 50, (8,), generator=g), "labels": torch.randint(0, 50, (8,), generator=g)}
            for _ in range(48)]  # fmt: skip


# ---------------------------------------------------------------------------------------- transformers


def _hf_run(tmp_path, callbacks, bomb_at=-1, max_steps=6, accumulation=1):
    transformers = pytest.importorskip("transformers", reason="the integrations extra is not installed")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the integrations extra)")
    torch.manual_seed(0)
    model = TinyLM(bomb_at)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation,
        logging_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_data(), callbacks=callbacks)
    trainer.train()
    return trainer, model


def test_the_trainer_callback_changes_no_bit_and_writes_and_logs_the_report(tmp_path, hf_log):
    from normscope.integrations.transformers import DoctorCallback

    _, plain = _hf_run(tmp_path / "plain", [])
    callback = DoctorCallback(every=2)
    trainer, watched = _hf_run(tmp_path / "watched", [callback], accumulation=2)
    _, plain2 = _hf_run(tmp_path / "plain2", [], accumulation=2)
    for a, b in zip(plain2.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), plain2.state_dict().values()))
    doc = json.loads((tmp_path / "watched" / "normscope-watch.json").read_text())
    assert doc["schema"] == "normscope.doctor/1" and "non-finite" in doc["checks"]
    assert (tmp_path / "watched" / "normscope-watch.html").read_text().startswith("<!doctype html>")
    assert callback.report_path == tmp_path / "watched" / "normscope-watch.json"
    # the optimizer steps are the steps: 0, 2, 4 watched, two forwards each (accumulation), the first recorded
    assert sorted({r["step"] for r in callback.watch.history}) == [0, 2, 4]
    assert all("normscope/errors" in h for h in trainer.state.log_history if "loss" in h)
    logged = [r.getMessage() for r in hf_log.records if r.name == "transformers.normscope"]
    assert any("the report is in" in line for line in logged)


def test_the_trainer_stops_in_the_step_a_planted_inf_reaches_a_norm(tmp_path, hf_log):
    from normscope.integrations.transformers import DoctorCallback

    callback = DoctorCallback(every=5, stop_on="non-finite")
    trainer, _ = _hf_run(tmp_path, [callback], bomb_at=3, max_steps=10)
    # one forward per optimizer step: the inf is made in step 3, which then ends and training stops
    assert trainer.state.global_step == 4
    (f,) = [
        f for f in json.loads((tmp_path / "normscope-watch.json").read_text())["findings"] if f["check"] == "non-finite"
    ]
    assert (f["module"], f["measured"]["step"], f["measured"]["where"]) == ("ln1", 3, "input")
    assert any("stopping training" in r.getMessage() for r in hf_log.records)


def test_the_trainer_callbacks_options_are_checked():
    from normscope.integrations.transformers import DoctorCallback

    with pytest.raises(ValueError, match="`stop_on`"):
        DoctorCallback(stop_on="nan")
    with pytest.raises(ValueError, match="`every`"):
        DoctorCallback(every=0)
    with pytest.raises(ValueError, match="`filename`"):
        DoctorCallback(filename="a/b.json")
    assert DoctorCallback().on_prediction_step(None, None, None) is None  # events it does not use


# ---------------------------------------------------------------------------------------- Lightning


def _lightning_run(tmp_path, callbacks, bomb_at=-1, max_steps=6):
    L = pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    from lightning.pytorch.loggers import CSVLogger

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(3, 8, 3), Bomb(bomb_at), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 2)
            )

        def training_step(self, batch, i):  # calls a submodule: the module's own forward never runs
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 3, 8, 8, generator=g), torch.randint(0, 2, (96,), generator=g)
    )
    module = Module()
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=CSVLogger(str(tmp_path)),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        log_every_n_steps=1,
        deterministic=True,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer, module


def test_the_lightning_callback_changes_no_bit_and_logs_and_writes_the_report(tmp_path, caplog):
    pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    from normscope.integrations.lightning import DoctorCallback

    _, plain = _lightning_run(tmp_path / "plain", [])
    callback = DoctorCallback(every=2)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.normscope"):
        trainer, watched = _lightning_run(tmp_path / "watched", [callback])
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    doc = json.loads(callback.report_path.read_text())
    assert callback.report_path.parent == __import__("pathlib").Path(trainer.log_dir)
    assert doc["schema"] == "normscope.doctor/1" and doc["summary"]["warning"] >= 1  # bn-elements: 8 x 36 values
    assert sorted({r["step"] for r in callback.watch.history}) == [0, 2, 4]
    metrics = (callback.report_path.parent / "metrics.csv").read_text().splitlines()
    assert "normscope/warnings" in metrics[0]
    assert any("bn-elements" in r.getMessage() for r in caplog.records)


def test_lightning_stops_in_the_step_a_planted_inf_reaches_a_norm(tmp_path):
    pytest.importorskip("lightning.pytorch", reason="the lightning extra is not installed")
    from normscope.integrations.lightning import DoctorCallback

    callback = DoctorCallback(every=5, stop_on="non-finite")
    trainer, _ = _lightning_run(tmp_path, [callback], bomb_at=2, max_steps=10)
    assert trainer.global_step == 3
    (f,) = [f for f in json.loads(callback.report_path.read_text())["findings"] if f["check"] == "non-finite"]
    assert (f["module"], f["measured"]["step"], f["measured"]["where"]) == ("net.2", 2, "input")


def test_without_lightning_the_callback_says_what_to_install():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['lightning.pytorch'] = None\n"
        "from normscope.integrations.lightning import DoctorCallback\n"
        "assert DoctorCallback.__doc__\n"
        "try:\n    DoctorCallback()\nexcept ImportError as e:\n    print(e)\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src})
    assert "pip install normscope[lightning]" in out.stdout, out.stderr
