"""Prefect flows that read like the DAG: train → featurize → finalize → score (→ report) = attribute;
evaluate = attribute + counterfactual LDS.

    from flows import attribute, train
    attribute(config)            # an AttributeConfig or a dict of its fields
"""

from flows.attribute import attribute
from flows.demo import digits_demo
from flows.evaluate import evaluate
from flows.featurize import featurize
from flows.finalize import finalize
from flows.score import score
from flows.train import train

__all__ = ["attribute", "digits_demo", "evaluate", "featurize", "finalize", "score", "train"]
