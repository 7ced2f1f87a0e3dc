"""The doctor on many zoo models at once, to find false alarms on code it was not written for.

For each timm / torchvision model (random weights, nothing downloaded): its BatchNorms' running
statistics are fitted to 64 images (as a trained model's fit its data, tests/doctor/test_doctor_zoo.py's
``calibrate``), then

* ``eval``: the doctor on 16 other images in evaluation mode -- a healthy configuration: any warning or
  error is a false alarm to explain;
* ``train@2``: the doctor in training mode at batch 2 -- bn-elements should name the small-batch BatchNorms,
  and nothing but BatchNorm-type layers may mix the batch (a batch-invariance warning is a false alarm);
* ``watch`` (with ``--watch``): ``normscope.watch(every=2)`` over 6 SGD steps at batch 8 (``--lr``, 1e-3: a
  calibrated, slowly trained model) -- a healthy run: any warning or error but bn-elements (true at 8 images of
  64 pixels) is a false alarm to explain. At lr 1e-2 the runs are no longer healthy everywhere: MNASNet's first
  BatchNorm input's variance grows some 270x in 6 steps while its running statistics (torchvision's momentum
  3e-4) stay where they were -- the watch's train-eval-drift warning is then the truth.

For each transformers text model (a tiny random configuration, a padded batch, left-padded for decoders): the
doctor in eval and in training, and the watch over 6 AdamW steps: any warning or error is a false alarm; the
norms called Post-LN are listed for reading.

Usage (from the repository root; timm and torchvision in build/zoo as .ci/run installs them)::

    PYTHONPATH=src python3 scripts/doctor_zoo_sweep.py --out benchmarks/results/doctor_zoo_sweep.json
    PYTHONPATH=src python3 scripts/doctor_zoo_sweep.py --timm resnet18,levit_128s --torchvision '' --watch

Prints one line per model as it goes; the JSON holds every non-information finding.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "doctor"), str(ROOT / "tests" / "integrations")]

from test_doctor_zoo import _images, calibrate, diagnose  # noqa: E402
from test_zoo_setup import zoo_import  # noqa: E402

import normscope  # noqa: E402

TIMM = (
    "resnet18,efficientnet_b0,regnety_002,mobilenetv3_small_050,resnest14d,densenet121,dla34,ghostnet_050,"
    "cspresnet50,mixnet_s,lcnet_050,repvgg_a0,levit_128s,poolformer_s12,mobilevit_xxs,edgenext_xx_small,"
    "fastvit_t8,efficientformer_l1,nf_resnet26,hrnet_w18_small,dpn68,convmixer_768_32,coatnet_nano_rw_224,"
    "tf_efficientnet_b0,rexnet_100,tinynet_e,vgg11_bn,xception41,cait_xxs24_224,eva02_tiny_patch14_224,"
    "deit_tiny_patch16_224,gcvit_xxtiny,mobilenetv4_conv_small,efficientvit_b0,inception_v3,regnetz_b16,"
    "convnext_atto"
)
TORCHVISION = (
    "mobilenet_v2,shufflenet_v2_x0_5,densenet121,regnet_y_400mf,efficientnet_b0,convnext_tiny,mnasnet0_5,"
    "googlenet,resnext50_32x4d,mobilenet_v3_small,efficientnet_v2_s,squeezenet1_0,inception_v3,vgg11_bn,maxvit_t,"
    "regnet_x_400mf,wide_resnet50_2,vit_b_32,swin_t"
)


def _lines(report) -> list[str]:
    return [f"{f.severity} {f.check} {f.module}: {f.reason}" for f in report.findings if f.severity != "info"]


def _size(model) -> int:
    """64 pixels where the model takes them, else its own input size (ViTs, LeViT, Inception)."""
    try:
        with torch.no_grad():
            model.eval()(_images(2, 64))
        return 64
    except (RuntimeError, AssertionError, ValueError):
        cfg = getattr(model, "pretrained_cfg", None) or {}
        return int(cfg.get("input_size", (3, 299 if type(model).__name__ == "Inception3" else 224))[-1])


def _watch(model, size: int, lr: float) -> list[str]:
    """What the watch reports beyond bn-elements (8 images of 64 pixels leave a few values per statistic in
    the last stages: true, and the one-batch test's business)."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with normscope.watch(model.train(), every=2) as w:
        for step in range(6):
            out = model(_images(8, size, seed=10 + step))
            logits = out if isinstance(out, torch.Tensor) else out[0]
            loss = torch.nn.functional.cross_entropy(logits, torch.arange(8) % logits.shape[-1])
            loss.backward()
            opt.step()
            opt.zero_grad()
    return [x for x in _lines(w.report()) if " bn-elements " not in x]


def sweep(zoo: str, names: list[str], watch: bool, lr: float = 1e-3) -> list[dict]:
    lib = zoo_import(zoo)
    rows = []
    for name in names:
        t = time.perf_counter()
        row = {"zoo": zoo, "model": name}
        try:
            torch.manual_seed(0)
            model = (
                lib.create_model(name, num_classes=10) if zoo == "timm" else getattr(lib.models, name)(num_classes=10)
            )
            size = _size(model)
            calibrate(model, _images(64, size))
            row["size"] = size
            row["eval"] = _lines(diagnose(model.eval(), _images(16, size, seed=2)))
            train = _lines(diagnose(model.train(), _images(2, size, seed=1)))
            # the small-batch findings are expected (bn-elements): counted per check and severity, not listed
            row["train@2"] = dict(sorted(Counter(" ".join(x.split()[:2]) for x in train).items()))
            row["train@2 batch-invariance"] = [x for x in train if " batch-invariance " in x]
            if watch:
                row["watch"] = _watch(model, size, lr)
        except Exception as e:  # noqa: BLE001 -- a model the sweep cannot build or run is reported, not fatal
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["seconds"] = round(time.perf_counter() - t, 1)
        alarms = len(row.get("eval", [])) + len(row.get("train@2 batch-invariance", [])) + len(row.get("watch", []))
        print(
            f"{zoo:11s} {name:28s} "
            + (
                f"failed: {row['failed']}"
                if "failed" in row
                else f"false alarms {alarms}  (eval {len(row['eval'])}, batch-invariance at 2 "
                f"{len(row['train@2 batch-invariance'])}" + (f", watch {len(row['watch'])}" if watch else "") + ")"
            )
            + f"  {row['seconds']} s",
            flush=True,
        )
        for line in row.get("eval", [])[:5] + row.get("train@2 batch-invariance", [])[:5] + row.get("watch", [])[:5]:
            print("    " + line[:240], flush=True)
        rows.append(row)
    return rows


# transformers text models: random tiny configurations, (config class, model class, keyword arguments, left padding)
_TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=100,
    max_position_embeddings=64,
)
TRANSFORMERS = {
    "gpt2": ("GPT2Config", "GPT2Model", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64), True),
    "opt": ("OPTConfig", "OPTModel", {**_TINY, "intermediate_size": None, "ffn_dim": 64}, True),
    "mistral": ("MistralConfig", "MistralModel", {**_TINY, "num_key_value_heads": 2}, True),
    "phi": ("PhiConfig", "PhiModel", _TINY, True),
    "phi3": ("Phi3Config", "Phi3Model", {**_TINY, "pad_token_id": 0}, True),
    "gemma2": ("Gemma2Config", "Gemma2Model", {**_TINY, "num_key_value_heads": 2, "head_dim": 8}, True),
    "qwen2": ("Qwen2Config", "Qwen2Model", {**_TINY, "num_key_value_heads": 2}, True),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", _TINY, True),
    "falcon": ("FalconConfig", "FalconModel", {**_TINY, "intermediate_size": None}, True),
    "bloom": ("BloomConfig", "BloomModel", dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=100), True),
    "roberta": ("RobertaConfig", "RobertaModel", {**_TINY, "pad_token_id": 1, "max_position_embeddings": 80}, False),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertModel",
        dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=100),
        False,
    ),
    "electra": ("ElectraConfig", "ElectraModel", {**_TINY, "embedding_size": 32}, False),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", _TINY, False),
    "albert": ("AlbertConfig", "AlbertModel", {**_TINY, "embedding_size": 16}, False),
    "mpnet": ("MPNetConfig", "MPNetModel", _TINY, False),
    "modernbert": ("ModernBertConfig", "ModernBertModel", {**_TINY, "pad_token_id": 0}, False),
}


