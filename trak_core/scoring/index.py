"""TrakIndex: top-k attribution queries against a finalized store, without an n × m score array.

A query featurizes its m inputs once per checkpoint with the projector the store was built with, forms
W_c = A_c G_cᵀ (:func:`trak_core.scoring.streaming.grads_right_hand`, the inputs' projected gradients rounded to the
store's dtype first, as stored targets are), then makes one pass over the stored rows with
:func:`trak_core.scoring.streaming.stream_scores` (its reader thread, its one-thread GEMM workers, the same float32
arithmetic and the same blocks as :func:`trak_core.solve.reduce.finalize_scores`). Each finished chunk of scores goes
to a running top-k per input instead of the store, so the scores are those ``finalize_scores`` gives for the
same inputs, bit for bit, and memory stays at a few chunks of scores.

Ties are broken by the lower train index (both ends), so a result never depends on thread timing.

The store is opened read-only. A run may hold the store's lock meanwhile: the index reads only finalized
checkpoints, whose rows and inverse a run leaves alone (repairing or starting a checkpoint over clears its
finalize record first), and checks each query's checkpoints before and after its pass: a query that saw a
checkpoint change is refused, never answered from two states.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trak_core import engine
from trak_core.checkpoints import check_record, file_sha256, load_state, record_of, state_digest
from trak_core.errors import BadInputError, StateError, StoreMismatchError
from trak_core.featurize.budget import parse_bytes
from trak_core.featurize.featurizer import Featurizer
from trak_core.featurize.gradients import AbstractGradientComputer, FunctionalGradientComputer, grad_dim_of
from trak_core.featurize.modelout import AbstractModelOutput, check_batch, resolve_task
from trak_core.projection.projectors import AbstractProjector
from trak_core.rules import check_dtypes, check_finite
from trak_core.scoring.streaming import grads_right_hand, stream_scores
from trak_core.scoring.topk import RunningTopK
from trak_core.store import StoreLock, StoreMetadata, model_array, open_store

#: the metadata fields that identify a projection (compared with a rebuilt or given projector)
PROJECTION_FIELDS = ("projector", "proj_type", "proj_seed", "grad_dim", "proj_dim", "projector_params")


@dataclass(frozen=True)
class QueryResult:
    """The k best train rows per query input: ``indices`` (m, k) int64 and ``scores`` (m, k) float32, best
    first (``opponents``: the most negative first); ``model_ids``: the checkpoints combined."""

    indices: np.ndarray
    scores: np.ndarray
    opponents: bool
    model_ids: tuple[int, ...]
    #: with ``explain=True`` (sequence models): (m, k, T) float32, each row's score split by position of its train
    #: sequence (:mod:`trak_core.scoring.explain`); ``shares[j, r].sum()`` is ``scores[j, r]``
    shares: np.ndarray | None = None

    def to_dict(self) -> dict:
        """JSON-able: ``{"opponents", "model_ids", "results": [{"input", "indices", "scores"[, "shares"]}, ...]}``."""
        results = []
        for j in range(self.indices.shape[0]):
            r: dict = {"input": j, "indices": self.indices[j].tolist(), "scores": [float(s) for s in self.scores[j]]}
            if self.shares is not None:
                r["shares"] = [[float(v) for v in row] for row in self.shares[j]]
            results.append(r)
        return {"opponents": self.opponents, "model_ids": list(self.model_ids), "results": results}


class _TopKWriter:
    """Where :func:`stream_scores` puts each chunk of scores (a :class:`~trak_core.scoring.streaming.ScoreSink`): into
    running top-k's; nothing is marked done, nothing written."""

    def __init__(self, chunk_rows: int, topks: Sequence[RunningTopK]):
        self._chunk_rows = int(chunk_rows)
        self.topks = list(topks)

    @property
    def chunk_rows(self) -> int:
        return self._chunk_rows

    @property
    def done_rows(self) -> int:
        return self._chunk_rows

    def rows(self, a: int, b: int, scores: np.ndarray) -> None:
        for t in self.topks:
            t.add(a, scores[: b - a])

    def mark_done(self, a: int, b: int) -> None:
        """Nothing to mark: the scores are not stored."""


