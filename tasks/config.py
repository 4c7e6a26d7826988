"""The pipeline's configuration: pydantic models that are the flows' parameters and the UI's run form
(no Prefect import here). The algorithm's own settings are trak_core's (:class:`trak_core.settings.TrakSettings`,
which :attr:`AttributeConfig.settings` produces); this module adds where the inputs come from, where the
store is, where the tasks run (``task_runner``, ``max_workers``, ``gpus``, Dask) and the report.

Conventions
-----------
* **Import paths** ``"package.module:attr"`` name the model factory, the data and (optionally) the task.
  They are resolved when the config is validated: a module that does not import or an attribute that is
  missing fails validation, naming the field.
* **Model** (``model``): a zero-argument callable returning a fresh ``torch.nn.Module`` (a class works).
* **Data** (``train_data``, ``target_data``): a zero-argument callable returning a tuple of tensors with
  one leading dimension (the rows), in the order the task's batches use, e.g. ``(images, labels)`` for
  ``image_classification``; or such a tuple itself. Row ``i`` of ``train_data`` is train example ``i``.
* **Task** (``task``): ``"image_classification"``, ``"text_classification"``, ... (trak_core's names), or
  an import path to an :class:`~trak_core.featurize.modelout.AbstractModelOutput` subclass or instance.
* **Checkpoints** (``checkpoints``): a list of ``state_dict`` files, a glob (``"ckpts/*.pt"``), or the
  JSON manifest the train flow writes (``"ckpts/manifest.json"``). They are sorted by path and
  ``model_id`` is the position in that sorted list (trak_core.TRAKer's convention). Every file must
  exist when the config is validated.
* **Store** (``store``): a local path or an fsspec URL. A local store must be creatable/writable when
  the config is validated (the check leaves nothing behind).

Validation happens before any compute; an error names the field (pydantic ``ValidationError``, whose
message lists the field, or :class:`~trak_core.errors.BadInputError` naming it).
"""

from __future__ import annotations

import glob as _glob
import hashlib
import importlib
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from trak_core.errors import BadInputError
from trak_core.settings import (
    Curvature,
    CurvatureDamping,
    GradWrt,
    LambdaSetting,
    ProjectorKind,
    ProjType,
    StorageDtype,
    TrakSettings,
)
from trak_core.solve.kfac import KFAC_CURVATURES
from trak_core.store import check_exp_name, check_writable

_GLOB_CHARS = set("*?[")
TASK_NAMES = ("image_classification", "text_classification", "clip", "iterative_image_classification", "causal_lm")