def sweep_transformers(names: list[str], watch: bool, lr: float) -> list[dict]:
    """The text models: padded batches (left padding for decoders), the doctor in eval and in training, and
    (``watch``) 6 AdamW steps on the mean square of the last hidden state."""
    import transformers
    from test_doctor_zoo import _padded_ids

    rows = []
    for name in names:
        t = time.perf_counter()
        row = {"zoo": "transformers", "model": name}
        try:
            cfg_name, model_name, kwargs, left = TRANSFORMERS[name]
            torch.manual_seed(0)
            config = getattr(transformers, cfg_name)(**{k: v for k, v in kwargs.items() if v is not None})
            model = getattr(transformers, model_name)(config)
            ids, mask = _padded_ids(100, [16, 11, 5, 13], 16, left=left)
            evaluated = diagnose(model.eval(), ids, attention_mask=mask)
            row["eval"] = _lines(evaluated)
            row["train"] = _lines(diagnose(model.train(), ids, attention_mask=mask))
            row["post-ln"] = sorted(f.module for f in evaluated.by_check("post-ln"))
            if watch:
                opt = torch.optim.AdamW(model.parameters(), lr=lr)
                with normscope.watch(model.train(), every=2) as w:
                    for step in range(6):
                        ids, mask = _padded_ids(100, [16, 11, 5, 13], 16, left=left, seed=step)
                        model(ids, attention_mask=mask).last_hidden_state.square().mean().backward()
                        opt.step()
                        opt.zero_grad()
                row["watch"] = _lines(w.report())
        except Exception as e:  # noqa: BLE001 -- a model the sweep cannot build or run is reported, not fatal
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["seconds"] = round(time.perf_counter() - t, 1)
        alarms = sum(len(row.get(k, [])) for k in ("eval", "train", "watch"))
        status = row["failed"] if "failed" in row else f"false alarms {alarms}  (post-ln: {len(row['post-ln'])} norms)"
        print(f"transformers {name:27s} {status}  {row['seconds']} s", flush=True)
        for line in (row.get("eval", []) + row.get("train", []) + row.get("watch", []))[:5]:
            print("    " + line[:240], flush=True)
        rows.append(row)
    return rows