def _holder_text(holder: dict | None) -> str:
    if not holder:
        return ""
    return f" (run {holder.get('run') or '?'}, pid {holder.get('pid')} on {holder.get('host')}, holds the store)"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class TrakIndex:
    """Top-k queries against a finalized store: ``TrakIndex(save_dir, model=..., checkpoints=[...], task=...)``
    then ``index.query(batch, k=10)`` (``opponents=True``: the most negative scores).

    Args:
        save_dir: the store (a path or fsspec URL), opened read-only.
        model: the model the checkpoints belong to (None: an index that answers :meth:`query_vectors` only).
        checkpoints: one per ``model_ids`` entry: a state dict or a checkpoint file (torch.save of a state dict).
            Each is compared with the store's record of the checkpoint its model id was featurized from (the
            digest of its contents, whichever route wrote the store); a mismatch is refused naming the model id.
        task: the model output (name or instance); must be the store's.
        model_ids: the store's checkpoints to combine (default: all, in ascending order).
        projector: the projector the store was built with (default: rebuilt from the store's metadata and the
            model; compared with it either way).
        grad_wrt: the parameters the store's gradients were taken with respect to (default: all).
        device: where the inputs are featurized (default: cuda if available, else cpu).
        storage_options: fsspec options of a remote store.
        max_memory: a memory budget (bytes or '4GB'): query batches are featurized in pieces that keep the peak
            under it (:mod:`trak_core.featurize.budget`).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        model: torch.nn.Module | None = None,
        checkpoints: Sequence[Mapping[str, Tensor] | str | os.PathLike] | None = None,
        task: AbstractModelOutput | str = "image_classification",
        *,
        model_ids: Sequence[int] | None = None,
        projector: AbstractProjector | None = None,
        grad_wrt: Sequence[str] | None = None,
        device: str | torch.device | None = None,
        storage_options: dict | None = None,
        gradient_computer: type[AbstractGradientComputer] = FunctionalGradientComputer,
        max_memory: int | str | None = None,
    ) -> None:
        self.location = str(save_dir)
        self.max_memory = parse_bytes(max_memory)
        self._storage_options = storage_options
        self.store = open_store(self.location, storage_options, mode="r")
        meta = self.store.meta
        self.task = resolve_task(task)
        if meta.task and meta.task != type(self.task).__name__:
            raise StoreMismatchError(
                f"task: the store at {self.location} was built with {meta.task}, not {type(self.task).__name__}"
            )
        stored = self.store.model_ids()
        ids = [int(i) for i in (stored if model_ids is None else model_ids)]
        if not ids or len(set(ids)) != len(ids):
            raise BadInputError(f"model_ids: {ids} must be distinct and not empty (the store has {stored})")
        self.model_ids = tuple(sorted(ids))
        self.holder = StoreLock(self.location).holder()
        self._check_models(stored)
        self.n = meta.train_set_size
        self._inverses = {mid: torch.from_numpy(self.store.inverse(mid)) for mid in self.model_ids}
        self._snapshot = self._state()
        self.model = model
        self.device = str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        self._states: dict[int, dict] = {}
        self.featurizer: Featurizer | None = None
        if model is None:
            if checkpoints is not None:
                raise BadInputError("checkpoints: given without a model; pass model= too")
            return
        if checkpoints is None:
            raise BadInputError(f"checkpoints: one per model_id {list(self.model_ids)} is needed with a model")
        if isinstance(checkpoints, (str, os.PathLike, Mapping)):
            checkpoints = [checkpoints]
        if len(checkpoints) != len(self.model_ids):
            raise BadInputError(
                f"checkpoints: {len(checkpoints)} given for the store's {len(self.model_ids)} checkpoints "
                f"(model_ids {list(self.model_ids)}); pass one per model_id, or choose them with model_ids="
            )
        self.grad_wrt = list(grad_wrt) if grad_wrt is not None else None
        try:
            grad_dim = grad_dim_of(model, self.grad_wrt)
        except BadInputError as e:
            raise BadInputError(f"grad_wrt: {e}") from None
        if grad_dim != meta.grad_dim:
            raise StoreMismatchError(
                f"model: {grad_dim} gradient coordinates (grad_wrt={self.grad_wrt!r}), but the store at "
                f"{self.location} was built with grad_dim={meta.grad_dim}"
            )
        order = sorted(range(len(ids)), key=lambda i: ids[i])  # checkpoints follow model_ids' order as given
        for pos in order:
            mid = ids[pos]
            self._states[mid] = self._load_checkpoint(pos, mid, checkpoints[pos])
        model.to(self.device)
        self.projector = self._projector(projector, model)
        self.featurizer = Featurizer(
            model, self.task, self.projector, gradient_computer, self.grad_wrt, self.device, max_memory=self.max_memory
        )
        first = self.model_ids[0]
        self.featurizer.load_state(self._states[first])  # a checkpoint that does not fit the model fails here

    # ------------------------------------------------------------------ opening
    @classmethod
    def from_config(cls, config: Any, **overrides) -> TrakIndex:
        """The index of a pipeline run: ``config`` an object with the pipeline config's interface (``store``,
        ``storage_options``, ``build_model()``, ``build_task()``, ``checkpoint_paths``, ``grad_wrt``,
        ``resolved_device()``), e.g. ``tasks.config.AttributeConfig``, or the path of its YAML file (read by the
        loader the pipeline registers, :func:`register_config_loader`; ``tasks.query.open_index`` does both).
        The store's checkpoint records are checked against the files' contents. ``overrides``: constructor
        arguments to replace."""
        if isinstance(config, (str, os.PathLike)):
            if _CONFIG_LOADER[0] is None:
                raise BadInputError(
                    f"TrakIndex.from_config({str(config)!r}): no pipeline config reader is registered; import "
                    "tasks.query (or call tasks.query.open_index) to read a config file"
                )
            config = _CONFIG_LOADER[0](config)
        model = config.build_model()
        kwargs = dict(
            model=model,
            checkpoints=list(config.checkpoint_paths),
            task=config.build_task(),
            model_ids=list(range(len(config.checkpoint_paths))),
            grad_wrt=config.grad_wrt,
            device=config.resolved_device(),
            storage_options=config.storage_options,
            max_memory=getattr(config, "max_memory", None),
        )
        kwargs.update(overrides)
        return cls(config.store, **kwargs)

    def _check_models(self, stored: list[int]) -> None:
        n = self.store.meta.train_set_size
        rows = np.arange(n)
        for mid in self.model_ids:
            if mid not in stored:
                raise BadInputError(f"model_ids: {mid} is not in the store at {self.location} (it has {stored})")
            if not self.store.is_finalized(mid):
                raise StateError(
                    f"model_id={mid} in {self.location} is not finalized{_holder_text(self.holder)}: "
                    "finalize it (or wait for the run), then open the index again"
                )
            done = int(self.store.featurized_mask(mid).sum())
            if done != n:
                raise StateError(f"model_id={mid}: {n - done} of {n} train rows are not featurized")
            self.store.check_present(
                [
                    (model_array(mid, "grads"), rows),
                    (model_array(mid, "out_to_loss"), rows),
                    (model_array(mid, "inverse"), np.zeros(1, int)),
                ]
            )

    def _load_checkpoint(self, pos: int, mid: int, ckpt) -> dict:
        """The state dict of ``checkpoints[pos]``, checked against the record of the checkpoint ``mid`` was
        featurized from (:func:`trak_core.checkpoints.check_record`, the check every front door makes)."""
        field = f"checkpoints[{pos}]"
        if isinstance(ckpt, (str, os.PathLike)):
            state = load_state(ckpt, field)
            given = record_of(ckpt, digest=state_digest(state))
        elif isinstance(ckpt, Mapping):
            state, given = dict(ckpt), record_of(ckpt)
        else:
            raise BadInputError(f"{field}: a state dict or a file path, got {type(ckpt).__name__}")
        check_record(self.store.checkpoint_record(mid), given, mid, self.location, field)
        return state

    def _projector(self, given: AbstractProjector | None, model: torch.nn.Module) -> AbstractProjector:
        meta = self.store.meta
        if given is None:  # rebuilt as TRAKer and the pipeline rebuild a store's projector
            try:
                given = engine.recorded_projector(meta, model, self.grad_wrt, self.device)
            except BadInputError as e:  # "projector: cannot rebuild the store's ... projection (...)"
                raise BadInputError(f"{e}; pass projector=") from None
        have = StoreMetadata.from_projector(given.spec(), train_set_size=meta.train_set_size).model_dump()
        want = meta.model_dump()
        for field in PROJECTION_FIELDS:
            if have[field] != want[field]:
                raise StoreMismatchError(
                    f"projector: {field}={have[field]!r}, but the store at {self.location} was built with "
                    f"{field}={want[field]!r} (check model, grad_wrt and projector)"
                )
        if meta.curvature in engine.FIT_BEFORE_FEATURIZE:  # the rows are in the recorded factors' eigenbasis
            engine.bind_recorded_eigen(given, self.store)
        return given

    # ------------------------------------------------------------------ snapshot
    def _state(self) -> dict:
        """What a run changes when it touches a checkpoint: its finalize record and the row count, read afresh."""
        store = open_store(self.location, self._storage_options, mode="r", check_arrays=False)
        return {
            "n": store.meta.train_set_size,
            "models": {mid: store.finalize_info(mid) if store.has_model(mid) else None for mid in self.model_ids},
        }

    def _check_snapshot(self, when: str) -> None:
        now = self._state()
        if now != self._snapshot:
            holder = StoreLock(self.location).holder()
            changed = [mid for mid in self.model_ids if now["models"][mid] != self._snapshot["models"][mid]]
            what = f"model_ids {changed}" if changed else f"train_set_size ({self._snapshot['n']} → {now['n']})"
            raise StateError(
                f"store {self.location} changed {when} ({what}){_holder_text(holder)}: the index does not mix two "
                "states of a store; open the index again once the run is done"
            )

    # ------------------------------------------------------------------ queries
    def check_k(self, k) -> int:
        """``k`` as an int, refused unless 1 ≤ k ≤ n."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= self.n:
            raise BadInputError(f"k={k!r}: must be an integer from 1 to the store's {self.n} train rows")
        return int(k)

    def check_batch(self, batch) -> int:
        """Refuse a malformed query batch before any compute (BadInputError); returns its size m."""
        try:
            m = check_batch(batch)
            self.task.validate_batch(batch)
        except BadInputError as e:
            raise BadInputError(f"query batch: {e}") from None
        if self.model is not None:  # the rules of every front door's inputs (trak_core.rules)
            check_dtypes(self.model, batch, "query batch")
            check_finite(batch, "query batch")
        return m

    def featurize(self, batch: Sequence[Tensor]) -> dict[int, np.ndarray]:
        """The inputs' projected gradients per checkpoint, {model_id: (m, proj_dim) float32}, rounded to the
        store's dtype (as stored targets are)."""
        if self.featurizer is None:
            raise StateError("this index has no model (TrakIndex(..., model=None)): use query_vectors")
        m = self.check_batch(batch)
        out = {}
        dtype = self.store.meta.np_dtype
        for mid in self.model_ids:
            self.featurizer.load_state(self._states[mid])
            try:
                x = self.featurizer.target_features(batch, mid, range(m))
            except RuntimeError as e:  # e.g. inputs of another shape than the model takes
                raise BadInputError(
                    f"query batch of shapes {[tuple(t.shape) for t in batch]}: the model cannot take it "
                    f"({_first_line(e)})"
                ) from None
            out[mid] = x.astype(dtype).astype(np.float32)
        return out

    def query(
        self,
        batch: Sequence[Tensor],
        k: int = 10,
        opponents: bool = False,
        explain: bool = False,
        train_data: Sequence[Tensor] | None = None,
    ) -> QueryResult:
        """The k train rows with the highest (``opponents``: lowest) scores for each input of ``batch``; the scores
        are ``TRAKer.finalize_scores``' for the same inputs. ``explain`` (sequence models): also each row's score
        split by position of its train sequence (``QueryResult.shares``), from ``train_data`` (the store's train rows,
        a tuple of tensors; only the k rows found are featurized again, :mod:`trak_core.scoring.explain`)."""
        k = self.check_k(k)
        if explain:
            from trak_core.scoring.explain import check_explain

            check_explain(self, train_data)
        vectors = self.featurize(batch)
        result = self.query_vectors(vectors, k, opponents)
        return self._explained(result, vectors, train_data) if explain else result

    def query_both(
        self, batch: Sequence[Tensor], k: int = 10, explain: bool = False, train_data: Sequence[Tensor] | None = None
    ) -> tuple[QueryResult, QueryResult]:
        """(:meth:`query`, :meth:`query` with ``opponents=True``) from one featurization and one pass."""
        k = self.check_k(k)
        if explain:
            from trak_core.scoring.explain import check_explain

            check_explain(self, train_data)
        vectors = self.featurize(batch)
        top, low = self._scan(vectors, k, (False, True))
        if explain:
            return self._explained(top, vectors, train_data), self._explained(low, vectors, train_data)
        return top, low

    def _explained(self, result: QueryResult, vectors: Mapping[int, np.ndarray], train_data) -> QueryResult:
        from dataclasses import replace

        from trak_core.scoring.explain import query_shares

        return replace(result, shares=query_shares(self, result, vectors, train_data))

    def query_vectors(
        self,
        vectors: Mapping[int, np.ndarray | Tensor],
        k: int = 10,
        opponents: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> QueryResult:
        """:meth:`query` from the inputs' projected gradients {model_id: (m, proj_dim)} (e.g. :meth:`featurize`'s).
        ``progress(rows)`` as rows are scored."""
        return self._scan(vectors, self.check_k(k), (bool(opponents),), progress)[0]

    def _scan(
        self,
        vectors: Mapping[int, np.ndarray | Tensor],
        k: int,
        ends: tuple[bool, ...],
        progress: Callable[[int], None] | None = None,
    ) -> list[QueryResult]:
        """One pass over the stored rows, a running top-k per entry of ``ends`` (False: highest, True: lowest)."""
        p = self.store.meta.proj_dim
        if set(vectors) != set(self.model_ids):
            ids = list(self.model_ids)
            raise BadInputError(f"vectors: one (m, {p}) array per model_id {ids}, got {sorted(vectors)}")
        shapes = sorted({tuple(np.shape(v)) for v in vectors.values()})
        m = shapes[0][0] if len(shapes) == 1 and len(shapes[0]) == 2 and shapes[0][1] == p else 0
        if not m:
            raise BadInputError(f"vectors: expected (m, {p}) arrays with one m ≥ 1, got shapes {shapes}")
        right = {}
        for mid in self.model_ids:
            g = torch.as_tensor(np.asarray(vectors[mid], dtype=np.float32))
            if not bool(torch.isfinite(g).all()):
                raise BadInputError(f"vectors[{mid}]: NaN or inf")
            right[mid] = grads_right_hand(self._inverses[mid], g.T.contiguous())
        self._check_snapshot("since the index was opened")
        topks = [RunningTopK(m, k, opp) for opp in ends]
        writer = _TopKWriter(self.store.meta.score_chunk_rows(m), topks)
        with self.store.pinned():
            stream_scores(self.store, "query", list(self.model_ids), 0, self.n, right, progress=progress, sink=writer)
        self._check_snapshot("during the query")
        out = []
        for t in topks:
            idx, scores = t.result()
            out.append(QueryResult(indices=idx, scores=scores, opponents=t.opponents, model_ids=self.model_ids))
        return out

    def __repr__(self) -> str:
        return f"TrakIndex({self.location!r}, n={self.n}, model_ids={list(self.model_ids)})"


#: the pipeline's reader of a config file (tasks.query registers AttributeConfig.from_yaml)
_CONFIG_LOADER: list[Callable[[Any], Any] | None] = [None]


def register_config_loader(loader: Callable[[Any], Any]) -> None:
    """Let :meth:`TrakIndex.from_config` read a config file with ``loader(path)`` (the pipeline registers its own)."""
    _CONFIG_LOADER[0] = loader


__all__ = ["QueryResult", "RunningTopK", "TrakIndex", "file_sha256", "register_config_loader"]
