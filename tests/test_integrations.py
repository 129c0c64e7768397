"""The training-framework callbacks, in real (tiny) Hugging Face Trainer and Lightning runs.

The FLOPs each run logs are compared with an independent count: ``FlopCounterMode`` around one real
forward + ``loss.backward()`` of an identical model on a batch of the same shape, times the
microbatches per optimizer step. No framework is mocked.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import fxflops
from reference import flop_counter_with_cpu_attention

PEAK = 1e12  # a made-up peak: a CPU has none in the table, and MFU needs one
PREFIX = "fxflops/"


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return a == pytest.approx(b, rel=rel)


def test_importing_integrations_imports_no_framework():
    code = (
        "import sys, fxflops, fxflops.integrations; "
        "frameworks = ('transformers', 'pytorch_lightning', 'lightning', 'lightning_fabric'); "
        "bad = [m for m in frameworks if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- Hugging Face Trainer ----------------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    """Fixed-length random token sequences, labels = inputs (the model shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_hf_trainer_logs_exact_flops_and_mfu(tmp_path):
    """Three optimizer steps, a log each, evaluation before training and after steps 2 and 3.

    Reference: FlopCounterMode around ``model(input_ids, labels).loss.backward()`` of a copy of the
    model on a (2, 24) batch, eager attention (the QKᵀ and P·V products are ``matmul``s FlopCounterMode
    sees; the rotary ``inv_freq @ positions`` product is counted by both). The loss' cross-entropy and
    its backward are not matrix products, under either count. Evaluation forwards go through the same
    wrapper under ``no_grad``: the sum matching the reference shows the callback kept them out.
    """
    import transformers  # from the test extra
    from fxflops.integrations.hf_trainer import FlopsCallback

    batch, seq, vocab = 2, 24, 128
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    assert model.config._attn_implementation == "eager"
    reference = copy.deepcopy(model).train()
    ids = torch.randint(0, vocab, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        reference(input_ids=ids, labels=ids).loss.backward()
    per_step = counter.get_total_flops()
    assert per_step > 0

    class Recorder(transformers.TrainerCallback):
        """Stands for a reporting integration: placed before FlopsCallback in the Trainer's list."""

        def __init__(self) -> None:
            self.logs: list[tuple[dict, float, object]] = []
            self.began = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append((dict(logs), time.perf_counter(), flops.last_report))

    wrapper = fxflops.instrument(model, backward=True)  # zero-config: every input dim a symbol
    recorder, flops = Recorder(), FlopsCallback(wrapper, peak_flops=PEAK)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=batch, per_device_eval_batch_size=4,
        logging_steps=1, eval_strategy="steps", eval_steps=2, eval_on_start=True, report_to=[], use_cpu=True,
        save_strategy="no",  # default remove_unused_columns: the wrapper's forward has the model's signature
        label_names=["labels"],  # the Trainer looks for labels on the model *class*'s forward
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=wrapper, args=args, train_dataset=TokenDataset(16, seq, vocab, 1),
        eval_dataset=TokenDataset(4, seq, vocab, 2), callbacks=[recorder, flops],
    )
    flops.attach(trainer)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert names.index("FlopsCallback") < names.index("Recorder")
    trainer.train()

    assert sum("eval_loss" in logs for logs, _, _ in recorder.logs) == 3  # evaluation really ran
    train_logs = [(logs, t, r) for logs, t, r in recorder.logs if "loss" in logs]
    assert len(train_logs) == 3
    assert all(PREFIX + "model_flops_per_step" not in logs for logs, _, _ in recorder.logs if "loss" not in logs)
    assert sum(logs[PREFIX + "model_flops_per_step"] for logs, _, _ in train_logs) == 3 * per_step
    # evaluation (eval mode, no grad) and training (train mode, grad) are two situations: two programs
    assert wrapper.captures == 2 and flops.last_report.uncounted == 0
    assert {p.backward for p in wrapper.programs} == {"none", "traced"}

    for logs, _, report in train_logs:
        assert logs[PREFIX + "model_flops_per_step"] == per_step
        assert logs[PREFIX + "fwd_flops_per_step"] + logs[PREFIX + "bwd_flops_per_step"] == per_step
        assert logs[PREFIX + "flops_per_step"] == per_step  # no recompute
        # MFU from the logged numbers: model FLOPs / elapsed / peak, one step per log
        assert report.steps == 1 and report.elapsed_s > 0
        assert _close(logs[PREFIX + "tflops_per_gpu"], per_step / report.elapsed_s / 1e12)
        assert _close(logs[PREFIX + "mfu"], per_step / report.elapsed_s / PEAK)
        assert _close(logs[PREFIX + "hfu"], logs[PREFIX + "mfu"])
    # the intervals are wall time between logs (the first from train begin), evaluation time left out
    def evaluating_before(at: float) -> float:
        return sum(logs["eval_runtime"] for logs, t, _ in recorder.logs if "eval_runtime" in logs and t < at)

    first_elapsed, first_logged_at = train_logs[0][2].elapsed_s, train_logs[0][1]
    assert evaluating_before(first_logged_at) > 0  # eval_on_start
    first_training = first_logged_at - recorder.began - evaluating_before(first_logged_at)
    assert first_elapsed <= first_training + 1e-3
    assert first_elapsed == pytest.approx(first_training, rel=0.1, abs=0.02)
    wall = train_logs[-1][1] - recorder.began
    assert sum(r.elapsed_s for _, _, r in train_logs) <= wall - evaluating_before(train_logs[-1][1]) + 1e-3
    # the Trainer's own history (copied before the callbacks ran) was patched too
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry[PREFIX + "model_flops_per_step"] for entry in history] == [per_step] * 3