def _machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timm", default=TIMM, help="comma-separated timm model names ('' for none)")
    p.add_argument("--torchvision", default=TORCHVISION, help="comma-separated torchvision model names")
    p.add_argument("--transformers", default=",".join(TRANSFORMERS), help="comma-separated tiny text models")
    p.add_argument("--watch", action="store_true", help="also 6 watched training steps per model")
    p.add_argument("--lr", type=float, default=1e-3, help="the watched runs' SGD learning rate (momentum 0.9)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the results as JSON")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    for zoo, names in (("timm", a.timm), ("torchvision", a.torchvision)):
        if names:
            rows += sweep(zoo, [n for n in names.split(",") if n], a.watch, a.lr)
    if a.transformers:
        rows += sweep_transformers([n for n in a.transformers.split(",") if n], a.watch, a.lr)
    alarms = sum(sum(len(r.get(k, [])) for k in ("eval", "train@2 batch-invariance", "train", "watch")) for r in rows)
    print(f"{len(rows)} models, {sum('failed' in r for r in rows)} failed to run, {alarms} false alarms")
    if a.out:
        a.out.write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "machine": _machine(),
                    "torch": torch.__version__,
                    "normscope": normscope.__version__,
                    "watch_lr": a.lr if a.watch else None,
                    "models": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if alarms else 0


if __name__ == "__main__":
    sys.exit(main())
