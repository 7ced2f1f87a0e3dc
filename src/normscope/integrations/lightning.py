"""The doctor during a Lightning ``Trainer.fit``: :class:`DoctorCallback`, a thin wrapper over
:func:`normscope.watch` (``pip install normscope[lightning]``).

Lightning is imported with this module: without it the class is still here, documented, and says what to
install when it is built.
"""

from __future__ import annotations

import logging
from typing import Any

from ._callback import Watcher, check_options

try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # the extra is not installed: DoctorCallback says so when it is built
    _Callback = object
    _MISSING = "normscope.integrations.lightning.DoctorCallback needs Lightning: pip install normscope[lightning]"
else:
    _MISSING = None

__all__ = ["DoctorCallback"]


class DoctorCallback(_Callback):
    """A Lightning callback that watches the LightningModule's norms during ``Trainer.fit``.

    :func:`normscope.watch` on the module, counted in the Trainer's optimizer steps
    (``trainer.global_step``: the batches of ``accumulate_grad_batches`` belong to one step) -- the
    module's own ``forward`` need not be called, ``training_step`` may call its submodules. Each finding
    is logged once on Lightning's logger (``lightning.pytorch.normscope``), and the counts per severity
    go to the Trainer's loggers with ``LightningModule.log`` (``normscope/errors``, ``normscope/warnings``,
    ``normscope/infos``, ``normscope/non_finite_step`` once an inf/NaN was seen) every ``every`` steps.
    At the end of training the report is written to ``trainer.log_dir`` (or ``dirpath``), by the global
    rank 0. With ``stop_on="non-finite"`` training stops after the batch in which a norm first saw inf
    or NaN.

    Args:
        every: record the norms' statistics every ``every`` optimizer steps. Default: 50.
        stop_on: None, or ``"non-finite"``. Default: None.
        checks: the checks to run, as :func:`normscope.watch` takes them. Default: all.
        filename: the report's file name, None for none. Default: ``"normscope-watch.json"``.
        dirpath: where to write it. Default: the Trainer's ``log_dir``, else its ``default_root_dir``.

    With a LightningModule ``module`` and a DataLoader ``loader`` of your own::

        from normscope.integrations.lightning import DoctorCallback

        trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[DoctorCallback(stop_on="non-finite")])
        trainer.fit(module, loader)
    """

    def __init__(
        self,
        every: int = 50,
        *,
        stop_on: str | None = None,
        checks: list[str] | None = None,
        filename: str | None = "normscope-watch.json",
        dirpath: str | None = None,
    ) -> None:
        if _MISSING is not None:
            raise ImportError(_MISSING)
        check_options("DoctorCallback", every, stop_on, filename)
        super().__init__()
        self.filename = filename
        self.dirpath = dirpath
        self.report_path = None
        self._watcher = Watcher(
            "DoctorCallback", every, checks, stop_on, logging.getLogger("lightning.pytorch.normscope")
        )

    @property
    def watch(self):
        """The :class:`normscope.doctor.Watch` of the current (or last) run, None before one."""
        return self._watcher.watch

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._watcher.start(pl_module, trainer.global_step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._watcher.step(trainer.global_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._watcher.watch is not None:  # the first watched step's checks, before the weights change
            self._watcher.watch._forward_done()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._watcher.should_stop():
            trainer.should_stop = True
        watch = self._watcher.watch
        if watch is not None and watch.current_step is not None and watch.current_step % self._watcher.every == 0:
            figures = self._watcher.log()
            if figures and trainer.loggers:
                pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        directory = self.dirpath or getattr(trainer, "log_dir", None) or trainer.default_root_dir
        self.report_path = self._watcher.finish(directory, self.filename, bool(trainer.is_global_zero))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._watcher.watch is not None:  # the hooks come off the model whatever stopped the run
            self._watcher.watch.close()