# ---------------------------------------------------------------------------- import paths
#: environment variable: comma-separated import roots (top-level packages or dotted prefixes) that config import
#: paths may name, e.g. "examples,mypkg"; unset: any module (a config is code: see README "Security")
IMPORT_ROOTS_ENV = "TRAKFLOW_IMPORT_ROOTS"
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ATTR_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _parse_roots(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    roots = [str(r).strip() for r in items if str(r).strip()]
    bad = [r for r in roots if not _MODULE_RE.fullmatch(r)]
    if bad:
        raise BadInputError(f"import_roots: {bad} are not module names (e.g. 'examples', 'mypkg.models')")
    return roots


def env_import_roots() -> list[str] | None:
    """The deployment's allow-list (``TRAKFLOW_IMPORT_ROOTS``), None when unset (any module)."""
    value = os.environ.get(IMPORT_ROOTS_ENV)
    return None if value is None or not value.strip() else _parse_roots(value)


def _under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def check_import_root(module_name: str, path: str, field: str, roots: list[str] | None = None) -> None:
    """Refuse, before importing it, a module outside the allow-list: ``TRAKFLOW_IMPORT_ROOTS`` (the
    deployment's; a config cannot widen it) and ``roots`` (a config's own ``import_roots``, which can only
    narrow it)."""
    for allowed, source in ((env_import_roots(), f"the environment's {IMPORT_ROOTS_ENV}"), (roots, "import_roots")):
        if allowed is not None and not any(_under(module_name, r) for r in allowed):
            raise BadInputError(
                f"{field}: {path!r} imports module {module_name!r}, which is outside the allowed "
                f"import roots {allowed} ({source}); nothing was imported"
            )


def load_object(path: str, field: str = "import path", roots: list[str] | None = None) -> Any:
    """Resolve ``"package.module:attr"``: import the module (if it is under the allowed import roots) and take
    one attribute of it. Nothing is called and no attribute chain is followed (``"os:environ.clear"`` is
    refused). Errors name ``field``."""
    form = f"{field}: {path!r} is not an import path of the form 'package.module:attr' (one attribute name)"
    if not isinstance(path, str) or path.count(":") != 1:
        raise BadInputError(form)
    module_name, attr = path.split(":")
    if not _MODULE_RE.fullmatch(module_name) or not _ATTR_RE.fullmatch(attr):
        raise BadInputError(form)
    if attr.startswith("__"):
        raise BadInputError(f"{field}: {path!r} names a dunder attribute; name a public callable or value")
    check_import_root(module_name, path, field, roots)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises on import
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
            hint = (
                f"; modules are found among the installed packages and in the working directory ({os.getcwd()}): "
                "run from the folder that holds it (the repository root for examples.*), or set PYTHONPATH"
            )
        raise BadInputError(
            f"{field}: cannot import module {module_name!r} of {path!r} ({type(e).__name__}: {e}){hint}"
        ) from None
    try:
        return inspect.getattr_static(module, attr)
    except AttributeError:
        pass
    try:  # a module-level __getattr__ (PEP 562)
        return getattr(module, attr)
    except AttributeError:
        raise BadInputError(f"{field}: module {module_name!r} has no attribute {attr!r} ({path!r})") from None


def _check_import_path(
    value: str | None, field: str, must_be_callable: bool = True, roots: list[str] | None = None
) -> str | None:
    if value is None:
        return value
    obj = load_object(value, field, roots)
    if must_be_callable and not callable(obj):
        raise BadInputError(f"{field}: {value!r} resolves to a {type(obj).__name__}, which is not callable")
    return value


# ---------------------------------------------------------------------------- checkpoints
def read_manifest(path: str | os.PathLike, field: str = "checkpoints") -> list[str]:
    """Checkpoint paths listed in a train-flow manifest (relative entries are relative to the manifest)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInputError(f"{field}: manifest {str(path)!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise BadInputError(f"{field}: cannot read manifest {str(path)!r} ({type(e).__name__}: {e})") from None
    entries = data.get("checkpoints") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BadInputError(f"{field}: manifest {str(path)!r} has no non-empty 'checkpoints' list")
    out = []
    for i, e in enumerate(entries):
        p = e.get("path") if isinstance(e, dict) else e
        if not isinstance(p, str):
            raise BadInputError(f"{field}: manifest {str(path)!r} entry {i} has no 'path'")
        out.append(str((path.parent / p).resolve()) if not os.path.isabs(p) else p)
    return out


def resolve_checkpoints(spec: str | list[str], field: str = "checkpoints") -> list[str]:
    """Absolute, sorted checkpoint paths from a list, a glob or a manifest; every file must exist."""
    if isinstance(spec, str):
        if spec.endswith(".json"):
            paths = read_manifest(spec, field)
        elif _GLOB_CHARS & set(spec):
            paths = _glob.glob(spec)
            if not paths:
                raise BadInputError(f"{field}: the glob {spec!r} matches no file")
        else:
            paths = [spec]
    else:
        paths = list(spec)
    if not paths:
        raise BadInputError(f"{field}: no checkpoint given")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise BadInputError(
            f"{field}: checkpoint file(s) not found: {missing[:5]}"
            + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        )
    out = sorted(os.path.abspath(p) for p in paths)
    if len(set(out)) != len(out):
        raise BadInputError(f"{field}: the same checkpoint is listed twice")
    return out


def file_fingerprint(path: str) -> str:
    """sha256 of a file (what a store records per model_id, so a different checkpoint is refused)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------- stores
def check_store_location(location: str, field: str = "store") -> None:
    """A local store must be a directory we can create files in (trak_core.store.check_writable: a probe
    directory in the nearest existing ancestor, removed again). URLs other than ``file://`` are checked by
    their first write. Errors name ``field``."""
    loc = str(location)
    if not loc:
        raise BadInputError(f"{field}: empty store location")
    try:
        check_writable(loc)
    except BadInputError as e:
        msg = str(e)
        msg = msg[len("store: ") :] if msg.startswith("store: ") else msg
        raise BadInputError(f"{field}: {msg}") from None


# ---------------------------------------------------------------------------- configs
class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_default=True)

    @field_validator("store", "report_dir", "out_dir", "cache_dir", check_fields=False)
    @classmethod
    def _writable_location(cls, v, info: ValidationInfo):
        """Every folder/store field of the configs: a path or URL that can be created (null: not used)."""
        if v is not None:
            check_store_location(v, info.field_name or "location")
        return v

    @classmethod
    def from_yaml(cls, path: str | os.PathLike):
        """Validate a YAML file (a mapping of field: value)."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise BadInputError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise BadInputError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise BadInputError(f"config file {str(path)!r} must hold a mapping of field: value")
        return cls.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def resolved_device(self) -> str:
        """The config's ``device`` with ``"auto"`` resolved (cuda when available)."""
        return resolve_device(self.device)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _setting(name: str, description: str):
    """A field of trak_core's TrakSettings (its default), described for the form."""
    return Field(TrakSettings.model_fields[name].default, description=description)