# --- PyTorch Lightning -------------------------------------------------------------------------------


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*")
def test_lightning_logs_exact_flops_per_optimizer_step_and_throughput():
    """Three optimizer steps of two accumulated microbatches each, a report every step, validation
    (sanity check and every 2 batches) through the same wrapper.

    Reference: FlopCounterMode around ``loss.backward()`` of one real forward of a TinyGPT copy on a
    (2, 12) batch, times 2 microbatches. TinyGPT's SDPA runs the CPU flash kernel, which
    FlopCounterMode counts as 0; for the reference run, torch's own ``sdpa_flop_count`` /
    ``sdpa_backward_flop_count`` are registered for those kernels (``flop_counter_with_cpu_attention``),
    i.e. the fused backward costs 2.5x the forward (dQ, dK, dV, dP and the recomputed scores), which is
    what the kernel does and what fxflops counts from the traced backward op. Running the reference on
    the MATH backend counts its backward as 2x (4 bmm, the scores kept from the forward): the model
    FLOPs, which leave the recomputed scores out as MFU leaves out any recompute.
    """
    import pytorch_lightning as pl  # from the test extra
    from pytorch_lightning.loggers import Logger

    from fxflops.integrations.lightning import FlopsCallback
    from fxflops.models.tiny_gpt import GPTConfig, TinyGPT

    batch, seq, accumulate = 2, 12, 2
    cfg = GPTConfig(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2)
    torch.manual_seed(0)
    reference = TinyGPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, seq))
    with flop_counter_with_cpu_attention(), FlopCounterMode(display=False) as counter:
        _lm_loss(reference(ids), ids).backward()
    per_step = accumulate * counter.get_total_flops()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _lm_loss(reference(ids), ids).backward()
    model_per_step = accumulate * counter.get_total_flops()  # the backward's recomputed Q·Kᵀ left out

    class MemoryLogger(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            self.calls.append((step, dict(metrics)))

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = fxflops.instrument(TinyGPT(cfg), backward=True)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return _lm_loss(self.model(ids), ids)

        def validation_step(self, batch, batch_idx):
            (ids,) = batch
            self.log("val_loss", _lm_loss(self.model(ids), ids))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    tokens = torch.randint(0, cfg.vocab, (16, seq), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=batch)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:8]), batch_size=4)
    lit, logger = LitGPT(), MemoryLogger()
    flops = FlopsCallback(log_every_n_steps=1, peak_flops=PEAK)  # finds lit.model, the wrapper, at setup
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", devices=1, logger=logger, callbacks=[flops],
        accumulate_grad_batches=accumulate, log_every_n_steps=1, val_check_interval=2, limit_val_batches=1,
        num_sanity_val_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(lit, loader, val_loader)

    assert any("val_loss" in metrics for _, metrics in logger.calls)  # validation really ran
    assert flops.meter is lit.model.flops
    logged = [(step, m) for step, m in logger.calls if PREFIX + "model_flops_per_step" in m]
    assert [step for step, _ in logged] == [0, 1, 2]
    assert lit.model.captures == 2 and flops.last_report.uncounted == 0  # validation: its own situation
    assert sum(m[PREFIX + "model_flops_per_step"] for _, m in logged) == 3 * model_per_step

    previous_time = 0.0
    for k, (_, m) in enumerate(logged, start=1):
        assert m[PREFIX + "model_flops_per_step"] == model_per_step  # exact: logged as float64
        assert m[PREFIX + "flops_per_step"] == per_step
        assert _close(m[PREFIX + "mfu"], m[PREFIX + "tflops_per_gpu"] * 1e12 / PEAK)
        # Lightning's Throughput, fed the exact FLOPs at each report
        t = PREFIX + "throughput/"
        assert m[t + "batches"] == accumulate * k
        assert m[t + "samples"] == accumulate * batch * k
        assert m[t + "time"] > previous_time
        interval = m[t + "time"] - previous_time
        previous_time = m[t + "time"]
        assert _close(m[t + "device/flops_per_sec"], model_per_step / interval, rel=1e-6)
        assert _close(m[t + "device/flops_per_sec"], m[PREFIX + "tflops_per_gpu"] * 1e12, rel=1e-6)
        assert _close(m[t + "device/mfu"], m[PREFIX + "mfu"], rel=1e-6)
        assert _close(m[t + "device/batches_per_sec"], accumulate / interval, rel=1e-6)
        assert _close(m[t + "device/samples_per_sec"], accumulate * batch / interval, rel=1e-6)


class _AdapterWrapper(torch.nn.Module):
    """A PEFT-style model: its forward passes everything to the model it wraps (``get_base_model``)."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def get_base_model(self) -> torch.nn.Module:
        return self.base_model

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_the_wrapper_of_a_model_forwarding_everything_shows_its_base_models_signature():
    """The HF Trainer keeps the dataset columns named by the forward's parameters, reading a PEFT
    model's base model for them: the wrapper of such a model shows the base model's signature (was
    ``(*args, **kwargs)``: every column dropped, a KeyError in the collator) and counts exactly."""
    import inspect

    from fxflops.models.tiny_gpt import TinyGPT
    from reference import flop_counter_call

    base = TinyGPT()
    model = _AdapterWrapper(base)
    wrapper = fxflops.instrument(model)
    assert list(inspect.signature(wrapper.forward).parameters) == list(inspect.signature(base.forward).parameters)
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        wrapper(ids)
        assert wrapper.flops.total() == flop_counter_call(base, (ids,), {}, backward=False)
