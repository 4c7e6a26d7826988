"""The algorithm's own settings: projector, projection dimension/seed/type, the λ rule, rescaling of the
inverse, storage dtype and which parameters to take gradients for. Nothing about where or how it runs
(that is the pipeline's configuration, ``tasks.config``, whose ``AttributeConfig.settings`` produces one).

The field types are defined once here and used by both :class:`TrakSettings` and the pipeline's config,
so a setting is validated the same way wherever it is given.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from trak_core.projection.projectors import load_projector_plugins, registered_projectors
from trak_core.solve.damping import LambdaRule, parse_lambda_reg

from .errors import BadInputError

ProjType = Literal["rademacher", "normal"]
StorageDtype = Literal["float16", "float32"]
Curvature = Literal["xtx", "ggn", "kfac", "ekfac", "kfac-eigen"]
#: 'kfac'/'ekfac'/'kfac-eigen': the Kronecker blocks' damping (a finite number > 0; None: the curvature's default)
CurvatureDamping = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def normalize_lambda_reg(value: float | str) -> float | str:
    """A lambda_reg setting in its normalized form (a float, ``"auto"``, ``"rel:<f>"``, ``"deff:<c>"``,
    ``"resid:<k>"`` or such parts joined by ``","``; ``"adaptive"`` becomes its parts); errors name it."""
    try:
        return parse_lambda_reg(value).setting
    except ValueError as e:
        raise BadInputError(f"lambda_reg: {e}") from None


def check_projector_kind(kind: str) -> str:
    """``kind`` when a projector of that name is registered (trak_core's own, those registered on import, the
    ``trakflow.projectors`` entry points); else an error listing the registered kinds."""
    if kind not in registered_projectors():
        load_projector_plugins()
    if kind not in registered_projectors():
        raise BadInputError(f"projector: unknown kind {kind!r}; registered: {', '.join(registered_projectors())}")
    return kind


def check_grad_wrt(value: list[str] | None) -> list[str] | None:
    if value is not None and not value:
        raise BadInputError("grad_wrt: an empty list selects no parameter; use null for the trainable parameters")
    return value


#: the name of a registered projector (trak_core.projection.projectors.register_projector), e.g. ``"factored"`` or
#: ``"fast_jl"``
ProjectorKind = Annotated[str, AfterValidator(check_projector_kind)]
#: a number ≥ 0, ``"auto"``, ``"rel:<f>"``, ``"adaptive"``, ``"deff:<c>"``, ``"resid:<k>"`` or parts joined by ``","``
#: (trak_core.solve.damping.parse_lambda_reg)
LambdaSetting = Annotated[NonNegativeFloat | str, AfterValidator(normalize_lambda_reg)]
#: parameter names to take gradients for; None: all parameters
GradWrt = Annotated[list[str] | None, AfterValidator(check_grad_wrt)]


class TrakSettings(BaseModel):
    """What the algorithm needs to know, and nothing else (frozen)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    projector: ProjectorKind = Field("factored", description="JL projection kind")
    proj_dim: PositiveInt = Field(512, description="projection dimension")
    proj_type: ProjType = "rademacher"
    proj_seed: NonNegativeInt = 0
    lambda_reg: LambdaSetting = Field("adaptive", description="ridge term λ in (XᵀX + λI)⁻¹")
    rescale_inverse: bool = Field(True, description="divide (XᵀX + λI)⁻¹ by its mean |entry| (traker 0.3.2)")
    dtype: StorageDtype = Field("float16", description="storage dtype of gradients")
    curvature: Curvature = Field(
        "xtx",
        description="H of (H + λI)⁻¹: 'xtx' (XᵀX, traker's) or 'ggn' (XᵀRX); 'kfac' / 'ekfac': per-layer Kronecker "
        "factors in the factored projection's space, a block-diagonal H; 'kfac-eigen': those layers projected in "
        "their factors' eigenbasis, EK-FAC's diagonal inverse (docs/damping.md)",
    )
    curvature_damping: CurvatureDamping | None = Field(
        None,
        description="'kfac'/'ekfac': each Kronecker block's λ = this × its mean eigenvalue (default 0.001); "
        "'kfac-eigen': × its rows' mean second moment (default 0.01); null: the curvature's default",
    )
    grad_wrt: GradWrt = Field(
        None, description="parameter names to take gradients for (None: the trainable ones, a PEFT model's adapters)"
    )

    @property
    def lambda_rule(self) -> LambdaRule:
        return parse_lambda_reg(self.lambda_reg)


__all__ = [
    "TrakSettings",
    "ProjectorKind",
    "ProjType",
    "StorageDtype",
    "Curvature",
    "CurvatureDamping",
    "LambdaSetting",
    "GradWrt",
    "normalize_lambda_reg",
    "check_projector_kind",
    "check_grad_wrt",
]