class AttributeConfig(_Base):
    """Parameters of the ``attribute`` flow (and of ``featurize``/``finalize``/``score``)."""

    import_roots: list[str] | None = Field(
        None,
        description="modules the import paths below may name (top-level packages or dotted prefixes, e.g. "
        "['examples', 'mypkg']); null: any module, or the deployment's TRAKFLOW_IMPORT_ROOTS, "
        "which this can only narrow. Import paths are code: see README 'Security'",
    )
    model: str = Field(
        description="import path 'pkg.mod:factory' of a zero-argument callable returning the "
        "torch.nn.Module the checkpoints belong to"
    )
    train_data: str = Field(
        description="import path of a zero-argument callable returning a tuple of tensors "
        "(e.g. (inputs, labels)) holding the train examples, one per row"
    )
    target_data: str = Field(description="import path like train_data, for the targets to attribute")
    task: str = Field(
        "image_classification",
        description="model output function: one of "
        + ", ".join(TASK_NAMES)
        + ", or an import path to an AbstractModelOutput subclass or instance",
    )
    checkpoints: list[str] | str = Field(
        description="state_dict files: a list of paths, a glob ('ckpts/*.pt') or a train-flow manifest "
        "('ckpts/manifest.json'); model_id = position in the sorted list"
    )
    store: str = Field(description="Zarr store: local path or fsspec URL")
    exp_name: str = Field("default", description="experiment name (the targets' group in the store)")
    proj_dim: PositiveInt = _setting(
        "proj_dim", "projection dimension; keep it well below the number of train examples"
    )
    projector: ProjectorKind = _setting(
        "projector",
        "'factored' (per-layer Kronecker projection, the default: fastest, see benchmarks/RESULTS.md), "
        "'dense' (counter-RNG JL projection), 'sjlt' (sparse JL), 'noop' (no projection), or any other registered "
        "projector (e.g. 'fast_jl', TRAK's CUDA projector, where cuda_ext and fast_jl are installed)",
    )
    proj_type: ProjType = _setting("proj_type", "'rademacher' (±1) or 'normal' projection entries")
    proj_seed: NonNegativeInt = _setting("proj_seed", "seed of the projection")
    lambda_reg: LambdaSetting = _setting(
        "lambda_reg",
        "ridge term λ in (XᵀX + λI)⁻¹: 'adaptive' (the default, = 'neff:0.12,uresid:10/0.3': per checkpoint the "
        "larger of the λ where the effective dimension of XᵀX is min(0.12·n_eff, rank/2), n_eff the rows' effective "
        "number, and 10 × the shared part of ‖Xᵀq‖²/‖q‖², the implicit ridge of a run stopped before convergence, "
        "× min(1, mean q²/0.3²): in full while the rows are far from fit), a number ≥ 0, 'auto' / 'rel:<f>' (f × the "
        "mean eigenvalue of XᵀX; 'auto' = rel:0.3), 'deff:<c>', 'neff:<c>', 'resid:<k>', 'cresid:<k>', "
        "'uresid:<k>[/<rms>]', or rules joined by ',' (their largest λ)",
    )
    rescale_inverse: bool = _setting("rescale_inverse", "divide (XᵀX + λI)⁻¹ by its mean |entry| (traker 0.3.2)")
    curvature: Curvature = _setting(
        "curvature",
        "H of the inverse (H + λI)⁻¹: 'xtx' (XᵀX, traker's; the default) or 'ggn' (XᵀRX, the Gauss-Newton matrix, "
        "R = diag(Q(1 − Q)), row weights floored at 0.3·mean: +0.020…+0.060 LDS on converged models, "
        "one more p × p partial per shard; "
        "benchmarks/RESULTS.md 'Gauss-Newton curvature'); λ's rule still reads XᵀX, scaled by the traces; "
        "'kfac' / 'ekfac': each Linear layer's Kronecker factors in the factored projection's space (a block-diagonal "
        "H; other layers keep their XᵀX block), summed as the rows are featurized; "
        "'kfac-eigen': those layers projected in their factors' eigenbasis (fitted before the rows), EK-FAC's "
        "diagonal inverse (docs/damping.md)",
    )
    curvature_damping: CurvatureDamping | None = _setting(
        "curvature_damping",
        "'kfac'/'ekfac': λ of each Kronecker block = this × its mean eigenvalue (> 0; default 0.001); 'kfac-eigen': "
        "× its rows' mean second moment (default 0.01); null: the curvature's default",
    )
    curvature_rows: PositiveInt | None = Field(
        None,
        description="'kfac'/'ekfac'/'kfac-eigen': the factors are fitted on this many train rows, evenly spaced, in a "
        "pass before the rows (null: all rows; 'kfac'/'ekfac' then sum them as each shard is featurized)",
    )
    dtype: StorageDtype = _setting("dtype", "storage dtype of gradients")
    batch_size: PositiveInt = Field(64, description="examples per gradient batch")
    max_memory: int | str | None = Field(
        None,
        description="memory budget of a task: bytes or a size like '4GB' / '12GiB'; featurize batches are then "
        "chosen from a measured probe so that the peak (the process's resident memory on the CPU, torch's "
        "allocated memory on a GPU) stays under it, instead of batch_size, and scoring's buffers take a share "
        "of what it leaves; a budget below the model's own need is refused before any row is featurized",
    )
    shard_size: PositiveInt = Field(4096, description="train rows per featurize task (a multiple of chunk_rows)")
    score_task_rows: PositiveInt | None = Field(
        None,
        description="train rows per score task (a multiple of shard_size); null: as many shards as give a task "
        "about 4e11 flops of GEMM, leaving at least 16 tasks and 4 per concurrent task (one shard each on an "
        "existing Dask cluster, whose size the config does not say; trak_core.scoring.streaming.score_task_ranges)",
    )
    chunk_rows: PositiveInt | None = Field(
        None,
        description="Zarr chunk rows; default: as many rows as fit in "
        "32 MiB (at most 1024 and the number of train "
        "examples) dividing shard_size",
    )
    grad_wrt: GradWrt = _setting(
        "grad_wrt", "parameter names to take gradients for (null: the trainable ones, a PEFT model's adapters)"
    )
    processes_per_task: PositiveInt = Field(
        1,
        description="processes that featurize one (checkpoint, shard) together, the model sharded across them with "
        "torch FSDP2 (one per GPU, rank r on cuda:r, nccl; gloo on the CPU); needs projector 'factored' "
        "(docs/scaleout.md 'One model over several GPUs'); 1: one process",
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="'auto' = cuda when available")
    task_runner: Literal["thread", "process", "dask"] = Field(
        "thread",
        description="where tasks run: 'thread' (threads of the flow's process), 'process' (a process "
        "pool; one process per GPU with gpus), 'dask' (prefect-dask: dask_address, or a "
        "local cluster of dask_n_workers processes)",
    )
    max_workers: PositiveInt = Field(
        2, description="concurrent tasks of the thread runner; processes of the process runner without gpus"
    )
    gpus: list[str] | None = Field(
        None,
        description="process runner / local Dask cluster: one worker process "
        "per entry, with CUDA_VISIBLE_DEVICES set to it "
        "(e.g. ['0', '1', '2', '3'])",
    )
    dask_address: str | None = Field(
        None, description="scheduler address of an existing Dask cluster (tcp://host:8786); none: start a local cluster"
    )
    dask_n_workers: PositiveInt = Field(2, description="worker processes of the local Dask cluster")
    dask_threads_per_worker: PositiveInt = Field(1, description="threads per worker of the local Dask cluster")
    top_k: PositiveInt = Field(5, description="proponents/opponents reported per target")
    report_targets: NonNegativeInt = Field(5, description="how many targets the report covers (0: no report)")
    report_dir: str | None = Field(
        None, description="local folder for the report (markdown + PNGs); none: Prefect artifacts only"
    )
    show: str | None = Field(
        None,
        description="import path of a callable(input_row) -> 2-D array (drawn as "
        "an image) or str (drawn as text, e.g. examples.text:decode) "
        "for the report",
    )
    storage_options: dict[str, Any] | None = Field(None, description="fsspec options of a remote store")

    _checkpoint_paths: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _task_runner_fields(self):
        if self.gpus is not None:
            if not self.gpus or any(not str(g).strip() or "," in str(g) for g in self.gpus):
                raise BadInputError(f"gpus: one GPU (index or UUID, no commas) per entry, got {self.gpus!r}")
            if len(set(self.gpus)) != len(self.gpus):
                raise BadInputError(f"gpus: a GPU is listed twice in {self.gpus!r}")
            if self.task_runner == "thread":
                raise BadInputError(
                    "gpus: needs task_runner 'process' or 'dask' (one worker process per GPU); "
                    "the thread runner shares one process"
                )
            if self.dask_address:
                raise BadInputError(
                    "gpus: the workers of an existing Dask cluster (dask_address) are pinned when "
                    "they are started (CUDA_VISIBLE_DEVICES=i dask worker ...); remove gpus"
                )
        if self.dask_address is not None:
            if self.task_runner != "dask":
                raise BadInputError(f"dask_address: needs task_runner 'dask', not {self.task_runner!r}")
            import re

            if not re.fullmatch(r"([a-z][a-z0-9+.-]*://)?[^\s/]+:\d+", self.dask_address.strip()):
                raise BadInputError(
                    f"dask_address: {self.dask_address!r} is not a scheduler address like 'tcp://10.0.0.5:8786'"
                )
        if self.task_runner != "thread" and str(self.store).startswith("memory://"):
            raise BadInputError(
                f"store: {self.store!r} lives in the memory of one process; the workers of the "
                f"{self.task_runner!r} runner would each see their own empty store. Use a path, a "
                "file:// URL or shared storage (s3://...), or task_runner 'thread'"
            )
        return self

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, v):
        from trak_core.featurize.budget import parse_bytes

        return parse_bytes(v, "max_memory")

    @field_validator("import_roots")
    @classmethod
    def _import_roots(cls, v):
        return _parse_roots(v)

    @field_validator("model", "train_data", "target_data")
    @classmethod
    def _import_paths(cls, v, info):
        return _check_import_path(
            v, info.field_name, must_be_callable=info.field_name == "model", roots=info.data.get("import_roots")
        )

    @field_validator("show")
    @classmethod
    def _show(cls, v, info):
        return _check_import_path(v, info.field_name, roots=info.data.get("import_roots"))

    @field_validator("task")
    @classmethod
    def _task(cls, v, info):
        if v in TASK_NAMES:
            return v
        if ":" not in v:
            raise BadInputError(
                f"task: unknown task {v!r}; use one of {list(TASK_NAMES)} or an import path 'pkg.mod:ModelOutput'"
            )
        from trak_core.featurize.modelout import AbstractModelOutput

        obj = load_object(v, "task", info.data.get("import_roots"))
        ok = isinstance(obj, AbstractModelOutput) or (isinstance(obj, type) and issubclass(obj, AbstractModelOutput))
        if not ok:
            raise BadInputError(f"task: {v!r} is not an AbstractModelOutput subclass or instance")
        return v

    @field_validator("exp_name")
    @classmethod
    def _exp_name(cls, v):
        check_exp_name(v, "exp_name")
        return v

    @model_validator(mode="after")
    def _device_available(self):
        if self.device == "cuda" and not self.dask_address:  # an existing cluster's workers may have GPUs
            import torch

            if not torch.cuda.is_available():
                raise BadInputError(
                    "device: 'cuda' but CUDA is not available in this process "
                    "(torch.cuda.is_available() is False); use 'cpu' or 'auto'"
                )
        return self

    @model_validator(mode="after")
    def _cross_fields(self):
        if self.chunk_rows is not None and self.shard_size % self.chunk_rows:
            raise BadInputError(
                f"chunk_rows: {self.chunk_rows} must divide shard_size={self.shard_size} "
                "(each featurize task must own whole chunks)"
            )
        if self.score_task_rows is not None and self.score_task_rows % self.shard_size:
            raise BadInputError(
                f"score_task_rows: {self.score_task_rows} must be a multiple of shard_size={self.shard_size} "
                "(each score task scores whole shards)"
            )
        if self.processes_per_task > 1 and self.projector != "factored":
            from trak_core.featurize.sharded import VMAP_REFUSAL

            raise BadInputError(VMAP_REFUSAL.format(kind=self.projector))
        if self.curvature in KFAC_CURVATURES and self.projector != "factored":
            raise BadInputError(
                f"curvature={self.curvature!r} needs the factored projector (its blocks are the layers that the "
                f"Kronecker factors curve), not projector={self.projector!r}"
            )
        if self.processes_per_task > 1 and self.curvature in KFAC_CURVATURES:
            raise BadInputError(
                f"curvature={self.curvature!r}: Kronecker-factored curvature is not supported with "
                f"processes_per_task={self.processes_per_task} (model-parallel featurizing); use 1, or 'xtx' / 'ggn'"
            )
        self._checkpoint_paths = resolve_checkpoints(self.checkpoints, "checkpoints")
        return self

    # -------------------------------------------------------------- derived values
    @property
    def checkpoint_paths(self) -> list[str]:
        """Sorted absolute checkpoint paths; ``model_id`` is the index in this list."""
        if not self._checkpoint_paths:
            self._checkpoint_paths = resolve_checkpoints(self.checkpoints, "checkpoints")
        return list(self._checkpoint_paths)

    @property
    def settings(self) -> TrakSettings:
        """The algorithm's settings of this config (what trak_core needs)."""
        return TrakSettings(**{k: getattr(self, k) for k in TrakSettings.model_fields})

    @property
    def task_slots(self) -> int | None:
        """Tasks the configured runner executes at once; None on an existing Dask cluster (``dask_address``),
        whose size the config does not say."""
        if self.task_runner == "thread":
            return self.max_workers
        if self.task_runner == "process":
            return len(self.gpus) if self.gpus else self.max_workers
        if self.dask_address:
            return None
        return (len(self.gpus) if self.gpus else self.dask_n_workers) * self.dask_threads_per_worker

    @property
    def effective_chunk_rows(self) -> int:
        """``chunk_rows``, or the most rows a chunk may have (the store also bounds a chunk in bytes:
        trak_core.store.choose_chunk_rows, recorded in its metadata)."""
        if self.chunk_rows is not None:
            return self.chunk_rows
        c = min(1024, self.shard_size)
        return c if self.shard_size % c == 0 else self.shard_size

    def build_model(self):
        import torch

        model = load_object(self.model, "model", self.import_roots)()
        if not isinstance(model, torch.nn.Module):
            raise BadInputError(f"model: {self.model!r} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def build_task(self):
        from trak_core.featurize.modelout import TASK_TO_MODELOUT, AbstractModelOutput

        if self.task in TASK_TO_MODELOUT:
            return TASK_TO_MODELOUT[self.task]()
        obj = load_object(self.task, "task", self.import_roots)
        return obj if isinstance(obj, AbstractModelOutput) else obj()

    def load_train(self) -> tuple:
        return load_data(self.train_data, "train_data", self.import_roots)

    def load_targets(self) -> tuple:
        return load_data(self.target_data, "target_data", self.import_roots)


def load_data(path: str, field: str, roots: list[str] | None = None) -> tuple:
    """Call the data import path and check the convention (a tuple of tensors with equal rows)."""
    import torch

    obj = load_object(path, field, roots)
    data = obj() if callable(obj) else obj
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple) or not data or not all(isinstance(t, torch.Tensor) for t in data):
        raise BadInputError(
            f"{field}: {path!r} must return a non-empty tuple of tensors (e.g. (inputs, labels)), "
            f"got {type(data).__name__}"
        )
    rows = {t.shape[0] if t.dim() else None for t in data}
    if len(rows) != 1 or None in rows:
        raise BadInputError(
            f"{field}: the tensors returned by {path!r} have different numbers of rows {[tuple(t.shape) for t in data]}"
        )
    if next(iter(rows)) == 0:
        raise BadInputError(f"{field}: {path!r} returned no rows")
    return data


