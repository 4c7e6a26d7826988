"""The plan of an attribution run and the manifests its tasks return: small, typed, frozen pydantic models
(never arrays). They travel as Prefect task results and flow parameters/returns, across processes too.

* :class:`Plan` — what the plan task established and created: sizes, shards, the checkpoints (``model_id`` =
  position in the sorted list). The stage flows fan out over ``plan.shards()`` × ``plan.models``.
* :class:`ScorePlan` — the checkpoints the scores combine, and the row blocks of the score tasks.
* :class:`TruthPlan` — the evaluate flow's ground-truth cache folder and the subset models to train.
* manifests — what one task did: :class:`ShardManifest` (featurize), :class:`FinalizeManifest`,
  :class:`TargetsManifest`, :class:`ScoreBlockManifest`, :class:`SubsetModelManifest` (evaluate's models);
  ``skipped`` is True when the store (or the cache) already held the result.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------------------- plan
class PlannedModel(_Frozen):
    """One checkpoint of the run."""

    model_id: NonNegativeInt
    checkpoint: str


class Plan(_Frozen):
    """The attribution run the plan task validated and created the store's arrays for."""

    store: str
    exp_name: str
    train_set_size: PositiveInt
    num_targets: PositiveInt
    grad_dim: PositiveInt
    proj_dim: PositiveInt
    shard_rows: PositiveInt
    chunk_rows: PositiveInt
    num_shards: PositiveInt
    models: tuple[PlannedModel, ...]
    grown_from: PositiveInt | None = None  # the store's train rows before this plan appended the rest

    @property
    def model_ids(self) -> list[int]:
        return [m.model_id for m in self.models]

    def shards(self) -> range:
        return range(self.num_shards)

    def featurize_jobs(self) -> list[tuple[PlannedModel, int]]:
        """(checkpoint, shard) of every featurize task, checkpoint-major."""
        return [(m, s) for m in self.models for s in self.shards()]


class ScorePlan(_Frozen):
    """The checkpoints whose scores are combined, and the train-row blocks [a, b) of the score tasks."""

    model_ids: tuple[NonNegativeInt, ...]
    blocks: tuple[tuple[NonNegativeInt, NonNegativeInt], ...]


class TruthPlan(_Frozen):
    """The evaluate flow's ground truth: its cache folder (named by ``key``), sizes, and the (subset, seed
    index) models still to train."""

    key: str
    folder: str
    n: PositiveInt
    m: PositiveInt
    models: NonNegativeInt
    jobs: tuple[tuple[NonNegativeInt, NonNegativeInt], ...]

    @property
    def to_train(self) -> int:
        return len(self.jobs)


# ---------------------------------------------------------------------------- manifests
class Manifest(_Frozen):
    """What one task did (common fields)."""

    stage: str
    skipped: bool
    seconds: float

    @classmethod
    def timed(cls, t0: float, skipped: bool, **fields: Any):
        """The manifest of a task that started at ``time.perf_counter()`` = ``t0``."""
        return cls(skipped=bool(skipped), seconds=round(time.perf_counter() - t0, 4), **fields)


class _Rows(Manifest):
    rows: tuple[NonNegativeInt, NonNegativeInt]

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


class ShardManifest(_Rows):
    """featurize-shard: train rows ``rows`` of ``model_id`` (shard ``shard``) and their XᵀX partial."""

    stage: Literal["featurize"] = "featurize"
    model_id: NonNegativeInt
    shard: NonNegativeInt


class FinalizeManifest(Manifest):
    """finalize-checkpoint: the solve of one checkpoint (``info``: λ, condition, ...) and its warnings."""

    stage: Literal["finalize"] = "finalize"
    model_id: NonNegativeInt
    info: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()


class TargetsManifest(Manifest):
    """featurize-targets: the target gradients of one checkpoint in experiment ``exp_name``."""

    stage: Literal["targets"] = "targets"
    model_id: NonNegativeInt
    exp_name: str


class ScoreBlockManifest(_Rows):
    """score-block: the combined scores of train rows ``rows``."""

    stage: Literal["score"] = "score"


class SubsetModelManifest(Manifest):
    """train-subset-model (evaluate): counterfactual model ``seed_index`` of subset ``subset``."""

    stage: Literal["lds-train"] = "lds-train"
    subset: NonNegativeInt
    seed_index: NonNegativeInt
    seed: int | None = None
    rows: int | None = None


def summarize(manifests: Sequence[Manifest | Mapping[str, Any]]) -> dict:
    """Counts and summed seconds of a stage's manifests (or of the train flow's records, which are dicts)."""

    def get(m, key):
        return getattr(m, key) if isinstance(m, Manifest) else m[key]

    return {
        "tasks": len(manifests),
        "computed": sum(not get(m, "skipped") for m in manifests),
        "skipped": sum(bool(get(m, "skipped")) for m in manifests),
        "seconds": round(sum(get(m, "seconds") for m in manifests), 3),
    }


__all__ = [
    "Plan",
    "PlannedModel",
    "ScorePlan",
    "TruthPlan",
    "Manifest",
    "ShardManifest",
    "FinalizeManifest",
    "TargetsManifest",
    "ScoreBlockManifest",
    "SubsetModelManifest",
    "summarize",
]
