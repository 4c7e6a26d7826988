"""Prefect flows that read like the DAG: train → featurize → finalize → score (→ report) = attribute.

    from flows import attribute, train
    attribute(config)            # an AttributeConfig or a dict of its fields
"""

from .attribute import attribute
from .featurize import featurize
from .finalize import finalize
from .score import score
from .train import train

__all__ = ["attribute", "featurize", "finalize", "score", "train"]