class TrainConfig(_Base):
    """Parameters of the ``train`` flow: N checkpoints of one model on (subsets of) one data set."""

    model: str = Field(description="import path of a zero-argument callable returning the torch.nn.Module")
    train_data: str = Field(description="import path of a callable returning (inputs, labels) tensors")
    out_dir: str = Field(description="folder for model_XXX.pt, their JSON records, plots and manifest.json")
    num_models: PositiveInt = Field(3, description="how many checkpoints to train")
    seeds: list[NonNegativeInt] | None = Field(None, description="one seed per model (default 0..N-1)")
    subset_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="each model trains on a random subset of this fraction of rows"
    )
    epochs: PositiveInt = 10
    batch_size: PositiveInt = 64
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.1, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: NonNegativeFloat = 0.0
    alpha_every: NonNegativeInt = Field(5, description="track cockpit's α every k steps (0: off)")
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    task_runner: Literal["thread"] = Field("thread", description="Prefect task runner")
    max_workers: PositiveInt = Field(2, description="models trained concurrently")
    overwrite: bool = Field(False, description="retrain models whose checkpoint already exists")
    snapshots: list[float] = Field(
        default_factory=lambda: [1.0],
        description="fractions of each run's optimizer steps after which its state is also saved as a checkpoint "
        "of its own (listed in manifest.json, so attribute and evaluate use them all); in (0, 1] and including 1.0, "
        "the end of the run. [0.625, 0.75, 0.875, 1.0] raised LDS at the same training cost by +0.006 to +0.088 on "
        "the nine small evaluation cases (`benchmarks/past_trak.py`, in the git history, with an earlier factored "
        "layout and damping rule), at 4x the featurize and scoring time",
    )

    @property
    def task_slots(self) -> int:
        """Models trained at once (the runner's threads or processes: ``max_workers``)."""
        return self.max_workers

    @field_validator("model")
    @classmethod
    def _model(cls, v):
        return _check_import_path(v, "model")

    @field_validator("train_data")
    @classmethod
    def _data(cls, v):
        return _check_import_path(v, "train_data", must_be_callable=False)

    @field_validator("snapshots")
    @classmethod
    def _snapshots(cls, v):
        bad = [f for f in v if not 0.0 < f <= 1.0]
        if bad or 1.0 not in v:
            raise BadInputError(
                f"snapshots: {v}: every fraction must be in (0, 1] and 1.0 (the end of the run) must be one of them"
            )
        return sorted(set(v))

    @model_validator(mode="after")
    def _seeds(self):
        if self.seeds is not None and len(self.seeds) != self.num_models:
            raise BadInputError(f"seeds: {len(self.seeds)} seeds for num_models={self.num_models}")
        return self

    def model_seeds(self) -> list[int]:
        return list(self.seeds) if self.seeds is not None else list(range(self.num_models))


