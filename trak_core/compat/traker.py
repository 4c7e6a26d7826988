"""A drop-in for traker 0.3.2's ``TRAKer``: same constructor arguments and methods, our store and math. A
stateful adapter over :mod:`trak_core.engine` (the steps the pipeline runs too): it keeps the current model and
experiment, and the rows of consecutive batches until a chunk is complete.

Differences from traker 0.3.2, on purpose:

* the store is one Zarr group (``save_dir`` may be a path or an fsspec URL), validated on reopen; a TRAKer holds
  the store's run lock while it lives (another process's TRAKer or pipeline run on it is refused), and refuses
  settings that cannot fit in memory before creating anything;
* each model_id records the fingerprint of the state_dict it was featurized from: loading another checkpoint
  for it is refused (traker reuses the old features silently), unless ``load_from_save_dir=False``;
* XᵀX is accumulated in float64 and inverted in float64 (traker: in the storage dtype / float32);
* singular or badly conditioned XᵀX warns with the condition estimate and the remedy;
* bad input raises a clear exception before anything is written (traker asserts or logs and goes on); where
  traker asserted, the exception is also an ``AssertionError`` carrying traker's message. Batches and checkpoints
  pass the pipeline's input rules (:mod:`trak_core.rules`, the same messages): NaN/inf rows, dtypes, labels;
  ``load_checkpoint`` refuses a state_dict with NaN or inf;
* ``saver=`` / ``score_computer=``: traker's defaults (``MmapSaver``, ``BasicScoreComputer``) are accepted,
  ``BasicSingleBlockScoreComputer`` means the plain inverse, other classes are refused;
* the default projector is the factored per-layer projection (featurize + finalize 28× traker's fastest CPU
  configuration on a 400k-parameter MLP, within 0.02 LDS of dense on 9 evaluation cases; dense Rademacher for
  models it cannot factor); the matrices come
  from a counter-based RNG, the same on CPU and GPU. Pass ``projector=`` to choose another;
* no features are stored: ``finalize_features`` computes and stores the inverse A = (XᵀX + λI)⁻¹ (p × p) and
  ``finalize_scores`` multiplies the stored gradients X by A Gᵀ (the same scores as traker's Φ Gᵀ with Φ = X A,
  without rounding Φ to the store's dtype); :meth:`TRAKer.features` computes Φ for the rows a caller asks for,
  and ``del_grads=True`` is ignored with a warning (the gradients are what scoring reads);
* the default damping is ``lambda_reg="adaptive"`` (traker: 0.0, which leaves XᵀX singular when proj_dim ≥ n
  and scores near LDS 0 on held-out cases at proj_dim 2048); ``lambda_reg=0.0`` reproduces traker where proj_dim < n
  (proj_dim ≥ n with it is refused, as the pipeline refuses it: traker's scores would be noise).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import warnings
import weakref
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor

from trak_core import engine
from trak_core.featurize.gradients import AbstractGradientComputer, FunctionalGradientComputer, grad_dim_of
from trak_core.featurize.modelout import AbstractModelOutput, resolve_task
from trak_core.projection.projectors import (
    AbstractProjector,
    DenseProjector,
    NoOpProjector,
    ProjectionType,
    make_projector,
    projector_traits,
)

from ..errors import BadInputError, StateError
from .errors import InputAssertionError, ModelIDException, StateAssertionError
from .savers import check_saver
from .score_computers import score_computer_settings

#: TRAKer's default lambda_reg (traker 0.3.2: 0.0); see parse_lambda_reg and RESULTS.md "Attribution quality"
DEFAULT_LAMBDA_REG = "adaptive"


#: TRAKers alive in this process: rows they hold back are written at exit (weak references only)
_open_trakers: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_open_trakers() -> None:
    for tr in list(_open_trakers):
        tr._close()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def writes_behind(device) -> bool:
    """TRAKer's default ``write_behind`` on ``device``: on a CUDA device the store writes (float16 conversion,
    checksums, files, each shard's partial) run beside the next batches' device arithmetic instead of between them;
    on the CPU the same cores would do both, and each call returns with its rows written."""
    return torch.device(device).type == "cuda"


def check_device(device) -> str:
    """``device`` as a string, refused (BadInputError) when torch cannot use it here, e.g. ``"cuda"`` in a
    process without CUDA, before anything is created."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise BadInputError(f"device={device!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInputError(
                f"device={device!r}: CUDA is not available in this process "
                "(torch.cuda.is_available() is False); use device='cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadInputError(f"device={device!r}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def default_projector(
    model, grad_dim: int, proj_dim: int, seed: int, device, grad_wrt=None, energies: dict | None = None
) -> AbstractProjector:
    """trakflow's default: the factored per-layer projection (benchmarks/RESULTS.md), proj_dim split by
    ``energies`` (:func:`trak_core.projection.energy.sketched_energies`; equally between layers without them); the dense
    Rademacher projection, with a one-line warning, for models it cannot factor."""
    try:
        return make_projector(
            "factored",
            grad_dim,
            proj_dim,
            seed,
            "rademacher",
            device=device,
            model=model,
            grad_wrt=grad_wrt,
            energies=energies,
        )
    except BadInputError as e:
        warnings.warn(f"TRAKer: using the dense projector (the default 'factored' does not apply: {e})", stacklevel=3)
        return DenseProjector(grad_dim, proj_dim, seed, ProjectionType.rademacher, device)


class TRAKer:
    """The front-facing TRAK class (see the module docstring for how it differs from traker 0.3.2).

    ``lambda_reg`` defaults to ``"adaptive"`` (traker: 0.0; pass ``lambda_reg=0.0`` to reproduce traker): λ
    such that the effective dimension of each checkpoint's XᵀX is min(0.1·n, rank/2), chosen by
    leave-one-case-out (benchmarks/RESULTS.md, "Attribution quality"). It may also be a number,
    ``"auto"`` / ``"rel:<f>"`` (damping relative to the mean eigenvalue of XᵀX) or ``"deff:<c>"`` (see
    :func:`trak_core.solve.damping.parse_lambda_reg`). Extra keyword arguments: ``rescale_inverse``
    (traker's division of (XᵀX+λI)⁻¹ by its mean |entry|; default True for parity),
    ``chunk_rows``/``shard_rows`` (store layout; by default a chunk holds at most 32 MiB and 1,024 rows, a
    shard 8 chunks: trak_core.store.choose_chunk_rows), ``storage_options`` (fsspec), ``curvature``: the H of
    (H + λI)⁻¹, ``"xtx"`` (XᵀX, traker's; the default) or ``"ggn"`` (XᵀRX, the Gauss-Newton matrix of the loss in
    the model output, R = diag(Q(1 − Q)) for the built-in tasks, row weights floored at 0.3·mean(r): +0.020 to +0.060
    LDS on converged models at one more p × p partial per shard; benchmarks/RESULTS.md, "Gauss-Newton curvature"),
    ``"kfac"`` / ``"ekfac"`` (Kronecker-factored curvature applied in the projected space: the factors summed over the
    rows :meth:`featurize` is given and recorded by :meth:`finalize_features`, or fitted by :meth:`fit_curvature`,
    needed where another TRAKer featurized some of the rows; ``curvature_damping``: each factor's λ = this × its
    mean eigenvalue; docs/damping.md),
    ``"kfac-eigen"`` (the layers projected in their factors' eigenbasis, EK-FAC's diagonal inverse: call
    :meth:`fit_curvature` after each load_checkpoint and before featurize or score; ``curvature_damping``: each
    such block's λ = this × its rows' mean second moment, default 0.01; trak_core.solve.kfac).
    A store keeps its curvature. ``write_behind``: rows are written by a background thread while the next batches
    are featurized (the GPU then does not wait on the store), so a :meth:`featurize` call returns before its rows
    are in the store and a write's error is raised by a later call; otherwise each call returns with its complete
    chunks written. By default (None) on a CUDA device, not on the CPU (:func:`writes_behind`). Either way rows are
    flagged only once written (a killed process featurizes the rest again). ``max_memory``: a memory budget (bytes
    or a size like ``"4GB"``): each batch is featurized in pieces of the most rows a measured probe fits under it
    (the process's resident memory on the CPU, torch's allocated memory on a GPU), and scoring's buffers take a
    share of what it leaves (:mod:`trak_core.featurize.budget`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        task: AbstractModelOutput | str,
        train_set_size: int,
        save_dir: str = "./trak_results",
        load_from_save_dir: bool = True,
        device: str | torch.device | None = None,
        gradient_computer: type[AbstractGradientComputer] = FunctionalGradientComputer,
        projector: AbstractProjector | None = None,
        saver=None,
        score_computer=None,
        proj_dim: int = 2048,
        logging_level=logging.INFO,
        use_half_precision: bool = True,
        proj_max_batch_size: int = 32,
        projector_seed: int = 0,
        grad_wrt: Iterable[str] | None = None,
        lambda_reg: float | str | None = None,
        *,
        rescale_inverse: bool = True,
        chunk_rows: int | None = None,
        shard_rows: int | None = None,
        storage_options: dict | None = None,
        curvature: str = "xtx",
        curvature_damping: float | None = None,
        write_behind: bool | None = None,
        max_memory: int | str | None = None,
    ) -> None:
        self.logger = logging.getLogger("trakflow")
        self.logger.setLevel(logging_level)
        # traker's defaults (MmapSaver, BasicScoreComputer) are what our store and scoring do; any other
        # saver / score computer is refused with what to use instead (compat.savers, compat.score_computers)
        check_saver(saver)
        if lambda_reg is None:  # the default: adaptive damping; none where the score computer is the plain inverse
            plain = score_computer_settings(score_computer, 0.0).get("rescale_inverse") is False
            lambda_reg = 0.0 if plain else DEFAULT_LAMBDA_REG
        if score_computer_settings(score_computer, lambda_reg).get("rescale_inverse") is False:
            rescale_inverse = False
        if not isinstance(save_dir, (str, os.PathLike)) or not str(save_dir).strip():
            raise BadInputError(f"save_dir must be a non-empty path or URL of the store, got {save_dir!r}")
        if "://" not in str(save_dir):  # a local path: resolved now, so a later os.chdir cannot move the store
            save_dir = os.path.abspath(save_dir)
        if not isinstance(train_set_size, (int, np.integer)) or train_set_size <= 0:
            raise BadInputError(f"train_set_size must be a positive integer, got {train_set_size!r}")
        engine.check_solve_settings(lambda_reg, curvature)
        if curvature_damping is None:  # the curvature's own default
            curvature_damping = engine.default_damping(curvature)
        self.curvature_damping = engine.check_damping(curvature_damping)
        self.curvature = curvature
        self._fitted: dict[int, engine.KroneckerFactors] = {}  # K-FAC factors fitted before the store exists
        # "kfac" / "ekfac" without fit_curvature: each model's factor sums over the rows this instance featurizes
        # (None: the store records the model's factors)
        self._folds: dict[int, engine.FactorFold | None] = {}
        self.model = model
        self.task = resolve_task(task)
        self.train_set_size = int(train_set_size)
        self.device = check_device(device) if device is not None else default_device()
        self.max_memory = engine.check_budget(max_memory, self.device)
        self.dtype = torch.float16 if use_half_precision else torch.float32
        self.grad_wrt = list(grad_wrt) if grad_wrt is not None else None
        self.lambda_reg = lambda_reg if isinstance(lambda_reg, str) else float(lambda_reg)
        self.rescale_inverse = rescale_inverse
        self.num_params = sum(p.numel() for p in model.parameters())
        self.num_params_for_grad = grad_dim_of(model, self.grad_wrt)
        self.proj_seed = projector_seed

        # the default projector on a new store: its proj_dim split follows the gradient energy of the first
        # min(PROBE_ROWS, train_set_size) rows featurized, whatever the batches (engine.ProbeRows holds them), so it
        # (and the store, whose metadata records it) is built once they are here; until then a stand-in with the
        # same sizes (the equal split) serves the checks below
        self._deferred = False
        self._probe = engine.ProbeRows(int(train_set_size))
        self._probe_chunk = int(proj_max_batch_size)
        if projector is None:
            if not isinstance(proj_dim, int) or isinstance(proj_dim, bool) or proj_dim <= 0:
                raise BadInputError(f"proj_dim must be a positive integer, got {proj_dim!r}")
            exists, split = engine.stored_split(str(save_dir), storage_options)
            if split is not None:  # a store of the default projector: its own split, rebuilt from its metadata
                projector = engine.rebuild_projector(
                    "factored",
                    self.num_params_for_grad,
                    proj_dim,
                    projector_seed,
                    "rademacher",
                    split,
                    model,
                    self.grad_wrt,
                    self.device,
                )
            else:
                projector = default_projector(
                    model, self.num_params_for_grad, proj_dim, projector_seed, self.device, self.grad_wrt
                )
                self._deferred = projector_traits(projector.kind).splits_by_layer and not exists
        elif not hasattr(projector, "spec"):
            raise BadInputError(
                f"TRAKer(projector={type(projector).__name__}): give one projector for the whole "
                "gradient (e.g. CudaProjector or BasicProjector with grad_dim = the number of "
                "parameters); trak_core projects the gradient parameter by parameter on its own, "
                "so ChunkedCudaProjector is not needed"
            )
        elif isinstance(projector, NoOpProjector):
            projector.grad_dim = projector.proj_dim = self.num_params_for_grad
            projector.device = self.device
        if projector.grad_dim != self.num_params_for_grad:
            raise BadInputError(
                f"projector.grad_dim={projector.grad_dim} but the model has "
                f"{self.num_params_for_grad} parameters to take gradients for"
            )
        self.projector: AbstractProjector | None = None if self._deferred else projector
        self.proj_dim = projector.proj_dim
        # the pipeline's rule: proj_dim ≥ n with no damping leaves XᵀX singular (traker returns noise)
        lam_setting = engine.lambda_setting(lambda_reg)
        engine.check_projection(
            projector.kind, self.proj_dim, self.train_set_size, lam_setting, curvature, task=self.task
        )
        self.normalize_factor = torch.sqrt(torch.tensor(self.num_params_for_grad, dtype=torch.float32))

        # the store's metadata of a projector (deferred: of the one the first featurize call builds)
        self._metadata_of = functools.partial(
            engine.store_metadata,
            train_set_size=self.train_set_size,
            dtype="float16" if use_half_precision else "float32",
            task=self.task,
            chunk_rows=chunk_rows,
            shard_rows=shard_rows,
            curvature=curvature,
        )
        self._storage_options = storage_options
        meta = self._metadata_of(projector)
        self.save_dir = str(save_dir)
        self.load_from_save_dir = load_from_save_dir
        self.write_behind = writes_behind(self.device) if write_behind is None else bool(write_behind)
        # nothing is created before the settings are known to fit in memory; then the store's run lock (as the
        # pipeline's runs take it: another process on this save_dir is refused), held while this TRAKer lives
        on_device = torch.device(self.device).type != "cpu"  # see RowSink.partials_while_featurizing
        engine.check_featurize_memory(
            meta,
            model,
            rows_held=proj_max_batch_size + (meta.rows_per_shard if on_device else meta.rows_per_chunk),
            partials=on_device,
            projector=projector.kind,
        )
        self._locked = False
        engine.acquire_store(self.save_dir, run=f"TRAKer (pid {os.getpid()})")
        self._locked = True
        self._store: engine.RunStore | None = None
        # deferred: the store's metadata (None until then) and the model records of load_checkpoint calls
        self.metadata: engine.StoreMetadata | None = None if self._deferred else meta
        self._planned: list[tuple[int, dict, bool]] = []
        try:
            if self._deferred:  # created by the first featurize call: what would refuse it then is refused now
                engine.check_new_store(self.save_dir, storage_options)
            else:
                self._store = engine.open_run(self.save_dir, meta, storage_options)
        except BaseException:
            self._close()
            raise
        self.featurizer = engine.Featurizer(
            model,
            self.task,
            projector,
            gradient_computer,
            self.grad_wrt,
            self.device,
            stored_dtype=self.dtype,
            max_memory=self.max_memory,
        )
        if curvature in engine.FIT_BEFORE_FEATURIZE:
            self._bind_eigen(projector)
        # under a budget, the rows held beside the batches (as check_featurize_memory counts them) and the partial
        held = proj_max_batch_size + (meta.rows_per_shard if on_device else meta.rows_per_chunk)
        self.featurizer.memory_reserve = held * meta.proj_dim * 8 + 2 * meta.proj_dim**2 * 8
        self.gradient_computer = self.featurizer.gradient_computer
        self.ckpt_loaded: int | None = None
        self.current_model_id: int | None = None
        self.current_experiment_name: str | None = None
        self._last_ind = 0
        self._last_ind_target = 0
        self.scores: np.ndarray | None = None
        self._started_over: set[int] = set()  # model ids this instance started over (load_from_save_dir=False)
        # featurized rows on their way into the store (in whole chunks, behind this thread where asked, with each
        # shard's partial on a GPU): the engine's RowSink
        self._rows = engine.RowSink(self.device, self.write_behind)
        # the model known not to be finalized while featurizing it (dropped by every other step)
        self._writable: int | None = None
        _open_trakers.add(self)

    # ------------------------------------------------------------------ the store
    @property
    def store(self) -> engine.RunStore:
        """The store (StateError while the default projector waits for the first :meth:`featurize` call)."""
        if self._store is None:
            raise StateError(
                f"TRAKer: nothing is stored at {self.save_dir} yet: with the default projector the store is created "
                "once the first rows are featurized (proj_dim is split between the model's layers by the gradient "
                "energy of the first 64 rows given); call load_checkpoint(...) and featurize(...) first"
            )
        return self._store

    def _energy_projector(self, batch) -> AbstractProjector:
        """The default projector with proj_dim split by the gradient energy of ``batch`` (:func:`engine.probe_split`
        on the first ≤ PROBE_ROWS rows given, in passes of ``proj_max_batch_size``) at the loaded checkpoint."""
        try:
            rows = self.featurizer.rows_within_budget(batch, self.current_model_id or 0)  # (measured by the stand-in)
            split = engine.probe_split(self.model, self.task, batch, self.grad_wrt, min(rows, self._probe_chunk))
            self.featurizer.memory_fit = None  # the projector built here (its own factors) is probed again
        except RuntimeError as e:
            self.featurizer._dtype_mismatch(batch, e)
            raise
        spectra = None
        if self.curvature in engine.FIT_BEFORE_FEATURIZE and self._fitted:  # the split model 0's factors say
            spectra = engine.SpectraMemo()  # its reductions, for the sides of the same factors below
            split = engine.eigen_split(split, self._fitted[min(self._fitted)], self.proj_dim, spectra)
        projector = default_projector(
            self.model,
            self.num_params_for_grad,
            self.proj_dim,
            self.proj_seed,
            self.device,
            self.grad_wrt,
            energies=split["energies"],
        )
        if self.curvature in engine.FIT_BEFORE_FEATURIZE:
            self._bind_eigen(projector, spectra)
        return projector

    def _create_default_store(self) -> None:
        """The default projector from the rows held (:class:`engine.ProbeRows`), their features computed with it,
        then the store created and the rows stored: a batch that cannot be featurized leaves no store behind."""
        projector = self._energy_projector(self._probe.rows())
        held = self._probe.take()
        stand_in, self.featurizer.projector = self.featurizer.projector, projector
        folded = self.curvature in engine.FOLDED_CURVATURES  # each batch's factor sums from its own featurizing
        try:
            computed = []
            for mid, batch, inds in held:
                fold = (
                    engine.FactorFold(self.train_set_size, self.grad_wrt)
                    if folded and mid not in self._fitted
                    else None
                )
                computed.append((*engine.featurize_folded(fold, self.featurizer, batch, mid, inds.tolist()), fold))
        finally:
            self.featurizer.projector = stand_in
        self._create_store(projector)
        with self.store.pinned(self._rows.handles):
            for (mid, batch, inds), done in zip(held, computed, strict=True):
                self._featurize(mid, batch, inds, None, done)

    def _create_store(self, projector: AbstractProjector) -> None:
        """The store of ``projector`` (the default, built by the first featurize call), then the model records of
        the load_checkpoint calls so far."""
        meta = self._metadata_of(projector)
        self._store = engine.open_run(self.save_dir, meta, self._storage_options)
        self.projector = self.featurizer.projector = projector
        self.metadata = meta
        self._deferred = False
        planned, self._planned = self._planned, []
        for mid, record, start_over in planned:
            engine.plan_model(self._store, mid, checkpoint=record, start_over=start_over)
        for mid, pre in self._fitted.items():  # K-FAC factors fitted before the store existed
            engine.record_curvature(self._store, mid, pre)

    # ------------------------------------------------------------------ Kronecker-factored curvature
    def _bind_eigen(self, projector: AbstractProjector, spectra: engine.SpectraMemo | None = None) -> None:
        """``curvature="kfac-eigen"``: ``projector`` projects each model's Kronecker blocks in the eigenbasis of
        the factors fitted by :meth:`fit_curvature` (or recorded in the store at its checkpoint); a model without
        them is refused when featurized or scored. ``spectra``: the split's reductions of model 0's factors."""
        me = weakref.ref(self)

        def factors_of(model_id: int) -> engine.KroneckerFactors:
            tr = me()
            pre = None if tr is None else tr._fitted.get(model_id)
            if pre is None and tr is not None and tr._store is not None:
                pre = engine.current_factors(tr._store, model_id)
            if pre is None:
                raise StateError(
                    f"model_id={model_id}: curvature='kfac-eigen' projects with the eigenbasis of the checkpoint's "
                    "Kronecker factors, and none are fitted: call TRAKer.fit_curvature(batches) after "
                    "load_checkpoint, before featurize"
                )
            return pre

        engine.bind_eigen(projector, factors_of, spectra=spectra)

    def fit_curvature(self, batches) -> None:
        """Fit the current checkpoint's Kronecker-factored curvature on train ``batches`` (a list or DataLoader of
        batches as :meth:`featurize` takes them, all train rows or a sample): after :meth:`load_checkpoint`; for
        ``"kfac-eigen"`` before :meth:`featurize` (required), for ``"kfac"`` / ``"ekfac"`` before
        :meth:`finalize_features` (optional: without it, the factors of the rows featurized). The store records the
        factors; a checkpoint that has them keeps them (this call then does nothing)."""
        mid = self.current_model_id
        if self.curvature not in engine.KFAC_CURVATURES:
            raise StateError(
                f"fit_curvature: this TRAKer's curvature is {self.curvature!r}, not one of {engine.KFAC_CURVATURES}"
            )
        if mid is None:
            raise StateAssertionError("Load a checkpoint using traker.load_checkpoint before fit_curvature")
        if mid in self._fitted:
            return
        self._flush_rows()
        if self._store is not None:
            pre = engine.fit_curvature(
                self.store, mid, self.featurizer, lambda: batches, self.curvature_damping, self.grad_wrt
            )
        else:
            pre = engine.fit_factors(
                self.featurizer, lambda: batches, self.curvature, self.curvature_damping, self.grad_wrt
            )
        if pre is not None:
            self._fitted[mid] = pre
            if self.curvature in engine.FIT_BEFORE_FEATURIZE:  # sides cached for other factors of this model
                self.featurizer.projector.free_memory()

    # ------------------------------------------------------------------ featurizing
    def _forget_handles(self) -> None:
        """Drop what featurizing one model keeps between calls (a step other than featurize may change it)."""
        self._rows.forget()
        self._writable = None

    def _flush_rows(self) -> None:
        """Write the featurized rows held back by :meth:`featurize` and wait until every queued write is done (its
        error, if any, raised here)."""
        if self._deferred and self._probe.count:  # fewer rows than the probe takes: they decide it
            self._create_default_store()
        if self._store is not None:
            self._rows.flush(self._store)

    def _close(self) -> None:
        """Write the rows held back, then release the store's run lock (at exit, or when garbage collected)."""
        try:
            self._flush_rows()
        except Exception:  # interpreter shutdown or a closed store: the rows stay unmarked (featurized again)
            pass
        rows = getattr(self, "_rows", None)
        if rows is not None:
            rows.close()
        if getattr(self, "_locked", False):
            self._locked = False
            engine.release_store(self.save_dir)

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # interpreter shutdown: a lock left by a dead process is taken over by the next run
            pass

    def load_checkpoint(self, checkpoint: dict, model_id: int, _allow_featurizing_already_registered=False) -> None:
        """Load a state_dict and make ``model_id`` the current model for :meth:`featurize`."""
        engine.check_state_finite(checkpoint, "checkpoint", f"the state_dict of model_id={model_id}")
        self._flush_rows()
        self._rows.new_model()
        self._writable = None
        # traker: load_from_save_dir=False does not load what save_dir holds; the model starts over here (once
        # per instance), never reusing gradients (or features, targets, scores) of another checkpoint
        start_over = not self.load_from_save_dir and model_id not in self._started_over
        # the checkpoint's fingerprint is recorded: featurizing another checkpoint into model_id's rows is refused
        record = {
            "path": "state_dict given to TRAKer.load_checkpoint",
            "state_sha256": engine.state_fingerprint(checkpoint),
        }
        if self._deferred:  # no store yet (see _create_store): recorded, then planned when it is created
            engine.check_model_id(model_id)
            self.featurizer.load_state(checkpoint)
            self._planned = [p for p in self._planned if p[0] != model_id] + [(model_id, record, start_over)]
        else:
            if not start_over:
                engine.check_model(self.store, model_id, checkpoint=record)
            self.featurizer.load_state(checkpoint)  # a state_dict that does not fit the model is refused here
            engine.plan_model(self.store, model_id, checkpoint=record, start_over=start_over)
        if start_over:
            self._started_over.add(model_id)
            self._folds.pop(model_id, None)
        self.ckpt_loaded = model_id
        self.current_model_id = model_id
        self._last_ind = 0

    def _checked(self, batch, inds, num_samples, attr: str, limit: int, field: str) -> np.ndarray:
        """The rows ``inds`` of a batch of ``field`` (``train_data`` or ``target_data``), after the pipeline's checks
        of its inputs (:func:`trak_core.engine.check_batch_rows`: the task's, NaN/inf naming the example indices,
        dtypes)."""
        rows = functools.partial(self._resolve_inds, batch, inds, num_samples, attr, limit)
        return engine.check_batch_rows(self.task, self.model, batch, field, rows)

    def _resolve_inds(self, batch, inds, num_samples, attr: str, limit: int) -> np.ndarray:
        if (inds is None) == (num_samples is None):
            raise InputAssertionError(
                "Exactly one of num_samples and inds should be specified "
                f"(got inds={'None' if inds is None else 'given'}, num_samples={num_samples!r})"
            )
        if num_samples is not None:
            start = getattr(self, attr)
            inds = np.arange(start, start + int(num_samples))
            setattr(self, attr, start + int(num_samples))
        inds = np.asarray(inds.cpu() if isinstance(inds, Tensor) else inds).reshape(-1).astype(np.int64)
        b = batch[0].shape[0] if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], Tensor) else None
        if b is not None and b != inds.size:
            raise BadInputError(f"batch has {b} examples but {inds.size} indices were given")
        if inds.size and (inds.min() < 0 or inds.max() >= limit):
            bad = inds[(inds < 0) | (inds >= limit)]
            raise BadInputError(f"indices {bad[:10].tolist()} out of range [0, {limit})")
        # strictly ascending indices (num_samples, or a sorted batch) are distinct without sorting them
        if inds.size > 1 and not bool((inds[1:] > inds[:-1]).all()) and np.unique(inds).size != inds.size:
            raise BadInputError("indices within one batch must be distinct")
        return inds

    def featurize(self, batch, inds=None, num_samples: int | None = None) -> None:
        """Project the gradients of a batch of train examples and store them (rows ``inds``).

        Consecutive batches of ascending rows (``num_samples``, or contiguous ``inds``) are written to the
        store together, in whole chunks, once a chunk boundary or the last train row is reached (the rows after
        the boundary are held for the next write: one write per chunk instead of a read-modify-write of the chunk
        per batch); every other TRAKer call, and the end of the process, writes what is held first. Rows are
        marked featurized only once written: a process killed in between leaves them unmarked, and they are
        featurized again on the next run."""
        mid = self.current_model_id
        if self.ckpt_loaded is None or mid is None:  # the two are set together (load_checkpoint)
            raise StateAssertionError(
                "Load a checkpoint using traker.load_checkpoint before featurizing "
                "(call load_checkpoint(state_dict, model_id=...) first)"
            )
        if self._deferred:  # held until the rows that decide the default projector are here (engine.ProbeRows)
            inds = self._checked(batch, inds, num_samples, "_last_ind", self.train_set_size, "train_data")
            self._probe.add(mid, batch, inds)
            if self._probe.full:
                self._create_default_store()
            else:  # held: checked now as featurizing would (with the stand-in; ≤ PROBE_ROWS rows computed twice)
                try:
                    self.featurizer.featurize(batch, mid, inds.tolist())
                except BaseException:
                    self._probe.drop_last()
                    raise
            return
        with self.store.pinned(self._rows.handles):
            self._featurize(mid, batch, inds, num_samples)

    def _featurize(self, mid: int, batch, inds, num_samples, computed=None) -> None:
        inds = self._checked(batch, inds, num_samples, "_last_ind", self.train_set_size, "train_data")
        if self._writable != mid:
            if self.store.is_finalized(mid):  # every row is stored (finalize needs them all): skipped, as traker does
                return
            self._writable = mid
        todo = self._rows.todo(self.store, mid, inds)
        if not todo.any():
            return
        if not todo.all():
            keep = np.flatnonzero(todo)
            sel = torch.as_tensor(keep)
            batch = [x[sel] for x in batch]
            inds = inds[keep]
            computed = None if computed is None else (computed[0][keep], computed[1][keep], None)
        fold = self._fold_of(mid)  # the factors' sums over the same rows (before they count as featurized)
        if computed is None:
            x, q = engine.featurize_folded(fold, self.featurizer, batch, mid, inds)
        else:  # rows held for the default projector: their own fold's sums, else (some rows stored) a pass here
            x, q, held = computed
            if fold is not None and not (held is not None and fold.merge(held)):
                fold.add(self.featurizer, batch, inds)
        self._rows.add(self.store, mid, inds, x, q)

    def _fold_of(self, mid: int) -> engine.FactorFold | None:
        """The factor sums featurizing ``mid`` adds to: ``"kfac"`` / ``"ekfac"`` with no factors fitted for it
        (:meth:`fit_curvature`) nor recorded in the store at its checkpoint; else None."""
        if self.curvature not in engine.FOLDED_CURVATURES or mid in self._fitted:
            return None
        if mid not in self._folds:
            recorded = engine.current_factors(self.store, mid) is not None
            self._folds[mid] = None if recorded else engine.FactorFold(self.train_set_size, self.grad_wrt)
        return self._folds[mid]

    def _fold_factors(self, mid: int) -> None:
        """Record the factors of ``mid``'s featurized rows (:class:`engine.FactorFold`) when it has none fitted nor
        recorded and this instance featurized every one of its rows; rows featurized elsewhere are refused, naming
        the fit."""
        fold = self._fold_of(mid)
        if fold is None:
            return
        featurized = self.store.featurized_mask(mid)
        if not featurized.all():  # finalize names the rows missing
            return
        if not fold.covers(featurized):
            counted = int((fold.rows & featurized).sum())
            raise StateError(
                f"model_id={mid}: curvature={self.curvature!r} fits its Kronecker factors on the rows this TRAKer "
                f"featurizes, and {featurized.size - counted} of its {featurized.size} rows were featurized by "
                "another TRAKer or process: call TRAKer.fit_curvature(batches) after load_checkpoint"
            )
        pre = fold.factors(self.curvature, self.curvature_damping)
        engine.record_curvature(self.store, mid, pre, replace=True)  # factors of an earlier checkpoint: replaced
        self._fitted[mid] = pre
        del self._folds[mid]

    def finalize_features(self, model_ids: Iterable[int] | None = None, del_grads: bool = False) -> None:
        """XᵀX and A = (XᵀX + λI)⁻¹ for each model (all registered ones by default), stored; the features
        Φ = X A are not (:meth:`features` computes them). ``del_grads``: ignored with a warning, scoring reads
        the gradients."""
        self._flush_rows()
        self._forget_handles()
        if del_grads:
            warnings.warn(
                "del_grads=True is ignored: trak_core keeps no features and scores from the stored gradients "
                "(X · A Gᵀ); deleting them would make scoring impossible",
                stacklevel=2,
            )
        if self._store is None:  # the default projector waits for the first featurize: nothing is registered
            first = next(iter(model_ids), None) if model_ids is not None else None
            raise ModelIDException(
                f"Model ID {first} not registered, not ready for finalizing: nothing was featurized into "
                f"{self.save_dir} yet (load_checkpoint and featurize first)"
            )
        ids = list(model_ids) if model_ids is not None else self.store.model_ids()
        for mid in ids:
            if not self.store.has_model(mid):
                raise ModelIDException(
                    f"Model ID {mid} not registered, not ready for finalizing: load_checkpoint and featurize it first"
                )
        for mid in ids:
            self._fold_factors(mid)
            sums = self._rows.partial_sums  # the partials' running sum: used where it covers all of mid's shards
            _, skipped, _ = engine.finalize(self.store, mid, self.lambda_reg, self.rescale_inverse, self.device, sums)
            if skipped:
                self.logger.warning("model_id=%s already finalized, skipping", mid)
        self._last_ind = 0

    def features(self, model_id: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """traker's features Φ = X A of train rows [start, stop) of a finalized ``model_id``, (rows, proj_dim)
        float32, computed on demand from the stored gradients and inverse."""
        self._flush_rows()
        return engine.features(self.store, model_id, start, stop)

    # ------------------------------------------------------------------ scoring
    def start_scoring_checkpoint(self, exp_name: str, checkpoint: dict, model_id: int, num_targets: int) -> None:
        """Begin computing target gradients of experiment ``exp_name`` for checkpoint ``model_id``."""
        engine.check_state_finite(checkpoint, "checkpoint", f"the state_dict of model_id={model_id}")
        self._flush_rows()
        self._forget_handles()
        engine.begin_targets(self.store, exp_name, model_id, num_targets)
        self.featurizer.load_state(checkpoint)
        self.current_experiment_name = exp_name
        self.current_model_id = model_id
        self.ckpt_loaded = model_id
        self._last_ind_target = 0

    def score(self, batch, inds=None, num_samples: int | None = None) -> None:
        """Project the gradients of a batch of targets (rows ``inds`` of the experiment)."""
        exp, mid = self.current_experiment_name, self.current_model_id
        if exp is None or mid is None:  # the two are set together (start_scoring_checkpoint)
            raise StateError("call start_scoring_checkpoint(...) before score(...)")
        inds = self._checked(batch, inds, num_samples, "_last_ind_target", self.store.num_targets(exp), "target_data")
        engine.target_rows(self.store, self.featurizer, exp, mid, batch, inds)

    def finalize_scores(
        self, exp_name: str, model_ids: Iterable[int] | None = None, allow_skip: bool = False
    ) -> np.ndarray:
        """Combine the checkpoints' scores: (n_train, n_targets) float32 array."""
        self._last_ind_target = 0
        if model_ids is not None:
            model_ids = list(model_ids)
            if not model_ids:
                raise InputAssertionError("No model IDs to finalize scores for (model_ids is empty)")
        with engine.memory_limit(self.max_memory):
            self.scores = engine.score_all(self.store, exp_name, model_ids, allow_skip)
        return self.scores