class EvaluateConfig(_Base):
    """Parameters of the ``evaluate`` flow: the counterfactual LDS of an experiment's scores.

    The experiment is ``attribute`` (its store, exp_name, model, data and task); with ``run_attribute`` the
    attribute flow runs first (it skips what the store already holds). The ground truth is
    ``num_subsets`` models trained with the recipe below on random subsets of ``subset_fraction`` of the
    train rows (``seeds_per_subset`` inits each, margins averaged), and their margins on the targets.
    It is cached under ``cache_dir``, keyed by the data (import paths and content fingerprints), the model,
    the recipe, the fraction and the seeds; a re-run trains nothing, and a larger ``num_subsets`` trains
    only the new subsets.
    """

    attribute: AttributeConfig = Field(
        description="the experiment to evaluate (an AttributeConfig, or the path of its YAML file)"
    )
    run_attribute: bool = Field(True, description="run the attribute flow first (it skips complete work)")
    num_subsets: PositiveInt = Field(32, description="M: counterfactual models (random train subsets)")
    subset_fraction: float = Field(0.5, gt=0.0, lt=1.0, description="each subset holds this fraction of the rows")
    seeds_per_subset: PositiveInt = Field(1, description="models (inits) per subset; their margins are averaged")
    subset_seed: NonNegativeInt = Field(0, description="seed of the subset draws")
    model_seed: NonNegativeInt = Field(
        1000, description="model (s, r) is initialized with seed model_seed + s * seeds_per_subset + r"
    )
    recipe_from: str | None = Field(
        None,
        description="a train-flow manifest.json or TrainConfig YAML whose "
        "recipe (epochs, batch_size, optimizer, lr, momentum, "
        "weight_decay) the subset models use; fields set here win",
    )
    epochs: PositiveInt = 10
    batch_size: PositiveInt = 64
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.1, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: NonNegativeFloat = 0.0
    cache_dir: str = Field(
        "trakflow_lds_cache",
        description="folder of the ground truth (margins of the subset models), reused across runs",
    )
    report_dir: str | None = Field(None, description="folder for the LDS report (markdown + histogram PNG)")
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    task_runner: Literal["thread", "process"] = Field("thread", description="where the subset models train")
    max_workers: PositiveInt = Field(2, description="subset models trained concurrently")

    @property
    def task_slots(self) -> int:
        """Subset models trained at once (the runner's threads or processes: ``max_workers``)."""
        return self.max_workers

    @field_validator("attribute", mode="before")
    @classmethod
    def _attribute(cls, v):
        if isinstance(v, (str, os.PathLike)):
            return AttributeConfig.from_yaml(v)
        return v

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data):
        """Fill the recipe fields not given from ``recipe_from`` (a train manifest or TrainConfig YAML)."""
        if not isinstance(data, dict) or not data.get("recipe_from"):
            return data
        src = str(data["recipe_from"])
        path = Path(src)
        try:
            raw = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise BadInputError(f"recipe_from: {src!r} does not exist") from None
        except (OSError, ValueError, yaml.YAMLError) as e:
            raise BadInputError(f"recipe_from: cannot read {src!r} ({type(e).__name__}: {e})") from None
        recipe = raw.get("config", raw) if isinstance(raw, dict) else None
        if not isinstance(recipe, dict) or "epochs" not in recipe:
            raise BadInputError(f"recipe_from: {src!r} is neither a train-flow manifest nor a TrainConfig YAML")
        out = dict(data)
        for key in ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay"):
            if key in recipe and key not in out:
                out[key] = recipe[key]
        return out

    @model_validator(mode="after")
    def _classifier_task(self):
        """The ground truth is a classifier's margins on its targets, from subset models trained as classifiers: a
        causal language model (whose output is a text's log-odds) is refused before anything is trained."""
        task = self.attribute.task
        lm = task == "causal_lm"
        if not lm and ":" in task:
            from trak_core.featurize.modelout import CausalLMModelOutput

            obj = load_object(task, "task", self.attribute.import_roots)
            cls = obj if isinstance(obj, type) else type(obj)
            lm = issubclass(cls, CausalLMModelOutput)
        if lm:
            raise BadInputError(
                f"attribute.task: evaluate trains classifiers and scores their margins; {task!r} is a causal language "
                "model, whose ground truth (each target text's log-odds) it does not compute"
            )
        return self

    def recipe(self) -> dict:
        """The training recipe of the subset models."""
        return {k: getattr(self, k) for k in ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay")}
